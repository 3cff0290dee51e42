"""Binding items derived from what a torch training process can see: content
digests of the model and batch, the optimizer, scheduler, RNG, environment,
topology and precision. The loop supplies only what it alone knows."""

from __future__ import annotations

import hashlib
import math
import os
import platform
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from nanrunbook.capture.torch._convert import safetensors_dtype, tensor_bytes, tensor_to_raw

__all__ = [
    "add_weight",
    "batch_binding",
    "cuda_devices",
    "digest_tensors",
    "environment_binding",
    "heaviest",
    "identifier",
    "model_binding",
    "model_item",
    "optimizer_binding",
    "precision_binding",
    "random_state_binding",
    "scheduler_binding",
    "topology_binding",
]

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:@/+=-]")


def identifier(text: str) -> str:
    """``text`` as a contract identifier: unsafe characters become '-'."""
    cleaned = _ID_UNSAFE.sub("-", text)[:256]
    return cleaned if cleaned[:1].isalnum() else f"x{cleaned}"[:256]


def _tensor_digest(item: tuple[str, Any]) -> bytes:
    name, tensor = item
    dtype, shape, data = tensor_bytes(tensor)
    digest = hashlib.sha256(f"{name}\0{dtype}\0{list(shape)}\0{len(data)}\0".encode())
    digest.update(data)
    return digest.digest()


def digest_tensors(named: Iterable[tuple[str, Any]]) -> str:
    """SHA-256 over each named tensor's digest (name, dtype, shape, bytes), in
    order; the tensors are hashed on one thread per core (hashlib releases the
    GIL), reading their memory in place where it holds the stored bytes."""
    items = list(named)
    total = sum(t.numel() * t.element_size() for _, t in items if isinstance(t, torch.Tensor))
    if len(items) > 1 and total >= 8 << 20:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1)) as pool:
            parts = list(pool.map(_tensor_digest, items))
    else:
        parts = [_tensor_digest(item) for item in items]
    return hashlib.sha256(b"".join(parts)).hexdigest()


def add_weight(weights: dict[str, int], tensor: Any) -> None:
    """Count a floating tensor's elements under its safetensors dtype name."""
    if tensor.is_floating_point():
        name = safetensors_dtype(tensor.dtype)
        if name is not None:
            weights[name] = weights.get(name, 0) + tensor.numel()


def heaviest(weights: Mapping[str, int]) -> str | None:
    return max(weights, key=lambda k: weights[k]) if weights else None


def model_binding(state: Iterator[tuple[str, Any]], model: Any, extra: int = 0) -> dict[str, Any]:
    """``state``: the (name, tensor) pairs the digest covers."""
    return {
        "id": "model@sha256:" + digest_tensors(state),
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()) + extra,
    }


def model_item(model: Any, optimizer: Any) -> dict[str, Any]:
    """The model item of a step: its digest covers the parameters the optimizer
    holds outside the model too (``outside/group<g>.param<i>``)."""
    inside = {id(p) for p in model.parameters()}
    outside = [
        (f"outside/group{g}.param{i}", p)
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in inside
    ]
    state = [*model.state_dict().items(), *outside]
    return model_binding(iter(state), model, sum(p.numel() for _, p in outside))


def batch_binding(tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    if not tensors:
        raise ValueError("the batch holds no tensor")
    fields: dict[str, Any] = {
        "id": "batch@sha256:" + digest_tensors(tensors),
        "tensors": len(tensors),
    }
    if tensors[0][1].dim() > 0:
        fields["size"] = int(tensors[0][1].shape[0])
    return fields


def environment_binding() -> dict[str, Any]:
    python = platform.python_version()
    cuda = torch.version.cuda or "none"
    return {
        "id": identifier(
            f"torch-{torch.__version__}.python-{python}.{sys.platform}-{platform.machine()}"
        ),
        "torch": str(torch.__version__),
        "python": python,
        "platform": platform.platform(),
        "cuda": str(cuda),
    }


def topology_binding() -> dict[str, Any]:
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


def cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return list(range(torch.cuda.device_count()))
    return []


def random_state_binding(seed: int | None) -> dict[str, Any]:
    """The RNG state the step runs on (call it with that state set)."""
    digest = hashlib.sha256(tensor_to_raw(torch.get_rng_state()).data)
    for device in cuda_devices():
        digest.update(tensor_to_raw(torch.cuda.get_rng_state(device)).data)
    fields: dict[str, Any] = {
        "id": f"torch-rng@sha256:{digest.hexdigest()}",
        "initial_seed": str(torch.initial_seed()),
    }
    if seed is not None:
        fields["seed"] = str(seed)
    return fields


def _state_digest(state: Mapping[str, Any]) -> str:
    """A digest of a state_dict's tensors and plain values, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state, key=str):
        value = state[key]
        if isinstance(value, torch.Tensor):
            digest.update(digest_tensors([(str(key), value)]).encode())
        elif isinstance(value, Mapping):
            digest.update(f"{key}={{{_state_digest(value)}}}\0".encode())
        else:
            digest.update(f"{key}={value!r}\0".encode())
    return digest.hexdigest()


def optimizer_binding(optimizer: Any) -> dict[str, Any]:
    state = optimizer.state_dict()
    digest = hashlib.sha256()
    for index, group in enumerate(state["param_groups"]):
        hyper = {k: repr(v) for k, v in sorted(group.items()) if k != "params"}
        digest.update(f"group {index} {hyper!r} {group['params']!r}\0".encode())
    tensors = []
    for key in sorted(state["state"]):
        for name, value in sorted(state["state"][key].items()):
            if isinstance(value, torch.Tensor):
                tensors.append((f"{key}/{name}", value))
            else:
                digest.update(f"{key}/{name}={value!r}\0".encode())
    digest.update(digest_tensors(tensors).encode())
    fields: dict[str, Any] = {
        "id": f"{identifier(type(optimizer).__name__)}@sha256:{digest.hexdigest()}",
        "class": type(optimizer).__name__,
        "param_groups": len(optimizer.param_groups),
    }
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    if isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr):
        fields["lr"] = float(lr)
    return fields


def scheduler_binding(scheduler: Any) -> dict[str, Any]:
    """A learning-rate scheduler by class and a digest of its state_dict; a loop
    without one is bound as ``constant-lr``."""
    if scheduler is None:
        return {"id": "constant-lr", "class": "none"}
    state = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    fields: dict[str, Any] = {
        "id": f"{identifier(type(scheduler).__name__)}@sha256:{_state_digest(state)}",
        "class": type(scheduler).__name__,
    }
    last_epoch = state.get("last_epoch")
    if isinstance(last_epoch, int) and not isinstance(last_epoch, bool):
        fields["last_epoch"] = last_epoch
    return fields


def precision_binding(params: Iterable[Any], activations: Mapping[str, int]) -> dict[str, Any]:
    """Parameter dtype and compute dtype, each the one holding the most elements."""
    weights: dict[str, int] = {}
    for param in params:
        add_weight(weights, param)
    param_dtype = heaviest(weights) or "F32"
    compute_dtype = heaviest(activations) or param_dtype
    return {
        "id": f"params-{param_dtype}.compute-{compute_dtype}",
        "param_dtype": param_dtype,
        "compute_dtype": compute_dtype,
    }
