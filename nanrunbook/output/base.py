"""The one interface every output format implements.

A command builds its record (a report, a rejection, a document) and hands it to
the renderer the user named; renderers never compute facts, they only show them.
Every method writes to ``out``; nothing is returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any, ClassVar

from nanrunbook.errors import EvidenceRejected
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:  # the diff records import numpy: a renderer loads them only for diff
    from nanrunbook.diff import Comparison, ComparisonRejected

__all__ = ["Renderer"]


class Renderer(ABC):
    """Writes what a command answers, in one format."""

    name: ClassVar[str]

    @abstractmethod
    def report(self, report: Report, out: IO[str]) -> None:
        """An accepted bundle's verdict (``check``, ``seal``)."""

    @abstractmethod
    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        """Evidence that cannot be judged, with every violation."""

    @abstractmethod
    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        """The replay runbook (``checklist``)."""

    @abstractmethod
    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        """The contract document in force (``contract``)."""

    @abstractmethod
    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        """Two bundles compared (``diff``), or the rejection of one side or both."""
