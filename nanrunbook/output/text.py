"""``--format text``: the on-call view, through rich.

Manifest strings are shown literally through ``rich.text.Text`` (never markup);
colour only on a terminal without NO_COLOR. rich is imported on first use, so
``kv`` and ``json`` never load it.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import EvidenceRejected, quote
from nanrunbook.output.base import Renderer
from nanrunbook.records import StageFinding, TensorFinding
from nanrunbook.verdict.incident_set import (
    REJECTED,
    CheckOutcome,
    IncidentSet,
    SetMember,
    SetViolation,
    rank_list,
)
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section
from nanrunbook.verdict.wording import counts_phrase, number, shape_text

if TYPE_CHECKING:
    from nanrunbook.capture.recovery import RecoveryRecord, RecoveryVerification
    from nanrunbook.diff import Comparison, ComparisonRejected, TensorDiff
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["TextRenderer"]


@functools.cache
def _verdict_console() -> Any:
    """rich's Console, except that a closed pipe raises BrokenPipeError: rich would
    exit 1, and the caller must keep the verdict's exit code. Built on first use so
    kv and json never import rich."""
    from rich.console import Console

    class VerdictConsole(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError

    return VerdictConsole


@functools.cache
def _trimmed() -> Any:
    """A wrapper that drops the spaces rich pads table and grid lines with: a line of
    the report ends where its text ends, in a log as at a terminal."""
    from rich.segment import Segment

    class Trimmed:
        def __init__(self, renderable: Any) -> None:
            self.renderable = renderable

        def __rich_console__(self, console: Any, options: Any) -> Any:
            for line in console.render_lines(self.renderable, options, pad=False):
                while line and not line[-1].control and not line[-1].text.rstrip():
                    line.pop()
                if line and not line[-1].control:
                    last = line.pop()
                    line.append(Segment(last.text.rstrip(), last.style, last.control))
                yield from line
                yield Segment.line()

    return Trimmed


def _show(console: Any, renderable: Any = "") -> None:
    """Print ``renderable`` wrapped to the console's width, without trailing spaces."""
    if renderable == "":
        console.print()
    else:
        console.print(_trimmed()(renderable), soft_wrap=False)


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
        # prints directly; the report wraps to the width through _show.
        plain = bool(os.environ.get("NO_COLOR"))
        return _verdict_console()(
            file=out,
            width=self.width,
            highlight=False,
            emoji=False,
            soft_wrap=True,
            force_terminal=self.force_terminal,
            color_system=None if plain else "auto",
        )

    def report(self, report: Report, out: IO[str]) -> None:
        console = self._console(out)
        if self.brief:
            _print_unwrapped(console, _brief_lines(report))
            return
        for block in _report_blocks(console, report, full_checklist=self.full_checklist):
            _show(console, block)

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        from rich.text import Text

        console = self._console(out)
        count = len(error.violations)
        headline = Text.assemble(
            ("nanrunbook check: ", "bold"),
            ("REJECTED", "bold yellow"),
            f" - {count} violation{'s' if count != 1 else ''}; no decision is made on this evidence",
        )
        if self.brief:
            _print_unwrapped(
                console, [headline, *_brief_violations(error), _fact_line("bundle", bundle)]
            )
            return
        _show(console, headline)
        _show(console, _grid([("bundle", Text(bundle))]))
        for violation in error.violations:
            _show_violation(console, violation.code, violation.where, violation.message)

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        console = self._console(out)
        _show(console, _sections_block(sections, heading="nanrunbook replay checklist"))

    def contract(self, document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
        lines = [
            f"contract {document['contract_version']} for bundles {document['bundle_format']}",
            f"contract_content_id={content_id}",
            "stage order: " + " -> ".join(document["stage_order"]),
            "actions on HOLD (exit 1):",
            *(f"  {stage}: {action}" for stage, action in document["actions"].items()),
            f"CONTINUE_BOUNDED_DIAGNOSTICS (exit 0): {document['no_nonfinite_action']}",
            f"root cause claim: {document['root_cause_claim']}",
            "caps:",
            *(f"  {name}: {value}" for name, value in document["caps"].items()),
            "bounds:",
            *(f"  {name}: {value}" for name, value in document["bounds"].items()),
        ]
        out.write("\n".join(lines) + "\n")

    def diff(self, result: Comparison | ComparisonRejected, out: IO[str]) -> None:
        from rich.text import Text

        from nanrunbook.diff import ComparisonRejected

        console = self._console(out)
        if isinstance(result, ComparisonRejected):
            count = len(result.violations)
            _show(
                console,
                Text.assemble(
                    ("nanrunbook diff: ", "bold"),
                    ("REJECTED", "bold yellow"),
                    f" - {' and '.join(result.sides)} rejected, {count} violation"
                    f"{'s' if count != 1 else ''}; no comparison is made",
                ),
            )
            for violation in result.violations:
                _show_violation(console, violation.code, violation.where, violation.message)
            return
        if result.same_bundle:
            _diff_same_bundle(console, result)
            return
        _diff_heading(console, result)
        _diff_changes(console, result)
        _diff_divergence(console, result)
        _diff_stages(console, result)
        _diff_tensor_lists(console, result)

    def incident_set(self, result: IncidentSet, out: IO[str]) -> None:
        from rich.text import Text

        console = self._console(out)
        command = "nanrunbook check" if result.path is not None else "nanrunbook merge"
        headline = Text.assemble((f"{command}: ", "bold"), *_set_headline(result))
        if self.brief:
            _print_unwrapped(console, [headline, *_brief_set_lines(result)])
            return
        _show(console, headline)
        _run_directory_note(console, result)
        if result.decision == REJECTED:
            _print_set_rejection(console, result)
        else:
            _show(console, _grid(_set_facts(result)))
            _show(console, Text("  The symptom's location is not its cause.", style="italic"))
        _show(console)
        _show(console, _rank_table(console, result))
        if result.nested_sets:
            _show(console, Text(_nested_note(result), style="yellow"))
        if result.path is not None and result.members:
            command = f"nanrunbook check --format json {quote(result.path)}"
            _show(console, Text(f"Every member's whole report: {command}"))
        if result.decision == HOLD:
            _show(
                console,
                Text(
                    "Containment: hold the update on every rank, preserve each rank's boundary,"
                    " mark the last known-good state, choose replay authority; replay from the"
                    " origin ranks (full runbook: nanrunbook checklist --stage"
                    f" {result.earliest_nonfinite_stage})."
                ),
            )

    def many(self, outcomes: Sequence[CheckOutcome], exit_code: int, out: IO[str]) -> None:
        from rich.text import Text

        console = self._console(out)
        rows = []
        for outcome in outcomes:
            decision = _outcome_decision(outcome)
            rows.append((Text(decision, _DECISION_STYLE.get(decision, "")), _outcome_line(outcome)))
        _show(console, _grid(rows, indent=0, label_style=""))
        counts = {d: sum(_outcome_decision(o) == d for o in outcomes) for d in _DECISION_STYLE}
        tally = ", ".join(f"{n} {d}" for d, n in counts.items() if n)
        _show(console, Text(f"{len(outcomes)} checked: {tally}; exit {exit_code}, the most severe"))

    def recovery_verification(self, verification: RecoveryVerification, out: IO[str]) -> None:
        from rich.text import Text

        console = self._console(out)
        count = len(verification.violations)
        if verification.verified:
            headline = Text.assemble(
                ("nanrunbook verify-recovery: ", "bold"),
                ("VERIFIED", "bold green"),
                f" - step {verification.step}, every file as written",
            )
        else:
            headline = Text.assemble(
                ("nanrunbook verify-recovery: ", "bold"),
                ("REJECTED", "bold yellow"),
                f" - {count} violation{'s' if count != 1 else ''}; not a recovery point",
            )
        _show(console, headline)
        rows: list[tuple[str, Any]] = [("point", Text(verification.path))]
        if verification.point_id is not None:
            rows.append(("id", Text(verification.point_id)))
        if verification.run_id is not None:
            rows.append(("run", Text(verification.run_id)))
        if verification.parts:
            shown = ", ".join(f"{part} {kind}" for part, kind in sorted(verification.parts.items()))
            rows.append(("parts", Text(shown)))
        if verification.files:
            size = f"{verification.files} files, {verification.total_bytes} bytes"
            torch_version = verification.torch_version or "?"
            rows.append(
                (
                    "read",
                    Text(f"{size}; torch {torch_version}, world size {verification.world_size}"),
                )
            )
        _show(console, _grid(rows))
        for violation in verification.violations:
            _show_violation(console, violation.code, violation.where, violation.message)

    def recovery_record(self, record: RecoveryRecord, out: IO[str]) -> None:
        from rich.text import Text

        console = self._console(out)
        verdict = ("PROVEN", "bold green") if record.proven else ("NOT PROVEN", "bold red")
        change = record.change or "no change"
        after = sum(1 for n in record.steps_run if n > record.incident_step)
        ran = (
            f"held at step {record.held_at}"
            if record.held_at is not None
            else f"then {after} steps"
        )
        _show(
            console,
            Text.assemble(
                ("nanrunbook prove: ", "bold"),
                verdict,
                f" - step {record.incident_step} with {change}, {ran}",
            ),
        )

        def trend(label: str, value: Any) -> str:
            loss = "-" if value.loss is None else f"{value.loss:.4g}"
            norm = "-" if value.grad_norm is None else f"{value.grad_norm:.4g}"
            return f"{label}: median loss {loss}, grad norm {norm} ({value.steps} steps)"

        diff = record.diff_verdict or "none"
        if record.diff_outcome:
            diff += f", {record.diff_outcome}"
        rows: list[tuple[str, Any]] = [
            ("point", Text(f"{record.point_id} (step {record.point_step})")),
            ("resumed", Text("bit for bit" if record.digests_match else "NOT the point's state")),
            ("held", Text("none" if record.held_at is None else f"at step {record.held_at}")),
            ("new bundle", Text(f"{record.new_decision or 'none'}; diff {diff}")),
            ("trend", Text(trend("before", record.before))),
            ("", Text(trend("from the incident", record.after))),
            ("warnings", Text(", ".join(f"{c} (step {s})" for s, c in record.warnings) or "none")),
            ("reopen", Text(f"a person's decision: {record.reopen_decided_by}")),
        ]
        _show(console, _grid(rows))
        for reason in record.reasons:
            _show(console, _indented(Text(f"not proven: {reason}"), 2))

    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        from rich.text import Text

        from nanrunbook.output.watch_text import STATUS_MEANING, summary_facts, summary_sections

        console = self._console(out)
        style = {"ALARM": "bold red", "WARNINGS": "bold yellow", "OK": "bold green"}
        status = summary.status
        _show(
            console,
            Text.assemble(
                ("nanrunbook watch: ", "bold"),
                (status, style.get(status, "bold")),
                f" - {STATUS_MEANING[status]}",
            ),
        )
        _show(console, _grid(summary_facts(summary)))
        for heading, lines in summary_sections(summary):
            _show(console, Text(heading, style="bold"))
            for line in lines:
                _show(console, _indented(Text(line), 2))
        if plots and summary.series:
            self._watch_plots(console, summary)

    def _watch_plots(self, console: Any, summary: WatchSummary) -> None:
        from rich.text import Text

        from nanrunbook.output.panels import watch_marks, watch_panels
        from nanrunbook.output.plots import terminal_plot

        colour = console.color_system is not None
        marks = watch_marks(summary)
        if marks:
            legend = "; ".join(mark.label for mark in marks)
            _show(console, Text(f"Vertical lines: {legend}", style="dim"))
        for panel in watch_panels(summary):
            _show(console)
            lines = terminal_plot(panel, marks, colour=colour)
            _show(console, Text(lines[0], style="bold"))
            for line in lines[1:]:
                _show(console, Text.from_ansi(line) if colour else Text(line))

    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        from rich.text import Text

        from nanrunbook.output.watch_text import event_line

        style = {"hold": "bold red", "nonfinite": "bold red", "warning": "yellow"}
        console = self._console(out)
        _show(console, Text(event_line(event), style=style.get(event.kind, "")))
        out.flush()


# ---------------------------------------------------------------- building blocks

_DIGEST = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{52}\b")
_NUMERIC = ("elements", "nan", "+inf", "-inf", "max abs")


def _shorten_digests(text: str) -> str:
    """Every SHA-256 hex digest cut to its first 12 digits: content ids and digests
    are whole in json and kv; in text they would not fit 80 columns."""
    return _DIGEST.sub(r"\1...", text)


def _indented(text: Any, left: int) -> Any:
    from rich.padding import Padding

    return Padding(text, (0, 0, 0, left))


def _grid(rows: Sequence[tuple[Any, Any]], *, indent: int = 2, label_style: str = "dim") -> Any:
    """Label/value lines; a long value wraps under itself, not under its label."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style=label_style)
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(label, value if isinstance(value, Text) else Text(str(value)))
    return _indented(grid, indent)


_BRIEF_LABEL_WIDTH = len("earliest non-finite stage")


def _fact_line(label: str, value: str) -> Any:
    from rich.text import Text

    return Text.assemble((f"  {label:<{_BRIEF_LABEL_WIDTH}}  ", "dim"), value)


def _show_violation(console: Any, code: str, where: str, message: str) -> None:
    """A violation as check shows one: its code and where, its message under them."""
    from rich.text import Text

    _show(console, _indented(Text.assemble((code, "yellow"), f" {where}"), 2))
    _show(console, _indented(Text(_shorten_digests(message)), 4))


def _print_unwrapped(console: Any, lines: list[Any]) -> None:
    """One printed line each, never wrapped: ``--brief`` promises a line count."""
    for line in lines:
        console.print(line)  # the console soft-wraps: a line stays one line


# ---------------------------------------------------------------- the report


SCREEN_LINES = 40  # the report's height at 80 columns: one screen, no scrolling
_TENSORS_SHOWN = 5  # at most, of the earliest stage's tensors, before "N more"
_WARNINGS_SHOWN = 6  # at most, of the warnings, before "N more"
_ENTRY_LINES = 2  # a step of "Next steps" or a warning wraps to at most this many lines


def _report_blocks(console: Any, report: Report, *, full_checklist: bool) -> list[Any]:
    """The report, block after block. The earliest stage's tensors and the warnings
    share the lines the other blocks leave of one screen (the first of each is
    always shown); when even that does not fit, the warnings and then, one by
    one, the steps take one line each. ``full_checklist`` prints every step in full, with the caps alone."""
    from rich.console import Group

    stage = _earliest_stage(report)
    head = [_verdict_block(report), _stage_table(report)]
    head.append(_grid(_stage_notes(report, recovery=full_checklist or stage is None)))
    head.append(_probes_block(report) if stage is None else _earliest_heading(stage))

    def tensors(shown: int) -> Any:
        return Group() if stage is None else _earliest_tensors(report, stage, shown)

    total_tensors = 0 if stage is None else len(stage.tensors)
    caps = (min(total_tensors, _TENSORS_SHOWN), min(len(report.warnings), _WARNINGS_SHOWN))
    if full_checklist:
        heading = "Checklist (whole runbook: nanrunbook checklist)"
        steps = _sections_block(report.checklist, heading=heading)
        return [*head, tensors(caps[0]), _warnings_block(console, report, caps[1]), steps]
    fixed = sum(_height(console, block) for block in head)
    # Crowded, the warnings and then, one by one, the steps take one line each.
    count = sum(len(section.steps) for section in report.checklist)
    modes = [(0, _ENTRY_LINES), *((cut, 1) for cut in range(count + 1))]
    for cut, warning_lines in modes:
        steps = _next_steps(console, report, cut)

        def warnings(shown: int, lines: int = warning_lines) -> Any:
            return _warnings_block(console, report, shown, lines=lines)

        room = SCREEN_LINES - fixed - _height(console, steps)
        shown = _fit(room, caps, lambda n: _height(console, tensors(n)),
                     lambda n: _height(console, warnings(n)))  # fmt: skip
        if _height(console, tensors(shown[0])) + _height(console, warnings(shown[1])) <= room:
            break
    return [*head, tensors(shown[0]), warnings(shown[1]), steps]


def _height(console: Any, renderable: Any) -> int:
    """Lines ``renderable`` takes at the console's width."""
    return len(console.render_lines(renderable, console.options, pad=False))


def _fit(
    room: int, caps: tuple[int, int], tensors: Callable[[int], int], warnings: Callable[[int], int]
) -> tuple[int, int]:
    """How many tensors and warnings fit in ``room`` lines, at most ``caps``: at least
    the first of each, then one more of each in turn while they fit."""
    shown = [min(1, caps[0]), min(1, caps[1])]
    heights = (tensors, warnings)
    grown = True
    while grown:
        grown = False
        for which in (0, 1):
            more = list(shown)
            more[which] += 1
            if more[which] <= caps[which] and heights[0](more[0]) + heights[1](more[1]) <= room:
                shown = more
                grown = True
    return shown[0], shown[1]


def _earliest_stage(report: Report) -> StageFinding | None:
    name = report.decision.earliest_nonfinite_stage
    return next((s for s in report.stages if s.stage == name), None)


def _short_id(content_id: str) -> str:
    """``sha256:5df540288221...``: a content id without the kind its label names."""
    return _shorten_digests(content_id.split("@", 1)[-1])


def _verdict_facts(report: Report) -> list[tuple[str, str]]:
    decision = report.decision
    manifest = report.manifest
    stage = decision.earliest_nonfinite_stage
    facts = [("earliest non-finite stage", stage or "none: every captured element is finite")]
    if stage is not None:
        facts.append(("first non-finite tensor", _first_tensor(report)))
    run = f"{manifest.run_id} step {manifest.step}"
    if stage is None:  # a HOLD's next steps name the owner, as replay authority
        run += f", owner {manifest.incident_owner}"
    # The evidence id is named only when it says more than the run and step do.
    evidence = _shorten_digests(manifest.evidence_content_id)
    if manifest.evidence_id != f"{manifest.run_id}.step-{manifest.step}":
        evidence = f"{manifest.evidence_id} {evidence}"
    alone = report.alone
    member = []
    if alone is not None:
        member = [
            (
                "incident set",
                f"rank {alone.rank} of {alone.world_size}: one member of a set, checked"
                f" alone ({alone.warning}); check the set instead:"
                f" nanrunbook check {alone.set_path}",
            )
        ]
    return [
        *facts,
        ("action", decision.action),
        ("root cause claim", decision.root_cause_claim),
        *member,
        ("bundle", report.bundle),
        ("run", run),
        ("evidence", evidence),
        ("contract", f"{report.contract_version} {_short_id(report.contract_content_id)}"),
    ]


def _verdict_block(report: Report) -> Any:
    from rich.console import Group
    from rich.text import Text

    decision = report.decision.decision
    style = "bold red" if decision == HOLD else "bold green"
    headline = Text.assemble(("nanrunbook check: ", "bold"), (decision, style))
    return Group(headline, _grid(_verdict_facts(report)))


def _brief_lines(report: Report) -> list[Any]:
    """Verdict, earliest stage, first tensor, action, warnings, bundle: six lines."""
    from rich.text import Text

    decision = report.decision
    style = "bold red" if decision.decision == HOLD else "bold green"
    lines = [
        Text.assemble(("nanrunbook check: ", "bold"), (decision.decision, style)),
        _fact_line("earliest non-finite stage", decision.earliest_nonfinite_stage or "none"),
        _fact_line("first non-finite tensor", _first_tensor(report)),
        _fact_line("action", decision.action),
        _fact_line("warnings", _warnings_count(report)),
        _fact_line("bundle", report.bundle),
    ]
    return lines


def _warnings_count(report: Report) -> str:
    """``2 (AT_DTYPE_MAX, NEAR_DTYPE_MAX)``: how many, and which codes."""
    found = [w.code for w in report.warnings]
    if report.alone is not None:
        found.append(report.alone.warning)
    codes = ", ".join(dict.fromkeys(found))
    return f"{len(found)} ({codes})" if codes else "0"


def _brief_violations(error: EvidenceRejected) -> list[Any]:
    """Up to four lines of codes and paths; the messages are in the full report."""
    from rich.text import Text

    violations = error.violations
    shown = violations if len(violations) <= 4 else violations[:3]
    lines = [Text.assemble(("  " + v.code, "yellow"), f" {v.where}") for v in shown]
    if len(shown) < len(violations):
        lines.append(Text(f"  ... {len(violations) - len(shown)} more (without --brief)"))
    return lines


def _first_tensor(report: Report) -> str:
    decision = report.decision
    if decision.earliest_nonfinite_stage is None:
        return "none"
    if decision.first_nonfinite_tensor is None:
        return "unknown (a summary stage has no per-tensor counts)"
    return decision.first_nonfinite_tensor


def _stage_dtypes(stage: StageFinding) -> str:
    """The stage's dtypes in capture order, each once (``F32,I64``); NOT_RUN when
    the stage did not run, as it then has no tensors."""
    return ",".join(dict.fromkeys(t.dtype for t in stage.record.tensors)) or stage.status


def _stage_table(report: Report) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, padding=(0, 1))  # its header row says what it is
    # On a narrow console words wrap; a number is never broken across lines (a
    # folded "160" would read as 16 and 0), it is cut with an ellipsis instead.
    for column in ("stage", "dtype"):
        table.add_column(column, overflow="fold")
    for column in _NUMERIC:
        table.add_column(column, justify="right", no_wrap=True, overflow="ellipsis")
    for stage in report.stages:
        counts = stage.counts
        numbers = (
            (counts.elements, counts.nan, counts.posinf, counts.neginf)
            if counts is not None
            else ("-",) * 4
        )
        magnitude = report.reported_magnitude(stage, stage.finite_max_abs)
        cells = [
            stage.stage,
            _stage_dtypes(stage),
            *(str(n) for n in numbers),
            "-" if magnitude is None else number(magnitude),
        ]
        style = "red" if counts is not None and counts.nonfinite else ""
        table.add_row(*(Text(c) for c in cells), style=style)
    return table


