"""The failing step, and one replay of it (or of some of its examples) on copies.

Every replay starts from a fresh deep copy of the model, a clone of the batch
and the step's RNG state, inside a forked RNG: the caller's model, batch and
RNG are never touched. Probes attached to the copy are removed afterwards,
exceptions included.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch

from nanrunbook.capture.torch._copies import clone_batch, copy_scaler, flatten
from nanrunbook.capture.torch.replay import RngState, cuda_devices
from nanrunbook.capture.torch.shrink._finiteness import all_finite
from nanrunbook.capture.torch.shrink._results import ShrinkError

__all__ = ["FailingStep", "Ran", "Stop", "replay_examples", "resolved", "select_examples"]


class Stop(BaseException):
    """Raised from a hook once the watched operation has run: the rest of the
    replay cannot change the answer. A BaseException, so that a loss function's
    ``except Exception`` does not swallow it."""


@dataclass(frozen=True)
class FailingStep:
    """The failing step as the loop ran it, which every replay starts from.

    ``compute_loss(model, batch)`` is the loop's forward and loss; ``autocast``
    the autocast regions the loop opened around it (each with ``device_type``,
    ``dtype`` and optionally ``cache_enabled``, as the sentinel's ``Autocast``;
    none when compute_loss opens its own).
    ``scaler`` (a ``torch.amp.GradScaler``) or ``loss_scale`` (a static scale)
    scales the loss before backward as the loop did. ``rng_state`` is
    ``torch.get_rng_state()`` (or the sentinel's ``RngState``) taken before the
    forward: every replay starts from it. ``select(batch, examples)`` returns the batch restricted to the
    given indices; by default every tensor whose first dimension is the batch
    size is indexed along it. ``batch_size`` defaults to the first dimension of
    the batch's first tensor.
    """

    model: Any
    optimizer: Any
    batch: Any
    compute_loss: Callable[[Any, Any], Any]
    scaler: Any = None
    loss_scale: float | None = None
    rng_state: Any = None
    select: Callable[[Any, tuple[int, ...]], Any] | None = None
    batch_size: int | None = None
    autocast: tuple[Any, ...] = ()

    @classmethod
    def of_micro_batch(cls, objects: Any, micro: Any) -> FailingStep:
        """The step as a sentinel holds it: its step objects (model, optimizer,
        scaler, loss_scale, compute_loss) and one micro-batch (batch, rng,
        autocast)."""
        return cls(
            objects.model,
            objects.optimizer,
            micro.batch,
            objects.compute_loss,
            scaler=objects.scaler,
            loss_scale=objects.loss_scale,
            rng_state=micro.rng,
            autocast=tuple(micro.autocast),
        )


def _autocast(region: Any) -> AbstractContextManager[Any]:
    cache = getattr(region, "cache_enabled", None)
    return torch.autocast(region.device_type, dtype=region.dtype, cache_enabled=cache)


def resolved(step: FailingStep) -> FailingStep:
    """``step`` with its batch size and RNG state filled in (the current state when
    none was given: every later replay starts from the same one)."""
    size = step.batch_size
    if size is None:
        tensors = [t for _, t in flatten(step.batch, "")]
        if not tensors or tensors[0].dim() == 0:
            raise ShrinkError("the batch's first tensor has no batch dimension: pass batch_size")
        size = int(tensors[0].shape[0])
    if size < 1:
        raise ShrinkError("batch_size must be at least 1")
    state = step.rng_state
    if state is None:
        state = RngState.now()
    elif not isinstance(state, RngState):
        state = RngState(state)  # a torch.get_rng_state() tensor
    return replace(step, batch_size=size, rng_state=state)


def select_examples(batch: Any, examples: tuple[int, ...], size: int) -> Any:
    """``batch`` with every tensor whose first dimension is ``size`` indexed by
    ``examples``; other tensors and values as they are, containers rebuilt."""
    index = torch.tensor(examples, dtype=torch.long)
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == size:
            return batch.index_select(0, index.to(batch.device))
        return batch
    if isinstance(batch, Mapping):
        items = {k: select_examples(v, examples, size) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(select_examples(v, examples, size) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(select_examples(v, examples, size) for v in batch)
    return batch


def _prepared_copy(model: Any) -> Any:
    """A deep copy to replay on. In-place activations are switched off on the
    copy: same values, and full backward hooks refuse a module output that the
    next module rewrites in place."""
    replica = copy.deepcopy(model)
    for module in replica.modules():
        if getattr(module, "inplace", None) is True:
            module.inplace = False
    for param in replica.parameters():
        param.grad = None
    return replica


@dataclass(frozen=True, slots=True)
class Ran:
    """How far a replay went: the loss and gradients' finiteness (None: not
    reached), and whether an observer stopped it early."""

    loss_finite: bool | None
    grads_finite: bool | None
    stopped: bool


def _scaled(step: FailingStep, loss: Any) -> Any:
    if step.scaler is not None and step.scaler.is_enabled():
        return copy_scaler(step.scaler).scale(loss)
    return loss if step.loss_scale is None else loss * step.loss_scale


def replay_examples(
    step: FailingStep,
    examples: tuple[int, ...] | None,
    observers: Callable[[Any], list[Any]],
    *,
    backward: bool,
) -> Ran:
    """One replay on a fresh copy of the model and a clone of the batch (or of
    the given examples), from the step's RNG state; the caller's model, batch
    and RNG are left as they were. ``observers(copy)`` attaches the observers
    (each one's ``context()`` is entered around the forward only: function
    modes, the named-probe sink) and every one is removed afterwards,
    exceptions included. Backward runs, scaled as
    the loop scaled it, when asked and the loss is finite."""
    model = _prepared_copy(step.model)
    size = step.batch_size or 0
    if examples is None:
        batch = clone_batch(step.batch)
    elif step.select is not None:
        batch = clone_batch(step.select(step.batch, examples))
    else:
        batch = clone_batch(select_examples(step.batch, examples, size))
    attached = observers(model)
    loss_finite = grads_finite = None
    with (
        torch.random.fork_rng(devices=cuda_devices()),
        step.rng_state.kept(),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
        step.rng_state.restore()
        try:
            with ExitStack() as around:
                for region in step.autocast:
                    around.enter_context(_autocast(region))
                for observer in attached:
                    around.enter_context(observer.context())
                loss = step.compute_loss(model, batch)
            loss_finite = all_finite(loss)
            if backward and loss_finite:
                _scaled(step, loss).backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                grads_finite = all_finite(grads)
        except Stop:
            return Ran(loss_finite, grads_finite, True)
        finally:
            for observer in attached:
                observer.remove()
    return Ran(loss_finite, grads_finite, False)
