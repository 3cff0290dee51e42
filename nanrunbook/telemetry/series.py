"""Bounded, downsampled series of a run for plots.

Records go into at most ``capacity`` buckets of ``width`` consecutive records
each (in file order). When the buckets are full, neighbours are merged in pairs
and the width doubles, so memory stays the same on a million lines as on a
hundred, and every bucket keeps the extremes of what it covers: a single spike
or a single skipped step is never averaged away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Downsampler", "SeriesBucket"]

_INF = math.inf

# Column positions in a bucket's working list.
_FIRST, _LAST, _N, _LMIN, _LMAX, _GMAX, _HMIN, _SMIN, _SMAX, _SKIP, _HELD, _NONF = range(12)
_NMAX, _RMIN, _RMAX, _CMIN = range(12, 16)  # appended: grad norm, lr, compute headroom


@dataclass(frozen=True, slots=True)
class SeriesBucket:
    """Consecutive records: their step range and the extremes of each series."""

    first_step: int
    last_step: int
    records: int
    loss_min: float | None  # finite losses only
    loss_max: float | None
    grad_max_abs: float | None  # the largest finite gradient magnitude
    headroom_min: float | None  # the least headroom, in bits
    scale_min: float | None
    scale_max: float | None
    skipped: int
    held: int
    nonfinite: int  # steps with a non-finite loss, gradient or update the scaler did not absorb
    grad_norm_max: float | None = None
    lr_min: float | None = None
    lr_max: float | None = None
    # the least headroom of the reduced-precision compute (model output,
    # sampled activations) to its own dtype's max, in bits
    compute_headroom_min: float | None = None


def _new(step: int) -> list[float]:
    return [step, step, 0, _INF, -_INF, -_INF, _INF, _INF, -_INF, 0, 0, 0, -_INF, _INF, -_INF, _INF]


def _merge(a: list[float], b: list[float]) -> list[float]:
    return [
        a[_FIRST],
        b[_LAST],
        a[_N] + b[_N],
        min(a[_LMIN], b[_LMIN]),
        max(a[_LMAX], b[_LMAX]),
        max(a[_GMAX], b[_GMAX]),
        min(a[_HMIN], b[_HMIN]),
        min(a[_SMIN], b[_SMIN]),
        max(a[_SMAX], b[_SMAX]),
        a[_SKIP] + b[_SKIP],
        a[_HELD] + b[_HELD],
        a[_NONF] + b[_NONF],
        max(a[_NMAX], b[_NMAX]),
        min(a[_RMIN], b[_RMIN]),
        max(a[_RMAX], b[_RMAX]),
        min(a[_CMIN], b[_CMIN]),
    ]


def _finite(value: float) -> float | None:
    return value if -_INF < value < _INF else None


class Downsampler:
    """At most ``capacity`` buckets (even, at least 2), merged in pairs as records come."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError("capacity must be an even number of at least 2")
        self.capacity = capacity
        self.width = 1
        self._buckets: list[list[float]] = []
        self._room = 0  # records the last bucket still takes

    def add(
        self,
        step: int,
        loss: float | None,
        grad_max_abs: float | None,
        headroom: float | None,
        scale: float | None,
        skipped: bool = False,
        held: bool = False,
        nonfinite: bool = False,
        grad_norm: float | None = None,
        lr: float | None = None,
        compute_headroom: float | None = None,
    ) -> None:
        bucket = self._buckets[-1] if self._room else self._start(step)
        self._room -= 1
        bucket[_LAST] = step
        bucket[_N] += 1
        # Plain comparisons, not min()/max(): this runs once per line.
        if loss is not None:
            if loss < bucket[_LMIN]:
                bucket[_LMIN] = loss
            if loss > bucket[_LMAX]:
                bucket[_LMAX] = loss
        if grad_max_abs is not None and grad_max_abs > bucket[_GMAX]:
            bucket[_GMAX] = grad_max_abs
        if headroom is not None and headroom < bucket[_HMIN]:
            bucket[_HMIN] = headroom
        if scale is not None:
            _widen(bucket, scale, _SMIN, _SMAX)
        if skipped or held or nonfinite:
            bucket[_SKIP] += skipped
            bucket[_HELD] += held
            bucket[_NONF] += nonfinite
        if grad_norm is not None and grad_norm > bucket[_NMAX]:
            bucket[_NMAX] = grad_norm
        if lr is not None:
            _widen(bucket, lr, _RMIN, _RMAX)
        if compute_headroom is not None and compute_headroom < bucket[_CMIN]:
            bucket[_CMIN] = compute_headroom

    def extend(
        self,
        steps: list[int],
        losses: list[float],
        grad_max_abs: list[float | None],
        headroom: list[float | None],
        scales: list[float | None],
        grad_norms: list[float | None] | None = None,
        lrs: list[float | None] | None = None,
        compute_headroom: list[float | None] | None = None,
    ) -> None:
        """As :meth:`add` for each record in turn (none skipped, held or
        non-finite), a bucket's share at a time with min() and max()."""
        done, total = 0, len(steps)
        while done < total:
            bucket = self._buckets[-1] if self._room else self._start(steps[done])
            end = min(done + self._room, total)
            self._room -= end - done
            bucket[_LAST] = steps[end - 1]
            bucket[_N] += end - done
            for column, low, high in (
                (losses, _LMIN, _LMAX),
                (grad_max_abs, None, _GMAX),
                (headroom, _HMIN, None),
                (scales, _SMIN, _SMAX),
                (grad_norms, None, _NMAX),
                (lrs, _RMIN, _RMAX),
                (compute_headroom, _CMIN, None),
            ):
                if column is not None:
                    _fold(bucket, column[done:end], low, high)
            done = end

    def _start(self, step: int) -> list[float]:
        """A new last bucket (the last one is full), after merging when at capacity."""
        if len(self._buckets) == self.capacity:
            self._halve()
        bucket = _new(step)
        self._buckets.append(bucket)
        self._room = self.width
        return bucket

    def _halve(self) -> None:
        pairs = zip(self._buckets[0::2], self._buckets[1::2], strict=True)
        self._buckets = [_merge(a, b) for a, b in pairs]
        self.width *= 2

    def buckets(self) -> tuple[SeriesBucket, ...]:
        return tuple(
            SeriesBucket(
                int(b[_FIRST]),
                int(b[_LAST]),
                int(b[_N]),
                _finite(b[_LMIN]),
                _finite(b[_LMAX]),
                _finite(b[_GMAX]),
                _finite(b[_HMIN]),
                _finite(b[_SMIN]),
                _finite(b[_SMAX]),
                int(b[_SKIP]),
                int(b[_HELD]),
                int(b[_NONF]),
                _finite(b[_NMAX]),
                _finite(b[_RMIN]),
                _finite(b[_RMAX]),
                _finite(b[_CMIN]),
            )
            for b in self._buckets
        )


def _widen(bucket: list[float], value: float, low: int, high: int) -> None:
    """One value into ``bucket``'s extremes at ``low`` and ``high``."""
    if value < bucket[low]:
        bucket[low] = value
    if value > bucket[high]:
        bucket[high] = value


def _fold(bucket: list[float], values: list[Any], low: int | None, high: int | None) -> None:
    """The extremes of ``values`` (None for no value) into ``bucket``, as add()'s
    comparisons keep them: the first of equal extremes stays."""
    if None in values:
        values = [v for v in values if v is not None]
        if not values:
            return
    if low is not None:
        least = min(values)
        if least < bucket[low]:
            bucket[low] = least
    if high is not None:
        most = max(values)
        if most > bucket[high]:
            bucket[high] = most
