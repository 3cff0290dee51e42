"""What a replay looks at in a tensor: finiteness, rows, extremes, autocast.

Counts are torch's own (``isfinite``, ``isnan``...), on a float view where a
dtype lacks them (fp8 widened exactly, complex as its real pairs).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nanrunbook.capture.torch._convert import as_checkable
from nanrunbook.capture.torch._copies import flatten
from nanrunbook.capture.torch.shrink._results import TensorFacts

__all__ = [
    "all_finite",
    "autocast_state",
    "facts",
    "inputs_facts",
    "named_facts",
    "nonfinite_rows",
    "requires_grad_flags",
    "tensor_finite",
]


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _leaves(value: Any) -> Iterator[Any]:
    """Tensors and Python floats of a nested value, in order."""
    if isinstance(value, torch.Tensor | float):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)


def tensor_finite(tensor: Any) -> bool:
    """Every element of a floating tensor finite (other dtypes always are). One
    min/max pass: NaN propagates through both and an infinity is an extreme, so
    this is exact, and about 6x cheaper than ``isfinite(t).all()`` (measured
    on a 2M-element float32 tensor), which allocates a mask."""
    if not _floating(tensor) or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(as_checkable(tensor))
    return bool(torch.isfinite(low) & torch.isfinite(high))


def all_finite(value: Any) -> bool:
    """True when every floating element (and Python float) of ``value`` is finite."""
    for leaf in _leaves(value):
        if isinstance(leaf, float):
            if not math.isfinite(leaf):
                return False
        elif not tensor_finite(leaf):
            return False
    return True


def nonfinite_rows(value: Any, size: int) -> frozenset[int] | None:
    """Indices along dimension 0 holding a non-finite element, over the floating
    tensors of ``value`` whose first dimension is ``size``; None when none has it."""
    rows: set[int] | None = None
    for _, tensor in flatten(value, ""):
        if not _floating(tensor) or tensor.dim() == 0 or tensor.shape[0] != size:
            continue
        bad = ~torch.isfinite(as_checkable(tensor)).reshape(size, -1).all(dim=1)
        rows = (rows or set()) | {int(i) for i in torch.nonzero(bad).flatten().tolist()}
    return None if rows is None else frozenset(rows)


def facts(name: str, tensor: Any) -> TensorFacts:
    """Counts by kind and finite extremes of one tensor (non-floating: all finite)."""
    shape = tuple(int(d) for d in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    n = tensor.numel()
    if not _floating(tensor) or n == 0:
        values = tensor.detach().double() if n and not tensor.is_complex() else None
        low = float(values.min()) if values is not None else None
        high = float(values.max()) if values is not None else None
        top = float(values.abs().max()) if values is not None else None
        return TensorFacts(name, dtype, shape, n, 0, 0, 0, low, high, top)
    t = as_checkable(tensor).double()
    nan, pos, neg = int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum())
    finite = t[torch.isfinite(t)]
    if finite.numel() == 0:
        return TensorFacts(name, dtype, shape, n, nan, pos, neg, None, None, None)
    return TensorFacts(
        name,
        dtype,
        shape,
        n,
        nan,
        pos,
        neg,
        float(finite.min()),
        float(finite.max()),
        float(finite.abs().max()),
    )


def named_facts(prefix: str, value: Any) -> tuple[TensorFacts, ...]:
    return tuple(facts(f"{prefix}/{name}" if name else prefix, t) for name, t in flatten(value, ""))


def inputs_facts(inputs: tuple[Any, Any]) -> tuple[TensorFacts, ...]:
    args, kwargs = inputs
    return named_facts("args", args) + named_facts("kwargs", kwargs)


def autocast_state(value: Any) -> tuple[str, str] | None:
    """(device type, dtype) of the autocast in force for the tensors of ``value``."""
    devices = [t.device.type for _, t in flatten(value, "")] or ["cpu"]
    device = devices[0]
    try:
        if torch.is_autocast_enabled(device):
            return device, str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return None


def requires_grad_flags(value: Any) -> list[bool]:
    """Whether each tensor of ``value``, in order, requires grad."""
    return [bool(t.requires_grad) for _, t in flatten(value, "")]
