"""What an incident capsule costs, against its floors, measured in one run.

    python bench/bench_capsule.py [--rounds 5] [--width 512] [--depth 4]

A token-wise MLP stack (``--depth`` blocks of width ``--width``, 4x inner)
trained with Adam on batches of 64 x 32 tokens; after two real steps the
sentinel holds a step whose batch holds a NaN, writing its bundle and capsule.
Then, alternating round by round:

* ``write``     -- ``write_capsule`` of that state, digests included;
* ``dcp_save``  -- ``torch.distributed.checkpoint.save`` of the same state
  alone (model, optimizer tensors, the batch), no digests: the issue's floor;
* ``replay``    -- ``nanrunbook replay`` in process: open and verify the
  capsule, build, load, replay as recorded, write the bundle, diff it with the
  incident bundle;
* ``dcp_load``  -- ``torch.distributed.checkpoint.load`` of that state, and
  ``step`` -- one real training step, for the replay's floor: load + 3 steps
  + the bundles' bytes at the single-stream SHA-256 rate (measured here).

Prints medians and the two ratios (the issue asks at most 1.5 for the write,
at most 1.0 for the replay).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

from nanrunbook.capture.torch import Capsule, Sentinel, SentinelHold  # noqa: E402
from nanrunbook.capture.torch._entry import Built  # noqa: E402
from nanrunbook.capture.torch.capsule import HeldStep, replay_capsule, write_capsule  # noqa: E402
from nanrunbook.capture.torch.replay import MicroBatch, RngState  # noqa: E402

PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]
WIDTH, DEPTH = 512, 4


class Stack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * scale.unsqueeze(-1)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["tokens"], batch["scale"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def batch(step: int, bad: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (64, 32), generator=g)
    scale = torch.ones(64, 32)
    if bad:
        scale[5, 7] = float("nan")
    return {"tokens": tokens, "targets": torch.roll(tokens, 1, 1), "scale": scale}


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Stack(WIDTH, DEPTH)
    return {
        "model": model,
        "optimizer": torch.optim.Adam(model.parameters(), lr=1e-4),
        "compute_loss": loss_fn,
    }


def median_of(rounds: int, jobs: dict[str, Callable[[], None]]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in jobs}
    names = list(jobs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            jobs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def sha_rate(nbytes: int = 256 << 20) -> float:
    data = bytes(nbytes)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - start)


def main() -> None:
    global WIDTH, DEPTH
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--depth", type=int, default=DEPTH)
    args = parser.parse_args()
    WIDTH, DEPTH = args.width, args.depth
    warnings.filterwarnings("ignore")
    work = Path(tempfile.mkdtemp(prefix="bench-capsule-"))
    try:
        run(work, args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, rounds: int) -> None:
    objects = build()
    model, optimizer = objects["model"], objects["optimizer"]
    sentinel = Sentinel(
        model, optimizer, loss_fn, run_id="bench-capsule", incident_dir=work / "incident",
        checkpoint={"id": "init", "verified_together": PARTS}, data={"id": "synthetic"},
        objective={"id": "xent", "reduction": "mean"}, telemetry=False,
    )  # fmt: skip
    hold = None
    for step in (1, 2, 3):
        optimizer.zero_grad()
        sentinel.forward(batch(step, bad=step == 3)).backward()
        try:
            optimizer.step()
        except SentinelHold as held:
            hold = held
    sentinel.close()
    assert hold is not None and hold.capsule is not None, hold
    state_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    held = HeldStep(
        model=model, optimizer=optimizer, scheduler=None, scaler=None, loss_scale=None,
        micro_batches=(MicroBatch(batch(3, bad=True), RngState.now(taken_live=True), ()),),
        clipping=None, custom_modules=False, compiled=False, run_id="bench-capsule", step=3,
        incident_owner="ml-oncall", last_known_good={"checkpoint_id": "init", "step": 0,
        "verified_together": PARTS}, given={}, topology=None,
        live={"loss_nonfinite": True, "backward_nonfinite": True}, reproduced=None,
        bundle_evidence_id="x",
    )  # fmt: skip
    saved = optimizer.state_dict()["state"]
    plain = {
        "model": model.state_dict(),
        "optimizer": {str(i): dict(entry) for i, entry in saved.items()},
        "batch": {"mb0": {k: v for k, v in batch(3, bad=True).items()}},
    }
    counter = [0]

    def fresh(name: str) -> Path:
        counter[0] += 1
        return work / f"{name}-{counter[0]}"

    def write() -> None:
        write_capsule(fresh("capsule"), held)

    def dcp_save() -> None:
        dcp.save(plain, storage_writer=dcp.FileSystemWriter(fresh("dcp")), no_dist=True)

    capsule = Capsule.open(hold.capsule)
    built = Built(**build())

    def replay() -> None:
        result = replay_capsule(Capsule.open(hold.capsule), built, [], fresh("replay"))
        assert result.reproduction is not None and result.reproduction.same_evidence

    target = {
        "model": model.state_dict(),
        "optimizer": {
            str(i): {k: torch.empty_like(v) for k, v in e.items()} for i, e in saved.items()
        },
        "batch": {"mb0": {k: torch.empty_like(v) for k, v in batch(3, bad=True).items()}},
    }
    first = fresh("dcp-load")
    dcp.save(plain, storage_writer=dcp.FileSystemWriter(first), no_dist=True)

    def dcp_load() -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(first), no_dist=True)

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model, batch(9)).backward()
        optimizer.step()

    del capsule
    medians = median_of(rounds, {"write": write, "dcp_save": dcp_save, "replay": replay,
                                 "dcp_load": dcp_load, "step": step})  # fmt: skip
    bundle_bytes = sum(p.stat().st_size for p in hold.bundle.glob("*.safetensors"))
    rate = sha_rate()
    floor = medians["dcp_load"] + 3 * medians["step"] + bundle_bytes / rate
    print(f"model state {state_bytes / 2**20:.0f} MiB, bundle {bundle_bytes / 2**20:.0f} MiB,"
          f" SHA-256 {rate / 2**20:.0f} MiB/s single stream")  # fmt: skip
    for name, value in medians.items():
        print(f"{name:9} {value * 1000:9.1f} ms")
    print(f"write / dcp_save = {medians['write'] / medians['dcp_save']:.2f} (at most 1.5)")
    print(f"replay floor (dcp_load + 3 steps + bundle at SHA rate) = {floor * 1000:.1f} ms")
    print(f"replay / floor = {medians['replay'] / floor:.2f} (at most 1.0)")


if __name__ == "__main__":
    main()
