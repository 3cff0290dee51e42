"""What a shrink costs, in training steps of the same model, measured in one run.

    python bench/bench_shrink.py [--rounds 5] [--width 256] [--depth 4]

A token-wise MLP stack (``--depth`` blocks of width ``--width``, 4x inner) on
a batch of 64 sequences of 32 tokens, with a hand-written normalisation in the
middle; one example is a constant row, so the normalisation divides by a zero
std. Times, alternating round by round:

* ``step``     -- one real training step (forward, backward, optimizer step);
* ``shrink``   -- ``shrink_step`` with the row hint (the default);
* ``plain``    -- ``shrink_step(hint=False)``: delta debugging from halves;
* ``fixture``  -- ``shrink_step`` writing the fixture (export, bundle, test).

The order rotates from round to round. Prints medians, the replays each
needed, and the ratio to ``step``. Then the trials plain delta debugging needs
for every position of the bad example (a smaller model: only the count matters).
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from nanrunbook.capture.torch import shrink_step  # noqa: E402
from tests.shrink_models import Normalise  # noqa: E402

BUNDLE: dict[str, Any] = {
    "run_id": "bench-shrink",
    "step": 2,
    "incident_owner": "ml-oncall",
    "last_known_good": {
        "checkpoint_id": "ckpt-1",
        "step": 1,
        "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
    },
    "binding": {
        "checkpoint": {"id": "ckpt-1"},
        "data": {"id": "synthetic"},
        "loader_cursor": {"id": "cursor-2"},
        "objective": {"id": "xent", "reduction": "mean"},
        "scheduler": {"id": "constant"},
    },
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.standardise = Normalise()
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.standardise(self.blocks(self.embed(x))).mean(1))


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def setup(width: int, depth: int, bad: int) -> tuple[Net, Any, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net(width, depth)
    # Zero biases: an all-zero example stays zero through every block (the
    # residual stream of a blank record), and the normalisation divides 0 by 0.
    with torch.no_grad():
        model.embed.bias.zero_()
        for block in model.blocks:
            block.up.bias.zero_()
            block.down.bias.zero_()
    x = torch.randn(64, 32, 16)
    x[bad] = 0.0
    batch = {"x": x, "y": torch.randint(0, 10, (64,))}
    return model, torch.optim.AdamW(model.parameters()), batch


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    model, optimizer, batch = setup(args.width, args.depth, bad=45)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters; batch 64x32x16; torch {torch.__version__}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-shrink-"))

    def step() -> None:  # on a copy made untimed (the real run's state is left alone)
        real, opt = copies.pop()
        opt.zero_grad()
        compute_loss(real, batch).backward()
        opt.step()

    def fixture() -> Any:
        shutil.rmtree(scratch / "fx", ignore_errors=True)
        return shrink_step(
            model, optimizer, batch, compute_loss, fixture=scratch / "fx", bundle=BUNDLE
        )

    runs: dict[str, Callable[[], Any]] = {
        "step": step,
        "shrink": lambda: shrink_step(model, optimizer, batch, compute_loss),
        "plain": lambda: shrink_step(model, optimizer, batch, compute_loss, hint=False),
        "fixture": fixture,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    replays: dict[str, int] = {}
    names = list(runs)
    for round_ in range(args.rounds):
        twin = copy.deepcopy(model)
        copies = [(twin, torch.optim.AdamW(twin.parameters()))]
        order = names[round_ % len(names) :] + names[: round_ % len(names)]  # rotate: no slot bias
        for name in order:
            run = runs[name]
            elapsed, result = timed(run)
            times[name].append(elapsed)
            if result is not None:
                replays[name] = result.replays
                operation = result.operation.describe()
    base = statistics.median(times["step"])
    print(f"operation found: {operation}")
    for name, values in times.items():
        median = statistics.median(values)
        extra = f"  replays {replays[name]:2d}" if name in replays else ""
        print(f"{name:8s} {median * 1e3:9.1f} ms  x{median / base:6.1f} step{extra}")
    counts = []
    for bad in range(64):
        m, o, b = setup(args.width // 4, 1, bad)
        counts.append(shrink_step(m, o, b, compute_loss, hint=False).trials)
    print(
        f"plain delta debugging, bad example at each of 64 positions: trials "
        f"max {max(counts)} mean {statistics.mean(counts):.2f} (bound 2*log2(64) = 12)"
    )
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
