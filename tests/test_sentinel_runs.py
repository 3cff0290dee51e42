"""Real CPU training runs that go non-finite through real arithmetic under the
sentinel. Each ends with the real parameters finite and bit-identical to their
state before the held step, one bundle the check answers HOLD at the true stage,
a telemetry line for every step, and (for the blow-ups) a warning first."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import (
    Classifier,
    Pooler,
    Regressor,
    Sentinel,
    bundles,
    drifting_batch,
    facts,
    fp16_scaled_step,
    mse,
    params_finite,
    quiet_thresholds,
    regression_batch,
    run_loop,
    state_bits,
    telemetry,
    xent,
)
from torch import nn

from nanrunbook import check_bundle


def assert_held_cleanly(
    tmp: Path, run_id: str, ran: Any, model: nn.Module, state: Any, stage: str, held_step: int
) -> dict[str, Any]:
    """The common ending of every non-finite run; returns the held step's line."""
    hold = ran.hold
    assert hold is not None, "the run never held"
    assert hold.step == held_step
    assert params_finite(model)
    assert state() == ran.before[held_step]  # bit-identical to the state before the held step
    [bundle] = bundles(tmp, run_id)
    assert hold.bundle == bundle == tmp / "incident" / run_id / str(held_step)
    report = check_bundle(bundle)
    assert (report.decision.decision, report.decision.earliest_nonfinite_stage) == ("HOLD", stage)
    assert hold.stage == stage and hold.report is not None
    lines = telemetry(tmp, run_id)
    assert [line["step"] for line in lines] == list(range(1, ran.steps + 1))
    held = [line for line in lines if line["held"]]
    assert [line["step"] for line in held] == [held_step]
    assert held[0]["bundle"] == str(bundle)
    return held[0]


def first_warning(lines: list[dict[str, Any]]) -> int:
    return min(line["step"] for line in lines if line["warnings"])


def first_nonfinite(lines: list[dict[str, Any]]) -> int:
    return min(
        line["step"]
        for line in lines
        if line["loss_class"] != "finite"
        or line["found_inf"]
        or line["grad"]["nan"] + line["grad"]["posinf"] + line["grad"]["neginf"]
    )


def test_absurd_learning_rate_holds_at_the_loss_after_warning(tmp_path: Path) -> None:
    """A warm-up written wrong multiplies the learning rate by 3000 at step 30:
    the gradient norm spikes against its running median, then the loss overflows."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < 30 else 3000.0)
    sentinel = Sentinel(
        model,
        optimizer,
        mse,
        scheduler=scheduler,
        thresholds=quiet_thresholds(),
        **facts("absurd-lr", tmp_path),
    )

    def step(i: int) -> Any:
        optimizer.zero_grad()
        loss = sentinel.forward(regression_batch(i))
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss

    state = lambda: state_bits(model, optimizer, scheduler)  # noqa: E731
    ran = run_loop(step, 200, state)
    line = assert_held_cleanly(tmp_path, "absurd-lr", ran, model, state, "loss", ran.steps)
    assert line["loss"] is None and line["loss_class"] in ("posinf", "nan")
    lines = telemetry(tmp_path, "absurd-lr")
    assert first_warning(lines) < first_nonfinite(lines) == ran.steps
    assert {w["code"] for line in lines for w in line["warnings"]} >= {"GRAD_NORM_SPIKE"}
    assert scheduler.last_epoch == ran.steps - 1  # the held step's scheduler.step never ran


def test_fp16_overflow_under_a_dynamic_gradscaler_holds_at_the_forward(tmp_path: Path) -> None:
    """A feature drifting into raw units overflows float16 under autocast. The
    scaler's own overflow skips are recorded as probing; the non-finite unscaled
    loss holds, and the bundle places the overflow in the forward."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    sentinel = Sentinel(
        model,
        optimizer,
        xent,
        scaler=scaler,
        thresholds=quiet_thresholds(),
        **facts("fp16", tmp_path),
    )

    def step(i: int) -> Any:
        optimizer.zero_grad()
        return fp16_scaled_step(
            sentinel, model, optimizer, scaler, partial(drifting_batch, i, drift_from=20)
        )

    state = lambda: state_bits(model, optimizer, scaler=scaler)  # noqa: E731
    ran = run_loop(step, 100, state)
    line = assert_held_cleanly(tmp_path, "fp16", ran, model, state, "forward", ran.steps)
    assert line["loss_class"] != "finite"
    lines = telemetry(tmp_path, "fp16")
    assert first_warning(lines) < first_nonfinite(lines)
    probing = [line for line in lines if line["found_inf"] and not line["held"]]
    assert all(line["skipped"] and line["update"] is None for line in probing)
    report = check_bundle(ran.hold.bundle)
    assert report.decision.first_nonfinite_tensor == "act/net.0"
    assert report.manifest.binding.scaler.mode == "dynamic"
    assert report.manifest.binding.compute_dtype == "F16"


