"""What the transformers, Lightning and Accelerate adapters cost a step: same-run ratios.

An MLP regression (``--width``, ``--depth``, batches of ``--batch``) trains for
``--steps`` steps with and without the adapter, in alternating runs from the
same initial state, in one process (torch on one thread). Per framework (and
a plain torch loop with the Sentinel itself, for reference): the
median step time of each (the first steps of each run left out as warm-up),
their ratio, and the time the adapter adds per step, in the thread's CPU time
(``time.thread_time``: on a shared machine other processes move wall-clock
step times by more than the adapter costs; the wall-clock ratio is printed
beside it). The adapter's cost is the sentinel's (its
bookkeeping, checks, one host read and telemetry line) plus its own routing
and, for Lightning, the loops' counters set aside at each step (timed apart).

    python bench/bench_adapters.py [--steps 40 --runs 5 --width 1024 --depth 3 --batch 256]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]
WARMUP = 5


# What the bench's loops state to the sentinel (they never hold).
STATED = {
    "checkpoint": {"id": "init", "verified_together": PARTS},
    "data": {"id": "synthetic"},
    "objective": {"id": "mse", "reduction": "mean"},
}


def facts(run_id: str, tmp: Path) -> dict[str, Any]:
    return {"run_id": run_id, "incident_dir": tmp / "incident", **STATED}


def make_net(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def data(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 32, generator=g)
    y = x.sum(1)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, steps * batch, batch)]


def mse(model: Any, batch: Any) -> Any:
    x, y = batch
    return ((model(x).squeeze(1) - y) ** 2).mean()


# ------------------------------------------------------------------ Lightning


def now() -> tuple[float, float]:
    return time.thread_time(), time.perf_counter()


def since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = now()
    return cpu - start[0], wall - start[1]


def medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    """Median CPU and wall-clock seconds of the steps after the warm-up."""
    kept = times[WARMUP:]
    return statistics.median(t[0] for t in kept), statistics.median(t[1] for t in kept)


def timed_steps(args: Any, step: Any, sentinel: Any) -> tuple[float, float]:
    """``step(batch)`` over the bench's batches, each timed; the sentinel closed after."""
    times = []
    for batch in data(args.steps, args.batch):
        start = now()
        step(batch)
        times.append(since(start))
    if sentinel is not None:
        sentinel.close()
    return medians(times)


