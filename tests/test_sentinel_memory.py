"""Memory the sentinel takes on a sampled step and at a hold, measured as bytes
torch's allocator hands out (the profiler's allocation events), against the
parameters' own bytes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

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
    pending = sentinel._decider.pending
    assert pending is not None and pending.update_max is not None
    assert pending.update_max[0] == ["F32"]
    sentinel.close()


def test_update_extremes_is_the_max_abs_of_every_delta() -> None:
    from nanrunbook.capture.torch.sentinel._steps import update_extremes

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


# ------------------------------------------------------------------ the hold


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(512, WIDTH)
        self.layers = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(6)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embed(tokens))


def _token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _held(
    tmp: Path, memory: str, measure: bool, snapshot: Any = True
) -> tuple[Any, int, int, Any, Any, nn.Module]:
    """Two healthy AdamW steps (the state exists), then one with eps=0: the
    embedding rows no batch used divide 0 by 0, the update is NaN, rolled back
    from the snapshot, and the step replayed. Returns the hold, the peak device
    and host bytes of the call that holds, the real state before the update
    and after the hold."""
    from sentinel_support import state_bits

    from nanrunbook.capture.torch import SentinelHold, _offload

    model = _Embedded()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sentinel = Sentinel(
        model,
        optimizer,
        _token_loss,
        snapshot=snapshot,
        replay_memory=memory,  # type: ignore[arg-type]
        thresholds=Thresholds(sample_every=0),
        telemetry=False,
        **facts(f"hold-{memory}", tmp),
    )
    tokens = torch.arange(64).reshape(4, 16)  # rows 64.. of the embedding never used
    kept: dict[str, Any] = {}

    def train() -> None:
        for step in range(3):
            if step == 2:
                for group in optimizer.param_groups:
                    group["eps"] = 0.0
            optimizer.zero_grad(set_to_none=False)
            sentinel.forward(tokens).backward()
            # What the rollback must give back: the state before this update.
            # Taken from deep copies: a numpy view of a CPU tensor makes its storage
            # one torch cannot resize, and so cannot set aside.
            kept["before"] = state_bits(*copy.deepcopy((model, optimizer)), same=False)
            kept["grads"] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            optimizer.step()

    pointers: list[tuple[int, int]] = []
    real_buffer = _offload.host_buffer

    def recorded(nbytes: int, pinned: bool) -> Any:
        made = real_buffer(nbytes, pinned)
        pointers.append((made.data_ptr(), nbytes))
        return made

    def close() -> Any:
        try:
            sentinel.close()
        except SentinelHold as hold:
            return hold
        return None

    _offload.host_buffer = recorded  # type: ignore[assignment]
    try:
        if measure:
            peak = peak_allocated(close, prepare=train, host=lambda: pointers)
            hold, device, host = peak.result, peak.device, peak.host
        else:
            train()
            hold, device, host = close(), 0, 0
    finally:
        _offload.host_buffer = real_buffer  # type: ignore[assignment]
    before, grads = kept["before"], kept["grads"]
    after = state_bits(model, optimizer, same=False)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.grad is not None and torch.equal(p.grad, g)
    return hold, device, host, before, after, model


def test_an_offloaded_replay_writes_the_same_bundle_and_leaves_the_real_state(
    tmp_path: Path,
) -> None:
    """The real gradients and optimizer state set aside on the host during the
    replay come back bit for bit, and the bundle is the
    default path's, tensor for tensor."""
    import json

    bundles = {}
    for memory in ("device", "offload"):
        hold, _, _, before, after, _ = _held(tmp_path / memory, memory, measure=False)
        assert hold is not None and hold.bundle is not None, hold
        assert hold.report.decision.earliest_nonfinite_stage == "optimizer"
        assert after == before
        stages = json.loads((hold.bundle / "manifest.json").read_text())["stages"]
        bundles[memory] = [
            (t["name"], t["sha256"]) for stage in stages for t in stage.get("tensors", [])
        ]
    assert bundles["offload"] == bundles["device"]
    assert any(name.startswith("opt/") for name, _ in bundles["offload"])


