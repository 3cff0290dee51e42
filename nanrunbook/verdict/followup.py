"""The checklist that follows the verdict and names this bundle's evidence.

``nanrunbook checklist`` prints the whole runbook (:mod:`runbook`). A report
carries only the steps its verdict calls for, in the runbook's words, each
naming the tensors, stages, scale transition and finite extremes it refers to:
in full (``detail``) and in a few words (``fact``, the one-line form a screen
has room for).
A CONTINUE never says "hold the update"; a HOLD at input, the first boundary,
points at the input data contract, not at stages upstream of it.

The checklist is data built here; renderers only show it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nanrunbook.dtypes import DTYPES
from nanrunbook.records import (
    Decision,
    EarlyWarning,
    Headroom,
    Manifest,
    StageFinding,
    TensorFinding,
    TensorHeadroom,
)
from nanrunbook.verdict.precision import closest_to_limit
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import STAGE_STEPS, Section, Step, find_step
from nanrunbook.verdict.wording import (
    counts_phrase,
    number,
    reported_magnitude,
    shape_text,
    stages_before,
)

__all__ = ["checklist_for"]

# Dtypes in which autocast runs reduced precision: a replay in F32 is a real change.
_REDUCED = frozenset({"F16", "BF16"}) | {
    name for name in DTYPES if name.startswith(("F8", "F6", "F4"))
}
_WARNINGS_NAMED = 3  # warnings a step names before "and N more"


@dataclass(frozen=True, slots=True)
class _Evidence:
    """One report's facts, as the checklist refers to them."""

    report: Report

    @property
    def manifest(self) -> Manifest:
        return self.report.manifest

    @property
    def stages(self) -> tuple[StageFinding, ...]:
        return self.report.stages

    @property
    def decision(self) -> Decision:
        return self.report.decision

    @property
    def earliest(self) -> int | None:
        """Index of the earliest non-finite stage, None on CONTINUE."""
        name = self.decision.earliest_nonfinite_stage
        return (
            None if name is None else next(i for i, s in enumerate(self.stages) if s.stage == name)
        )

    def bound(self, item: str) -> str:
        """A binding item's id (every item has one in an accepted manifest)."""
        return self.manifest.binding.ids.get(item, "?")

    def magnitude(self, stage: StageFinding, stored: float) -> str:
        """A stored magnitude as a person reads it; scaled gradients say both."""
        shown = reported_magnitude(stage, stored, self.manifest.binding.scaler)
        assert shown is not None
        if shown == stored:
            return number(stored)
        return f"{number(shown)} unscaled ({number(stored)} as stored)"

    def warnings_before(self, index: int) -> tuple[EarlyWarning, ...]:
        """The report's warnings in stages before ``index`` (they come upstream first)."""
        upstream = {s.stage for s in self.stages[:index]}
        return tuple(w for w in self.report.warnings if w.stage in upstream)


def _step(step_id: str, detail: str, fact: str) -> Step:
    """The runbook's step, its detail and its fact naming this bundle's evidence."""
    return Step(step_id, find_step(step_id).title, detail, fact)


def checklist_for(report: Report) -> tuple[Section, ...]:
    """The sections this verdict calls for, in the order they are worked, naming
    the report's evidence and warnings."""
    evidence = _Evidence(report)
    earliest = evidence.earliest
    if earliest is None:
        return (_bounded_diagnostics(evidence),)
    stage = evidence.stages[earliest]
    specific = STAGE_STEPS[stage.stage]
    first, *rest = _STAGE_BUILDERS[stage.stage](evidence, stage)
    here = [w for w in report.warnings if w.stage == stage.stage]
    if here:
        detail = f"{first.detail} Warnings here: {_named(here)}."
        first = Step(first.id, first.title, detail, first.fact)
    steps = (first, *rest)
    return (
        Section(specific.id, specific.title, steps),
        _containment(evidence),
        _replay(evidence, earliest),
    )


# ---------------------------------------------------------------- the facts named


def _first_tensor(evidence: _Evidence, stage: StageFinding) -> TensorFinding | None:
    name = evidence.decision.first_nonfinite_tensor
    return next((t for t in stage.tensors if t.entry.name == name), None)


def _first_named(evidence: _Evidence, stage: StageFinding) -> str:
    """``grad/w (F16 16x8: 1 -inf of 128 elements)``; a summary has no per-tensor counts."""
    tensor = _first_tensor(evidence, stage)
    if tensor is None or tensor.counts is None:
        assert stage.counts is not None
        return f"{counts_phrase(stage.counts)} in the {stage.stage} summary (no per-tensor counts)"
    entry = tensor.entry
    return f"{entry.name} ({entry.dtype} {shape_text(entry.shape)}: {counts_phrase(tensor.counts)})"


