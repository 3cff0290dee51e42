"""Replays with one mechanism changed, applied with torch: :func:`replay_changed`
and :func:`autocast_off`, re-exported by :mod:`nanrunbook.capture.mechanisms`
(where the changes themselves are declared, torch-free)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanrunbook.capture._changes import (
    CHANGE_FIELD,
    AdamEps,
    AutocastDtype,
    BatchExamples,
    Change,
    ClipMaxNorm,
    Deterministic,
    LearningRate,
    LossScale,
    OtherBatch,
    Reduction,
    WithoutAutocast,
)
from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch._copies import flatten
from nanrunbook.capture.torch.replay._replay_step import (
    Autocast,
    Clipping,
    MicroBatch,
    Scaling,
    StepRecipe,
    replay_step,
)
from nanrunbook.capture.writer import BundleWriter
from nanrunbook.contract import SCALE_RANGE, is_contract_scale

__all__ = [
    "RecipeChange",
    "autocast_as",
    "autocast_off",
    "changed_examples",
    "changed_optimizer_values",
    "changed_recipe",
    "changed_reduction",
    "replay_changed",
]

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
        return changed_reduction(change.to, batch, compute_loss, scaler, binding)
    if isinstance(change, OtherBatch):
        if _same_batch(batch, change.batch):
            raise ValueError("the other batch is bit for bit the batch: nothing would change")
        return _Plan(change.batch, compute_loss, scaler, binding, "batch substituted")
    if isinstance(change, LearningRate):
        raise ValueError(
            "a learning-rate change applies to a resumed run (prove_recovery), not to a replay"
            " of one step on copies"
        )
    raise TypeError(f"not a mechanism change: {type(change).__name__}")


# -------------------------------------------------------------- precision


_lock = threading.Lock()
_users = 0
_off: dict[int, list[int]] = {}  # thread id -> [autocast regions turned off]
_as: dict[int, tuple[Any, list[int]]] = {}  # thread id -> (dtype, [regions recast])
_original_enter: Any = None


def _enter(self: Any) -> Any:
    """autocast.__enter__, run disabled (or in another dtype) on a thread that
    asked for it."""
    counter = _off.get(threading.get_ident())
    recast = _as.get(threading.get_ident())
    if recast is not None and self._enabled:
        recast[1][0] += 1
        saved = self.fast_dtype
        self.fast_dtype = recast[0]
        try:
            return _original_enter(self)
        finally:
            self.fast_dtype = saved
    if counter is None or not self._enabled:
        return _original_enter(self)
    counter[0] += 1
    self._enabled = False  # what enabled=False would have made of it
    try:
        return _original_enter(self)
    finally:
        self._enabled = True  # the object may be entered again, elsewhere


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    """autocast.__enter__ replaced while any thread needs it."""
    global _users, _original_enter
    autocast = torch.amp.autocast_mode.autocast
    with _lock:
        if _users == 0:
            _original_enter = autocast.__enter__
            autocast.__enter__ = _enter  # type: ignore[method-assign]
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                autocast.__enter__ = _original_enter  # type: ignore[method-assign]


@contextlib.contextmanager
def autocast_off() -> Iterator[list[int]]:
    """Within the block, on this thread only, every autocast region runs disabled
    (autocast already on when the block starts is turned off too). Yields a
    one-item list: the number of enabled regions turned off. Other threads'
    autocast is untouched; the class is restored when the last user leaves."""
    counter = [0]
    with _patched():
        _off[threading.get_ident()] = counter
        try:
            with contextlib.ExitStack() as outer:
                for device in _autocast_devices():
                    outer.enter_context(torch.autocast(device, enabled=False))
                    counter[0] += 1
                yield counter
        finally:
            del _off[threading.get_ident()]


@contextlib.contextmanager
def autocast_as(dtype: Any) -> Iterator[list[int]]:
    """Within the block, on this thread only, every enabled autocast region runs
    in ``dtype``, autocast already on included. Yields the count recast."""
    counter = [0]
    with _patched():
        _as[threading.get_ident()] = (dtype, counter)
        try:
            with contextlib.ExitStack() as outer:
                for device in _autocast_devices():
                    outer.enter_context(torch.autocast(device, dtype=dtype))
                yield counter
        finally:
            del _as[threading.get_ident()]


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


def changed_reduction(
    to: str, batch: Any, compute_loss: Loss, scaler: Any, binding: dict[str, Any]
) -> _Plan:
    """The plan of a replay whose ``compute_loss`` calls its loss functions with
    reduction ``to`` instead of the binding objective's (also a resumed run's,
    ``prove_recovery``); ValueError when the binding states no reduction or
    ``to`` is not another one."""
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


# ------------------------------------------------- a recipe with one change


@dataclass
class RecipeChange:
    """One change applied to a step's recipe: the recipe and binding to replay,
    the note for the changed item, and whether the change acted."""

    recipe: StepRecipe
    binding: dict[str, dict[str, Any]]
    note: str
    item: str
    acted: Callable[[], bool] = field(default=lambda: True)
    why_not: str = ""


@contextlib.contextmanager
def changed_recipe(
    change: Change, recipe: StepRecipe, optimizer: Any, binding: Mapping[str, Mapping[str, Any]]
) -> Iterator[RecipeChange]:
    """``recipe`` (of a replay of ``optimizer``'s step) with exactly ``change``
    applied. A change of the optimizer's hyperparameters or of the determinism
    flag holds for the block and is put back after: the replay copies the
    optimizer, and its state is loaded from it. ValueError when the change
    cannot apply or would change nothing."""
    items = {name: dict(fields) for name, fields in binding.items()}
    scaler = recipe.scaling.scaler if recipe.scaling.mode == "dynamic" else None
    if isinstance(change, WithoutAutocast | LossScale | Reduction | OtherBatch):
        plan = _plan(change, recipe.micro_batches[0].batch, recipe.compute_loss, scaler, items)
        changed = dataclasses.replace(recipe, compute_loss=plan.compute_loss)
        if isinstance(change, LossScale):
            changed = dataclasses.replace(changed, scaling=Scaling("dynamic", scaler=plan.scaler))
        if isinstance(change, OtherBatch):
            first = recipe.micro_batches[0]
            changed = dataclasses.replace(
                changed, micro_batches=(MicroBatch(change.batch, first.rng, first.autocast),)
            )
        yield RecipeChange(changed, plan.binding, plan.note, change.item, plan.acted, plan.why_not)
    elif isinstance(change, AutocastDtype):
        yield _recast(change, recipe, items)
    elif isinstance(change, BatchExamples):
        yield _examples(change, recipe, items)
    elif isinstance(change, ClipMaxNorm):
        yield _clipped(change, recipe, optimizer, items)
    elif isinstance(change, LearningRate | AdamEps):
        with changed_optimizer_values(change, optimizer) as note:
            yield RecipeChange(recipe, items, note, change.item)
    elif isinstance(change, Deterministic):
        if torch.are_deterministic_algorithms_enabled():
            raise ValueError("deterministic algorithms are already on: nothing would change")
        torch.use_deterministic_algorithms(True)
        try:
            yield RecipeChange(recipe, items, "deterministic algorithms on", change.item)
        finally:
            torch.use_deterministic_algorithms(False)
    else:
        raise TypeError(f"not a mechanism change: {type(change).__name__}")


def _recast(change: AutocastDtype, recipe: StepRecipe, binding: dict[str, Any]) -> RecipeChange:
    dtype = getattr(torch, change.dtype)
    recast = [0]
    regions = [r for micro in recipe.micro_batches for r in micro.autocast]
    if any(region.dtype == dtype for region in regions):
        raise ValueError(f"the step's autocast is already {change.dtype}: nothing would change")

    def loss(model: Any, data: Any) -> Any:
        with autocast_as(dtype) as counter:
            result = recipe.compute_loss(model, data)
        recast[0] += counter[0]
        return result

    micro = tuple(
        dataclasses.replace(
            m, autocast=tuple(Autocast(r.device_type, dtype, r.cache_enabled) for r in m.autocast)
        )
        for m in recipe.micro_batches
    )
    return RecipeChange(
        dataclasses.replace(recipe, compute_loss=loss, micro_batches=micro),
        binding,
        f"autocast in {change.dtype}",
        change.item,
        acted=lambda: bool(regions) or recast[0] > 0,
        why_not="the step entered no enabled autocast region: another autocast dtype"
        " changes nothing",
    )


def _select(index: Any, tensor: Any) -> Any:
    return tensor.index_select(0, index.to(tensor.device))


def _rows(value: Any, keep: Callable[[Any], Any], size: int) -> Any:
    """``value`` with ``keep`` applied to every tensor whose first dimension is
    the micro-batch's ``size`` (its examples)."""
    if isinstance(value, torch.Tensor):
        return keep(value) if value.dim() > 0 and value.shape[0] == size else value.clone()
    if isinstance(value, Mapping):
        return {k: _rows(v, keep, size) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_rows(v, keep, size) for v in value)
    return value


def changed_examples(change: BatchExamples, batches: Sequence[Any]) -> tuple[list[Any], str]:
    """The micro-batches ``batches`` of one step with ``change`` applied (their
    examples numbered across them in order) and what changed, said. ValueError
    when an example is not there or a micro-batch would be left empty."""
    changed = []
    start = 0
    touched: set[int] = set()
    for batch in batches:
        tensors = [t for _, t in flatten(batch, "") if t.dim() > 0]
        if not tensors:
            raise ValueError("a micro-batch holds no tensor with examples to drop or replace")
        size = int(tensors[0].shape[0])
        local = range(start, start + size)
        dropped = [i - start for i in change.drop if i in local]
        replaced = [(i - start, j - start) for i, j in change.replace if i in local]
        for i, j in change.replace:
            if i in local and j not in local:
                raise ValueError(f"batch=replace:{i}={j}: example {j} is not in {i}'s micro-batch")
        touched.update(i for i in change.drop if i in local)
        touched.update(i for i, _ in change.replace if i in local)
        if replaced:
            order = list(range(size))
            for i, j in replaced:
                order[i] = j
            index = torch.tensor(order)
            batch = _rows(batch, functools.partial(_select, index), size)
        if dropped:
            kept = torch.tensor([i for i in range(size) if i not in set(dropped)], dtype=torch.long)
            if not len(kept):
                raise ValueError("batch=drop would leave a micro-batch without examples")
            batch = _rows(batch, functools.partial(_select, kept), size)
        changed.append(batch)
        start += size
    wanted = set(change.drop) | {i for i, _ in change.replace}
    if wanted - touched:
        raise ValueError(
            f"the step has {start} examples (0 to {start - 1}):"
            f" no example {', '.join(map(str, sorted(wanted - touched)))}"
        )
    parts = []
    if change.drop:
        parts.append(f"examples {', '.join(map(str, change.drop))} dropped")
    if change.replace:
        parts.append(", ".join(f"example {i} replaced by {j}" for i, j in change.replace))
    return changed, "; ".join(parts)


def _examples(change: BatchExamples, recipe: StepRecipe, binding: dict[str, Any]) -> RecipeChange:
    batches, note = changed_examples(change, [micro.batch for micro in recipe.micro_batches])
    micro_batches = tuple(
        dataclasses.replace(micro, batch=batch)
        for micro, batch in zip(recipe.micro_batches, batches, strict=True)
    )
    return RecipeChange(
        dataclasses.replace(recipe, micro_batches=micro_batches), binding, note, change.item
    )


def _clipped(
    change: ClipMaxNorm, recipe: StepRecipe, optimizer: Any, binding: dict[str, Any]
) -> RecipeChange:
    before = recipe.clipping
    if change.max_norm is None:
        if before is None:
            raise ValueError("the step did not clip: clip=none changes nothing")
        return RecipeChange(
            dataclasses.replace(recipe, clipping=None), binding, "no clipping", change.item
        )
    if not change.max_norm > 0:
        raise ValueError(f"clip={change.max_norm:g}: a max norm is a positive number")
    if before is not None and before.max_norm == change.max_norm:
        raise ValueError(f"the step already clips at {change.max_norm:g}: nothing would change")
    if before is None:
        params = tuple(id(p) for g in optimizer.param_groups for p in g["params"])
        clipping = Clipping(change.max_norm, 2.0, params)
        note = f"clipping at max norm {change.max_norm:g} (L2, every parameter), none before"
    else:
        clipping = dataclasses.replace(before, max_norm=change.max_norm)
        note = f"clip max norm {before.max_norm:g} -> {change.max_norm:g}"
    return RecipeChange(dataclasses.replace(recipe, clipping=clipping), binding, note, change.item)


@contextlib.contextmanager
def changed_optimizer_values(change: LearningRate | AdamEps, optimizer: Any) -> Iterator[str]:
    """Within the block, ``optimizer``'s learning rates or ``eps`` as ``change``
    says (a replay's, or a resumed run's from the incident step on); yields
    what changed, said. ValueError when a group cannot take it or nothing
    would change."""
    groups = optimizer.param_groups
    key = "lr" if isinstance(change, LearningRate) else "eps"
    if isinstance(change, LearningRate):
        for group, _ in change.rates:
            if group is not None and not 0 <= group < len(groups):
                raise ValueError(f"lr: the optimizer has param groups 0 to {len(groups) - 1}")
        wanted: list[tuple[int, float]] = []
        for index, group in enumerate(groups):
            current = group.get("lr")
            if isinstance(current, float | int) and not isinstance(current, bool):
                rate = change.rate(index, float(current))
            else:
                rate = change.rate(index, math.nan) if change.factor is None else math.nan
            if rate is not None:
                wanted.append((index, rate))
    else:
        wanted = [(index, change.eps) for index in range(len(groups))]
    saved = [(index, groups[index].get(key)) for index, _ in wanted]
    for index, old in saved:
        if not isinstance(old, float | int) or isinstance(old, bool):
            what = "no" if old is None else f"a {type(old).__name__}"
            raise ValueError(f"param group {index} has {what} {key}: it cannot be set to a number")
    if all(groups[index][key] == value for index, value in wanted):
        raise ValueError(f"{key} is already that: nothing would change")
    note = ", ".join(f"group {i} {key} {groups[i][key]:g} -> {v:g}" for i, v in wanted)
    try:
        for index, value in wanted:
            groups[index][key] = float(value)
        yield note
    finally:
        for index, old in saved:
            groups[index][key] = old
