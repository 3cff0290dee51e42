"""A held step's evidence: its replay on copies from the pre-step state, bound,
written atomically under the incident directory, and checked."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nanrunbook.check  # noqa: F401  -- loaded now, not in the middle of a hold
from nanrunbook.capture.facts import LoopFacts
from nanrunbook.capture.incident import incident_bundle_path
from nanrunbook.capture.torch.replay import (
    Scaling,
    StepRecipe,
    bind,
    model_binding,
    replay_recipe,
    scheduler_binding,
)
from nanrunbook.capture.torch.sentinel._steps import StepRecord
from nanrunbook.errors import EvidenceRejected
from nanrunbook.records import STAGE_ORDER

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


@dataclass(frozen=True)
class Captured:
    bundle: Path | None
    report: Any  # nanrunbook.Report, when the bundle was written and checked
    error: str | None


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


def capture_step(
    objects: StepObjects,
    facts: LoopFacts,
    record: StepRecord,
    last_known_good: Mapping[str, Any],
    root: Path,
    rank: int | None,
) -> Captured:
    """Replay ``record`` on copies of the real objects (which must hold the
    pre-step state), write its bundle, check it. Never raises: a capture that
    fails is reported, and the hold stands without it."""
    recipe = StepRecipe(
        compute_loss=objects.compute_loss,
        micro_batches=tuple(record.micro),
        scaling=_scaling(objects),
        clipping=record.clip.recipe() if record.clip is not None else None,
        choose=objects.choose,
        outside=True,
    )
    owner = dict.fromkeys(STAGE_ORDER, facts.incident_owner)
    try:
        replayed = replay_recipe(
            objects.model,
            objects.optimizer,
            recipe,
            owner,
            run_id=facts.run_id,
            step=record.number,
            incident_owner=facts.incident_owner,
            last_known_good=last_known_good,
        )
        derived = {"model": _model_item(objects), "scheduler": scheduler_binding(objects.scheduler)}
        bind(replayed, objects.model, objects.optimizer, facts.binding(record.number), derived)
        target = incident_bundle_path(root, facts.run_id, record.number, rank)
        target.parent.mkdir(parents=True, exist_ok=True)
        report = replayed.writer.write_checked(target)
    except EvidenceRejected as error:
        log.error("step %d: the captured evidence was refused: %s", record.number, error)
        return Captured(None, None, f"evidence refused: {error}")
    except Exception as error:  # the hold must stand whatever the capture hits
        log.exception("step %d: capture failed", record.number)
        return Captured(None, None, f"{type(error).__name__}: {error}")
    decision = report.decision
    log.error(
        "step %d held; bundle %s checks %s at %s (first non-finite tensor %s)",
        record.number,
        target,
        decision.decision,
        decision.earliest_nonfinite_stage or "no stage",
        decision.first_nonfinite_tensor,
    )
    return Captured(target, report, None)
