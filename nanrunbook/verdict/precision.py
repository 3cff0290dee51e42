"""Precision facts about an accepted bundle: headroom to the dtypes' largest finite
values, and the early warnings drawn from them and from the gradients' small values.

Everything here reads a :class:`~nanrunbook.verdict.report.Report` and returns
frozen records; nothing changes the decision or the exit code. Values are the
tensors' as stored (scaled gradients before any division by the loss scale), so
they compare with the range of the dtype that holds them.

Warnings and their thresholds (:class:`WarningThresholds`):

* ``AT_DTYPE_MAX``: a tensor's largest finite magnitude equals its dtype's largest
  finite value (saturated; a cast or an overflowing op clamped there, or the
  next step will not fit).
* ``NEAR_DTYPE_MAX``: less than ``near_max_bits`` (default 1) bits of headroom to
  the tensor's dtype, or, in a stage computed in the compute dtype, to that dtype.
* ``BEYOND_COMPUTE_DTYPE``: in a stage computed in the compute dtype (input,
  forward, loss), a finite magnitude above that dtype's largest finite value: the
  cast to the compute dtype cannot represent it.
* ``GRADIENT_UNDERFLOW``: in the backward stage, a tensor of a dtype in
  ``underflow_dtypes`` (default: the floating dtypes of at most 16 bits) whose
  share of zero or subnormal finite values is above ``underflow_share`` (default
  0.5); or, under a loss scale (scaler mode static or dynamic), a gradient whose
  values are all zero. Only gradients whose elements are all finite are looked at.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nanrunbook.contract import NEAR_MAX_BITS
from nanrunbook.dtypes import DTYPES, DType
from nanrunbook.records import (
    EarlyWarning,
    Extremes,
    Headroom,
    Manifest,
    Scaler,
    StageFinding,
    TensorFinding,
    TensorHeadroom,
)

__all__ = [
    "COMPUTE_STAGES",
    "WarningThresholds",
    "closest_to_limit",
    "early_warnings",
    "headroom",
]


class Report(Protocol):
    """What these facts read of a report: a Protocol, so that the report's own
    JSON document (verdict/report.py) can use them without an import circle."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def stages(self) -> Sequence[StageFinding]: ...

    @property
    def scaler(self) -> Scaler: ...


# The stages autocast-style mixed precision computes in precision.compute_dtype.
COMPUTE_STAGES: tuple[str, ...] = ("input", "forward", "loss")
_GRADIENT_STAGE = "backward"

_LOW_PRECISION = frozenset(d.name for d in DTYPES.values() if d.kind == "float" and d.bits <= 16)


@dataclass(frozen=True, slots=True)
class WarningThresholds:
    """When a warning fires; the defaults are documented in ``nanrunbook(1)``."""

    near_max_bits: float = NEAR_MAX_BITS  # NEAR_DTYPE_MAX below this many bits of headroom
    underflow_share: float = 0.5  # GRADIENT_UNDERFLOW above this share of zero/subnormal
    underflow_dtypes: frozenset[str] = field(default=_LOW_PRECISION)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.near_max_bits) and self.near_max_bits >= 0):
            raise ValueError(f"near_max_bits must be finite and >= 0, not {self.near_max_bits}")
        if not 0 <= self.underflow_share <= 1:
            raise ValueError(f"underflow_share must be within [0, 1], not {self.underflow_share}")
        unknown = sorted(
            name
            for name in self.underflow_dtypes
            if name not in DTYPES or not DTYPES[name].floating
        )
        if unknown:
            raise ValueError(f"underflow_dtypes: not floating dtypes: {', '.join(unknown)}")


@dataclass(frozen=True, slots=True)
class _Limits:
    """One floating dtype's limits, worked out once: a bundle may hold thousands of
    tensors of the same few dtypes."""

    dtype: str
    max_finite: float
    log2_max: float
    exp_limit: float
    square_limit: float
    reciprocal_limit: float


