"""A held step's evidence: its replay on copies from the pre-step state, bound,
written atomically under the incident directory, and checked."""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nanrunbook.check  # noqa: F401  -- loaded now, not in the middle of a hold
from nanrunbook.capture._changes import CHANGE_FIELD
from nanrunbook.capture.facts import LoopFacts
from nanrunbook.capture.incident import Reproduction, StepSight, incident_bundle_path
from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch._faithfulness import device_facts
from nanrunbook.capture.torch._offload import ReplayMemory
from nanrunbook.capture.torch.capsule import HeldStep, annotate_replay, write_held_capsule
from nanrunbook.capture.torch.replay import (
    COMPILED_LIVE,
    Scaling,
    StepRecipe,
    bind,
    leaf,
    model_item,
    replay_recipe,
    scheduler_binding,
    topology_binding,
)
from nanrunbook.capture.torch.sentinel._steps import StepRecord
from nanrunbook.capture.writer import BundleWriter
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.errors import EvidenceRejected
from nanrunbook.verdict.report import Report

__all__ = ["Captured", "StepCapture", "StepObjects", "capture_step"]

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
class StepCapture:
    """One capture's request, for :func:`capture_step` and the sharded one alike:
    the loop's objects and statement, the step, where and as whom its bundle goes,
    and how the step was held."""

    objects: StepObjects
    facts: LoopFacts
    step: StepRecord
    last_known_good: Mapping[str, Any]
    root: Path  # the incident directory
    rank: int | None  # the job's rank (its member name), None without a process group
    attempt: int | None = None  # the incident directory's attempt; None: the first free
    topology: Mapping[str, Any] | None = None  # more of the topology item: the voting group's
    recovery: Mapping[str, Any] | None = None  # the checkpoint item's detail (verified/stated)
    peer: bool = False  # held because another rank's values went non-finite
    policy: str = "hold"  # what a NOT_REPRODUCED hold does (hold or rerun), recorded
    capsule: bool = True  # write the step's capsule (before any update: the pre-step state)
    requested: bool = False  # a capture_steps step that goes on, not a hold (its log says so)


@dataclass(frozen=True)
class Captured:
    bundle: Path | None
    report: Any  # nanrunbook.Report, when the bundle was written and checked
    error: str | None
    notes: tuple[str, ...] = ()  # how the replay differs from the live step, for the reason
    reproduced: Reproduction | None = None  # the replay against the live step
    capsule: Path | None = None  # the held step's capsule, to replay it later
    capsule_error: str | None = None  # why there is none


def _scaling(objects: StepObjects) -> Scaling:
    if objects.scaler is not None:
        return Scaling("dynamic", scaler=objects.scaler)
    if objects.loss_scale is not None:
        return Scaling("static", scale=objects.loss_scale)
    return Scaling()


def _live_finiteness(record: StepRecord) -> dict[str, Any]:
    """Whether the live step's loss and gradients were non-finite (under DDP this
    rank's own gradients, as its replay's backward is its own)."""
    values = record.loss_values
    grads = record.grads
    backward = not grads.local_finite if grads.local_finite is not None else grads.tripped
    return {
        "loss_nonfinite": (not all(math.isfinite(v) for v in values)) if values else None,
        "backward_nonfinite": bool(backward or grads.found_inf),
    }


_CHECKED = ("loss", "backward", "optimizer")  # the boundaries the live step checks


def _sums(counts: Any) -> tuple[int, int, int]:
    return (
        sum(c.nan for c in counts),
        sum(c.posinf for c in counts),
        sum(c.neginf for c in counts),
    )


def live_sight(record: StepRecord, *, peer: bool = False) -> StepSight:
    """What the live step saw: its losses' bits and counts, its gradients' counts
    (exact when the check counted them; none when it saw them finite), the
    update's finiteness; ``peer``: held for another rank, its own values finite."""
    values = record.loss_values
    loss = (
        sum(math.isnan(v) for v in values),
        sum(v == math.inf for v in values),
        sum(v == -math.inf for v in values),
    )
    grads = record.grads
    gradients: tuple[int, int, int] | None = None
    if grads.local_finite is None:  # under DDP the live counts are after the all-reduce
        if grads.counts:
            gradients = _sums(grads.counts)
        elif not (grads.tripped or grads.found_inf):
            gradients = (0, 0, 0)
    update = record.update
    stage = None
    if grads.local_finite is not None:  # this rank's own gradients, as its replay's
        backward = not grads.local_finite
    else:
        backward = bool(grads.tripped or grads.found_inf or (gradients and any(gradients)))
    if not peer:
        if any(loss):
            stage = "loss"
        elif backward:
            stage = "backward"
        elif update is not None and (update.nan or update.posinf or update.neginf):
            stage = "optimizer"
    bits = tuple(tensor_to_raw(value).data.hex() for value in record.losses)
    return StepSight(stage, bits, loss, gradients)


