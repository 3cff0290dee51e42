"""Replays with one mechanism changed, applied with torch: :func:`replay_changed`
and :func:`autocast_off`, re-exported by :mod:`nanrunbook.capture.mechanisms`
(where the changes themselves are declared, torch-free)."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanrunbook.capture._changes import (
    CHANGE_FIELD,
    Change,
    LossScale,
    OtherBatch,
    Reduction,
    WithoutAutocast,
)
from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch.replay._replay_step import replay_step
from nanrunbook.capture.writer import BundleWriter
from nanrunbook.contract import SCALE_RANGE, is_contract_scale

__all__ = ["autocast_off", "replay_changed"]

Loss = Callable[[Any, Any], Any]


@dataclass
class _Plan:
    """What one change does to the replay's arguments, and how to prove it acted."""

    batch: Any
    compute_loss: Loss
    scaler: Any
    binding: dict[str, dict[str, Any]]
    note: str
    acted: Callable[[], bool] = field(default=lambda: True)
    why_not: str = ""


def replay_changed(
    change: Change,
    model: Any,
    optimizer: Any,
    batch: Any,
    compute_loss: Loss,
    *,
    binding: Mapping[str, Mapping[str, Any]],
    scaler: Any = None,
    target: Any = None,
    overwrite: bool = False,
    **replay: Any,
) -> BundleWriter:
    """:func:`~nanrunbook.capture.torch.replay_step` with ``change`` applied.

    Every other argument means what it means for ``replay_step`` (give the same
    ``rng_state`` or ``seed`` as the replay it is compared with). The changed
    binding item gets a ``replay_change`` detail saying what changed. Returns
    the BundleWriter; with ``target`` the bundle is also written there.
    Raises ValueError when the change cannot apply or changed nothing.
    """
    items = {name: dict(fields) for name, fields in binding.items()}
    plan = _plan(change, batch, compute_loss, scaler, items)
    writer = replay_step(
        model,
        optimizer,
        plan.batch,
        plan.compute_loss,
        binding=plan.binding,
        scaler=plan.scaler,
        **replay,
    )
    if not plan.acted():
        raise ValueError(plan.why_not)
    item = writer.binding[change.item]
    writer.binding[change.item] = {**item, CHANGE_FIELD: plan.note}
    if target is not None:
        writer.write(target, overwrite=overwrite)
    return writer


def _plan(
    change: Change, batch: Any, compute_loss: Loss, scaler: Any, binding: dict[str, Any]
) -> _Plan:
    if isinstance(change, WithoutAutocast):
        return _without_autocast(batch, compute_loss, scaler, binding)
    if isinstance(change, LossScale):
        return _loss_scale(change.scale, batch, compute_loss, scaler, binding)
    if isinstance(change, Reduction):
        return _reduction(change.to, batch, compute_loss, scaler, binding)
    if isinstance(change, OtherBatch):
        if _same_batch(batch, change.batch):
            raise ValueError("the other batch is bit for bit the batch: nothing would change")
        return _Plan(change.batch, compute_loss, scaler, binding, "batch substituted")
    raise TypeError(f"not a mechanism change: {type(change).__name__}")


# -------------------------------------------------------------- precision


_lock = threading.Lock()
_users = 0
_off: dict[int, list[int]] = {}  # thread id -> [autocast regions turned off]
_original_enter: Any = None


def _enter(self: Any) -> Any:
    """autocast.__enter__, run disabled on a thread that asked for it."""
    counter = _off.get(threading.get_ident())
    if counter is None or not self._enabled:
        return _original_enter(self)
    counter[0] += 1
    self._enabled = False  # what enabled=False would have made of it
    try:
        return _original_enter(self)
    finally:
        self._enabled = True  # the object may be entered again, elsewhere


@contextlib.contextmanager
def autocast_off() -> Iterator[list[int]]:
    """Within the block, on this thread only, every autocast region runs disabled
    (autocast already on when the block starts is turned off too). Yields a
    one-item list: the number of enabled regions turned off. Other threads'
    autocast is untouched; the class is restored when the last user leaves."""
    global _users, _original_enter
    autocast = torch.amp.autocast_mode.autocast
    counter = [0]
    with _lock:
        if _users == 0:
            _original_enter = autocast.__enter__
            autocast.__enter__ = _enter  # type: ignore[method-assign]
        _users += 1
        _off[threading.get_ident()] = counter
    try:
        with contextlib.ExitStack() as outer:
            for device in _autocast_devices():
                outer.enter_context(torch.autocast(device, enabled=False))
                counter[0] += 1
            yield counter
    finally:
        with _lock:
            del _off[threading.get_ident()]
            _users -= 1
            if _users == 0:
                autocast.__enter__ = _original_enter  # type: ignore[method-assign]


