"""``--format kv``: ``key=value`` lines for shell playbooks (spec section 10).

Only values the contract constrains to a shell-safe alphabet are printed, never
free text from a manifest; untrusted key names in a violation's path become ``[?]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.contract import CONTRACT_VERSION
from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.diff import Comparison, ComparisonRejected

__all__ = ["KvRenderer", "kv_where"]

_KV_SAFE_WHERE = re.compile(r"[A-Za-z0-9._/+=@:,\[\]$-]+")
_QUOTED_SEGMENT = re.compile(r"\['(?:[^'\\]|\\.)*'\]|\[\"(?:[^\"\\]|\\.)*\"\]")
_KV_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9._/+=@:,\[\]$-]")


def kv_where(where: str) -> str:
    """A violation's path for shell scripts: untrusted key names become ``[?]``."""
    if _KV_SAFE_WHERE.fullmatch(where):
        return where
    return _KV_UNSAFE_CHAR.sub("?", _QUOTED_SEGMENT.sub("[?]", where)) or "?"


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
        ]
        _write(lines, out)
