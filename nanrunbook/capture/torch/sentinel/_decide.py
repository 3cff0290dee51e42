"""The sentinel's decision at each step, between the backward and the update.

One host read brings the step's losses, its gradient check (the norm clipping
computed, the scaler's found_inf, or a fused norm), the previous update's flag
and, on a sampled step, exact magnitudes. From them an :class:`Outcome`:
update, let the GradScaler skip (its probing), skip or hold (non-finite loss or
gradients), or roll back the previous update. Under several ranks the outcome
is agreed first. A mixin of :class:`~.sentinel.Sentinel`, whose state it uses.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture.facts import LoopFacts
from nanrunbook.capture.incident import SentinelHold
from nanrunbook.capture.telemetry import (
    Alert,
    EarlyWarnings,
    StepTelemetry,
    TelemetryFile,
    Thresholds,
    headroom_bits,
    magnitude_alerts,
)
from nanrunbook.capture.torch.sentinel._capture import StepObjects, capture_step
from nanrunbook.capture.torch.sentinel._checks import Counted, Readout, exact_counts, gradients
from nanrunbook.capture.torch.sentinel._ranks import LocalGradients, Outcome, Ranks
from nanrunbook.capture.torch.sentinel._snapshot import StateSnapshot, reset_scaler_step
from nanrunbook.capture.torch.sentinel._steps import GradFindings, StepRecord, grad_probe

__all__ = ["Decisions"]

log = logging.getLogger("nanrunbook.sentinel")
GO, STOP = True, False


class Decisions:
    """The per-step decision; the attributes it uses are the Sentinel's."""

    # Set by Sentinel.__init__ (declared for readers and type checkers).
    optimizer: Any
    scaler: Any
    loss_scale: float | None
    policy: str
    thresholds: Thresholds
    facts: LoopFacts
    objects: StepObjects
    ranks: Ranks
    incident_dir: Path
    last_known_good: dict[str, Any]
    last_step: int
    _params: list[Any]
    _local: LocalGradients | None
    _grad_dtype: str | None
    _step: StepRecord | None
    _pending: StepRecord | None
    _decided: StepRecord | None
    _skip_update: bool
    _skip_scheduler: bool
    _early: EarlyWarnings
    _snapshot: StateSnapshot | None
    _telemetry: TelemetryFile | None
    _carry: list[Alert]
    _logged_codes: set[str]

    # ------------------------------------------------------------- the read

    def _decide(self, *, scaler_path: bool) -> bool:
        """The step's one read (and, with several ranks, its one collective), then:
        go on with the update, or not."""
        step = self._step
        if step is None or not step.micro:
            raise RuntimeError(
                "optimizer.step() without sentinel.forward(batch) since the last step:"
                " route the loop's forward through the sentinel"
            )
        self._step, self._decided, self.last_step = None, step, step.number
        previous, self._pending = self._pending, None
        readout = Readout()
        grads = gradients(self._params)
        found_inf = self._found_inf() if scaler_path else None
        flags = self._pack(readout, step, previous, grads, found_inf)
        vote = self.ranks.vote(flags)
        if vote is not None:
            readout.add("vote", vote)
        values = readout.read()
        update_ok = previous.read_update(values) if previous is not None else True
        # A step run on a non-finite update is discarded: no exact count for it.
        self._read_step(step, values, grads, count=update_ok)
        outcome = self._outcome(step, update_ok)
        if vote is not None and values["vote"][0] > 0:
            outcome = self.ranks.agree(outcome, step.losses[0].device)
        if outcome.kind == "update" and previous is not None:
            return self._update_incident(previous, outcome.reason, current=step)
        if previous is not None:
            self._finish(previous)
        return self._apply(step, outcome)

    def _pack(
        self,
        readout: Readout,
        step: StepRecord,
        previous: StepRecord | None,
        grads: list[Any],
        found_inf: Any,
    ) -> list[Any]:
        """Everything the read brings; returns the values a rank votes on."""
        flags = []
        if previous is not None:
            previous.pack_update(readout)
            flags.append(previous.update_flag)
        norms = grad_probe(readout, grads, step.clip, found_inf)
        if norms is not None:
            flags.append(norms.total)
        elif step.clip is not None:
            flags.append(step.clip.total)
        if found_inf is not None:
            flags.append(torch.where(found_inf > 0, math.inf, 0.0))
        local = self._local.take() if self._local is not None else None
        if local is not None:
            readout.add("local_grad", local)
            flags.append(local)
        step.pack_losses(readout)
        flags += step.losses
        if self.scaler is not None:
            readout.add("scale", self.scaler._get_scale_async())
        step.sampled_names = step.pack_sampled(readout, grads) if step.sampler else []
        return flags

    def _found_inf(self) -> Any:
        per_device = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        flags = list(per_device.values())
        return torch.stack([f.to(flags[0].device) for f in flags]).sum() if flags else None

    def _read_step(
        self, step: StepRecord, values: dict[str, list[float]], grads: list[Any], count: bool
    ) -> None:
        step.loss_values = values["loss"]
        step.scale = values["scale"][0] if "scale" in values else self.loss_scale
        group = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        lr = group.get("lr")
        step.lr = float(lr) if isinstance(lr, float | int) and not isinstance(lr, bool) else None
        findings = GradFindings()
        if "found_inf" in values:
            findings.found_inf = values["found_inf"][0] > 0
        if "norm" in values:
            norm = values["norm"][0]
            clip = step.clip
            l2 = clip is None or clip.norm_type == 2.0
            findings.norm = norm if math.isfinite(norm) and l2 else None
            findings.tripped = not math.isfinite(norm)
        if "local_grad" in values:
            findings.local_finite = all(math.isfinite(v) for v in values["local_grad"])
        findings.bounds = {
            k.split("/", 1)[1]: v[0] for k, v in values.items() if k.startswith("bound/")
        }
        if not count:
            pass
        elif findings.tripped or findings.found_inf or _near_max(findings):
            findings.counts = exact_counts(grads)  # the slow path: a read of its own
        elif step.sampled_names:  # finite: the sampled maxima are the finite max abs
            findings.counts = [
                Counted(dtype, 0, 0, 0, top)
                for dtype, top in zip(step.sampled_names, values["grad_max"], strict=True)
            ]
        if findings.counts and findings.tripped and not findings.nonfinite:
            findings.tripped = False  # finite values whose squares overflowed
        step.grads = findings
        step.read_activations(values)
        step.warnings += magnitude_alerts("activations (sampled)", step.activation_extremes(values))

    # ---------------------------------------------------------- the outcome

    def _outcome(self, step: StepRecord, update_ok: bool) -> Outcome:
        grads = step.grads
        if not update_ok:
            return Outcome("update", "", "optimizer")
        if step.loss_class != "finite":
            bad = [i for i, v in enumerate(step.loss_values) if not math.isfinite(v)]
            where = f" in micro-batch {bad[0]}" if len(step.micro) > 1 else ""
            return Outcome("incident", f"non-finite loss ({step.loss_class}){where}", "loss")
        counts = (
            f"{grads.nonfinite} non-finite gradient elements"
            f" ({sum(c.nan for c in grads.counts)} NaN, {sum(c.posinf for c in grads.counts)}"
            f" +inf, {sum(c.neginf for c in grads.counts)} -inf)"
        )
        if grads.found_inf:
            return self._scaler_outcome(step, counts)
        if grads.tripped:
            if grads.local_finite is not None:
                counts += (
                    "; this rank's own gradients were finite before the all-reduce"
                    if grads.local_finite
                    else "; already in this rank's own gradients, before the all-reduce"
                )
            return Outcome("incident", f"non-finite gradients: {counts}", "backward")
        return Outcome("healthy")

    def _scaler_outcome(self, step: StepRecord, counts: str) -> Outcome:
        """A GradScaler overflow is its designed probing; it holds only after
        ``backoff_hold`` in a row or below the scale floor."""
        assert step.scale is not None
        after = step.scale * self.scaler.get_backoff_factor()
        backoffs = self._early.backoffs + 1
        if backoffs >= self.thresholds.backoff_hold:
            return Outcome(
                "hold", f"{backoffs} GradScaler overflow skips in a row ({counts})", "backward"
            )
        if after < self.thresholds.scale_floor:
            reason = f"the loss scale would fall to {after:g}, below the floor ({counts})"
            return Outcome("hold", reason, "backward")
        return Outcome("probe", counts, "backward")

    def _apply(self, step: StepRecord, outcome: Outcome) -> bool:
        if outcome.kind == "healthy":
            return self._healthy(step)
        if self.scaler is not None and step.scale is not None and step.grads.found_inf:
            after = step.scale * self.scaler.get_backoff_factor()
            step.warnings += self._early.scaler(True, step.scale, after)
        if outcome.kind == "probe":
            step.warnings += self._early.skipped(True)
            log.info("step %d: GradScaler skipped the update (%s)", step.number, outcome.reason)
            self._finish(step, skipped=True)
            return GO  # the scaler skips optimizer.step() itself and backs off
        return self._incident(step, outcome)

    def _healthy(self, step: StepRecord) -> bool:
        grads = step.grads
        step.warnings += self._early.gradient_norm(grads.norm)
        step.warnings += magnitude_alerts("gradients", [(c.max_abs, c.dtype) for c in grads.counts])
        if step.scale is not None and self.scaler is not None:
            step.warnings += self._early.scaler(False, step.scale, step.scale)
        step.warnings += self._early.skipped(False)
        step.updated = [p for p in self._params if p.grad is not None]
        if step.sampler is not None:
            step.before = [p.detach().clone() for p in step.updated]
        if self._snapshot is not None:
            self._snapshot.take()
        if step.clip is not None:
            step.clip.apply()
        return GO

    def _incident(self, step: StepRecord, outcome: Outcome) -> bool:
        """Non-finite values the update must not see: nothing steps, the buffers
        the forward wrote are put back; skip (recorded) or hold."""
        self._stand_down(step)
        step.warnings += self._early.skipped(True)
        skips = self._early.skips
        may_skip = self.policy == "skip" and outcome.kind == "incident"
        if may_skip and skips <= self.thresholds.skip_hold:
            log.warning("step %d skipped: %s", step.number, outcome.reason)
            self._finish(step, skipped=True)
            return STOP
        reason = outcome.reason + (f"; {skips} consecutive skipped steps" if may_skip else "")
        raise self._hold(step, reason, outcome.stage)

    def _stand_down(self, step: StepRecord) -> None:
        step.buffers.restore()
        if self.scaler is not None:
            reset_scaler_step(self.scaler)
        self._skip_update = self._skip_scheduler = True

    def _hold(self, step: StepRecord, reason: str, stage: str | None) -> SentinelHold:
        """Capture the step's bundle, write its line; the exception to raise."""
        captured = capture_step(
            self.objects,
            self.facts,
            step,
            self.last_known_good,
            self.incident_dir,
            self.ranks.rank if self.ranks.several else None,
        )
        step.buffers.restore()  # whatever the replay's compute_loss touched
        report = captured.report
        decision = report.decision if report is not None else None
        found = decision.earliest_nonfinite_stage if decision is not None else stage
        origin = self.ranks.origin(decision.decision if decision else None, found, step.number)
        self._finish(step, held=True, bundle=captured.bundle)
        return SentinelHold(
            step=step.number,
            reason=reason,
            stage=found,
            bundle=captured.bundle,
            report=report,
            last_known_good=self.last_known_good,
            capture_error=captured.error,
            origin_ranks=origin if self.ranks.several else None,
        )

    # ----------------------------------------------------------- the update

    def _after_update(self) -> None:
        step = self._decided
        if step is None:
            return
        step.watch_update(step.updated, step.before)
        step.before = None
        self._pending = step

    def _resolve_pending(self, checkpointing: str | None = None) -> None:
        """Read the last update's flag now (one read); a non-finite one holds."""
        previous, self._pending = self._pending, None
        if previous is None:
            return
        readout = Readout()
        previous.pack_update(readout)
        if previous.read_update(readout.read()):
            self._finish(previous)
            return
        reason = f"checkpoint {checkpointing} was saved after it" if checkpointing else ""
        self._update_incident(previous, reason, current=None, must_hold=True)

    def _update_incident(
        self,
        previous: StepRecord,
        note: str,
        current: StepRecord | None,
        must_hold: bool = False,
    ) -> bool:
        """The previous step's update is non-finite. With a snapshot it is rolled
        back (and the current step, run on it, skipped); without one the real
        state is contaminated and the run holds."""
        update = previous.update
        counts = (
            f"{update.nan} NaN, {update.posinf} +inf, {update.neginf} -inf" if update else "unknown"
        )
        reason = f"non-finite update after optimizer.step(): {counts} in the parameters"
        reason += f"; {note}" if note else ""
        if current is not None:
            self._stand_down(current)  # it ran on the parameters the update wrote
        if self._snapshot is None or not self._snapshot.taken:
            raise self._contaminated(previous, current, reason)
        self._snapshot.restore()
        previous.buffers.restore()
        previous.warnings += self._early.skipped(True)
        skips = self._early.skips
        if self.policy == "skip" and not must_hold and skips <= self.thresholds.skip_hold:
            log.warning("step %d rolled back: %s", previous.number, reason)
            self._finish(previous, skipped=True)
            if current is not None:
                current.warnings += self._early.skipped(True)
                self._finish(current, skipped=True)
            return STOP
        hold = self._hold(previous, reason + "; rolled back to the pre-step snapshot", "optimizer")
        if current is not None:
            self._finish(current, skipped=True)
        raise hold

    def _contaminated(
        self, previous: StepRecord, current: StepRecord | None, reason: str
    ) -> SentinelHold:
        origin = self.ranks.origin(None, "optimizer", previous.number)  # the others gather
        self._finish(previous, held=True)
        if current is not None:
            self._finish(current, skipped=True)
        return SentinelHold(
            step=previous.number,
            reason=reason,
            stage="optimizer",
            bundle=None,
            report=None,
            last_known_good=self.last_known_good,
            contaminated=True,
            capture_error="no pre-step snapshot to replay from (Sentinel(snapshot=True) keeps one)",
            origin_ranks=origin if self.ranks.several else None,
        )

    # ------------------------------------------------------------- the line

    def _finish(
        self,
        step: StepRecord,
        *,
        skipped: bool = False,
        held: bool = False,
        bundle: Path | None = None,
    ) -> None:
        warnings = [*self._carry, *step.warnings]
        self._carry = []
        for alert in warnings:
            if alert.code not in self._logged_codes:  # a streak is logged once, when it starts
                log.warning("step %d: %s: %s", step.number, alert.code, alert.message)
        self._logged_codes = {alert.code for alert in warnings}
        if self._telemetry is None:
            return
        record = StepTelemetry(
            run_id=self.facts.run_id,
            rank=self.ranks.rank,
            world_size=self.ranks.world_size,
            step=step.number,
            time=step.time,
            loss=step.loss,
            loss_class=step.loss_class,  # type: ignore[arg-type]
            grad=step.grads.telemetry(self._grad_dtype),
            update=step.update,
            scale=step.scale,
            found_inf=step.grads.found_inf,
            skipped=skipped,
            held=held,
            warnings=tuple(warnings),
            bundle=str(bundle) if bundle is not None else None,
            activations=step.activations,
            lr=step.lr,
        )
        self._telemetry.append(record)


def _near_max(findings: GradFindings) -> bool:
    """The per-tensor norms bound max abs: within 1 bit of a dtype's largest
    value, measure it exactly rather than warn on a bound."""
    return any(
        (bits := headroom_bits(bound, dtype)) is not None and bits < 1
        for dtype, bound in findings.bounds.items()
    )
