"""The sentinel's per-step checks on what real loops hand them: gradients read
through clipping's norm, fp8 tensors, tensors on several devices."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import (
    Sentinel,
    facts,
    mse,
    mse_column,
    regression_batch,
    run_loop,
    telemetry,
)
from torch import nn

from nanrunbook.capture.telemetry import Thresholds
from nanrunbook.dtypes import DTYPES

# ------------------------------------------------------ headroom through clipping


def _clipped_run(tmp: Path, clip: bool, sample_every: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    sentinel = Sentinel(
        model,
        optimizer,
        mse_column,
        thresholds=Thresholds(sample_every=sample_every),
        **facts("clipped", tmp),
    )
    for i in range(1, 7):
        optimizer.zero_grad()
        sentinel.forward(regression_batch(i)).backward()
        if clip:
            sentinel.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    sentinel.close()
    return telemetry(tmp, "clipped")


def test_clipping_through_the_sentinel_gives_a_headroom_bounded_by_the_norm(
    tmp_path: Path,
) -> None:
    """|g_i| <= ||g||_2: the norm clipping computed bounds every gradient, so the
    headroom is known on every step (a lower bound, and the line says so)."""
    lines = _clipped_run(tmp_path, clip=True, sample_every=3)
    f32_max = DTYPES["F32"].max_finite
    assert f32_max is not None
    for line in lines:
        grad = line["grad"]
        assert grad["headroom_bits"] is not None, line
        if line["step"] % 3:
            assert line["grad_headroom_from"] == "total_norm"
            assert grad["headroom_bits"] == pytest.approx(math.log2(f32_max / grad["norm"]))
        else:  # sampled: the exact max abs, never above the norm
            assert line["grad_headroom_from"] == "max_abs"
            assert grad["max_abs"] <= grad["norm"]
        # appended at the end of the line, before the early warnings' two fields
        # and the held step's reproduction
        assert list(line)[-4:] == ["grad_headroom_from", "weight_norm", "output", "reproduced"]


def test_without_clipping_the_headroom_says_it_is_from_the_tensor_norms(tmp_path: Path) -> None:
    lines = _clipped_run(tmp_path, clip=False, sample_every=0)
    assert {line["grad_headroom_from"] for line in lines} == {"tensor_norm"}
    assert all(line["grad"]["headroom_bits"] is not None for line in lines)


def test_clipping_part_of_the_parameters_bounds_nothing_it_did_not_see(tmp_path: Path) -> None:
    """A norm over some parameters says nothing of the others' gradients."""
    from nanrunbook.capture.torch.sentinel._steps import ClipCall

    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    call = ClipCall([a], 1.0, 2.0, None, torch.tensor(1.4))
    assert not call.bounds_every_gradient([a, b])
    assert call.bounds_every_gradient([a])
    b.grad = None
    assert call.bounds_every_gradient([a, b])


# ------------------------------------------------------------------------- fp8

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_counts_agree_with_the_checks_own_counting(dtype: torch.dtype) -> None:
    """Flag, norms, maxima and exact counts of fp8 tensors (no CPU kernel reduces
    them: each is widened exactly), against the check's bit-pattern counts."""
    from nanrunbook.capture.torch._convert import tensor_to_raw
    from nanrunbook.capture.torch.sentinel._checks import (
        GradNorms,
        exact_counts,
        max_rows,
        nonfinite_flag,
    )
    from nanrunbook.tensors.counting import combine, tally_bytes

    g = torch.Generator().manual_seed(7)
    clean = [(torch.randn(300, generator=g) * 10).to(dtype) for _ in range(3)]
    assert math.isfinite(float(nonfinite_flag(clean)))
    names, maxima = max_rows(clean)
    widened = max(float(t.float().abs().max()) for t in clean)
    assert names == [tensor_to_raw(clean[0]).dtype] and float(maxima[0]) == widened
    norms = GradNorms.of(clean)
    assert norms is not None and float(norms.bounds[names[0]]) >= widened
    special = [t.clone() for t in clean]
    special[1][[3, 5]] = float("nan")
    special[2][[0, 1]] = float("-inf")  # e4m3fn has no infinity: torch saturates to -448
    special[2][9] = 300.0
    assert not math.isfinite(float(nonfinite_flag(special)))
    [found] = exact_counts(special)
    total = combine([tally_bytes(r.dtype, r.data) for r in map(tensor_to_raw, special)])
    assert (found.nan, found.posinf, found.neginf) == (
        total.counts.nan,
        total.counts.posinf,
        total.counts.neginf,
    )
    assert found.nan == 2 and found.neginf == (2 if dtype == torch.float8_e5m2 else 0)
    assert found.max_abs == total.max_abs


