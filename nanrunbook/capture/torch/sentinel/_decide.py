"""The sentinel's decision at each step, between the backward and the update.

One host read brings the step's losses, its gradient check (the norm clipping
computed, the scaler's found_inf, or a fused norm), the previous update's flag
and, on a sampled step, exact magnitudes. From them an :class:`Outcome`:
update, let the GradScaler skip (its probing), skip or hold (non-finite loss or
gradients), or roll back the previous update. Under several ranks the outcome
is agreed first.

:class:`StepDecider` owns the decision's state (the step whose update runs, the
one whose flag is unread, the early warnings, the snapshot, the warnings
carried to the next line, the telemetry file, the last known-good state) and is
given each step to decide on; :class:`Decision` is what the Sentinel's
wrappers act on. The Sentinel constructs it and keeps none of that state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch

from nanrunbook.capture.facts import LoopFacts
from nanrunbook.capture.incident import SentinelHold, incident_attempt
from nanrunbook.capture.telemetry import (
    EarlyWarnings,
    TelemetryFile,
    Thresholds,
    alert,
    divergence_alerts,
    finite_or_none,
    headroom_bits,
    magnitude_alerts,
    norm_overflow_alerts,
)
from nanrunbook.capture.torch._convert import safetensors_dtype
from nanrunbook.capture.torch._shards import local_view
from nanrunbook.capture.torch.replay import add_weight, heaviest
from nanrunbook.capture.torch.sentinel._capture import (
    Captured,
    StepCapture,
    StepObjects,
    capture_step,
)
from nanrunbook.capture.torch.sentinel._checks import (
    Counted,
    Readout,
    exact_counts,
    gradients,
    joined,
)
from nanrunbook.capture.torch.sentinel._fsdp import (
    OwnGradients,
    capture_sharded_step,
)
from nanrunbook.capture.torch.sentinel._ranks import LocalGradients, Outcome, Proposal, Ranks
from nanrunbook.capture.torch.sentinel._snapshot import Buffers, StateSnapshot, reset_scaler_step
from nanrunbook.capture.torch.sentinel._steps import GradFindings, StepRecord, grad_probe
from nanrunbook.telemetry.record import TelemetryRecord, TelemetryWarning, headroom_code

__all__ = ["Decision", "Policy", "StepDecider", "Transient", "scaler_found_inf"]

log = logging.getLogger("nanrunbook.sentinel")
# What the decision does with a non-finite step, and with one its replay did not reproduce.
Policy = Literal["hold", "skip"]
Transient = Literal["hold", "rerun"]
GO, STOP = True, False


@dataclass(frozen=True)
class Decision:
    """What the Sentinel's wrappers do with a decided step."""

    update: bool  # optimizer.step() runs (GO) or is skipped (STOP)
    scaler_skips: bool  # the GradScaler found inf: it skips optimizer.step() itself


