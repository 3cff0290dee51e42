"""The sentinel in healthy loops of every shape it supports, its policies and
thresholds, its host synchronisations, probes, hooks and telemetry."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import (
    PARTS,
    Classifier,
    HostSyncs,
    Regressor,
    Sentinel,
    bits,
    bundles,
    drifting_batch,
    facts,
    mse,
    params_finite,
    quiet_thresholds,
    regression_batch,
    run_loop,
    state_bits,
    telemetry,
    xent,
)
from test_sentinel_telemetry import APPENDED_KEYS
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanrunbook import check_bundle
from nanrunbook.capture.telemetry import TELEMETRY_FORMAT, Thresholds
from nanrunbook.capture.torch import SentinelHold, probe
from nanrunbook.warning_codes import WARNING_CODES

# ----------------------------------------------------------------- the loops


class TemperatureLoss(nn.Module):
    """A loss module with a learned temperature: a parameter outside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits / self.log_t.exp(), y)


@dataclass
class Loop:
    """One loop shape: ``build()`` makes its objects, ``step`` runs a step with the
    forward and the clipping it is handed (plain torch, or the sentinel's)."""

    build: Callable[[], dict[str, Any]]
    step: Callable[[dict[str, Any], int, Callable[..., Any], Callable[..., Any]], Any]
    sentinel: dict[str, Any]  # what the loop tells the sentinel beyond the objects


def _plain() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": mse}


def _plain_step(o: dict[str, Any], i: int, forward: Any, clip: Any) -> Any:
    o["optimizer"].zero_grad()
    loss = forward(regression_batch(i))
    loss.backward()
    o["optimizer"].step()
    o["scheduler"].step()
    return loss


def _amp() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    return {"model": model, "optimizer": optimizer, "scaler": scaler, "loss": xent}


def _amp_step(o: dict[str, Any], i: int, forward: Any, clip: Any) -> Any:
    o["optimizer"].zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = forward(drifting_batch(i, drift_from=10**6))
    o["scaler"].scale(loss).backward()
    o["scaler"].unscale_(o["optimizer"])
    clip(o["model"].parameters(), 1.0)
    o["scaler"].step(o["optimizer"])
    o["scaler"].update()
    return loss


def _amp_noclip_step(o: dict[str, Any], i: int, forward: Any, clip: Any) -> Any:
    o["optimizer"].zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = forward(drifting_batch(i, drift_from=10**6))
    o["scaler"].scale(loss).backward()
    o["scaler"].step(o["optimizer"])  # unscales itself
    o["scaler"].update()
    return loss