def _stage_notes(report: Report, *, recovery: bool) -> list[tuple[str, str]]:
    """What the table cannot say: counts not recounted, scaled magnitudes, why a
    stage did not run, the loss scale and, with ``recovery``, the recovery point
    (a HOLD's next steps name it)."""
    notes = [
        ("declared", f"{stage.stage}: counts of a summary, not recounted")
        for stage in report.stages
        if stage.counts_source == "declared"
    ]
    notes += [
        (stage.stage, f"gradients stored scaled: max abs divided by {report.scaler.scale:g}")
        for stage in report.stages
        if stage.record.gradients == "scaled" and stage.status == "OBSERVED"
    ]
    # Stages after the first that did not run usually share one reason: say it once.
    not_run: dict[str, list[str]] = {}
    for stage in report.stages:
        if stage.status == "NOT_RUN":
            not_run.setdefault(stage.record.reason or "", []).append(stage.stage)
    notes += [("not run", f"{', '.join(names)}: {reason}") for reason, names in not_run.items()]
    notes.append(("loss scale", _scaler_text(report)))
    learning_rate = _learning_rate_text(report)
    if learning_rate is not None:
        notes.append(("learning rate", learning_rate))
    if recovery:
        # The contract accepts a recovery point only when all five parts were verified together.
        lkg = report.manifest.last_known_good
        notes.append(("last known-good", f"{lkg.checkpoint_id} at step {lkg.step}, {_TOGETHER}"))
    return notes


