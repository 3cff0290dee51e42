"""What the sentinel costs a real CPU training loop: same-run ratios.

A small GPT-style transformer (27M parameters by default) trains on random
tokens, with and without the sentinel, in alternating runs from the same
initial state. Printed, for each loop shape (plain AdamW; with clipping routed
through the sentinel; under a GradScaler with float16 autocast):

* check share: the time spent in the sentinel's own code per step (its forward
  bookkeeping, the decision with its fused checks and one host read, the
  update flag, the telemetry line), measured inside each step, over the step
  time, and the end-to-end ratio of median step times (noisier: a shared
  machine moves step times by more than the checks cost);
* sampled share: the extra time of a sampled step (activation extremes, exact
  gradient and update magnitudes), amortised over ``--sample-every`` steps;
* host syncs added per step, counted as the tests count them;
* capture on a hold: replay, bundle write and check against one step, and the
  bound "3 steps + bundle bytes at the single-stream SHA-256 rate";
* peak extra memory of a hold and of a sampled step, as multiples of the
  parameter bytes, old path against new in the same run: torch's allocations
  as the profiler's allocation events count them (each carries the CPU
  allocator's running total; see nanrunbook.capture.torch._memory), over the
  level when the measured call starts. On the CPU the host and the device are
  one memory: the offload path's host buffers are counted apart by address.

    python bench/bench_sentinel.py [--steps 6 --runs 3 --layers 7 --width 512] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nanrunbook.capture.torch.sentinel._sentinel as sentinel_module
import nanrunbook.capture.torch.sentinel._steps as steps_module
from nanrunbook.capture.torch import Sentinel, SentinelHold, Thresholds, _offload
from nanrunbook.capture.torch._memory import peak_allocated
from nanrunbook.capture.torch.sentinel import Sentinel as _Base
from nanrunbook.capture.torch.sentinel._checks import max_rows
from nanrunbook.capture.torch.sentinel._steps import ClipCall as _ClipCall
from nanrunbook.capture.torch.sentinel._steps import update_extremes as _update_extremes

PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]
VOCAB = 8192


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    causal: torch.Tensor  # a buffer (register_buffer): moves and copies with the model

    def __init__(
        self, layers: int = 7, width: int = 512, heads: int = 8, context: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        causal = torch.triu(torch.full((context, context), float("-inf")), 1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, self.causal[:t, :t])
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def next_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["tokens"])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())


class ClipCall(_ClipCall):
    """The sentinel's deferred clipping, with a stopwatch."""

    seconds = 0.0

    def apply(self) -> None:
        start = time.perf_counter()
        try:
            super().apply()
        finally:
            ClipCall.seconds += time.perf_counter() - start


steps_module.ClipCall = ClipCall  # type: ignore[misc]
sentinel_module.ClipCall = ClipCall  # type: ignore[attr-defined]


