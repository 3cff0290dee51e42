"""The sentinel's per-step checks, fused on the device, and its one host read.

Every value a healthy step needs on the host (the losses, the gradient norm or
the scaler's found_inf, the previous update's flag, sampled extremes) is
computed where the tensors live and packed into one small tensor, read with a
single ``tolist()``: one host synchronisation per step. Exact NaN / +inf / -inf
counts cost a pass per class, so they are counted only once a cheap flag trips.

Tensors are checked in groups of one device and one dtype; a dtype's values
from several devices are joined on an accelerator when one holds any (host
values go to it without waiting, device values never come to the host but in
the one read). fp8 tensors, which CPU kernels cannot reduce, are widened
exactly to float32 one tensor at a time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanrunbook.capture.torch._convert import as_checkable, safetensors_dtype

__all__ = [
    "Counted",
    "GradNorms",
    "NormChooser",
    "Readout",
    "count_rows",
    "counted",
    "exact_counts",
    "gradients",
    "joined",
    "max_rows",
    "nonfinite_flag",
]


def gradients(params: Iterable[Any]) -> list[Any]:
    """The dense gradient tensors of ``params`` (a sparse gradient's values)."""
    out = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        out.append(g.coalesce().values() if g.is_sparse else g.detach())
    return out


def _by_device_dtype(tensors: Iterable[Any]) -> dict[tuple[Any, Any], list[Any]]:
    """Non-empty floating tensors by (device, dtype), as man 7 states the checks."""
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _home(values: Sequence[Any]) -> Any:
    """Where values of several devices are joined: the first accelerator that
    holds one (so device values never travel to the host one by one), else
    the first value's device."""
    for v in values:
        if v.device.type != "cpu":
            return v.device
    return values[0].device


def joined(values: Sequence[Any]) -> list[Any]:
    """``values`` on their :func:`_home`; a host value goes to an accelerator
    without waiting (non_blocking: no stream synchronisation)."""
    home = _home(values)
    return [
        v if v.device == home else v.to(home, non_blocking=v.device.type == "cpu") for v in values
    ]


def _by_name(parts: Iterable[tuple[Any, Any]]) -> dict[str, list[Any]]:
    """(dtype, device value) pairs by the dtype's safetensors name (dtypes
    without one are left out)."""
    named: dict[str, list[Any]] = {}
    for dtype, value in parts:
        name = safetensors_dtype(dtype)
        if name is not None:
            named.setdefault(name, []).append(value)
    return named


def _fused_norms(tensors: list[Any]) -> Any:
    try:
        norms = list(torch._foreach_norm(tensors, 2.0, dtype=torch.float32))
    except (TypeError, RuntimeError):  # torch without the dtype argument
        norms = [n.float() for n in torch._foreach_norm(tensors, 2.0)]
    return torch.stack([n.to(norms[0].device) for n in norms])


def _dot_norms(tensors: list[Any]) -> Any:
    with torch.no_grad():
        return torch.stack([torch.dot(t.view(-1), t.view(-1)) for t in tensors]).sqrt()


class NormChooser:
    """Per-tensor L2 norms of CPU float32 tensors by whichever of two kernels is
    faster on this machine now, by measurement: one fused ``_foreach_norm``, or
    a BLAS dot per tensor. On the 2-core CPU the dots were 2x faster idle and
    15x slower with another process on a core (a parallel region per tensor,
    each waiting for the descheduled thread), so neither wins for good: both
    are timed on the first calls, and every ``recheck`` calls the other one is
    timed again (a moving average of each decides)."""

    def __init__(self, recheck: int = 200) -> None:
        self.recheck = recheck
        self.calls = 0
        self.seconds: dict[str, float] = {}

    @property
    def choice(self) -> str:
        return min(self.seconds, key=lambda k: self.seconds[k]) if self.seconds else "fused"

    def norms(self, tensors: list[Any]) -> Any:
        """A 1-D float32 tensor: each tensor's L2 norm."""
        self.calls += 1
        if self.calls <= 4:
            kernel = "dot" if self.calls % 2 else "fused"
        elif self.calls % self.recheck == 0:
            kernel = "fused" if self.choice == "dot" else "dot"
        else:
            kernel = self.choice
        start = time.perf_counter()
        out = _dot_norms(tensors) if kernel == "dot" else _fused_norms(tensors)
        elapsed = time.perf_counter() - start
        previous = self.seconds.get(kernel)
        self.seconds[kernel] = elapsed if previous is None else 0.5 * (previous + elapsed)
        return out


_CHOOSER = NormChooser()


def _norms(tensors: list[Any]) -> Any:
    """Per-tensor L2 norms of one device and dtype, a 1-D float32 tensor (so float16
    squares do not overflow): the measured faster kernel for CPU float32 tensors
    (:class:`NormChooser`), one norm per widened tensor for fp8 (no fused kernel
    takes it), one fused ``_foreach_norm`` otherwise."""
    if tensors and tensors[0].element_size() == 1:
        return torch.stack([torch.linalg.vector_norm(as_checkable(t)) for t in tensors])
    if tensors and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    ):
        return _CHOOSER.norms(tensors)
    return _fused_norms(tensors)


@dataclass
class GradNorms:
    """Device values: the total L2 norm (non-finite when any gradient is, or when
    finite ones overflow float32 squares), and per dtype the largest per-tensor
    norm, which bounds that dtype's max abs from above."""

    total: Any
    bounds: dict[str, Any]

    @classmethod
    def of(cls, grads: Sequence[Any]) -> GradNorms | None:
        per_group = [
            (dtype, _norms(group)) for (_, dtype), group in _by_device_dtype(grads).items()
        ]
        if not per_group:
            return None
        total = torch.linalg.vector_norm(torch.cat(joined([n for _, n in per_group])))
        bounds = {
            name: torch.stack(joined([n.max() for n in norms])).amax()
            for name, norms in _by_name(per_group).items()
        }
        return cls(total, bounds)