_TOGETHER = "all five parts verified together"


def _learning_rate_text(report: Report) -> str | None:
    """The optimizer's learning rate as the bundle binds it (the sentinel records the
    first parameter group's), with the scheduler; None when the bundle has none."""
    details = report.manifest.binding.details
    optimizer = details.get("optimizer", {})
    lr = optimizer.get("lr")
    if not isinstance(lr, int | float) or isinstance(lr, bool):
        return None
    text = number(float(lr))
    groups = optimizer.get("param_groups")
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 1:
        text += f" (parameter group 0 of {groups})"
    scheduler = details.get("scheduler", {})
    kind = scheduler.get("class")
    if isinstance(kind, str) and kind != "none":
        epoch = scheduler.get("last_epoch")
        text += f", scheduler {kind}" + (f" at epoch {epoch}" if isinstance(epoch, int) else "")
    return text


def _scaler_text(report: Report) -> str:
    scaler = report.scaler
    if scaler.mode == "none":
        return "none (scale 1)"
    if scaler.mode == "static":
        return f"static, scale {scaler.scale:g}"
    line = (
        f"dynamic, scale {scaler.scale:g} -> {scaler.scale_after:g}, "
        f"found_inf {str(scaler.found_inf).lower()}"
    )
    if scaler.step_skipped:
        line += "; the update was skipped: evidence of overflow, not recovery"
    return line


