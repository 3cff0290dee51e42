"""What the sentinel's Trainer adapter costs a transformers.Trainer step: same-run ratios.

A GPT-2 built from a config trains on random tokens with the plain
``transformers.Trainer`` and with ``SentinelTrainer``, in alternating runs from
the same initial state in one process. A step's time is the time between two
``on_step_end`` callbacks (data, forward, backward, clip, optimizer step,
scheduler, the Trainer's bookkeeping); printed per model: the median step of
each and their ratio, the median of the ratios of each run pair (the two runs
next to each other in time), and the ratio of the fastest steps (the least
disturbed on a shared machine). The added share of the step is ratio - 1.
On a machine whose load moves step times by more than the sentinel costs, the
last column bounds it from inside: the time spent in the sentinel's own calls
per step (``forward`` without the loss it calls, the decision at
``optimizer.step()`` without the clip it applies, the update's check; the
clip's norm and its application are the Trainer's own work, moved), timed
around them, over the adapter's median step.

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

from nanrunbook.capture.adapters.transformers import SentinelTrainerMixin
from nanrunbook.capture.torch import Sentinel
from nanrunbook.capture.torch.sentinel._steps import ClipCall

# name: (width, layers, sequence length, batch size)
MODELS = {
    "tiny (the tests')": (16, 2, 8, 4),
    "small": (256, 4, 64, 8),
}


class OwnTime:
    """Seconds spent in the sentinel's own calls: its methods timed around, the
    loss it calls (the Trainer's compute) taken out."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.steps = 0

    def time(self, cls: Any, name: str, sign: float) -> None:
        original = getattr(cls, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += sign * (time.perf_counter() - start)

        setattr(cls, name, timed)


OWN = OwnTime()
OWN.time(Sentinel, "forward", +1)
OWN.time(SentinelTrainerMixin, "_trainer_loss", -1)  # the Trainer's forward and loss
OWN.time(Sentinel, "_decide", +1)  # the checks, the read, the line
OWN.time(ClipCall, "apply", -1)  # the Trainer's clip, applied inside the decision
OWN.time(Sentinel, "_after_update", +1)


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def tokens(count: int, length: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (count, length), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def step_times(
    shape: tuple[int, int, int, int], steps: int, adapter: bool, out: Path
) -> list[float]:
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
    OWN.steps += steps if adapter else 0
    return [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)][2:]  # warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="12 steps, 1 run pair")
    options = parser.parse_args()
    steps, runs = (12, 1) if options.quick else (options.steps, options.runs)
    torch.set_num_threads(1)  # a shared machine: one core each run, the same for both
    print(f"transformers.Trainer, {steps} steps a run, {runs} run pairs alternating, 1 thread")
    print(
        f"{'model':24} {'plain ms':>9} {'adapter ms':>11} {'ratio':>6} {'pairs':>6}"
        f" {'fastest':>8} {'own ms':>7} {'own share':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in MODELS.items():
            plain: list[list[float]] = []
            watched: list[list[float]] = []
            OWN.seconds, OWN.steps = 0.0, 0
            for run in range(runs):
                order = (False, True) if run % 2 == 0 else (True, False)
                for adapter in order:
                    out = Path(tmp) / f"{name[:4]}-{run}-{adapter}"
                    (watched if adapter else plain).append(step_times(shape, steps, adapter, out))
            p = statistics.median(t for times in plain for t in times)
            w = statistics.median(t for times in watched for t in times)
            pairs = statistics.median(
                statistics.median(a) / statistics.median(b)
                for a, b in zip(watched, plain, strict=True)
            )
            fastest = min(min(t) for t in watched) / min(min(t) for t in plain)
            own = OWN.seconds / OWN.steps
            print(
                f"{name:24} {p * 1e3:9.2f} {w * 1e3:11.2f} {w / p:6.3f} {pairs:6.3f}"
                f" {fastest:8.3f} {own * 1e3:7.2f} {own / w:9.2%}"
            )


if __name__ == "__main__":
    main()