class _Fp8Linear(nn.Module):
    """A linear map whose weight is stored in fp8 (computed widened: CPU has no
    fp8 matmul); its gradient is fp8 too."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter((torch.randn(8, generator=g) * 0.3).to(dtype))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.float() + self.b


class _WidenedSGD(torch.optim.Optimizer):
    """SGD that steps fp8 parameters through float32 (CPU cannot add fp8)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_((p.float() - group["lr"] * p.grad.float()).to(p.dtype))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_a_run_with_fp8_parameters_is_checked_every_step_and_holds(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    model = _Fp8Linear(dtype)
    optimizer = _WidenedSGD(model.parameters(), 0.01)

    sentinel = Sentinel(
        model, optimizer, mse, thresholds=Thresholds(sample_every=2), **facts("fp8", tmp_path)
    )

    def step(i: int) -> torch.Tensor:
        batch = regression_batch(i)
        if i == 5:
            batch["x"][0, 0] = float("inf")
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    hold = run_loop(step, 7, lambda: None).hold
    sentinel.close()
    assert model.w.grad is not None and model.w.grad.dtype == dtype
    assert hold is not None and hold.step == 5 and hold.stage == "input", hold
    assert hold.bundle is not None and hold.capture_error is None
    lines = telemetry(tmp_path, "fp8")
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    fp8_name = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[dtype]
    assert all(line["grad"]["dtype"] == fp8_name for line in lines[:4])  # the least headroom
    assert [line["grad"]["max_abs"] is not None for line in lines[:4]] == [False, True] * 2


# -------------------------------------------------------------- several devices


def _mixed() -> list[torch.Tensor]:
    """float32 and float16 on the host and on a stand-in accelerator ('meta':
    shapes and devices without data, so no kernel runs and nothing is read)."""
    return [
        torch.ones(5),
        torch.ones(7, device="meta"),
        torch.ones(3, dtype=torch.float16, device="meta"),
        torch.ones(4, dtype=torch.float16),
        torch.ones(6, device="meta"),
    ]


def test_checks_group_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every norm kernel sees one device and one dtype, and a dtype's groups
    from several devices are joined on the accelerator, not on the host."""
    from nanrunbook.capture.torch.sentinel import _checks as checks

    groups: list[set[tuple[str, str]]] = []
    real = checks._norms

    def watched(tensors: list[torch.Tensor]) -> Any:
        groups.append({(t.device.type, str(t.dtype)) for t in tensors})
        return real(tensors)

    monkeypatch.setattr(checks, "_norms", watched)
    norms = checks.GradNorms.of(_mixed())
    assert norms is not None
    assert sorted(sorted(group) for group in groups) == [
        [("cpu", "torch.float16")],
        [("cpu", "torch.float32")],
        [("meta", "torch.float16")],
        [("meta", "torch.float32")],
    ]
    assert norms.total.device.type == "meta"
    assert {k: v.device.type for k, v in norms.bounds.items()} == {"F32": "meta", "F16": "meta"}
    for rows in (checks.count_rows(_mixed()), checks.max_rows(_mixed())):
        names, values = rows
        assert names == ["F32", "F16"] and values.device.type == "meta"


def test_the_one_read_is_made_on_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host values go to the accelerator and the packed values come back in one
    read, whichever part was added first (not a blocking copy per device part)."""
    from nanrunbook.capture.torch.sentinel import _checks as checks

    reads: list[str] = []

    def tolist(self: torch.Tensor) -> list[float]:
        reads.append(self.device.type)
        return [0.0] * self.numel()

    readout = checks.Readout()
    readout.add("host", torch.ones(2))
    readout.add("device", torch.ones(3, device="meta"))
    readout.add("host-too", torch.ones(()))
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    values = readout.read()
    assert reads == ["meta"]
    assert {k: len(v) for k, v in values.items()} == {"host": 2, "device": 3, "host-too": 1}


def test_the_scalers_flags_and_the_sampled_extremes_join_on_the_accelerator() -> None:
    """A GradScaler keeps a found_inf per device; sampled activation extremes
    come from each module's device: both are joined where the read is made."""
    from types import SimpleNamespace

    from nanrunbook.capture.torch.sentinel._checks import Readout
    from nanrunbook.capture.torch.sentinel._decide import scaler_found_inf
    from nanrunbook.capture.torch.sentinel._steps import StepRecord

    optimizer = object()
    per_device = {"cpu": torch.zeros(()), "meta": torch.zeros((), device="meta")}
    scaler = SimpleNamespace(
        _per_optimizer_states={id(optimizer): {"found_inf_per_device": per_device}}
    )
    found = scaler_found_inf(SimpleNamespace(scaler=scaler, optimizer=optimizer))  # type: ignore[arg-type]
    assert found.device.type == "meta"
    sampler = SimpleNamespace(values=[torch.ones(()), torch.ones((), device="meta")])
    step = StepRecord(1, 0.0, None, sampler)  # type: ignore[arg-type]
    readout = Readout()
    step.pack_sampled(readout, [])
    assert readout._parts[0].device.type == "meta"


# ------------------------------------------------- the decision, on its own


def _decider(tmp: Path, model: nn.Module) -> Any:
    from nanrunbook.capture.facts import LoopFacts
    from nanrunbook.capture.torch.replay import leaf
    from nanrunbook.capture.torch.sentinel._capture import StepObjects
    from nanrunbook.capture.torch.sentinel._decide import StepDecider
    from nanrunbook.capture.torch.sentinel._ranks import Ranks

    stated = facts("decider", tmp)
    loop = LoopFacts.of(
        run_id=stated["run_id"],
        incident_owner="ml-oncall",
        checkpoint=stated["checkpoint"],
        data=stated["data"],
        objective=stated["objective"],
        loader_cursor=None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    objects = StepObjects(model, optimizer, None, None, None, mse, leaf)
    return StepDecider(
        objects=objects,
        facts=loop,
        ranks=Ranks(None),
        policy="hold",
        transient="hold",
        thresholds=Thresholds(sample_every=0),
        incident_dir=tmp / "incident",
        local=None,
        sharded=False,
        snapshot=None,
        telemetry=None,
        capture_steps=frozenset(),
    )


def _step(model: nn.Module, number: int, batch: dict[str, torch.Tensor]) -> Any:
    from nanrunbook.capture.torch.replay import Autocast, MicroBatch, OutputExtremes, RngState
    from nanrunbook.capture.torch.sentinel._snapshot import Buffers
    from nanrunbook.capture.torch.sentinel._steps import StepRecord

    step = StepRecord(number, 0.0, Buffers(model), None, outputs=OutputExtremes(model))
    step.micro.append(MicroBatch(dict(batch), RngState.now((), taken_live=True), Autocast.now()))
    loss = mse(model, batch)
    loss.backward()
    step.losses.append(loss.detach())
    return step


def test_the_decision_is_an_object_given_each_step_that_returns_its_decision(
    tmp_path: Path,
) -> None:
    """The decider is constructed with what it needs and given the step (no
    Sentinel, no mixin): a finite step goes on and, once updated, is the
    pending one; a NaN loss holds with the step's bundle captured through
    one StepCapture request."""
    from nanrunbook.capture.incident import SentinelHold
    from nanrunbook.capture.torch.sentinel._decide import Decision

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    decider = _decider(tmp_path, model)
    first = _step(model, 1, regression_batch(1))
    assert decider.decide(first, scaler_path=False) == Decision(update=True, scaler_skips=False)
    assert not first.stood_down and decider.pending is None
    decider.objects.optimizer.step()
    decider.updated()
    assert decider.pending is first
    bad = regression_batch(2)
    bad["x"][0, 0] = float("nan")
    second = _step(model, 2, bad)
    with pytest.raises(SentinelHold) as held:
        decider.decide(second, scaler_path=False)
    assert second.stood_down and held.value.step == 2 and held.value.stage == "input"
    assert held.value.bundle == tmp_path / "incident" / "decider" / "2"
    assert decider.last_known_good == held.value.last_known_good
