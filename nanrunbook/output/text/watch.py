"""What a telemetry file says about the run (``watch``) and one followed event
(``watch --follow``), in text: the facts and lines from ``output/watch_text.py``,
the plots from ``output/panels.py`` and ``output/plots.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanrunbook.output.text._blocks import grid, indented, show

if TYPE_CHECKING:
    from nanrunbook.telemetry.summary import WatchEvent, WatchSummary

__all__ = ["render_watch_event", "render_watch_summary"]


def render_watch_summary(console: Any, summary: WatchSummary, *, plots: bool) -> None:
    from rich.text import Text

    from nanrunbook.output.watch_text import STATUS_MEANING, summary_facts, summary_sections

    style = {"ALARM": "bold red", "WARNINGS": "bold yellow", "OK": "bold green"}
    status = summary.status
    show(
        console,
        Text.assemble(
            ("nanrunbook watch: ", "bold"),
            (status, style.get(status, "bold")),
            f" - {STATUS_MEANING[status]}",
        ),
    )
    show(console, grid(summary_facts(summary)))
    for heading, lines in summary_sections(summary):
        show(console, Text(heading, style="bold"))
        for line in lines:
            show(console, indented(Text(line), 2))
    if plots and summary.series:
        _watch_plots(console, summary)


def _watch_plots(console: Any, summary: WatchSummary) -> None:
    from rich.text import Text

    from nanrunbook.output.panels import watch_marks, watch_panels
    from nanrunbook.output.plots import terminal_plot

    colour = console.color_system is not None
    marks = watch_marks(summary)
    if marks:
        legend = "; ".join(mark.label for mark in marks)
        show(console, Text(f"Vertical lines: {legend}", style="dim"))
    for panel in watch_panels(summary):
        show(console)
        lines = terminal_plot(panel, marks, colour=colour)
        show(console, Text(lines[0], style="bold"))
        for line in lines[1:]:
            show(console, Text.from_ansi(line) if colour else Text(line))


def render_watch_event(console: Any, event: WatchEvent) -> None:
    from rich.text import Text

    from nanrunbook.output.watch_text import event_line

    style = {"hold": "bold red", "nonfinite": "bold red", "warning": "yellow"}
    show(console, Text(event_line(event), style=style.get(event.kind, "")))