def _first_short(evidence: _Evidence, stage: StageFinding) -> str:
    """The first non-finite tensor's name, or the summary stage it is unknown in."""
    name = evidence.decision.first_nonfinite_tensor
    return name or f"{stage.stage} summary (no per-tensor counts)"


def _first_of_kind(evidence: _Evidence, stage: StageFinding, kind: str) -> str:
    """``X is the first non-finite gradient in capture order``, or why it is unknown."""
    if evidence.decision.first_nonfinite_tensor is None:
        return f"{_first_named(evidence, stage)}: the first non-finite {kind} is unknown"
    return f"{_first_named(evidence, stage)} is the first non-finite {kind} in capture order"


def _symptom(evidence: _Evidence, stage: StageFinding) -> str:
    """What replay must find again: the first tensor, or the stage when it is unknown."""
    name = evidence.decision.first_nonfinite_tensor
    return f"{name} non-finite again" if name else f"{stage.stage} non-finite again"


Peak = tuple[TensorHeadroom, Headroom]  # a tensor, and the dtype limit it comes closest to


def _peak(evidence: _Evidence, indices: range) -> Peak | None:
    """Among these stages' recounted floating tensors, the one closest to a limit:
    its own dtype's largest finite value or, in a stage computed in the compute
    dtype, that dtype's."""
    return closest_to_limit(evidence.report, {evidence.stages[i].stage for i in indices})


def _bits(bits: float) -> str:
    size = abs(bits)
    return f"{size:.2g}" if size < 0.05 else f"{size:.1f}"


def _peak_phrase(evidence: _Evidence, peak: Peak) -> str:
    """``act/x (forward, F16) reached 65504, exactly F16's largest finite value``;
    ``batch/x (input, F32) reached 70354.1, 0.1 bits above F16's max (the compute
    dtype)``."""
    room, limit = peak
    assert limit.bits is not None and room.extremes.max_abs is not None
    whose = f"{limit.dtype}'s"
    if limit.bits == 0:
        where = f"exactly {whose} largest finite value"
    else:
        side = "below" if limit.bits > 0 else "above"
        where = f"{_bits(limit.bits)} bits {side} {whose} max"
    if limit.dtype != room.dtype:
        where += " (the compute dtype)"
    stage = next(s for s in evidence.stages if s.stage == room.stage)
    reached = evidence.magnitude(stage, room.extremes.max_abs)
    return f"{room.tensor} ({room.stage}, {room.dtype}) reached {reached}, {where}"


def _upstream_phrase(evidence: _Evidence, earliest: int) -> str:
    """The finite extreme closest to its limit upstream of the earliest stage and how
    far upstream, as in ``act/encoder.4 (forward, F16) reached 61000, 0.1 bits below
    F16's max, one stage before the first non-finite tensor``."""
    peak = _peak(evidence, range(earliest))
    if peak is None:
        return "no upstream stage holds a recounted finite non-zero floating value"
    target = (
        "the first non-finite tensor"
        if evidence.decision.first_nonfinite_tensor
        else "the first non-finite stage"
    )
    at = next(i for i, s in enumerate(evidence.stages) if s.stage == peak[0].stage)
    distance = stages_before(earliest - at)
    return f"{_peak_phrase(evidence, peak)}, {distance} {target}"


def _upstream_fact(evidence: _Evidence, earliest: int) -> str:
    """``act/x (forward, F32) reached 4, 14.0 bits below F16's max (compute dtype), two
    stages before``: the upstream phrase in fewer words."""
    peak = _peak(evidence, range(earliest))
    if peak is None:
        return "no recounted finite non-zero floating value upstream"
    at = next(i for i, s in enumerate(evidence.stages) if s.stage == peak[0].stage)
    phrase = _peak_phrase(evidence, peak).replace(" (the compute dtype)", " (compute dtype)")
    return f"{phrase}, {stages_before(earliest - at)}"


def _upstream_detail(evidence: _Evidence, earliest: int) -> str:
    upstream = evidence.warnings_before(earliest)
    detail = _upstream_phrase(evidence, earliest) + "."
    return f"{detail} Warnings upstream: {_named(upstream)}." if upstream else detail


