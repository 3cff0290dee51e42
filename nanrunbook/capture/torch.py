"""PyTorch capture: tensors as safetensors bytes, and a replay of one step on copies.

Needs the optional extra ``nanrunbook[torch]``; torch is imported only here.

* :func:`tensor_to_raw` turns a tensor of any device and any dtype safetensors
  names (bool, integers, F16/BF16/F32/F64, C64, the float8 variants and packed
  ``float4_e2m1fn_x2``) into :class:`~nanrunbook.tensors.safetensors_write.RawTensor` bytes.
* :func:`replay_step` runs one training step on deep copies of the model, the
  optimizer and the GradScaler, so the real run's state is untouched ("reproduce
  without an update"), and captures its five boundaries into a
  :class:`~nanrunbook.capture.BundleWriter`.
"""

from __future__ import annotations

import copy
import hashlib
import math
import platform
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture.writer import BundleWriter
from nanrunbook.dtypes import TORCH_DTYPES
from nanrunbook.manifest.parse import BINDING_ITEMS
from nanrunbook.tensors.safetensors_write import RawTensor

__all__ = ["TORCH_DTYPES", "replay_step", "tensor_to_raw"]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_raw(tensor: Any) -> RawTensor:
    """A tensor's stored bits, little-endian, as safetensors holds them.

    The tensor is detached and copied to host memory (CUDA and other devices
    included); conjugate and negative views are resolved, sparse tensors made
    dense, non-contiguous ones packed. A ``float4_e2m1fn_x2`` tensor of shape
    ``(..., n)`` holds ``2n`` F4 elements and is stored as F4 of shape
    ``(..., 2n)`` (a 0-dim one as ``(2,)``). Raises TypeError for a dtype
    safetensors has no name for (complex128, quantized...) or a tensor without
    data (meta device).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    name = _dtype_name(tensor.dtype)
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        raise TypeError(f"no safetensors dtype for torch dtype {name!r}")
    if tensor.device.type == "meta":
        raise TypeError("a meta tensor has no data to capture")
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().to("cpu").contiguous()
    shape = tuple(int(d) for d in t.shape)
    if dtype == "F4":
        shape = (*shape[:-1], 2 * shape[-1]) if shape else (2,)
    # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes of another width.
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if sys.byteorder == "big" and t.element_size() > 1:
        import numpy as np

        unit = 4 if dtype == "C64" else t.element_size()
        data = np.frombuffer(data, dtype=f">u{unit}").astype(f"<u{unit}").tobytes()
    return RawTensor(dtype, shape, data)


# ----------------------------------------------------------------------- replay

_REQUIRED_BINDING = ("checkpoint", "data", "loader_cursor", "objective", "scheduler")
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:@/+=-]")


def _identifier(text: str) -> str:
    """``text`` as a contract identifier: unsafe characters become '-'."""
    cleaned = _ID_UNSAFE.sub("-", text)[:256]
    return cleaned if cleaned[:1].isalnum() else f"x{cleaned}"[:256]


def _digest_tensors(named: Iterator[tuple[str, Any]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        raw = tensor_to_raw(tensor)
        digest.update(f"{name}\0{raw.dtype}\0{list(raw.shape)}\0{len(raw.data)}\0".encode())
        digest.update(raw.data)
    return digest.hexdigest()


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of a nested batch or module output, in order."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _flatten(item, f"{prefix}/{index}" if prefix else str(index))


def _clone(value: Any) -> Any:
    """A copy of a nested batch: tensors detached and cloned, containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        items = {k: _clone(v) for k, v in value.items()}
        try:
            return type(value)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_clone(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _copy_optimizer(
    optimizer: Any,
    model: Any,
    model_copy: Any,
    factory: Callable[[list[dict[str, Any]]], Any] | None,
) -> Any:
    """The optimizer rebuilt on the copy's parameters, its state loaded from a
    deep copy of the real one's state_dict (never sharing a tensor with it)."""
    mapping = {id(p): q for p, q in zip(model.parameters(), model_copy.parameters(), strict=True)}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            if id(param) not in mapping:
                raise ValueError("the optimizer holds a parameter that is not in the model")
            params.append(mapping[id(param)])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if factory is not None:
        rebuilt = factory(groups)
    else:
        try:
            rebuilt = type(optimizer)(groups)
        except TypeError:
            rebuilt = type(optimizer)(groups, **optimizer.defaults)
        rebuilt.defaults = copy.deepcopy(optimizer.defaults)
    rebuilt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return rebuilt


def _copy_scaler(scaler: Any) -> Any:
    if scaler is None or not scaler.is_enabled():
        return None
    rebuilt = torch.amp.GradScaler(
        getattr(scaler, "_device", "cuda"),
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
    )
    rebuilt.load_state_dict(copy.deepcopy(scaler.state_dict()))
    return rebuilt


def _add_weight(weights: dict[str, int], tensor: Any) -> None:
    """Count a floating tensor's elements under its safetensors dtype name."""
    if tensor.is_floating_point():
        name = TORCH_DTYPES.get(_dtype_name(tensor.dtype))
        if name is not None:
            weights[name] = weights.get(name, 0) + tensor.numel()


def _heaviest(weights: Mapping[str, int]) -> str | None:
    return max(weights, key=lambda k: weights[k]) if weights else None


def _environment() -> dict[str, Any]:
    python = platform.python_version()
    cuda = torch.version.cuda or "none"
    return {
        "id": _identifier(
            f"torch-{torch.__version__}.python-{python}.{sys.platform}-{platform.machine()}"
        ),
        "torch": str(torch.__version__),
        "python": python,
        "platform": platform.platform(),
        "cuda": str(cuda),
    }


def _topology() -> dict[str, Any]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        return {
            "id": f"world-{world}.rank-{rank}",
            "world_size": world,
            "rank": rank,
            "backend": str(dist.get_backend()),
        }
    return {"id": "single-process", "world_size": 1, "rank": 0}


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return list(range(torch.cuda.device_count()))
    return []


def _random_state(seed: int | None) -> dict[str, Any]:
    digest = hashlib.sha256(tensor_to_raw(torch.get_rng_state()).data)
    for device in _cuda_devices():
        digest.update(tensor_to_raw(torch.cuda.get_rng_state(device)).data)
    fields: dict[str, Any] = {
        "id": f"torch-rng@sha256:{digest.hexdigest()}",
        "initial_seed": str(torch.initial_seed()),
    }
    if seed is not None:
        fields["seed"] = str(seed)
    return fields


def _optimizer_binding(optimizer: Any) -> dict[str, Any]:
    state = optimizer.state_dict()
    digest = hashlib.sha256()
    for index, group in enumerate(state["param_groups"]):
        hyper = {k: repr(v) for k, v in sorted(group.items()) if k != "params"}
        digest.update(f"group {index} {hyper!r} {group['params']!r}\0".encode())
    for key in sorted(state["state"]):
        for name, value in sorted(state["state"][key].items()):
            if isinstance(value, torch.Tensor):
                digest.update(_digest_tensors(iter([(f"{key}/{name}", value)])).encode())
            else:
                digest.update(f"{key}/{name}={value!r}\0".encode())
    fields: dict[str, Any] = {
        "id": f"{_identifier(type(optimizer).__name__)}@sha256:{digest.hexdigest()}",
        "class": type(optimizer).__name__,
        "param_groups": len(optimizer.param_groups),
    }
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr):
        fields["lr"] = float(lr)
    return fields


