"""Incident sets (spec section 11): one step of a job, one bundle per rank, one answer.

Each member is judged as a bundle first; :func:`judge_set` then applies the set
rules to the members' verdicts and what they declare, and says which ranks the
symptom showed on first (the origin). Members judged here and members read
back from ``check --format json`` reports (``merge``) are the same record, so
both ways give the same answer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nanrunbook._version import __version__
from nanrunbook.codes import INCIDENT_SET_CODES as CODES
from nanrunbook.contract import (
    ACTIONS,
    CONTINUE,
    CONTRACT_VERSION,
    HOLD,
    NO_NONFINITE_ACTION,
    ROOT_CAUSE_CLAIM,
    STAGE_ORDER,
)
from nanrunbook.errors import Violation
from nanrunbook.exits import Exit
from nanrunbook.manifest.declared import Declared
from nanrunbook.records import NO_ORIGIN, ORIGINS, origin_of
from nanrunbook.verdict.judgement import Judgement
from nanrunbook.verdict.report import Report, path_text, rejection_document, report_document

__all__ = [
    "CODES",
    "MAX_LISTED_RANKS",
    "ORIGINS",
    "REJECTED",
    "SET_REPORT_FORMAT",
    "CheckOutcome",
    "IncidentSet",
    "SetMember",
    "SetViolation",
    "judge_set",
    "member_document",
    "rank_list",
    "reference_value",
    "set_document",
]

SET_REPORT_FORMAT = "nanrunbook-set-report/1"
REJECTED = "REJECTED"
# Missing ranks are listed one by one up to this many; past it (no real job is
# that large, but world_size is any integer >= 1) runs are written first-last,
# so the answer stays bounded.
MAX_LISTED_RANKS = 1 << 20


@dataclass(frozen=True, slots=True)
class SetMember:
    """One member's verdict and what it declares."""

    name: str  # its directory name as shown: quoted unless plain
    declared: Declared
    decision: str  # HOLD, CONTINUE_BOUNDED_DIAGNOSTICS or REJECTED
    earliest_nonfinite_stage: str | None
    first_nonfinite_tensor: str | None
    contract_content_id: str | None  # the contract it was judged under; None if unknown
    violations: tuple[Violation, ...]  # a rejected member's; () when accepted
    document: Mapping[str, Any] = field(compare=False)  # its full report, as JSON has it
    report: Report | None = field(default=None, compare=False)  # when judged here
    warnings: tuple[str, ...] = ()  # its early-warning codes, in the report's order

    @classmethod
    def of(cls, name: str, judgement: Judgement) -> SetMember:
        """The member ``name`` (as shown) from its bundle's judgement."""
        declared = judgement.declared
        content_id = judgement.contract_content_id
        if judgement.report is not None:
            report = judgement.report
            decision = report.decision
            return cls(
                name,
                declared,
                decision.decision,
                decision.earliest_nonfinite_stage,
                decision.first_nonfinite_tensor,
                content_id,
                (),
                report_document(report),
                report,
                tuple(warning.code for warning in report.warnings),
            )
        assert judgement.rejection is not None
        error = judgement.rejection
        document = rejection_document(error, judgement.bundle, content_id, declared)
        return cls(name, declared, REJECTED, None, None, content_id, error.violations, document)

    @property
    def rank(self) -> int | None:
        return self.declared.rank

    def verdict_only(self) -> SetMember:
        """This member without its report: its verdict, what it declares and its
        bundle (what a text or kv answer shows of it), so that a set's members
        can be judged by the thousand and their reports let go."""
        bundle = self.document.get("bundle")
        document = {} if bundle is None else {"bundle": bundle}
        return replace(self, document=document, report=None)

    @property
    def accepted(self) -> bool:
        return self.decision != REJECTED


@dataclass(frozen=True, slots=True)
class SetViolation:
    """A reason the set is rejected: about the whole set (``member`` None), about
    one member (``path`` None), or one of a rejected member's own violations."""

    code: str
    member: str | None
    path: str | None
    message: str

    @property
    def where(self) -> str:
        if self.member is None:
            return "."
        return self.member if self.path is None else f"{self.member}/{self.path}"


