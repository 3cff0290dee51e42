"""What every example prints once its bundle is written: the check's verdict."""

from __future__ import annotations

from pathlib import Path

import nanrunbook


USAGE_ERROR = 2  # the exit code of a bad --out, as argparse's own usage errors


def refused_out(out: Path | None, *, new: bool = True) -> str | None:
    """Why ``--out`` cannot be written (one line), or None: its directory must
    exist, and a bundle's path (``new``) must not."""
    if out is None:
        return None
    if not out.parent.is_dir():
        return f"--out {out}: the directory {out.parent} does not exist"
    if new and (out.exists() or out.is_symlink()):
        return f"--out {out}: exists; give a new path for the bundle"
    return None


def report(bundle: Path) -> int:
    """Check ``bundle``, print the verdict as key=value lines, return the exit code."""
    try:
        result = nanrunbook.check_bundle(bundle)
    except nanrunbook.EvidenceRejected as error:
        print(f"bundle {bundle}: {error}")
        return error.exit_code
    decision = result.decision
    print(f"bundle: {bundle}")
    print(f"decision={decision.decision}")
    print(f"earliest_nonfinite={decision.earliest_nonfinite_stage or 'none'}")
    print(f"first_nonfinite_tensor={decision.first_nonfinite_tensor}")
    print(f"action={decision.action}")
    scaler = result.manifest.binding.scaler
    if scaler.mode == "dynamic":
        print(
            f"scaler: found_inf={scaler.found_inf} step_skipped={scaler.step_skipped}"
            f" scale {scaler.scale} -> {scaler.scale_after}"
        )
    print(f"see: nanrunbook check {bundle}")
    return result.exit_code
