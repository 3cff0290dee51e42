"""The watch panels as one SVG image for an incident document.

Hand-written SVG 1.1: no dependency, a few kilobytes whatever the run's length
(the panels come from the bounded series), readable in any browser, diffable,
and embeddable in Markdown. Every text from the telemetry is XML-escaped.
"""

from __future__ import annotations

import math
from html import escape

from nanrunbook.output.panels import Mark, Panel, Trace, watch_marks, watch_panels
from nanrunbook.telemetry.summary import WatchSummary

__all__ = ["watch_svg"]

WIDTH = 900
PANEL_HEIGHT = 150
LEFT, RIGHT = 70, 20  # plot area margins inside the image
TOP = 56  # room for the heading
GAP = 40  # between panels: the title of the next
_COLOURS = ("#1f77b4", "#2ca02c", "#d62728", "#9467bd")
_MARK_COLOURS = {"warning": "#e69f00", "nonfinite": "#d62728"}


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values within [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw), default=raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _tick_label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"


class _Frame:
    """Maps data to pixels for one panel."""

    def __init__(self, top: float, x_range: tuple[float, float], y_range: tuple[float, float]):
        self.top = top
        self.x0, self.x1 = x_range[0], max(x_range[1], x_range[0] + 1)
        self.x1 += (self.x1 - self.x0) * 0.01  # the last point off the frame's edge
        self.y0, self.y1 = y_range
        self.width = WIDTH - LEFT - RIGHT

    def x(self, value: float) -> float:
        return LEFT + (value - self.x0) / (self.x1 - self.x0) * self.width

    def y(self, value: float) -> float:
        return self.top + PANEL_HEIGHT - (value - self.y0) / (self.y1 - self.y0) * PANEL_HEIGHT


def _y_range(panel: Panel) -> tuple[float, float]:
    if panel.y_range is not None:
        return panel.y_range
    ys = [y for trace in panel.traces for y in trace.ys]
    low, high = min(ys), max(ys)
    pad = (high - low) * 0.05 or 1.0
    return low - pad, high + pad


def _axes(frame: _Frame, panel: Panel) -> list[str]:
    bottom = frame.top + PANEL_HEIGHT
    parts = [
        f'<text x="{LEFT}" y="{frame.top - 8}" class="title">{escape(panel.title)}</text>',
        f'<rect x="{LEFT}" y="{frame.top}" width="{frame.width}" height="{PANEL_HEIGHT}" class="frame"/>',
    ]
    for value in _ticks(frame.y0, frame.y1, 4):
        y = frame.y(value)
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + frame.width}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
        )
        parts.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="ytick">{_tick_label(value)}</text>'
        )
    for value in _ticks(frame.x0, frame.x1, 8):
        x = frame.x(value)
        parts.append(
            f'<text x="{x:.1f}" y="{bottom + 14}" class="xtick">{_tick_label(value)}</text>'
        )
    x, y = LEFT - 44, frame.top + PANEL_HEIGHT / 2
    parts.append(
        f'<text x="{x}" y="{y:.0f}" transform="rotate(-90 {x} {y:.0f})" class="axis">'
        f"{escape(panel.axis)}</text>"
    )
    return parts


def _trace(frame: _Frame, trace: Trace, colour: str) -> list[str]:
    points = [(frame.x(x), frame.y(y)) for x, y in zip(trace.xs, trace.ys, strict=True)]
    if trace.marker is not None:
        return [
            f'<text x="{x:.1f}" y="{y + 4:.1f}" class="marker" style="fill:{colour}">{escape(trace.marker)}</text>'
            for x, y in points
        ]
    if len(points) == 1:
        x, y = points[0]
        return [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="{colour}"/>']
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return [f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.3"/>']


def _marks(frame: _Frame, marks: tuple[Mark, ...]) -> list[str]:
    parts = []
    for mark in marks:
        x = frame.x(mark.step)
        colour = _MARK_COLOURS.get(mark.kind, "#000")
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.top + PANEL_HEIGHT}"'
            f' stroke="{colour}" stroke-dasharray="4 3"/>'
        )
    return parts


def _panel(top: float, panel: Panel, marks: tuple[Mark, ...]) -> list[str]:
    if not any(trace.xs for trace in panel.traces):
        return [f'<text x="{LEFT}" y="{top + 20}" class="title">{escape(panel.title)}: none</text>']
    frame = _Frame(top, panel.x_range, _y_range(panel))
    parts = _axes(frame, panel) + _marks(frame, marks)
    for trace, colour in zip(panel.traces, _COLOURS, strict=False):
        if trace.xs:
            parts += _trace(frame, trace, colour)
    return parts


_STYLE = (
    "text{font-family:DejaVu Sans,Arial,sans-serif;font-size:12px;fill:#222}"
    ".title{font-weight:bold}.heading{font-size:15px;font-weight:bold}"
    ".ytick{text-anchor:end;font-size:11px}.xtick{text-anchor:middle;font-size:11px}"
    ".axis{font-size:11px;fill:#555;text-anchor:middle}.marker{text-anchor:middle;font-weight:bold;font-size:12px}"
    ".legend{font-size:11px;fill:#555}.frame{fill:none;stroke:#888}.grid{stroke:#ddd;stroke-width:1}"
)


def watch_svg(summary: WatchSummary, heading: str) -> str:
    """The whole image: ``heading`` on top, then the panels, sharing one step axis."""
    panels = watch_panels(summary)
    marks = watch_marks(summary)
    height = TOP + len(panels) * (PANEL_HEIGHT + GAP) + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}"'
        f' viewBox="0 0 {WIDTH} {height}">',
        f"<style>{_STYLE}</style>",
        f'<rect width="{WIDTH}" height="{height}" fill="#fff"/>',
        f'<text x="{LEFT}" y="22" class="heading">{escape(heading)}</text>',
    ]
    legend = "; ".join(f"{m.label}" for m in marks) or "no warning, no non-finite step"
    parts.append(f'<text x="{LEFT}" y="40" class="legend">dashed lines: {escape(legend)}</text>')
    for index, panel in enumerate(panels):
        parts += _panel(TOP + 20 + index * (PANEL_HEIGHT + GAP), panel, marks)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