def _tensor_facts(
    report: Report, stage: StageFinding, tensor: TensorFinding
) -> tuple[str, str | None]:
    """Counts, and the finite extremes (as reported: scaled gradients divided by the
    scale) when the tensor's data was read."""
    if tensor.counts is None:  # a summary: the header says why there are no counts
        return "", None
    counts = counts_phrase(tensor.counts)
    extremes = tensor.extremes
    if extremes is None or extremes.min is None or extremes.max is None:
        magnitude = report.reported_magnitude(stage, tensor.finite_max_abs)
        return (counts if magnitude is None else f"{counts}, max abs {number(magnitude)}"), None

    def shown(value: float) -> str:
        reported = report.reported_magnitude(stage, value)
        assert reported is not None
        return number(reported)

    line = f"finite {shown(extremes.min)}..{shown(extremes.max)}"
    if extremes.min_nonzero_abs is not None:
        line += f"; smallest non-zero |x| {shown(extremes.min_nonzero_abs)}"
    zeros = "zero" if extremes.zeros == 1 else "zeros"
    subnormals = "subnormal" if extremes.subnormals == 1 else "subnormals"
    line += f"; {extremes.zeros} {zeros}, {extremes.subnormals} {subnormals}"
    return counts, line


def _earliest_tensors(report: Report, stage: StageFinding, shown: int) -> Any:
    """The first ``shown`` of the stage's tensors, non-finite ones first (the first
    non-finite leads): name, dtype, shape and counts on a line, the extremes on the
    next; then how many more."""
    from rich.cells import cell_len
    from rich.console import Group
    from rich.text import Text

    ordered = sorted(stage.tensors, key=lambda t: not (t.counts is not None and t.counts.nonfinite))
    rows = ordered[:shown]
    names = max((cell_len(t.entry.name) for t in rows), default=0)
    dtypes = max((len(t.entry.dtype) for t in rows), default=0)
    shapes = max((len(shape_text(t.entry.shape)) for t in rows), default=0)
    lines = []
    for tensor in rows:
        entry = tensor.entry
        counts, extremes = _tensor_facts(report, stage, tensor)
        padding = " " * (names - cell_len(entry.name))
        cells = f"  {entry.dtype:<{dtypes}}  {shape_text(entry.shape):<{shapes}}  {counts}"
        lines.append(_indented(Text.assemble(entry.name, padding, cells.rstrip()), 2))
        if extremes is not None:
            lines.append(_indented(Text(extremes), 4))
    hidden = len(ordered) - len(rows)
    if hidden > 0:
        lines.append(_indented(Text(f"... {hidden} more (all in --format json)"), 2))
    return Group(*lines)


