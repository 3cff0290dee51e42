"""A sliding least-squares line through the last N (step, value) points, in O(1)
per point: running sums, rebuilt exactly every N points so rounding never
accumulates."""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable
from itertools import islice
from operator import lt, mul

__all__ = ["SlidingTrend"]

_EPS = sys.float_info.epsilon


class SlidingTrend:
    __slots__ = ("_added", "_origin", "_sx", "_sxx", "_sxy", "_sy", "size", "xs", "ys")

    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError("a trend needs a window of at least 2 points")
        self.size = size
        # Steps relative to _origin (small, exact sums) and values, oldest first.
        self.xs: deque[int] = deque(maxlen=size)
        self.ys: deque[float] = deque(maxlen=size)
        self._origin: int | None = None
        self._sx = 0  # integers: exact
        self._sxx = 0
        self._sy = 0.0
        self._sxy = 0.0
        self._added = 0

    def __len__(self) -> int:
        return len(self.xs)

    def add(self, step: int, value: float) -> float | None:
        """Take a point; the slope through the window now (see :meth:`slope`).
        Runs once per telemetry line: the slope is worked out here rather than
        in a second call."""
        origin = self._origin
        if origin is None:
            origin = self._origin = step
        x = step - origin
        xs, ys = self.xs, self.ys
        n = len(xs)
        if n == self.size:
            ox, oy = xs[0], ys[0]
            self._sx -= ox
            self._sxx -= ox * ox
            self._sy -= oy
            self._sxy -= ox * oy
        else:
            n += 1
        xs.append(x)
        ys.append(value)
        sx = self._sx = self._sx + x
        sxx = self._sxx = self._sxx + x * x
        sy = self._sy = self._sy + value
        sxy = self._sxy = self._sxy + x * value
        self._added += 1
        if self._added % self.size == 0:
            self._rebuild()
            sx, sxx, sy, sxy = self._sx, self._sxx, self._sy, self._sxy
        return _slope(n, sx, sxx, sy, sxy)

    def _rebuild(self) -> None:
        shift = self.xs[0]
        assert self._origin is not None
        self._restart(self._origin + shift, [x - shift for x in self.xs], self.ys)

    def _restart(self, origin: int, xs: list[int], ys: Iterable[float]) -> None:
        """The sums of a full window afresh, ``xs`` relative to ``origin``."""
        self._origin = origin
        self.xs = deque(xs, maxlen=self.size)
        self.ys = deque(ys, maxlen=self.size)
        self._sx = sum(xs)
        self._sxx = sum(map(mul, xs, xs))
        self._sy = sum(self.ys)
        self._sxy = sum(map(mul, xs, self.ys))

    def extend(self, steps: list[int], values: list[float]) -> None:
        """As :meth:`add` for each point in turn (the slopes unasked), with the
        same sums to the last bit: after many points the state is that of the
        last rebuild (a function of its window alone) and the adds since, so
        only those are replayed."""
        if len(steps) < 2 * self.size:
            for step, value in zip(steps, values, strict=True):
                self.add(step, value)
            return
        added = self._added + len(steps)
        # The last rebuild, at a multiple of size, falls inside this run.
        start = added - added % self.size - self.size - self._added
        end = start + self.size
        origin = steps[start]
        self._restart(origin, [step - origin for step in steps[start:end]], values[start:end])
        self._added = end + self._added
        for step, value in zip(steps[end:], values[end:], strict=True):
            self.add(step, value)

    def steepest(self, steps: list[int], values: list[float], fewest: int) -> float:
        """A bound on the magnitude of every slope :meth:`add` would return
        (rounding included) while adding these points, counting only windows of
        at least ``fewest`` points; inf when there is none cheaply (steps that do
        not rise strictly). Least squares through n distinct integer steps with
        values spanning R has a slope of at most R * sqrt(3 / (n*n - 1))."""
        xs, ys = self.xs, self.ys
        n = max(fewest, min(len(xs) + 1, self.size), 2)
        rising = all(map(lt, steps, islice(steps, 1, None)))
        if xs:
            assert self._origin is not None
            rising = rising and steps[0] > self._origin + xs[-1]
            rising = rising and all(map(lt, xs, islice(xs, 1, None)))
        if not rising:
            return math.inf
        high = max(max(values), max(ys, default=-math.inf))
        low = min(min(values), min(ys, default=math.inf))
        origin = self._origin if self._origin is not None else steps[0]
        first = origin + xs[0] if xs else steps[0]
        x_range = max(steps[-1], origin) - min(first, origin)
        # Rounding: at most ~3 * size operations into each running sum since the
        # last rebuild, each off by EPS of a partial sum (generously bounded).
        size = self.size
        rounding = 144 * size * (size + 1) * _EPS * x_range * max(high, -low, 0.0)
        rounding /= n * (n * n - 1)
        return (high - low) * math.sqrt(3 / (n * n - 1)) * (1 + 1e-9) + rounding

    def slope(self) -> float | None:
        """Value per step, or None with fewer than two distinct steps."""
        return _slope(len(self.xs), self._sx, self._sxx, self._sy, self._sxy)

    def span(self) -> int:
        """Steps from the window's first point to its last."""
        return self.xs[-1] - self.xs[0] if self.xs else 0

    def first_step(self) -> int:
        assert self._origin is not None
        return self._origin + self.xs[0]

    def last_step(self) -> int:
        assert self._origin is not None
        return self._origin + self.xs[-1]


def _slope(n: int, sx: int, sxx: int, sy: float, sxy: float) -> float | None:
    denominator = n * sxx - sx * sx
    if n < 2 or denominator <= 0:
        return None
    return (n * sxy - sx * sy) / denominator
