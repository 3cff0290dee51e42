"""Prove recovery: resume from a verified point, run the steps up to the
incident as they were, the incident step with one change and N more steps
under the sentinel, and write the recovery record.

The steps before the incident run unchanged (a bit-identical resume repeats
the run's own: they must go on as they did); the change starts at the incident
step and stays, as the run would be reopened with it: the optimizer's values,
the loss scale, the precision, clipping, the loss reduction, deterministic
algorithms. A batch change (drop or replace examples, another batch) is the
incident step's batch alone: the steps after it take the loader's batches.
The bundles from the incident step on name the change as a replay's do (the
changed item's ``replay_change`` detail). The incident step's bundle is
captured whatever its verdict (the sentinel's ``capture_steps``), so ``diff``
against the incident bundle can attribute the outcome to the one change:
ONE_MECHANISM_CHANGED and FIXED is recovery; without a change the step holds
again and the diff says REPRODUCED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nanrunbook.capture._changes import (
    AdamEps,
    AutocastDtype,
    BatchExamples,
    Change,
    ClipMaxNorm,
    Deterministic,
    LearningRate,
    LossScale,
    OtherBatch,
    Reduction,
    WithoutAutocast,
    change_text,
)
from nanrunbook.capture.atomic import atomic_write
from nanrunbook.capture.facts import RunChange
from nanrunbook.capture.incident import SentinelHold
from nanrunbook.capture.recovery import (
    RecoveryRecord,
    StepTrend,
    record_document,
    verify_recovery_point,
)
from nanrunbook.capture.torch._entry import Built, EntryError, built_from
from nanrunbook.capture.torch.recovery._point import load_recovery_point
from nanrunbook.capture.torch.replay import (
    autocast_as,
    autocast_off,
    changed_examples,
    changed_optimizer_values,
    changed_reduction,
)
from nanrunbook.check import check_bundle
from nanrunbook.contract import CONTINUE, SCALE_RANGE, is_contract_scale
from nanrunbook.diff import FIXED, ONE_MECHANISM_CHANGED, diff_bundles
from nanrunbook.manifest.parse import RECOVERY_PARTS

__all__ = ["RECORD_NAME", "prove_recovery"]

RECORD_NAME = "recovery.json"


class _Applied:
    """The change, off until the incident step, then on: for the rest of the
    run, or, a batch change, for the incident step's batch. What cannot apply
    is refused when it is made, before anything runs (EntryError); what can
    only be known at the incident step (an example the batch does not have, a
    reduction compute_loss never asked for) is a reason the proof fails."""

    def __init__(
        self,
        change: Change | None,
        run: Built,
        stack: contextlib.ExitStack,
        objective: Mapping[str, Any],
    ) -> None:
        self.change, self.run, self.stack, self.on = change, run, stack, False
        self.failed: str | None = None  # why the change did not apply at the incident step
        self.clip: float | None = None
        self._loss = run.compute_loss
        self._acted: Callable[[], bool] = lambda: True
        self._why_not = ""
        self._rewritten: Any = None  # the reduction's rewrite (replay's plan)
        said = self._said = f"--change {change_text(change)}" if change is not None else ""
        if isinstance(change, LossScale):
            if run.scaler is None or not run.scaler.is_enabled():
                raise EntryError(f"{said}: needs the run's enabled GradScaler")
            if not is_contract_scale(change.scale):
                raise EntryError(f"{said}: a loss scale is {SCALE_RANGE}")
        elif isinstance(change, LearningRate | AdamEps):
            with contextlib.ExitStack() as trial:  # refused now, before anything runs
                self._set_values(trial)
        elif isinstance(change, ClipMaxNorm):
            if change.max_norm is None:
                raise EntryError(
                    f"{said}: prove's loop clips only with clip=MAX_NORM, so there is no"
                    " clipping to take away"
                )
            if not change.max_norm > 0:
                raise EntryError(f"{said}: a max norm is a positive number")
        elif isinstance(change, Reduction):
            try:
                plan = changed_reduction(
                    change.to, None, run.compute_loss, None, {"objective": objective}
                )
            except ValueError as error:
                raise EntryError(f"{said}: {error}") from None
            self._rewritten, self._acted, self._why_not = plan, plan.acted, plan.why_not
        elif isinstance(change, Deterministic):
            import torch

            if torch.are_deterministic_algorithms_enabled():
                raise EntryError(f"{said}: deterministic algorithms are already on")

    def _set_values(self, stack: contextlib.ExitStack) -> str:
        """The change's optimizer values, set until ``stack`` closes (replay's
        helper); what changed."""
        assert isinstance(self.change, LearningRate | AdamEps)
        try:
            return str(
                stack.enter_context(changed_optimizer_values(self.change, self.run.optimizer))
            )
        except ValueError as error:
            raise EntryError(f"--change {change_text(self.change)}: {error}") from None

    def start(self, sentinel: Any, batch: Any) -> Any:
        """Turn the change on at the incident step, whose loader batch is
        ``batch``; the batch to run it on. The sentinel's bundles say the change
        from now on, where a replay's would (the item's ``replay_change``)."""
        self.on = True
        change, run = self.change, self.run
        if change is None:
            return batch
        note = ""
        if isinstance(change, LearningRate | AdamEps):
            note = self._set_values(self.stack)  # changed until the proof ends
        elif isinstance(change, LossScale):
            before = run.scaler.get_scale()
            run.scaler.load_state_dict({**run.scaler.state_dict(), "scale": float(change.scale)})
            note = f"loss scale {before:g} -> {change.scale:g}"
        elif isinstance(change, WithoutAutocast):
            note = "autocast disabled: compute in the parameters' dtype"
        elif isinstance(change, AutocastDtype):
            note = f"autocast in {change.dtype}"
        elif isinstance(change, ClipMaxNorm):
            assert change.max_norm is not None
            self.clip = change.max_norm
            note = f"clipping at max norm {change.max_norm:g} (L2, every parameter), none before"
        elif isinstance(change, Reduction):
            self._loss = self._rewritten.compute_loss
            note = self._rewritten.note
        elif isinstance(change, Deterministic):
            import torch

            warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
            torch.use_deterministic_algorithms(True)
            self.stack.callback(torch.use_deterministic_algorithms, False, warn_only=warn_only)
            note = "deterministic algorithms on"
        elif isinstance(change, BatchExamples):
            try:
                [batch], note = changed_examples(change, [batch])
            except ValueError as error:
                self.failed = f"{self._said} did not apply: {error}"
                return batch
        elif isinstance(change, OtherBatch):
            batch, note = change.batch, "batch substituted"
        number = sentinel.last_step + 1  # the incident step, about to run
        alone = number if isinstance(change, BatchExamples | OtherBatch) else None
        fields = {"reduction": change.to} if isinstance(change, Reduction) else {}
        said = RunChange(change.item, note, number, alone, fields)
        sentinel.facts = dataclasses.replace(sentinel.facts, changes=(said,))
        return batch

    def not_acted(self) -> str | None:
        """Why the change, on, never acted (None: it did, or is not on)."""
        if self.on and self.failed is None and not self._acted():
            return f"{self._said} did not act: {self._why_not}"
        return self.failed

    def compute_loss(self, model: Any, batch: Any) -> Any:
        if self.on and isinstance(self.change, WithoutAutocast):
            with autocast_off():
                return self._loss(model, batch)
        if self.on and isinstance(self.change, AutocastDtype):
            import torch

            with autocast_as(getattr(torch, self.change.dtype)):
                return self._loss(model, batch)
        return self._loss(model, batch)


def _loop_facts(incident: Path) -> tuple[str, str, dict[str, Any]]:
    """The incident's run id, owner and the statements its loop made (checkpoint,
    data, objective): the resumed run states the same."""
    manifest = json.loads((incident / "manifest.json").read_text())
    binding = manifest["binding"]
    checkpoint = {k: v for k, v in binding["checkpoint"].items() if k != "last_known_good_recovery"}
    checkpoint["verified_together"] = list(RECOVERY_PARTS)
    facts = {"checkpoint": checkpoint, "data": binding["data"], "objective": binding["objective"]}
    return manifest["run"]["run_id"], manifest["incident_owner"], facts


def _step(run: Built, sentinel: Any, batch: Any, clip: float | None) -> None:
    """One step of prove's loop; with ``clip``, the gradients (unscaled) clipped
    at that max norm through the sentinel, so its replays clip them too."""
    run.optimizer.zero_grad()
    loss = sentinel.forward(batch)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    if run.scaler is not None and run.scaler.is_enabled():
        run.scaler.scale(loss).backward()
        if clip is not None:
            run.scaler.unscale_(run.optimizer)
            sentinel.clip_grad_norm_(params, clip)
        run.scaler.step(run.optimizer)
        run.scaler.update()
    else:
        loss.backward()
        if clip is not None:
            sentinel.clip_grad_norm_(params, clip)
        run.optimizer.step()
    if run.scheduler is not None:
        run.scheduler.step()


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _telemetry(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trend(lines: list[dict[str, Any]], keep: Callable[[int], bool]) -> StepTrend:
    chosen = [line for line in lines if keep(int(line["step"]))]
    losses = [line["loss"] for line in chosen if isinstance(line.get("loss"), float | int)]
    norms = [
        line["grad"]["norm"]
        for line in chosen
        if isinstance(line.get("grad"), dict) and isinstance(line["grad"].get("norm"), float | int)
    ]
    return StepTrend(len(chosen), _median(losses), _median(norms))


def prove_recovery(
    point: str | Path,
    incident: str | Path,
    *,
    build: Callable[[], Any],
    through: int,
    then: int,
    change: Change | None = None,
    out: str | Path,
    max_warnings: int = 0,
) -> RecoveryRecord:
    """Resume the run ``build`` makes from ``point`` (verified first), run it
    under the sentinel up to the incident step ``through`` unchanged, that step
    with ``change`` and ``then`` more steps, and write the recovery record
    (``out/recovery.json``, atomically; the run's telemetry, its captured
    bundles and incident directory below ``out``, which must not exist).

    Proven when: the state after the resume is the point's bit for bit, no step
    held, the incident step's new bundle checks CONTINUE and its diff against
    ``incident`` is ONE_MECHANISM_CHANGED with FIXED, all ``then`` steps ran,
    and at most ``max_warnings`` warnings came after the incident step (the
    incident step's own, its spike, are recorded, not counted).
    Raises StateDirRejected (a point that does not verify), EvidenceRejected
    (the incident bundle, or the new one), EntryError (an unusable run or
    change)."""
    from nanrunbook.capture.torch import Sentinel

    root, bundle, target = Path(point), Path(incident), Path(out)
    verification = verify_recovery_point(root)
    if not verification.verified:
        raise verification.rejected()
    report = check_bundle(bundle)
    incident_step = report.manifest.step
    if incident_step != through:
        raise EntryError(f"the incident bundle is step {incident_step}, not --through {through}")
    if verification.step is None or not verification.step < through:
        raise EntryError(f"the point is step {verification.step}: not before the incident")
    if then < 0:
        raise EntryError(f"--then {then}: a number of steps >= 0")
    run = built_from(build, needs=("loader",))
    run_id, owner, facts = _loop_facts(bundle)
    telemetry = target / "telemetry.jsonl"
    own = {
        "run_id": run_id,
        "incident_owner": owner,
        "scheduler": run.scheduler,
        "scaler": run.scaler,
        "generators": run.generators,
        "incident_dir": target / "incident",
        "telemetry": telemetry,
        "capture_steps": (through,),
        **facts,
        **({"modules": run.modules} if run.modules is not None else {}),
    }
    taken = sorted(set(own) & set(run.sentinel))
    if taken:
        raise EntryError(f"the entry's sentinel= sets {', '.join(taken)}: prove sets them itself")
    restorable = callable(getattr(run.loader, "load_state_dict", None))
    loaded = load_recovery_point(
        root,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        data=run.loader if restorable else None,
        generators=run.generators,
        check_digests=True,  # the record says the resumed state is the point's
    )
    stack = contextlib.ExitStack()
    applied = _Applied(change, run, stack, facts["objective"])  # one that cannot: refused here
    target.mkdir()
    sentinel = Sentinel(run.model, run.optimizer, applied.compute_loss, **own, **run.sentinel)
    sentinel.resumed_from(loaded.point)
    steps_run: list[int] = []
    hold: SentinelHold | None = None
    assert run.loader is not None  # built_from needs it
    batches: Iterator[Any] = iter(run.loader)
    loaded.restore_random()  # the iterator may have drawn its seed from torch's generator
    reasons: list[str] = []
    with stack:  # the change's values are put back when the proof ends, however it ends
        try:
            for number in range(loaded.point.step + 1, through + then + 1):
                try:
                    batch = next(batches)
                except StopIteration:
                    reasons.append(f"the loader ran out before step {number}")
                    break
                if number == through:
                    batch = applied.start(sentinel, batch)
                    if applied.failed is not None:
                        break
                steps_run.append(number)
                _step(run, sentinel, batch, applied.clip)
            sentinel.close()
        except SentinelHold as held:
            hold = held
            with contextlib.suppress(SentinelHold):
                sentinel.close()
    not_acted = applied.not_acted()
    if not_acted is not None:
        reasons.append(not_acted)
    new_bundle = hold.bundle if hold is not None and hold.step == through else None
    if new_bundle is None:
        new_bundle = sentinel.captured.get(through)
    return _record(
        verification.path,
        loaded,
        bundle,
        target,
        run_id=run_id,
        owner=owner,
        through=through,
        then=then,
        description=change_text(change) if change is not None else None,
        steps_run=tuple(steps_run),
        hold=hold,
        new_bundle=new_bundle,
        reasons=reasons,
        max_warnings=max_warnings,
        telemetry=_telemetry(telemetry),
    )


def _record(
    point_path: str,
    loaded: Any,
    incident: Path,
    target: Path,
    *,
    run_id: str,
    owner: str,
    through: int,
    then: int,
    description: str | None,
    steps_run: tuple[int, ...],
    hold: SentinelHold | None,
    new_bundle: Path | None,
    reasons: list[str],
    max_warnings: int,
    telemetry: list[dict[str, Any]],
) -> RecoveryRecord:
    if not loaded.digests_match:
        reasons.append("the state after the resume is not the point's")
    if hold is not None:
        where = "again at the incident step" if hold.step == through else f"at step {hold.step}"
        reasons.append(f"the run held {where}")
    new_decision = verdict = outcome = None
    changed: tuple[str, ...] = ()
    if new_bundle is None:
        reasons.append("no bundle of the incident step")
    else:
        new_decision = check_bundle(new_bundle).decision.decision
        comparison = diff_bundles(incident, new_bundle)
        verdict, outcome = comparison.verdict, comparison.outcome
        changed = tuple(change.item for change in comparison.changes)
        if new_decision != CONTINUE:
            reasons.append(f"the incident step's new bundle is {new_decision}")
        if verdict != ONE_MECHANISM_CHANGED or outcome != FIXED:
            shown = verdict if outcome is None else f"{verdict}, {outcome}"
            reasons.append(f"the diff against the incident is {shown}")
    ran_after = [n for n in steps_run if n > through]
    if hold is None and len(ran_after) < then:
        reasons.append(f"{len(ran_after)} of {then} steps after the incident ran")
    warnings = tuple(
        (int(line["step"]), str(warning["code"]))
        for line in telemetry
        if int(line["step"]) >= through
        for warning in line.get("warnings", [])
    )
    after = [warning for warning in warnings if warning[0] > through]
    if len(after) > max_warnings:
        reasons.append(f"{len(after)} warnings after the incident step (at most {max_warnings})")
    point = loaded.point
    record = RecoveryRecord(
        point=point_path,
        point_id=point.point_id,
        point_step=point.step,
        run_id=run_id,
        incident=str(incident),
        incident_step=through,
        incident_owner=owner,
        change=description,
        steps_run=steps_run,
        held_at=hold.step if hold is not None else None,
        warnings=warnings,
        before=_trend(telemetry, lambda n: n < through),
        after=_trend(telemetry, lambda n: n >= through),
        digests_match=loaded.digests_match,
        new_bundle=str(new_bundle) if new_bundle is not None else None,
        new_decision=new_decision,
        diff_verdict=verdict,
        diff_outcome=outcome,
        changed_items=changed,
        reasons=tuple(reasons),
        max_warnings=max_warnings,
    )
    document = json.dumps(record_document(record), indent=2, sort_keys=False) + "\n"
    atomic_write(target / RECORD_NAME, document.encode())
    return record
