"""HOLD or CONTINUE_BOUNDED_DIAGNOSTICS, from checked stage findings (spec section 8).

:func:`decide` trusts nothing it is handed: frozen dataclasses can still be
altered with ``object.__setattr__``, so it revalidates every invariant the
decision rests on before it answers, and rejects records that contradict
themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanrunbook.codes import DECISION_CODES as CODES
from nanrunbook.contract import ACTIONS, CONTINUE, HOLD, NO_NONFINITE_ACTION, ROOT_CAUSE_CLAIM
from nanrunbook.errors import EvidenceRejected, Violation
from nanrunbook.manifest.rules import counts_violations, found_inf_violations, sequence_violations
from nanrunbook.records import Counts, Decision, Scaler, StageFinding, StageRecord, TensorFinding

__all__ = ["CODES", "decide", "finding_violations"]


def _inconsistent(where: str, message: str) -> Violation:
    return Violation("RECORD_INCONSISTENT", where, message)


def finding_violations(stages: Sequence[StageFinding]) -> list[Violation]:
    """Every invariant of the findings that the decision depends on."""
    path = "$.stages"
    if not isinstance(stages, tuple | list) or not all(
        isinstance(s, StageFinding) and isinstance(s.record, StageRecord) for s in stages
    ):
        return [_inconsistent(path, "expected a sequence of StageFinding records")]
    found = sequence_violations(stages, path)
    for index, stage in enumerate(stages):
        where = f"{path}[{index}]"
        if stage.status not in ("OBSERVED", "NOT_RUN"):
            found.append(_inconsistent(f"{where}.status", "status is OBSERVED or NOT_RUN"))
            continue
        if stage.status == "NOT_RUN":
            if stage.counts is not None or stage.tensors:
                found.append(_inconsistent(where, "a NOT_RUN stage carries no counts or tensors"))
            continue
        if not isinstance(stage.counts, Counts):
            found.append(_inconsistent(f"{where}.counts", "an OBSERVED stage has counts"))
            continue
        found.extend(counts_violations(stage.counts, f"{where}.counts"))
        found.extend(_source_violations(stage, where))
    return found


def _source_violations(stage: StageFinding, where: str) -> list[Violation]:
    counts = stage.counts
    assert counts is not None
    if stage.counts_source == "declared":
        if counts != stage.record.counts:
            return [_inconsistent(f"{where}.counts", "declared counts differ from the record's")]
        return []
    if stage.counts_source != "recounted":
        return [_inconsistent(f"{where}.counts_source", "counts are recounted or declared")]
    tensors: Sequence[TensorFinding] = stage.tensors
    counts_of = [t.counts for t in tensors]
    # The types as a set, in C: "None in counts_of" would call each record's __eq__.
    if len(tensors) != len(stage.record.tensors) or not set(map(type, counts_of)) <= {Counts}:
        return [_inconsistent(f"{where}.tensors", "a recounted stage has counts for every tensor")]
    found: list[Counts] = counts_of  # type: ignore[assignment]
    rows = [(c.elements, c.finite, c.nan, c.posinf, c.neginf) for c in found]
    total = tuple(map(sum, zip(*rows, strict=True))) if rows else (0, 0, 0, 0, 0)
    if total != (counts.elements, counts.finite, counts.nan, counts.posinf, counts.neginf):
        return [_inconsistent(f"{where}.counts", "stage counts are not the sum of its tensors'")]
    return []


def decide(stages: Sequence[StageFinding], scaler: Scaler | None = None) -> Decision:
    """The decision for five checked stages; EvidenceRejected if they contradict
    themselves or, when the run's ``scaler`` is given, its found_inf."""
    problems = finding_violations(stages)
    if scaler is not None and not problems:
        problems = found_inf_violations(scaler, stages, "$")
    if problems:
        raise EvidenceRejected(problems)
    for stage in stages:
        if stage.status == "OBSERVED" and stage.counts is not None and stage.counts.nonfinite:
            return Decision(
                decision=HOLD,
                earliest_nonfinite_stage=stage.stage,
                first_nonfinite_tensor=stage.first_nonfinite_tensor,
                action=ACTIONS[stage.stage],
                root_cause_claim=ROOT_CAUSE_CLAIM,
            )
    return Decision(
        decision=CONTINUE,
        earliest_nonfinite_stage=None,
        first_nonfinite_tensor=None,
        action=NO_NONFINITE_ACTION,
        root_cause_claim=ROOT_CAUSE_CLAIM,
    )
