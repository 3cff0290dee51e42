"""Real CPU training runs under the sentinel, for the early warnings: six that
diverge, each in its own way, and six healthy ones with ordinary noise.

Shared by ``tests/test_early_warnings.py`` and ``bench/bench_warnings.py`` (which
puts ``tests/`` on its path). Each run is a small model, tens of steps, under a
:class:`~nanrunbook.capture.torch.Sentinel` writing telemetry (policy ``hold``:
the first non-finite step holds and ends the run).

The divergence *onset* is measured by the loop itself, independently of the
sentinel, as the earliest of:

* the loss: the first step whose loss is more than ``ONSET_RATIO`` times the
  lowest 5-step running median before it and stays so until the run ends (at
  least ``ONSET_STEPS`` steps, or until it goes non-finite);
* the weight norm: the same rule on the parameters' L2 norm after each update;
* the model's output under float16 autocast: the first step whose largest
  magnitude is within 1 bit of 65504 (or is non-finite).

A healthy run has no onset (the bench refuses one that does).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import torch
from torch import nn

from nanrunbook.capture.torch import Sentinel, SentinelHold, Thresholds

PARTS = ["model", "optimizer", "scheduler", "scaler", "data_position"]
ONSET_RATIO = 10.0
ONSET_STEPS = 3
FLOAT16_MAX = 65504.0
# The warning codes of the early-warning rules (the benchmark's "first warning").
EARLY_CODES = (
    "LOSS_DIVERGENCE",
    "GRAD_NORM_DIVERGENCE",
    "WEIGHT_NORM_GROWTH",
    "GRAD_NORM_OVERFLOW",
    "NEAR_DTYPE_MAX",
    "AT_DTYPE_MAX",
)


@dataclass
class Outcome:
    """What one run did, measured by its loop, and what the sentinel wrote."""

    name: str
    diverging: bool
    steps: int  # steps run
    losses: list[float | None] = field(default_factory=list)  # per step, None non-finite
    weight_norms: list[float] = field(default_factory=list)
    output_max: list[float | None] = field(default_factory=list)  # fp16 output, or None
    first_nonfinite: int | None = None
    telemetry: Path | None = None

    @property
    def onset(self) -> int | None:
        found = [
            s
            for s in (
                _ratio_onset(self.losses),
                _ratio_onset(self.weight_norms),
                _output_onset(self.output_max),
                self.first_nonfinite,
            )
            if s is not None
        ]
        return min(found, default=None)

    def lines(self) -> list[dict[str, Any]]:
        assert self.telemetry is not None
        return [orjson.loads(line) for line in self.telemetry.read_bytes().splitlines()]

    def warnings(self) -> list[tuple[int, str, str]]:
        """(step, code, message) of every warning the lines carry."""
        return [(d["step"], w["code"], w["message"]) for d in self.lines() for w in d["warnings"]]


def _ratio_onset(values: list[float | None]) -> int | None:
    """The first step (1-based) above ONSET_RATIO x the baseline before it that
    stays above that for the rest of the run, at least ONSET_STEPS steps (a
    non-finite value counts as above). The baseline is the lowest running
    median of 5 steps, so one lucky batch does not make a noisy run diverge."""
    lowest = math.inf
    for index in range(len(values)):
        if index and lowest > 0 and math.isfinite(lowest):
            bar = ONSET_RATIO * lowest
            rest = values[index:]
            long_enough = len(rest) >= ONSET_STEPS or None in rest
            if long_enough and all(v is None or v > bar for v in rest):
                return index + 1
        window = [v for v in values[max(0, index - 4) : index + 1] if v is not None]
        if window:
            lowest = min(lowest, statistics.median(window))
    return None


def _output_onset(values: list[float | None]) -> int | None:
    for index, value in enumerate(values):
        if value is not None and (not math.isfinite(value) or value >= FLOAT16_MAX / 2):
            return index + 1
    return None


# ------------------------------------------------------------------ models


class MLP(nn.Module):
    def __init__(self, features: int, width: int, out: int, act: type = nn.Tanh) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, width), act())
        self.head = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Tempered(nn.Module):
    """An MLP whose output a schedule multiplies by ``gain`` (1.15x a step) and
    whose loss divides it back out: training is untouched while the output
    itself creeps towards the dtype's maximum."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP(8, 32, 1)
        self.register_buffer("gain", torch.tensor(100.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gain


# ------------------------------------------------------------------ data


def regression_data(seed: int, n: int = 256, features: int = 8) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def classes_data(seed: int, n: int = 256, features: int = 16, classes: int = 4) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(classes, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, features, generator=g)
    return x, y


class Batches:
    """Minibatches of a fixed data set, reshuffled each epoch (seeded)."""

    def __init__(self, x: Any, y: Any, size: int, seed: int) -> None:
        self.x, self.y, self.size = x, y, size
        self.g = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(x), generator=self.g)
        self.at = 0

    def next(self) -> dict[str, Any]:
        if self.at + self.size > len(self.x):
            self.order, self.at = torch.randperm(len(self.x), generator=self.g), 0
        index = self.order[self.at : self.at + self.size]
        self.at += self.size
        return {"x": self.x[index], "y": self.y[index]}


# ------------------------------------------------------------------ the loop


@dataclass
class Setup:
    model: nn.Module
    optimizer: Any
    compute_loss: Callable[..., Any]  # (model output, batch, model) -> loss
    batch: Callable[[int], Any]  # step (1-based) -> batch
    steps: int
    scheduler: Any = None
    scaler: Any = None
    clip: float | None = None
    autocast: Any = None  # a torch.dtype: CPU autocast to it


_OUTPUT: dict[str, float] = {}


def _watched(loss: Callable[..., Any]) -> Callable[[nn.Module, Any], Any]:
    """compute_loss, remembering its model output's max abs under autocast
    (the loop's own measurement of the output onset)."""

    def compute(model: nn.Module, batch: Any) -> Any:
        out = model(batch["x"])
        if out.dtype == torch.float16:
            _OUTPUT["max"] = float(out.detach().abs().max())
        return loss(out, batch, model)

    return compute


def mse(out: Any, batch: Any, model: Any = None) -> Any:
    return nn.functional.mse_loss(out.float(), batch["y"])


def xent(out: Any, batch: Any, model: Any = None) -> Any:
    return nn.functional.cross_entropy(out.float(), batch["y"])


def run(name: str, tmp: Path, thresholds: Thresholds | None = None) -> Outcome:
    """Run one named run (of RUNS or PERIODIC) under the sentinel; its outcome."""
    diverging, build = RUNS[name] if name in RUNS else (False, PERIODIC[name])
    torch.manual_seed(0)
    setup = build()
    outcome = Outcome(name, diverging, 0)
    outcome.telemetry = tmp / name / "telemetry.jsonl"
    sentinel = Sentinel(
        setup.model,
        setup.optimizer,
        _watched(setup.compute_loss),
        run_id=name,
        checkpoint={"id": "init", "verified_together": PARTS},
        data={"id": "synthetic"},
        objective={"id": "objective", "reduction": "mean"},
        scheduler=setup.scheduler,
        scaler=setup.scaler,
        thresholds=thresholds,
        incident_dir=tmp / "incident",
        telemetry=outcome.telemetry,
    )
    params = [p for g in setup.optimizer.param_groups for p in g["params"]]
    try:
        for step in range(1, setup.steps + 1):
            outcome.steps = step
            batch = setup.batch(step)
            _OUTPUT.clear()
            with torch.autocast("cpu", dtype=setup.autocast, enabled=setup.autocast is not None):
                loss = sentinel.forward(batch)
            value = float(loss.detach())
            outcome.losses.append(value if math.isfinite(value) else None)
            outcome.output_max.append(_OUTPUT.get("max"))
            if outcome.first_nonfinite is None and not math.isfinite(value):
                outcome.first_nonfinite = step
            setup.optimizer.zero_grad(set_to_none=False)
            if setup.scaler is not None:
                setup.scaler.scale(loss).backward()
                setup.scaler.step(setup.optimizer)
                setup.scaler.update()
            else:
                loss.backward()
                if setup.clip is not None:
                    sentinel.clip_grad_norm_(setup.model.parameters(), setup.clip)
                setup.optimizer.step()
            if setup.scheduler is not None:
                setup.scheduler.step()
            with torch.no_grad():
                norm = torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.double()) for p in params])
                )
            outcome.weight_norms.append(float(norm) if math.isfinite(norm) else math.inf)
        sentinel.close()
    except SentinelHold as hold:
        if outcome.first_nonfinite is None:
            outcome.first_nonfinite = hold.step
    return outcome