def test_a_static_loss_scale_that_overflows_holds_at_the_backward(tmp_path: Path) -> None:
    """No GradScaler: the loop multiplies the loss by 2^12 and divides the
    gradients back. As a feature drifts, the scaled float16 gradients overflow
    while the forward and the loss stay finite."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scale = 2.0**12
    sentinel = Sentinel(
        model,
        optimizer,
        xent,
        loss_scale=scale,
        thresholds=quiet_thresholds(),
        **facts("static", tmp_path),
    )

    def step(i: int) -> Any:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sentinel.forward(drifting_batch(i, drift_from=20))
        (loss * scale).backward()
        for p in model.parameters():
            p.grad.div_(scale)
        optimizer.step()
        return loss

    state = lambda: state_bits(model, optimizer)  # noqa: E731
    ran = run_loop(step, 100, state)
    line = assert_held_cleanly(tmp_path, "static", ran, model, state, "backward", ran.steps)
    assert line["loss_class"] == "finite" and line["scale"] == scale
    assert line["grad"]["nan"] + line["grad"]["posinf"] + line["grad"]["neginf"] > 0
    lines = telemetry(tmp_path, "static")
    assert first_warning(lines) < first_nonfinite(lines)
    scaler = check_bundle(ran.hold.bundle).manifest.binding.scaler
    assert (scaler.mode, scaler.scale) == ("static", scale)


def test_adam_with_eps_zero_is_rolled_back_with_the_snapshot(tmp_path: Path) -> None:
    """Adam with eps=0 divides 0 by 0 for every embedding row the batch did not
    use: the update is NaN while loss and gradients are finite. Found after the
    step, it is rolled back from the pre-step snapshot; the incident is at the
    first step, whose recovery point is the initial state."""
    torch.manual_seed(0)
    model = Pooler()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b["tokens"], b["mask"]), b["y"])

    sentinel = Sentinel(
        model,
        optimizer,
        loss_fn,
        snapshot=True,
        thresholds=quiet_thresholds(),
        **facts("adam-eps0", tmp_path),
    )

    def step(i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        batch = {
            "tokens": torch.randint(0, 20, (8, 6), generator=g),  # rows 20..49 unused
            "mask": torch.ones(8, 6),
            "y": torch.randint(0, 2, (8,), generator=g),
        }
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    state = lambda: state_bits(model, optimizer)  # noqa: E731
    ran = run_loop(step, 5, state)
    assert ran.hold is not None and ran.hold.step == 1 and ran.steps == 2
    assert not ran.hold.contaminated
    assert params_finite(model)
    assert state() == ran.before[1]  # rolled back to before step 1, bit for bit
    [bundle] = bundles(tmp_path, "adam-eps0")
    report = check_bundle(bundle)
    assert (report.decision.decision, report.decision.earliest_nonfinite_stage) == (
        "HOLD",
        "optimizer",
    )
    assert report.decision.first_nonfinite_tensor.startswith(("opt/", "update/"))
    assert report.manifest.last_known_good.checkpoint_id == "init-seed-0"
    assert report.manifest.last_known_good.step == 0
    lines = telemetry(tmp_path, "adam-eps0")
    assert [(line["step"], line["held"], line["skipped"]) for line in lines] == [
        (1, True, False),
        (2, False, True),
    ]
    assert lines[0]["update"]["nan"] > 0 and lines[0]["bundle"] == str(bundle)


def test_adam_eps_zero_without_a_snapshot_holds_as_contaminated(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Pooler()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b["tokens"], b["mask"]), b["y"])

    sentinel = Sentinel(model, optimizer, loss_fn, **facts("contaminated", tmp_path))
    batch = {
        "tokens": torch.arange(24).reshape(4, 6),
        "mask": torch.ones(4, 6),
        "y": torch.tensor([0, 1, 0, 1]),
    }
    optimizer.zero_grad()
    sentinel.forward(batch).backward()
    optimizer.step()
    with pytest.raises(Exception) as held:
        sentinel.checkpointed(
            "ckpt-1",
            verified_together=["model", "optimizer", "scheduler", "scaler", "data_position"],
        )
    hold = held.value
    assert type(hold).__name__ == "SentinelHold"
    assert hold.contaminated and hold.bundle is None and hold.step == 1
    assert hold.last_known_good["checkpoint_id"] == "init-seed-0"
    assert "contaminated" in str(hold) and "init-seed-0" in str(hold)
    # Issue 27: never presented as replayable: no capsule, and the hold says why.
    assert hold.capsule is None and "no capsule is written" in str(hold.capsule_error)
    assert "no capsule (the real state holds the non-finite update" in str(hold)
    assert sentinel.last_known_good["checkpoint_id"] == "init-seed-0"  # ckpt-1 is not one


def test_a_nan_in_the_data_holds_at_the_input(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sentinel = Sentinel(
        model, optimizer, mse, thresholds=quiet_thresholds(), **facts("nan-data", tmp_path)
    )

    def step(i: int) -> Any:
        batch = regression_batch(i)
        if i == 7:
            batch["x"][3, 2] = float("nan")  # one corrupt record
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    state = lambda: state_bits(model, optimizer)  # noqa: E731
    ran = run_loop(step, 20, state)
    assert_held_cleanly(tmp_path, "nan-data", ran, model, state, "input", 7)
    report = check_bundle(ran.hold.bundle)
    assert report.decision.first_nonfinite_tensor == "batch/x"
    # BatchNorm's running statistics saw the NaN in the real forward: put back.
    assert bool(torch.isfinite(model.body[1].running_mean).all())


def test_a_nan_between_leaf_modules_is_located_by_its_probe(tmp_path: Path) -> None:
    """A masked mean over a row whose mask is all zero: 0/0 in functional code.
    The probe places it there, before the head that is the next leaf module."""
    torch.manual_seed(0)
    model = Pooler()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(m(b["tokens"], b["mask"]), b["y"])

    sentinel = Sentinel(
        model, optimizer, loss_fn, thresholds=quiet_thresholds(), **facts("probe", tmp_path)
    )

    def step(i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        mask = (torch.rand(8, 6, generator=g) < 0.7).float()
        mask[:, 0] = 1
        if i == 4:
            mask[5] = 0  # a record whose every token is padding
        batch = {
            "tokens": torch.randint(0, 50, (8, 6), generator=g),
            "mask": mask,
            "y": torch.randint(0, 2, (8,), generator=g),
        }
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    state = lambda: state_bits(model, optimizer)  # noqa: E731
    ran = run_loop(step, 10, state)
    assert_held_cleanly(tmp_path, "probe", ran, model, state, "forward", 4)
    report = check_bundle(ran.hold.bundle)
    assert report.decision.first_nonfinite_tensor == "probe/pool.mean"
    names = [t.name for t in report.manifest.stages[1].tensors]
    assert names.index("probe/pool.mean") < names.index("act/head")
