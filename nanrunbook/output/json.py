"""``--format json``: the whole record, for programs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

import orjson

from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.verdict.report import (
    Report,
    checklist_document,
    rejection_document,
    report_document,
)
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.diff import Comparison, ComparisonRejected

__all__ = ["JsonRenderer", "json_text"]


def json_text(document: Any) -> str:
    """Indented JSON and a final newline; orjson refuses NaN, so output is strict JSON."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"


class JsonRenderer(Renderer):
    name = "json"

    def report(self, report: Report, out: IO[str]) -> None:
        out.write(json_text(report_document(report)))

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        out.write(json_text(rejection_document(error, bundle, contract_content_id)))

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        out.write(json_text({"checklist": checklist_document(sections)}))

    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        out.write(json_text(document))

    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        from nanrunbook.diff import (
            ComparisonRejected,
            diff_document,
            diff_rejection_document,
        )

        if isinstance(result, ComparisonRejected):
            out.write(json_text(diff_rejection_document(result)))
        else:
            out.write(json_text(diff_document(result)))
