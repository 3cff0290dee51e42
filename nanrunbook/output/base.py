"""The one interface every output format implements.

A command builds its record (a report, a rejection, a document) and hands it to
the renderer the user named; renderers never compute facts, they only show them.
Every method writes to ``out``; nothing is returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any, ClassVar

from nanrunbook.errors import EvidenceRejected
from nanrunbook.verdict.incident_set import CheckOutcome, IncidentSet
from nanrunbook.verdict.judgement import Judgement
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:  # the diff records import numpy, the replays' torch: loaded only for them
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification
    from nanrunbook.capture.torch.capsule import CapsuleReplay
    from nanrunbook.capture.torch.sharded_replay import ShardedReplay
    from nanrunbook.diff import Comparison, ComparisonRejected
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

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
    def incident_set(self, result: IncidentSet, out: IO[str]) -> None:
        """An incident set's verdict, one row per rank (``check`` on a set, ``merge``)."""

    @abstractmethod
    def many(self, outcomes: Sequence[CheckOutcome], exit_code: int, out: IO[str]) -> None:
        """Several paths judged each on its own (``check A/ B/ C/``), in the order
        given; ``exit_code`` is the command's, the most severe of theirs under
        ``--fail-on-warnings`` or not."""

    def judgement(self, judgement: Judgement, out: IO[str]) -> None:
        """One bundle's report or rejection; in json a rejection carries what the
        rejected manifest declares (so ``merge`` can place its rank)."""
        if judgement.report is not None:
            self.report(judgement.report, out)
        else:
            assert judgement.rejection is not None
            self.rejection(
                judgement.rejection, judgement.bundle, judgement.contract_content_id, out
            )

    @abstractmethod
    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        """Two bundles compared (``diff``), or the rejection of one side or both."""

    @abstractmethod
    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        """What a telemetry file says about the run (``watch``); ``plots`` asks
        for the terminal plots where the format has them (text)."""

    @abstractmethod
    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        """One thing that happened while following a telemetry file (``watch --follow``)."""

    @abstractmethod
    def recovery_verification(self, verification: RecoveryVerification, out: IO[str]) -> None:
        """A recovery point verified or not, with every violation (``verify-recovery``)."""

    @abstractmethod
    def recovery_record(self, record: RecoveryRecord, out: IO[str]) -> None:
        """A proof of recovery, proven or not and why (``prove``)."""

    @abstractmethod
    def replay(self, result: CapsuleReplay, out: IO[str], *, require_fixed: bool = False) -> None:
        """A capsule's step replayed, compared with its incident bundle and once per
        change (``replay``); ``require_fixed`` is the command's, for its exit code."""

    @abstractmethod
    def sharded_replay(
        self, result: ShardedReplay, out: IO[str], *, require_fixed: bool = False
    ) -> None:
        """A sharded capsule's step replayed by every rank together, each rank's
        bundle compared with its incident member (``replay`` under torchrun)."""