def lightning_run(args: Any, adapter: bool, tmp: Path, index: int) -> tuple[float, float]:
    """The median step time (CPU, wall-clock seconds) of one fit."""
    import pytorch_lightning as pl

    from nanrunbook.capture.adapters.lightning import SentinelCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(args.width, args.depth)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return mse(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []
            self.start = (0.0, 0.0)

        def on_train_batch_start(self, *_: Any) -> None:
            self.start = now()

        def on_train_batch_end(self, *_: Any) -> None:
            self.times.append(since(self.start))

    torch.manual_seed(0)
    module, timer = Module(), Timer()
    callbacks: list[Any] = [timer]
    if adapter:
        callbacks.append(SentinelCallback(**facts(f"lightning-{index}", tmp)))
    trainer = pl.Trainer(
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        gradient_clip_val=1.0,
    )
    loader = torch.utils.data.DataLoader(data(args.steps, args.batch), batch_size=None)
    trainer.fit(module, loader)
    return medians(timer.times)


def counters_cost(args: Any) -> float:
    """Microseconds for one save of a fit loop's counters."""
    import pytorch_lightning as pl

    from nanrunbook.capture.adapters._lightning_counters import LoopCounters

    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    counters = LoopCounters(trainer.fit_loop)
    start = time.perf_counter()
    for _ in range(10_000):
        counters.save()
    return (time.perf_counter() - start) / 10_000 * 1e6


# ----------------------------------------------------------------- Accelerate


def accelerate_run(args: Any, adapter: bool, tmp: Path, index: int) -> tuple[float, float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from nanrunbook.capture.adapters.accelerate import AcceleratorSentinel

    AcceleratorState._reset_state()
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = make_net(args.width, args.depth)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(net, optimizer)
    sentinel = (
        AcceleratorSentinel(accelerator, model, optimizer, mse, **facts(f"accel-{index}", tmp))
        if adapter
        else None
    )

    def step(batch: Any) -> None:
        with accelerator.accumulate(model):
            loss = sentinel.forward(batch) if sentinel is not None else mse(model, batch)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

    return timed_steps(args, step, sentinel)


# --------------------------------------------------------------- transformers


def transformers_run(args: Any, adapter: bool, tmp: Path, index: int) -> tuple[float, float]:
    """The median step time of one ``Trainer.train()``, ``SentinelTrainer`` with
    the adapter (the Trainer clips at 1.0; its step is timed from
    ``on_step_begin`` to ``on_step_end``)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nanrunbook.capture.adapters.transformers import SentinelTrainer

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net(args.width, args.depth)

        def forward(self, x: Any, y: Any) -> Any:
            return {"loss": mse(self.net, (x, y))}

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []
            self.start = (0.0, 0.0)

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = now()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times.append(since(self.start))

    torch.manual_seed(0)
    records = [
        {"x": x, "y": y}
        for batch in data(args.steps, args.batch)
        for x, y in zip(*batch, strict=True)
    ]
    timer = Timer()
    kwargs: dict[str, Any] = {
        "model": Regression(),
        "args": TrainingArguments(
            output_dir=str(tmp / f"hf-{index}-{adapter}"),
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            learning_rate=1e-4,
            max_grad_norm=1.0,
            report_to=[],
            save_strategy="no",
            logging_steps=args.steps + 1,
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        ),
        "train_dataset": records,
        "callbacks": [timer],
    }
    if adapter:
        trainer: Any = SentinelTrainer(**kwargs, sentinel=facts(f"hf-{index}", tmp))
    else:
        trainer = Trainer(**kwargs)
    trainer.train()
    return medians(timer.times)


def torch_run(args: Any, adapter: bool, tmp: Path, index: int) -> tuple[float, float]:
    """The same step in a plain loop, with and without the Sentinel itself: what
    the sentinel costs with no framework around it."""
    from nanrunbook.capture.torch import Sentinel

    torch.manual_seed(0)
    net = make_net(args.width, args.depth)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    sentinel = Sentinel(net, optimizer, mse, **facts(f"torch-{index}", tmp)) if adapter else None
    clip = sentinel.clip_grad_norm_ if sentinel is not None else torch.nn.utils.clip_grad_norm_

    def step(batch: Any) -> None:
        loss = sentinel.forward(batch) if sentinel is not None else mse(net, batch)
        loss.backward()
        clip(list(net.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    return timed_steps(args, step, sentinel)


def compare(name: str, run: Any, args: Any, tmp: Path) -> None:
    off, on = [], []
    for index in range(args.runs):
        off.append(run(args, False, tmp, index))
        on.append(run(args, True, tmp, index))
    base, watched = (statistics.median(t[0] for t in off), statistics.median(t[0] for t in on))
    wall = statistics.median(t[1] for t in on) / statistics.median(t[1] for t in off)
    ratios = sorted(b[0] / a[0] for a, b in zip(off, on, strict=True))
    print(
        f"{name:<10} CPU a step {base * 1e3:8.3f} ms without, {watched * 1e3:8.3f} ms with the"
        f" adapter: ratio {watched / base:.3f} (runs {ratios[0]:.3f}..{ratios[-1]:.3f}),"
        f" +{(watched - base) * 1e6:.0f} us a step; wall-clock ratio {wall:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("nanrunbook").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    params = sum(p.numel() for p in make_net(args.width, args.depth).parameters())
    print(
        f"MLP {params / 1e6:.2f}M parameters, batch {args.batch}, {args.steps} steps x {args.runs}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        compare("torch loop", torch_run, args, Path(tmp))
        compare("lightning", lightning_run, args, Path(tmp))
        compare("accelerate", accelerate_run, args, Path(tmp))
        compare("hf trainer", transformers_run, args, Path(tmp))
    print(f"lightning  counters set aside at each step: {counters_cost(args):.1f} us")


if __name__ == "__main__":
    main()
