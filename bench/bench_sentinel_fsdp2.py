"""What the sentinel costs an FSDP2 training loop on 2 gloo ranks (CPU): same-run ratios.

    python bench/bench_sentinel_fsdp2.py [--steps 8 --width 1536 --layers 4 --batch 512]

Two ranks train the same fully sharded MLP (``fully_shard`` on each layer and
the root) twice from one initial state, a plain step and a watched step in
turn (which goes first alternates), so both see the same machine. Printed per rank:

* step: the median wall time of a plain and of a watched step, and their ratio
  (not the figure: on this machine the FSDP2 model built first stepped 1.2 to
  1.45x slower than the other, whichever it was, measured both ways);
* check share: the sentinel's own time per step (its forward bookkeeping, the
  decision with its fused checks, the vote and the one host read, the update
  flag; the loop's compute_loss excluded) over the plain step (the vote waits
  for the slower rank: that wait is in it);
* collectives per step through ``torch.distributed`` (FSDP2's all-gathers and
  reduce-scatters, the vote), plain and watched;
* host reads per step (``item``, ``tolist``, ``_local_scalar_dense``), plain and
  watched, counted as bench_sentinel.py counts them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from nanrunbook.capture.torch import Sentinel, Thresholds  # noqa: E402

COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "broadcast",
)
PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]


class Timed(Sentinel):
    """The sentinel with a stopwatch on its own code."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.own = 0.0
        super().__init__(*args, **kwargs)

    def forward(self, batch: Any) -> Any:
        start = time.perf_counter()
        inner = self.compute_loss
        spent = [0.0]

        def timed(model: Any, b: Any) -> Any:
            begun = time.perf_counter()
            try:
                return inner(model, b)
            finally:
                spent[0] += time.perf_counter() - begun

        self.compute_loss = timed
        try:
            return super().forward(batch)
        finally:
            self.compute_loss = inner
            self.own += time.perf_counter() - start - spent[0]

    @contextmanager
    def _own_time(self) -> Iterator[None]:
        """Adds the block's wall time to the sentinel's own (all of it is the sentinel's)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.own += time.perf_counter() - start

    def _decide(self, *, scaler_path: bool) -> bool:
        with self._own_time():
            return super()._decide(scaler_path=scaler_path)

    def _after_update(self) -> None:
        with self._own_time():
            super()._after_update()


def _model(width: int, layers: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    blocks.append(nn.Linear(width, 1))
    net = nn.Sequential(*blocks)
    for block in net:
        if isinstance(block, nn.Linear):
            fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]).squeeze(1) - batch["y"]) ** 2).mean()


class Counted:
    """Calls of the collectives through ``torch.distributed`` and host reads."""

    def __init__(self) -> None:
        self.collectives = 0
        self.reads = 0
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Counted:
        for name in COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved.append((dist, name, real))
            setattr(dist, name, self._counting(real, "collectives"))
        for name in ("item", "tolist"):
            real = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, real))
            setattr(torch.Tensor, name, self._counting(real, "reads"))
        return self

    def _counting(self, real: Any, kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            setattr(self, kind, getattr(self, kind) + 1)
            return real(*args, **kwargs)

        return call

    def __exit__(self, *exc: Any) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)


def _rank(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    store = dist.FileStore(str(Path(tmp) / "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    torch.set_num_threads(1)  # two ranks on two cores
    plain, watched = _model(args.width, args.layers), _model(args.width, args.layers)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    watched_opt = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    sentinel = Timed(
        watched,
        watched_opt,
        _loss,
        run_id="bench-fsdp2",
        checkpoint={"id": "init", "verified_together": PARTS},
        data={"id": "synthetic"},
        objective={"id": "mse", "reduction": "mean"},
        incident_dir=Path(tmp) / "incident",
        thresholds=Thresholds(sample_every=0),
        telemetry=False,
    )

    def batch(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * rank + i)
        x = torch.randn(args.batch, 64, generator=g)
        return {"x": x, "y": x.sum(1)}

    def step(model: Any, optimizer: Any, forward: Any, i: int) -> None:
        optimizer.zero_grad()
        forward(batch(i)).backward()
        optimizer.step()

    times: dict[str, list[float]] = {"plain": [], "watched": []}
    own: list[float] = []
    counts: dict[str, tuple[int, int]] = {}
    for i in range(args.steps + 1):
        pair = [
            ("plain", plain, plain_opt, lambda b, m=plain: _loss(m, b)),
            ("watched", watched, watched_opt, sentinel.forward),
        ]
        for name, model, optimizer, forward in pair[i % 2 :] + pair[: i % 2]:  # turn about
            dist.barrier()
            before = sentinel.own
            start = time.perf_counter()
            if i == args.steps:  # the last step counted, not timed
                with Counted() as counted:
                    step(model, optimizer, forward, i)
                counts[name] = (counted.collectives, counted.reads)
                continue
            step(model, optimizer, forward, i)
            if i > 0:  # the first step warms up
                times[name].append(time.perf_counter() - start)
                if name == "watched":
                    own.append(sentinel.own - before)
    sentinel.close()
    result = {
        "rank": rank,
        "plain": statistics.median(times["plain"]),
        "watched": statistics.median(times["watched"]),
        "own": statistics.median(own),
        "counts": counts,
    }
    del sentinel, plain, watched, plain_opt, watched_opt
    gc.collect()
    dist.destroy_process_group()
    (Path(tmp) / f"result-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    mp.spawn(_rank, args=(2, tmp, args), nprocs=2, join=True)
    for rank in range(2):
        r = json.loads((Path(tmp) / f"result-{rank}.json").read_text())
        (pc, pr), (wc, wr) = r["counts"]["plain"], r["counts"]["watched"]
        print(
            f"rank {rank}: step plain {r['plain']:.3f} s, watched {r['watched']:.3f} s"
            f" ({r['watched'] / r['plain']:.3f} x); check share {100 * r['own'] / r['plain']:.2f} %"
            f" ({1e3 * r['own']:.1f} ms); collectives per step {pc} -> {wc};"
            f" host reads per step {pr} -> {wr}"
        )


if __name__ == "__main__":
    main()