def _autocast_devices() -> list[str]:
    """Device types whose autocast is on now."""
    found = []
    for device in ("cpu", "cuda", "xpu", "mps", "hpu"):
        with contextlib.suppress(RuntimeError, TypeError, ValueError, AttributeError):
            if torch.is_autocast_enabled(device):
                found.append(device)
    return found


def _without_autocast(
    batch: Any, compute_loss: Loss, scaler: Any, binding: dict[str, Any]
) -> _Plan:
    turned_off = [0]

    def loss(model: Any, data: Any) -> Any:
        with autocast_off() as counter:
            result = compute_loss(model, data)
        turned_off[0] += counter[0]
        return result

    return _Plan(
        batch,
        loss,
        scaler,
        binding,
        "autocast disabled: compute in the parameters' dtype",
        acted=lambda: turned_off[0] > 0,
        why_not="compute_loss entered no enabled autocast region: float32 instead of autocast"
        " changes nothing",
    )


# -------------------------------------------------------------- loss scale


def _loss_scale(
    scale: float, batch: Any, compute_loss: Loss, scaler: Any, binding: dict[str, Any]
) -> _Plan:
    if scaler is None or not scaler.is_enabled():
        raise ValueError("another loss scale needs the step's enabled GradScaler (scaler=)")
    if not is_contract_scale(scale):
        raise ValueError(f"a loss scale is {SCALE_RANGE}, not {scale!r}")
    before = scaler.get_scale()
    if scale == before:
        raise ValueError(f"the scaler's scale is already {scale:g}: nothing would change")
    state = dict(scaler.state_dict())
    state["scale"] = float(scale)
    rescaled = torch.amp.GradScaler(
        getattr(scaler, "_device", "cuda"),
        init_scale=float(scale),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
    )
    rescaled.load_state_dict(state)
    return _Plan(batch, compute_loss, rescaled, binding, f"loss scale {before:g} -> {scale:g}")


# -------------------------------------------------------------- reduction


class _RewriteReduction(TorchFunctionMode):
    """Calls of loss functions with ``reduction`` = ``old`` run with ``new``."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__()
        self.old, self.new = old, new
        self.rewritten = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        parameters = _reduction_signature(func)
        if parameters is not None:
            bound = parameters.bind(*args, **kwargs)
            legacy = [n for n in ("size_average", "reduce") if bound.arguments.get(n) is not None]
            if legacy:
                raise ValueError(
                    f"{func.__name__} is called with {', '.join(legacy)}: the reduction"
                    " cannot be changed on its own"
                )
            bound.apply_defaults()
            if bound.arguments["reduction"] == self.old:
                bound.arguments["reduction"] = self.new
                self.rewritten += 1
                return func(*bound.args, **bound.kwargs)
        return func(*args, **kwargs)


_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def _reduction_signature(func: Any) -> inspect.Signature | None:
    """The signature of a torch.nn.functional loss with a ``reduction`` parameter."""
    if func not in _SIGNATURES:
        signature = None
        if getattr(func, "__module__", None) == "torch.nn.functional":
            with contextlib.suppress(TypeError, ValueError):
                candidate = inspect.signature(func)
                if "reduction" in candidate.parameters:
                    signature = candidate
        _SIGNATURES[func] = signature
    return _SIGNATURES[func]


def _reduction(
    to: str, batch: Any, compute_loss: Loss, scaler: Any, binding: dict[str, Any]
) -> _Plan:
    objective = binding.get("objective")
    if objective is None or "reduction" not in objective:
        raise ValueError("the binding's objective needs its reduction to change it")
    old = objective["reduction"]
    if to not in ("mean", "sum") or to == old:
        raise ValueError(f"reduction {old!r} -> {to!r}: give 'mean' or 'sum', not the current one")
    modes: list[_RewriteReduction] = []

    def loss(model: Any, data: Any) -> Any:
        mode = _RewriteReduction(old, to)
        modes.append(mode)
        with mode:
            return compute_loss(model, data)

    changed = {**binding, "objective": {**objective, "reduction": to}}
    return _Plan(
        batch,
        loss,
        scaler,
        changed,
        f"reduction {old} -> {to}",
        acted=lambda: any(mode.rewritten for mode in modes),
        why_not=f"compute_loss called no torch.nn.functional loss with reduction {old!r}:"
        " the reduction cannot be changed from outside",
    )


# ------------------------------------------------------------------ batch


def _same_batch(a: Any, b: Any) -> bool:
    """The same structure and, tensor by tensor, the same stored bits."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        ra, rb = tensor_to_raw(a), tensor_to_raw(b)
        return (ra.dtype, ra.shape, ra.data) == (rb.dtype, rb.shape, rb.data)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same_batch(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same_batch(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