def _earliest_heading(stage: StageFinding) -> Any:
    """The stage, its telemetry and where it was probed; its owner is named by the
    checklist's replay authority step."""
    from rich.console import Group
    from rich.text import Text

    record = stage.record
    heading = Text.assemble(
        (f"Earliest non-finite stage: {stage.stage}", "bold"),
        f" (telemetry {record.telemetry_id})",
    )
    return Group(heading, _grid([("probe source", record.probe_source)]))


def _warnings_block(console: Any, report: Report, shown: int, *, lines: int = 0) -> Any:
    """The first ``shown`` early warnings, upstream stages first (their order in the
    report), each cut to ``lines`` lines (0: whole), then how many more."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    warnings = report.warnings
    alone = report.alone
    if not warnings:
        if alone is not None:
            return Text.assemble(("Warnings", "bold"), f": {alone.warning} (incident set, above)")
        return Text.assemble(("Warnings", "bold"), ": none")
    total = len(warnings) + (alone is not None)
    heading = Text(f"Warnings ({total}, upstream first)", style="bold")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="yellow")
    grid.add_column(overflow="fold")
    codes = max(len(w.code) for w in warnings[:shown]) if shown else 0
    if alone is not None:
        codes = max(codes, len(alone.warning))
        grid.add_row(alone.warning, "this bundle alone: see incident set, above")
    width = console.width - 2 - codes - 2  # indent, code, padding
    for warning in warnings[:shown]:
        where = Text.assemble((f"{warning.stage} ", "dim"), warning.tensor, f": {warning.message}")
        grid.add_row(warning.code, _at_most(console, where, width, lines) if lines else where)
    hidden = len(warnings) - shown
    rest = [Text(f"... {hidden} more (all in --format json)")] if hidden > 0 else []
    return Group(heading, _indented(Group(grid, *rest), 2))


def _probes_block(report: Report) -> Any:
    """On CONTINUE no stage is singled out: what was checked is where each boundary
    was probed."""
    from rich.console import Group
    from rich.text import Text

    probes = _grid([(s.stage, s.record.probe_source) for s in report.stages])
    return Group(Text("Probes", style="bold"), probes)


_NEXT_STEPS = "Next steps (in full: --checklist; whole runbook: nanrunbook checklist)"


def _next_steps(console: Any, report: Report, cut: int) -> Any:
    """The checklist one step an entry: its title and the bundle's fact it refers to,
    wrapped to at most two lines; the first ``cut`` steps that wrap are cut to one."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    steps = [step for section in report.checklist for step in section.steps]
    digits = len(str(len(steps)))
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True, min_width=digits + 1)
    grid.add_column()
    width = console.width - 1 - (digits + 1) - 1  # indent, number, padding
    for number_, step in enumerate(steps, 1):
        fact = _shorten_digests(step.fact or step.detail)
        text = Text.assemble((step.title, "bold"), f": {fact}")
        lines = _ENTRY_LINES
        if cut and len(text.wrap(console, max(width, 8))) > 1:
            cut, lines = cut - 1, 1
        grid.add_row(f"{number_}.", _at_most(console, text, width, lines))
    return Group(Text(_NEXT_STEPS, style="bold underline"), _indented(grid, 1))


