"""``nanrunbook seal``: fill and verify a foreign manifest's digests, then check it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, Annotated

import typer

from nanrunbook.cli.app import BundleArgument, CheckFormat, command, guarded

__all__ = ["seal", "seal_and_judge"]


@command("Fill and verify the tensor digests and content id of a manifest, then check it.")
@guarded
def seal(
    bundle: BundleArgument,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a sha256 or content id that differs.")
    ] = False,
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format of the check.")
    ] = CheckFormat.text,
) -> None:
    """Fill and verify the tensor digests and content id of a manifest, then check it.

    Example: nanrunbook seal bundle/ --format kv
    """
    raise typer.Exit(
        seal_and_judge(bundle, force=force, format=format.value, out=sys.stdout, err=sys.stderr)
    )


def seal_and_judge(bundle: Path, *, force: bool, format: str, out: IO[str], err: IO[str]) -> int:
    """Seal, then check; returns the exit code (0, 1 or 3).

    A refused seal is a rejection: one line on ``err`` and, in kv and json, the
    rejection on ``out`` as ``check`` prints it (kv readers get ``decision=REJECTED``). After a seal,
    its summary goes to ``err`` and the check's verdict to ``out``.
    """
    from nanrunbook.capture.seal import seal_bundle
    from nanrunbook.cli._judging import emit_rejection, judge
    from nanrunbook.errors import EvidenceRejected

    try:
        result = seal_bundle(bundle, force=force)
    except EvidenceRejected as error:
        hint = ""
        if "SEAL_VALUE_DIFFERS" in error.codes:
            hint = "; nothing written (--force replaces the recorded values, which then no longer stand)"
        err.write(f"nanrunbook: seal refused: {error.summary}{hint}\n")
        if format == "text":  # the line above is the whole text answer
            return error.exit_code
        return emit_rejection(error, bundle, format, out)
    if result.replacements:
        err.write(
            "nanrunbook: WARNING: --force overwrote recorded values: the original evidence"
            " did not verify\n"
        )
        for replaced in result.replacements:
            err.write(
                f"nanrunbook:   {replaced.where}: recorded {replaced.recorded},"
                f" now {replaced.computed}\n"
            )
    err.write(f"nanrunbook: {result.summary(str(bundle))}\n")
    return judge(bundle, format, out)
