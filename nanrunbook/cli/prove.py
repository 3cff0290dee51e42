"""``nanrunbook prove``: resume from a recovery point, run the incident step with
one change and N more steps under the sentinel, and write the recovery record."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import IO, Annotated

import typer

from nanrunbook.cli.app import (
    CheckFormat,
    FormatOption,
    change_option,
    command,
    guarded,
    path_argument,
    path_option,
    usage_error,
)

__all__ = ["prove", "prove_and_emit"]


@command(
    "Resume from a recovery point, run the incident step with a change and N more steps:"
    " exit 0 proven, 1 not, 3 rejected."
)
@guarded
def prove(
    path: Annotated[
        Path,
        path_argument("PATH", "The recovery point."),
    ],
    entry: Annotated[
        str,
        typer.Option(
            "--entry",
            metavar="MODULE:FUNCTION",
            help="Builds the run's objects, as for replay, with its loader (see man 1);"
            " MODULE is found from the current directory first.",
            show_default=False,
        ),
    ],
    through: Annotated[
        int,
        typer.Option(
            "--through", metavar="STEP", min=1, help="The incident step.", show_default=False
        ),
    ],
    then: Annotated[
        int,
        typer.Option("--then", metavar="N", min=0, help="Steps to run after the incident step."),
    ] = 10,
    change: Annotated[
        list[str] | None,
        change_option(
            "One change, as for replay, made to the run from the incident step on"
            " (batch: that step's batch alone): precision, loss_scale, lr, lr_factor,"
            " eps, clip, reduction, batch, deterministic."
        ),
    ] = None,
    incident: Annotated[
        Path | None,
        path_option(
            "--incident", "BUNDLE", "The incident step's bundle [default: incident/RUN_ID/STEP]."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        path_option("--out", "DIR", "A new directory for the record [default: recovery-STEP]."),
    ] = None,
    max_warnings: Annotated[
        int,
        typer.Option(
            "--max-warnings", metavar="N", min=0, help="Warnings allowed after the incident step."
        ),
    ] = 0,
    format: FormatOption = CheckFormat.text,
) -> None:
    """Resume from a recovery point, run the incident step with a change and N more steps.

    Verifies the point, builds the run with --entry, restores it bit for bit,
    runs the steps before the incident as they were, the incident step with
    the change (at most one) and --then more steps under the sentinel; the
    incident step's new bundle must check CONTINUE and diff against --incident
    as ONE_MECHANISM_CHANGED, FIXED. Writes OUT/recovery.json. Exit 0 proven,
    1 not proven, 3 evidence rejected. Reopening the run stays a person's
    decision: the record names who makes it.

    Example: nanrunbook prove points/step-6 --entry train:build --through 8
    """
    raise typer.Exit(
        prove_and_emit(
            path,
            entry=entry,
            through=through,
            then=then,
            incident=incident if incident is not None else _incident_of(path, through),
            out=out if out is not None else Path(f"recovery-{through}"),
            changes=change or [],
            max_warnings=max_warnings,
            fmt=format.value,
            stream=sys.stdout,
        )
    )


def _incident_of(point: Path, through: int) -> Path:
    """The sentinel's bundle of step ``through`` of the point's run, below
    ``incident/`` (its default incident directory)."""
    from nanrunbook import strictjson
    from nanrunbook.errors import EvidenceRejected

    try:
        header = strictjson.load_manifest_bytes((point / "manifest.json").read_bytes())["header"]
        run_id = str(header["run_id"])
    except (OSError, EvidenceRejected, KeyError, TypeError):
        run_id = "unknown-run"  # the point is refused before this path is read
    return Path("incident") / run_id / str(through)


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
    from nanrunbook.capture.torch._entry import EntryError, build, load_entry, parse_changes
    from nanrunbook.capture.torch.recovery import prove_recovery
    from nanrunbook.cli._judging import emit
    from nanrunbook.errors import EvidenceRejected
    from nanrunbook.exits import Exit
    from nanrunbook.output.renderers import RENDERERS

    try:
        parsed = parse_changes(changes)
        if len(parsed) > 1:
            raise EntryError("one --change at a time: a proof changes one mechanism")
        change = parsed[0] if parsed else None
        if out.exists():
            raise EntryError(f"--out {out} exists: the record goes into a new directory")
        record = prove_recovery(
            path,
            incident,
            build=lambda: build(load_entry(entry)),  # imported once the evidence is verified
            through=through,
            then=then,
            change=change,
            out=out,
            max_warnings=max_warnings,
        )
    except EntryError as error:
        usage_error("prove", str(error))
    except EvidenceRejected as error:
        sys.stderr.write(f"nanrunbook: prove: {error.message}\n")
        for violation in error.violations:
            sys.stderr.write(f"nanrunbook:   {violation}\n")
        return int(Exit.REJECTED)
    emit(functools.partial(RENDERERS[fmt].recovery_record, record, stream), stream)
    return int(Exit.CONTINUE if record.proven else Exit.HOLD)