class Timed(_Base):
    """The sentinel with a stopwatch on its own code (the loop's compute_loss and
    the real optimizer step excluded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.own = 0.0
        self.loss_time = 0.0
        super().__init__(*args, **kwargs)

    def forward(self, batch: Any) -> Any:
        start, before = time.perf_counter(), self.loss_time
        try:
            return super().forward(batch)
        finally:
            self.own += time.perf_counter() - start - (self.loss_time - before)

    def _decide(self, *, scaler_path: bool) -> bool:
        start, clipping = time.perf_counter(), ClipCall.seconds
        try:
            return super()._decide(scaler_path=scaler_path)
        finally:
            # The deferred clipping is the loop's own work, done at the step.
            self.own += time.perf_counter() - start - (ClipCall.seconds - clipping)

    def _after_update(self) -> None:
        start = time.perf_counter()
        try:
            super()._after_update()
        finally:
            self.own += time.perf_counter() - start

    def clip_grad_norm_(self, *args: Any, **kwargs: Any) -> Any:
        return super().clip_grad_norm_(*args, **kwargs)  # the norm is the loop's own work


class Setup:
    """One loop shape on one model, rebuilt from the same initial state each run."""

    def __init__(self, args: argparse.Namespace, shape: str) -> None:
        torch.manual_seed(0)
        self.args, self.shape = args, shape
        self.initial = GPT(args.layers, args.width, context=args.seq)
        g = torch.Generator().manual_seed(1)
        self.batches = [
            {
                "tokens": torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
                "targets": torch.randint(0, VOCAB, (args.batch, args.seq), generator=g),
            }
            for _ in range(4)
        ]

    def objects(self) -> dict[str, Any]:
        model = copy.deepcopy(self.initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = (
            torch.amp.GradScaler("cpu", init_scale=2.0**8) if self.shape == "gradscaler" else None
        )
        return {"model": model, "optimizer": optimizer, "scaler": scaler}

    def step(
        self, o: dict[str, Any], i: int, forward: Callable[..., Any], clip: Callable[..., Any]
    ) -> None:
        batch = self.batches[i % len(self.batches)]
        o["optimizer"].zero_grad()
        if self.shape == "gradscaler":
            with torch.autocast("cpu", dtype=torch.float16):
                loss = forward(batch)
            o["scaler"].scale(loss).backward()
            o["scaler"].step(o["optimizer"])
            o["scaler"].update()
            return
        loss = forward(batch)
        loss.backward()
        if self.shape == "clip":
            clip(o["model"].parameters(), 1.0)
        o["optimizer"].step()

    def sentinel(
        self,
        o: dict[str, Any],
        root: Path,
        sample_every: int,
        timed: bool = True,
        snapshot: bool = False,
        replay_memory: Literal["auto", "device", "offload"] = "auto",
    ) -> Any:
        cls = Timed if timed else Sentinel

        def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return next_token_loss(model, batch)
            finally:
                if isinstance(sentinel, Timed):
                    sentinel.loss_time += time.perf_counter() - start

        sentinel = cls(
            o["model"],
            o["optimizer"],
            loss,
            scaler=o["scaler"],
            run_id=f"bench-{self.shape}",
            checkpoint={"id": "init", "verified_together": PARTS},
            data={"id": "random-tokens"},
            objective={"id": "next-token", "reduction": "mean"},
            thresholds=Thresholds(sample_every=sample_every),
            incident_dir=root,
            snapshot=snapshot,
            replay_memory=replay_memory,
        )
        return sentinel


def timed_run(
    setup: Setup, watched: bool, steps: int, sample_every: int
) -> tuple[list[float], list[float]]:
    """Step times, and the sentinel's own time per step (zeros without it)."""
    o = setup.objects()
    root = Path(tempfile.mkdtemp(prefix="bench-sentinel-"))
    sentinel = setup.sentinel(o, root, sample_every) if watched else None
    forward = sentinel.forward if sentinel else (lambda b: next_token_loss(o["model"], b))
    clip = sentinel.clip_grad_norm_ if sentinel else torch.nn.utils.clip_grad_norm_
    setup.step(o, 0, forward, clip)  # warm-up: allocations, optimizer state
    times, own = [], []
    for i in range(1, steps + 1):
        before = sentinel.own if sentinel else 0.0
        start = time.perf_counter()
        setup.step(o, i, forward, clip)
        times.append(time.perf_counter() - start)
        own.append((sentinel.own - before) if sentinel else 0.0)
    if sentinel is not None:
        sentinel.close()
    return times, own


