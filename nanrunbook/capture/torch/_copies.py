"""Copies of a training step's objects that share no tensor with the real ones.

A replay runs on these, so the real model, optimizer, scaler and batch are left
bit-identical ("reproduce without an update").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["clone_batch", "copy_optimizer", "copy_scaler", "flatten"]


def flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of a nested batch or module output, in order."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from flatten(item, f"{prefix}/{index}" if prefix else str(index))


def clone_batch(value: Any) -> Any:
    """A copy of a nested batch: tensors detached and cloned, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        items = {k: clone_batch(v) for k, v in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(clone_batch(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(clone_batch(v) for v in value)
    return copy.deepcopy(value)


def copy_optimizer(
    optimizer: Any,
    mapping: Mapping[int, Any],
    factory: Callable[[list[dict[str, Any]]], Any] | None,
) -> Any:
    """The optimizer rebuilt on copied parameters (``mapping``: id of a real
    parameter -> its copy), its state loaded from a deep copy of the real one's
    state_dict (never sharing a tensor with it)."""
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if id(param) not in mapping:
                raise ValueError("the optimizer holds a parameter that is not in the model")
            params.append(mapping[id(param)])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if factory is not None:
        rebuilt = factory(groups)
    else:
        try:
            rebuilt = type(optimizer)(groups)
        except TypeError:
            rebuilt = type(optimizer)(groups, **optimizer.defaults)
        rebuilt.defaults = copy.deepcopy(optimizer.defaults)
    rebuilt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return rebuilt


def copy_scaler(scaler: Any, state: Mapping[str, Any] | None = None) -> Any:
    """An enabled GradScaler rebuilt from ``scaler``'s state_dict (or ``state``), or None."""
    if scaler is None or not scaler.is_enabled():
        return None
    saved = dict(state) if state is not None else scaler.state_dict()
    rebuilt = torch.amp.GradScaler(
        getattr(scaler, "_device", "cuda"),
        init_scale=saved["scale"],
        growth_factor=saved["growth_factor"],
        backoff_factor=saved["backoff_factor"],
        growth_interval=saved["growth_interval"],
    )
    rebuilt.load_state_dict(copy.deepcopy(saved))
    return rebuilt
