"""``--format kv``: ``key=value`` lines for shell playbooks (spec section 10).

Only values the contract constrains to a shell-safe alphabet are printed, never
free text from a manifest; untrusted key names in a violation's path become ``[?]``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.contract import CONTRACT_VERSION
from nanrunbook.errors import EvidenceRejected
from nanrunbook.manifest.fields import IDENTIFIER
from nanrunbook.output.base import Renderer
from nanrunbook.verdict.incident_set import (
    REJECTED,
    CheckOutcome,
    IncidentSet,
    SetViolation,
    rank_list,
)
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification
    from nanrunbook.capture.torch.capsule import CapsuleReplay
    from nanrunbook.capture.torch.sharded_replay import ShardedReplay
    from nanrunbook.diff import Comparison, ComparisonRejected
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["KvRenderer", "kv_set_where", "kv_where"]

_SHELL_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=@:,-]+")


def _identifier_or_unknown(value: object) -> str:
    """An identifier as it is, ``none`` for None, anything else ``?``: free text
    is never printed for a shell to read."""
    text = "none" if value is None else str(value)
    return text if IDENTIFIER.fullmatch(text) else "?"


def _path_or_unknown(path: object) -> str:
    """A path of shell-safe characters as it is, else ``?`` (json shows it)."""
    text = str(path)
    return text if _SHELL_SAFE_PATH.fullmatch(text) else "?"


_KV_SAFE_WHERE = re.compile(r"[A-Za-z0-9._/+=@:,\[\]$-]+")
_QUOTED_SEGMENT = re.compile(r"\['(?:[^'\\]|\\.)*'\]|\[\"(?:[^\"\\]|\\.)*\"\]")
_KV_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._/+=@:,\[\]$-]")


def kv_where(where: str) -> str:
    """A violation's path for shell scripts: untrusted key names become ``[?]``."""
    if _KV_SAFE_WHERE.fullmatch(where):
        return where
    return _KV_UNSAFE_CHAR.sub("?", _QUOTED_SEGMENT.sub("[?]", where)) or "?"


def kv_set_where(violation: SetViolation) -> str:
    """A set violation's WHERE (spec section 11): ``.`` for the whole set, else the
    member's name, ``[?]`` unless an identifier, then the violation's own path."""
    if violation.member is None:
        return "."
    name = _member_name(violation.member)
    return name if violation.path is None else f"{name}/{kv_where(violation.path)}"


def _member_name(name: str) -> str:
    """A member's directory name, ``[?]`` unless an identifier: it is untrusted."""
    return name if IDENTIFIER.fullmatch(name) else "[?]"


def _run_directory_lines(result: IncidentSet) -> list[str]:
    """Appended last when the set looks like a run directory: its members' steps,
    in order (``run_directory_steps=13,20``); check each member on its own."""
    incidents = result.run_incidents
    if not incidents:
        return []
    steps = (str(i.step) if i.step is not None else "none" for i in incidents)
    return [f"run_directory_steps={','.join(steps)}"]


def _write(lines: list[str], out: IO[str]) -> None:
    out.write("\n".join(lines) + "\n")


