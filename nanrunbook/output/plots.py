"""The watch panels drawn for a terminal, 80 columns wide, through plotille
(braille dots; imported on first use, so no other command pays for it)."""

from __future__ import annotations

from typing import Any

from nanrunbook.output.panels import Mark, Panel

__all__ = ["PLOT_COLUMNS", "terminal_plot"]

PLOT_COLUMNS = 80
# plotille adds 13 columns of y labels on the left and 10 + len(axis label) after
# the last x tick; 56 canvas columns keep every line within 80.
_CANVAS_COLUMNS = 56
_CANVAS_ROWS = 8
_COLOURS = ("cyan", "green", "red", "magenta")


def _label(value: float, chars: int, delta: float, left: bool = False) -> str:
    """Short tick labels: whole numbers for steps, 4 significant digits otherwise."""
    whole = abs(delta) >= 20 and abs(value) < 1e9
    text = f"{value:.0f}" if whole else f"{value:.4g}"
    return text.ljust(chars) if left else text.rjust(chars)


def _figure(panel: Panel, marks: tuple[Mark, ...], colour: bool) -> Any:
    import plotille

    figure = plotille.Figure()
    figure.width = _CANVAS_COLUMNS
    figure.height = _CANVAS_ROWS
    figure.origin = False
    figure.with_colors = colour
    figure.x_label = "step"
    figure.y_label = panel.axis
    figure.register_label_formatter(float, _label)
    figure.register_label_formatter(int, _label)
    left, right = panel.x_range
    # plotille drops a point exactly at the right limit: leave it a column.
    right = max(right, left + 1)
    right += (right - left) / _CANVAS_COLUMNS
    if panel.y_range is not None:
        low, high = panel.y_range
    else:
        ys = [y for trace in panel.traces for y in trace.ys]
        low, high = min(ys), max(ys)
        if high - low < 1e-9:  # a flat series: give it some room around its value
            low, high = low - 1, high + 1
    figure.set_x_limits(min_=left, max_=right)
    figure.set_y_limits(min_=low, max_=high)
    for mark in marks:
        colour_name = "yellow" if mark.kind == "warning" else "red"
        # Half a column on, so the line falls in the column of the mark's points.
        where = (mark.step - left) / (right - left) + 0.5 / _CANVAS_COLUMNS
        figure.axvline(min(where, 1.0), lc=colour_name)
    for trace, name in zip(panel.traces, _COLOURS, strict=False):
        if not trace.xs:
            continue
        if trace.marker is None:
            figure.plot(trace.xs, trace.ys, lc=name, label=trace.label)
        else:
            figure.scatter(trace.xs, trace.ys, lc=name, label=trace.label, marker=trace.marker)
    return figure


def terminal_plot(panel: Panel, marks: tuple[Mark, ...] = (), *, colour: bool = False) -> list[str]:
    """The panel's title and plot lines (ANSI colours only when ``colour``); a
    panel with no point is one line saying so."""
    if not any(trace.xs for trace in panel.traces):
        return [f"{panel.title}: none"]
    text: str = _figure(panel, marks, colour).show()
    return [panel.title, *text.splitlines()]
