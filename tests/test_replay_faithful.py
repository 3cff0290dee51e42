"""Replays that record what the live step was given and ran on: the batch as
given (before an in-place compute_loss), compiled models, the RNG and
determinism state, and the device; and the errors of bad arguments.

Real CPU runs whose NaN comes from real arithmetic."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from sentinel_support import PARTS, Sentinel, facts
from torch import nn

from nanrunbook import check_bundle
from nanrunbook.capture.torch import SentinelHold, replay_step, shrink_step

BINDING: dict[str, dict[str, Any]] = {
    "checkpoint": {"id": "ckpt-100"},
    "data": {"id": "data-test"},
    "loader_cursor": {"id": "cursor-101"},
    "objective": {"id": "mse", "reduction": "mean"},
    "scheduler": {"id": "constant"},
}
IDENTITY: dict[str, Any] = {
    "run_id": "run-faithful",
    "step": 101,
    "incident_owner": "ml-oncall",
    "last_known_good": {"checkpoint_id": "ckpt-100", "step": 100, "verified_together": PARTS},
    "binding": BINDING,
}


def manifest(bundle: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((bundle / "manifest.json").read_text())
    return loaded


def stage(bundle: Path, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in manifest(bundle)["stages"] if s["stage"] == name)
    return found


def input_tensors(bundle: Path) -> dict[str, torch.Tensor]:
    stored = safetensors.torch.load_file(bundle / "tensors.safetensors")
    return {t["name"]: stored[t["name"]] for t in stage(bundle, "input")["tensors"]}


# ------------------------------------------------- in-place loss functions


def _x(seed: int) -> torch.Tensor:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    x[2] = 0.5  # a constant row: de-meaned it is all zeros
    return x


def standardise_tensor(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """De-means and scales the window in place: the constant row becomes 0/0."""
    x.sub_(x.mean(1, keepdim=True)).div_(x.std(1, keepdim=True))
    return model(x).pow(2).mean()


def masked_dict(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masks and averages in place; a row with nothing kept is 0/0."""
    mask = batch["mask"]
    batch["x"].masked_fill_(~mask, 0.0).div_(mask.sum(1, keepdim=True))
    return model(batch["x"]).pow(2).mean()