@dataclass(frozen=True, slots=True)
class RunIncident:
    """One member of a directory that looks like a run directory: an incident of
    its own, at ``step``, to be checked on its own at ``bundle``."""

    step: int | None
    member: str  # its name as shown
    decision: str
    bundle: str


@dataclass(frozen=True, slots=True)
class IncidentSet:
    """The set's verdict (spec section 11)."""

    path: str | None  # the set directory; None when merged from reports
    merged_from: tuple[str, ...]  # the report files of a merge
    contract_content_id: str
    members: tuple[SetMember, ...]  # in name order
    run_id: str | None
    step: int | None
    world_size: int | None  # None when no member declares one
    ranks: tuple[int, ...]  # the distinct ranks the members declare, ascending
    missing: tuple[range, ...]  # runs of missing ranks, ascending
    decision: str
    earliest_nonfinite_stage: str | None
    origin_ranks: tuple[int, ...]
    origin: str
    action: str | None  # None when REJECTED
    violations: tuple[SetViolation, ...]  # why it is REJECTED; () otherwise
    # Subdirectories that are not members but hold bundles one level down (a set
    # nested in this one): not judged, as spec section 11 ignores them; named so
    # that nobody takes this answer for theirs.
    nested_sets: tuple[str, ...] = ()
    root_cause_claim: str = ROOT_CAUSE_CLAIM
    contract_version: str = CONTRACT_VERSION
    report_format: str = SET_REPORT_FORMAT

    @property
    def exit_code(self) -> int:
        return {HOLD: Exit.HOLD, CONTINUE: Exit.CONTINUE}.get(self.decision, Exit.REJECTED)

    def exit_code_for(self, *, fail_on_warnings: bool = False) -> int:
        """The exit code; a CONTINUE whose members warn is WARNINGS (5) when the
        caller asked to fail on warnings. A HOLD stays HOLD."""
        if fail_on_warnings and self.decision == CONTINUE and any(m.warnings for m in self.members):
            return Exit.WARNINGS
        return self.exit_code

    @property
    def run_incidents(self) -> tuple[RunIncident, ...]:
        """The members by step when the checked directory looks like a run
        directory rather than one incident set, else (). The sentinel writes a
        single-rank run's incidents as ``incident/<run>/<step>/``: checked,
        ``incident/<run>/`` is a set by spec section 11 (and its verdict stands),
        but its members are single-rank bundles of one run that differ in step or
        are named by their step, as the sentinel names them: incidents, each a
        whole answer on its own. (A multi-rank run's steps are sets, not members;
        ranks of one step that disagree on it are a broken set, not a run.)"""
        declared = [member.declared for member in self.members]
        runs = {d.run_id for d in declared if d.run_id is not None}
        steps = {d.step for d in declared if d.step is not None}
        named_by_step = all(m.name == str(m.declared.step) for m in self.members)
        if (
            not self.members
            or len(runs) > 1
            or not all(d.world_size == 1 for d in declared)
            or not (len(steps) > 1 or named_by_step)
        ):
            return ()
        incidents = (
            RunIncident(m.declared.step, m.name, m.decision, str(m.document.get("bundle", "")))
            for m in self.members
        )
        return tuple(sorted(incidents, key=lambda i: (i.step is None, i.step or 0, i.member)))

    @property
    def ranks_present(self) -> int:
        return len(self.ranks)

    @property
    def rejected_members(self) -> int:
        return sum(1 for member in self.members if not member.accepted)

    @property
    def missing_count(self) -> int:
        return sum(len(run) for run in self.missing)

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        """Every missing rank (as many as the world size: see ``missing`` for runs)."""
        return tuple(rank for run in self.missing for rank in run)