class _Activations:
    """Forward hooks on the chosen modules: outputs as host bytes, in execution order."""

    def __init__(self, model: Any, choose: Callable[[str, Any], bool]) -> None:
        self.captured: list[tuple[str, Any, str]] = []
        self.weights: dict[str, int] = {}  # floating elements per dtype
        self._calls: dict[str, int] = {}
        self._handles = [
            module.register_forward_hook(self._hook(path))
            for path, module in model.named_modules()
            if choose(path, module)
        ]

    def _hook(self, path: str) -> Callable[[Any, Any, Any], None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            calls = self._calls[path] = self._calls.get(path, 0) + 1
            base = f"act/{path or '(root)'}" + (f"@call{calls}" if calls > 1 else "")
            probe = f"{path or '(root)'} output ({type(module).__name__})"
            for suffix, tensor in _flatten(output, ""):
                name = f"{base}/{suffix}" if suffix else base
                # Bytes now: an in-place op later in the forward must not alter them.
                self.captured.append((name, tensor_to_raw(tensor), probe))
                _add_weight(self.weights, tensor)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _leaf(path: str, module: Any) -> bool:
    return next(iter(module.children()), None) is None


def replay_step(
    model: Any,
    optimizer: Any,
    batch: Any,
    compute_loss: Callable[[Any, Any], Any],
    *,
    run_id: str,
    step: int,
    incident_owner: str,
    last_known_good: Mapping[str, Any],
    binding: Mapping[str, Mapping[str, Any]],
    scaler: Any = None,
    gradients: str = "unscaled",
    owners: Mapping[str, str] | None = None,
    seed: int | None = None,
    rng_state: Any = None,
    modules: Callable[[str, Any], bool] | None = None,
    optimizer_factory: Callable[[list[dict[str, Any]]], Any] | None = None,
    target: str | Path | None = None,
    overwrite: bool = False,
) -> BundleWriter:
    """Replay one training step on copies and capture its five boundaries.

    ``compute_loss(model, batch)`` runs the forward and returns the loss, as the
    training loop does (autocast included, if the loop uses it); it is called
    with a deep copy of ``model`` and a clone of ``batch`` (a tensor, or a
    mapping/sequence of them). The optimizer is rebuilt on the copy's
    parameters and loaded from a deep copy of its state_dict (or built by
    ``optimizer_factory(param_groups)``), and ``scaler`` (a
    ``torch.amp.GradScaler``, optional) is rebuilt from its state_dict, so the
    real model, optimizer, scaler, gradients and global RNG state are left
    bit-identical. The copy's gradients start from None.

    Captured: input (the batch tensors), forward (outputs of ``modules`` --
    default: every leaf module -- named ``act/<module path>``, in execution
    order), loss, backward (``grad/<param>`` of the optimizer's parameters,
    after ``scaler.unscale_``, or before it when ``gradients="scaled"``) and
    optimizer (``opt/<param>/<state key>`` after ``step()``, and
    ``update/<param>``, the parameter after the step minus before, in float32
    for lower-precision parameters). When the loss is non-finite and no enabled
    scaler guards the step, backward and optimizer are NOT_RUN; when the scaler
    finds inf/NaN, the optimizer stage is NOT_RUN (the step is skipped).

    ``binding`` must give ``checkpoint``, ``data``, ``loader_cursor``,
    ``objective`` (with ``reduction``) and ``scheduler``; the others are derived
    (model and batch ids are SHA-256 digests of the state_dict and batch bytes,
    the scaler item is the loss-scale evidence) and any given item replaces the
    derived one. ``seed`` or ``rng_state`` (a ``torch.get_rng_state()``
    snapshot) sets the RNG the replay runs on; by default it runs on a fork of
    the current state.

    Returns the BundleWriter; with ``target`` the bundle is also written there
    (see :meth:`BundleWriter.write`).
    """
    missing = [name for name in _REQUIRED_BINDING if name not in binding]
    if missing:
        raise ValueError(f"binding needs {', '.join(missing)}: replay_step cannot derive them")
    if gradients not in ("unscaled", "scaled"):
        raise ValueError("gradients is 'unscaled' or 'scaled'")
    if seed is not None and rng_state is not None:
        raise ValueError("give seed or rng_state, not both")
    dynamic = scaler is not None and scaler.is_enabled()
    if gradients == "scaled" and not dynamic:
        raise ValueError("gradients='scaled' needs an enabled GradScaler")
    stage_owner = dict.fromkeys(
        ("input", "forward", "loss", "backward", "optimizer"), incident_owner
    )
    stage_owner.update(owners or {})

    derived: dict[str, dict[str, Any]] = {
        "model": {
            "id": "model@sha256:" + _digest_tensors(iter(model.state_dict().items())),
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "optimizer": _optimizer_binding(optimizer),
        "environment": _environment(),
        "topology": _topology(),
    }
    batch_tensors = list(_flatten(batch, ""))
    if not batch_tensors:
        raise ValueError("the batch holds no tensor")
    derived["batch"] = {
        "id": "batch@sha256:" + _digest_tensors(iter(batch_tensors)),
        "tensors": len(batch_tensors),
    }
    if batch_tensors[0][1].dim() > 0:
        derived["batch"]["size"] = int(batch_tensors[0][1].shape[0])

    with torch.random.fork_rng(devices=_cuda_devices()):
        if seed is not None:
            torch.manual_seed(seed)
        elif rng_state is not None:
            torch.set_rng_state(rng_state)
        derived["random_state"] = _random_state(seed)
        writer, scaler_fields, activation_weights = _run(
            model,
            optimizer,
            batch,
            compute_loss,
            scaler,
            gradients,
            stage_owner,
            modules or _leaf,
            optimizer_factory,
            run_id=run_id,
            step=step,
            incident_owner=incident_owner,
            last_known_good=last_known_good,
        )
    derived["scaler"] = scaler_fields
    param_weights: dict[str, int] = {}
    for param in model.parameters():
        _add_weight(param_weights, param)
    param_dtype = _heaviest(param_weights) or "F32"
    compute_dtype = _heaviest(activation_weights) or param_dtype
    derived["precision"] = {
        "id": f"params-{param_dtype}.compute-{compute_dtype}",
        "param_dtype": param_dtype,
        "compute_dtype": compute_dtype,
    }
    items = {**derived, **{name: dict(fields) for name, fields in binding.items()}}
    writer.binding = {
        **{name: items[name] for name in BINDING_ITEMS if name in items},
        **{name: value for name, value in items.items() if name not in BINDING_ITEMS},
    }
    if target is not None:
        writer.write(target, overwrite=overwrite)
    return writer


def _run(
    model: Any,
    optimizer: Any,
    batch: Any,
    compute_loss: Callable[[Any, Any], Any],
    scaler: Any,
    gradients: str,
    owner: Mapping[str, str],
    choose: Callable[[str, Any], bool],
    factory: Callable[[list[dict[str, Any]]], Any] | None,
    **identity: Any,
) -> tuple[BundleWriter, dict[str, Any], dict[str, int]]:
    """The step itself, on copies: returns the writer, the scaler evidence and the
    activations' floating elements per dtype (for the precision binding)."""
    model_copy = copy.deepcopy(model)
    optimizer_copy = _copy_optimizer(optimizer, model, model_copy, factory)
    scaler_copy = _copy_scaler(scaler)
    optimizer_copy.zero_grad(set_to_none=True)
    batch_copy = _clone(batch)
    names = {id(p): name for name, p in model_copy.named_parameters()}
    params = [p for group in optimizer_copy.param_groups for p in group["params"]]

    writer = BundleWriter(binding={}, **identity)
    writer.observe(
        "input",
        [
            (f"batch/{n}" if n else "batch", t, f"batch[{n!r}]" if n else "batch")
            for n, t in _flatten(batch_copy, "")
        ],
        owner=owner["input"],
        probe_source="replay_step: the batch as given, before compute_loss",
    )
    hooks = _Activations(model_copy, choose)
    try:
        loss = compute_loss(model_copy, batch_copy)
    finally:
        hooks.remove()
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"compute_loss returned a {type(loss).__name__}, not a tensor")
    if not hooks.captured:
        raise ValueError("no chosen module ran in the forward: nothing to capture")
    writer.observe(
        "forward",
        hooks.captured,
        owner=owner["forward"],
        probe_source="forward hooks on leaf modules, execution order (replay on a deep copy)",
    )
    loss_counts = writer.observe(
        "loss",
        [("loss", loss, "compute_loss(model, batch)")],
        owner=owner["loss"],
        probe_source="loss returned by compute_loss, before backward",
    )

    if scaler_copy is None:
        scaler_fields: dict[str, Any] = {"id": "no-loss-scaling", "mode": "none", "scale": 1}
        if loss_counts.nonfinite:
            reason = "the loss is non-finite and no GradScaler guards the step: backward not run"
            writer.not_run("backward", owner=owner["backward"], reason=reason, gradients="unscaled")
            writer.not_run("optimizer", owner=owner["optimizer"], reason=reason)
            return writer, scaler_fields, hooks.weights
    if loss.numel() != 1:
        raise ValueError(f"the loss has {loss.numel()} elements; backward needs a scalar loss")
    if scaler_copy is None:
        loss.backward()  # type: ignore[no-untyped-call]
        grad_source = "param.grad after loss.backward() on the copy (no loss scaling)"
    else:
        scale = scaler_copy.get_scale()
        scaler_copy.scale(loss).backward()
        grad_source = "param.grad after scaler.scale(loss).backward(), before unscale_"

    def grads() -> list[tuple[str, Any, str]]:
        # Bytes now: unscale_ rewrites the gradients in place.
        return [
            (f"grad/{names[id(p)]}", tensor_to_raw(p.grad), "param.grad")
            for p in params
            if p.grad is not None
        ]

    captured = grads() if gradients == "scaled" else []
    found_inf = False
    if scaler_copy is not None:
        scaler_copy.unscale_(optimizer_copy)
        per_device = scaler_copy._found_inf_per_device(optimizer_copy)
        found_inf = bool(sum(v.item() for v in per_device.values()))
        if gradients == "unscaled":
            captured = grads()
            grad_source = "param.grad after scaler.unscale_(optimizer) on the copy"
    else:
        captured = grads()
    if not captured:
        raise ValueError("no parameter of the optimizer received a gradient")
    writer.observe(
        "backward",
        captured,
        owner=owner["backward"],
        probe_source=grad_source,
        gradients=gradients,
    )

    before = [p.detach().clone() for p in params]
    if scaler_copy is not None:
        scaler_copy.step(optimizer_copy)
        scaler_copy.update()
        scaler_fields = {
            "id": "torch.amp.GradScaler",
            "mode": "dynamic",
            "scale": scale,
            "growth_factor": scaler_copy.get_growth_factor(),
            "backoff_factor": scaler_copy.get_backoff_factor(),
            "found_inf": found_inf,
            "step_skipped": found_inf,  # GradScaler.step skips optimizer.step exactly then
            "scale_after": scaler_copy.get_scale(),
            "growth_interval": scaler_copy.get_growth_interval(),
        }
        if found_inf:
            writer.not_run(
                "optimizer",
                owner=owner["optimizer"],
                reason="GradScaler found inf/NaN after unscale_ and skipped optimizer.step()",
            )
            return writer, scaler_fields, hooks.weights
    else:
        optimizer_copy.step()

    tensors: list[tuple[str, Any, str]] = []
    for p in params:
        for key, value in optimizer_copy.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors.append((f"opt/{names[id(p)]}/{key}", value, f"optimizer.state[p][{key!r}]"))
    for p, old in zip(params, before, strict=True):
        new = p.detach()
        if p.is_floating_point() and p.element_size() < 4:
            new, old = new.float(), old.float()
        tensors.append((f"update/{names[id(p)]}", new - old, "param after step() minus before"))
    writer.observe(
        "optimizer",
        tensors,
        owner=owner["optimizer"],
        probe_source="optimizer.step() on the copy: state after, and the update it applied",
    )
    return writer, scaler_fields, hooks.weights