def _named(warnings: Sequence[EarlyWarning]) -> str:
    """``AT_DTYPE_MAX at act/x (forward); ...; and 2 more``: code, tensor and stage of
    the first few, in the report's order (upstream first)."""
    named = "; ".join(f"{w.code} at {w.tensor} ({w.stage})" for w in warnings[:_WARNINGS_NAMED])
    rest = len(warnings) - _WARNINGS_NAMED
    return f"{named}; and {rest} more" if rest > 0 else named


# ---------------------------------------------------------------- CONTINUE


def _bounded_diagnostics(evidence: _Evidence) -> Section:
    manifest = evidence.manifest
    binding = manifest.binding
    total = sum(s.counts.elements for s in evidence.stages if s.counts is not None)
    peak = _peak(evidence, range(len(evidence.stages)))
    warnings = evidence.report.warnings
    if warnings:
        count = f"{len(warnings)} warning{'s' if len(warnings) != 1 else ''}"
        extremes = f"{count}, upstream first: {_named(warnings)}."
        first = warnings[0]
        look = f"{count}, first {first.code} at {first.tensor} ({first.stage})"
    elif peak:
        extremes = f"No warning; the value closest to a limit: {_peak_phrase(evidence, peak)}."
        look = f"none; closest to a limit: {_peak_phrase(evidence, peak)}"
    else:
        extremes = "No warning, and no recounted floating tensor holds a non-zero value."
        look = "none, and no recounted floating tensor holds a non-zero value"
    return Section(
        "bounded-diagnostics",
        "Bounded diagnostics",
        (
            _step(
                "read-continue",
                f"All {total} elements captured at the five boundaries of step {manifest.step} "
                f"(rank {binding.rank} of {binding.world_size}) are finite: nothing here needs "
                "holding, and nothing here explains the alert.",
                f"all {total} elements of step {manifest.step} finite "
                f"(rank {binding.rank} of {binding.world_size})",
            ),
            _step("look-at-warnings", extremes, look),
            _step(
                "check-other-signals",
                f"Look for the alert's source outside this evidence: another step than "
                f"{manifest.step}, another rank, the loss logging or reduction path, or "
                "evaluation.",
                f"another step than {manifest.step}, another rank, the loss path, evaluation",
            ),
            _step(
                "keep-capturing",
                "Keep the five boundaries guarded so the next non-finite step leaves a bundle; "
                f"compare it with {manifest.evidence_id}.",
                f"compare the next bundle with {manifest.evidence_id}",
            ),
        ),
    )


# ---------------------------------------------------------------- HOLD: the stage


def _input_steps(evidence: _Evidence, stage: StageFinding) -> tuple[Step, ...]:
    first = _first_named(evidence, stage)
    batch, data = evidence.bound("batch"), evidence.bound("data")
    cursor, state = evidence.bound("loader_cursor"), evidence.bound("random_state")
    return (
        _step(
            "validate-batch",
            f"{first}: check batch {batch} of data {data} for value ranges, label ids and masks.",
            f"{_first_short(evidence, stage)}, batch {batch} of {data}",
        ),
        _step(
            "reload-samples",
            f"Load it again from loader cursor {cursor} with random state {state}; "
            f"expect {_symptom(evidence, stage)}.",
            f"from {cursor} with {state}; expect {_symptom(evidence, stage)}",
        ),
        _step(
            "trace-preprocessing",
            "Input is the first boundary, with nothing upstream: look for a log of zero, a "
            f"zero standard deviation or a corrupt shard of {data}; quarantine it, never skip "
            "silently.",
            f"nothing is upstream of input: a log of 0, a 0 std, a bad shard of {data}",
        ),
    )


def _forward_steps(evidence: _Evidence, stage: StageFinding) -> tuple[Step, ...]:
    compute = evidence.manifest.binding.compute_dtype
    if compute in _REDUCED:
        fp32 = (
            f"The forward ran in {compute}: replay it with autocast off; if it stays finite, "
            "look at overflow in reduced precision (attention logits, exp, large matmul sums)."
        )
        fact = f"it ran in {compute}: replay with autocast off"
    else:
        fp32 = (
            f"The forward already ran in {compute}: precision alone is not the change to "
            "try; look at the module's exp, division, log and large sums."
        )
        fact = f"it already ran in {compute}: look at exp, division, log, large sums"
    return (
        _step(
            "first-module",
            f"{_first_of_kind(evidence, stage, 'activation')}; replay the forward with hooks "
            "in execution order: it names a module, not a cause.",
            f"{_first_short(evidence, stage)}, first non-finite activation: a module, not a cause",
        ),
        _step("forward-in-fp32", fp32, fact),
    )


