"""Memory the sentinel takes on a sampled step and at a hold, measured as bytes
torch's allocator hands out (the profiler's allocation events), against the
parameters' own bytes."""

from __future__ import annotations

from pathlib import Path

import torch
from sentinel_support import facts
from torch import nn

from nanrunbook.capture.torch import Sentinel, Thresholds
from nanrunbook.capture.torch._memory import peak_allocated

WIDTH, LAYERS = 256, 16  # sixteen parameters of 256 KiB: one is 1/16 of them all


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _step_peak(tmp: Path, sample_every: int) -> tuple[int, Sentinel]:
    """The peak bytes of one optimizer.step() (the decision, the update and its
    watch), on the sentinel's second step."""
    model = _stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state of its own
    sentinel = Sentinel(
        model,
        optimizer,
        _loss,
        thresholds=Thresholds(sample_every=sample_every),
        telemetry=False,
        **facts("memory", tmp),
    )
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    peak = 0
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        sentinel.forward(batch).backward()
        peak = peak_allocated(optimizer.step).device
    return peak, sentinel


def test_a_sampled_step_keeps_one_parameter_delta_at_a_time(tmp_path: Path) -> None:
    """A sampled step keeps the parameters before the update (1x their bytes) and
    measures the update one parameter at a time; it used to hold every float32
    delta at once as well (2x in all for float32 parameters)."""
    params = sum(p.numel() * p.element_size() for p in _stack().parameters())
    largest = WIDTH * WIDTH * 4
    plain, _ = _step_peak(tmp_path / "plain", sample_every=0)
    sampled, sentinel = _step_peak(tmp_path / "sampled", sample_every=1)
    extra = sampled - plain
    assert params <= extra <= params + 3 * largest, (extra / params, plain, sampled)
    # The measurement is the exact max abs of the update all the same.
    pending = sentinel._pending
    assert pending is not None and pending.update_max is not None
    assert pending.update_max[0] == ["F32"]
    sentinel.close()


def test_update_extremes_is_the_max_abs_of_every_delta() -> None:
    from nanrunbook.capture.torch.steps import update_extremes

    g = torch.Generator().manual_seed(3)
    before = [torch.randn(40, generator=g).to(torch.bfloat16) for _ in range(3)]
    after = [b + torch.randn(40, generator=g).to(torch.bfloat16) for b in before]
    expected = max(
        float((a.float() - b.float()).abs().max()) for a, b in zip(after, before, strict=True)
    )
    names, maxima = update_extremes(after, before)
    assert names == ["F32"] and maxima.tolist() == [expected]
    after[1][5] = float("nan")
    assert update_extremes(after, before)[1].isnan().all()
    assert update_extremes([], [])[0] == []