def _at_most(console: Any, text: Any, width: int, lines: int) -> Any:
    """``text`` wrapped to ``width``, cut to ``lines`` lines: the last is filled to the
    width, word or not, and ends in ``...`` when it was cut."""
    from rich.text import Text

    width = max(width, 8)
    wrapped = text.wrap(console, width)
    if len(wrapped) <= lines:
        return text
    kept = [line.copy() for line in wrapped[: lines - 1]]
    rest = text[sum(len(line.plain) for line in kept) :]
    rest = rest[len(rest.plain) - len(rest.plain.lstrip()) :]
    rest.truncate(width - 3)
    rest.rstrip()
    rest.append("...")
    return Text("\n").join([*kept, rest])


def _sections_block(sections: tuple[Section, ...], *, heading: str) -> Any:
    """Every step in full, section by section, numbered through."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(heading, style="bold underline")]
    count = 0
    digits = len(str(sum(len(section.steps) for section in sections)))
    for section in sections:
        parts.append(Text(section.title, style="bold"))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", no_wrap=True, min_width=digits + 1)
        grid.add_column(overflow="fold")
        for step in section.steps:
            count += 1
            detail = _shorten_digests(step.detail)
            grid.add_row(f"{count}.", Text.assemble((step.title, "bold"), f": {detail}"))
        parts.append(_indented(grid, 1))
    return Group(*parts)


_DIFF_STYLE = {
    "REPRODUCED": "bold green",
    "ONE_MECHANISM_CHANGED": "bold green",
    "NOT_REPRODUCED": "bold red",
    "CONFOUNDED": "bold red",
}
_DIFF_MEANING = {
    "REPRODUCED": "no mechanism differs, and both answer the same",
    "NOT_REPRODUCED": "no mechanism differs, yet the answers differ: a nondeterministic or"
    " mis-captured replay",
    "ONE_MECHANISM_CHANGED": "exactly one mechanism differs: the change is attributable to it",
    "CONFOUNDED": "several mechanisms differ: no attribution is made; change one at a time",
}
_OUTCOME_MEANING = {
    "FIXED": "HOLD became CONTINUE",
    "BROKE": "CONTINUE became HOLD",
    "MOVED": "the earliest non-finite stage moved",
    "UNCHANGED": "the same decision at the same stage",
}
_LISTED = 10  # tensors listed by name in the text view; json lists them all


_RUN_INCIDENTS_SHOWN = 10


def _run_directory_note(console: Any, result: IncidentSet) -> None:
    """A set that looks like a run directory (the sentinel's
    ``incident/<run>/<step>/``): the verdict stands, and the note says which
    incidents it holds, by step, and what to check instead."""
    from rich.text import Text

    incidents = result.run_incidents
    if not incidents:
        return
    several = len({i.step for i in incidents}) > 1
    kind = "incidents at different steps" if several else "single-rank incidents"
    note = (
        f"This looks like a run directory: its members are {kind} of run"
        f" {result.run_id}, each a whole answer on its own. The verdict here"
        " is the directory's, judged as one set (spec section 11). Check each"
        " incident instead:"
    )
    _show(console, _indented(Text(note, style="yellow"), 2))
    for incident in incidents[:_RUN_INCIDENTS_SHOWN]:
        step = "-" if incident.step is None else str(incident.step)
        line = f"step {step}  {incident.decision}  nanrunbook check {quote(incident.bundle)}"
        _show(console, _indented(Text(line), 4))
    hidden = len(incidents) - _RUN_INCIDENTS_SHOWN
    if hidden > 0:
        _show(console, _indented(Text(f"... {hidden} more (--format json: run_directory)"), 4))


def _diff_same_bundle(console: Any, result: Comparison) -> None:
    """One directory on both sides: no replay was compared, so no verdict."""
    from rich.text import Text

    console.print(
        Text.assemble(
            ("nanrunbook diff: ", "bold"),
            ("SAME BUNDLE", "bold yellow"),
            " - base and other are one directory, one evidence",
        )
    )
    manifest = result.base.manifest
    console.print(f"  evidence  {_short_id(manifest.evidence_content_id)} on both sides")
    console.print(
        f"  bundle    {manifest.run_id} step {manifest.step}, {result.base.decision.decision}"
    )
    console.print("  Nothing was compared (exit 2): give the original as BASE and the")
    console.print("  replay's bundle as OTHER.")


def _diff_heading(console: Any, result: Comparison) -> None:
    from rich.text import Text

    verdict = result.verdict
    head = Text.assemble(("nanrunbook diff: ", "bold"), (verdict, _DIFF_STYLE[verdict]))
    if result.outcome is not None:
        head.append(f" {result.changed[0]}: ")
        head.append(result.outcome, style="bold")
        head.append(f" ({_OUTCOME_MEANING[result.outcome]})")
    _show(console, head)
    meaning = _DIFF_MEANING[verdict]
    if verdict == "REPRODUCED" and result.first_divergence is not None:
        meaning += ", though not bit for bit (see the first divergence)"
    if result.not_reproduced == "decision":
        meaning += " (the decision differs)"
    elif result.not_reproduced is not None:
        meaning += " (the earliest non-finite stage differs)"
    _show(console, Text(f"  {meaning}"))
    for side, report in (("base", result.base), ("other", result.other)):
        decision = report.decision
        where = (
            f" at {decision.earliest_nonfinite_stage}" if decision.earliest_nonfinite_stage else ""
        )
        manifest = report.manifest
        _show(
            console,
            Text.assemble(
                (f"  {side:<5}  ", "dim"),
                (f"{decision.decision}{where}", "red" if decision.decision == HOLD else "green"),
                f"  {manifest.run_id} step {manifest.step}  {_short_id(manifest.evidence_content_id)}",
            ),
        )
    if result.same_evidence:
        console.print("  note: both sides are the same evidence (one content id): a replay")
        console.print("  that came out bit for bit, or a copy of BASE; the bundles cannot")
        console.print("  tell which")
    if not result.same_run or not result.same_step:
        what = "runs" if not result.same_run else "steps"
        _show(
            console,
            Text(f"  note: the bundles are of different {what}: identities, not mechanisms"),
        )


def _diff_changes(console: Any, result: Comparison) -> None:
    from rich.text import Text

    for change in result.changes:
        _show(console, Text(f"Changed mechanism: {change.item}", style="bold"))
        rows = []
        for field in change.fields:
            old = change.base.get(field, "(absent)")
            new = change.other.get(field, "(absent)")
            rows.append((field, f"{old!s} -> {new!s}"))
        _show(console, _grid(rows, label_style=""))
    if not result.changes:
        _show(console, Text("Changed mechanisms: none"))


def _tensor_line(tensor: TensorDiff) -> str:
    line = f"{tensor.name} ({tensor.base_stage})"
    if tensor.status == "dtype_differs":
        return f"{line}: dtype {tensor.base.dtype} -> {tensor.other.dtype}"
    if tensor.status == "shape_differs":
        return f"{line}: shape {list(tensor.base.shape)} -> {list(tensor.other.shape)}"
    delta = tensor.delta
    if delta is None:
        return f"{line}: {tensor.status}"
    line += f": {delta.differing} of {delta.elements} elements differ"
    if delta.max_abs_diff is not None:
        line += f", max abs diff {_figure(delta.max_abs_diff)}"
        line += f", max rel diff {_figure(delta.max_rel_diff)}"
    for label, count in (
        ("NaN appeared", delta.nan_appeared),
        ("NaN disappeared", delta.nan_disappeared),
        ("inf appeared", delta.inf_appeared),
        ("inf disappeared", delta.inf_disappeared),
    ):
        if count:
            line += f", {label} in {count}"
    return line


def _figure(value: float | int | None) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _diff_divergence(console: Any, result: Comparison) -> None:
    from rich.text import Text

    first = result.first_divergence
    if first is None:
        shown = "none: every tensor both hold is bit-identical"
        if any(t.status == "not_compared" for t in result.tensors):
            shown = "none among the tensors both hold with data (summaries are not compared)"
        _show(console, Text(f"First divergence: {shown}"))
        return
    _show(console, Text.assemble(("First divergence: ", "bold"), _tensor_line(first)))


def _diff_stages(console: Any, result: Comparison) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=Text("Stages, side by side"), title_justify="left", box=None, padding=(0, 1)
    )
    table.add_column("stage", no_wrap=True)
    # Two-line headers keep the table within 80 columns.
    for column in ("base\nnan/+inf/-inf", "other\nnan/+inf/-inf"):
        table.add_column(column, no_wrap=True)
    for column in ("tensors\nsame", "tensors\ndiffer", "only in\nbase", "only in\nother"):
        table.add_column(column, justify="right", no_wrap=True)
    for stage in result.stages:
        cells = [stage.stage, _stage_counts(stage.base), _stage_counts(stage.other)]
        cells += [str(stage.identical), str(stage.differing)]
        cells += [str(stage.base_only), str(stage.other_only)]
        nonfinite = any(
            f.counts is not None and f.counts.nonfinite for f in (stage.base, stage.other)
        )
        table.add_row(*(Text(c) for c in cells), style="red" if nonfinite else "")
    _show(console, table)


def _stage_counts(finding: StageFinding) -> str:
    counts = finding.counts
    if counts is None:
        return finding.status
    return f"{counts.nan}/{counts.posinf}/{counts.neginf}"


def _diff_tensor_lists(console: Any, result: Comparison) -> None:
    from rich.text import Text

    differing = [t for t in result.tensors if t.differs]
    if len(differing) > 1:
        _show(console, Text(f"Differing tensors ({len(differing)}):", style="bold"))
        for tensor in differing[:_LISTED]:
            _show(console, Text(f"  {_tensor_line(tensor)}"))
        if len(differing) > _LISTED:
            _show(console, Text(f"  and {len(differing) - _LISTED} more (--format json lists all)"))
    for side, tensors in (("base", result.base_only), ("other", result.other_only)):
        if not tensors:
            continue
        names = ", ".join(f"{t.name} ({t.stage})" for t in tensors[:_LISTED])
        more = f" and {len(tensors) - _LISTED} more" if len(tensors) > _LISTED else ""
        _show(console, Text(f"Only in {side} ({len(tensors)}): {names}{more}"))
    _show(console, Text("  The symptom's location is not its cause.", style="italic"))


_DECISION_STYLE = {
    REJECTED: "bold yellow",
    HOLD: "bold red",
    "CONTINUE_BOUNDED_DIAGNOSTICS": "bold green",
}
_MISMATCHES = frozenset(
    {
        "SET_CONTRACT_MISMATCH",
        "SET_RUN_MISMATCH",
        "SET_STEP_MISMATCH",
        "SET_WORLD_SIZE_MISMATCH",
        "SET_RANK_DUPLICATE",
    }
)


def _quoted(name: str) -> str:
    return name if name.startswith(("'", '"')) else quote(name)


def _set_headline(result: IncidentSet) -> tuple[Any, ...]:
    where = (
        quote(result.path)
        if result.path is not None
        else f"merged from {len(result.merged_from)} report{'s' if len(result.merged_from) != 1 else ''}"
    )
    size = (
        f"world size {result.world_size}" if result.world_size is not None else "world size unknown"
    )
    if result.decision == REJECTED:
        count, members = len(result.violations), len(result.members)
        return (
            ("REJECTED", "bold yellow"),
            f" - incident set {where}, {members} member{'s' if members != 1 else ''}, {size}:"
            f" {count}"
            f" violation{'s' if count != 1 else ''}; no decision is made on this set",
        )
    style = _DECISION_STYLE[result.decision]
    return (
        (result.decision, style),
        f" - incident set {where}, run {result.run_id} step {result.step}, {size}",
    )


def _brief_set_lines(result: IncidentSet) -> list[Any]:
    """Under the headline, five lines: the origin, stage, action and ranks, or up
    to four violations (codes and where) and the ranks."""
    from rich.text import Text

    facts = _set_facts(result)
    ranks = _fact_line(*facts[4])
    if result.decision != REJECTED:
        return [*(_fact_line(label, value) for label, value in facts[:4]), ranks]
    violations = result.violations
    shown = violations if len(violations) <= 4 else violations[:3]
    lines = [Text.assemble(("  " + v.code, "yellow"), f" {v.where}") for v in shown]
    if len(shown) < len(violations):
        lines.append(Text(f"  ... {len(violations) - len(shown)} more (without --brief)"))
    return [*lines, ranks]


def _set_facts(result: IncidentSet) -> list[tuple[str, str]]:
    origin = result.origin
    if result.origin_ranks:
        ranks = ", ".join(map(str, result.origin_ranks))
        origin += f": rank{'s' if len(result.origin_ranks) > 1 else ''} {ranks}"
    missing = rank_list(result.missing, listed=32)
    return [
        ("origin", origin),
        ("earliest non-finite stage", result.earliest_nonfinite_stage or "none"),
        ("action", result.action or "-"),
        ("root cause claim", result.root_cause_claim),
        (
            "ranks",
            f"{result.ranks_present} of {result.world_size} present, missing: {missing};"
            f" {result.rejected_members} rejected member{'s' if result.rejected_members != 1 else ''}",
        ),
        ("contract", f"{result.contract_version} {_shorten_digests(result.contract_content_id)}"),
    ]


def _print_set_rejection(console: Any, result: IncidentSet) -> None:
    """Every violation; when the members do not form one set, what the directory
    holds instead, and the set's own violations only (the table shows each
    member's verdict, which does not matter until they form one set)."""
    from rich.text import Text

    split = any(v.code in _MISMATCHES for v in result.violations)
    if split:
        _show(console, Text(_what_it_holds(result)))
    shown = [v for v in result.violations if not split or v.path is None]
    for violation in shown:
        _show_violation(console, violation.code, violation.where, violation.message)
    hidden = len(result.violations) - len(shown)
    if hidden:
        _show(
            console,
            Text(f"  and {hidden} violations of rejected members (--format json or kv lists them)"),
        )