def stripped(path: Path) -> Path:
    """The telemetry as an older sentinel wrote it: no warning on any line."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    for line in lines:
        line["warnings"] = []
    out = path.with_name("older.jsonl")
    out.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return out


# ------------------------------------------------------------ diverging runs


def lr_too_high() -> Setup:
    """The issue's case: an MLP on regression under SGD at too high a rate."""
    x, y = regression_data(1)
    model = MLP(8, 32, 1)
    data = Batches(x, y, 32, 1)
    return Setup(model, torch.optim.SGD(model.parameters(), lr=1.5), mse, lambda s: data.next(), 40)


def lr_jump() -> Setup:
    """A scheduler whose rate jumps 40x at step 20 (a wrong milestone factor)."""
    x, y = regression_data(2)
    model = MLP(8, 32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 40.0 if i >= 20 else 1.0)
    data = Batches(x, y, 32, 2)
    return Setup(model, optimizer, mse, lambda s: data.next(), 40, scheduler=scheduler)


def data_shift() -> Setup:
    """From step 20 the inputs arrive in another unit (x1000, unnormalised)."""
    x, y = regression_data(3)
    model = MLP(8, 32, 1, nn.ReLU)
    data = Batches(x, y, 32, 3)

    def batch(step: int) -> Any:
        b = data.next()
        return {"x": b["x"] * (1000.0 if step >= 20 else 1.0), "y": b["y"]}

    return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), mse, batch, 40)


