"""``nanrunbook replay``: run a held step again from its capsule, after the training
process is gone, as recorded and with one mechanism changed per ``--change``."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

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

__all__ = ["replay"]


@command("Replay a held step from its capsule, as recorded and with one mechanism changed.")
@guarded
def replay(
    capsule: Annotated[
        Path,
        path_argument("CAPSULE", "The capsule directory (a held bundle's capsule/)."),
    ],
    entry: Annotated[
        str,
        typer.Option(
            "--entry",
            metavar="MODULE:FUNCTION",
            help="Builds model, optimizer, compute_loss (scheduler, scaler...) as the"
            " training script does (see man 1); MODULE is found from the current directory"
            " first.",
            show_default=False,
        ),
    ],
    change: Annotated[
        list[str] | None,
        change_option(
            "Replay once more with exactly this changed (repeatable): precision,"
            " loss_scale, lr, lr_factor, eps, clip, reduction, batch, deterministic."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        path_option(
            "--out", "DIR", "A new directory for the replays' bundles [default: ./replay-RUN-STEP]."
        ),
    ] = None,
    require_fixed: Annotated[
        bool,
        typer.Option(
            "--require-fixed",
            help="Recovery gate: exit 0 only when every change is the one mechanism"
            " changed and FIXED the step.",
        ),
    ] = False,
    format: FormatOption = CheckFormat.text,
) -> None:
    """Replay a held step from its capsule, as recorded and with one mechanism changed.

    Verifies the capsule (nothing in it is run), builds the objects with the
    entry, loads the capsule into them, replays the step and writes its bundle;
    reports whether it REPRODUCED the incident bundle beside the capsule (diff),
    then the diff verdict of each --change against the replay as recorded.
    Exit as diff (0 attributable, 1 not; with --require-fixed 0 only when every
    change FIXED it), 3 when the capsule, or a bundle, is rejected or the built
    objects do not fit it, 2 for a bad entry or change, or how it was started:
    a capsule every rank of an FSDP2 job wrote is replayed under torchrun with
    its world size (torchrun --nproc-per-node N -m nanrunbook replay ...), every
    rank's bundle written below --out as an incident set and compared with its
    incident member; no --change.

    Example: nanrunbook replay incident/run-7/1842/capsule --entry train:build --change precision=fp32
    """
    from nanrunbook.capture.torch._entry import EntryError, build, load_entry, parse_changes
    from nanrunbook.capture.torch._state_dir import StateDirRejected
    from nanrunbook.capture.torch.capsule import replay_capsule
    from nanrunbook.capture.torch.sharded_replay import (
        ShardedCapsule,
        launched_world,
        open_capsule,
    )
    from nanrunbook.cli._judging import emit, emit_rejection
    from nanrunbook.diff import ComparisonRejected
    from nanrunbook.output.renderers import RENDERERS

    texts = list(change or ())
    try:
        changes = list(zip(texts, parse_changes(texts), strict=True))
        opened = open_capsule(capsule)
    except EntryError as error:
        usage_error("replay", str(error))
    except StateDirRejected as error:
        raise typer.Exit(emit_rejection(error, capsule, format.value, sys.stdout)) from None
    if isinstance(opened, ShardedCapsule):
        _sharded(opened, entry, len(changes), out, require_fixed, format.value)
    world = launched_world()
    if world is not None and world > 1:
        usage_error(
            "replay",
            f"{capsule} was written by one process, this job has {world} ranks: replay it"
            " without torchrun (or with --nproc-per-node 1)",
        )
    target = (
        out if out is not None else Path(f"replay-{opened.run_id}-{opened.step}".replace("/", "-"))
    )
    try:
        built = build(load_entry(entry))
        result = replay_capsule(opened, built, changes, target)
    except EntryError as error:
        usage_error("replay", str(error))
    except ValueError as error:  # a change that cannot apply: the value is wrong
        usage_error("replay", str(error))
    except StateDirRejected as error:
        raise typer.Exit(emit_rejection(error, capsule, format.value, sys.stdout)) from None
    except ComparisonRejected as error:
        emit(functools.partial(RENDERERS[format.value].diff, error, sys.stdout), sys.stdout)
        raise typer.Exit(error.exit_code) from None
    code = result.exit_code(require_fixed=require_fixed)
    answer = RENDERERS[format.value].replay
    emit(functools.partial(answer, result, sys.stdout, require_fixed=require_fixed), sys.stdout)
    raise typer.Exit(code)


def _sharded(
    capsule: Any, entry: str, changes: int, out: Path | None, require_fixed: bool, fmt: str
) -> NoReturn:
    """A sharded capsule, replayed by every rank of this torchrun job: the same
    exit code on every rank, the answer printed by rank 0."""
    from nanrunbook.capture.torch._entry import EntryError, build, load_entry
    from nanrunbook.capture.torch._state_dir import StateDirRejected
    from nanrunbook.capture.torch.sharded_replay import replay_sharded
    from nanrunbook.cli._judging import emit, emit_rejection
    from nanrunbook.output.renderers import RENDERERS

    target = (
        out
        if out is not None
        else Path(f"replay-{capsule.run_id}-{capsule.step}".replace("/", "-"))
    )
    first = os.environ.get("RANK", "0") == "0"  # before the group exists, as after it
    try:
        result = replay_sharded(capsule, lambda: build(load_entry(entry)), target, changes=changes)
    except EntryError as error:
        usage_error("replay", str(error))
    except StateDirRejected as error:
        rejected = int(error.exit_code)
        if first:
            rejected = emit_rejection(error, capsule.path, fmt, sys.stdout)
        raise typer.Exit(rejected) from None
    code = result.exit_code(require_fixed=require_fixed)
    if first:
        answer = RENDERERS[fmt].sharded_replay
        emit(functools.partial(answer, result, sys.stdout, require_fixed=require_fixed), sys.stdout)
    raise typer.Exit(code)
