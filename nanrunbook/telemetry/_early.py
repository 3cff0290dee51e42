"""Divergence warnings from the first few steps: one rule, kept by the sentinel
as it runs and derived again by ``watch`` from a telemetry file's series.

A signal (the loss, the gradient norm, the weight norm) is followed in log
space. A value warns when, after ``min_steps`` finite positive values, it is
both ``ratio`` times the running minimum and ``mads`` MADs above the median of
the last ``window`` values, the MAD being that of the step-to-step changes
(scaled to a standard deviation of one step's noise), which a steady trend
does not inflate. The minimum is what a fast early drop leaves behind (a drop
never warns: only a rise above it does); the MAD says how much the signal moves
by itself from step to step, so a noisy signal needs a larger rise. Neither
needs a full window: the statistics are over the steps seen so far. The weight
norm's minimum is over the window only (``windowed``), and its growth must
keep its pace (the later half of the rise since that minimum at least
``SETTLING`` of the earlier half's rate): weights that grow towards a level
slow down; weights on the road to +inf grow exponentially. Steps a GradScaler skipped
carry no gradient norm and are not fed; a loss that is not positive is not fed
either (log space). A rise no higher above the running low than the largest
cycle the signal has completed (see ``Divergence._cycle``), plus the MADs'
allowance, does not warn: a periodic loss repeats its cycle, a divergence
rises beyond every cycle before it.

Framework-free and bounded: a detector keeps ``window`` floats. The defaults
were chosen by ``bench/bench_warnings.py`` (``make bench-warnings``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LIMITS",
    "SIGNALS",
    "Divergence",
    "DivergenceLimits",
    "Rise",
    "float32_norm_overflow",
]

_MAD_SCALE = 1.4826  # MAD to a normal distribution's standard deviation
SETTLING = 0.7
_SQRT2 = math.sqrt(2.0)  # a change of two independent steps' noise
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class DivergenceLimits:
    """When a signal's rise warns: ``ratio`` times its running minimum and
    ``mads`` scaled MADs above its median, after ``min_steps`` values."""

    ratio: float
    mads: float
    min_steps: int
    window: int = 64
    windowed: bool = False  # the minimum over the window, not the whole run

    def __post_init__(self) -> None:
        if not (self.ratio > 1 and math.isfinite(self.ratio)):
            raise ValueError("a divergence ratio must be a finite number > 1")
        if not (self.mads >= 0 and math.isfinite(self.mads)):
            raise ValueError("a divergence MAD multiple must be a finite number >= 0")
        for name in ("min_steps", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1")


# The defaults, per signal (bench/bench_warnings.py measured them on real runs).
DEFAULT_LIMITS = {
    # A loss 4x its first value at the second step is no healthy start.
    "loss": DivergenceLimits(ratio=4.0, mads=6.0, min_steps=1),
    "grad_norm": DivergenceLimits(ratio=8.0, mads=6.0, min_steps=3),
    "weight_norm": DivergenceLimits(ratio=5.0, mads=6.0, min_steps=3, windowed=True),
}


# Per signal: its warning code and the name its message gives it.
SIGNALS = {
    "loss": ("LOSS_DIVERGENCE", "loss"),
    "grad_norm": ("GRAD_NORM_DIVERGENCE", "gradient norm"),
    "weight_norm": ("WEIGHT_NORM_GROWTH", "weight norm"),
}


@dataclass(frozen=True)
class Rise:
    """A value that warns, and the statistics it was compared with."""

    value: float
    step: int
    minimum: float
    minimum_step: int
    median: float
    mads: float  # how many scaled MADs above the median
    seen: int  # values the statistics are over
    began: int  # the step the rise began (the first of the rising run)

    def describe(self, signal: str) -> str:
        spread = (
            f"{self.mads:.3g} MADs above the median {self.median:.4g} of {self.seen} steps"
            " (MAD of its step-to-step change)"
            if math.isfinite(self.mads)
            else f"above the median {self.median:.4g} of {self.seen} steps, which moved"
            " by no MAD from step to step"
        )
        return (
            f"{signal} {self.value:.4g} is {self.value / self.minimum:.3g}x its running"
            f" minimum {self.minimum:.4g} (step {self.minimum_step}) and {spread};"
            f" rising since step {self.began}"
        )


class Divergence:
    """One signal's detector. :meth:`add` returns the :class:`Rise` when the value
    warns; :meth:`cannot_warn` says, without changing anything, that none of a
    run of values can (watch's fast path counts such runs in bulk)."""

    __slots__ = (
        "_logs", "_low", "_peak", "_rise", "_steps", "began", "bump", "count", "last", "limits",
        "minimum", "minimum_step",
    )  # fmt: skip

    def __init__(self, limits: DivergenceLimits) -> None:
        self.limits = limits
        self._logs: deque[float] = deque(maxlen=limits.window)
        self._steps: deque[int] = deque(maxlen=limits.window)
        self.count = 0
        self.minimum = math.inf
        self.minimum_step = 0
        self.last = math.inf
        self.began = 0
        # The largest cycle seen (log space): see _cycle.
        self._low = self._peak = math.inf
        self._rise = 0.0
        self.bump = 0.0

    def add(self, step: int, value: float | None) -> Rise | None:
        if value is None or not (value > 0 and math.isfinite(value)):
            return None
        limits = self.limits
        if value <= self.last or self.count == 0:
            self.began = step  # a rise begins at the step after the last fall
        rise = None
        if self.count >= limits.min_steps and value > limits.ratio * self._floor()[0]:
            rise = self._judge(step, value)
        self._cycle(math.log(value))
        self._logs.append(math.log(value))
        self._steps.append(step)
        self.count += 1
        self.last = value
        if value < self.minimum:
            self.minimum, self.minimum_step = value, step
        return rise

    def _cycle(self, log: float) -> None:
        """The largest completed cycle of the run: a peak's height above the
        lowest value before it and above the lowest after it, the lesser of the
        two (log space, in O(1): the peak since the running low, measured as
        the signal falls from it). A value whose rise above the running low is
        no more than that (and the step noise) repeats a cycle the signal has
        already come back from, as a periodic loss does; a divergence rises
        beyond every cycle before it."""
        fall = self._peak - log
        if fall > 0:
            self.bump = max(self.bump, min(self._rise, fall))
        if log < self._low:
            self._low = self._peak = log
            self._rise = 0.0
        elif log > self._peak:
            self._peak = log
            self._rise = log - self._low

    def _floor(self) -> tuple[float, int]:
        """The minimum the ratio is over, and its step."""
        if not self.limits.windowed:
            return self.minimum, self.minimum_step
        low = min(range(len(self._logs)), key=self._logs.__getitem__)
        return math.exp(self._logs[low]), self._steps[low]

    def _judge(self, step: int, value: float) -> Rise | None:
        logs = list(self._logs)
        median = statistics.median(logs)
        changes = [b - a for a, b in itertools.pairwise(logs)]
        if changes:
            centre = statistics.median(changes)
            noise = _MAD_SCALE * statistics.median(abs(c - centre) for c in changes) / _SQRT2
        else:
            noise = 0.0
        excess = math.log(value) - median
        if (
            excess <= self.limits.mads * noise
            or not self._not_settling(math.log(value))
            or math.log(value) - self._low <= self.bump + self.limits.mads * noise
        ):
            return None
        floor, floor_step = self._floor()
        return Rise(
            value, step, floor, floor_step, math.exp(median),
            excess / noise if noise > 0 else math.inf, len(logs), self.began,
        )  # fmt: skip

    def _not_settling(self, last: float) -> bool:
        """Windowed signals only: the growth since the window's minimum keeps its
        pace (the later half at least SETTLING of the earlier half's rate), as
        exponential growth does; growth towards a level slows down."""
        if not self.limits.windowed:
            return True
        logs = list(self._logs)
        low = min(range(len(logs)), key=logs.__getitem__)
        rise = [*logs[low:], last]
        half = len(rise) // 2
        if half < 2:
            return True
        early = (rise[half] - rise[0]) / half
        late = (rise[-1] - rise[half]) / (len(rise) - 1 - half)
        return late >= SETTLING * early

    def cannot_warn(self, values: list[float | None]) -> bool:
        """True when no value of ``values`` can warn (each is at most ``ratio``
        times the lowest minimum the run could reach), judged in C by min/max."""
        known = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
        if not known:
            return True
        # A window's minimum only rises as values leave it: today's bounds the run's.
        floor = math.exp(min(self._logs)) if self.limits.windowed and self._logs else self.minimum
        lowest = min(floor, min(known))
        return max(known) <= self.limits.ratio * lowest

    def extend(self, steps: list[int], values: list[float | None]) -> None:
        """Feed a run :meth:`cannot_warn` cleared: no value reaches the ratio, so
        no median is taken (the same state as feeding them one by one)."""
        add = self.add
        for step, value in zip(steps, values, strict=True):
            add(step, value)


def float32_norm_overflow(max_abs: float | None) -> str:
    """The GRAD_NORM_OVERFLOW message: every gradient finite, their L2 norm beyond
    float32 (the squares overflowed)."""
    shown = f"; the largest magnitude is {max_abs:.4g}" if max_abs is not None else ""
    return (
        f"the gradient norm overflows float32 (above {FLOAT32_MAX:.4g}) while every"
        f" gradient is finite{shown}"
    )
