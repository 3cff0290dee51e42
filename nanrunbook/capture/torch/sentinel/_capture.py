"""A held step's evidence: its replay on copies from the pre-step state, bound,
written atomically under the incident directory, and checked."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nanrunbook.check  # noqa: F401  -- loaded now, not in the middle of a hold
from nanrunbook.capture.facts import LoopFacts
from nanrunbook.capture.incident import incident_bundle_path
from nanrunbook.capture.torch._offload import ReplayMemory
from nanrunbook.capture.torch.replay import (
    COMPILED_LIVE,
    EAGER_REPLAY,
    Replayed,
    Scaling,
    StepRecipe,
    bind,
    mark_eager,
    model_binding,
    replay_recipe,
    scheduler_binding,
    topology_binding,
)
from nanrunbook.capture.torch.sentinel._steps import StepRecord
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.errors import EvidenceRejected
from nanrunbook.verdict.report import Report

__all__ = ["Captured", "StepObjects", "capture_step"]

log = logging.getLogger("nanrunbook.sentinel")


@dataclass(frozen=True)
class StepObjects:
    """The real objects of the loop, as the replay needs them."""

    model: Any  # the module the replay copies (DistributedDataParallel unwrapped)
    optimizer: Any
    scheduler: Any
    scaler: Any  # an enabled GradScaler, or None
    loss_scale: float | None  # a static loss scale, or None
    compute_loss: Callable[[Any, Any], Any]
    choose: Callable[[str, Any], bool]
    compiled: bool = False  # the loop's model is torch.compile'd: the replay runs eagerly
    memory: ReplayMemory = "auto"  # the replay's path: default, offload, or chosen by free memory


@dataclass(frozen=True)
class Captured:
    bundle: Path | None
    report: Any  # nanrunbook.Report, when the bundle was written and checked
    error: str | None
    notes: tuple[str, ...] = ()  # how the replay differs from the live step, for the reason


def _scaling(objects: StepObjects) -> Scaling:
    if objects.scaler is not None:
        return Scaling("dynamic", scaler=objects.scaler)
    if objects.loss_scale is not None:
        return Scaling("static", scale=objects.loss_scale)
    return Scaling()


def _model_item(objects: StepObjects) -> dict[str, Any]:
    """The model's digest covers parameters the optimizer holds outside it too."""
    inside = {id(p) for p in objects.model.parameters()}
    outside = [
        (f"outside/group{g}.param{i}", p)
        for g, group in enumerate(objects.optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in inside
    ]
    state = [*objects.model.state_dict().items(), *outside]
    return model_binding(iter(state), objects.model, sum(p.numel() for _, p in outside))


def _finite(nonfinite: bool) -> str:
    return "non-finite" if nonfinite else "finite"


def _differences(record: StepRecord, writer: Any) -> list[tuple[str, str]]:
    """(stage, note) where the replay's loss or gradients are finite and the live
    step's were not, or the reverse: evidence that the replay is not the step."""
    found: list[tuple[str, str]] = []
    replayed = writer.nonfinite("loss")
    if record.loss_values and replayed is not None:
        live = not all(math.isfinite(v) for v in record.loss_values)
        if live != replayed:
            found.append(
                (
                    "loss",
                    f"the live step's loss was {_finite(live)}, the replay's is {_finite(replayed)}",
                )
            )
    grads = record.grads
    replayed = writer.nonfinite("backward")
    if replayed is not None:
        # Under DDP the replay is this rank's own backward: compare with its own gradients.
        live = not grads.local_finite if grads.local_finite is not None else grads.tripped
        live = live or bool(grads.found_inf)
        if live != replayed:
            found.append(
                (
                    "backward",
                    f"the live step's gradients were {_finite(live)},"
                    f" the replay's are {_finite(replayed)}",
                )
            )
    return found


def _compare(objects: StepObjects, record: StepRecord, replayed: Replayed) -> list[str]:
    """Mark the eager replay of a compiled model and the differences from the
    live step in the stages' probe sources; the notes for the hold's reason."""
    notes: list[str] = []
    writer = replayed.writer
    if objects.compiled:
        mark_eager(writer)
        notes.append(EAGER_REPLAY)
        replayed.inexact.append(COMPILED_LIVE)
    for stage, note in _differences(record, writer):
        writer.annotate(stage, f"replay differs from the live step: {note}")
        notes.append(f"replay differs from the live step: {note}")
    return notes


def capture_step(
    objects: StepObjects,
    facts: LoopFacts,
    record: StepRecord,
    last_known_good: Mapping[str, Any],
    root: Path,
    rank: int | None,
    attempt: int | None = None,
    topology: Mapping[str, Any] | None = None,
    *,
    peer: bool = False,
) -> Captured:
    """Replay ``record`` on copies of the real objects (which must hold the
    pre-step state), write its bundle (as ``rank`` of the job, into the
    incident directory's ``attempt``, default the first free; ``topology``: more
    of the topology item, the voting group's rank and size), check it. Never
    raises: a capture that fails is reported, and the hold stands without it.
    ``peer``: the step holds because another rank's values went non-finite."""
    recipe = StepRecipe(
        compute_loss=objects.compute_loss,
        micro_batches=tuple(record.micro),
        scaling=_scaling(objects),
        clipping=record.clip.recipe() if record.clip is not None else None,
        choose=objects.choose,
        outside=True,
        memory=objects.memory,
    )
    owner = dict.fromkeys(STAGE_ORDER, facts.incident_owner)
    try:
        run_directory = root / facts.run_id  # the bundle goes below it, its spool in it
        run_directory.mkdir(parents=True, exist_ok=True)
        replayed = replay_recipe(
            objects.model,
            objects.optimizer,
            recipe,
            owner,
            run_id=facts.run_id,
            step=record.number,
            incident_owner=facts.incident_owner,
            last_known_good=last_known_good,
            spool_dir=run_directory,  # the tensors stream to disk as they are taken
        )
        notes = _compare(objects, record, replayed)
        derived = {"model": _model_item(objects), "scheduler": scheduler_binding(objects.scheduler)}
        if topology is not None:
            derived["topology"] = {**topology_binding(), **topology}
        given = facts.binding(record.number)
        inexact = bind(replayed, objects.model, objects.optimizer, given, derived)
        notes += [f"the replay may not be exact: {why}" for why in inexact if why != COMPILED_LIVE]
        target = incident_bundle_path(root, facts.run_id, record.number, rank, attempt)
        target.parent.mkdir(parents=True, exist_ok=True)
        report = replayed.writer.write_checked(target)
    except EvidenceRejected as error:
        log.error("step %d: the captured evidence was refused: %s", record.number, error)
        return Captured(None, None, f"evidence refused: {error}")
    except Exception as error:  # the hold must stand whatever the capture hits
        log.exception("step %d: capture failed", record.number)
        return Captured(None, None, f"{type(error).__name__}: {error}")
    log.error("%s", held_line(record.number, target, report, peer=peer))
    for note in notes:
        log.error("step %d: %s", record.number, note)
    return Captured(target, report, None, tuple(notes))


def held_line(step: int, target: Path, report: Report, *, peer: bool = False) -> str:
    """The log line for a held step whose bundle was written and checked."""
    decision = report.decision
    if decision.earliest_nonfinite_stage is None:
        checks = f"bundle {target} checks {decision.decision}"
        if peer:  # every rank holds when any rank's values went non-finite
            return (
                f"step {step} held because another rank's values went non-finite; this"
                f" rank's {checks}: every value it captured is finite"
            )
        return (
            f"step {step} held; {checks}: every value its replay captured is finite"
            " (the non-finite values did not come back on the replay)"
        )
    tensor = decision.first_nonfinite_tensor or "unknown (a summary stage)"
    return (
        f"step {step} held; bundle {target} checks {decision.decision} at"
        f" {decision.earliest_nonfinite_stage} (first non-finite tensor {tensor})"
    )
