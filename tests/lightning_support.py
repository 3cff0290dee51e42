"""Real Lightning fits for the adapter's tests: a small regression module, its
data, a Trainer without loggers or checkpoints, and callbacks that record the
truth (the first step whose loss or gradients went non-finite, seen without the
sentinel) and the Trainer's whole state at each step's first batch.

Run as a script (``python lightning_support.py <tmp> <max_steps>``) it is one
rank of a 2-process ``strategy="ddp"`` fit on gloo: Lightning's launcher runs
this same command again for rank 1. Rank 1's fourth batch holds a NaN.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from sentinel_support import facts, params_finite, state_bits
from torch import nn

from nanrunbook.capture.adapters.lightning import SentinelCallback
from nanrunbook.capture.torch import SentinelHold

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "accelerator": "cpu",
}


def quiet_lightning() -> None:
    """Lightning's advice (num_workers, the logger) and torchdata's deprecations
    are not the adapter's: kept out of the tests' output."""
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    warnings.filterwarnings("ignore", module="lightning_fabric")
    warnings.filterwarnings("ignore", category=DeprecationWarning)


class Regression(pl.LightningModule):
    """An MLP regression; ``jump`` multiplies the learning rate from step
    ``jump_at`` on (an absurd learning rate)."""

    def __init__(
        self, optimizer: str = "adamw", lr: float = 1e-2, jump: float = 1.0, jump_at: int = 3
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.choice, self.lr, self.jump, self.jump_at = optimizer, lr, jump, jump_at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = ((self.net(x).squeeze(1).float() - y) ** 2).mean()
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> Any:
        kind = torch.optim.AdamW if self.choice == "adamw" else torch.optim.SGD
        optimizer = kind(self.parameters(), lr=self.lr)
        jump, at = self.jump, self.jump_at
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < at else jump)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def loader(corrupt: int | None = None, seed: int = 0, size: int = 96) -> Any:
    """Batches of 8; with ``corrupt``, that record's first feature is NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(size, generator=g)
    if corrupt is not None:
        x[corrupt, 0] = float("nan")
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def sentinel_facts(run_id: str, tmp: Path, **more: Any) -> dict[str, Any]:
    objective = {"id": "mse", "reduction": "mean"}
    return facts(run_id, tmp, data={"id": "synthetic-regression"}, objective=objective, **more)


class Truth(pl.Callback):
    """Without the sentinel: the first step whose loss or (unclipped) gradients
    went non-finite, and at which stage."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.stage: str | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if self.step is None and not all(bool(torch.isfinite(t).all()) for t in batch):
            self.step, self.stage = trainer.global_step + 1, "input"

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self.step is None and not math.isfinite(float(loss.detach())):
            self.step, self.stage = trainer.global_step + 1, "loss"

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if self.step is None and not all(bool(torch.isfinite(g).all()) for g in grads):
            self.step, self.stage = trainer.global_step + 1, "backward"


class StateAtStepStart(pl.Callback):
    """At each step's first batch: every bit of the model, optimizer and LR
    scheduler, the fit loop's state (its progress counters), the global step."""

    def __init__(self) -> None:
        self.before: Any = None
        self.steps_started = 0

    def now(self, trainer: Any, pl_module: Any) -> Any:
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        return (
            state_bits(pl_module, trainer.optimizers[0], scheduler),
            copy.deepcopy(trainer.fit_loop.state_dict()),
            trainer.global_step,
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        if idx % trainer.accumulate_grad_batches == 0:
            self.before = self.now(trainer, pl_module)
            self.steps_started += 1


def trainer(callbacks: list[Any], max_steps: int, **options: Any) -> Any:
    return pl.Trainer(max_steps=max_steps, callbacks=callbacks, **{**QUIET, **options})


def fit(module: Any, data: Any, callbacks: list[Any], max_steps: int, **options: Any) -> Any:
    """The Trainer after its fit, and the hold it ended with (or None)."""
    run = trainer(callbacks, max_steps, **options)
    try:
        run.fit(module, data)
    except SentinelHold as hold:
        return run, hold
    return run, None


# ------------------------------------------------------------------ DDP job


def ddp_rank(tmp: Path, max_steps: int) -> None:
    """One rank of the 2-process DDP fit; writes ``result-<rank>.json``."""
    from pytorch_lightning.strategies import DDPStrategy

    quiet_lightning()
    torch.manual_seed(0)
    module = Regression(optimizer="sgd", lr=0.01)
    rank = int(__import__("os").environ.get("LOCAL_RANK", "0"))
    data = loader(corrupt=8 * 3 + 2 if rank == 1 else None, seed=rank)
    recorder = StateAtStepStart()
    sentinel = SentinelCallback(**sentinel_facts("ddp", tmp))
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
    run = trainer(
        [recorder, sentinel], max_steps, devices=2, strategy=strategy, use_distributed_sampler=False
    )
    hold = None
    try:
        run.fit(module, data)
    except SentinelHold as error:
        hold = error
    after = recorder.now(run, module)
    result = {
        "held": hold.step if hold else None,
        "stage": hold.stage if hold else None,
        "reason": hold.reason if hold else None,
        "origin": list(hold.origin_ranks) if hold and hold.origin_ranks is not None else None,
        "global_step": run.global_step,
        "untouched": hold is not None and after == recorder.before,
        "finite": params_finite(module),
    }
    (tmp / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    ddp_rank(Path(sys.argv[1]), int(sys.argv[2]))
