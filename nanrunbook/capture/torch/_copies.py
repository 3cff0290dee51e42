"""Copies of a training step's objects that share no tensor with the real ones.

A replay runs on these, so the real model, optimizer, scaler and batch are left
bit-identical ("reproduce without an update").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["clone_batch", "copy_optimizer", "copy_scaler", "eager_module", "flatten"]


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
    """A copy of a nested batch: tensors detached and cloned, containers rebuilt,
    other values deep-copied (or shared, when they cannot be copied)."""
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
    try:
        return copy.deepcopy(value)
    except Exception:  # a handle or lock in the batch: shared, never a training step's crash
        return value


def copy_optimizer(
    optimizer: Any,
    mapping: Mapping[int, Any],
    factory: Callable[[list[dict[str, Any]]], Any] | None,
    state: Mapping[str, Any] | None = None,
) -> Any:
    """The optimizer rebuilt on copied parameters (``mapping``: id of a real
    parameter -> its copy), its state loaded from a deep copy of the real one's
    state_dict (never sharing a tensor with it), or from ``state``, such a copy
    made elsewhere."""
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
    rebuilt.load_state_dict(copy.deepcopy(optimizer.state_dict()) if state is None else state)
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


def eager_module(model: Any) -> tuple[Any, bool]:
    """The module a replay copies: DistributedDataParallel and ``torch.compile``
    wrappers taken off (hooks do not fire inside a compiled graph, so the replay
    runs eagerly on the original module, ``_orig_mod``); True when one was compiled."""
    compiled = False
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model, compiled = model._orig_mod, True
        else:
            return model, compiled