def test_an_offloaded_replay_takes_at_most_twice_the_parameters_on_the_device(
    tmp_path: Path,
) -> None:
    """Measured: the default path takes about 5.5x the parameter bytes more than
    the training step had (float32 AdamW: model, state, gradients, parameters
    before the update); the offload path at most 2x on the device, the rest on
    the host."""
    params = sum(p.numel() * p.element_size() for p in _Embedded().parameters())
    _, device_path, _, _, _, _ = _held(tmp_path / "device", "device", measure=True)
    _, offload_path, host, _, _, _ = _held(tmp_path / "offload", "offload", measure=True)
    assert device_path > 3 * params, device_path / params
    print(f"hold: device path {device_path / params:.2f}x, offload {offload_path / params:.2f}x")
    assert offload_path <= 2 * params, (offload_path / params, host / params)


def test_a_host_snapshot_rolls_back_bit_for_bit(tmp_path: Path) -> None:
    """``snapshot="host"`` keeps the pre-step copy in host memory (on the CPU the
    same memory) and rolls a NaN update back as the device snapshot does, the
    optimizer state included, each state tensor on the device it was on."""
    hold, _, _, before, after, _ = _held(tmp_path, "device", measure=False, snapshot="host")
    assert hold is not None and hold.bundle is not None and not hold.contaminated
    assert after == before


def test_a_snapshot_or_replay_memory_that_is_not_one_of_the_choices_is_refused(
    tmp_path: Path,
) -> None:
    import pytest

    model = _stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="snapshot is True, False, 'device' or 'host'"):
        Sentinel(model, optimizer, _loss, snapshot="gpu", **facts("bad", tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_memory is one of"):
        Sentinel(model, optimizer, _loss, replay_memory="cpu", **facts("bad", tmp_path))  # type: ignore[arg-type]


def test_auto_offloads_only_when_the_free_memory_it_sees_is_short(monkeypatch: Any) -> None:
    """``auto``: the default path on the CPU (no free-memory figure), the offload
    path when the device's free memory is less than the default path needs."""
    from nanrunbook.capture.torch import _offload

    model = _stack()
    optimizer = torch.optim.AdamW(model.parameters())
    need = _offload.default_path_bytes(model, optimizer)
    assert need >= 4 * sum(p.numel() * 4 for p in model.parameters())  # copies, grads, update
    assert _offload.choose_path(model, optimizer, "auto") == "device"
    monkeypatch.setattr(_offload, "_device_free", lambda device: need // 2)
    assert _offload.choose_path(model, optimizer, "auto") == "offload"
    monkeypatch.setattr(_offload, "_device_free", lambda device: 2 * need)
    assert _offload.choose_path(model, optimizer, "auto") == "device"
    assert _offload.choose_path(model, optimizer, "offload") == "offload"


def test_an_offloaded_replay_that_fails_still_puts_the_real_state_back(tmp_path: Path) -> None:
    """A replay that raises (here compute_loss on the copy) on the offload path:
    the hold stands without a bundle, and the real gradients and optimizer state
    set aside on the host are back on their tensors, bit for bit."""
    from sentinel_support import bits

    from nanrunbook.capture.torch import SentinelHold

    model = _stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def only_the_real_model(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        if m is not model:
            raise RuntimeError("out of memory (made on purpose)")
        return _loss(m, batch)

    sentinel = Sentinel(
        model,
        optimizer,
        only_the_real_model,
        replay_memory="offload",
        thresholds=Thresholds(sample_every=0),
        telemetry=False,
        **facts("failing-replay", tmp_path),
    )
    batch = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    for step in range(3):
        optimizer.zero_grad(set_to_none=False)
        if step == 2:
            batch[0, 0] = float("nan")
        sentinel.forward(batch).backward()
        if step == 2:
            # Bits of clones: a numpy view would make the real storages unresizable.
            grads = [bits(p.grad.clone()) for p in model.parameters()]  # type: ignore[union-attr]
            state = [bits(v.clone()) for s in optimizer.state.values() for v in s.values()]
            try:
                optimizer.step()
            except SentinelHold as hold:
                assert hold.bundle is None and "made on purpose" in str(hold.capture_error)
            else:
                raise AssertionError("the step did not hold")
        else:
            optimizer.step()
    assert [bits(p.grad) for p in model.parameters()] == grads
    assert [bits(v) for s in optimizer.state.values() for v in s.values()] == state