def _first_five(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _nested_note(result: IncidentSet) -> str:
    """The subdirectories holding bundles one level down: this answer is not theirs."""
    names = result.nested_sets
    holds = "holds" if len(names) == 1 else "hold"
    return (
        f"Not judged: {_first_five(names)} {holds} bundles one level down, not members of this"
        " set (a member is a subdirectory with manifest.json); check each on its own."
    )


def _what_it_holds(result: IncidentSet) -> str:
    listed = _first_five([_quoted(m.name) for m in result.members])
    runs = {m.declared.run_id for m in result.members if m.declared.run_id is not None}
    steps = {m.declared.step for m in result.members if m.declared.step is not None}
    of = f"of {len(runs)} run{'s' if len(runs) != 1 else ''} and"
    of += f" {len(steps)} step{'s' if len(steps) != 1 else ''}"
    if result.path is None:
        return f"The merged reports are not of one incident set: {listed}, {of}"
    place = quote(result.path)
    return (
        f"{place} is not a bundle (it has no manifest.json) and not one incident set: it holds"
        f" bundles one level down: {listed}, {of}; judge each on its own:"
        f" nanrunbook check {quote(result.path.rstrip('/') or '/')}/*/"
    )


def _rank_table(console: Any, result: IncidentSet) -> Any:
    """One row per rank, in rank order: members, runs of missing ranks, then members
    that declare no rank. Columns are padded; the last, the first non-finite tensor
    or violation, ends the row where the row fits the console's width, and goes
    on a line of its own under its row (wrapped there) where it does not."""
    from rich.console import Group
    from rich.text import Text

    split = any(v.code in _MISMATCHES for v in result.violations)
    header = ["rank", "member", *(("run", "step") if split else ()), "decision", "earliest"]
    header += ["warnings", "first non-finite tensor, or first violation"]
    rows: list[list[str]] = []
    origin = set(result.origin_ranks)
    missing = list(result.missing)
    for member in sorted(result.members, key=lambda m: (m.rank is None, m.rank or 0, m.name)):
        while missing and member.rank is not None and missing[0].start < member.rank:
            rows.append(_missing_row(missing.pop(0), split))
        rows.append(_member_row(member, split, member.rank in origin))
    rows += [_missing_row(run, split) for run in missing]
    decision = header.index("decision")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    fixed = 2 + sum(width + 2 for width in widths)
    one_line = fixed + max(len(row[-1]) for row in [header, *rows]) <= console.width
    lines: list[Any] = [Text("Ranks", style="bold")]
    for index, row in enumerate([header, *rows]):
        style = "dim" if index == 0 else _ROW_STYLE.get(row[decision], "")
        cells = [f"{cell:<{width}}" for cell, width in zip(row, widths, strict=False)]
        if one_line:
            lines.append(Text("  " + "  ".join([*cells, row[-1]]).rstrip(), style=style))
            continue
        lines.append(Text("  " + "  ".join(cells).rstrip(), style=style))
        if row[-1] not in ("", "-"):
            lines.append(_indented(Text(row[-1], style=style), 6))
    return Group(*lines)


_ROW_STYLE = {REJECTED: "yellow", HOLD: "red", "missing": "yellow"}


def _missing_row(run: range, split: bool) -> list[str]:
    rank = str(run.start) if len(run) == 1 else f"{run.start}-{run.stop - 1}"
    return [rank, "-", *(("-", "-") if split else ()), "missing", "-", "-", ""]


def _member_row(member: SetMember, split: bool, origin: bool) -> list[str]:
    declared = member.declared
    detail = member.first_nonfinite_tensor or "-"
    if member.decision == HOLD and member.first_nonfinite_tensor is None:
        detail = "unknown (summary stage)"
    if member.violations:
        first = member.violations[0]
        more = len(member.violations) - 1
        detail = f"{first.code} {first.where}" + (f" (and {more} more)" if more else "")
    if origin:
        detail += "  <- origin"
    cells = ["?" if member.rank is None else str(member.rank), member.name]
    if split:
        cells += [declared.run_id or "?", "?" if declared.step is None else str(declared.step)]
    stage = member.earliest_nonfinite_stage or "-"
    return [*cells, member.decision, stage, _warning_summary(member.warnings), detail]


def _warning_summary(codes: Sequence[str]) -> str:
    """Each warning code once, with how many times it fired: ``NEAR_DTYPE_MAX x2``."""
    counts: dict[str, int] = {}
    for code in codes:
        counts[code] = counts.get(code, 0) + 1
    shown = [code if n == 1 else f"{code} x{n}" for code, n in counts.items()]
    return ",".join(shown) or "-"


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