class KvRenderer(Renderer):
    """``key=value`` lines in the spec's fixed order; every value is shell-safe."""

    name = "kv"

    def report(self, report: Report, out: IO[str]) -> None:
        manifest = report.manifest
        decision = report.decision
        lines = [
            f"contract_version={report.contract_version}",
            f"contract_content_id={report.contract_content_id}",
            f"run={manifest.run_id}",
            f"step={manifest.step}",
            f"evidence_id={manifest.evidence_id}",
            f"evidence_content_id={manifest.evidence_content_id}",
            f"earliest_nonfinite={decision.earliest_nonfinite_stage or 'none'}",
            f"decision={decision.decision}",
            f"action={decision.action}",
            f"root_cause_claim={decision.root_cause_claim}",
            # Appended after the spec's lines (section 10 allows it). A tensor name
            # is not shell-safe; its index in the stage is.
            f"warnings={len(report.warnings)}",
            *(f"warning={w.code} {w.stage}#{w.index}" for w in report.warnings),
        ]
        if report.alone is not None:  # appended: one rank of a set, checked alone
            lines += [
                f"set_member_warning={report.alone.warning}",
                f"set_rank={report.alone.rank}",
                f"set_world_size={report.alone.world_size}",
                f"set_path={kv_where(report.alone.set_path)}",
            ]
        _write(lines, out)

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        lines = [
            f"contract_version={CONTRACT_VERSION}",
            f"contract_content_id={contract_content_id}",
            "decision=REJECTED",
            f"violations={len(error.violations)}",
        ]
        lines += [f"violation={v.code} {kv_where(v.where)}" for v in error.violations]
        _write(lines, out)

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        # Section and step ids are the runbook's own identifiers: shell-safe.
        steps = [f"step={section.id}/{step.id}" for section in sections for step in section.steps]
        _write([f"steps={len(steps)}", *steps], out)

    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        lines = [
            f"contract_version={document['contract_version']}",
            f"contract_content_id={content_id}",
            f"bundle_format={document['bundle_format']}",
            f"stage_order={','.join(document['stage_order'])}",
            *(f"action.{stage}={action}" for stage, action in document["actions"].items()),
            f"no_nonfinite_action={document['no_nonfinite_action']}",
            f"root_cause_claim={document['root_cause_claim']}",
            *(f"caps.{name}={value}" for name, value in document["caps"].items()),
            # Numbers only: a pattern bound is not shell-safe (json and text show it).
            *(
                f"bounds.{name}={value}"
                for name, value in document["bounds"].items()
                if isinstance(value, int)
            ),
        ]
        _write(lines, out)

    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        # Binding item names, stage names and fixed words only: never a field value.
        from nanrunbook.diff import ComparisonRejected

        if isinstance(result, ComparisonRejected):
            lines = [
                "verdict=REJECTED",
                f"rejected={','.join(result.sides)}",
                f"violations={len(result.violations)}",
            ]
            lines += [f"violation={v.code} {kv_where(v.where)}" for v in result.violations]
            _write(lines, out)
            return
        base, other = result.base, result.other
        first = result.first_divergence
        lines = [
            f"base_evidence_content_id={base.manifest.evidence_content_id}",
            f"other_evidence_content_id={other.manifest.evidence_content_id}",
            f"base_decision={base.decision.decision}",
            f"other_decision={other.decision.decision}",
            f"base_earliest_nonfinite={base.decision.earliest_nonfinite_stage or 'none'}",
            f"other_earliest_nonfinite={other.decision.earliest_nonfinite_stage or 'none'}",
            f"changed={','.join(result.changed) or 'none'}",
            f"verdict={result.verdict}",
            f"outcome={result.outcome or 'none'}",
            f"first_divergence_stage={first.base_stage if first else 'none'}",
            # appended after the first lines: one content id on both sides, and
            # one directory on both sides (exit 2)
            f"same_evidence={'true' if result.same_evidence else 'false'}",
            f"same_bundle={'true' if result.same_bundle else 'false'}",
        ]
        _write(lines, out)

    def incident_set(self, result: IncidentSet, out: IO[str]) -> None:
        """The lines of spec section 11, in its order; then the members' warnings."""
        lines = [
            f"contract_version={result.contract_version}",
            f"contract_content_id={result.contract_content_id}",
        ]
        if result.decision == REJECTED:
            lines += ["decision=REJECTED", f"violations={len(result.violations)}"]
            lines += [f"violation={v.code} {kv_set_where(v)}" for v in result.violations]
            _write(lines + _run_directory_lines(result), out)
            return
        lines += [
            f"run={result.run_id}",
            f"step={result.step}",
            f"world_size={result.world_size}",
            f"ranks_present={result.ranks_present}",
            f"missing_ranks={rank_list(result.missing)}",
            f"rejected_members={result.rejected_members}",
            f"earliest_nonfinite={result.earliest_nonfinite_stage or 'none'}",
            f"origin_ranks={','.join(map(str, result.origin_ranks)) or 'none'}",
            f"origin={result.origin}",
            f"decision={result.decision}",
            f"action={result.action}",
            f"root_cause_claim={result.root_cause_claim}",
            # Appended after the spec's lines, as a bundle's are: what makes
            # --fail-on-warnings exit 5, member by member in the set's order.
            f"warnings={sum(len(member.warnings) for member in result.members)}",
            *(
                f"warning={code} {_member_name(member.name)}"
                for member in result.members
                for code in member.warnings
            ),
            *_run_directory_lines(result),
        ]
        _write(lines, out)

    def many(self, outcomes: Sequence[CheckOutcome], exit_code: int, out: IO[str]) -> None:
        """``checked=N``, then each path's own lines, as one path prints them, with
        its position in the arguments as a prefix: ``1.decision=HOLD``."""
        lines = [f"checked={len(outcomes)}"]
        for position, outcome in enumerate(outcomes, start=1):
            one = io.StringIO()
            if isinstance(outcome, IncidentSet):
                self.incident_set(outcome, one)
            else:
                self.judgement(outcome, one)
            lines += [f"{position}.{line}" for line in one.getvalue().splitlines()]
        _write(lines, out)

    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        from nanrunbook.output.watch_kv import summary_lines

        _write(summary_lines(summary), out)

    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        from nanrunbook.output.watch_kv import event_value

        out.write(f"event={event_value(event)}\n")
        out.flush()

    def recovery_verification(self, verification: RecoveryVerification, out: IO[str]) -> None:
        # Identifiers and numbers only; the path and the messages are free text.
        lines = [f"recovery_point={'VERIFIED' if verification.verified else 'REJECTED'}"]
        for key in ("point_id", "run_id"):
            value = getattr(verification, key)
            lines.append(f"{key}={value if value and IDENTIFIER.fullmatch(value) else '?'}")
        step = verification.step
        lines += [
            f"step={step if step is not None else '?'}",
            f"files={verification.files}",
            f"bytes={verification.total_bytes}",
            f"violations={len(verification.violations)}",
        ]
        lines += [f"violation={v.code} {kv_where(v.where)}" for v in verification.violations]
        _write(lines, out)

    def recovery_record(self, record: RecoveryRecord, out: IO[str]) -> None:
        safe = _identifier_or_unknown
        lines = [
            f"recovery={'PROVEN' if record.proven else 'NOT_PROVEN'}",
            f"point_id={safe(record.point_id)}",
            f"point_step={record.point_step}",
            f"run_id={safe(record.run_id)}",
            f"incident_step={record.incident_step}",
            f"change={safe(record.change)}",
            f"steps_run={len(record.steps_run)}",
            f"held_at={record.held_at if record.held_at is not None else 'none'}",
            f"digests_match={'true' if record.digests_match else 'false'}",
            f"new_decision={safe(record.new_decision)}",
            f"diff_verdict={safe(record.diff_verdict)}",
            f"diff_outcome={safe(record.diff_outcome)}",
            f"warnings={len(record.warnings)}",
            *(f"warning={step} {code}" for step, code in record.warnings),
            f"reasons={len(record.reasons)}",
            f"reopen_decided_by={safe(record.reopen_decided_by)}",
        ]
        _write(lines, out)

    def replay(self, result: CapsuleReplay, out: IO[str], *, require_fixed: bool = False) -> None:
        """The capsule and the verdicts, then each comparison's own ``diff`` lines
        with a prefix: ``reproduction.verdict=...``, ``change.1.outcome=...``."""
        capsule = result.capsule
        held = capsule.reproduced
        reproduction = result.reproduction
        lines = [
            f"capsule_run={_identifier_or_unknown(capsule.run_id)}",
            f"capsule_step={capsule.step}",
            f"held_process={held.verdict if held is not None else 'none'}",
            f"reproduction={reproduction.verdict if reproduction is not None else 'none'}",
            f"changes={len(result.changes)}",
        ]
        if reproduction is not None:
            lines += [f"reproduction.{line}" for line in self._diff_lines(reproduction)]
        for index, changed in enumerate(result.changes, 1):
            lines += [f"change.{index}.{line}" for line in self._diff_lines(changed.comparison)]
        _write(lines, out)

    def sharded_replay(
        self, result: ShardedReplay, out: IO[str], *, require_fixed: bool = False
    ) -> None:
        capsule = result.capsule
        lines = [
            f"capsule_run={_identifier_or_unknown(capsule.run_id)}",
            f"capsule_step={capsule.step}",
            f"world_size={capsule.world_size}",
            f"reproduction={result.verdict}",
        ]
        for rank in result.ranks:
            lines += [
                f"rank.{rank.rank}.reproduction={rank.verdict}",
                f"rank.{rank.rank}.decision={rank.decision}",
                f"rank.{rank.rank}.earliest_nonfinite_stage={rank.stage or 'none'}",
                f"rank.{rank.rank}.bundle={_path_or_unknown(rank.bundle)}",
            ]
        _write(lines, out)

    def _diff_lines(self, comparison: Comparison) -> list[str]:
        one = io.StringIO()
        self.diff(comparison, one)
        return one.getvalue().splitlines()
