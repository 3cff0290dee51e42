"""The replay checklist: what an on-call engineer does after the verdict.

Plain data, so every renderer shows the same steps. The stage-specific section
comes first when a stage is named: the earliest non-finite stage is where
replay starts, not where the cause must be.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanrunbook.contract import STAGE_ORDER

__all__ = ["SECTIONS", "STAGE_STEPS", "Section", "Step", "checklist", "find_step"]


@dataclass(frozen=True, slots=True)
class Step:
    """A runbook step. ``fact`` is, in a report's checklist, the bundle's evidence the
    step refers to in a few words: the one-line form of ``detail`` a screen has room
    for (empty in the whole runbook, which names no bundle)."""

    id: str
    title: str
    detail: str
    fact: str = ""


@dataclass(frozen=True, slots=True)
class Section:
    """One part of the runbook (containment, replay, hardening...) and its steps."""

    id: str
    title: str
    steps: tuple[Step, ...]


SECTIONS: tuple[Section, ...] = (
    Section(
        "containment",
        "Containment",
        (
            Step(
                "hold-the-update",
                "Hold the update",
                "Stop the optimizer from applying this step's update and pause checkpoint "
                "promotion; a NaN written into weights spreads to every later step.",
            ),
            Step(
                "preserve-the-boundary",
                "Preserve the boundary",
                "Keep this bundle, the batch, the loader cursor and the random state exactly as "
                "captured; replay needs the same inputs, not similar ones.",
            ),
            Step(
                "mark-last-known-good",
                "Mark the last known-good state",
                "Pin the checkpoint whose model, optimizer, scheduler, scaler and data position "
                "were verified together; nothing after it is trusted.",
            ),
            Step(
                "choose-replay-authority",
                "Choose replay authority",
                "Name one owner who decides how the step is replayed and when training resumes; "
                "parallel uncoordinated replays destroy the evidence.",
            ),
        ),
    ),
    Section(
        "mixed-precision",
        "Mixed-precision order",
        (
            Step(
                "autocast",
                "Autocast the forward and loss only",
                "Run forward and loss under autocast; keep the backward call and the optimizer "
                "step outside it, with master weights in the param dtype.",
            ),
            Step(
                "scale-before-backward",
                "Scale before backward",
                "Call backward on scaler.scale(loss), never on the raw loss, so small fp16 "
                "gradients do not underflow.",
            ),
            Step(
                "unscale-before-inspection",
                "Unscale before clipping or inspection",
                "Call scaler.unscale_(optimizer) before clipping, logging or probing gradients; "
                "scaled magnitudes are not the real ones.",
            ),
            Step(
                "step-after-qualification",
                "Step only after qualification",
                "Let scaler.step skip the update when it found inf, then scaler.update; a skipped "
                "step is evidence of overflow, not recovery.",
            ),
        ),
    ),
    Section(
        "replay",
        "Replay",
        (
            Step(
                "reproduce-without-update",
                "Reproduce without an update",
                "Replay the failing step from the last known-good state on copies of model, "
                "optimizer and scaler (nanrunbook.capture.torch.replay_step) and confirm the "
                "same earliest non-finite stage.",
            ),
            Step(
                "shrink-the-graph",
                "Shrink the graph",
                "Cut the replay down to the smallest batch slice and module subset that still "
                "goes non-finite at the same boundary.",
            ),
            Step(
                "change-one-mechanism",
                "Change one mechanism at a time",
                "Alter one thing per replay (fp32 instead of autocast, a lower scale, another "
                "batch, another kernel) and record the outcome of each.",
            ),
            Step(
                "inspect-upstream-extremes",
                "Inspect upstream finite extremes",
                "Look at the largest finite magnitudes in the stages before the first non-finite "
                "one: a value near its dtype's limit is where overflow starts.",
            ),
            Step(
                "prove-recovery",
                "Prove recovery",
                "Resume only after a replay with the fix passes several steps with every "
                "boundary finite and a fresh bundle checks CONTINUE.",
            ),
        ),
    ),
    Section(
        "hardening",
        "Hardening",
        (
            Step(
                "guard-boundaries",
                "Guard the five boundaries",
                "Count non-finite elements at input, forward, loss, backward and optimizer "
                "every step and capture a bundle automatically on the first one.",
            ),
            Step(
                "verify-checkpoints-together",
                "Verify checkpoints together",
                "Checkpoint model, optimizer, scheduler, scaler and data position as one unit "
                "and verify them together, so a known-good state exists.",
            ),
            Step(
                "alert-on-scale-collapse",
                "Alert on scale collapse",
                "Alert when the dynamic loss scale backs off repeatedly; repeated skipped steps "
                "are a slow incident.",
            ),
            Step(
                "gate-resume-on-check",
                "Gate resume on the check",
                "Make restart scripts run nanrunbook check on a fresh bundle and refuse to "
                "resume on HOLD or a rejection.",
            ),
        ),
    ),
    Section(
        "bounded-diagnostics",
        "Bounded diagnostics (after CONTINUE)",
        (
            Step(
                "read-continue",
                "Read CONTINUE as bounded",
                "Every captured element is finite: nothing in this evidence needs holding, "
                "and nothing in it explains the alert. The verdict covers only the five "
                "boundaries of one step on one rank.",
            ),
            Step(
                "look-at-warnings",
                "Look at the warnings",
                "A finite value at or near its dtype's limit, or beyond what the compute dtype "
                "holds, is where the next overflow starts; warnings name the tensor.",
            ),
            Step(
                "check-other-signals",
                "Check other signals",
                "Find where the non-finite alert came from: another step, another rank, the "
                "loss logging or reduction path, or evaluation.",
            ),
            Step(
                "keep-capturing",
                "Keep capturing",
                "Keep the five boundaries guarded so the next non-finite step leaves a bundle, "
                "and compare it with this one.",
            ),
        ),
    ),
)

STAGE_STEPS: dict[str, Section] = {
    "input": Section(
        "stage-input",
        "Input stage specifics",
        (
            Step(
                "validate-batch",
                "Validate the batch against the data contract",
                "Recount the batch tensors, check value ranges, label ids and masks, and load the "
                "same sample ids from the data and loader cursor bindings.",
            ),
            Step(
                "reload-samples",
                "Reload the same samples",
                "Load the batch again from the loader cursor with the captured random state "
                "and confirm the same tensor is non-finite before any model code runs.",
            ),
            Step(
                "trace-preprocessing",
                "Trace preprocessing",
                "Input is the first boundary: nothing upstream of it was captured. Look for a "
                "log of zero, a division by a zero standard deviation or a corrupt shard "
                "upstream of the loader; quarantine the shard, do not skip silently.",
            ),
        ),
    ),
    "forward": Section(
        "stage-forward",
        "Forward stage specifics",
        (
            Step(
                "first-module",
                "Find the first non-finite module",
                "Replay the forward with hooks in execution order; the first non-finite "
                "activation names a module, not a cause.",
            ),
            Step(
                "forward-in-fp32",
                "Replay the forward in fp32",
                "Disable autocast for the replay: if it stays finite, look at overflow in "
                "reduced precision (attention logits, exp, large matmul sums).",
            ),
        ),
    ),
    "loss": Section(
        "stage-loss",
        "Loss stage specifics",
        (
            Step(
                "objective-reduction",
                "Inspect the objective and its reduction",
                "Check the reduction in the objective binding: a mean over zero valid elements "
                "(every label masked) is 0/0; a log of a zero probability is -inf.",
            ),
            Step(
                "loss-in-fp32",
                "Compute the loss in fp32 from logits",
                "Use the fused log-softmax losses on logits, not log of probabilities, and "
                "compute them in fp32.",
            ),
        ),
    ),
    "backward": Section(
        "stage-backward",
        "Backward stage specifics",
        (
            Step(
                "gradient-path",
                "Inspect the gradient path",
                "Start from the first non-finite gradient in capture order and the finite "
                "extremes of the forward activations that feed it.",
            ),
            Step(
                "loss-scaling",
                "Check loss scaling",
                "Compare the scaler's found_inf with the captured gradients, and the scale "
                "before and after; scaled gradients are divided by the scale before any "
                "threshold.",
            ),
        ),
    ),
    "optimizer": Section(
        "stage-optimizer",
        "Optimizer stage specifics",
        (
            Step(
                "optimizer-state",
                "Inspect optimizer state",
                "Look at second-moment estimates near zero with a small eps, state kept in "
                "reduced precision, and the learning rate the scheduler gave this step.",
            ),
            Step(
                "update-size",
                "Inspect the update it would apply",
                "Compare the proposed update with the parameters: finite gradients with a "
                "non-finite update point at the optimizer, not the model.",
            ),
        ),
    ),
}


def checklist(stage: str | None = None) -> tuple[Section, ...]:
    """The runbook; with a stage, that stage's specifics first."""
    if stage is None:
        return SECTIONS
    if stage not in STAGE_ORDER:
        raise ValueError(f"unknown stage {stage!r}")
    return (STAGE_STEPS[stage], *SECTIONS)


def find_step(step_id: str) -> Step:
    """The runbook's step with this id (ids are unique across the runbook)."""
    for section in (*SECTIONS, *STAGE_STEPS.values()):
        for step in section.steps:
            if step.id == step_id:
                return step
    raise KeyError(step_id)
