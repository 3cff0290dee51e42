"""Real Accelerate loops for the adapter's tests: the MLP regression of
``lightning_support`` without Lightning, prepared by an ``Accelerator`` on the
CPU, with gradient accumulation, ``accelerator.clip_grad_norm_`` and a
per-step LR scheduler, as Accelerate's own examples write the loop.

Run as a script under ``torchrun --nproc-per-node 2`` it is one rank of a
2-process job (gloo); rank 1's third batch holds a NaN.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sentinel_support import facts, params_finite, state_bits
from torch import nn

from nanrunbook.capture.adapters.accelerate import AcceleratorSentinel
from nanrunbook.capture.torch import SentinelHold

warnings.filterwarnings("ignore", category=DeprecationWarning)


def batches(count: int, corrupt: int | None = None, seed: int = 0) -> list[Any]:
    """``count`` batches of 8; with ``corrupt``, that record's first feature is NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8 * count, 8, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(8 * count, generator=g)
    if corrupt is not None:
        x[corrupt, 0] = float("nan")
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 8 * count, 8)]


def mse(model: Any, batch: Any) -> Any:
    x, y = batch
    return ((model(x).squeeze(1).float() - y) ** 2).mean()


def sentinel_facts(run_id: str, tmp: Path, **more: Any) -> dict[str, Any]:
    objective = {"id": "mse", "reduction": "mean"}
    return facts(run_id, tmp, data={"id": "synthetic-regression"}, objective=objective, **more)


@dataclass
class Ran:
    """What a loop ended with; ``before``: the state at the held step's first
    forward (model, optimizer, scheduler bits, ``accelerator.step``)."""

    hold: SentinelHold | None = None
    steps: int = 0  # optimizer steps completed
    truth: tuple[int, str] | None = None  # without the sentinel: first non-finite step, stage
    before: Any = None
    end: Any = None
    after: Any = field(default=None)
    final: Any = None  # the bits at the end, without object identities (to compare runs)


def run(
    batches_: list[Any],
    *,
    tmp: Path | None,
    run_id: str = "run",
    optimizer: str = "adamw",
    jump: float = 1.0,
    jump_at: int = 3,
    accumulate: int = 2,
    clip: float | None = 1.0,
    mixed_precision: str = "no",
) -> Ran:
    """One loop; under the sentinel when ``tmp`` is given, else recording the truth."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate's state is a process-wide singleton: each loop here starts its own.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulate, mixed_precision=mixed_precision
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    opt = kind(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < jump_at else jump)
    model, opt, scheduler = accelerator.prepare(net, opt, scheduler)
    plain = (opt.optimizer, scheduler.scheduler)

    def state() -> Any:
        return (state_bits(net, *plain), accelerator.step)

    sentinel = (
        AcceleratorSentinel(
            accelerator, model, opt, mse, scheduler=scheduler, **sentinel_facts(run_id, tmp)
        )
        if tmp is not None
        else None
    )
    ran = Ran()
    try:
        for index, batch in enumerate(batches_):
            with accelerator.accumulate(model):
                if index % accumulate == 0:
                    ran.before = state()
                if sentinel is not None:
                    loss = sentinel.forward(batch)
                else:
                    loss = mse(model, batch)
                    _truth(ran, batch, loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    if sentinel is None:
                        _truth(ran, None, None, net)
                    if clip is not None:
                        accelerator.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                scheduler.step()
                opt.zero_grad()
                if accelerator.sync_gradients:
                    ran.steps += 1
    except SentinelHold as hold:
        ran.hold = hold
    if sentinel is not None:
        sentinel.close()
        assert "clip_grad_norm_" not in vars(accelerator)
    ran.after = state()
    ran.final = (state_bits(net, *plain, same=False), accelerator.step)
    ran.end = params_finite(net)
    return ran


def _truth(ran: Ran, batch: Any, loss: Any, net: Any = None) -> None:
    """The first step (1-based) whose input, loss or unclipped gradients went
    non-finite, and the stage."""
    if ran.truth is not None:
        return
    step = ran.steps + 1
    if batch is not None and not all(bool(torch.isfinite(t).all()) for t in batch):
        ran.truth = (step, "input")
    elif loss is not None and not math.isfinite(float(loss.detach())):
        ran.truth = (step, "loss")
    elif net is not None and not all(bool(torch.isfinite(p.grad).all()) for p in net.parameters()):
        ran.truth = (step, "backward")


def rank_main(tmp: Path) -> None:
    """One torchrun rank: its own batches (rank 1's third holds a NaN)."""
    rank = int(os.environ["RANK"])
    data = batches(12, corrupt=8 * 2 + 5 if rank == 1 else None, seed=rank)
    ran = run(data, tmp=tmp, run_id="ddp", optimizer="sgd", accumulate=1, clip=None)
    hold = ran.hold
    result = {
        "held": hold.step if hold else None,
        "stage": hold.stage if hold else None,
        "reason": hold.reason if hold else None,
        "origin": list(hold.origin_ranks) if hold and hold.origin_ranks is not None else None,
        "untouched": hold is not None and ran.after == ran.before,
        "finite": ran.end,
        "world": int(os.environ["WORLD_SIZE"]),
    }
    (tmp / f"result-{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