def activations_fp16() -> Setup:
    """Under float16 autocast the output creeps 1.15x a step to 65504 while the
    loss (on the output divided by the gain) stays level; then it overflows."""
    x, y = regression_data(4)
    model = Tempered()
    data = Batches(x, y, 32, 4)

    def loss(out: Any, batch: Any, model: Any) -> Any:
        return nn.functional.mse_loss(out.float() / model.gain, batch["y"])

    def batch(step: int) -> Any:
        model.gain.fill_(100.0 * 1.15**step)  # the schedule, outside the step
        return data.next()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return Setup(model, optimizer, loss, batch, 70, autocast=torch.float16)


def weight_growth() -> Setup:
    """A regulariser with the wrong sign: the weights grow ~6% a step while the
    loss goes negative (no loss rule can see it: log space needs a positive loss)."""
    x, y = regression_data(5)
    model = MLP(8, 32, 1)
    data = Batches(x, y, 32, 5)

    def loss(out: Any, batch: Any, model: Any) -> Any:
        penalty = sum(p.pow(2).sum() for p in model.parameters())
        return mse(out, batch) - 0.3 * penalty

    return Setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss, lambda s: data.next(), 60
    )


def adam_large_step() -> Setup:
    """Adam at a rate a hundred times too large for a ReLU regression MLP: the
    loss jumps 200-fold at the second step and stays hundreds of times up."""
    x, y = regression_data(6)
    model = MLP(8, 64, 1, nn.ReLU)
    data = Batches(x, y, 32, 6)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0)
    return Setup(model, optimizer, mse, lambda s: data.next(), 30)


# ------------------------------------------------------------- healthy runs