def normalised_tuple(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    x.div_(x.norm(dim=1, keepdim=True))  # the zero row: 0/0
    return nn.functional.mse_loss(model(x).squeeze(1), y)


def _tuple_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _x(seed)
    x[2] = 0.0
    return x, torch.randn(6, generator=torch.Generator().manual_seed(seed + 1))


def _dict_batch(seed: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[3] = False
    return {"x": _x(seed), "mask": mask}


IN_PLACE: dict[str, tuple[Callable[[int], Any], Callable[..., Any], int]] = {
    "tensor": (_x, standardise_tensor, 2),
    "dict": (_dict_batch, masked_dict, 2),
    "tuple": (_tuple_batch, normalised_tuple, 1),
}


def _flat(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    return list(batch.values()) if isinstance(batch, dict) else list(batch)


def _assert_input_as_given(bundle: Path, given: Any) -> None:
    tensors = list(input_tensors(bundle).values())
    expected = _flat(given)
    assert len(tensors) == len(expected)
    for stored, original in zip(tensors, expected, strict=True):
        assert torch.equal(stored, original)  # the bytes the step was given
    counts = stage(bundle, "input")["counts"]
    assert counts["nan"] == counts["posinf"] == counts["neginf"] == 0
    assert counts["elements"] == sum(t.numel() for t in expected)
    assert check_bundle(bundle).decision.earliest_nonfinite_stage != "input"


@pytest.mark.parametrize("shape", sorted(IN_PLACE))
def test_replay_step_records_the_batch_as_given_before_an_in_place_loss(
    shape: str, tmp_path: Path
) -> None:
    make, loss, width = IN_PLACE[shape]
    torch.manual_seed(0)
    model = nn.Linear(4, width if shape != "tuple" else 1)
    batch = make(5)
    given = [t.clone() for t in _flat(batch)]
    bundle = tmp_path / "b"
    replay_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), batch, loss, target=bundle, **IDENTITY
    )
    _assert_input_as_given(bundle, make(5))
    assert all(torch.equal(a, b) for a, b in zip(_flat(batch), given, strict=True))
    assert check_bundle(bundle).decision.earliest_nonfinite_stage == "forward"


@pytest.mark.parametrize("shape", sorted(IN_PLACE))
def test_the_sentinel_records_the_batch_as_given_before_an_in_place_loss(
    shape: str, tmp_path: Path
) -> None:
    make, loss, width = IN_PLACE[shape]
    torch.manual_seed(0)
    model = nn.Linear(4, width if shape != "tuple" else 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = Sentinel(model, optimizer, loss, **facts(f"inplace-{shape}", tmp_path))
    with pytest.raises(SentinelHold) as held:
        optimizer.zero_grad()
        sentinel.forward(make(5)).backward()
        optimizer.step()
    bundle = held.value.bundle
    assert bundle is not None, held.value.capture_error
    _assert_input_as_given(bundle, make(5))
    assert held.value.stage == "forward"


@pytest.mark.parametrize("shape", sorted(IN_PLACE))
def test_shrink_and_its_fixture_take_the_batch_as_given(shape: str, tmp_path: Path) -> None:
    make, loss, width = IN_PLACE[shape]
    torch.manual_seed(0)
    model = nn.Linear(4, width if shape != "tuple" else 1)
    batch = make(5)
    found = shrink_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batch,
        loss,
        fixture=tmp_path / "fx",
        bundle={k: v for k, v in IDENTITY.items()},
    )
    assert found.operation.stage == "forward"  # made by the loss function, not in the data
    rows = torch.tensor(found.examples)
    shrunk = [t.index_select(0, rows) for t in _flat(make(5))]
    _assert_input_as_given(tmp_path / "fx" / "bundle", shrunk)  # the fixture's bundle
    assert all(torch.equal(a, b) for a, b in zip(_flat(batch), _flat(make(5)), strict=True))


# ------------------------------------------------- arguments the caller got wrong


def _sqrt_step() -> tuple[nn.Module, Any, torch.Tensor, Callable[..., Any]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))

    def loss(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = m(batch)
        return (out - out.detach()).pow(2).sum(1).sqrt().mean()  # sqrt(0): NaN gradient

    return model, torch.optim.SGD(model.parameters(), lr=0.1), x, loss


def test_shrink_step_takes_seed_as_replay_step_does() -> None:
    from nanrunbook.capture.torch.shrink import ShrinkError

    model, optimizer, batch, loss = _sqrt_step()
    found = shrink_step(model, optimizer, batch, loss, seed=7)
    assert found.operation.stage == "backward"
    with pytest.raises(ShrinkError, match="give seed or rng_state, not both"):
        shrink_step(model, optimizer, batch, loss, seed=7, rng_state=torch.get_rng_state())
    with pytest.raises(TypeError, match=r"shrink_step\(\) got an unexpected keyword argument"):
        shrink_step(model, optimizer, batch, loss, seeds=7)  # type: ignore[call-arg]


def test_replay_step_into_a_missing_directory_names_the_target(tmp_path: Path) -> None:
    model, optimizer, batch, loss = _sqrt_step()
    target = tmp_path / "no-such-dir" / "bundle"
    with pytest.raises(FileNotFoundError) as error:
        replay_step(model, optimizer, batch, loss, target=target, **IDENTITY)
    assert str(error.value) == (
        f"cannot write the bundle to {target}: its directory {target.parent} does not exist"
    )
    assert not (tmp_path / "no-such-dir").exists()


# ------------------------------------------------- a torch.compile'd model


class LogNet(nn.Module):
    """log of a ReLU output: -inf where the unit is off, a real loss NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.act(self.lin(x)))


class CompilerOnlyOverflow(LogNet):
    """Finite eagerly; the compiled graph overflows (as a fused kernel that
    accumulates in a narrower type would): the replay must say it differs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x)) + 1.0
        if torch.compiler.is_compiling():
            h = h * 3.0e38
        return h * h


def mean_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).mean()