class StepDecider:
    """The per-step decision and the state only it uses; the Sentinel gives it
    each step (:meth:`decide`), the update's end (:meth:`updated`) and the
    moments the last update must be known finite (:meth:`resolve_pending`)."""

    def __init__(
        self,
        *,
        objects: StepObjects,
        facts: LoopFacts,
        ranks: Ranks,
        policy: Policy,
        transient: Transient,
        thresholds: Thresholds,
        incident_dir: Path,
        local: LocalGradients | OwnGradients | None,
        sharded: bool,
        snapshot: StateSnapshot | None,
        telemetry: TelemetryFile | None,
        capture_steps: frozenset[int],
    ) -> None:
        self.objects, self.facts, self.ranks = objects, facts, ranks
        self.policy, self.transient, self.thresholds = policy, transient, thresholds
        self.incident_dir = incident_dir
        self.capture_steps = capture_steps  # steps whose bundle is captured whatever the verdict
        self.captured: dict[int, Path] = {}  # their bundles
        self.last_known_good: dict[str, Any] = dict(facts.start)
        self.last_known_good_recovery = "stated"  # "verified": a point the tool verified
        self.pending: StepRecord | None = None  # updated, its flag not read yet
        self._decided: StepRecord | None = None  # decided, its update running
        self._params = [p for g in objects.optimizer.param_groups for p in g["params"]]
        weights: dict[str, int] = {}
        for param in self._params:
            add_weight(weights, param)
        self._grad_dtype = heaviest(weights)
        self._local, self.sharded = local, sharded  # sharded: FSDP2, the checks read local shards
        self._snapshot, self._telemetry = snapshot, telemetry
        self._held = False  # an agreed hold: no rank votes again until the next step
        self._early = EarlyWarnings(thresholds)
        self._carry: list[TelemetryWarning] = []  # warnings for the next line
        self._logged_codes: set[str] = set()
        self._sample_next = False  # the output's headroom is below watch_output_bits

    # ------------------------------------------------------- the Sentinel's

    def sampled(self, number: int) -> bool:
        """Step ``number`` measures exact magnitudes: every ``sample_every`` steps,
        and every step while the output's headroom is low (read at the last step)."""
        every = self.thresholds.sample_every
        return every > 0 and (number % every == 0 or self._sample_next)

    def warn_next(self, warning: TelemetryWarning) -> None:
        """On the line of the last step when it is still unwritten, else the next's."""
        (self.pending.warnings if self.pending is not None else self._carry).append(warning)

    def known_good(self, state: dict[str, Any], recovery: str) -> None:
        """The last known-good state from now on, ``stated`` by the loop or
        ``verified`` by the tool."""
        self.last_known_good, self.last_known_good_recovery = state, recovery

    def close(self) -> None:
        if self._telemetry is not None:
            self._telemetry.close()

    # ------------------------------------------------------------- the read

    def decide(self, step: StepRecord, *, scaler_path: bool) -> Decision:
        """The step's one read (and, with several ranks, its one collective), then:
        go on with the update, or not (a hold raises SentinelHold)."""
        self._decided = step
        update = self._decide(step, scaler_path)
        return Decision(update, step.grads.found_inf is True)

    def _decide(self, step: StepRecord, scaler_path: bool) -> bool:
        self._held = False
        previous, self.pending = self.pending, None
        readout = Readout()
        grads: list[Any] = []
        flags: list[Any] = []
        failure: Exception | None = None
        try:
            grads = gradients(self._params)
            if self.sharded:
                grads = local_view(grads)  # each rank checks its shards: no collective
            found_inf = scaler_found_inf(self.objects) if scaler_path else None
            flags = self._pack(readout, step, previous, grads, found_inf)
        except Exception as error:
            if not self.ranks.several:
                raise
            failure = error  # the others wait in the vote: vote, agree, then raise
        vote = self.ranks.vote(flags, failed=failure is not None)
        voted = vote is not None
        update_ok, outcome = True, Outcome("healthy")
        if failure is None:
            try:
                if vote is not None:
                    readout.add("vote", vote)
                values = readout.read()
                voted = vote is not None and values["vote"][0] > 0
                update_ok = previous.read_update(values) if previous is not None else True
                if previous is not None and update_ok:
                    self._weights(previous)
                # A step run on a non-finite update is discarded: no exact count for it.
                self._read_step(step, values, grads, count=update_ok)
                outcome = self._outcome(step, update_ok)
            except Exception as error:
                if not self.ranks.several:
                    raise
                failure = error
                voted = vote is not None and float(vote.item()) > 0
        device = step.losses[0].device
        if failure is not None:
            try:
                self._fail(failure, step, previous, device, voted)
            finally:
                del failure  # as in _fail: no cycle through the traceback
        proposal = self._propose(step, previous, outcome, update_ok, voted)
        agreed = self.ranks.agree(proposal, device) if voted else proposal
        if agreed.update and previous is not None:
            return self._update_incident(previous, "", step, agreed, own=not update_ok)
        if previous is not None:
            self._finish(previous)
        if outcome.kind == "healthy" and step.number in self.capture_steps:
            self._capture_healthy(step)
        return self._apply(step, outcome, agreed)

    def _capture_healthy(self, step: StepRecord) -> None:
        """The bundle of a step asked for (``capture_steps``) that goes on: its
        replay on copies, before the update (a proof of recovery needs the
        incident step's bundle whatever its verdict). The replay starts from the
        buffers before the forward, as a held step's does; the run goes on with
        the ones its forward wrote (a BatchNorm's running statistics of this step).
        Its capsule is written now, while the real state is still the pre-step
        state (the update comes after the decision)."""
        forward = Buffers(self.objects.model)  # the loop model's own buffers
        step.buffers.restore()
        try:
            captured = self._capture_with(
                capture_step,
                step,
                None,
                capsule=not self.sharded,  # a sharded capsule is not written yet
                requested=True,
            )
        finally:
            forward.restore()  # and whatever the replay's compute_loss touched is undone
        if captured.bundle is not None:
            self.captured[step.number] = captured.bundle

    def _capture_with(
        self,
        capture: Callable[[StepCapture], Captured],
        step: StepRecord,
        attempt: int | None,
        *,
        peer: bool = False,
        policy: str = "hold",
        capsule: bool = True,
        requested: bool = False,
    ) -> Captured:
        """``capture`` (``capture_step`` or the sharded one) of ``step`` into this
        run's incident directory as this rank, with the recovery detail."""
        request = StepCapture(
            objects=self.objects,
            facts=self.facts,
            step=step,
            last_known_good=self.last_known_good,
            root=self.incident_dir,
            rank=self.ranks.member,
            attempt=attempt,
            topology=self._topology(),
            recovery={"last_known_good_recovery": self.last_known_good_recovery},
            peer=peer,
            policy=policy,
            capsule=capsule,
            requested=requested,
        )
        return capture(request)

    def _fail(
        self,
        failure: Exception,
        step: StepRecord,
        previous: StepRecord | None,
        device: Any,
        voted: bool,
    ) -> NoReturn:
        """This rank could not check its step (an out-of-memory, a dtype the checks
        refuse): it holds the others, takes part in the collectives of their hold
        and raises its error. Without a vote of its own (the read failed after
        a vote of 0) the others go on, and the job's next collective fails."""
        self._held = True
        if voted:
            agreed = self.ranks.agree(Proposal("hold", failed=True), device)
            held = previous if agreed.update and previous is not None else step
            attempt = agreed.previous_attempt if held is previous else agreed.attempt
            self.ranks.origin(None, None, self._incident_key(held, attempt))
        log.error("step %d: this rank could not check its step: %s", step.number, failure)
        try:
            raise failure
        finally:
            # The error's traceback holds this frame: holding the error in turn
            # would be a cycle that keeps the model (and its process group) alive
            # until a garbage collection, perhaps none before interpreter shutdown.
            del failure

    def _may_skip(self, skips: int = 1) -> bool:
        """The skip policy allows ``skips`` more skipped steps."""
        return self.policy == "skip" and self._early.skips + skips <= self.thresholds.skip_hold

    def _propose(
        self,
        step: StepRecord,
        previous: StepRecord | None,
        outcome: Outcome,
        update_ok: bool,
        voted: bool,
    ) -> Proposal:
        """This rank's action (and what decides the others'), before any state
        changes: under several ranks it is agreed before anyone acts on it."""
        stuck = self._snapshot is None or not self._snapshot.taken
        if not update_ok:
            action = "skip" if self._may_skip() and not stuck else "hold"
        elif outcome.kind == "incident":
            action = "skip" if self._may_skip() else "hold"
        else:
            action = outcome.kind  # healthy, probe, hold
        attempt = previous_attempt = 0
        if voted and self.ranks.several:  # the incident directory every rank would use
            root, run, member = self.incident_dir, self.facts.run_id, self.ranks.member
            attempt = incident_attempt(root, run, step.number, member)
            if previous is not None:
                previous_attempt = incident_attempt(root, run, previous.number, member)
        return Proposal(action, not update_ok, stuck, False, attempt, previous_attempt)

    def _incident_key(self, step: StepRecord, attempt: int | None) -> str:
        """The name of an agreed hold among the ranks (the store's keys)."""
        return f"{self.facts.run_id}/{step.number}.{attempt or 0}"

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
            flags.append(step.clip.checked)
        if found_inf is not None:
            flags.append(torch.where(found_inf > 0, math.inf, 0.0))
        local = self._local.take() if self._local is not None else None
        if local is not None:
            readout.add("local_grad", local)
            flags.append(local)
        step.pack_losses(readout)
        flags += step.losses
        step.pack_outputs(readout)
        if self.objects.scaler is not None:
            readout.add("scale", self.objects.scaler._get_scale_async())
        step.sampled_names = step.pack_sampled(readout, grads) if step.sampler else []
        return flags

    def _read_step(
        self, step: StepRecord, values: dict[str, list[float]], grads: list[Any], count: bool
    ) -> None:
        step.loss_values = values["loss"]
        step.scale = values["scale"][0] if "scale" in values else self.objects.loss_scale
        groups = self.objects.optimizer.param_groups
        group = groups[0] if groups else {}
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
        findings.bounds_from = "tensor_norm" if findings.bounds else None
        clip = step.clip
        if "norm" in values and clip is not None and clip.bounds_every_gradient(self._params):
            norm = values["norm"][0]
            if math.isfinite(norm):  # the norm clipping computed bounds every dtype's max abs
                findings.bounds = dict.fromkeys(_dtype_names(grads), norm)
                findings.bounds_from = "total_norm"
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
            top = max((c.max_abs for c in findings.counts if c.max_abs is not None), default=None)
            step.warnings += norm_overflow_alerts(top)
        step.grads = findings
        step.read_activations(values)
        step.warnings += magnitude_alerts("activations (sampled)", step.activation_extremes(values))
        self._read_outputs(step, values)

    def _read_outputs(self, step: StepRecord, values: dict[str, list[float]]) -> None:
        """The model's reduced-precision output, read every step: its headroom
        warns, and while it is low every step is sampled."""
        step.read_outputs(values)
        output = step.output
        if output is None:
            self._sample_next = False
            return
        step.warnings += magnitude_alerts("model output", [(output.max_abs, output.dtype)])
        bits = output.headroom_bits
        self._sample_next = bool(output.nonfinite) or (
            bits is not None and bits < self.thresholds.watch_output_bits
        )

    def _weights(self, previous: StepRecord) -> None:
        """The weight norm the previous update left (its flag), into its detector."""
        previous.warnings += divergence_alerts(
            self._early, "weight_norm", previous.number, previous.weight_norm
        )

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
                collective = self._local.collective if self._local is not None else "all-reduce"
                counts += (
                    f"; this rank's own gradients were finite before the {collective}"
                    if grads.local_finite
                    else f"; already in this rank's own gradients, before the {collective}"
                )
            return Outcome("incident", f"non-finite gradients: {counts}", "backward")
        return Outcome("healthy")

    def _scaler_outcome(self, step: StepRecord, counts: str) -> Outcome:
        """A GradScaler overflow is its designed probing; it holds only after
        ``backoff_hold`` in a row or below the scale floor."""
        assert step.scale is not None
        after = step.scale * self.objects.scaler.get_backoff_factor()
        backoffs = self._early.backoffs + 1
        if backoffs >= self.thresholds.backoff_hold:
            return Outcome(
                "hold", f"{backoffs} GradScaler overflow skips in a row ({counts})", "backward"
            )
        if after < self.thresholds.scale_floor:
            reason = f"the loss scale would fall to {after:g}, below the floor ({counts})"
            return Outcome("hold", reason, "backward")
        return Outcome("probe", counts, "backward")

    def _apply(self, step: StepRecord, outcome: Outcome, agreed: Proposal) -> bool:
        step.warnings += divergence_alerts(self._early, "loss", step.number, step.loss)
        if agreed.action == "healthy":
            return self._healthy(step)
        if self.objects.scaler is not None and step.scale is not None and step.grads.found_inf:
            after = step.scale * self.objects.scaler.get_backoff_factor()
            step.warnings += self._early.scaler(True, step.scale, after)
        if agreed.action == "probe":
            step.warnings += self._early.skipped(True)
            reason = outcome.reason or "another rank's GradScaler overflowed"
            log.info("step %d: GradScaler skipped the update (%s)", step.number, reason)
            self._finish(step, skipped=True)
            return GO  # the scaler skips optimizer.step() itself and backs off
        return self._incident(step, outcome, agreed)

    def _healthy(self, step: StepRecord) -> bool:
        grads = step.grads
        step.warnings += self._early.gradient_norm(grads.norm)
        step.warnings += divergence_alerts(self._early, "grad_norm", step.number, grads.norm)
        step.warnings += magnitude_alerts("gradients", [(c.max_abs, c.dtype) for c in grads.counts])
        if step.scale is not None and self.objects.scaler is not None:
            step.warnings += self._early.scaler(False, step.scale, step.scale)
        step.warnings += self._early.skipped(False)
        step.updated = [p for p in self._params if p.grad is not None]
        if self.sharded:
            step.updated = local_view(step.updated)  # the update flag reads the local shards
        if step.sampler is not None:
            step.before = [p.detach().clone() for p in step.updated]
        if self._snapshot is not None:
            self._snapshot.take()
        if step.clip is not None:
            step.clip.apply()
        return GO

    def _incident(self, step: StepRecord, outcome: Outcome, agreed: Proposal) -> bool:
        """Non-finite values the update must not see: nothing steps, the buffers
        the forward wrote are put back; skip (recorded) or hold, as agreed."""
        self._stand_down(step)
        step.warnings += self._early.skipped(True)
        skips = self._early.skips
        mine = outcome.kind in ("incident", "hold")
        reason = outcome.reason if mine else "another rank's values went non-finite"
        if agreed.failed:
            reason += "; another rank could not check its step and raised"
        if agreed.action == "skip":
            log.warning("step %d skipped: %s", step.number, reason)
            self._finish(step, skipped=True)
            return STOP
        if self.policy == "skip" and outcome.kind == "incident" and not self._may_skip(0):
            reason += f"; {skips} consecutive skipped steps"
        stage = outcome.stage if mine else None
        hold = self._hold(step, reason, stage, agreed.attempt)
        if hold is None:  # not reproduced, and the policy re-runs: skipped, recorded
            return STOP
        raise hold

    def _stand_down(self, step: StepRecord) -> None:
        step.buffers.restore()
        if self.objects.scaler is not None:  # the other optimizers' stand
            reset_scaler_step(self.objects.scaler, self.objects.optimizer)
        step.stood_down = True

    def _hold(
        self,
        step: StepRecord,
        reason: str,
        stage: str | None,
        attempt: int = 0,
        skipped: StepRecord | None = None,
    ) -> SentinelHold | None:
        """Capture the step's bundle, write its line (and the line of ``skipped``,
        the step run on it), then exchange the ranks' verdicts (after the lines:
        a hold whose exchange fails still left them); the exception to raise.
        None under ``transient="rerun"`` (one process) when the replay did not
        reproduce the live step: the step is skipped, its evidence kept."""
        self._held = True
        several = self.ranks.several
        rerun = self.transient == "rerun" and not several  # one process: no second vote
        # No copy of an FSDP2 module: the live held step's evidence.
        capture = capture_sharded_step if self.sharded else capture_step
        captured = self._capture_with(
            capture,
            step,
            attempt if several else None,
            peer=stage is None,  # only another rank's outcome names no stage
            policy="rerun" if rerun else "hold",
        )
        step.buffers.restore()  # whatever the replay's compute_loss touched
        report = captured.report
        decision = report.decision if report is not None else None
        found = decision.earliest_nonfinite_stage if decision is not None else stage
        reproduced = captured.reproduced
        if reproduced is not None and not reproduced.reproduced and rerun:
            self._not_reproduced(step, captured, reproduced, skipped)
            return None
        verdict = reproduced.verdict if reproduced is not None else None
        self._finish(step, held=True, bundle=captured.bundle, reproduced=verdict)
        if skipped is not None:
            self._finish(skipped, skipped=True)
        origin = self.ranks.origin(
            decision.decision if decision else None, found, self._incident_key(step, attempt)
        )
        return SentinelHold(
            step=step.number,
            reason="; ".join((reason, *captured.notes)),
            stage=found,
            bundle=captured.bundle,
            report=report,
            last_known_good=self.last_known_good,
            capture_error=captured.error,
            origin_ranks=origin if several else None,
            reproduced=reproduced,
            capsule=captured.capsule,
            capsule_error=captured.capsule_error,
        )

    def _not_reproduced(
        self, step: StepRecord, captured: Any, reproduced: Any, skipped: StepRecord | None
    ) -> None:
        """The re-run (the replay from the same state and random state) came out
        finite where the live step did not: a transient fault. The step stays
        skipped (its update was never applied), its bundle and capsule kept."""
        self._held = False
        message = (
            f"step {step.number} skipped, not held: {reproduced.line()}; bundle {captured.bundle}"
        )
        log.warning("%s", message)
        step.warnings.append(alert("STEP_NOT_REPRODUCED", message))
        self._finish(step, skipped=True, bundle=captured.bundle, reproduced=reproduced.verdict)
        if skipped is not None:
            self._finish(skipped, skipped=True)

    def _topology(self) -> dict[str, Any] | None:
        """The bundle's topology: the job's rank and size, with the voting group's."""
        ranks = self.ranks
        if not ranks.distributed:
            return None
        return {"group_rank": ranks.group_rank, "group_size": ranks.group_size}

    # ----------------------------------------------------------- the update

    def updated(self) -> None:
        """The decided step's update ran: its flag is read at the next decision."""
        step = self._decided
        if step is None:
            return
        step.watch_update(step.updated, step.before)
        step.before = None
        self.pending = step

    def resolve_pending(self, last_step: int, checkpointing: str | None = None) -> None:
        """Read the last update's flag now (one read; with several ranks, one
        vote, which every rank casts at the same call); a non-finite one holds.
        ``last_step``: the run's last decided step."""
        previous, self.pending = self.pending, None
        if self._held or (previous is None and not self.ranks.several):
            return  # after an agreed hold every rank is here without a vote
        readout = Readout()
        flags = []
        if previous is not None:
            previous.pack_update(readout)
            flags.append(previous.update_flag)
        vote = self.ranks.vote(flags)
        if vote is not None:
            readout.add("vote", vote)
        values = readout.read()
        update_ok = previous.read_update(values) if previous is not None else True
        voted = vote is not None and values["vote"][0] > 0
        if update_ok and not voted:
            if previous is not None:
                self._weights(previous)
                self._finish(previous)
            return
        stuck = self._snapshot is None or not self._snapshot.taken
        attempt = 0
        if voted and previous is not None:
            attempt = incident_attempt(
                self.incident_dir, self.facts.run_id, previous.number, self.ranks.member
            )
        proposal = Proposal("hold", not update_ok, stuck, False, 0, attempt)
        agreed = self.ranks.agree(proposal, vote.device) if voted else proposal
        if previous is None:  # a rank that had no step to check: the others hold
            self._held = True
            key = f"{self.facts.run_id}/{last_step}.{agreed.previous_attempt}"
            self.ranks.origin(None, None, key)
            return
        note = f"checkpoint {checkpointing} was saved after it" if checkpointing else ""
        self._update_incident(previous, note, None, agreed, own=not update_ok)

    def _update_incident(
        self,
        previous: StepRecord,
        note: str,
        current: StepRecord | None,
        agreed: Proposal,
        own: bool,
    ) -> bool:
        """Some rank's update of the previous step is non-finite (``own``: this
        rank's). Every rank rolls it back from its snapshot (and skips the
        current step, run on it), so the replicas stay equal; a rank without one
        holds contaminated; a hold holds on every rank."""
        update = previous.update
        if own:
            counts = (
                f"{update.nan} NaN, {update.posinf} +inf, {update.neginf} -inf"
                if update
                else "unknown"
            )
            reason = f"non-finite update after optimizer.step(): {counts} in the parameters"
        else:
            reason = "another rank's update after optimizer.step() went non-finite"
        reason += f"; {note}" if note else ""
        if current is not None:
            self._stand_down(current)  # it ran on the parameters the update wrote
        if self._snapshot is None or not self._snapshot.taken:
            raise self._contaminated(previous, current, reason, agreed.previous_attempt)
        self._snapshot.restore()
        previous.buffers.restore()
        previous.warnings += self._early.skipped(True)
        if agreed.action == "skip" and not agreed.stuck:
            log.warning("step %d rolled back: %s", previous.number, reason)
            self._finish(previous, skipped=True)
            if current is not None:
                current.warnings += self._early.skipped(True)
                self._finish(current, skipped=True)
            return STOP
        reason += "; rolled back to the pre-step snapshot"
        hold = self._hold(previous, reason, "optimizer", agreed.previous_attempt, skipped=current)
        if hold is None:
            return STOP
        raise hold

    def _contaminated(
        self, previous: StepRecord, current: StepRecord | None, reason: str, attempt: int
    ) -> SentinelHold:
        self._held = True
        self._finish(previous, held=True)
        if current is not None:
            self._finish(current, skipped=True)
        origin = self.ranks.origin(None, "optimizer", self._incident_key(previous, attempt))
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
            capsule_error="the real state holds the non-finite update (no snapshot): no capsule"
            " is written, nothing can replay the step bit for bit",
        )

    # ------------------------------------------------------------- the line

    def _finish(
        self,
        step: StepRecord,
        *,
        skipped: bool = False,
        held: bool = False,
        bundle: Path | None = None,
        reproduced: str | None = None,
    ) -> None:
        warnings = [*self._carry, *step.warnings]
        self._carry = []
        for warning in warnings:
            if warning.code not in self._logged_codes:  # a streak is logged once, when it starts
                log.warning("step %d: %s: %s", step.number, warning.code, warning.message)
        self._logged_codes = {warning.code for warning in warnings}
        if self._telemetry is None:
            return
        grad = step.grads.telemetry(self._grad_dtype)
        record = TelemetryRecord(
            run_id=self.facts.run_id,
            rank=self.ranks.rank,
            world_size=self.ranks.world_size,
            step=step.number,
            time=step.time,
            loss=step.loss,
            loss_class=step.loss_class,
            grad=grad,
            update=step.update,
            scale=finite_or_none(step.scale),
            found_inf=step.grads.found_inf,
            skipped=skipped,
            held=held,
            warnings=tuple(warnings),
            bundle=str(bundle) if bundle is not None else None,
            activations=step.activations,
            lr=finite_or_none(step.lr),
            grad_headroom_from=step.grads.headroom_from(grad),
            weight_norm=step.weight_norm,
            output=step.output,
            reproduced=reproduced,
        )
        self._telemetry.append(record)


def scaler_found_inf(objects: StepObjects) -> Any:
    """The GradScaler's found_inf of the loop's optimizer, its devices' flags
    summed where the read is made (None: no flag yet)."""
    states = objects.scaler._per_optimizer_states[id(objects.optimizer)]
    flags = list(states["found_inf_per_device"].values())
    return torch.stack(joined(flags)).sum() if flags else None


def _dtype_names(grads: list[Any]) -> list[str]:
    """The safetensors names of the floating gradients' dtypes, once each."""
    names = (safetensors_dtype(g.dtype) for g in grads if g.is_floating_point())
    return list(dict.fromkeys(name for name in names if name is not None))


def _near_max(findings: GradFindings) -> bool:
    """The per-tensor norms bound max abs: within 1 bit of a dtype's largest
    value, measure it exactly rather than warn on a bound."""
    return any(
        headroom_code(headroom_bits(bound, dtype)) is not None
        for dtype, bound in findings.bounds.items()
    )
