"""The sentinel in a PyTorch Lightning ``Trainer``: one added callback.

::

    from nanrunbook.capture.adapters.lightning import SentinelCallback

    sentinel = SentinelCallback(run_id="run-7", checkpoint={...}, data={...}, objective={...})
    trainer = Trainer(..., callbacks=[sentinel])     # was: Trainer(...)
    trainer.fit(module, loader)                      # raises SentinelHold on a held step

``SentinelCallback`` takes :class:`~nanrunbook.capture.torch.Sentinel`'s
keyword arguments other than the ones the Trainer owns (model, optimizer, loss,
scheduler, scaler, process group). It imports ``lightning.pytorch`` when that
is installed (or already imported), else ``pytorch_lightning``: give it to a
Trainer of the same package.

What Lightning hides from a callback, and how the adapter gets it:

* the batch, the loss and the autocast region: ``on_train_batch_start`` has the
  batch but runs outside the precision plugin's autocast, and no hook has the
  forward; the adapter sets the LightningModule's ``training_step`` on the
  instance, so Lightning's own call (inside autocast, through DDP) goes through
  ``Sentinel.forward``. The loss the sentinel sees and a replay backwards is
  the one Lightning backpropagates (divided by ``accumulate_grad_batches``);
* the order: Lightning passes its closure (forward, backward,
  ``on_before_optimizer_step``, clipping) into ``optimizer.step(closure)``, so
  nothing is known when ``step`` is called; the adapter runs the closure first
  (under ``enable_grad``, as torch's optimizers do) and then the step, where the
  sentinel decides;
* the gradients before clipping: ``gradient_clip_val`` (norm) goes to
  ``Sentinel.clip_grad_norm_``, whose norm is the check and whose clip is
  applied once the step is known finite (the precision plugin's
  ``clip_grad_by_norm``, set on the instance). ``gradient_clip_algorithm="value"``
  is refused: it clamps an infinite gradient before any check could see it;
* the counters: Lightning counts the step's batch, zero_grad and optimizer step
  before the update; on a hold the loops' counters are put back as they were
  at the step's first ``on_train_batch_start``, so ``trainer.global_step``, the
  loops' progress, the LR schedulers, the model and the optimizer are as before
  the step, and ``fit`` ends with ``SentinelHold``.

Automatic optimization with one optimizer (and at most one LR scheduler), on
one device or under DDP (``strategy="ddp"`` and its spawned forms; the vote
runs on the default process group, the strategy's). Manual optimization,
several optimizers, FSDP and DeepSpeed are refused when training starts.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from nanrunbook.capture.adapters._forward_as_loss import ForwardAsLoss
from nanrunbook.capture.adapters._lightning_counters import LoopCounters
from nanrunbook.capture.torch import Sentinel, SentinelHold

__all__ = ["SentinelCallback", "lightning_package"]

# Sentinel arguments the Trainer owns.
_OWNED = ("model", "optimizer", "compute_loss", "scheduler", "scaler", "process_group")


def lightning_package() -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``: the one imported already,
    else the first installed."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        if name in sys.modules:
            return sys.modules[name]
    try:
        import lightning.pytorch as package
    except ImportError:
        import pytorch_lightning as package
    return package


pl = lightning_package()
_Callback: Any = pl.Callback


def _loss_of(output: Any) -> Any:
    """The loss in ``training_step``'s output, as Lightning reads it."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError(
        "under the sentinel, training_step returns the loss (a tensor or a dict with 'loss'),"
        f" not {type(output).__name__}: a skipped step has no loss to check"
    )


def _lightning_module(model: Any) -> Any:
    """The LightningModule in ``model`` (DDP and Lightning's wrapper taken off;
    the replay's copy of either holds one too)."""
    for module in model.modules():
        if isinstance(module, pl.LightningModule):
            return module
    raise TypeError(f"no LightningModule in {type(model).__name__}")


