"""``--format text``: the on-call view, through rich.

One module per record kind: ``report`` (a bundle's verdict and its rejection),
``checklist``, ``contract``, ``incident_set``, ``outcomes`` (several paths
judged each on its own), ``diff``, ``recovery`` (``verify-recovery`` and
``prove``), ``replay`` (a capsule's replay, one process's or every rank's)
and ``watch``; ``_blocks`` holds what they share. The renderer only
makes the console and hands the record to its module.

Manifest strings are shown literally through ``rich.text.Text`` (never markup);
colour only on a terminal without NO_COLOR. rich is imported on first use, so
``kv`` and ``json`` never load it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.output.text._blocks import verdict_console
from nanrunbook.output.text.checklist import render_checklist
from nanrunbook.output.text.contract import render_contract
from nanrunbook.output.text.diff import render_diff
from nanrunbook.output.text.incident_set import render_incident_set
from nanrunbook.output.text.outcomes import render_many
from nanrunbook.output.text.recovery import render_recovery_record, render_recovery_verification
from nanrunbook.output.text.replay import render_replay, render_sharded_replay
from nanrunbook.output.text.report import SCREEN_LINES, render_rejection, render_report
from nanrunbook.output.text.watch import render_watch_event, render_watch_summary
from nanrunbook.verdict.incident_set import CheckOutcome, IncidentSet
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification
    from nanrunbook.capture.torch.capsule import CapsuleReplay
    from nanrunbook.capture.torch.sharded_replay import ShardedReplay
    from nanrunbook.diff import Comparison, ComparisonRejected
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["SCREEN_LINES", "TextRenderer"]


class TextRenderer(Renderer):
    """The on-call view, through rich; colour only on a terminal without NO_COLOR.

    Lines wrap to the console's width (the terminal's, COLUMNS, or 80 when not a
    terminal); ``width`` fixes it. ``brief`` prints at most six unwrapped lines. A
    report fits one screen (:data:`SCREEN_LINES`, at 80 columns): one line per
    checklist step, as many of the earliest stage's tensors and of the warnings as
    there is room for; ``checklist`` prints every step in full instead.
    """

    name = "text"

    def __init__(
        self,
        *,
        force_terminal: bool | None = None,
        width: int | None = None,
        brief: bool = False,
        checklist: bool = False,
    ) -> None:
        self.force_terminal = force_terminal
        self.width = width
        self.brief = brief
        self.full_checklist = checklist

    def _console(self, out: IO[str]) -> Any:
        # rich drops styles when ``out`` is not a terminal; NO_COLOR (any
        # non-empty value, no-color.org) turns off every escape sequence, bold
        # included. Soft wrapping keeps ids and messages whole where a caller
        # prints directly; the report wraps to the width through _blocks.show.
        plain = bool(os.environ.get("NO_COLOR"))
        return verdict_console()(
            file=out,
            width=self.width,
            highlight=False,
            emoji=False,
            soft_wrap=True,
            force_terminal=self.force_terminal,
            color_system=None if plain else "auto",
        )

    def report(self, report: Report, out: IO[str]) -> None:
        render_report(
            self._console(out), report, brief=self.brief, full_checklist=self.full_checklist
        )

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        render_rejection(self._console(out), error, bundle, brief=self.brief)

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        render_checklist(self._console(out), sections)

    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        render_contract(document, content_id, out)

    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        render_diff(self._console(out), result)

    def incident_set(self, result: IncidentSet, out: IO[str]) -> None:
        render_incident_set(self._console(out), result, brief=self.brief)

    def many(self, outcomes: Sequence[CheckOutcome], exit_code: int, out: IO[str]) -> None:
        render_many(self._console(out), outcomes, exit_code)

    def recovery_verification(self, verification: RecoveryVerification, out: IO[str]) -> None:
        render_recovery_verification(self._console(out), verification)

    def recovery_record(self, record: RecoveryRecord, out: IO[str]) -> None:
        render_recovery_record(self._console(out), record)

    def replay(self, result: CapsuleReplay, out: IO[str], *, require_fixed: bool = False) -> None:
        render_replay(self._console(out), result)

    def sharded_replay(
        self, result: ShardedReplay, out: IO[str], *, require_fixed: bool = False
    ) -> None:
        render_sharded_replay(self._console(out), result)

    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        render_watch_summary(self._console(out), summary, plots=plots)

    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        render_watch_event(self._console(out), event)
        out.flush()
