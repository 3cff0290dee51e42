"""``nanrunbook merge``: one incident set's verdict from reports checked on several nodes."""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from nanrunbook.cli.app import (
    CheckFormat,
    FormatOption,
    command,
    guarded,
    path_argument,
)
from nanrunbook.exits import Exit

__all__ = ["merge"]

ReportsArgument = Annotated[
    list[Path],
    path_argument("REPORT", "Files written by nanrunbook check --format json on each node."),
]


@command("Merge per-node check --format json reports into one incident set's verdict.")
@guarded
def merge(
    reports: ReportsArgument,
    format: FormatOption = CheckFormat.text,
) -> None:
    """Merge per-node check --format json reports into one incident set's verdict.

    Each node checks the rank bundles on its own disk (launched by the job's own
    launcher: srun, torchrun, mpirun, pdsh) and writes its report; merge judges the
    members they hold as one incident set, exactly as check would on one disk: HOLD
    (exit 1), CONTINUE (exit 0) or rejected (exit 3). Reports of another contract,
    run or step, or a rank seen twice, reject the set; a report that cannot be read
    counts as a rejected member that declares no rank.

    Example: nanrunbook merge reports/node-0.json reports/node-1.json --format kv
    """
    from nanrunbook.cli._judging import emit
    from nanrunbook.output.renderers import RENDERERS
    from nanrunbook.verdict.merge import merge_reports

    if format is not CheckFormat.json:
        result = merge_reports(reports, keep_reports=False)
        emit(
            functools.partial(RENDERERS[format.value].incident_set, result, sys.stdout), sys.stdout
        )
        raise typer.Exit(result.exit_code)
    from nanrunbook.output.json import MemberSpool

    # A JSON answer prints every member's whole report: each is spooled to a
    # temporary file as it is folded and let go, and copied out once the set is judged.
    try:
        spool = MemberSpool()
    except OSError as error:
        _unspooled(error)
    with spool:
        try:
            result = merge_reports(reports, keep_reports=False, folded=spool.add)
        except OSError as error:  # the reports' own are answered as rejected members
            _unspooled(error)
        emit(functools.partial(spool.write, result, sys.stdout), sys.stdout)
    raise typer.Exit(result.exit_code)


def _unspooled(error: OSError) -> NoReturn:
    """The temporary file a JSON answer spools its members to cannot be written."""
    sys.stderr.write(
        f"nanrunbook merge: cannot spool the members' reports in {tempfile.gettempdir()}"
        f" (TMPDIR): {error.strerror or error}\n"
    )
    raise typer.Exit(Exit.USAGE)