def _limits_of(dtype: DType) -> _Limits:
    top = dtype.max_finite
    assert top is not None
    return _Limits(dtype.name, top, math.log2(top), math.log(top), math.sqrt(top), 1 / top)


_LIMITS: dict[str, _Limits] = {d.name: _limits_of(d) for d in DTYPES.values() if d.floating}


def _compute_limits(report: Report) -> _Limits | None:
    return _LIMITS.get(report.manifest.binding.compute_dtype)


def _measured(
    stages: Iterable[StageFinding],
) -> Iterator[tuple[StageFinding, int, TensorFinding, Extremes]]:
    """Every recounted floating tensor of ``stages`` with its extremes, in stage
    then capture order."""
    for stage in stages:
        for index, tensor in enumerate(stage.tensors):
            if tensor.extremes is not None and tensor.counts is not None:
                yield stage, index, tensor, tensor.extremes


def headroom(report: Report) -> tuple[TensorHeadroom, ...]:
    """Every recounted floating tensor's headroom, in stage order, then capture order."""
    compute = _compute_limits(report)
    return tuple(
        _tensor_headroom(stage, index, tensor, compute)
        for stage, index, tensor, _ in _measured(report.stages)
    )


def closest_to_limit(
    report: Report, stages: Collection[str]
) -> tuple[TensorHeadroom, Headroom] | None:
    """Among the recounted floating tensors of ``stages``, the one with the least
    headroom to a limit (its own dtype's largest finite value or, in a stage
    computed in the compute dtype, that dtype's), and that limit; the first in
    stage and capture order on a tie. None when no such tensor has a non-zero value.
    """
    compute = _compute_limits(report)
    best: tuple[float, StageFinding, int, bool] | None = None
    for stage in report.stages:
        if stage.stage not in stages:
            continue
        against = compute if stage.stage in COMPUTE_STAGES else None
        # Against one limit, the least headroom is the largest magnitude: only the
        # first largest of each dtype (and of the stage, for the compute dtype) can win.
        for index, is_compute in _largest(stage, against is not None):
            tensor = stage.tensors[index]
            limit = against if is_compute else _LIMITS[tensor.entry.dtype]
            assert limit is not None and tensor.extremes is not None
            bits = limit.log2_max - math.log2(tensor.extremes.max_abs or 0.0)
            if best is None or bits < best[0]:  # strictly: the first one wins a tie
                best = (bits, stage, index, is_compute)
    if best is None:
        return None
    _, stage, index, is_compute = best
    room = _tensor_headroom(stage, index, stage.tensors[index], compute)
    closest = room.compute if is_compute else room.own
    assert closest is not None
    return room, closest


def _largest(stage: StageFinding, with_compute: bool) -> list[tuple[int, bool]]:
    """The index of the first tensor of the largest non-zero magnitude of each dtype,
    and of the whole stage when ``with_compute``; in capture order, own limit first."""
    peaks = _peaks(stage)
    found = [(index, False) for _, index in peaks.values()]
    if with_compute and peaks:  # the largest of all; the first one on a tie
        _, index = max(peaks.values(), key=lambda peak: (peak[0], -peak[1]))
        found.append((index, True))
    return sorted(found)


def _peaks(stage: StageFinding) -> dict[str, tuple[float, int]]:
    """Each dtype's largest non-zero finite magnitude among the stage's recounted
    floating tensors, with the index of the first tensor holding it.

    A column at a time: a stage may hold thousands of tensors, and the warnings and
    the checklist each ask. ``finite_max_abs`` is the recount's ``max_abs`` of the
    tensor's extremes, non-zero only for a recounted floating tensor."""
    tensors = stage.tensors
    maxima = [tensor.finite_max_abs for tensor in tensors]
    dtypes = [tensor.entry.dtype for tensor in tensors]
    peaks: dict[str, tuple[float, int]] = {}
    kinds = set(dtypes)
    for dtype in sorted(kinds):
        mine = (
            maxima
            if len(kinds) == 1
            else [m if d == dtype else None for m, d in zip(maxima, dtypes, strict=True)]
        )
        present = list(filter(None, mine))
        if present:
            peak = max(present)
            peaks[dtype] = (peak, mine.index(peak))
    return peaks