def judge_set(
    members: Sequence[SetMember],
    *,
    contract_content_id: str,
    path: str | None = None,
    merged_from: Sequence[str] = (),
    unlisted: str | None = None,
    nested_sets: Sequence[str] = (),
) -> IncidentSet:
    """The set's answer from its members' verdicts (spec section 11); ``unlisted``
    says why the set's members could not be listed, if they could not;
    ``nested_sets`` names the subdirectories holding bundles one level down,
    which are not members (see :attr:`IncidentSet.nested_sets`)."""
    members = tuple(sorted(members, key=lambda m: m.name))
    violations = _set_violations(members, unlisted)
    world_size = reference_value(members, lambda m: m.declared.world_size)
    ranks = tuple(sorted({m.rank for m in members if m.rank is not None}))
    missing = _missing_runs(ranks, world_size) if world_size is not None else ()
    holds = [m for m in members if m.decision == HOLD]
    complete = world_size is not None and not missing and all(m.accepted for m in members)
    if not violations and holds:
        decision = HOLD
    elif not violations and complete:
        decision = CONTINUE
    else:
        decision = REJECTED
        violations += _incomplete(members, world_size, missing)
    stage, origin_ranks, origin = (
        _origin(holds, world_size) if decision == HOLD else (None, (), NO_ORIGIN)
    )
    action = {HOLD: ACTIONS[stage] if stage else None, CONTINUE: NO_NONFINITE_ACTION}
    return IncidentSet(
        path=path,
        merged_from=tuple(merged_from),
        contract_content_id=contract_content_id,
        members=members,
        run_id=reference_value(members, lambda m: m.declared.run_id),
        step=reference_value(members, lambda m: m.declared.step),
        world_size=world_size,
        ranks=ranks,
        missing=missing,
        decision=decision,
        earliest_nonfinite_stage=stage,
        origin_ranks=origin_ranks,
        origin=origin,
        action=action.get(decision),
        violations=tuple(violations),
        nested_sets=tuple(nested_sets),
    )


def reference_value(members: Sequence[SetMember], value_of: Callable[[SetMember], Any]) -> Any:
    """The value most members declare (on a tie, the first member's in name order);
    None when none declares one. The set's run, step and world size, and the value
    a member that disagrees is told it differs from."""
    counts: Counter[Any] = Counter()
    first: dict[Any, int] = {}
    for index, value in enumerate(map(value_of, members)):
        if value is not None:
            counts[value] += 1
            first.setdefault(value, index)
    if not counts:
        return None
    return max(counts, key=lambda v: (counts[v], -first[v]))


_AGREEMENT: tuple[tuple[str, str, Callable[[SetMember], Any]], ...] = (
    ("SET_CONTRACT_MISMATCH", "contract_version", lambda m: m.declared.contract_version),
    ("SET_CONTRACT_MISMATCH", "the contract judged under", lambda m: m.contract_content_id),
    ("SET_RUN_MISMATCH", "run.run_id", lambda m: m.declared.run_id),
    ("SET_STEP_MISMATCH", "run.step", lambda m: m.declared.step),
    ("SET_WORLD_SIZE_MISMATCH", "world_size", lambda m: m.declared.world_size),
)


def _set_violations(members: Sequence[SetMember], unlisted: str | None) -> list[SetViolation]:
    """What rejects the set whatever its members say."""
    if not members:
        message = "the set holds no member bundle (a subdirectory with manifest.json)"
        if unlisted is not None:
            message = f"the set directory cannot be listed: {unlisted}"
        return [SetViolation("SET_EMPTY", None, None, message)]
    found: list[SetViolation] = []
    for code, what, value_of in _AGREEMENT:
        reference = reference_value(members, value_of)
        agreeing = sum(1 for m in members if value_of(m) == reference)
        for member in members:
            value = value_of(member)
            if value is not None and value != reference:
                message = (
                    f"{what} {value} differs from {reference}, declared by {agreeing} "
                    f"member{'s' if agreeing != 1 else ''}: not one incident set"
                )
                found.append(SetViolation(code, member.name, None, message))
    first_of: dict[int, str] = {}
    for member in members:
        if member.rank is None:
            continue
        if member.rank in first_of:
            message = f"rank {member.rank} is also declared by {first_of[member.rank]}"
            found.append(SetViolation("SET_RANK_DUPLICATE", member.name, None, message))
        else:
            first_of[member.rank] = member.name
    return found


def _missing_runs(ranks: Sequence[int], world_size: int) -> tuple[range, ...]:
    """Runs of the ranks in 0..world_size-1 that no member declares; bounded by the
    number of members, whatever the world size."""
    runs: list[range] = []
    expected = 0
    for rank in ranks:
        if rank >= world_size:
            break
        if rank > expected:
            runs.append(range(expected, rank))
        expected = rank + 1
    if expected < world_size:
        runs.append(range(expected, world_size))
    return tuple(runs)


