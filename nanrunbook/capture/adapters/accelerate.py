"""The sentinel in a Hugging Face Accelerate loop: one added line, one changed.

::

    from nanrunbook.capture.adapters.accelerate import AcceleratorSentinel

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sentinel = AcceleratorSentinel(accelerator, model, optimizer, compute_loss,
                                   scheduler=scheduler, run_id="run-7", checkpoint={...},
                                   data={...}, objective={...})
    for batch in loader:
        with accelerator.accumulate(model):
            loss = sentinel.forward(batch)       # was: loss = compute_loss(model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()                     # raises SentinelHold on a held step
            scheduler.step()
            optimizer.zero_grad()
    sentinel.close()

The loop keeps its ``accelerator.backward``, ``accelerator.clip_grad_norm_`` and
its prepared optimizer and scheduler. :class:`AcceleratorSentinel` builds a
:class:`~nanrunbook.capture.torch.Sentinel` on the prepared model (DDP under
several processes), the optimizer and scheduler inside Accelerate's wrappers,
and votes on the default process group, which Accelerate's state initialised
(gloo on CPU). Its keyword arguments are the Sentinel's, less the ones the
accelerator owns (scaler, process group).

What Accelerate hides, and how the adapter gets it:

* the loss as backpropagated: ``accelerator.backward`` divides the loss by
  ``gradient_accumulation_steps`` itself; the sentinel sees (and a replay
  backwards) that divided loss, while ``forward`` returns the loop's own loss
  to give ``accelerator.backward``;
* the gradients before clipping: ``accelerator.clip_grad_norm_`` clips at once;
  the adapter sets it on the accelerator instance to unscale as Accelerate
  does and then ``Sentinel.clip_grad_norm_``, whose norm is the check and whose
  clip is applied once the step is known finite;
* the counters: ``accelerator.accumulate`` counts each micro-batch
  (``accelerator.step``) and the prepared scheduler counts the micro-batches
  between steps (``_step_count``); on a hold both are put back as they were
  at the step's first forward, so with the model, optimizer and scheduler the
  accelerator's state is as before the step.

Refused when built: fp16 with Accelerate's GradScaler (it replaces the
optimizer's ``step`` during its own ``step``), FSDP, DeepSpeed, XLA, and the
``skip`` policy when the prepared scheduler steps once per process (the
sentinel passes one scheduler call of a skipped step, not several).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from accelerate.utils import DistributedType

from nanrunbook.capture.adapters._forward_as_loss import ForwardAsLoss
from nanrunbook.capture.torch import Sentinel, SentinelHold

__all__ = ["AcceleratorSentinel"]

_OWNED = ("scaler", "process_group")
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def _inner(prepared: Any, attribute: str) -> Any:
    """The torch object inside Accelerate's wrapper (or the object itself)."""
    return getattr(prepared, attribute, prepared)


class AcceleratorSentinel:
    """The sentinel on an accelerator's prepared model, optimizer and scheduler.
    ``sentinel`` is the :class:`Sentinel`; ``forward`` and ``close`` are the
    loop's; ``checkpointed`` is the sentinel's."""

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        compute_loss: Callable[[Any, Any], Any],
        *,
        scheduler: Any = None,
        **options: Any,
    ) -> None:
        owned = sorted(set(options) & set(_OWNED))
        if owned:
            raise TypeError(f"the accelerator owns {', '.join(owned)}: give the sentinel its facts")
        _refuse_unsupported(accelerator, scheduler, options.get("policy", "hold"))
        self.accelerator = accelerator
        self._loss = ForwardAsLoss(
            compute_loss, lambda loss: loss, lambda: int(accelerator.gradient_accumulation_steps)
        )
        plain_optimizer = _inner(optimizer, "optimizer")
        self._scheduler = _inner(scheduler, "scheduler") if scheduler is not None else None
        self.sentinel = Sentinel(
            model, plain_optimizer, self._loss, scheduler=self._scheduler, **options
        )
        self._first_forward = True  # the next forward begins a step
        self._counters: tuple[int, int | None] = (0, None)
        inner = plain_optimizer.step  # the sentinel's wrapper

        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except SentinelHold:
                self._restore_counters()
                raise
            finally:
                self._first_forward = True

        step.__dict__.update(getattr(inner, "__dict__", {}))  # the LR scheduler's marker
        self._undo = [(plain_optimizer, "step", "step" in vars(plain_optimizer), inner)]
        plain_optimizer.step = step
        sentinel = self.sentinel

        def clip_grad_norm_(
            parameters: Iterable[Any], max_norm: float, norm_type: float = 2
        ) -> Any:
            accelerator.unscale_gradients()  # as Accelerate does first (none without a scaler)
            return sentinel.clip_grad_norm_(list(parameters), max_norm, norm_type)

        self._undo.append((accelerator, "clip_grad_norm_", False, None))
        accelerator.clip_grad_norm_ = clip_grad_norm_

    # ------------------------------------------------------------- the loop

    def forward(self, batch: Any) -> Any:
        """``compute_loss(model, batch)`` through ``Sentinel.forward``; returns the
        loop's loss (for ``accelerator.backward``, which divides it for
        accumulation, as the sentinel's copy already is)."""
        if self._first_forward:
            self._counters = (
                self.accelerator.step,
                getattr(self._scheduler, "_step_count", None),
            )
            self._first_forward = False
        self.sentinel.forward(batch)
        return self._loss.take()

    def checkpointed(self, checkpoint_id: str, **kwargs: Any) -> None:
        self.sentinel.checkpointed(checkpoint_id, **kwargs)

    def close(self) -> None:
        """The last update's check and line; the accelerator and the optimizer as
        they were."""
        self._remove()
        self.sentinel.close()

    def __enter__(self) -> AcceleratorSentinel:
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        self._remove()
        self.sentinel.__exit__(kind, error, trace)

    # -------------------------------------------------------------- private

    def _restore_counters(self) -> None:
        step, scheduler_steps = self._counters
        self.accelerator.step = step
        if scheduler_steps is not None and self._scheduler is not None:
            self._scheduler._step_count = scheduler_steps

    def _remove(self) -> None:
        for obj, name, had, previous in reversed(self._undo):
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)
        self._undo = []


def _refuse_unsupported(accelerator: Any, scheduler: Any, policy: str) -> None:
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise TypeError(f"Accelerate's {kind} is not supported (one process, or DDP)")
    if accelerator.scaler is not None:
        raise TypeError(
            "fp16 with Accelerate's GradScaler replaces optimizer.step during its own step:"
            " not supported; bf16 needs no scaler"
        )
    steps_per_process = scheduler is not None and getattr(scheduler, "step_with_optimizer", False)
    several = steps_per_process and not scheduler.split_batches and accelerator.num_processes > 1
    if policy == "skip" and several:
        raise TypeError(
            "the prepared scheduler steps once per process for each optimizer step; the skip"
            " policy passes one of those calls: use the hold policy"
        )
