"""A sliding least-squares line through the last N (step, value) points, in O(1)
per point: running sums, rebuilt exactly every N points so rounding never
accumulates."""

from __future__ import annotations

from collections import deque

__all__ = ["SlidingTrend"]


class SlidingTrend:
    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError("a trend needs a window of at least 2 points")
        self.size = size
        self.points: deque[tuple[int, float]] = deque(maxlen=size)
        self._origin: int | None = None  # steps are taken relative to it: small sums
        self._sx = 0  # integers: exact
        self._sxx = 0
        self._sy = 0.0
        self._sxy = 0.0
        self._added = 0

    def add(self, step: int, value: float) -> None:
        if self._origin is None:
            self._origin = step
        x = step - self._origin
        if len(self.points) == self.size:
            ox, oy = self.points[0]
            self._sx -= ox
            self._sxx -= ox * ox
            self._sy -= oy
            self._sxy -= ox * oy
        self.points.append((x, value))
        self._sx += x
        self._sxx += x * x
        self._sy += value
        self._sxy += x * value
        self._added += 1
        if self._added % self.size == 0:
            self._rebuild()

    def _rebuild(self) -> None:
        shift = self.points[0][0]
        assert self._origin is not None
        self._origin += shift
        self.points = deque(((x - shift, y) for x, y in self.points), maxlen=self.size)
        self._sx = sum(x for x, _ in self.points)
        self._sxx = sum(x * x for x, _ in self.points)
        self._sy = sum(y for _, y in self.points)
        self._sxy = sum(x * y for x, y in self.points)

    def slope(self) -> float | None:
        """Value per step, or None with fewer than two distinct steps."""
        n = len(self.points)
        denominator = n * self._sxx - self._sx * self._sx
        if n < 2 or denominator <= 0:
            return None
        return (n * self._sxy - self._sx * self._sy) / denominator

    def span(self) -> int:
        """Steps from the window's first point to its last."""
        return self.points[-1][0] - self.points[0][0] if self.points else 0

    def first_step(self) -> int:
        assert self._origin is not None
        return self._origin + self.points[0][0]

    def last_step(self) -> int:
        assert self._origin is not None
        return self._origin + self.points[-1][0]