def _grouped() -> dict[str, Any]:
    """Several parameter groups, a parameter outside the model, a scheduler per
    step, gradient accumulation over three micro-batches, clipping."""
    torch.manual_seed(0)
    model = Classifier()
    criterion = TemperatureLoss()
    net = model.net
    optimizer = torch.optim.AdamW(
        [
            {"params": [*net[0].parameters(), *net[2].parameters()], "lr": 2e-3},
            {"params": net[4].parameters(), "lr": 1e-3, "weight_decay": 0.1},
            {"params": criterion.parameters(), "lr": 1e-2, "weight_decay": 0.0},
        ]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    def loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return criterion(m(b["x"]), b["y"]) / 3

    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loss": loss}


def _grouped_step(o: dict[str, Any], i: int, forward: Any, clip: Any) -> Any:
    for micro in range(3):
        loss = forward(drifting_batch(3 * i + micro, drift_from=10**6))
        loss.backward()
    clip([p for g in o["optimizer"].param_groups for p in g["params"]], 0.5)
    o["optimizer"].step()
    o["scheduler"].step()
    o["optimizer"].zero_grad()
    return loss


def _static() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    return {"model": model, "optimizer": optimizer, "loss": xent}


def _static_step(o: dict[str, Any], i: int, forward: Any, clip: Any) -> Any:
    o["optimizer"].zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = forward(drifting_batch(i, drift_from=10**6))
    (loss * 256.0).backward()
    for p in o["model"].parameters():
        p.grad.div_(256.0)
    o["optimizer"].step()
    return loss


LOOPS = {
    "plain-sgd-steplr": Loop(_plain, _plain_step, {}),
    "amp-gradscaler-clip": Loop(_amp, _amp_step, {}),
    "amp-gradscaler-no-unscale": Loop(_amp, _amp_noclip_step, {}),
    "groups-outside-accumulate-clip": Loop(_grouped, _grouped_step, {}),
    "static-loss-scale": Loop(_static, _static_step, {"loss_scale": 256.0}),
}


def train(loop: Loop, steps: int, tmp: Path | None, run_id: str = "healthy") -> dict[str, Any]:
    """The loop for ``steps`` steps, with the sentinel when ``tmp`` is given."""
    o = loop.build()
    sentinel = None
    if tmp is not None:
        sentinel = Sentinel(
            o["model"],
            o["optimizer"],
            o["loss"],
            scaler=o.get("scaler"),
            scheduler=o.get("scheduler"),
            thresholds=quiet_thresholds(),
            **facts(run_id, tmp),
            **loop.sentinel,
        )
        forward: Callable[..., Any] = sentinel.forward
        clip: Callable[..., Any] = sentinel.clip_grad_norm_
    else:
        forward = lambda batch: o["loss"](o["model"], batch)  # noqa: E731
        clip = torch.nn.utils.clip_grad_norm_
    for i in range(1, steps + 1):
        loop.step(o, i, forward, clip)
    if sentinel is not None:
        sentinel.close()
    o["state"] = state_bits(
        o["model"], o["optimizer"], o.get("scheduler"), o.get("scaler"), same=False
    )
    return o


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_a_healthy_run_trains_bit_for_bit_as_without_the_sentinel(
    name: str, tmp_path: Path
) -> None:
    """No bundle, no warning, no skip: and every parameter, optimizer, scheduler
    and scaler bit where it would be without the sentinel (clipping deferred to
    the step included)."""
    steps = 30
    alone = train(LOOPS[name], steps, None)
    watched = train(LOOPS[name], steps, tmp_path)
    assert watched["state"] == alone["state"]
    assert bundles(tmp_path, "healthy") == []
    lines = telemetry(tmp_path, "healthy")
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert [line for line in lines if line["warnings"]] == []
    assert not any(line["held"] or line["skipped"] for line in lines)
    assert all(line["loss_class"] == "finite" and line["update"] is not None for line in lines)
    sampled = [line for line in lines if line["activations"] is not None]
    assert [line["step"] for line in sampled] == [5, 10, 15, 20, 25, 30]
    assert all(line["grad"]["max_abs"] is not None for line in sampled)
    assert all(line["update"]["max_abs"] is not None for line in sampled)


# ------------------------------------------------------------ host syncs


def syncs_per_step(loop: Loop, tmp: Path | None) -> dict[str, float]:
    """Host syncs of steps 4..9 (sampling off), by kind, per step: what would
    make the host wait on an accelerator (:class:`HostSyncs`), the optimizer's
    host-side step counters left out."""
    o = loop.build()
    forward: Callable[..., Any] = lambda batch: o["loss"](o["model"], batch)  # noqa: E731
    clip: Callable[..., Any] = torch.nn.utils.clip_grad_norm_
    if tmp is not None:
        sentinel = Sentinel(
            o["model"],
            o["optimizer"],
            o["loss"],
            scaler=o.get("scaler"),
            scheduler=o.get("scheduler"),
            thresholds=Thresholds(sample_every=0),
            **facts("syncs", tmp),
            **loop.sentinel,
        )
        forward, clip = sentinel.forward, sentinel.clip_grad_norm_
    for i in range(1, 4):
        loop.step(o, i, forward, clip)
    with HostSyncs([o["optimizer"]]) as syncs:
        for i in range(4, 10):
            loop.step(o, i, forward, clip)
    return {kind: n / 6 for kind, n in syncs.kinds.items()}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_at_most_one_host_sync_is_added_per_step(name: str, tmp_path: Path) -> None:
    """The sentinel adds one read a step (its ``tolist``), nothing else that
    would wait for a device."""
    alone = syncs_per_step(LOOPS[name], None)
    watched = syncs_per_step(LOOPS[name], tmp_path)
    added = {k: watched.get(k, 0) - alone.get(k, 0) for k in {*alone, *watched}}
    assert {k: v for k, v in added.items() if v} == {"tolist": 1.0}, (alone, watched)


SYNCING_OPS: dict[str, tuple[str, Callable[[torch.Tensor], Any]]] = {
    "item": ("item", lambda t: t.sum().item()),
    "bool": ("item", lambda t: bool(t[0] > 0)),
    "float": ("item", lambda t: float(t.max())),
    "tolist": ("tolist", lambda t: t.tolist()),
    "numpy": ("numpy", lambda t: t.numpy()),
    "cpu": ("to_host", lambda t: t.cpu()),
    "to-cpu": ("to_host", lambda t: t.to("cpu")),
    "to-device-cpu": ("to_host", lambda t: t.to(device="cpu", dtype=t.dtype)),
    "nonzero": ("nonzero", lambda t: t.nonzero()),
    "where-one-argument": ("nonzero", lambda t: torch.where(t > 0)),
    "masked_select": ("masked_select", lambda t: t.masked_select(t > 0)),
    "boolean-index": ("boolean_index", lambda t: t[t > 0]),
    "boolean-index-put": ("boolean_index", lambda t: t.clone().__setitem__(t > 0, 1.0)),
    "equal": ("equal", lambda t: torch.equal(t, t)),
    "unique": ("unique", lambda t: torch.unique(t)),
    "repeat_interleave": (
        "repeat_interleave",
        lambda t: t.repeat_interleave(torch.tensor([1, 2]))[:0],
    ),
}


@pytest.mark.parametrize("name", sorted(SYNCING_OPS))
def test_the_sync_counter_sees_each_kind_of_host_read(name: str) -> None:
    kind, op = SYNCING_OPS[name]
    t = torch.randn(2)
    with HostSyncs() as syncs:
        op(t)
    assert dict(syncs.kinds) == {kind: 1}


def test_the_sync_counter_ignores_what_never_waits() -> None:
    """Device-side work, a dtype change and integer indexing do not wait; nor
    does AdamW's reading of its step counters, which torch keeps on the host
    (the old count of _local_scalar_dense saw one per parameter and step)."""
    t = torch.randn(6)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scalar_reads = {"n": 0}

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            scalar_reads["n"] += func.overloadpacket.__name__ == "_local_scalar_dense"
            return func(*args, **(kw or {}))

    with HostSyncs([optimizer]) as syncs, ScalarReads():
        t.sum(), t.to(torch.float64), t[torch.tensor([0, 1])], torch.where(t > 0, t, 0.0)
        t.to(t.device)  # wherever t is: on an accelerator, no host copy
        optimizer.step()
    assert syncs.count == 0, dict(syncs.kinds)
    assert scalar_reads["n"] >= 2  # the step counters were read: ignored, not unseen


# -------------------------------------------------------- policies, scaler


def test_skip_records_skips_continues_and_holds_after_k_in_a_row(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(
        model,
        optimizer,
        mse,
        policy="skip",
        thresholds=quiet_thresholds(skip_hold=2),
        **facts("skip", tmp_path),
    )
    corrupt = {3, 10, 11, 12}

    def step(i: int) -> Any:
        batch = regression_batch(i)
        if i in corrupt:
            batch["x"][0, 0] = float("nan")
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        return loss

    state = lambda: state_bits(model, optimizer)  # noqa: E731
    ran = run_loop(step, 30, state)
    assert ran.hold is not None and ran.hold.step == 12
    assert ran.before[4] == ran.before[3]  # the skipped step changed nothing
    assert state() == ran.before[12] and params_finite(model)
    lines = telemetry(tmp_path, "skip")
    assert [line["step"] for line in lines if line["skipped"]] == [3, 10, 11]
    assert [line["step"] for line in lines if line["held"]] == [12]
    assert "3 consecutive skipped steps" in ran.hold.reason
    [bundle] = bundles(tmp_path, "skip")
    assert check_bundle(bundle).decision.earliest_nonfinite_stage == "input"


def fp16_overflowing_from_the_start(tmp: Path, run_id: str, **thresholds: Any) -> Any:
    """A GradScaler whose first scale (2^24) overflows float16 gradients."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    sentinel = Sentinel(
        model,
        optimizer,
        xent,
        scaler=scaler,
        thresholds=quiet_thresholds(**thresholds),
        **facts(run_id, tmp),
    )

    def step(i: int) -> Any:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sentinel.forward(drifting_batch(i, drift_from=10**6))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    ran = run_loop(step, 40, lambda: state_bits(model, optimizer, scaler=scaler))
    return ran, scaler


def test_gradscaler_probing_is_recorded_and_holds_only_after_k_backoffs(tmp_path: Path) -> None:
    ran, scaler = fp16_overflowing_from_the_start(
        tmp_path, "probe-k", backoff_warn=2, backoff_hold=4
    )
    assert ran.hold is not None and ran.hold.step == 4
    assert scaler.get_scale() == 2.0**21  # three backoffs; the held fourth never happened
    lines = telemetry(tmp_path, "probe-k")
    assert [(line["found_inf"], line["skipped"], line["held"]) for line in lines] == [
        (True, True, False)
    ] * 3 + [(True, False, True)]
    assert [line["scale"] for line in lines] == [2.0**24, 2.0**23, 2.0**22, 2.0**21]
    streak, skips = "LOSS_SCALE_BACKOFF_STREAK", "SKIPPED_UPDATE_STREAK"
    assert [[w["code"] for w in line["warnings"]] for line in lines] == [
        [],
        [streak],  # backoff_warn=2
        [streak, skips],  # skip_warn=3
        [streak, skips],
    ]
    report = check_bundle(ran.hold.bundle)
    assert report.decision.earliest_nonfinite_stage == "backward"
    assert (report.scaler.found_inf, report.scaler.scale) == (True, 2.0**21)


def test_a_loss_scale_below_the_floor_holds(tmp_path: Path) -> None:
    ran, scaler = fp16_overflowing_from_the_start(tmp_path, "floor", scale_floor=2.0**22.5)
    assert ran.hold is not None and ran.hold.step == 2  # 2^24 -> 2^23 -> would be 2^22
    codes = [w["code"] for w in telemetry(tmp_path, "floor")[-1]["warnings"]]
    assert "LOSS_SCALE_BELOW_FLOOR" in codes
    assert scaler.get_scale() == 2.0**23


def test_closure_optimizers_are_refused_at_construction(tmp_path: Path) -> None:
    model = Regressor()
    with pytest.raises(TypeError, match="closure"):
        Sentinel(model, torch.optim.LBFGS(model.parameters()), mse, **facts("lbfgs", tmp_path))


# ------------------------------------------------------- replay fidelity


def test_the_replay_repeats_dropout_and_accumulation_bit_for_bit(tmp_path: Path) -> None:
    """Two micro-batches through dropout and batch norm; the second makes NaN
    gradients under a finite loss (sqrt at zero). The bundle's losses are the
    very bits the loop saw: the RNG state before each forward was restored."""
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        pred = m(b["x"])
        return ((pred - b["y"]) ** 2).mean() + (b["w"] * pred).pow(2).sum().sqrt()

    sentinel = Sentinel(model, optimizer, loss_fn, **facts("replay", tmp_path))
    seen = []
    for i in range(1, 4):
        for micro in range(2):
            batch = {**regression_batch(10 * i + micro), "w": torch.full((16,), 1e-3)}
            if i == 3 and micro == 1:
                batch["w"] = torch.zeros(16)  # the square root of exactly zero
            loss = sentinel.forward(batch)
            seen.append(loss.detach().clone())
            loss.backward()
        try:
            optimizer.step()
        except SentinelHold as hold:
            held = hold
            break
        optimizer.zero_grad()
    assert held.step == 3 and held.stage == "backward"
    report = check_bundle(held.bundle)
    names = [t.name for t in report.manifest.stages[0].tensors]
    assert names == [
        "batch/mb0/x",
        "batch/mb0/y",
        "batch/mb0/w",
        "batch/mb1/x",
        "batch/mb1/y",
        "batch/mb1/w",
    ]
    from safetensors import safe_open

    with safe_open(str(held.bundle / "tensors.safetensors"), "pt") as f:
        assert bits(f.get_tensor("loss/mb0")) == bits(seen[-2])
        assert bits(f.get_tensor("loss/mb1")) == bits(seen[-1])


# ------------------------------------------------- probes, hooks, telemetry


def test_probe_is_free_when_nothing_listens() -> None:
    t = torch.ones(4)

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    with Ops():
        assert probe("anything", t) is t
    assert Ops.count == 0


def test_hooks_are_removed_when_the_forward_raises(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def broken(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        m(b["x"])
        raise RuntimeError("a bug in the loss")

    sentinel = Sentinel(
        model, optimizer, broken, thresholds=Thresholds(sample_every=1), **facts("hooks", tmp_path)
    )
    with pytest.raises(RuntimeError, match="a bug in the loss"):
        sentinel.forward(regression_batch(1))
    assert all(not m._forward_hooks for m in model.modules())


def test_telemetry_line_shape(tmp_path: Path) -> None:
    train(LOOPS["amp-gradscaler-clip"], 5, tmp_path, run_id="shape")
    line = telemetry(tmp_path, "shape")[4]
    assert list(line) == [
        "format",
        "run_id",
        "rank",
        "world_size",
        "step",
        "time",
        "loss",
        "loss_class",
        "grad",
        "update",
        "scale",
        "found_inf",
        "skipped",
        "held",
        "warnings",
        "bundle",
        *APPENDED_KEYS,
    ]
    assert line["format"] == TELEMETRY_FORMAT == "nanrunbook-telemetry/1"
    assert (line["run_id"], line["rank"], line["world_size"], line["step"]) == ("shape", 0, 1, 5)
    assert list(line["grad"]) == [
        "nan",
        "posinf",
        "neginf",
        "max_abs",
        "dtype",
        "headroom_bits",
        "norm",
    ]
    assert list(line["update"]) == ["nan", "posinf", "neginf", "max_abs"]
    assert isinstance(line["time"], float) and abs(line["time"] - __import__("time").time()) < 600
    assert line["grad"]["dtype"] == "F32" and line["found_inf"] is False
    assert line["scale"] == 2.0**11 and isinstance(line["loss"], float)  # grew once, at step 4
    expected = math.log2(3.4028234663852886e38 / line["grad"]["max_abs"])
    assert line["grad"]["headroom_bits"] == pytest.approx(expected)
    assert line["grad_headroom_from"] == "max_abs"  # a sampled step: measured
    assert list(line["activations"]) == ["max_abs", "where", "dtype", "headroom_bits", "nonfinite"]


def test_sentinel_warning_codes_are_registered() -> None:
    for code in (
        "GRAD_NORM_SPIKE",
        "LOSS_SCALE_BACKOFF_STREAK",
        "LOSS_SCALE_BELOW_FLOOR",
        "SKIPPED_UPDATE_STREAK",
        "CHECKPOINT_NOT_RECOVERY_POINT",
        "NEAR_DTYPE_MAX",
    ):
        assert code in WARNING_CODES


# ----------------------------------------------------- last known-good


def test_checkpoints_mark_the_last_known_good_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    sentinel = Sentinel(model, optimizer, mse, **facts("lkg", tmp_path))

    def step(i: int) -> Any:
        batch = regression_batch(i)
        if i == 9:
            batch["x"][1, 1] = float("inf")
        optimizer.zero_grad()
        loss = sentinel.forward(batch)
        loss.backward()
        optimizer.step()
        if i == 4:
            sentinel.checkpointed("ckpt-4", verified_together=PARTS)
        if i == 6:  # this loop forgot to save the scaler: no recovery point
            sentinel.checkpointed("ckpt-6", verified_together=PARTS[:3] + PARTS[4:])
        return loss

    ran = run_loop(step, 20, lambda: state_bits(model, optimizer))
    assert ran.hold is not None and ran.hold.step == 9
    lkg = check_bundle(ran.hold.bundle).manifest.last_known_good
    assert (lkg.checkpoint_id, lkg.step) == ("ckpt-4", 4)
    assert ran.hold.last_known_good["checkpoint_id"] == "ckpt-4"
    lines = telemetry(tmp_path, "lkg")
    warned = {line["step"]: [w["code"] for w in line["warnings"]] for line in lines}
    # Said on the first line written after the checkpoint (step 6's, deferred for its update);
    # ckpt-4, all five parts in the loop's word, is a stated point (issue 28).
    assert [step for step, codes in warned.items() if codes] == [4, 6]
    assert warned[4] == ["RECOVERY_POINT_STATED"]
    assert warned[6] == ["CHECKPOINT_NOT_RECOVERY_POINT"]
    checkpoint = json.loads((ran.hold.bundle / "manifest.json").read_text())["binding"][
        "checkpoint"
    ]
    assert checkpoint["last_known_good_recovery"] == "stated"


def test_the_starting_state_must_be_stated_as_a_recovery_point(tmp_path: Path) -> None:
    model = Regressor()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    kwargs = facts("start", tmp_path)
    with pytest.raises(ValueError, match="verified_together"):
        Sentinel(model, optimizer, mse, **{**kwargs, "checkpoint": {"id": "init"}})
    with pytest.raises(ValueError, match="recovery point"):
        Sentinel(
            model,
            optimizer,
            mse,
            **{**kwargs, "checkpoint": {"id": "init", "verified_together": PARTS[:2]}},
        )
    with pytest.raises(ValueError, match="IDENTIFIER_INVALID"):
        Sentinel(model, optimizer, mse, **{**kwargs, "data": {"id": "has space"}})
    with pytest.raises(ValueError, match="reduction"):
        Sentinel(model, optimizer, mse, **{**kwargs, "objective": {"id": "x", "reduction": "avg"}})


def test_the_scheduler_state_dict_stays_a_checkpointable_dict(tmp_path: Path) -> None:
    """The scheduler's state_dict is its instance __dict__: holding its step must
    not put anything there (a checkpoint would save it, and could not)."""
    import pickle

    o = _plain()
    before = o["scheduler"].state_dict()
    scheduler_wrapper = vars(o["optimizer"])["step"]  # the scheduler's own, on the instance
    sentinel = Sentinel(
        o["model"], o["optimizer"], o["loss"], scheduler=o["scheduler"], **facts("sched", tmp_path)
    )
    assert o["scheduler"].state_dict().keys() == before.keys()
    assert isinstance(o["scheduler"], torch.optim.lr_scheduler.StepLR)
    _plain_step(o, 1, sentinel.forward, sentinel.clip_grad_norm_)
    pickle.dumps(o["scheduler"].state_dict())
    sentinel.close()
    assert type(o["scheduler"]) is torch.optim.lr_scheduler.StepLR
    assert vars(o["optimizer"])["step"] is scheduler_wrapper  # put back as it was


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_a_skip_under_a_gradscaler_leaves_scaler_and_scheduler_alone(
    scheduler_first: bool, tmp_path: Path
) -> None:
    """A NaN record under the skip policy: the scaler neither backs off nor
    counts the step, the scheduler does not advance, whatever order the loop
    calls scaler.update() and scheduler.step() in; training goes on."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sentinel = Sentinel(
        model,
        optimizer,
        xent,
        scaler=scaler,
        scheduler=scheduler,
        policy="skip",
        **facts("skip-scaler", tmp_path),
    )

    def step(i: int) -> Any:
        batch = drifting_batch(i, drift_from=10**6)
        if i == 3:
            batch["x"][0, 0] = float("nan")
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = sentinel.forward(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        if scheduler_first:
            scheduler.step()
            scaler.update()
        else:
            scaler.update()
            scheduler.step()
        return loss

    ran = run_loop(step, 6, lambda: state_bits(model, optimizer, scheduler, scaler))
    sentinel.close()  # the last step's line waits for its update's check
    assert ran.hold is None and ran.steps == 6
    assert ran.before[4] == ran.before[3]  # step 3 changed nothing at all
    lines = telemetry(tmp_path, "skip-scaler")
    assert [line["skipped"] for line in lines] == [False, False, True, False, False, False]
    assert scheduler.last_epoch == 5  # five applied steps
    assert bundles(tmp_path, "skip-scaler") == []


def test_the_last_line_is_written_at_exit_without_close(tmp_path: Path) -> None:
    """A loop that never calls close(): the last step's update is still checked,
    and its line written, when the interpreter exits."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from sentinel_support import Regressor, Sentinel, facts, mse, regression_batch
        torch.manual_seed(0)
        model = Regressor()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sentinel = Sentinel(model, optimizer, mse, **facts("at-exit", Path({str(tmp_path)!r})))
        for i in range(1, 5):
            optimizer.zero_grad()
            sentinel.forward(regression_batch(i)).backward()
            optimizer.step()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert [line["step"] for line in telemetry(tmp_path, "at-exit")] == [1, 2, 3, 4]


def test_a_sampled_step_sees_probes_in_execution_order() -> None:
    """While the sentinel samples, probes report beside the leaf modules, in the
    order the forward ran them; afterwards nothing listens."""
    from sentinel_support import Pooler

    from nanrunbook.capture.torch.replay import _recording as recording

    torch.manual_seed(0)
    model = Pooler()
    sampler = recording.ExtremesSampler(model, recording.leaf)
    tokens, mask = torch.randint(0, 50, (4, 6)), torch.ones(4, 6)
    with sampler.hooked():
        model(tokens, mask)
    assert sampler.names == ["act/embed", "act/proj", "probe/pool.mean", "act/head"]
    assert all(v.dim() == 0 and bool(torch.isfinite(v)) for v in sampler.values)
    assert recording._SINK is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_counts_agree_with_the_checks_own_counting(dtype: torch.dtype) -> None:
    """The sentinel's device counts (NaN, +inf, -inf, finite max abs) against the
    bit-pattern counting the check uses, on tensors with and without specials."""
    from nanrunbook.capture.torch._convert import tensor_to_raw
    from nanrunbook.capture.torch.sentinel._checks import exact_counts
    from nanrunbook.tensors.counting import combine, tally_bytes

    g = torch.Generator().manual_seed(7)
    tensors = [torch.randn(300, generator=g).to(dtype) * 100 for _ in range(4)]
    tensors[1][[3, 5]] = float("nan")
    tensors[1][7] = float("inf")
    tensors[3][[0, 1, 2]] = float("-inf")
    tensors[3][9] = 65000.0
    [found] = exact_counts(tensors)
    raws = [tensor_to_raw(t) for t in tensors]
    total = combine([tally_bytes(r.dtype, r.data) for r in raws])
    assert (
        (found.nan, found.posinf, found.neginf)
        == (total.counts.nan, total.counts.posinf, total.counts.neginf)
        == (2, 1, 3)
    )
    assert found.max_abs == total.max_abs


def test_the_replay_clips_scales_and_accumulates_as_the_loop_did() -> None:
    """Two micro-batches through dropout, a static loss scale, clipping: the
    replay's gradients and update are, bit for bit, what the real step did."""
    import copy

    from nanrunbook.capture.torch.replay import (
        Clipping,
        MicroBatch,
        RngState,
        Scaling,
        StepRecipe,
        replay_recipe,
    )

    torch.manual_seed(0)
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(2):  # optimizer state to carry
        optimizer.zero_grad()
        mse(model, regression_batch(i)).backward()
        optimizer.step()
    pre_model, pre_optimizer = copy.deepcopy(model), copy.deepcopy(optimizer)
    pre_optimizer.param_groups[0]["params"] = list(pre_model.parameters())
    pre_optimizer.state = {
        q: copy.deepcopy(optimizer.state[p])
        for p, q in zip(model.parameters(), pre_model.parameters(), strict=True)
    }
    micro = []
    optimizer.zero_grad()
    for i in (10, 11):
        micro.append(MicroBatch(regression_batch(i), RngState.now()))
        (mse(model, regression_batch(i)) * 256.0).backward()
    for p in model.parameters():
        p.grad.div_(256.0)
    grads = {n: bits(p.grad) for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()

    recipe = StepRecipe(
        compute_loss=mse,
        micro_batches=tuple(micro),
        scaling=Scaling("static", scale=256.0),
        clipping=Clipping(0.05, 2.0, tuple(id(p) for p in pre_model.parameters())),
    )
    identity = {
        "run_id": "r",
        "step": 3,
        "incident_owner": "o",
        "last_known_good": {"checkpoint_id": "c", "step": 2, "verified_together": PARTS},
    }
    owner = dict.fromkeys(("input", "forward", "loss", "backward", "optimizer"), "o")
    done = replay_recipe(pre_model, pre_optimizer, recipe, owner, **identity)
    data = {c.name: c.tensor.data for c in done.writer._tensors}
    for name, param in model.named_parameters():
        assert data[f"grad/{name}"] == grads[name][2], name  # unscaled, before clipping
        assert data[f"update/{name}"] == bits(param.detach() - before[name])[2], name


def test_the_norm_kernel_is_chosen_by_measurement_and_rechecked() -> None:
    """Both kernels give the same norms; both are timed first, then the faster
    is used, and the other is timed again every ``recheck`` calls."""
    from nanrunbook.capture.torch.sentinel._checks import NormChooser

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(50, 40, generator=g), torch.randn(7, generator=g)]
    chooser = NormChooser(recheck=7)
    first = [chooser.norms(tensors) for _ in range(4)]
    assert set(chooser.seconds) == {"fused", "dot"}
    for norms in first[1:]:
        assert torch.allclose(norms, first[0])
    chooser.seconds = {"fused": 1.0, "dot": 0.001}  # as if the dots were faster here
    chooser.norms(tensors)
    assert chooser.choice == "dot" and chooser.seconds["fused"] == 1.0  # fused not run
    chooser.calls = 13  # the next call is a recheck: the other kernel is timed
    chooser.norms(tensors)
    assert chooser.seconds["fused"] < 1.0
    bad = [torch.tensor([1.0, float("-inf")]), torch.ones(3)]
    assert not bool(torch.isfinite(NormChooser().norms(bad)).all())


@pytest.mark.parametrize(
    "copy",
    [
        lambda t: torch.empty(2).copy_(t),
        lambda t: t.to("cpu"),
        lambda t: t.cpu(),
        lambda t: t.tolist(),
    ],
    ids=["copy_", "to-cpu", "cpu", "tolist"],
)
def test_a_copy_off_an_accelerator_is_one_host_read(copy: Callable[[torch.Tensor], Any]) -> None:
    """'meta' stands in for an accelerator: the copy reaches the aten op (where
    it fails, having no data) and is counted once, at the Python call or at the
    op, never at both."""
    import contextlib

    with HostSyncs() as syncs, contextlib.suppress(NotImplementedError, RuntimeError):
        copy(torch.ones(2, device="meta"))
    assert syncs.count == 1, dict(syncs.kinds)
