"""``--format text``: the on-call view, through rich.

Manifest strings are shown literally through ``rich.text.Text`` (never markup);
colour only on a terminal without NO_COLOR. rich is imported on first use, so
``kv`` and ``json`` never load it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from nanrunbook.contract import HOLD
from nanrunbook.errors import EvidenceRejected
from nanrunbook.output.base import Renderer
from nanrunbook.records import StageFinding
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import Section

if TYPE_CHECKING:
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["TextRenderer"]


def _magnitude(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


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


class TextRenderer(Renderer):
    """The on-call view, through rich; colour only on a terminal without NO_COLOR."""

    name = "text"

    def __init__(self, *, force_terminal: bool | None = None) -> None:
        self.force_terminal = force_terminal

    def _console(self, out: IO[str]) -> Any:
        # rich drops styles when ``out`` is not a terminal; NO_COLOR (any
        # non-empty value, no-color.org) turns off every escape sequence, bold
        # included. Soft wrapping keeps ids and messages whole in logs.
        plain = bool(os.environ.get("NO_COLOR"))
        return _verdict_console()(
            file=out,
            highlight=False,
            emoji=False,
            soft_wrap=True,
            force_terminal=self.force_terminal,
            color_system=None if plain else "auto",
        )

    def report(self, report: Report, out: IO[str]) -> None:
        from rich.table import Table
        from rich.text import Text

        console = self._console(out)
        decision = report.decision
        manifest = report.manifest
        style = "bold red" if decision.decision == HOLD else "bold green"
        console.print(Text.assemble(("nanrunbook check: ", "bold"), (decision.decision, style)))
        facts = [
            ("earliest non-finite stage", decision.earliest_nonfinite_stage or "none"),
            ("first non-finite tensor", _first_tensor(report)),
            ("action", decision.action),
            ("root cause claim", decision.root_cause_claim),
            ("run", f"{manifest.run_id} step {manifest.step}"),
            ("evidence", manifest.evidence_id),
            ("incident owner", manifest.incident_owner),
            ("evidence content id", manifest.evidence_content_id),
            ("contract", f"{report.contract_version} {report.contract_content_id}"),
        ]
        width = max(len(label) for label, _ in facts)
        for label, value in facts:
            console.print(Text.assemble((f"  {label:<{width}}  ", "dim"), value))
        console.print(Text("  The symptom's location is not its cause.", style="italic"))
        console.print()

        numeric = ("elements", "finite", "nan", "+inf", "-inf", "max abs")
        table = Table(title=Text("Stages"), title_justify="left", box=None, padding=(0, 1))
        for column in ("stage", "status", "counts", *numeric):
            table.add_column(column, justify="right" if column in numeric else "left", no_wrap=True)
        for stage in report.stages:
            counts = stage.counts
            values = (
                (counts.elements, counts.finite, counts.nan, counts.posinf, counts.neginf)
                if counts is not None
                else ("-",) * 5
            )
            cells = [
                stage.stage,
                stage.status,
                stage.counts_source or "-",
                *(str(v) for v in values),
                _magnitude(report.reported_magnitude(stage, stage.finite_max_abs)),
            ]
            row_style = "red" if counts is not None and counts.nonfinite else ""
            table.add_row(*(Text(c) for c in cells), style=row_style)
        console.print(table)
        for stage in report.stages:
            record = stage.record
            line = f"  {stage.stage}: owner {record.owner}, telemetry {record.telemetry_id}, "
            line += f"probe source: {record.probe_source}"
            console.print(Text(line))
            if record.status == "NOT_RUN":
                console.print(Text(f"    NOT_RUN: {record.reason or ''}"))
            elif stage.counts is not None and stage.counts.nonfinite:
                console.print(Text(f"    first non-finite tensor: {_stage_first_tensor(stage)}"))
            if record.gradients == "scaled":
                console.print(
                    Text(
                        f"    scaled gradients: magnitudes shown divided by the scale {report.scaler.scale:g}"
                    )
                )
        console.print(Text(_scaler_line(report)))
        lkg = manifest.last_known_good
        console.print(
            Text(
                f"last known-good: {lkg.checkpoint_id} at step {lkg.step} "
                f"({', '.join(lkg.verified_together)} verified together)"
            )
        )
        console.print()
        console.print(
            Text(
                "Containment: hold the update, preserve the boundary, mark the last known-good "
                "state, choose replay authority (full runbook: nanrunbook checklist)."
            )
        )
        replay = tuple(s for s in report.checklist if s.id.startswith("stage-") or s.id == "replay")
        _print_sections(console, replay, heading="Replay checklist")

    def rejection(
        self, error: EvidenceRejected, bundle: str, contract_content_id: str, out: IO[str]
    ) -> None:
        from rich.text import Text

        console = self._console(out)
        count = len(error.violations)
        console.print(
            Text.assemble(
                ("nanrunbook check: ", "bold"),
                ("REJECTED", "bold yellow"),
                f" - {count} violation{'s' if count != 1 else ''}; no decision is made on this evidence",
            )
        )
        for violation in error.violations:
            console.print(
                Text.assemble(
                    ("  " + violation.code, "yellow"), f" {violation.where}: {violation.message}"
                )
            )

    def checklist(self, sections: tuple[Section, ...], out: IO[str]) -> None:
        _print_sections(self._console(out), sections, heading="nanrunbook replay checklist")

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

    def watch_summary(self, summary: WatchSummary, out: IO[str], *, plots: bool = True) -> None:
        from rich.text import Text

        from nanrunbook.output.watch_text import STATUS_MEANING, summary_facts, summary_sections

        console = self._console(out)
        style = {"ALARM": "bold red", "WARNINGS": "bold yellow", "OK": "bold green"}
        status = summary.status
        console.print(
            Text.assemble(
                ("nanrunbook watch: ", "bold"),
                (status, style.get(status, "bold")),
                f" - {STATUS_MEANING[status]}",
            )
        )
        facts = summary_facts(summary)
        width = max(len(label) for label, _ in facts)
        for label, value in facts:
            console.print(Text.assemble((f"  {label:<{width}}  ", "dim"), value))
        for heading, lines in summary_sections(summary):
            console.print(Text(heading, style="bold"))
            for line in lines:
                console.print(Text("  " + line))
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
            console.print(Text(f"Vertical lines: {legend}", style="dim"))
        for panel in watch_panels(summary):
            console.print()
            lines = terminal_plot(panel, marks, colour=colour)
            console.print(Text(lines[0], style="bold"))
            for line in lines[1:]:
                console.print(Text.from_ansi(line) if colour else Text(line))

    def watch_event(self, event: WatchEvent, out: IO[str]) -> None:
        from rich.text import Text

        from nanrunbook.output.watch_text import event_line

        style = {"hold": "bold red", "nonfinite": "bold red", "warning": "yellow"}
        console = self._console(out)
        console.print(Text(event_line(event), style=style.get(event.kind, "")))
        out.flush()


def _stage_first_tensor(stage: StageFinding) -> str:
    if stage.counts_source != "recounted":
        return "unknown (a summary has no per-tensor counts)"
    return stage.first_nonfinite_tensor or "-"


def _first_tensor(report: Report) -> str:
    decision = report.decision
    if decision.earliest_nonfinite_stage is None:
        return "none"
    if decision.first_nonfinite_tensor is None:
        return "unknown (summary stage has no per-tensor counts)"
    return decision.first_nonfinite_tensor


def _scaler_line(report: Report) -> str:
    scaler = report.scaler
    if scaler.mode == "none":
        return "loss scale: none (scale 1)"
    if scaler.mode == "static":
        return f"loss scale: static, scale {scaler.scale:g}"
    line = (
        f"loss scale: dynamic, scale {scaler.scale:g} -> {scaler.scale_after:g}, "
        f"found_inf {str(scaler.found_inf).lower()}"
    )
    if scaler.step_skipped:
        line += "; the update was skipped: evidence of overflow, not recovery"
    return line


def _print_sections(console: Any, sections: tuple[Section, ...], *, heading: str) -> None:
    from rich.text import Text

    console.print(Text(heading, style="bold underline"))
    number = 0
    for section in sections:
        console.print(Text(section.title, style="bold"))
        for step in section.steps:
            number += 1
            console.print(
                Text.assemble(f"  {number:>2}. ", (step.title, "bold"), f": {step.detail}")
            )