def replay_sight(report: Report, loss_bits: tuple[str, ...]) -> StepSight:
    """What a replay's checked bundle saw at the same boundaries."""
    found = {finding.stage: finding for finding in report.stages}

    def counted(stage: str) -> tuple[int, int, int] | None:
        counts = found[stage].counts
        return None if counts is None else (counts.nan, counts.posinf, counts.neginf)

    stage = next((s for s in _CHECKED if any(counted(s) or ())), None)
    return StepSight(stage, loss_bits, counted("loss") or (0, 0, 0), counted("backward"))


def where_it_ran(model: Any, rank: int | None) -> dict[str, Any]:
    """The host, device (and CUDA device UUID) and rank a reproduction names."""
    param = next(iter(model.parameters()), None)
    facts = device_facts(param.device if param is not None else "cpu")
    return {
        "host": socket.gethostname(),
        "device": str(facts["device"]),
        "device_uuid": facts.get("gpu_uuid"),
        "rank": rank,
    }


def stated_binding(
    facts: LoopFacts, step: int, recovery: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What the loop states of step ``step``, its checkpoint item with the
    ``recovery`` detail fields (whether the last known-good state was verified)."""
    given = facts.binding(step)
    if recovery:
        given["checkpoint"] = {**given["checkpoint"], **recovery}
    return given


def capture_step(request: StepCapture) -> Captured:
    """Replay the request's step on copies of the real objects (which must hold
    the pre-step state), write its bundle, check it (see :class:`StepCapture`).
    Never raises: a capture that fails is reported, and the hold stands without it."""
    objects, facts, record = request.objects, request.facts, request.step
    last_known_good, root, rank = request.last_known_good, request.root, request.rank
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
        live = _live_finiteness(record)
        notes = annotate_replay(replayed, live, objects.compiled)
        derived = {
            "model": model_item(objects.model, objects.optimizer),
            "scheduler": scheduler_binding(objects.scheduler),
        }
        if request.topology is not None:
            derived["topology"] = {**topology_binding(), **request.topology}
        given = stated_binding(facts, record.number, request.recovery)
        inexact = bind(replayed, objects.model, objects.optimizer, given, derived)
        binding = replayed.writer.binding
        changed = facts.changed(record.number)
        for change in changed:  # a change the run made, said where a replay says it
            binding[change.item] = {
                **binding[change.item],
                **change.fields,
                CHANGE_FIELD: change.note,
            }
        notes += [f"the replay may not be exact: {why}" for why in inexact if why != COMPILED_LIVE]
        target, report = write_incident(replayed.writer, request)
    except Exception as error:  # the hold must stand whatever the capture hits
        return capture_failed(record.number, error)
    level = logging.INFO if request.requested else logging.ERROR  # a step asked for is no incident
    if request.requested:
        decision = report.decision.decision
        log.info("step %d captured as asked (capture_steps): bundle %s checks %s",
                 record.number, target, decision)  # fmt: skip
    else:
        log.error("%s", held_line(record.number, target, report, peer=request.peer))
    for note in notes:
        log.log(level, "step %d: %s", record.number, note)
    reproduced = Reproduction.compare(
        live_sight(record, peer=request.peer),
        replay_sight(report, replayed.loss_bits),
        **where_it_ran(objects.model, rank),
        policy=request.policy,
    )
    log.log(level, "step %d: %s", record.number, reproduced.line())
    if not request.capsule:
        return Captured(target, report, None, tuple(notes), reproduced)
    if changed:  # the run's own change (prove's) may live in its compute_loss
        why = "a step under a change the run made has no capsule: the entry would not replay it"
        return Captured(target, report, None, tuple(notes), reproduced, None, why)
    held = HeldStep(
        model=objects.model,
        optimizer=objects.optimizer,
        scheduler=objects.scheduler,
        scaler=objects.scaler,
        loss_scale=objects.loss_scale,
        micro_batches=recipe.micro_batches,
        clipping=recipe.clipping,
        custom_modules=objects.choose is not leaf,
        compiled=objects.compiled,
        run_id=facts.run_id,
        step=record.number,
        incident_owner=facts.incident_owner,
        last_known_good=last_known_good,
        given=given,
        topology=derived.get("topology"),
        live=live,
        reproduced=reproduced,
        bundle_evidence_id=report.manifest.evidence_content_id,
    )
    written, capsule_error = write_held_capsule(target, held)
    return Captured(target, report, None, tuple(notes), reproduced, written, capsule_error)


def write_incident(writer: BundleWriter, request: StepCapture) -> tuple[Path, Report]:
    """Write and check the request's bundle at its place below the incident
    directory: where it is and its report."""
    number = request.step.number
    target = incident_bundle_path(
        request.root, request.facts.run_id, number, request.rank, request.attempt
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    return target, writer.write_checked(target)


def capture_failed(step: int, error: Exception) -> Captured:
    """The capture of step ``step`` raised ``error`` (called in its ``except``):
    logged, and the hold stands without a bundle."""
    if isinstance(error, EvidenceRejected):
        log.error("step %d: the captured evidence was refused: %s", step, error)
        return Captured(None, None, f"evidence refused: {error}")
    log.exception("step %d: capture failed", step)
    return Captured(None, None, f"{type(error).__name__}: {error}")


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