def _tensor_headroom(
    stage: StageFinding, index: int, tensor: TensorFinding, compute: _Limits | None
) -> TensorHeadroom:
    extremes, counts = tensor.extremes, tensor.counts
    assert extremes is not None and counts is not None
    against = compute if stage.stage in COMPUTE_STAGES else None
    return TensorHeadroom(
        stage=stage.stage,
        index=index,
        tensor=tensor.entry.name,
        dtype=tensor.entry.dtype,
        counts=counts,
        extremes=extremes,
        own=_headroom(extremes, counts.finite, _LIMITS[tensor.entry.dtype]),
        compute=None if against is None else _headroom(extremes, counts.finite, against),
    )


def _headroom(extremes: Extremes, finite: int, limits: _Limits) -> Headroom:
    top = limits.max_finite
    max_abs = extremes.max_abs
    smallest = extremes.min_nonzero_abs
    # A difference of logs: the ratio itself overflows for subnormal magnitudes.
    bits = limits.log2_max - math.log2(max_abs) if max_abs else None
    return Headroom(
        dtype=limits.dtype,
        max_finite=top,
        bits=bits,
        exp_limit=limits.exp_limit,
        square_limit=limits.square_limit,
        reciprocal_limit=limits.reciprocal_limit,
        exp_overflows=extremes.max is not None and extremes.max > limits.exp_limit,
        square_overflows=max_abs is not None and max_abs > limits.square_limit,
        reciprocal_overflows=smallest is not None and smallest < limits.reciprocal_limit,
        sum_can_overflow=max_abs is not None and finite * max_abs > top,
    )


def early_warnings(
    report: Report, thresholds: WarningThresholds | None = None
) -> tuple[EarlyWarning, ...]:
    """The report's warnings under ``thresholds`` (default :class:`WarningThresholds`),
    upstream stages first, then capture order."""
    limits = thresholds or WarningThresholds()
    scale = report.scaler.scale if report.scaler.mode != "none" else None
    compute = _compute_limits(report)
    # A value at or above max_finite / 2**near_max_bits may warn (_near compares the
    # same product); below it, in every limit that applies, none can: no headroom
    # record is built for such a tensor, the common case in a big bundle.
    near = math.pow(2.0, limits.near_max_bits)
    found: list[EarlyWarning] = []
    screened = [s for s in report.stages if _may_warn(s, compute, near, limits, scale)]
    for stage, index, tensor, extremes in _measured(screened):
        warned: list[tuple[str, str]] = []
        max_abs = extremes.max_abs
        if max_abs and max_abs * near >= _top(stage, tensor.entry.dtype, compute):
            warned = _range_warnings(_tensor_headroom(stage, index, tensor, compute), limits)
        if stage.stage == _GRADIENT_STAGE:
            warned += _underflow_warnings(tensor, limits, scale)
        for code, message in warned:
            name = tensor.entry.name
            found.append(EarlyWarning(code, message, stage=stage.stage, tensor=name, index=index))
    return tuple(found)


def _may_warn(
    stage: StageFinding,
    compute: _Limits | None,
    near: float,
    limits: WarningThresholds,
    scale: float | None,
) -> bool:
    """Whether any tensor of ``stage`` can warn: a dtype's largest magnitude at or
    above the range screen of :func:`early_warnings` (``near``: 2 ** near_max_bits;
    monotone in max_abs), or a gradient stage with a loss scale or a dtype the
    underflow warning watches."""
    if any(
        peak * near >= _top(stage, dtype, compute) for dtype, (peak, _) in _peaks(stage).items()
    ):
        return True
    if stage.stage != _GRADIENT_STAGE:
        return False
    return scale is not None or any(t.entry.dtype in limits.underflow_dtypes for t in stage.tensors)


