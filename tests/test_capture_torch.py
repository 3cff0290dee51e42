"""PyTorch capture: tensor_to_raw for every dtype, and replay_step on copies."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from nanrunbook import check_bundle
from nanrunbook.capture import BundleWriter, as_raw
from nanrunbook.capture.torch import TORCH_DTYPES, replay_step, tensor_to_raw
from nanrunbook.records import Counts

# The five parts a recovery point verifies together, stated as every caller must.
RECOVERY = ["model", "optimizer", "scheduler", "scaler", "data_position"]

BINDING: dict[str, dict[str, Any]] = {
    "checkpoint": {"id": "ckpt-100"},
    "data": {"id": "data-test"},
    "loader_cursor": {"id": "cursor-101"},
    "objective": {"id": "xent", "reduction": "mean"},
    "scheduler": {"id": "constant"},
}
IDENTITY: dict[str, Any] = {
    "run_id": "run-torch",
    "step": 101,
    "incident_owner": "ml-oncall",
    "last_known_good": {"checkpoint_id": "ckpt-100", "step": 100, "verified_together": RECOVERY},
    "binding": BINDING,
}


# ---- tensor_to_raw -----------------------------------------------------------------------

SPECIALS = [0.0, -0.0, 1.5, -2.25, float("nan"), float("inf"), float("-inf"), 300.0, 1e-3]


def sample(name: str) -> torch.Tensor:
    dtype = getattr(torch, name)
    if name == "bool":
        return torch.tensor([[True, False], [False, True]])
    if name.startswith(("int", "uint")):
        info = torch.iinfo(dtype)
        return torch.tensor(
            [info.min, 0, 1, info.max], dtype=torch.int64 if info.bits < 64 else dtype
        ).to(dtype)
    if name == "complex64":
        return torch.tensor(
            [1 + 2j, complex(float("nan"), 1), complex(float("inf"), 0), complex(1, float("-inf"))],
            dtype=dtype,
        )
    return torch.tensor(SPECIALS, dtype=torch.float32).to(dtype).reshape(3, 3)


def reference_bytes(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """dtype, shape and data bytes as the reference safetensors writer stores them."""
    blob = safetensors.torch.save({"t": tensor.contiguous()})
    (length,) = struct.unpack("<Q", blob[:8])
    entry = json.loads(blob[8 : 8 + length])["t"]
    begin, end = entry["data_offsets"]
    return entry["dtype"], entry["shape"], blob[8 + length + begin : 8 + length + end]


FULL_WIDTH = sorted(n for n in TORCH_DTYPES if n != "float4_e2m1fn_x2")


@pytest.mark.parametrize("name", FULL_WIDTH)
def test_bytes_match_the_reference_writer(name: str) -> None:
    tensor = sample(name)
    raw = tensor_to_raw(tensor)
    dtype, shape, data = reference_bytes(tensor)
    assert (raw.dtype, list(raw.shape), raw.data) == (dtype, shape, data)
    assert raw.dtype == TORCH_DTYPES[name]


def oracle(tensor: torch.Tensor) -> Counts:
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return Counts(tensor.numel(), tensor.numel(), 0, 0, 0)
    if tensor.is_complex():
        real, imag = tensor.real.float(), tensor.imag.float()
        nan = real.isnan() | imag.isnan()
        inf = ~nan & (real.isinf() | imag.isinf())
        first = torch.where(real.isinf(), real, imag)
        posinf, neginf = int((inf & (first > 0)).sum()), int((inf & (first < 0)).sum())
        n = int(nan.sum())
        return Counts(tensor.numel(), tensor.numel() - n - posinf - neginf, n, posinf, neginf)
    values = tensor.float()
    n, p, m = int(values.isnan().sum()), int(values.isposinf().sum()), int(values.isneginf().sum())
    return Counts(tensor.numel(), tensor.numel() - n - p - m, n, p, m)


@pytest.mark.parametrize("name", FULL_WIDTH)
def test_counts_of_every_torch_dtype_agree_with_torch(name: str, tmp_path: Path) -> None:
    tensor = sample(name)
    w = writer()
    counts = w.observe("input", [("x", tensor, "x")], owner="o", probe_source="p")
    assert counts == oracle(tensor)
    if counts.nonfinite:
        w.not_run_rest(owner="o", reason="stopped")
    else:
        for stage in ("forward", "loss", "backward", "optimizer"):
            w.observe(stage, [(stage, torch.ones(2), "p")], owner="o", probe_source="p")
    assert check_bundle(w.write(tmp_path / "b")).stages[0].counts == counts


def writer() -> BundleWriter:
    items = {
        **BINDING,
        "model": {"id": "m"},
        "batch": {"id": "b"},
        "optimizer": {"id": "sgd"},
        "scaler": {"id": "none", "mode": "none", "scale": 1},
        "random_state": {"id": "seed-0"},
        "environment": {"id": "env"},
        "topology": {"id": "single", "world_size": 1, "rank": 0},
        "precision": {"id": "fp32", "param_dtype": "F32", "compute_dtype": "F32"},
    }
    return BundleWriter(
        run_id="run-torch",
        step=101,
        incident_owner="ml-oncall",
        binding=items,
        last_known_good={"checkpoint_id": "ckpt-100", "step": 100, "verified_together": RECOVERY},
    )


def test_float4_x2_is_stored_as_f4_with_twice_the_last_dimension(tmp_path: Path) -> None:
    packed = torch.tensor([[0x82, 0xF7, 0x51], [0x00, 0x11, 0xFF]], dtype=torch.uint8)
    tensor = packed.view(torch.float4_e2m1fn_x2)
    raw = tensor_to_raw(tensor)
    assert (raw.dtype, raw.shape, raw.data) == ("F4", (2, 6), bytes(packed.flatten().tolist()))
    scalar = torch.tensor(0x35, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert scalar.dim() == 0
    assert (tensor_to_raw(scalar).shape, tensor_to_raw(scalar).data) == ((2,), b"\x35")
    empty = torch.empty(0, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert tensor_to_raw(empty).shape == (0, 8)
    w = writer()
    assert w.observe("input", [("f4", tensor, "p")], owner="o", probe_source="p") == Counts(
        12, 12, 0, 0, 0
    )


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: sparse invariant checks
def test_views_scalars_and_empty_tensors() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = tensor_to_raw(base.t())
    assert transposed.shape == (4, 3)
    assert transposed.data == base.t().contiguous().numpy().tobytes()
    strided = tensor_to_raw(base[:, ::2])
    assert strided.data == np.ascontiguousarray(base.numpy()[:, ::2]).tobytes()
    scalar = tensor_to_raw(torch.tensor(2.5, dtype=torch.bfloat16))
    assert (scalar.dtype, scalar.shape, scalar.data) == ("BF16", (), b"\x20\x40")
    empty = tensor_to_raw(torch.empty(0, 3, dtype=torch.float16))
    assert (empty.shape, empty.data) == ((0, 3), b"")
    complex_view = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    assert complex_view.is_conj()
    assert tensor_to_raw(complex_view).data == np.array([1 - 2j], "<c8").tobytes()
    parameter = nn.Parameter(torch.ones(2))
    assert as_raw(parameter).data == np.ones(2, "<f4").tobytes()  # requires_grad, via as_raw
    sparse = torch.sparse_coo_tensor([[0, 2]], [5.0, -1.0], (4,))
    assert tensor_to_raw(sparse).data == np.array([5, 0, -1, 0], "<f4").tobytes()


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch: complex32, qint8 are experimental
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, dtype=torch.complex128),
        lambda: torch.zeros(2, dtype=torch.complex32),
        lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        lambda: torch.empty(2, device="meta"),
    ],
    ids=["complex128", "complex32", "qint8", "meta"],
)
def test_tensors_without_stored_bytes_or_dtype_name_are_refused(
    make: Callable[[], torch.Tensor],
) -> None:
    with pytest.raises(TypeError):
        tensor_to_raw(make())


# ---- replay_step: the real state is untouched ---------------------------------------------


def _bits(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    raw = tensor_to_raw(tensor)
    return raw.dtype, raw.shape, raw.data


def snapshot(model: nn.Module, optimizer: Any, scaler: Any = None) -> dict[str, Any]:
    """Every bit of the real run's state a replay could disturb."""
    state: dict[str, Any] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        state[f"state/{name}"] = (id(value), _bits(value))
    for name, param in model.named_parameters():
        state[f"grad/{name}"] = None if param.grad is None else _bits(param.grad)
    state["training"] = [m.training for m in model.modules()]
    saved = optimizer.state_dict()
    for index, entries in saved["state"].items():
        for key, value in entries.items():
            state[f"opt/{index}/{key}"] = _bits(value) if torch.is_tensor(value) else repr(value)
    state["opt/groups"] = repr(saved["param_groups"])
    state["opt/params"] = [id(p) for g in optimizer.param_groups for p in g["params"]]
    if scaler is not None:
        state["scaler"] = repr(scaler.state_dict())
        state["scaler/_scale"] = None if scaler._scale is None else _bits(scaler._scale)
        tracker = scaler._growth_tracker
        state["scaler/_growth_tracker"] = None if tracker is None else _bits(tracker)
        state["scaler/per_optimizer"] = repr(dict(scaler._per_optimizer_states))
    state["rng"] = _bits(torch.get_rng_state())
    return state


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.25)
        )
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def xent(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def xent_fp16(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def make_batch(seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(6, 8, generator=g) * scale,
        "y": torch.randint(0, 4, (6,), generator=g),
    }


def trained(
    optimizer_class: Callable[..., Any] = torch.optim.AdamW, scaler: Any = None
) -> tuple[Net, Any]:
    """A model and optimizer after two real steps, so the optimizer has state and
    the parameters have gradients left from the last step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    for step in range(2):
        loss = (xent_fp16 if scaler else xent)(model, make_batch(step))
        optimizer.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
    return model, optimizer


def decision(bundle: Path) -> tuple[int, str | None]:
    report = check_bundle(bundle)
    return report.exit_code, report.decision.earliest_nonfinite_stage


def manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / "manifest.json").read_bytes())


def captured(w: BundleWriter, bundle: Path | None = None) -> dict[str, bytes]:
    """The tensor bytes a writer holds, or (a streaming one's) those it wrote to ``bundle``."""
    if bundle is None:
        return {c.name: c.tensor.data for c in w._tensors}
    data = (bundle / "tensors.safetensors").read_bytes()
    start = 8 + struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:start])
    offsets = {name: entry["data_offsets"] for name, entry in header.items()}
    return {
        c.name: data[start + offsets[c.name][0] : start + offsets[c.name][1]] for c in w._tensors
    }


SCENARIOS = {
    "finite-adamw": (torch.optim.AdamW, False, make_batch(5), xent, (0, None)),
    "finite-sgd-momentum": (
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
        False,
        make_batch(5),
        xent,
        (0, None),
    ),
    "nan-input-no-scaler": (
        torch.optim.AdamW,
        False,
        {**make_batch(5), "x": make_batch(5)["x"].index_fill(0, torch.tensor([1]), float("nan"))},
        xent,
        (1, "input"),
    ),
    "finite-scaler": (torch.optim.AdamW, True, make_batch(5), xent_fp16, (0, None)),
    "fp16-forward-overflow-scaler": (
        torch.optim.AdamW,
        True,
        make_batch(5, scale=1e5),
        xent_fp16,
        (1, "forward"),
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_real_state_is_bit_identical_after_replay(scenario: str, tmp_path: Path) -> None:
    optimizer_class, with_scaler, batch, loss_fn, expected = SCENARIOS[scenario]
    scaler = torch.amp.GradScaler("cpu") if with_scaler else None
    model, optimizer = trained(optimizer_class, scaler)
    batch_before = {k: _bits(v) for k, v in batch.items()}
    before = snapshot(model, optimizer, scaler)
    w = replay_step(
        model, optimizer, batch, loss_fn, scaler=scaler, target=tmp_path / "b", **IDENTITY
    )
    assert snapshot(model, optimizer, scaler) == before
    assert {k: _bits(v) for k, v in batch.items()} == batch_before
    assert decision(tmp_path / "b") == expected
    assert w.recorded == ("input", "forward", "loss", "backward", "optimizer")


def test_replay_reproduces_the_real_step_exactly(tmp_path: Path) -> None:
    """Activations (dropout masks included, from the RNG snapshot), loss, gradients and
    the update the replay captures are, bit for bit, what the real step then does."""
    model, optimizer = trained()
    batch = make_batch(7)
    rng = torch.get_rng_state()
    w = replay_step(model, optimizer, batch, xent, rng_state=rng, **IDENTITY)
    data = captured(w)

    torch.set_rng_state(rng)
    activations: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(
            lambda m, i, o, p=path: activations.__setitem__(p, o.detach().clone())
        )
        for path, m in model.named_modules()
        if not list(m.children())
    ]
    loss = xent(model, batch)
    for hook in hooks:
        hook.remove()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()

    assert list(activations) == ["body.0", "body.1", "body.2", "body.3", "head"]
    assert [n for n in data if n.startswith("act/")] == [f"act/{p}" for p in activations]
    for path, value in activations.items():
        assert data[f"act/{path}"] == tensor_to_raw(value).data, path
    assert data["loss"] == tensor_to_raw(loss).data
    for name, grad in grads.items():
        assert data[f"grad/{name}"] == tensor_to_raw(grad).data, name
    for name, param in model.named_parameters():
        assert data[f"update/{name}"] == tensor_to_raw(param.detach() - before[name]).data, name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert data[f"opt/{name}/{key}"] == tensor_to_raw(optimizer.state[param][key]).data


# ---- replay_step: stages, NOT_RUN and loss-scale evidence ---------------------------------


def test_nan_loss_without_scaler_stops_before_backward(tmp_path: Path) -> None:
    model, optimizer = trained()

    def log_of_zero(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        p = torch.softmax(model(batch["x"]), dim=1) * 0  # a zero probability, for real
        return -torch.log(p[:, 0]).mean()

    replay_step(model, optimizer, make_batch(), log_of_zero, target=tmp_path / "b", **IDENTITY)
    assert decision(tmp_path / "b") == (1, "loss")
    stages = manifest(tmp_path / "b")["stages"]
    assert [s["status"] for s in stages] == ["OBSERVED"] * 3 + ["NOT_RUN"] * 2
    assert "no GradScaler" in stages[3]["reason"] and stages[3]["gradients"] == "unscaled"
    assert stages[2]["counts"]["posinf"] == 1
    assert manifest(tmp_path / "b")["binding"]["scaler"] == {
        "id": "no-loss-scaling",
        "mode": "none",
        "scale": 1,
    }


def test_fp16_forward_overflow_with_dynamic_scaler(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu")
    model, optimizer = trained(scaler=scaler)
    scale = scaler.get_scale()
    replay_step(
        model,
        optimizer,
        make_batch(3, scale=1e5),
        xent_fp16,
        scaler=scaler,
        target=tmp_path / "b",
        **IDENTITY,
    )
    report = check_bundle(tmp_path / "b")
    assert (report.exit_code, report.decision.earliest_nonfinite_stage) == (1, "forward")
    assert report.decision.first_nonfinite_tensor == "act/body.0"
    document = manifest(tmp_path / "b")
    assert document["binding"]["scaler"] == {
        "id": "torch.amp.GradScaler",
        "mode": "dynamic",
        "scale": scale,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "found_inf": True,
        "step_skipped": True,
        "scale_after": scale * 0.5,
        "growth_interval": 2000,
    }
    assert document["binding"]["precision"] == {
        "id": "params-F32.compute-F16",
        "param_dtype": "F32",
        "compute_dtype": "F16",
    }
    optimizer_stage = document["stages"][4]
    assert optimizer_stage["status"] == "NOT_RUN" and "skipped" in optimizer_stage["reason"]
    assert scaler.get_scale() == scale  # the real scaler did not back off


def test_backward_overflow_found_by_the_scaler(tmp_path: Path) -> None:
    """Finite loss, gradients that overflow fp16 only once scaled by 2^24."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    model, optimizer = trained()
    replay_step(
        model, optimizer, make_batch(4), xent_fp16, scaler=scaler, target=tmp_path / "b", **IDENTITY
    )
    report = check_bundle(tmp_path / "b")
    assert (report.exit_code, report.decision.earliest_nonfinite_stage) == (1, "backward")
    scaler_fields = manifest(tmp_path / "b")["binding"]["scaler"]
    assert (scaler_fields["scale"], scaler_fields["found_inf"], scaler_fields["scale_after"]) == (
        2.0**24,
        True,
        2.0**23,
    )
    backward = manifest(tmp_path / "b")["stages"][3]
    assert (
        backward["gradients"] == "unscaled" and "unscale_" in backward["tensor_set"]["probe_source"]
    )


def test_scaled_gradients_are_the_unscaled_ones_times_the_scale(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    model, optimizer = trained()
    batch = make_batch(9)
    rng = torch.get_rng_state()
    unscaled = replay_step(
        model, optimizer, batch, xent_fp16, scaler=scaler, rng_state=rng, **IDENTITY
    )
    scaled = replay_step(
        model,
        optimizer,
        batch,
        xent_fp16,
        scaler=scaler,
        gradients="scaled",
        rng_state=rng,
        target=tmp_path / "b",
        **IDENTITY,
    )
    assert decision(tmp_path / "b") == (0, None)
    document = manifest(tmp_path / "b")
    assert document["stages"][3]["gradients"] == "scaled"
    # growth_interval=1: a finite step grows the scale at once.
    assert (
        document["binding"]["scaler"]["found_inf"],
        document["binding"]["scaler"]["scale_after"],
    ) == (
        False,
        512.0,
    )
    ones, twos = captured(unscaled), captured(scaled, tmp_path / "b")
    for name in (n for n in ones if n.startswith("grad/")):
        a = np.frombuffer(ones[name], "<f4")
        b = np.frombuffer(twos[name], "<f4")
        assert np.array_equal(a * 256, b), name


def test_arguments_that_cannot_give_a_true_bundle_are_refused() -> None:
    model, optimizer = trained()
    batch = make_batch()
    partial = {k: v for k, v in IDENTITY.items() if k != "binding"}
    with pytest.raises(ValueError, match="binding needs scheduler"):
        replay_step(
            model,
            optimizer,
            batch,
            xent,
            binding={k: v for k, v in BINDING.items() if k != "scheduler"},
            **partial,
        )
    with pytest.raises(ValueError, match="needs an enabled GradScaler"):
        replay_step(model, optimizer, batch, xent, gradients="scaled", **IDENTITY)
    with pytest.raises(ValueError, match="not both"):
        replay_step(
            model, optimizer, batch, xent, seed=1, rng_state=torch.get_rng_state(), **IDENTITY
        )
    stranger = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match="not in the model"):
        replay_step(model, stranger, batch, xent, **IDENTITY)
    with pytest.raises(ValueError, match="no tensor"):
        replay_step(model, optimizer, {"ids": [1, 2]}, xent, **IDENTITY)
    with pytest.raises(ValueError, match="needs a scalar loss"):
        replay_step(model, optimizer, batch, lambda m, b: m(b["x"]).sum(1), **IDENTITY)


# ---- replay_step: bindings --------------------------------------------------------------


def test_model_and_batch_ids_are_content_digests() -> None:
    model, optimizer = trained()
    first = replay_step(model, optimizer, make_batch(1), xent, seed=3, **IDENTITY).binding
    again = replay_step(model, optimizer, make_batch(1), xent, seed=3, **IDENTITY).binding
    other_batch = replay_step(model, optimizer, make_batch(2), xent, seed=3, **IDENTITY).binding
    assert first["model"]["id"].startswith("model@sha256:") and len(first["model"]["id"]) == 13 + 64
    assert first["batch"]["id"].startswith("batch@sha256:")
    assert (first["model"], first["batch"], first["random_state"]) == (
        again["model"],
        again["batch"],
        again["random_state"],
    )
    assert other_batch["batch"]["id"] != first["batch"]["id"]
    assert other_batch["model"] == first["model"]
    with torch.no_grad():
        model.head.bias[0] += 1
    changed = replay_step(model, optimizer, make_batch(1), xent, seed=3, **IDENTITY).binding
    assert changed["model"]["id"] != first["model"]["id"]
    assert first["random_state"]["seed"] == "3"
    assert first["topology"] == {"id": "single-process", "world_size": 1, "rank": 0}
    assert first["environment"]["torch"] == torch.__version__
    assert list(first) == [
        "model",
        "checkpoint",
        "data",
        "batch",
        "loader_cursor",
        "objective",
        "optimizer",
        "scheduler",
        "scaler",
        "random_state",
        "environment",
        "topology",
        "precision",
    ]


def test_given_binding_items_replace_derived_ones(tmp_path: Path) -> None:
    model, optimizer = trained()
    binding = {
        **BINDING,
        "model": {"id": "registry:tiny-net/v3"},
        "environment": {"id": "image-2026-11"},
    }
    replay_step(
        model,
        optimizer,
        make_batch(),
        xent,
        target=tmp_path / "b",
        **{**IDENTITY, "binding": binding},
    )
    document = manifest(tmp_path / "b")
    assert document["binding"]["model"] == {"id": "registry:tiny-net/v3"}
    assert document["binding"]["environment"] == {"id": "image-2026-11"}
    check_bundle(tmp_path / "b")


def test_topology_from_an_initialised_process_group(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, optimizer = trained()
        w = replay_step(model, optimizer, make_batch(), xent, target=tmp_path / "b", **IDENTITY)
    finally:
        dist.destroy_process_group()
    assert w.binding["topology"] == {
        "id": "world-1.rank-0",
        "world_size": 1,
        "rank": 0,
        "backend": "gloo",
    }
    check_bundle(tmp_path / "b")


# ---- replay_step: what the forward captures ----------------------------------------------


class Shared(nn.Module):
    """One layer called twice, and an output that is a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.split = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer(torch.relu(self.layer(x)))
        a, b = self.split((h[:, :2], h[:, 2:]))
        return (a - b).sum(1)


def test_repeated_calls_tuple_outputs_and_module_choice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Shared()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(3, 4), torch.randn(3))

    def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    w = replay_step(model, optimizer, batch, mse, target=tmp_path / "b", **IDENTITY)
    names = [c.name for c in w._tensors]
    assert names[:2] == ["batch/0", "batch/1"]
    assert [n for n in names if n.startswith("act/")] == [
        "act/layer",
        "act/layer@call2",
        "act/split/0",
        "act/split/1",
    ]
    assert [n for n in names if n.startswith("update/")] == [
        "update/layer.weight",
        "update/layer.bias",
    ]
    assert decision(tmp_path / "b") == (0, None)

    only = replay_step(
        model,
        optimizer,
        batch[0],
        lambda m, x: m(x).sum(),
        modules=lambda p, m: p == "split",
        **IDENTITY,
    )
    assert [c.name for c in only._tensors if c.name.startswith(("act/", "batch"))] == [
        "batch",
        "act/split/0",
        "act/split/1",
    ]
