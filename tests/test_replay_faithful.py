"""Replays that record what the live step was given and ran on: the batch as
given (before an in-place compute_loss), compiled models, the RNG and
determinism state, and the device; and the errors of bad arguments.

Real CPU runs whose NaN comes from real arithmetic."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
