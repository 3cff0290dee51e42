"""The sentinel in a Hugging Face ``transformers.Trainer``: one changed line.

::

    from nanrunbook.capture.adapters.transformers import SentinelTrainer

    trainer = SentinelTrainer(model=model, args=args, train_dataset=train,   # was: Trainer(
                              sentinel={"run_id": "run-7", "checkpoint": {...},
                                        "data": {...}, "objective": {...}})
    trainer.train()                              # raises SentinelHold on a held step

A subclass of the Trainer takes :class:`SentinelTrainerMixin` first in its bases
(``class MyTrainer(SentinelTrainerMixin, SFTTrainer)``). ``sentinel=`` takes
:class:`~nanrunbook.capture.torch.Sentinel`'s keyword arguments other than the
ones the Trainer owns (model, optimizer, loss, scheduler, scaler, process group).

What the Trainer hides from a callback, and how the adapter gets it:

* the batch and the loss: ``training_step`` and ``compute_loss`` (documented)
  send the step's forward through ``Sentinel.forward``; the loss the sentinel
  sees and a replay backwards is divided for gradient accumulation as
  ``training_step`` divides it (``_forward_as_loss``), and the Trainer gets its
  own undivided loss to divide;
* the gradients before clipping: the Trainer clips (or, with
  ``max_grad_norm=0``, measures the norm in place) before
  ``on_pre_optimizer_step``, and there one NaN makes every gradient NaN (an
  infinity: every finite one zero, itself NaN); the adapter hands that clip to ``Sentinel.clip_grad_norm_``,
  which checks the norm and applies the same clip once the step is known
  finite (the Trainer's private ``_clip_grad_norm``/``_get_grad_norm``, within
  the pinned versions);
* the hold: ``optimizer.step()`` raises ``SentinelHold`` before anything steps,
  so the model, the optimizer, the scheduler, ``state.global_step`` and the data
  position are as before the step; the counters the Trainer advanced on the held
  step's batches (``current_flos``, ``state.num_input_tokens_seen``) are put
  back, and ``train()`` ends with the hold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback

from nanrunbook.capture.adapters._forward_as_loss import ForwardAsLoss
from nanrunbook.capture.torch import Sentinel, SentinelHold

__all__ = ["SentinelTrainer", "SentinelTrainerMixin"]

# What the adapter takes from the Trainer itself; sentinel= may not name them.
_TRAINER_OWNED = ("model", "optimizer", "compute_loss", "scheduler", "scaler", "process_group")
# The Trainer's parallel modes whose clip and step are a plain torch loop's.
_PLAIN_LOOPS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class _StepCounters(TrainerCallback):
    """The counters the Trainer advances on each batch before the optimizer step,
    taken at each step's start, so a hold puts them back."""

    def __init__(self, trainer: SentinelTrainerMixin) -> None:
        self.trainer = trainer
        self.flos = 0.0
        self.tokens = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.flos = float(self.trainer.current_flos)
        self.tokens = int(state.num_input_tokens_seen)

    def put_back(self) -> None:
        self.trainer.current_flos = self.flos
        self.trainer.state.num_input_tokens_seen = self.tokens


