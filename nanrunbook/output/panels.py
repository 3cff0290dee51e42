"""What ``watch`` plots, whatever draws it (the terminal or SVG): one panel per
series against step, from the summary's bounded downsampled buckets.

Each bucket contributes its extremes (the worst of what it covers), plotted
at its last step: the loss's min and max, the gradient's largest magnitude
(log10), the gradient norm's largest (log10, where recorded), its least
headroom to the dtype's max (bits), the reduced-precision compute's least
headroom to its own dtype's max (bits, where recorded), the loss scale's least
value (log2), the learning rate's min and max (log10, where recorded), and the
skipped, held and non-finite steps it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nanrunbook.telemetry.series import SeriesBucket
from nanrunbook.telemetry.summary import WatchSummary

__all__ = ["Mark", "Panel", "Trace", "watch_marks", "watch_panels"]


@dataclass(frozen=True, slots=True)
class Trace:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    marker: str | None = None  # points with this character, not a line


@dataclass(frozen=True, slots=True)
class Mark:
    """A step every panel marks with a vertical line."""

    step: float
    label: str
    kind: str  # "warning" or "nonfinite"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    axis: str  # a short y-axis label
    traces: tuple[Trace, ...]
    x_range: tuple[float, float]  # the same for every panel: the whole series
    y_range: tuple[float, float] | None = None  # fixed; None: from the data


def _trace(
    label: str, points: Sequence[tuple[float, float | None]], marker: str | None = None
) -> Trace:
    kept = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
    return Trace(label, tuple(x for x, _ in kept), tuple(y for _, y in kept), marker)


def _log(value: float | None, base: float) -> float | None:
    return math.log(value, base) if value is not None and value > 0 else None


def _loss_panel(buckets: tuple[SeriesBucket, ...], x_range: tuple[float, float]) -> Panel:
    lows = [b.loss_min for b in buckets if b.loss_min is not None]
    highs = [b.loss_max for b in buckets if b.loss_max is not None]
    # A loss spanning many decades reads better on a log scale (if it stays positive).
    logged = bool(lows) and min(lows) > 0 and max(highs) / min(lows) > 1e3
    scale = (lambda v: _log(v, 10)) if logged else (lambda v: v)
    title = "loss, log10 (min and max per bucket)" if logged else "loss (min and max per bucket)"
    traces = (
        _trace("max", [(b.last_step, scale(b.loss_max)) for b in buckets]),
        _trace("min", [(b.last_step, scale(b.loss_min)) for b in buckets]),
    )
    return Panel(title, "log10" if logged else "loss", traces, x_range)


def _events_panel(buckets: tuple[SeriesBucket, ...], x_range: tuple[float, float]) -> Panel:
    """A timeline: a row per kind, a marker wherever a bucket holds one."""

    def row(field: str, y: float) -> list[tuple[float, float | None]]:
        return [(b.last_step, y if getattr(b, field) else None) for b in buckets]

    traces = (
        _trace("skipped", row("skipped", 1), "s"),
        _trace("held", row("held", 2), "H"),
        _trace("non-finite", row("nonfinite", 3), "N"),
    )
    title = "skipped (s, row 1), held (H, row 2), non-finite (N, row 3) steps"
    return Panel(title, "row", traces, x_range, (0.0, 4.0))


def watch_marks(summary: WatchSummary) -> tuple[Mark, ...]:
    """The first warning and the first non-finite step, when there are."""
    marks = []
    first_warning = summary.first_warning_step
    if first_warning is not None:
        code = min(summary.warnings, key=lambda w: w.first_step).code
        marks.append(
            Mark(first_warning, f"first warning ({code}) at step {first_warning}", "warning")
        )
    if summary.first_nonfinite is not None:
        step = summary.first_nonfinite.step
        marks.append(Mark(step, f"first non-finite at step {step}", "nonfinite"))
    return tuple(marks)


def watch_panels(summary: WatchSummary) -> tuple[Panel, ...]:
    """The panels for ``summary``; one with nothing to show has no points."""
    buckets = summary.series
    steps = [b.first_step for b in buckets] + [b.last_step for b in buckets]
    x_range = (float(min(steps)), float(max(steps))) if steps else (0.0, 1.0)
    dtype = f"the {summary.headroom.dtype}" if summary.headroom is not None else "its dtype's"
    panels = [
        _loss_panel(buckets, x_range),
        Panel(
            "gradient max abs, log10 (max per bucket)",
            "log10",
            (_trace("max abs", [(b.last_step, _log(b.grad_max_abs, 10)) for b in buckets]),),
            x_range,
        ),
        Panel(
            f"gradient headroom, bits below {dtype} max (least per bucket)",
            "bits",
            (_trace("headroom", [(b.last_step, b.headroom_min) for b in buckets]),),
            x_range,
        ),
    ]
    if any(b.grad_norm_max is not None for b in buckets):
        points = [(b.last_step, _log(b.grad_norm_max, 10)) for b in buckets]
        trace = _trace("norm", points)
        panels.insert(2, Panel("gradient norm, log10 (max per bucket)", "log10", (trace,), x_range))
    compute = summary.compute_headroom
    if compute is not None:
        points = [(b.last_step, b.compute_headroom_min) for b in buckets]
        title = f"compute headroom, bits below the {compute.dtype} max (least per bucket)"
        panels.append(Panel(title, "bits", (_trace("compute", points),), x_range))
    if summary.scale is not None:
        points = [(b.last_step, _log(b.scale_min, 2)) for b in buckets]
        trace = _trace("scale", points)
        panels.append(Panel("loss scale, log2 (least per bucket)", "log2", (trace,), x_range))
    if summary.learning_rate is not None:
        traces = (
            _trace("max", [(b.last_step, _log(b.lr_max, 10)) for b in buckets]),
            _trace("min", [(b.last_step, _log(b.lr_min, 10)) for b in buckets]),
        )
        panels.append(
            Panel("learning rate, log10 (min and max per bucket)", "log10", traces, x_range)
        )
    panels.append(_events_panel(buckets, x_range))
    return tuple(panels)
