"""Sharded tensors seen locally: under FSDP2 a parameter or gradient is a
DTensor, and each rank checks, copies and snapshots its own shard. Below every
feature that meets one (the sentinel's snapshot and FSDP2 hooks, the recovery
point and the sharded replay), so none of them imports another for it."""

from __future__ import annotations

from typing import Any

__all__ = ["is_dtensor", "local", "local_view"]


def is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local(tensor: Any) -> Any:
    """A DTensor's local shard (the tensor FSDP2 holds, no collective); any other
    tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_view(tensors: list[Any]) -> list[Any]:
    return [local(t) for t in tensors]