class SentinelTrainerMixin:
    """The sentinel inside a ``transformers.Trainer`` (put it first in the bases).

    ``sentinel``: the :class:`~nanrunbook.capture.torch.Sentinel`'s facts and
    options (``run_id``, ``checkpoint``, ``data``, ``objective`` and any of its
    keyword options). The checkpoint's ``step`` defaults to the Trainer's
    ``state.global_step`` when training starts (after a resume, the step it
    resumed from), so the sentinel's step numbers are the Trainer's;
    ``incident_dir`` defaults to ``<output_dir>/incident``; ``loader_cursor`` to
    the Trainer's global step and epoch. The sentinel is built at the first
    training step, when the Trainer has made its optimizer and scheduler, and is
    :attr:`sentinel` from then on.
    """

    # The Trainer's attributes this mixin reads (declared for type checkers).
    args: Any
    state: Any
    accelerator: Any
    optimizer: Any
    lr_scheduler: Any
    current_flos: float
    current_gradient_accumulation_steps: int
    loss_is_scaled_for_ga: bool | None
    model_accepts_loss_kwargs: bool
    compute_loss_func: Any

    def __init__(self, *args: Any, sentinel: Mapping[str, Any], **kwargs: Any) -> None:
        owned = sorted(set(sentinel) & set(_TRAINER_OWNED))
        if owned:
            raise TypeError(
                f"sentinel= takes the loop's facts and options; the Trainer gives"
                f" {', '.join(owned)} itself"
            )
        super().__init__(*args, **kwargs)
        self.sentinel_options = dict(sentinel)
        self.sentinel: Sentinel | None = None
        self._counters = _StepCounters(self)
        self.add_callback(self._counters)  # type: ignore[attr-defined]
        self._through_sentinel = False  # the next compute_loss is the step's forward
        self._num_items: Any = None  # the step's num_items_in_batch, for the replay too
        self._ga_divisor = 1  # what training_step divides this step's loss by
        self._step_loss = ForwardAsLoss(self._trainer_loss, lambda loss: loss, self._divisor)

    # ------------------------------------------------------------ the run

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a held step ends it with ``SentinelHold``."""
        try:
            result = super().train(*args, **kwargs)  # type: ignore[misc]
        except SentinelHold:
            self._counters.put_back()
            self._stop_sentinel(None)
            raise
        except BaseException as error:
            self._stop_sentinel(error)
            raise
        sentinel, self.sentinel = self.sentinel, None
        if sentinel is not None:
            sentinel.close()  # checks the last update: a non-finite one holds here
        return result

    def _stop_sentinel(self, error: BaseException | None) -> None:
        sentinel, self.sentinel = self.sentinel, None
        if sentinel is None:
            return
        if error is None:
            sentinel.close()  # after a hold: only takes the wrappers off
        else:  # this rank alone may have raised: no collective the others would not reach
            sentinel.__exit__(type(error), error, error.__traceback__)

    def _start_sentinel(self, model: Any) -> Sentinel:
        kind = self.accelerator.distributed_type
        if kind not in _PLAIN_LOOPS:
            raise NotImplementedError(
                f"the sentinel's Trainer adapter runs under {', '.join(k.value for k in _PLAIN_LOOPS)};"
                f" this Trainer runs under {kind.value}"
            )
        if self.accelerator.scaler is not None:
            raise NotImplementedError(
                "the sentinel's Trainer adapter does not run fp16 with accelerate's GradScaler"
                " (accelerate swaps the optimizer's step around it): use bf16"
            )
        if self.args.n_gpu > 1:  # one process driving several devices
            raise NotImplementedError(
                "the sentinel's Trainer adapter does not run under DataParallel"
                f" ({self.args.n_gpu} GPUs in one process): launch one process per GPU (torchrun)"
            )
        options = dict(self.sentinel_options)
        checkpoint = dict(options.pop("checkpoint", {}))
        at = self.state.global_step
        if checkpoint.setdefault("step", at) != at:
            raise ValueError(
                f"the checkpoint's step {checkpoint['step']} is not the step the Trainer"
                f" starts from (state.global_step {at})"
            )
        options.setdefault("incident_dir", Path(self.args.output_dir) / "incident")
        options.setdefault("loader_cursor", self._loader_cursor)
        optimizer = self.optimizer
        while isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        self.sentinel = Sentinel(
            model,
            optimizer,
            self._step_loss,
            checkpoint=checkpoint,
            scheduler=self.lr_scheduler,
            **options,
        )
        return self.sentinel

    def _loader_cursor(self) -> dict[str, Any]:
        """Where the Trainer's data stands: it resumes by global step (and epoch)."""
        step = self.state.global_step
        run = self.sentinel_options.get("run_id")
        return {
            "id": f"{run}.global-step-{step}",
            "kind": "trainer-global-step",
            "global_step": step,
            "epoch": self.state.epoch,
        }

    # ------------------------------------------------------------ a step

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """``Trainer.training_step`` with its forward through the sentinel."""
        if self.sentinel is None:
            self._start_sentinel(model)
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:  # the Trainer's own rule (training_step)
            scaled = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        self._ga_divisor = 1 if scaled else self.current_gradient_accumulation_steps
        self._num_items = num_items_in_batch
        self._through_sentinel = True
        try:
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        finally:
            self._through_sentinel = False

    def compute_loss(
        self,
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The training step's forward goes through ``Sentinel.forward``; every
        other call (evaluation, the sentinel's own) is the Trainer's."""
        if not self._through_sentinel or return_outputs or self.sentinel is None:
            return super().compute_loss(  # type: ignore[misc]
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        self._through_sentinel = False
        self.sentinel.forward(inputs)  # checks the loss divided as training_step divides it
        return self._step_loss.take()  # the Trainer's own loss, which it divides itself

    def _trainer_loss(self, model: Any, inputs: Any) -> Any:
        """The Trainer's ``compute_loss`` for the step (and its replays)."""
        return super().compute_loss(model, inputs, num_items_in_batch=self._num_items)  # type: ignore[misc]

    def _divisor(self) -> int:
        return self._ga_divisor

    def _clip_grad_norm(self, model: Any) -> Any:
        if self.sentinel is None:
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        return self._sentinel_clip(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None and self.sentinel is not None:
            # The Trainer measures the norm by a clip to infinity (a multiply by 1.0).
            grad_norm = self._sentinel_clip(model, math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]

    def _sentinel_clip(self, model: Any, max_norm: float) -> torch.Tensor:
        assert self.sentinel is not None  # no GradScaler: nothing to unscale first
        norm: torch.Tensor = self.sentinel.clip_grad_norm_(model.parameters(), max_norm)
        return norm


class SentinelTrainer(SentinelTrainerMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` under the sentinel: ``SentinelTrainer(...,
    sentinel={...})`` where the loop said ``Trainer(...)``."""
