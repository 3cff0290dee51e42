"""``--format json``: the whole record, for programs."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

import orjson

from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.verdict.incident_set import (
    CheckOutcome,
    IncidentSet,
    SetMember,
    member_document,
    set_document,
)
from nanrunbook.verdict.judgement import Judgement
from nanrunbook.verdict.report import (
    Report,
    checklist_document,
    rejection_document,
    report_document,
)
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification
    from nanrunbook.capture.torch.capsule import CapsuleReplay
    from nanrunbook.capture.torch.sharded_replay import ShardedReplay
    from nanrunbook.diff import Comparison, ComparisonRejected
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["JsonRenderer", "MemberSpool", "json_text", "outcome_document"]


def json_text(document: Any) -> str:
    """Indented JSON and a final newline; orjson refuses NaN, so output is strict JSON."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n"


def _indented(document: Any, depth: int) -> bytes:
    """``document`` as :func:`json_text` writes it ``depth`` levels down, its first
    line unindented (it follows a key or a list's indent). orjson escapes every
    newline inside a string, so each newline it writes starts a line."""
    return orjson.dumps(document, option=orjson.OPT_INDENT_2).replace(b"\n", b"\n" + b"  " * depth)


class MemberSpool:
    """A set's JSON answer that does not hold its members' reports: each member's
    entry is written to an unnamed temporary file as it is folded
    (``merge_reports(folded=spool.add)``), and once the set is judged the document
    is written, its members copied in the set's order: byte for byte the
    :meth:`JsonRenderer.incident_set` of the set with every report kept."""

    def __init__(self) -> None:
        # closed by __exit__; raises OSError when TMPDIR takes no file
        self._file = tempfile.TemporaryFile()  # noqa: SIM115
        self._entries: list[tuple[str, int, int]] = []  # name, offset, length

    def __enter__(self) -> MemberSpool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._file.close()

    def add(self, member: SetMember) -> None:
        entry = b"    " + _indented(member_document(member), 2)
        self._entries.append((member.name, self._file.tell(), len(entry)))
        self._file.write(entry)

    def write(self, result: IncidentSet, out: IO[str]) -> None:
        """``result``'s document (judged from the members added, in their order)."""
        # judge_set orders the members by name, stably: so do the entries, which
        # were added in the members' order.
        entries = sorted(self._entries, key=lambda entry: entry[0])
        if [name for name, _, _ in entries] != [member.name for member in result.members]:
            raise ValueError("the set was not judged from the members spooled")
        self._file.flush()
        document = set_document(result)
        out.write("{")
        for index, (key, value) in enumerate(document.items()):
            out.write(f"{',' if index else ''}\n  {orjson.dumps(key).decode()}: ")
            if key != "members":
                out.write(_indented(value, 1).decode())
            elif entries:
                out.write("[")
                for place, (_, offset, length) in enumerate(entries):
                    self._file.seek(offset)
                    out.write(("," if place else "") + "\n" + self._file.read(length).decode())
                out.write("\n  ]")
            else:
                out.write("[]")
        out.write("\n}\n")


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

    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        from nanrunbook.telemetry.watch_document import watch_document

        out.write(json_text(watch_document(summary)))

    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        from nanrunbook.telemetry.watch_document import event_document

        # One compact object per line, flushed: a live stream for jq or a log shipper.
        out.write(orjson.dumps(event_document(event)).decode() + "\n")
        out.flush()

    def incident_set(self, result: IncidentSet, out: IO[str]) -> None:
        out.write(json_text(set_document(result)))

    def many(self, outcomes: Sequence[CheckOutcome], exit_code: int, out: IO[str]) -> None:
        out.write(json_text([outcome_document(outcome) for outcome in outcomes]))

    def judgement(self, judgement: Judgement, out: IO[str]) -> None:
        out.write(json_text(outcome_document(judgement)))

    def recovery_verification(self, verification: RecoveryVerification, out: IO[str]) -> None:
        from nanrunbook.capture.recovery import verification_document

        out.write(json_text(verification_document(verification)))

    def recovery_record(self, record: RecoveryRecord, out: IO[str]) -> None:
        from nanrunbook.capture.recovery import record_document

        out.write(json_text(record_document(record)))

    def replay(self, result: CapsuleReplay, out: IO[str], *, require_fixed: bool = False) -> None:
        from nanrunbook.capture.torch.capsule import replay_document

        out.write(json_text(replay_document(result, require_fixed=require_fixed)))

    def sharded_replay(
        self, result: ShardedReplay, out: IO[str], *, require_fixed: bool = False
    ) -> None:
        from nanrunbook.capture.torch.sharded_replay import sharded_document

        out.write(json_text(sharded_document(result, require_fixed=require_fixed)))


def outcome_document(outcome: CheckOutcome) -> dict[str, Any]:
    """One path's document: a set's, a report, or a rejection (with what it declares)."""
    if isinstance(outcome, IncidentSet):
        return set_document(outcome)
    if outcome.report is not None:
        return report_document(outcome.report)
    assert outcome.rejection is not None
    return rejection_document(
        outcome.rejection, outcome.bundle, outcome.contract_content_id, outcome.declared
    )
