"""What every example prints once its bundle is written: the check's verdict."""

from __future__ import annotations

from pathlib import Path

import nanrunbook


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
