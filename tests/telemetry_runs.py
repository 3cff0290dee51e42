"""Real CPU training runs that write nanrunbook-telemetry/1 lines, measured honestly.

Until the sentinel lands, these loops measure each step themselves the way the
telemetry line defines it (loss; gradients after unscaling: NaN/+inf/-inf
counts, finite max abs, headroom to the F32 max, L2 norm; the update the step
made; the loss scale used; found_inf; skipped; held) and send the records
through :class:`nanrunbook.telemetry.JsonlSink`.

* ``blowup``: linear regression under plain SGD with an absurd learning rate:
  the weights, the gradient max abs and the loss grow about tenfold a step
  until the loss overflows F32; that step is held (no optimizer step) and the
  run stops, as the sentinel's ``hold`` policy does.
* ``scaler``: an MLP under fp16 autocast with a dynamic GradScaler whose
  initial scale (2^24) is far too high: the fp16 gradients overflow and the
  scaler backs off step after step before training settles; later growth
  intervals overflow once each.
* ``healthy``: the same MLP in F32 with a sane learning rate.

The only warnings a line carries are the check's NEAR_DTYPE_MAX and
AT_DTYPE_MAX, computed from the real headroom; ``watch`` derives the rest.

    python tests/telemetry_runs.py OUT_DIR   # writes blowup.jsonl, scaler.jsonl, healthy.jsonl
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from nanrunbook.telemetry import (
    GradientStats,
    JsonlSink,
    TelemetryRecord,
    TelemetryWarning,
    UpdateStats,
    headroom_bits,
    loss_fields,
)

RUNS = ("blowup", "scaler", "healthy")


def _counts(flat: torch.Tensor) -> tuple[int, int, int, float | None]:
    nan = int(torch.isnan(flat).sum())
    posinf = int((flat == math.inf).sum())
    neginf = int((flat == -math.inf).sum())
    finite = flat[torch.isfinite(flat)]
    max_abs = float(finite.abs().max()) if finite.numel() else None
    return nan, posinf, neginf, max_abs


def gradient_stats(parameters: Iterable[torch.nn.Parameter]) -> GradientStats:
    grads = [p.grad.detach().reshape(-1) for p in parameters if p.grad is not None]
    flat = torch.cat(grads).double()  # float64: the norm of huge F32 values stays finite
    nan, posinf, neginf, max_abs = _counts(flat)
    norm = float(torch.linalg.vector_norm(flat)) if nan + posinf + neginf == 0 else None
    return GradientStats(nan, posinf, neginf, max_abs, "F32", headroom_bits(max_abs, "F32"), norm)


def update_stats(before: list[torch.Tensor], parameters: list[torch.nn.Parameter]) -> UpdateStats:
    delta = torch.cat(
        [(p.detach() - b).reshape(-1) for p, b in zip(parameters, before, strict=True)]
    )
    return UpdateStats(*_counts(delta.double()))


def headroom_warnings(grad: GradientStats) -> tuple[TelemetryWarning, ...]:
    bits = grad.headroom_bits
    if bits is None or bits >= 1.0:
        return ()
    code = "AT_DTYPE_MAX" if bits == 0 else "NEAR_DTYPE_MAX"
    return (
        TelemetryWarning(
            code, f"gradient max abs {grad.max_abs:g} is {bits:.2f} bits below the F32 max"
        ),
    )


def _record(
    run_id: str, step: int, loss: float, grad: GradientStats, **fields: object
) -> TelemetryRecord:
    value, kind = loss_fields(loss)
    base: dict[str, object] = {
        "update": None, "scale": None, "found_inf": None, "skipped": False, "held": False,
        "warnings": headroom_warnings(grad), "bundle": None,
    }  # fmt: skip
    base.update(fields)
    return TelemetryRecord(
        run_id,
        0,
        1,
        step,
        time.time(),
        value,
        kind,
        grad,
        **base,  # type: ignore[arg-type]
    )


def blowup(path: Path, steps: int = 60) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=3.0)
    w_true = torch.randn(16, 1)
    params = list(model.parameters())
    with JsonlSink(path) as sink:
        for step in range(steps):
            x = torch.randn(64, 16)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x @ w_true)
            loss.backward()
            grad = gradient_stats(params)
            if not math.isfinite(loss.item()) or grad.nonfinite:
                sink.emit(_record("blowup", step, loss.item(), grad, held=True, skipped=True))
                return  # the sentinel's hold: no optimizer step, the run stops
            before = [p.detach().clone() for p in params]
            optimizer.step()
            sink.emit(
                _record("blowup", step, loss.item(), grad, update=update_stats(before, params))
            )
    raise AssertionError("the blow-up run never went non-finite")


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(64, 16, generator=generator)
    return x, (x[:, :4] * 2).argmax(1)


def scaler(path: Path, steps: int = 80) -> None:
    model = _mlp(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=15)
    params = list(model.parameters())
    with JsonlSink(path) as sink:
        for step in range(steps):
            x, y = _batch(step)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad = gradient_stats(params)
            found_inf = grad.nonfinite > 0  # what the scaler's own check finds
            before = [p.detach().clone() for p in params]
            scaler.step(optimizer)  # skipped by the scaler when found_inf
            scaler.update()
            skipped = all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
            assert skipped == found_inf, (step, skipped, found_inf)
            fields = {"scale": scale, "found_inf": found_inf, "skipped": skipped}
            sink.emit(
                _record(
                    "scaler", step, loss.item(), grad, update=update_stats(before, params), **fields
                )
            )


def healthy(path: Path, steps: int = 80) -> None:
    model = _mlp(2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    with JsonlSink(path) as sink:
        for step in range(steps):
            x, y = _batch(step)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            grad = gradient_stats(params)
            before = [p.detach().clone() for p in params]
            optimizer.step()
            sink.emit(
                _record("healthy", step, loss.item(), grad, update=update_stats(before, params))
            )


RUNNERS: dict[str, Callable[[Path], None]] = {
    "blowup": blowup,
    "scaler": scaler,
    "healthy": healthy,
}


def write_all(directory: Path) -> dict[str, Path]:
    """Run all three; their telemetry files by run name."""
    paths = {}
    for name, run in RUNNERS.items():
        path = directory / f"{name}.jsonl"
        path.unlink(missing_ok=True)
        run(path)
        paths[name] = path
    return paths


if __name__ == "__main__":
    for name, path in write_all(Path(sys.argv[1])).items():
        print(f"{name}: {path}")