def _compiled_hold(model: nn.Module, run: str, tmp_path: Path) -> SentinelHold:
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = Sentinel(compiled, optimizer, mean_loss, **facts(run, tmp_path))
    with pytest.raises(SentinelHold) as held:
        optimizer.zero_grad()
        sentinel.forward(_x(9)).backward()
        optimizer.step()
    return held.value


def test_a_compiled_model_is_replayed_eagerly_and_its_bundle_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hold = _compiled_hold(LogNet(), "compiled-log", tmp_path)
    assert hold.bundle is not None, hold.capture_error
    assert hold.stage == "loss" and hold.decision == "HOLD"
    assert "replayed eagerly" in hold.reason and "the live step ran compiled" in hold.reason
    assert "differs" not in hold.reason  # the eager replay saw what the live step saw
    for name in ("forward", "loss"):
        assert (
            "replayed eagerly on a copy of the compiled model's original module"
            in (stage(hold.bundle, name)["tensor_set"]["probe_source"])
        )
    assert "eagerly" not in stage(hold.bundle, "input")["tensor_set"]["probe_source"]
    names = [t["name"] for t in stage(hold.bundle, "forward")["tensors"]]
    assert names == ["act/lin", "act/act"]  # the original module's paths, no _orig_mod


def test_a_replay_that_differs_from_the_compiled_step_says_so(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hold = _compiled_hold(CompilerOnlyOverflow(), "compiled-overflow", tmp_path)
    assert hold.bundle is not None, hold.capture_error
    difference = "replay differs from the live step: the live step's loss was non-finite,"
    assert f"{difference} the replay's is finite" in hold.reason
    assert difference in stage(hold.bundle, "loss")["tensor_set"]["probe_source"]
    assert check_bundle(hold.bundle).decision.earliest_nonfinite_stage is None


def test_replay_step_replays_a_compiled_model_eagerly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LogNet()
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    replay_step(compiled, optimizer, _x(9), mean_loss, target=tmp_path / "b", **IDENTITY)
    assert "replayed eagerly" in stage(tmp_path / "b", "forward")["tensor_set"]["probe_source"]
    assert check_bundle(tmp_path / "b").decision.earliest_nonfinite_stage == "loss"


# ------------------------------------------------- random states and device facts


class NoisyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.lin(x))  # NaN where an output is negative


def _host_streams(generator: torch.Generator) -> tuple[Any, ...]:
    numpy_state = np.random.get_state()
    state = generator.get_state().numpy().tobytes()
    return (numpy_state[1].tobytes(), numpy_state[2], random.getstate(), state)