def warmup_cosine() -> Setup:
    x, y = classes_data(11)
    model = MLP(16, 64, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    total, warm = 60, 6

    def factor(i: int) -> float:
        if i < warm:
            return (i + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (i - warm) / (total - warm)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    data = Batches(x, y, 32, 11)
    return Setup(model, optimizer, xent, lambda s: data.next(), total, scheduler=scheduler)


def fast_early_drop() -> Setup:
    """Targets offset by 50: the loss starts near 2500 and falls 100-fold fast."""
    x, y = regression_data(12)
    model = MLP(8, 32, 1)
    data = Batches(x, y + 50.0, 32, 12)
    return Setup(
        model, torch.optim.Adam(model.parameters(), lr=0.05), mse, lambda s: data.next(), 60
    )


def epoch_reshuffles() -> Setup:
    """A 64-example set in batches of 8: an epoch every 8 steps, noisy batches."""
    x, y = classes_data(13, n=64)
    model = MLP(16, 32, 4)
    data = Batches(x, y, 8, 13)
    return Setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), xent, lambda s: data.next(), 60
    )


def gradscaler_probing() -> Setup:
    """float16 autocast under a GradScaler that grows every 3 steps: it overflows
    and backs off again and again (its designed probing)."""
    x, y = classes_data(14)
    model = MLP(16, 64, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**18, growth_interval=3)
    data = Batches(x, y, 32, 14)
    return Setup(
        model, optimizer, xent, lambda s: data.next(), 60, scaler=scaler, autocast=torch.float16
    )


def clipping_active() -> Setup:
    """A high rate held by gradient clipping (active on most steps)."""
    x, y = regression_data(15)
    model = MLP(8, 32, 1)
    data = Batches(x, y, 32, 15)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    return Setup(model, optimizer, mse, lambda s: data.next(), 60, clip=0.5)


def label_noise() -> Setup:
    """Small batches with a fifth of the labels wrong, and weight decay."""
    x, y = classes_data(16)
    g = torch.Generator().manual_seed(16)
    flip = torch.rand(len(y), generator=g) < 0.2
    y = torch.where(flip, torch.randint(0, 4, (len(y),), generator=g), y)
    model = MLP(16, 64, 4)
    data = Batches(x, y, 8, 16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return Setup(model, optimizer, xent, lambda s: data.next(), 60)


PERIOD = 60  # steps per epoch of periodic_noise


def periodic_noise() -> Setup:
    """Regression data read in a fixed order (no shuffling), 1024 examples a
    batch, whose label noise sweeps smoothly from low to high and back within
    each 60-step epoch: a healthy loss that cycles 0.15 -> 1.2 every epoch."""
    g = torch.Generator().manual_seed(17)
    batch, epochs = 1024, 3
    x = torch.randn(PERIOD * batch, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    k = torch.arange(PERIOD * batch) // batch
    sigma = 0.1 + 0.9 * (1 - torch.cos(2 * math.pi * k / PERIOD)) / 2
    y = x @ w + sigma[:, None] * torch.randn(PERIOD * batch, 1, generator=g)
    model = MLP(8, 32, 1)

    def batch_of(step: int) -> Any:
        at = (step - 1) % PERIOD * batch
        return {"x": x[at : at + batch], "y": y[at : at + batch]}

    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return Setup(model, optimizer, mse, batch_of, PERIOD * epochs)


# Healthy runs whose loss cycles: the first rise of a cycle is, when it comes,
# a rise like a divergence's; every later one repeats a cycle already seen.
PERIODIC: dict[str, Callable[[], Setup]] = {"periodic_noise": periodic_noise}


RUNS: dict[str, tuple[bool, Callable[[], Setup]]] = {
    "lr_too_high": (True, lr_too_high),
    "lr_jump": (True, lr_jump),
    "data_shift": (True, data_shift),
    "activations_fp16": (True, activations_fp16),
    "weight_growth": (True, weight_growth),
    "adam_large_step": (True, adam_large_step),
    "warmup_cosine": (False, warmup_cosine),
    "fast_early_drop": (False, fast_early_drop),
    "epoch_reshuffles": (False, epoch_reshuffles),
    "gradscaler_probing": (False, gradscaler_probing),
    "clipping_active": (False, clipping_active),
    "label_noise": (False, label_noise),
}
