"""One bundle's verdict as a value: its report or its rejection, and what its
manifest declares about its place in a job (spec section 11: a rejected member
of an incident set may still say which rank it is)."""

from __future__ import annotations

from dataclasses import dataclass

from nanrunbook.errors import EvidenceRejected
from nanrunbook.exits import Exit
from nanrunbook.manifest.declared import Declared
from nanrunbook.verdict.report import Report

__all__ = ["Judgement"]


@dataclass(frozen=True, slots=True)
class Judgement:
    """What ``judge_bundle`` answers: exactly one of ``report`` and ``rejection``."""

    bundle: str
    contract_content_id: str
    declared: Declared
    report: Report | None
    rejection: EvidenceRejected | None

    def __post_init__(self) -> None:
        if (self.report is None) == (self.rejection is None):
            raise ValueError("a judgement holds a report or a rejection, not both or neither")

    @property
    def exit_code(self) -> int:
        if self.report is not None:
            return self.report.exit_code
        return Exit.REJECTED

    def exit_code_for(self, *, fail_on_warnings: bool = False) -> int:
        """The exit code; a CONTINUE with warnings is 5 when asked (see Report)."""
        if self.report is not None:
            return self.report.exit_code_for(fail_on_warnings=fail_on_warnings)
        return Exit.REJECTED
