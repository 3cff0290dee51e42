"""A held step's micro-batches, random states and autocast regions as a capsule
holds them: tensors in the DCP state (``batch/mb<i>/t<j>``), everything else in
JSON through the state directory's exact encoding. No leaf is pickled: a leaf
that is neither a tensor, a container nor a plain value is refused, named."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nanrunbook.capture.torch._faithfulness import HostRandom
from nanrunbook.capture.torch._state_dir import decode_value, encode_value
from nanrunbook.capture.torch.replay import Autocast, MicroBatch, RngState

__all__ = [
    "CapsuleRefused",
    "decode_micro_batches",
    "encode_micro_batches",
    "micro_batch_template",
]


class CapsuleRefused(ValueError):
    """What the held step holds cannot be recorded exactly: no capsule is written."""


_PLAIN = (type(None), bool, int, float, str)


def _structure(value: Any, where: str, tensors: dict[str, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach()
        return {
            "tensor": name,
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "device": str(value.device),
        }
    if type(value) in (dict, OrderedDict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise CapsuleRefused(f"{where}: a {type(key).__name__} key cannot be recorded")
            items.append([key, _structure(item, f"{where}[{key!r}]", tensors)])
        return {"dict": items}
    if type(value) in (list, tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_structure(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if type(value) in _PLAIN:
        return {"value": encode_value(value, where)}
    raise CapsuleRefused(
        f"{where}: a {type(value).__name__} is neither a tensor, a dict, list or tuple, nor a"
        " plain value: the capsule would have to pickle it"
    )


def _rng(state: RngState | None) -> Any:
    if state is None:
        return None
    host = state.host
    return {
        "cpu": encode_value(state.cpu),
        "cuda": [encode_value(s) for s in state.cuda],
        "numpy": None if host is None else encode_value(host.numpy),
        "python": None if host is None else encode_value(host.python),
        "generators": [] if host is None else [encode_value(s) for _, s in host.generators],
        "taken_live": bool(host is not None and host.taken_live),
        "host": host is not None,
    }


def encode_micro_batches(micro: Sequence[MicroBatch]) -> tuple[list[Any], dict[str, Any]]:
    """The JSON of the micro-batches and the DCP state of their tensors."""
    documents: list[Any] = []
    state: dict[str, Any] = {}
    for index, batch in enumerate(micro):
        tensors: dict[str, Any] = {}
        documents.append(
            {
                "batch": _structure(batch.batch, f"micro-batch {index}", tensors),
                "rng": _rng(batch.rng),
                "autocast": [
                    {
                        "device_type": region.device_type,
                        "dtype": str(region.dtype).removeprefix("torch."),
                        "cache_enabled": region.cache_enabled,
                    }
                    for region in batch.autocast
                ],
            }
        )
        if tensors:
            state[f"mb{index}"] = tensors
    return documents, state


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _walk_tensors(structure: Any) -> list[Mapping[str, Any]]:
    if not isinstance(structure, dict):
        raise ValueError("a batch node is not an object")
    if "tensor" in structure:
        return [structure]
    for kind in ("dict", "list", "tuple"):
        if kind in structure:
            items = structure[kind]
            children = [item[1] for item in items] if kind == "dict" else items
            return [leaf for child in children for leaf in _walk_tensors(child)]
    if "value" in structure:
        return []
    raise ValueError("a batch node is neither a tensor, a container nor a value")


def micro_batch_template(documents: Sequence[Any]) -> dict[str, Any]:
    """Empty CPU tensors of the recorded shapes and dtypes, for DCP to load into."""
    state: dict[str, Any] = {}
    for index, document in enumerate(documents):
        tensors = {
            str(leaf["tensor"]): torch.empty(
                [int(n) for n in leaf["shape"]], dtype=_dtype(leaf["dtype"])
            )
            for leaf in _walk_tensors(document["batch"])
        }
        if tensors:
            state[f"mb{index}"] = tensors
    return state


def _rebuild(structure: Any, tensors: Mapping[str, Any]) -> Any:
    if "tensor" in structure:
        tensor = tensors[str(structure["tensor"])]
        device = torch.device(str(structure["device"]))
        return tensor if device.type == "cpu" else tensor.to(device)
    if "dict" in structure:
        return {key: _rebuild(item, tensors) for key, item in structure["dict"]}
    if "list" in structure:
        return [_rebuild(item, tensors) for item in structure["list"]]
    if "tuple" in structure:
        return tuple(_rebuild(item, tensors) for item in structure["tuple"])
    return decode_value(structure["value"])


def _rng_state(document: Any, generators: Sequence[Any]) -> RngState | None:
    if document is None:
        return None
    host = None
    if document["host"]:
        states = [decode_value(s) for s in document["generators"]]
        host = HostRandom(
            decode_value(document["numpy"]),
            decode_value(document["python"]),
            tuple(zip(generators, states, strict=True)),
            bool(document["taken_live"]),
        )
    return RngState(
        decode_value(document["cpu"]),
        tuple(decode_value(s) for s in document["cuda"]),
        host,
    )


def decode_micro_batches(
    documents: Sequence[Any], state: Mapping[str, Any], generators: Sequence[Any]
) -> tuple[MicroBatch, ...]:
    """The micro-batches as the live step was given them, from loaded ``state``."""
    micro = []
    for index, document in enumerate(documents):
        batch = _rebuild(document["batch"], state.get(f"mb{index}", {}))
        regions = tuple(
            Autocast(str(r["device_type"]), _dtype(r["dtype"]), bool(r["cache_enabled"]))
            for r in document["autocast"]
        )
        micro.append(MicroBatch(batch, _rng_state(document["rng"], generators), regions))
    return tuple(micro)


def generator_count(documents: Sequence[Any]) -> int:
    """How many of the loop's own generators the step's random state holds."""
    counts = {len(d["rng"]["generators"]) for d in documents if d["rng"] is not None}
    return max(counts, default=0)