def nonfinite_flag(tensors: Sequence[Any]) -> Any:
    """A 0-dim float32 that is non-finite when any element of ``tensors`` is NaN or
    infinite: their L2 norm (see :func:`_norms`; a max would miss -inf). Finite
    values can trip it only when their squares overflow, which the exact count
    then clears."""
    norms = GradNorms.of(tensors)
    return norms.total if norms is not None else torch.zeros((), dtype=torch.float32)


@dataclass(frozen=True)
class Counted:
    """Exact counts of one dtype group, and its finite max abs (None if none)."""

    dtype: str
    nan: int
    posinf: int
    neginf: int
    max_abs: float | None


def count_rows(tensors: Sequence[Any]) -> tuple[list[str], Any]:
    """Device rows, one per dtype (its devices' groups joined): NaN, +inf, -inf
    counts, finite max abs, and whether any element is finite (one pass per
    class: the slow path, taken once a flag tripped or on a sampled step). Read
    them with :func:`counted`."""
    per_group = []
    for (_, dtype), group in _by_device_dtype(tensors).items():
        per = []
        for tensor in group:
            t = as_checkable(tensor)
            finite = torch.isfinite(t)
            zero = torch.zeros((), dtype=t.dtype, device=t.device)
            per.append(
                torch.stack(
                    [
                        t.isnan().sum().double(),
                        t.isposinf().sum().double(),
                        t.isneginf().sum().double(),
                        torch.where(finite, t.abs(), zero).amax().double(),
                        finite.any().double(),
                    ]
                )
            )
        per_group.append((dtype, torch.stack(per)))
    rows, names = [], []
    for name, parts in _by_name(per_group).items():
        stacked = torch.cat(joined(parts))
        rows.append(torch.cat([stacked[:, :3].sum(0), stacked[:, 3:].amax(0)]))
        names.append(name)
    if not rows:
        return [], torch.zeros((0, 5), dtype=torch.float64)
    return names, torch.stack(rows)


def _maxima(group: list[Any]) -> Any:
    """Each tensor's largest magnitude, a 1-D float32 tensor on the group's device."""
    return torch.stack([as_checkable(t).abs().amax().float() for t in group])


def max_rows(tensors: Sequence[Any]) -> tuple[list[str], Any]:
    """Per dtype (its devices' groups joined), the largest magnitude (one pass
    per tensor, on the device): the finite max abs when the tensors are finite,
    which a sampled step learns from its flag in the same read."""
    per_group = [(dtype, _maxima(group)) for (_, dtype), group in _by_device_dtype(tensors).items()]
    named = _by_name(per_group)
    if not named:
        return [], torch.zeros(0)
    maxima = [torch.cat(joined(parts)).amax() for parts in named.values()]
    return list(named), torch.stack(joined(maxima))


def counted(names: Sequence[str], values: Sequence[float]) -> list[Counted]:
    """:func:`count_rows`' rows, read (5 values per dtype group, flattened)."""
    out = []
    for index, name in enumerate(names):
        nan, posinf, neginf, max_abs, any_finite = values[5 * index : 5 * index + 5]
        out.append(
            Counted(name, int(nan), int(posinf), int(neginf), max_abs if any_finite else None)
        )
    return out


def exact_counts(tensors: Sequence[Any]) -> list[Counted]:
    """:func:`count_rows`, read now. One fused norm per tensor first finds the
    tensors that hold a NaN or infinity: only those are counted class by class;
    the others need only their max abs (two host reads in all)."""
    groups = list(_by_device_dtype(tensors).values())
    if not groups:
        return []
    probe = Readout()
    for index, group in enumerate(groups):
        probe.add(str(index), _norms(group))
    norms = probe.read()
    suspect: list[Any] = []
    clean: list[Any] = []
    for index, group in enumerate(groups):
        for t, n in zip(group, norms[str(index)], strict=True):
            (clean if math.isfinite(n) else suspect).append(t)
    readout = Readout()
    names, rows = count_rows(suspect)
    if names:
        readout.add("rows", rows)
    clean_names, clean_maxima = max_rows(clean)
    if clean_names:
        readout.add("max", clean_maxima)
    values = readout.read()
    found = {c.dtype: c for c in counted(names, values.get("rows", []))}
    for dtype, top in zip(clean_names, values.get("max", []), strict=True):
        before = found.get(dtype, Counted(dtype, 0, 0, 0, None))
        best = top if before.max_abs is None else max(top, before.max_abs)
        found[dtype] = Counted(dtype, before.nan, before.posinf, before.neginf, best)
    return list(found.values())


class Readout:
    """Named device values packed into one float64 tensor and read with a single
    host transfer."""

    def __init__(self) -> None:
        self._parts: list[Any] = []
        self._slots: dict[str, tuple[int, int]] = {}
        self._size = 0

    def add(self, name: str, value: Any) -> None:
        flat = value.detach().reshape(-1).double()
        self._slots[name] = (self._size, self._size + flat.numel())
        self._size += flat.numel()
        self._parts.append(flat)

    def read(self) -> dict[str, list[float]]:
        if not self._parts:
            return {}
        values = torch.cat(joined(self._parts)).tolist()  # the one sync
        return {name: values[a:b] for name, (a, b) in self._slots.items()}
