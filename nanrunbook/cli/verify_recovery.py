"""``nanrunbook verify-recovery``: is a directory a recovery point, every file as written?"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import IO, Annotated

import typer

from nanrunbook.cli.app import (
    CheckFormat,
    FormatOption,
    command,
    guarded,
    path_argument,
)

__all__ = ["verify_and_emit", "verify_recovery"]

PointArgument = Annotated[Path, path_argument("PATH", "The recovery point directory.")]


@command("Re-read every file of a recovery point and check its manifest: exit 0 verified, 3 not.")
@guarded
def verify_recovery(
    path: PointArgument,
    format: FormatOption = CheckFormat.text,
) -> None:
    """Re-read every file of a recovery point and check its manifest: exit 0 verified, 3 not.

    Every file's SHA-256 and size against the manifest, no file missing or
    unlisted, no symlink, all parts (model, optimizer, scheduler, scaler,
    data_position, rng) saved at one step, DCP's metadata present and naming
    only DCP's records. Nothing is unpickled. Every violation is listed.

    Example: nanrunbook verify-recovery points/step-400 --format kv
    """
    raise typer.Exit(verify_and_emit(path, format.value, sys.stdout))


def verify_and_emit(path: Path, fmt: str, out: IO[str]) -> int:
    """Verify ``path``, write the answer in ``fmt`` to ``out``; the exit code."""
    from nanrunbook.capture.recovery import verify_recovery_point
    from nanrunbook.cli._judging import emit
    from nanrunbook.exits import Exit
    from nanrunbook.output.progress import check_progress
    from nanrunbook.output.renderers import RENDERERS

    with check_progress(fmt == "text") as bar:  # a bar on stderr at a terminal, text only
        verification = verify_recovery_point(path, progress=bar)
    emit(functools.partial(RENDERERS[fmt].recovery_verification, verification, out), out)
    return int(Exit.CONTINUE if verification.verified else Exit.REJECTED)
