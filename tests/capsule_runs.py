"""Training runs that hold and leave a capsule, and the entries that rebuild their
objects for ``nanrunbook replay`` (the same function the script builds with).

Run as a script, ``python capsule_runs.py KIND ROOT`` trains KIND under the
sentinel until it holds, with incident_dir ROOT, prints the capsule's path and
exits: the replay then runs in another process, after this one is gone.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
from sentinel_support import (
    Classifier,
    Pooler,
    Regressor,
    drifting_batch,
    facts,
    fp16_scaled_step,
    mse,
    quiet_thresholds,
    regression_batch,
    xent,
)
from torch import nn

from nanrunbook.capture.torch import Sentinel, SentinelHold

HELD = 3


def build_regressor() -> dict[str, Any]:
    """A regressor with dropout and batch norm, Adam and a step schedule."""
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "compute_loss": mse}


def build_fp16() -> dict[str, Any]:
    """A classifier under float16 autocast with a dynamic GradScaler and clipping."""
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    return {"model": model, "optimizer": optimizer, "scaler": scaler, "compute_loss": xent}


def pooled_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["tokens"], batch["mask"]), batch["y"])


def build_eps0() -> dict[str, Any]:
    """Adam with eps=0 on an embedding: the update goes NaN, rolled back."""
    model = Pooler()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    return {"model": model, "optimizer": optimizer, "compute_loss": pooled_loss}


def build_static() -> dict[str, Any]:
    """A classifier under float16 autocast with a static loss scale of 2^12."""
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"model": model, "optimizer": optimizer, "compute_loss": xent}


def build_absurd_lr() -> dict[str, Any]:
    """A warm-up written wrong: the learning rate x3000 from step 3."""
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 3 else 3000.0)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "compute_loss": mse}


def noisy_mse(generator: torch.Generator, model: nn.Module, batch: Any) -> torch.Tensor:
    """mse on inputs with noise drawn from the loop's own generator."""
    noise = torch.randn(batch["x"].shape, generator=generator) * 0.01
    return ((model(batch["x"] + noise) - batch["y"]) ** 2).mean()


def build_noisy() -> dict[str, Any]:
    """The regressor with input noise from a generator of the loop's own."""
    built = build_regressor()
    generator = torch.Generator().manual_seed(7)
    return {**built, "compute_loss": functools.partial(noisy_mse, generator),
            "generators": [generator]}  # fmt: skip


def _nan_micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches a step; at step HELD the second holds a NaN feature."""
    batch = regression_batch(step)
    halves = [
        {k: v[:8].clone() for k, v in batch.items()},
        {k: v[8:].clone() for k, v in batch.items()},
    ]
    if step == HELD:
        halves[1]["x"][2, 1] = float("nan")
    return halves


def train(kind: str, root: Path, steps: int = 100) -> SentinelHold:
    """Train ``kind`` until the sentinel holds; the hold."""
    torch.manual_seed(0)
    built = BUILDS[kind]()
    model, optimizer = built["model"], built["optimizer"]
    scheduler, scaler = built.get("scheduler"), built.get("scaler")
    sentinel = Sentinel(
        model,
        optimizer,
        built["compute_loss"],
        scheduler=scheduler,
        scaler=scaler,
        loss_scale=2.0**12 if kind == "static" else None,
        generators=built.get("generators", ()),
        snapshot=kind == "eps0",
        thresholds=quiet_thresholds(),
        **{**facts(kind, root), "incident_dir": root},
    )
    try:
        for i in range(1, steps + 1):
            optimizer.zero_grad()
            if kind in ("data-nan", "noisy"):
                for micro in _nan_micro_batches(i):
                    sentinel.forward(micro).backward()
                optimizer.step()
                scheduler.step()
            elif kind == "absurd-lr":
                sentinel.forward(regression_batch(i)).backward()
                optimizer.step()
                scheduler.step()
            elif kind == "static":
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = sentinel.forward(drifting_batch(i, drift_from=0))
                (loss * 2.0**12).backward()
                for p in model.parameters():
                    p.grad.div_(2.0**12)
                optimizer.step()
            elif kind == "fp16":
                fp16_scaled_step(
                    sentinel,
                    model,
                    optimizer,
                    scaler,
                    functools.partial(drifting_batch, i, drift_from=0),
                )
            else:
                g = torch.Generator().manual_seed(i)
                batch = {
                    "tokens": torch.randint(0, 20, (8, 6), generator=g),
                    "mask": torch.ones(8, 6),
                    "y": torch.randint(0, 2, (8,), generator=g),
                }
                sentinel.forward(batch).backward()
                optimizer.step()
    except SentinelHold as hold:
        return hold
    finally:
        sentinel.close()
    raise AssertionError(f"{kind} never held")


BUILDS = {
    "data-nan": build_regressor,
    "noisy": build_noisy,
    "fp16": build_fp16,
    "eps0": build_eps0,
    "static": build_static,
    "absurd-lr": build_absurd_lr,
}

if __name__ == "__main__":
    held = train(sys.argv[1], Path(sys.argv[2]))
    print(held.capsule)