def _loss_steps(evidence: _Evidence, stage: StageFinding) -> tuple[Step, ...]:
    binding = evidence.manifest.binding
    compute = binding.compute_dtype
    if compute in _REDUCED:
        fp32 = (
            f"The compute dtype was {compute}: compute the loss from logits "
            "with a fused log-softmax loss in F32, not as a log of probabilities."
        )
        fact = f"it ran in {compute}: a fused log-softmax on logits, in F32"
    else:
        fp32 = (
            f"The compute dtype was already {compute}: check that the loss "
            "takes logits through a fused log-softmax, not a log of probabilities."
        )
        fact = f"already {compute}: a fused log-softmax on logits, not log(probabilities)"
    objective = evidence.bound("objective")
    return (
        _step(
            "objective-reduction",
            f"{_first_named(evidence, stage)}: objective {objective} "
            f"reduces by {binding.reduction}; a mean over zero valid elements is 0/0, a log "
            "of a zero probability is -inf.",
            f"{_first_short(evidence, stage)} from {objective}, reduced by {binding.reduction}",
        ),
        _step("loss-in-fp32", fp32, fact),
    )


def _backward_steps(evidence: _Evidence, stage: StageFinding) -> tuple[Step, ...]:
    return (
        _step(
            "gradient-path",
            f"{_first_of_kind(evidence, stage, 'gradient')}: start there, then walk back "
            "through the activations that feed it.",
            f"{_first_short(evidence, stage)} first, then what feeds it",
        ),
        _step("loss-scaling", _scaling_detail(evidence, stage), _scaling_fact(evidence, stage)),
    )


def _scaling_detail(evidence: _Evidence, stage: StageFinding) -> str:
    scaler = evidence.manifest.binding.scaler
    if scaler.mode == "none":
        return (
            f"No loss scale (compute dtype {evidence.manifest.binding.compute_dtype}): "
            "without one, small F16 gradients underflow; the overflow is not the scaler's."
        )
    if scaler.mode == "static":
        transition = f"A static scale of {number(scaler.scale)} multiplies every gradient"
    else:
        assert scaler.scale_after is not None
        transition = (
            f"The scale went {number(scaler.scale)} -> {number(scaler.scale_after)} "
            f"(found_inf {str(scaler.found_inf).lower()})"
        )
        if scaler.step_skipped:
            transition += " and the update was skipped"
    if stage.record.gradients == "scaled":
        return f"{transition}; the gradients were probed scaled: unscale before any threshold."
    return f"{transition}; the gradients were probed after unscale_."


def _scaling_fact(evidence: _Evidence, stage: StageFinding) -> str:
    """``65536 -> 32768, found_inf true, update skipped; probed scaled``."""
    scaler = evidence.manifest.binding.scaler
    if scaler.mode == "none":
        return f"no loss scale, compute dtype {evidence.manifest.binding.compute_dtype}"
    if scaler.mode == "static":
        fact = f"static scale {number(scaler.scale)}"
    else:
        assert scaler.scale_after is not None
        fact = f"{number(scaler.scale)} -> {number(scaler.scale_after)} "
        fact += f"(found_inf {str(scaler.found_inf).lower()}"
        fact += ", skipped)" if scaler.step_skipped else ")"
    return f"{fact}; probed {stage.record.gradients}"


def _optimizer_steps(evidence: _Evidence, stage: StageFinding) -> tuple[Step, ...]:
    gradients = evidence.stages[evidence.stages.index(stage) - 1]
    if gradients.status == "OBSERVED" and gradients.finite_max_abs is not None:
        largest = evidence.magnitude(gradients, gradients.finite_max_abs)
        fed = f"finite gradients (largest {largest})"
    else:
        fed = "gradients that were not captured"
    return (
        _step(
            "optimizer-state",
            f"Optimizer {evidence.bound('optimizer')} turned {fed} into "
            f"{_first_named(evidence, stage)}: look at second moments near zero with a small "
            "eps, state kept in reduced precision, and the learning rate from scheduler "
            f"{evidence.bound('scheduler')}.",
            f"{evidence.bound('optimizer')} turned {fed} into {_first_short(evidence, stage)}",
        ),
        _step(
            "update-size",
            "Compare the proposed update with the parameters: finite gradients with a "
            "non-finite update point at the optimizer, not the model.",
            "against the parameters: finite gradients, non-finite update: the optimizer",
        ),
    )


_STAGE_BUILDERS: dict[str, Callable[[_Evidence, StageFinding], tuple[Step, ...]]] = {
    "input": _input_steps,
    "forward": _forward_steps,
    "loss": _loss_steps,
    "backward": _backward_steps,
    "optimizer": _optimizer_steps,
}