class SentinelCallback(_Callback):  # type: ignore[misc]
    """The sentinel on the Trainer's model, optimizer and LR scheduler, built when
    training starts (after a checkpoint's state is restored; its ``step`` must
    be the Trainer's ``global_step``). ``sentinel`` is the :class:`Sentinel`
    during the fit."""

    def __init__(self, **options: Any) -> None:
        owned = sorted(set(options) & set(_OWNED))
        if owned:
            raise TypeError(
                f"the Trainer owns {', '.join(owned)}: give the sentinel its facts only"
            )
        self.options = options
        self.sentinel: Sentinel | None = None
        self._forward: ForwardAsLoss | None = None
        self._counters: LoopCounters | None = None
        self._call: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})  # training_step's other args
        self._in_step = False
        self._undo: list[tuple[Any, str, bool, Any]] = []

    # --------------------------------------------------------------- set-up

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """After the checkpoint's training state is restored: the sentinel's
        steps count on from the checkpoint's, which must be the Trainer's."""
        optimizer, scheduler = _refuse_unsupported(trainer, pl_module)
        self._forward = ForwardAsLoss(
            self._run_training_step, _loss_of, lambda: int(trainer.accumulate_grad_batches)
        )
        self.sentinel = Sentinel(
            trainer.strategy.model,
            optimizer,
            self._forward,
            scheduler=scheduler,
            **self.options,
        )
        start = self.sentinel.facts.start_step
        if trainer.global_step != start:
            self.sentinel.close()
            self.sentinel = None
            raise ValueError(
                f"the fit starts at global_step {trainer.global_step}, the sentinel's checkpoint"
                f" at step {start}: give checkpoint={{'step': {trainer.global_step}, ...}}"
            )
        self._counters = LoopCounters(trainer.fit_loop)

        # A plain function on the instance: a replay's deep copy of the module
        # shares it (deepcopy copies no function), not the callback, the sentinel
        # and the process group a bound method would drag along.
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._training_step(*args, **kwargs)

        self._set(pl_module, "training_step", training_step)
        inner = optimizer.step  # the sentinel's wrapper

        def step(closure: Any = None, **kwargs: Any) -> Any:
            return self._step(inner, closure, **kwargs)

        # The LR scheduler's marker on the step it wrapped: without it, torch warns
        # that the step was replaced after the scheduler was built.
        step.__dict__.update(getattr(inner, "__dict__", {}))

        self._set(optimizer, "step", step)
        plugin = trainer.strategy.precision_plugin
        if trainer.strategy.precision_plugin is not plugin:
            raise TypeError("the strategy builds a new precision plugin at each access")

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            self._live.clip_grad_norm_(list(plugin.main_params(optimizer)), clip_val)

        self._set(plugin, "clip_grad_by_norm", clip_grad_by_norm)

    @property
    def _live(self) -> Sentinel:
        if self.sentinel is None:
            raise RuntimeError("the sentinel starts with the training")
        return self.sentinel

    def _set(self, obj: Any, name: str, function: Any) -> None:
        """``obj.<name>`` replaced on the instance (its class untouched), until the fit ends."""
        had = name in vars(obj)
        self._undo.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, function)

    def _remove(self) -> None:
        """What was on the instances before (the sentinel's own wrapper of
        ``optimizer.step``, which the sentinel's close then takes off)."""
        for obj, name, had, previous in reversed(self._undo):
            if had:
                setattr(obj, name, previous)
            else:
                vars(obj).pop(name, None)
        self._undo.clear()

    # ------------------------------------------------------------- the step

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._in_step and self._counters is not None:
            self._counters.save()  # the step's first batch: its counters before it
            self._in_step = True

    def _training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's call of ``training_step``, through ``Sentinel.forward``."""
        self._call = (args, kwargs)
        self._live.forward(batch)
        assert self._forward is not None
        return self._forward.take()

    def _run_training_step(self, model: Any, batch: Any) -> Any:
        """The class's ``training_step`` on ``model``'s LightningModule: the live
        one, or a replay's copy (with the live call's other arguments)."""
        module = _lightning_module(model)
        args, kwargs = self._call
        if module._trainer is not None:
            return type(module).training_step(module, batch, *args, **kwargs)
        with warnings.catch_warnings():  # a replay's copy has no Trainer to log to
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            return type(module).training_step(module, batch, *args, **kwargs)

    def _step(self, inner: Any, closure: Any, **kwargs: Any) -> Any:
        """``optimizer.step(closure)``: the closure (forward, backward, hooks,
        clipping's norm), then the sentinel's step, which decides."""
        loss = None
        try:
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            inner(**kwargs)
        except SentinelHold:
            if self._counters is not None:
                self._counters.restore()
            raise
        finally:
            self._in_step = False
        return loss

    # ---------------------------------------------------------------- the end

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._remove()
        if self.sentinel is not None:
            self.sentinel.close()  # the last update's check and line; its wrappers off

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._remove()
        if self.sentinel is not None:  # this rank may be alone: no collective
            self.sentinel.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._remove()


def _refuse_unsupported(trainer: Any, pl_module: Any) -> tuple[Any, Any]:
    """The one optimizer and LR scheduler, or a TypeError naming what the
    adapter does not follow."""
    if not pl_module.automatic_optimization:
        raise TypeError(
            "manual optimization steps the optimizer inside training_step: use the Sentinel"
            " there as in a plain loop"
        )
    if len(trainer.optimizers) != 1:
        raise TypeError(f"one optimizer, not {len(trainer.optimizers)}")
    configs = trainer.lr_scheduler_configs
    if len(configs) > 1:
        raise TypeError(f"at most one LR scheduler, not {len(configs)}")
    strategy = type(trainer.strategy).__name__
    if strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise TypeError(f"the strategy {strategy} is not supported (one device, or DDP)")
    algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").lower()
    if trainer.gradient_clip_val and "value" in algorithm:
        raise TypeError(
            "gradient_clip_algorithm='value' clamps an infinite gradient to the clip value"
            " before the sentinel could check it: clip by norm"
        )
    return trainer.optimizers[0], configs[0].scheduler if configs else None
