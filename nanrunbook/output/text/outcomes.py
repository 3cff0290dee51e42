"""Several paths judged each on its own (``check A/ B/ C/``), one line each, in text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import quote
from nanrunbook.output.text._blocks import DECISION_STYLE, grid, show
from nanrunbook.verdict.incident_set import REJECTED, CheckOutcome, IncidentSet, SetViolation

__all__ = ["render_many"]


def render_many(console: Any, outcomes: Sequence[CheckOutcome], exit_code: int) -> None:
    from rich.text import Text

    rows = []
    for outcome in outcomes:
        decision = _outcome_decision(outcome)
        rows.append((Text(decision, DECISION_STYLE.get(decision, "")), _outcome_line(outcome)))
    show(console, grid(rows, indent=0, label_style=""))
    counts = {d: sum(_outcome_decision(o) == d for o in outcomes) for d in DECISION_STYLE}
    tally = ", ".join(f"{n} {d}" for d, n in counts.items() if n)
    show(console, Text(f"{len(outcomes)} checked: {tally}; exit {exit_code}, the most severe"))


def _outcome_decision(outcome: CheckOutcome) -> str:
    if isinstance(outcome, IncidentSet):
        return outcome.decision
    return outcome.report.decision.decision if outcome.report is not None else REJECTED


def _outcome_line(outcome: CheckOutcome) -> str:
    if isinstance(outcome, IncidentSet):
        where = quote(outcome.path) if outcome.path is not None else "merged reports"
        line = f"{where} (incident set, {outcome.ranks_present} of {outcome.world_size} ranks)"
        if outcome.decision == HOLD:
            ranks = ",".join(map(str, outcome.origin_ranks))
            line += (
                f": earliest {outcome.earliest_nonfinite_stage}, origin {outcome.origin} {ranks}"
            )
        return line + _first_violation(outcome.violations)
    where = quote(outcome.bundle)
    if outcome.rejection is not None:
        return where + _first_violation(outcome.rejection.violations)
    assert outcome.report is not None
    decision = outcome.report.decision
    if decision.earliest_nonfinite_stage is None:
        return where
    tensor = decision.first_nonfinite_tensor or "unknown (summary)"
    return f"{where}: earliest {decision.earliest_nonfinite_stage}, first tensor {tensor}"


def _first_violation(violations: Sequence[SetViolation] | Sequence[Any]) -> str:
    if not violations:
        return ""
    more = len(violations) - 1
    first = violations[0]
    return f": {first.code} {first.where}: {first.message}" + (
        f" (and {more} more)" if more else ""
    )