def _top(stage: StageFinding, dtype: str, compute: _Limits | None) -> float:
    """The lowest largest finite value a tensor of ``dtype`` in ``stage`` is held to:
    its own dtype's, and the compute dtype's in a stage computed in it."""
    top = _LIMITS[dtype].max_finite
    if compute is not None and stage.stage in COMPUTE_STAGES:
        top = min(top, compute.max_finite)
    return top


def _range_warnings(tensor: TensorHeadroom, limits: WarningThresholds) -> list[tuple[str, str]]:
    """Exact comparisons of max_abs with the maxima (a difference of logs may round)."""
    found: list[tuple[str, str]] = []
    own, max_abs = tensor.own, tensor.extremes.max_abs
    if not max_abs:
        return found
    if max_abs == own.max_finite:
        found.append(
            ("AT_DTYPE_MAX", f"max |value| is {_num(max_abs)}, {own.dtype}'s largest finite value")
        )
    elif _near(max_abs, own.max_finite, limits):
        found.append(("NEAR_DTYPE_MAX", _below(max_abs, own, f"{own.dtype}'s")))
    compute = tensor.compute
    if compute is None or compute.dtype == own.dtype:
        return found
    if max_abs > compute.max_finite:
        found.append(
            (
                "BEYOND_COMPUTE_DTYPE",
                f"max |value| {_num(max_abs)} is above {_num(compute.max_finite)}, the largest"
                f" finite value of the compute dtype {compute.dtype}"
                f" ({_num(-_bits(compute), 3)} bits beyond)",
            )
        )
    elif _near(max_abs, compute.max_finite, limits):
        whose = f"the compute dtype {compute.dtype}'s"
        found.append(("NEAR_DTYPE_MAX", _below(max_abs, compute, whose)))
    return found


def _near(max_abs: float, max_finite: float, limits: WarningThresholds) -> bool:
    """Less than ``near_max_bits`` below: max_finite / max_abs < 2 ** bits, exactly
    for whole bits (a product that overflows to infinity still compares right)."""
    return max_abs <= max_finite < max_abs * math.pow(2.0, limits.near_max_bits)


def _bits(room: Headroom) -> float:
    assert room.bits is not None
    return room.bits


def _below(max_abs: float, room: Headroom, whose: str) -> str:
    return (
        f"max |value| {_num(max_abs)} is {_num(_bits(room), 3)} bits below {whose} largest"
        f" finite value {_num(room.max_finite)}"
    )


def _underflow_warnings(
    tensor: TensorFinding, limits: WarningThresholds, scale: float | None
) -> list[tuple[str, str]]:
    """A gradient's: the caller asks only of the backward stage's tensors."""
    extremes, counts, dtype = tensor.extremes, tensor.counts, tensor.entry.dtype
    assert extremes is not None and counts is not None
    # A gradient with NaN or infinite elements is a stronger signal than its zeros.
    if not extremes.values or counts.nonfinite:
        return []
    if scale is not None and extremes.zeros == extremes.values:
        message = f"all {extremes.values} finite values are zero under loss scale {_num(scale)}"
        return [("GRADIENT_UNDERFLOW", message)]
    small = extremes.zeros + extremes.subnormals
    share = small / extremes.values
    if dtype in limits.underflow_dtypes and share > limits.underflow_share:
        message = (
            f"{extremes.zeros} zero and {extremes.subnormals} subnormal of {extremes.values}"
            f" finite {dtype} values ({share:.1%}; threshold {limits.underflow_share:.1%})"
        )
        return [("GRADIENT_UNDERFLOW", message)]
    return []


def _num(value: float, digits: int = 6) -> str:
    return f"{value:.{digits}g}"