class Syncs(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's, untyped
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.__name__.split(".")[0] in ("_local_scalar_dense", "is_nonzero", "equal", "item"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def syncs_per_step(setup: Setup, watched: bool, steps: int = 3) -> float:
    o = setup.objects()
    sentinel = setup.sentinel(o, Path(tempfile.mkdtemp()), 0, timed=False) if watched else None
    forward = sentinel.forward if sentinel else (lambda b: next_token_loss(o["model"], b))
    clip = sentinel.clip_grad_norm_ if sentinel else torch.nn.utils.clip_grad_norm_
    setup.step(o, 0, forward, clip)
    real = torch.Tensor.tolist
    calls = [0]

    def tolist(self: Any) -> list[Any]:
        calls[0] += 1
        return real(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        syncs = Syncs()  # entered apart: the mode's __enter__ is untyped
        with syncs:
            for i in range(1, steps + 1):
                setup.step(o, i, forward, clip)
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    return (syncs.count + calls[0]) / steps


def sha256_rate(nbytes: int = 256 << 20) -> float:
    data = os.urandom(1 << 20) * (nbytes >> 20)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / (time.perf_counter() - start)


def capture_cost(setup: Setup, step_time: float) -> None:
    """The largest bundle: AdamW with eps=0 makes a NaN update (0/0 on the
    embedding rows the batch did not use), found after the step, rolled back from
    the snapshot and replayed in full (activations, gradients, optimizer state,
    update). The time from the decision to the exception, against one step and
    the bound 3 steps + the bundle's bytes at one SHA-256 stream's rate (the
    decision includes the exact counts, the rollback, the replay, the write and
    the check)."""
    o = setup.objects()
    o["optimizer"] = torch.optim.AdamW(o["model"].parameters(), lr=1e-4, eps=0.0)
    root = Path(tempfile.mkdtemp(prefix="bench-sentinel-hold-"))
    sentinel = setup.sentinel(o, root, 0, timed=False, snapshot=True)
    original = sentinel._decide
    seconds = [0.0]

    def decide(**kwargs: Any) -> Any:  # the failing step's whole decision, capture included
        start = time.perf_counter()
        try:
            return original(**kwargs)
        finally:
            seconds[0] = time.perf_counter() - start

    sentinel._decide = decide
    try:
        for i in range(2):
            setup.step(o, i, sentinel.forward, sentinel.clip_grad_norm_)
    except SentinelHold as held:
        assert held.bundle is not None and held.report is not None
        size = sum(f.stat().st_size for f in held.bundle.iterdir())
        rate = sha256_rate()
        bound = 3 * step_time + size / rate
        print(
            f"  capture on hold: {seconds[0]:.2f} s for a {size / 2**20:.0f} MiB bundle"
            f" ({held.report.decision.decision} at {held.stage}); one step {step_time:.2f} s;"
            f" bound 3 steps + bytes at SHA-256 {rate / 2**30:.2f} GiB/s = {bound:.2f} s"
            f" -> {seconds[0] / bound:.2f} of the bound, {seconds[0] / step_time:.2f} steps"
        )
    else:
        print("  capture on hold: the step did not hold (unexpected)")


def _old_update_extremes(params: list[Any], before: list[Any]) -> tuple[list[str], Any]:
    """The sampled step's update measure before this round: every delta at once."""
    return max_rows([p.detach().float() - b.float() for p, b in zip(params, before, strict=True)])


def _step_peak(setup: Setup, sample_every: int) -> int:
    """Peak bytes of the second step's optimizer.step() (decision, update, watch)."""
    o = setup.objects()
    sentinel = setup.sentinel(o, Path(tempfile.mkdtemp()), sample_every, timed=False)

    def prepare() -> None:
        setup.step(o, 0, sentinel.forward, sentinel.clip_grad_norm_)  # the state exists
        o["optimizer"].zero_grad()
        sentinel.forward(setup.batches[1]).backward()

    peak = peak_allocated(o["optimizer"].step, prepare=prepare).device
    sentinel.close()
    return peak


def _training_step_peak(setup: Setup) -> int:
    """Peak bytes of one whole training step under the sentinel (forward,
    backward, step) over the level before it: the room the step itself needs."""
    o = setup.objects()
    sentinel = setup.sentinel(o, Path(tempfile.mkdtemp()), 0, timed=False)

    def prepare() -> None:
        setup.step(o, 0, sentinel.forward, sentinel.clip_grad_norm_)

    peak = peak_allocated(
        lambda: setup.step(o, 1, sentinel.forward, sentinel.clip_grad_norm_), prepare=prepare
    ).device
    sentinel.close()
    return peak


def _sampled_step_peak(setup: Setup) -> int:
    """A sampled step's peak over the same step unsampled."""
    return _step_peak(setup, 1) - _step_peak(setup, 0)


def _hold_peak(setup: Setup, memory: Literal["device", "offload"]) -> tuple[int, int]:
    """Peak device and host bytes of a hold's capture: two healthy AdamW steps,
    then one with eps=0 whose update is NaN (0/0 on embedding rows no batch
    used), rolled back from the snapshot and replayed (the call that holds)."""
    o = setup.objects()
    root = Path(tempfile.mkdtemp(prefix="bench-sentinel-memory-"))
    sentinel = setup.sentinel(o, root, 0, timed=False, snapshot=True, replay_memory=memory)
    buffers: list[tuple[int, int]] = []
    real_buffer = _offload.host_buffer

    def recorded(nbytes: int, pinned: bool) -> Any:
        made = real_buffer(nbytes, pinned)
        buffers.append((made.data_ptr(), nbytes))
        return made

    def prepare() -> None:
        for i in range(3):
            if i == 2:
                for group in o["optimizer"].param_groups:
                    group["eps"] = 0.0
            setup.step(o, i, sentinel.forward, sentinel.clip_grad_norm_)

    def hold() -> bool:
        try:
            sentinel.close()
        except SentinelHold as held:
            return held.bundle is not None
        return False

    _offload.host_buffer = recorded
    try:
        peak = peak_allocated(hold, prepare=prepare, host=lambda: buffers)
    finally:
        _offload.host_buffer = real_buffer
    if not peak.result:
        print(f"  memory ({memory}): the step did not hold with a bundle (unexpected)")
    return peak.device, peak.host


def memory_cost(setup: Setup) -> None:
    params = sum(p.numel() * p.element_size() for p in setup.initial.parameters())
    new = _sampled_step_peak(setup)
    steps_module.update_extremes = _old_update_extremes
    try:
        old = _sampled_step_peak(setup)
    finally:
        steps_module.update_extremes = _update_extremes
    print(
        f"  peak extra memory of a sampled step: {old / params:.2f}x the parameter bytes"
        f" (every float32 delta at once) -> {new / params:.2f}x (one parameter at a time)"
    )
    device, _ = _hold_peak(setup, "device")
    offload, host = _hold_peak(setup, "offload")
    step = _training_step_peak(setup)
    print(
        f"  peak extra memory of a hold: replay beside the real state {device / params:.2f}x"
        f" the parameter bytes -> real gradients and optimizer state offloaded"
        f" {offload / params:.2f}x on the device, {host / params:.2f}x on the host"
        f" at that moment (float32 AdamW, snapshot on; the replayed forward's activations"
        f" included: a training step itself peaks {step / params:.2f}x over its start)"
    )


def measure(setup: Setup, args: argparse.Namespace) -> float:
    plain, watched, own = [], [], []
    for _ in range(args.runs):  # alternating: each pair sees the same machine
        times, _ = timed_run(setup, False, args.steps, 0)
        plain += times
        times, spent = timed_run(setup, True, args.steps, 0)
        watched += times
        own += [s / t for s, t in zip(spent, times, strict=True)]
    step = statistics.median(plain)
    quartiles = statistics.quantiles(own, n=4) if len(own) > 1 else [own[0]] * 3
    print(
        f"  step {step:.3f} s (median of {len(plain)}, fastest {min(plain):.3f} s); checks every"
        f" step: sentinel's own time {100 * statistics.median(own):.2f}% of the step"
        f" (quartiles {100 * quartiles[0]:.2f}-{100 * quartiles[2]:.2f}%, max {100 * max(own):.2f}%);"
        f" end to end {statistics.median(watched) / step:.3f}x"
    )
    sampled = []
    for _ in range(args.runs):
        times, spent = timed_run(setup, True, 2, 1)  # every step sampled
        _, plain_spent = timed_run(setup, True, 2, 0)
        sampled += [(s - p) / t for s, p, t in zip(spent, plain_spent, times, strict=True)]
    extra = statistics.median(sampled)
    print(
        f"  sampled step: +{100 * extra:.1f}% of a step; every {args.sample_every} steps:"
        f" {100 * extra / args.sample_every:.3f}% amortised"
    )
    added = syncs_per_step(setup, True) - syncs_per_step(setup, False)
    print(f"  host syncs added per step: {added:g}")
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per setting")
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--shapes", default="plain,clip,gradscaler")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 2 layers of width 256, 2 steps, 1 run, the plain loop only",
    )
    parser.add_argument(
        "--memory-only", action="store_true", help="only the memory figures (the plain loop)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.steps, args.runs, args.shapes = 2, 256, 2, 1, "plain"
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = GPT(args.layers, args.width, context=args.seq)
    print(
        f"bench-sentinel: GPT {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters,"
        f" batch {args.batch}x{args.seq} tokens, {torch.get_num_threads()} threads,"
        f" load average {os.getloadavg()[0]:.1f} (a shared machine: ratios are same-run)"
    )
    del model
    step = 0.0
    for shape in args.shapes.split(","):
        print(f"{shape}:")
        setup = Setup(args, shape)
        if args.memory_only:
            if shape == "plain":
                memory_cost(setup)
            continue
        step = measure(setup, args)
        if shape == "plain":
            capture_cost(setup, step)
            memory_cost(setup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