def test_numpy_python_and_a_loop_generator_are_restored_for_the_replay(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(11)
    np.random.seed(5)
    random.seed(6)

    def noisy_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        jitter = torch.from_numpy(np.random.standard_normal(x.shape)).float() * random.random()
        return model(x + jitter + torch.randn(x.shape, generator=generator)).mean()

    torch.manual_seed(0)
    model = NoisyNet()
    live: list[torch.Tensor] = []
    model.lin.register_forward_hook(lambda m, i, out: live.append(out.detach().clone()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = facts("host-random", tmp_path, generators=[generator])
    sentinel = Sentinel(model, optimizer, noisy_loss, **run)
    with pytest.raises(SentinelHold) as held:
        optimizer.zero_grad()
        sentinel.forward(_x(9)).backward()
        after_forward = _host_streams(generator)
        optimizer.step()
    assert _host_streams(generator) == after_forward  # the replay drew from copies of them
    bundle = held.value.bundle
    assert bundle is not None, held.value.capture_error
    stored = safetensors.torch.load_file(bundle / "tensors.safetensors")
    assert torch.equal(stored["act/lin"], live[0])  # the same noise, bit for bit
    binding = manifest(bundle)["binding"]
    assert {k: binding["random_state"][k] for k in ("numpy", "python_random", "generators")} == {
        "numpy": "restored",
        "python_random": "restored",
        "generators": 1,
    }
    assert binding["environment"]["replay"] == "exact"
    assert "may not be exact" not in held.value.reason


def test_a_replay_that_draws_from_an_unknown_numpy_state_says_it_may_not_be_exact(
    tmp_path: Path,
) -> None:
    def numpy_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x * float(np.random.uniform(0.9, 1.1))).mean()

    torch.manual_seed(0)
    model = NoisyNet()
    np.random.seed(3)
    before = np.random.get_state()[1].tobytes()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    replay_step(model, optimizer, _x(9), numpy_loss, target=tmp_path / "b", **IDENTITY)
    assert np.random.get_state()[1].tobytes() == before  # the caller's stream is untouched
    environment = manifest(tmp_path / "b")["binding"]["environment"]
    assert environment["replay"] == "inexact"
    assert environment["replay_inexact"] == (
        "the replay drew from numpy's or Python's random, whose state at the live step is not known"
    )
    assert manifest(tmp_path / "b")["binding"]["random_state"]["numpy"] == "current-at-replay"


def test_the_environment_records_determinism_flags_and_that_the_run_was_on_cpu(
    tmp_path: Path,
) -> None:
    model, optimizer, batch, loss = _sqrt_step()
    replay_step(model, optimizer, batch, loss, target=tmp_path / "b", **IDENTITY)
    environment = manifest(tmp_path / "b")["binding"]["environment"]
    assert environment["device"] == "cpu" and environment["replay"] == "exact"
    assert not {"gpu_name", "gpu_uuid", "compute_capability", "driver", "nccl"} & set(environment)
    expected = "true" if torch.are_deterministic_algorithms_enabled() else "false"
    assert environment["deterministic_algorithms"] == expected
    assert environment["matmul_allow_tf32"] in ("true", "false")
    assert environment["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_a_cuda_device_records_what_torch_exposes(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from nanrunbook.capture.torch._faithfulness import device_facts, inexact_kernels

    props = SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", uuid="5e1d1b8c-0000-4000-8000-00000000abcd", major=9, minor=0
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch._C, "_cuda_getDriverVersion", lambda: 12040, raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_facts(torch.device("cuda", 3)) == {
        "device": "cuda:3",
        "device_index": 3,
        "local_rank": 3,
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_uuid": "GPU-5e1d1b8c-0000-4000-8000-00000000abcd",
        "compute_capability": "9.0",
        "driver": "12.4",
        "cudnn": "90100",
        "nccl": "2.21.5",
    }
    assert device_facts("cuda")["device"] == "cuda:0"  # the current device
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    assert inexact_kernels("cuda:0") == [
        "non-deterministic CUDA kernels allowed (deterministic algorithms off)"
    ]
    assert inexact_kernels("cpu") == []
    monkeypatch.delenv("LOCAL_RANK")
    assert device_facts("cpu") == {"device": "cpu"}


def test_a_sentinel_without_host_random_says_its_replay_may_not_be_exact(tmp_path: Path) -> None:
    def numpy_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x * float(np.random.uniform(0.9, 1.1))).mean()

    torch.manual_seed(0)
    model = NoisyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = facts("no-host-random", tmp_path, host_random=False)
    sentinel = Sentinel(model, optimizer, numpy_loss, **run)
    with pytest.raises(SentinelHold) as held:
        optimizer.zero_grad()
        sentinel.forward(_x(9)).backward()
        optimizer.step()
    bundle = held.value.bundle
    assert bundle is not None, held.value.capture_error
    assert manifest(bundle)["binding"]["random_state"]["numpy"] == "current-at-replay"
    assert manifest(bundle)["binding"]["environment"]["replay"] == "inexact"
    assert "the replay may not be exact: the replay drew from numpy's" in held.value.reason


def test_a_batch_holding_a_value_that_cannot_be_copied_still_trains(tmp_path: Path) -> None:
    import threading

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    lock = threading.Lock()  # deepcopy refuses it

    def loss(m: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        assert batch["lock"] is lock
        return m(batch["x"]).pow(2).mean()

    sentinel = Sentinel(model, optimizer, loss, **facts("uncopyable", tmp_path))
    for _ in range(2):
        optimizer.zero_grad()
        sentinel.forward({"x": _x(1), "lock": lock}).backward()
        optimizer.step()
    sentinel.close()
