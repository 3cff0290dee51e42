"""What the sentinel's Trainer adapter costs a transformers.Trainer step: same-run ratios.

A GPT-2 built from a config trains on random tokens with the plain
``transformers.Trainer`` and with ``SentinelTrainer``, in alternating runs from
the same initial state in one process. A step's time is the time between two
``on_step_end`` callbacks (data, forward, backward, clip, optimizer step,
scheduler, the Trainer's bookkeeping); printed per model: the median step of
each, their ratio, and the sentinel's share of the step (ratio - 1).

    python bench/bench_adapter_transformers.py [--steps 40 --runs 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch
from transformers import TrainerCallback
from transformers_support import VOCAB, make_trainer, sentinel_facts

# name: (width, layers, sequence length, batch size)
MODELS = {
    "tiny (the tests' model)": (16, 2, 8, 4),
    "small": (256, 4, 64, 8),
}


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def tokens(count: int, length: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (count, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def median_step(shape: tuple[int, int, int, int], steps: int, adapter: bool, out: Path) -> float:
    width, layers, length, batch = shape
    trainer, _ = make_trainer(
        out,
        sentinel=sentinel_facts("bench") if adapter else None,
        dataset=tokens(batch * steps, length),
        watch_state=False,
        width=width,
        layers=layers,
        positions=max(16, length),
        max_steps=steps,
        per_device_train_batch_size=batch,
        max_grad_norm=1.0,
        logging_steps=50,
    )
    times = StepTimes()
    trainer.add_callback(times)
    trainer.train()
    gaps = [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)][2:]  # warm-up
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="12 steps, 1 run pair")
    options = parser.parse_args()
    steps, runs = (12, 1) if options.quick else (options.steps, options.runs)
    torch.set_num_threads(1)  # a shared machine: one core each run, the same for both
    print(f"transformers.Trainer, {steps} steps a run, {runs} run pairs alternating, 1 thread")
    print(f"{'model':26} {'plain ms':>9} {'adapter ms':>11} {'ratio':>7} {'share':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            plain: list[float] = []
            watched: list[float] = []
            for run in range(runs):
                order = (False, True) if run % 2 == 0 else (True, False)
                for adapter in order:
                    out = Path(tmp) / f"{name[:4]}-{run}-{adapter}"
                    (watched if adapter else plain).append(median_step(shape, steps, adapter, out))
            p, w = statistics.median(plain), statistics.median(watched)
            print(f"{name:26} {p * 1e3:9.2f} {w * 1e3:11.2f} {w / p:7.3f} {w / p - 1:+7.1%}")


if __name__ == "__main__":
    main()
