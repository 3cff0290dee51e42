"""``nanrunbook prove``: resume from a recovery point, run the incident step with
one change and N more steps under the sentinel, and write the recovery record."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import IO, Annotated

import typer

from nanrunbook.cli.app import CheckFormat, command, guarded, non_empty_path

__all__ = ["prove", "prove_and_emit"]


@command(
    "Resume from a recovery point, run the incident step with a change and N more steps:"
    " exit 0 proven, 1 not, 3 rejected."
)
@guarded
def prove(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH", parser=non_empty_path, help="The recovery point.", show_default=False
        ),
    ],
    entry: Annotated[
        str,
        typer.Option(
            "--entry", help="module:function that builds the run (see man 1).", show_default=False
        ),
    ],
    through: Annotated[
        int, typer.Option("--through", min=1, help="The incident step.", show_default=False)
    ],
    incident: Annotated[
        Path,
        typer.Option(
            "--incident",
            parser=non_empty_path,
            help="The incident step's bundle.",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            parser=non_empty_path,
            help="A new directory for the record, telemetry and bundles.",
            show_default=False,
        ),
    ],
    then: Annotated[
        int, typer.Option("--then", min=0, help="Steps to run after the incident step.")
    ] = 10,
    change: Annotated[
        list[str] | None,
        typer.Option(
            "--change", help="MECHANISM=VALUE: lr-factor=0.5, loss-scale=1024, autocast=off."
        ),
    ] = None,
    max_warnings: Annotated[
        int, typer.Option("--max-warnings", min=0, help="Warnings allowed after the incident step.")
    ] = 0,
    format: Annotated[
        CheckFormat, typer.Option("--format", "-f", help="Output format.")
    ] = CheckFormat.text,
) -> None:
    """Resume from a recovery point, run the incident step with a change and N more steps.

    Verifies the point, builds the run with --entry, restores it bit for bit,
    runs the steps before the incident as they were, the incident step with
    the change (at most one) and --then more steps under the sentinel; the
    incident step's new bundle must check CONTINUE and diff against --incident
    as ONE_MECHANISM_CHANGED, FIXED. Writes OUT/recovery.json. Exit 0 proven,
    1 not proven, 3 evidence rejected. Reopening the run stays a person's
    decision: the record names who makes it.

    Example: nanrunbook prove points/step-6 --entry train:build --through 8 --then 4 --incident incident/run/8 --out proof --change lr-factor=0.5
    """
    raise typer.Exit(
        prove_and_emit(
            path,
            entry=entry,
            through=through,
            then=then,
            incident=incident,
            out=out,
            changes=change or [],
            max_warnings=max_warnings,
            fmt=format.value,
            stream=sys.stdout,
        )
    )


def prove_and_emit(
    path: Path,
    *,
    entry: str,
    through: int,
    then: int,
    incident: Path,
    out: Path,
    changes: list[str],
    max_warnings: int,
    fmt: str,
    stream: IO[str],
) -> int:
    """Prove, write the record in ``fmt`` to ``stream``; the exit code."""
    from nanrunbook.capture.torch.recovery import EntryError, prove_recovery
    from nanrunbook.capture.torch.recovery._entry import load_entry, parse_change
    from nanrunbook.cli._judging import emit
    from nanrunbook.errors import EvidenceRejected
    from nanrunbook.exits import Exit
    from nanrunbook.output.renderers import RENDERERS

    try:
        if len(changes) > 1:
            raise EntryError("one --change at a time: a proof changes one mechanism")
        change = parse_change(changes[0]) if changes else None
        if out.exists():
            raise EntryError(f"--out {out} exists: the record goes into a new directory")
        record = prove_recovery(
            path,
            incident,
            build=load_entry(entry),
            through=through,
            then=then,
            change=change,
            out=out,
            max_warnings=max_warnings,
        )
    except EntryError as error:
        raise typer.BadParameter(str(error)) from None
    except EvidenceRejected as error:
        sys.stderr.write(f"nanrunbook: prove: {error.message}\n")
        for violation in error.violations:
            sys.stderr.write(f"nanrunbook:   {violation}\n")
        return int(Exit.REJECTED)
    emit(functools.partial(RENDERERS[fmt].recovery_record, record, stream), stream)
    return int(Exit.CONTINUE if record.proven else Exit.HOLD)