def rank_list(runs: Sequence[range], *, listed: int = MAX_LISTED_RANKS) -> str:
    """Ranks as spec section 11 writes them, ascending and comma-separated; past
    ``listed`` ranks, each run of two or more is written first-last."""
    if not runs:
        return "none"
    if sum(len(run) for run in runs) <= listed:
        return ",".join(str(rank) for run in runs for rank in run)
    return ",".join(str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}" for r in runs)


def _incomplete(
    members: Sequence[SetMember], world_size: int | None, missing: Sequence[range]
) -> list[SetViolation]:
    """Why a set without a set violation cannot continue: missing ranks and
    rejected members, with each rejected member's own violations."""
    found: list[SetViolation] = []
    if members and world_size is None:
        message = "no member declares a readable topology: every rank is missing"
        found.append(SetViolation("SET_RANKS_MISSING", None, None, message))
    elif missing:
        count = sum(len(run) for run in missing)
        shown = rank_list(missing, listed=16)
        message = f"{count} of {world_size} ranks are declared by no member: {shown}"
        found.append(SetViolation("SET_RANKS_MISSING", None, None, message))
    for member in members:
        found.extend(
            SetViolation(v.code, member.name, v.where, v.message) for v in member.violations
        )
    return found


def _origin(holds: Sequence[SetMember], world_size: int | None) -> tuple[str, tuple[int, ...], str]:
    """The earliest stage among accepted HOLD members, the ranks that show it, and
    how many of the world they are."""
    stage = min(
        (m.earliest_nonfinite_stage for m in holds if m.earliest_nonfinite_stage),
        key=STAGE_ORDER.index,
    )
    ranks = tuple(
        sorted(m.rank for m in holds if m.earliest_nonfinite_stage == stage and m.rank is not None)
    )
    return stage, ranks, origin_of(ranks, world_size)


def set_document(result: IncidentSet) -> dict[str, Any]:
    """The set's JSON document: the answer, then each member's full report."""
    listed = result.missing_count <= MAX_LISTED_RANKS and result.world_size is not None
    return {
        "report_format": result.report_format,
        "tool": {"name": "nanrunbook", "version": __version__},
        "contract_version": result.contract_version,
        "contract_content_id": result.contract_content_id,
        "set": None if result.path is None else path_text(result.path),
        "merged_from": [path_text(p) for p in result.merged_from],
        "run": {"run_id": result.run_id, "step": result.step},
        "world_size": result.world_size,
        "ranks_present": result.ranks_present,
        "ranks": list(result.ranks),
        "missing_ranks": list(result.missing_ranks) if listed else None,
        "missing_rank_runs": [[run.start, run.stop - 1] for run in result.missing],
        "rejected_members": result.rejected_members,
        "decision": result.decision,
        "earliest_nonfinite_stage": result.earliest_nonfinite_stage,
        "origin_ranks": list(result.origin_ranks),
        "origin": result.origin,
        "action": result.action,
        "root_cause_claim": result.root_cause_claim,
        "exit_code": result.exit_code,
        "violations": [
            {"code": v.code, "where": v.where, "message": v.message} for v in result.violations
        ],
        "members": [member_document(m) for m in result.members],
        "nested_sets": list(result.nested_sets),
        "run_directory": _run_directory_document(result),
    }


def _run_directory_document(result: IncidentSet) -> dict[str, Any] | None:
    incidents = result.run_incidents
    if not incidents:
        return None
    return {
        "run_id": result.run_id,
        "incidents": [
            {"step": i.step, "member": i.member, "decision": i.decision, "bundle": i.bundle}
            for i in incidents
        ],
    }


def member_document(member: SetMember) -> dict[str, Any]:
    """A member's entry in its set's JSON document: its verdict, then its whole report."""
    return {
        "name": member.name,
        "rank": member.rank,
        "decision": member.decision,
        "earliest_nonfinite_stage": member.earliest_nonfinite_stage,
        "first_nonfinite_tensor": member.first_nonfinite_tensor,
        "warnings": list(member.warnings),
        "report": dict(member.document),
    }


# What ``nanrunbook check`` answers for one path: a bundle's judgement or a set's verdict.
CheckOutcome = Judgement | IncidentSet
