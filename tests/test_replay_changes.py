"""Real CPU replays compared with ``diff``: as is, with one mechanism changed on
purpose (nanrunbook.capture.mechanisms), with two, and without the RNG state."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.numpy
import torch
from torch import nn
from torch.nn import functional as F

from nanrunbook import check_bundle, diff_bundles
from nanrunbook.capture.mechanisms import (
    LossScale,
    OtherBatch,
    Reduction,
    WithoutAutocast,
    autocast_off,
    replay_changed,
)
from nanrunbook.capture.torch import replay_step, tensor_to_raw
from nanrunbook.diff import Comparison

BINDING: dict[str, dict[str, Any]] = {
    "checkpoint": {"id": "ckpt-40"},
    "data": {"id": "data-mixed-units"},
    "loader_cursor": {"id": "cursor-41"},
    "objective": {"id": "xent", "reduction": "mean"},
    "scheduler": {"id": "constant"},
}
IDENTITY: dict[str, Any] = {
    "run_id": "run-replays",
    "step": 41,
    "incident_owner": "ml-oncall",
    "last_known_good": {
        "checkpoint_id": "ckpt-40",
        "step": 40,
        "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
    },
    "binding": BINDING,
}


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(64, 4))


def make_batch(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(8, 16, generator=g) * scale,
        "y": torch.randint(0, 4, (8,), generator=g),
    }


def fp16_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(batch["x"]), batch["y"])


def fp32_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


class Run:
    """A model, its optimizer and scaler, one batch and the RNG state of its step."""

    def __init__(self, *, scale: float = 1.0, init_scale: float = 2.0**16, dropout: float = 0.0):
        self.model = mlp(dropout)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        self.batch = make_batch(scale)
        self.rng = torch.get_rng_state()

    def replay(self, target: Path, loss: Any = fp16_loss, **options: Any) -> Path:
        options = {"scaler": self.scaler, "rng_state": self.rng, **IDENTITY, **options}
        replay_step(self.model, self.optimizer, self.batch, loss, target=target, **options)
        return target

    def changed(self, change: Any, target: Path, loss: Any = fp16_loss, **options: Any) -> Path:
        options = {"scaler": self.scaler, "rng_state": self.rng, **IDENTITY, **options}
        replay_changed(
            change, self.model, self.optimizer, self.batch, loss, target=target, **options
        )
        return target


def kv(result: Comparison) -> dict[str, str]:
    import io

    from nanrunbook.output.renderers import RENDERERS

    out = io.StringIO()
    RENDERERS["kv"].diff(result, out)
    return dict(line.split("=", 1) for line in out.getvalue().splitlines())


# --------------------------------------------------- the fp16 forward overflow


@pytest.fixture(scope="module")
def overflow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path, Path]:
    """Raw-units inputs overflow fp16 when autocast casts them: HOLD at forward."""
    run = Run(scale=1e5)
    where = tmp_path_factory.mktemp("overflow")
    base = run.replay(where / "base")
    report = check_bundle(base)
    assert (report.decision.decision, report.decision.earliest_nonfinite_stage) == (
        "HOLD",
        "forward",
    )
    return run, base, where


def test_replayed_as_is_reproduces_bit_for_bit(overflow: tuple[Run, Path, Path]) -> None:
    run, base, where = overflow
    result = diff_bundles(base, run.replay(where / "again"))
    assert (result.verdict, result.changes, result.first_divergence) == ("REPRODUCED", (), None)
    assert result.tensors and all(t.status == "identical" for t in result.tensors)
    assert kv(result)["first_divergence_stage"] == "none"
    # A deterministic replay writes the very bundle it replays: one evidence,
    # two directories, and the verdict stands.
    assert result.same_evidence and not result.same_bundle
    assert result.exit_code() == 0


def test_in_float32_one_mechanism_changed_and_fixed(overflow: tuple[Run, Path, Path]) -> None:
    run, base, where = overflow
    result = diff_bundles(base, run.changed(WithoutAutocast(), where / "fp32"))
    assert (result.verdict, result.changed, result.outcome) == (
        "ONE_MECHANISM_CHANGED",
        ("precision",),
        "FIXED",
    )
    assert result.recovered and result.exit_code(require_fixed=True) == 0
    change = result.changes[0]
    assert (change.base["compute_dtype"], change.other["compute_dtype"]) == ("F16", "F32")
    assert change.other["replay_change"] == "autocast disabled: compute in the parameters' dtype"
    assert "replay_change" in change.fields
    first = result.first_divergence
    assert first is not None and (first.name, first.status) == ("act/0", "dtype_differs")
    assert kv(result) | {"base_evidence_content_id": "", "other_evidence_content_id": ""} == {
        "base_evidence_content_id": "",
        "other_evidence_content_id": "",
        "base_decision": "HOLD",
        "other_decision": "CONTINUE_BOUNDED_DIAGNOSTICS",
        "base_earliest_nonfinite": "forward",
        "other_earliest_nonfinite": "none",
        "changed": "precision",
        "verdict": "ONE_MECHANISM_CHANGED",
        "outcome": "FIXED",
        "first_divergence_stage": "forward",
        "same_evidence": "false",
        "same_bundle": "false",
    }
    assert [t.name for t in result.other_only][:1] == ["opt/0.weight/momentum_buffer"]


def test_a_lower_loss_scale_leaves_a_forward_overflow_unchanged(
    overflow: tuple[Run, Path, Path],
) -> None:
    run, base, where = overflow
    result = diff_bundles(base, run.changed(LossScale(2.0**10), where / "scale"))
    assert (result.verdict, result.changed, result.outcome) == (
        "ONE_MECHANISM_CHANGED",
        ("scaler",),
        "UNCHANGED",
    )
    change = result.changes[0]
    assert (change.base["scale"], change.other["scale"]) == (65536.0, 1024.0)
    assert change.other["replay_change"] == "loss scale 65536 -> 1024"
    assert result.exit_code() == 0 and result.exit_code(require_fixed=True) == 1


def test_precision_and_scale_together_are_confounded(overflow: tuple[Run, Path, Path]) -> None:
    run, base, where = overflow
    other_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    other = run.changed(WithoutAutocast(), where / "both", scaler=other_scaler)
    result = diff_bundles(base, other)
    assert (result.verdict, result.changed, result.outcome) == (
        "CONFOUNDED",
        ("scaler", "precision"),
        None,
    )
    assert kv(result)["changed"] == "scaler,precision" and kv(result)["outcome"] == "none"
    assert result.exit_code() == 1


# ------------------------------------------------ the fp16 backward overflow


def test_a_lower_loss_scale_fixes_a_backward_overflow(tmp_path: Path) -> None:
    """Finite forward; gradients scaled by 2^24 overflow fp16 in backward."""
    run = Run(init_scale=2.0**24)
    base = run.replay(tmp_path / "base")
    result = diff_bundles(base, run.changed(LossScale(2.0**8), tmp_path / "scale"))
    assert (result.base.decision.earliest_nonfinite_stage, result.outcome) == ("backward", "FIXED")
    assert (result.verdict, result.changed) == ("ONE_MECHANISM_CHANGED", ("scaler",))
    assert kv(result)["first_divergence_stage"] == "backward"
    # the scaler's found_inf / skip / scale_after differ too: results, not mechanisms
    assert result.changes[0].fields == ("scale", "replay_change")


# ------------------------------------------------- reduction, batch, RNG state


def test_sum_instead_of_mean(tmp_path: Path) -> None:
    run = Run()
    criterion = nn.CrossEntropyLoss()  # a module: it calls F.cross_entropy(reduction="mean")

    def module_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return criterion(model(batch["x"]), batch["y"])

    base = run.replay(tmp_path / "base", module_loss, scaler=None)
    other = run.changed(Reduction("sum"), tmp_path / "sum", module_loss, scaler=None)
    result = diff_bundles(base, other)
    assert (result.verdict, result.changed, result.outcome) == (
        "ONE_MECHANISM_CHANGED",
        ("objective",),
        "UNCHANGED",
    )
    change = result.changes[0]
    assert (change.base["reduction"], change.other["reduction"]) == ("mean", "sum")
    assert change.other["replay_change"] == "reduction mean -> sum"
    first = result.first_divergence
    assert first is not None and (first.name, first.base_stage) == ("loss", "loss")
    mean = safetensors.numpy.load_file(str(base / "tensors.safetensors"))["loss"]
    total = safetensors.numpy.load_file(str(other / "tensors.safetensors"))["loss"]
    assert float(total) == pytest.approx(8 * float(mean), rel=1e-6)
    assert criterion.reduction == "mean"


def test_another_batch_parts_at_the_input(tmp_path: Path) -> None:
    run = Run()
    base = run.replay(tmp_path / "base")
    other_batch = {**run.batch, "x": run.batch["x"] * 2}
    result = diff_bundles(base, run.changed(OtherBatch(other_batch), tmp_path / "other"))
    assert (result.verdict, result.changed) == ("ONE_MECHANISM_CHANGED", ("batch",))
    assert result.changes[0].other["replay_change"] == "batch substituted"
    first = result.first_divergence
    assert first is not None and (first.name, first.base_stage) == ("batch/x", "input")
    assert [t.status for t in result.tensors[:2]] == ["differing", "identical"]  # x, then y


def test_without_the_recorded_rng_state_a_dropout_replay_diverges_at_forward(
    tmp_path: Path,
) -> None:
    run = Run(dropout=0.5)
    base = run.replay(tmp_path / "base", fp32_loss, scaler=None)
    torch.rand(1)  # the RNG moved on since the step
    other = run.replay(tmp_path / "other", fp32_loss, scaler=None, rng_state=None)
    result = diff_bundles(base, other)
    assert kv(result)["first_divergence_stage"] == "forward"
    first = result.first_divergence
    assert first is not None and first.name == "act/2"  # the Dropout's output
    status = {t.name: t.status for t in result.tensors}
    assert status["act/0"] == status["act/1"] == "identical"  # before the dropout
    assert result.changed == ("random_state",)


# ---------------------------------------------------- refusals and isolation


def test_changes_that_change_nothing_or_cannot_apply_are_refused(tmp_path: Path) -> None:
    run = Run()
    cases: list[tuple[Any, Any, dict[str, Any], str]] = [
        (WithoutAutocast(), fp32_loss, {}, "no enabled autocast region"),
        (LossScale(2.0**10), fp16_loss, {"scaler": None}, "needs the step's enabled GradScaler"),
        (LossScale(3.0), fp16_loss, {}, "power of two"),
        (LossScale(2.0**30), fp16_loss, {}, "power of two"),
        (LossScale(2.0**16), fp16_loss, {}, "already 65536"),
        (Reduction("mean"), fp32_loss, {}, "not the current one"),
        (OtherBatch(make_batch()), fp32_loss, {}, "bit for bit"),
    ]
    for change, loss, options, message in cases:
        with pytest.raises(ValueError, match=message):
            run.changed(change, tmp_path / "never", loss, **options)

    def hand_mean(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        picked = F.log_softmax(model(batch["x"]), 1).gather(1, batch["y"][:, None])
        return -picked.mean()

    with pytest.raises(ValueError, match=r"no torch\.nn\.functional loss"):
        run.changed(Reduction("sum"), tmp_path / "never", hand_mean)
    assert not (tmp_path / "never").exists()


def _state(run: Run) -> list[Any]:
    tensors = [tensor_to_raw(v).data for v in run.model.state_dict().values()]
    return [
        tensors,
        repr(run.optimizer.state_dict()),
        repr(run.scaler.state_dict()),
        tensor_to_raw(torch.get_rng_state()).data,
    ]


def test_the_real_run_and_torch_are_left_as_they_were(tmp_path: Path) -> None:
    run = Run(scale=1e5)
    enter = torch.amp.autocast_mode.autocast.__enter__
    before = _state(run)
    for index, change in enumerate((WithoutAutocast(), LossScale(2.0**4), Reduction("sum"))):
        run.changed(change, tmp_path / str(index))
    assert _state(run) == before
    assert torch.amp.autocast_mode.autocast.__enter__ is enter
    assert run.scaler.get_scale() == 2.0**16


def test_autocast_is_turned_off_on_the_replaying_thread_only() -> None:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    seen: dict[str, torch.dtype] = {}
    entered, release = threading.Event(), threading.Event()

    def elsewhere() -> None:
        entered.wait()
        with torch.autocast("cpu", dtype=torch.float16):
            seen["other thread"] = layer(x).dtype
        release.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with autocast_off() as counter:
        entered.set()
        release.wait(timeout=30)
        with torch.autocast("cpu", dtype=torch.float16):
            seen["this thread"] = layer(x).dtype
    thread.join()
    assert seen == {"other thread": torch.float16, "this thread": torch.float32}
    assert counter == [1]
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer(x).dtype == torch.float16