# ---------------------------------------------------------------- HOLD: containment, replay


def _hold_detail(evidence: _Evidence) -> tuple[str, str]:
    """The step's detail and its fact: what happened to this step's update."""
    optimizer = evidence.stages[-1]
    scaler = evidence.manifest.binding.scaler
    step = evidence.manifest.step
    if optimizer.status == "NOT_RUN" and scaler.step_skipped:
        done = f"The scaler skipped optimizer.step() at step {step}: keep it skipped on retry"
        fact = f"keep step {step} skipped"
    elif optimizer.status == "NOT_RUN":
        done = f"The optimizer did not run at step {step}: keep it from running on this evidence"
        fact = f"keep step {step} from running"
    else:
        done = f"The optimizer stage ran to its probe: do not apply its update of step {step}"
        fact = f"do not apply step {step}"
    return f"{done}; pause checkpoint promotion.", f"{fact}; pause checkpoint promotion"


def _containment(evidence: _Evidence) -> Section:
    manifest = evidence.manifest
    lkg = manifest.last_known_good
    stage = evidence.stages[evidence.earliest or 0]
    owner = stage.record.owner
    with_owner = "" if owner == manifest.incident_owner else f", with {owner} ({stage.stage})"
    batch, cursor = evidence.bound("batch"), evidence.bound("loader_cursor")
    state = evidence.bound("random_state")
    recovery = f"{lkg.checkpoint_id} (step {lkg.step}, {_steps_back(manifest.step - lkg.step)})"
    return Section(
        "containment",
        "Containment",
        (
            _step("hold-the-update", *_hold_detail(evidence)),
            _step(
                "preserve-the-boundary",
                f"Keep this bundle, batch {batch}, loader cursor {cursor} and random state "
                f"{state} exactly as captured.",
                f"{batch}, {cursor}, {state}",
            ),
            _step(
                "mark-last-known-good",
                f"{recovery}; nothing after it is trusted.",
                f"{lkg.checkpoint_id}, {_steps_back(manifest.step - lkg.step)}",
            ),
            _step(
                "choose-replay-authority",
                f"Incident owner {manifest.incident_owner} decides how step {manifest.step} "
                f"is replayed{with_owner}.",
                f"{manifest.incident_owner}{with_owner}",
            ),
        ),
    )


def _steps_back(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''} back"


def _replay(evidence: _Evidence, earliest: int) -> Section:
    manifest = evidence.manifest
    if earliest == 0:
        # Bad data is replayed by reloading it (the input steps); there is no graph
        # to shrink and no upstream stage.
        recovery = (
            "Resume only after the repaired or quarantined data passes input finite and a "
            "fresh bundle checks CONTINUE."
        )
        fact = "the repaired data passes input finite and a fresh bundle checks CONTINUE"
        return Section("replay", "Replay", (_step("prove-recovery", recovery, fact),))
    stage = evidence.stages[earliest]
    return Section(
        "replay",
        "Replay",
        (
            _step(
                "reproduce-without-update",
                f"Replay step {manifest.step} from {manifest.last_known_good.checkpoint_id} "
                "on copies (nanrunbook.capture.torch.replay_step); expect "
                f"{_symptom(evidence, stage)}.",
                f"expect {_symptom(evidence, stage)}",
            ),
            _step(
                "inspect-upstream-extremes",
                _upstream_detail(evidence, earliest),
                _upstream_fact(evidence, earliest),
            ),
            _step("change-one-mechanism", *_mechanisms(evidence)),
            _step(
                "prove-recovery",
                "Resume only after the fixed replay runs several steps finite at all five "
                "boundaries and a fresh bundle checks CONTINUE.",
                "several finite steps, then a fresh bundle checks CONTINUE",
            ),
        ),
    )


def _mechanisms(evidence: _Evidence) -> tuple[str, str]:
    """The detail, and the fact: the mechanisms this bundle's binding can change."""
    binding = evidence.manifest.binding
    options, short = [], []
    if binding.compute_dtype in _REDUCED:
        options.append(f"F32 instead of {binding.compute_dtype} autocast")
        short.append(f"F32, not {binding.compute_dtype}")
    if binding.scaler.mode != "none":
        options.append(f"a lower scale than {number(binding.scaler.scale)}")
        short.append(f"scale < {number(binding.scaler.scale)}")
    options.append(f"another batch than {evidence.bound('batch')}")
    short.append("another batch")
    detail = f"One per replay, each outcome recorded: {', '.join(options)}, another kernel."
    return detail, "; ".join(short)
