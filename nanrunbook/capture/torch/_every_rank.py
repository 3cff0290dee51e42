"""Every rank learns whether every rank got through a phase of a collective
write or load, so none waits in a collective another never reaches.

One ``all_gather_object`` per phase, bounded by the process group's own
timeout: a rank that raised sends its reason, a rank that died makes the
others' gather fail at the timeout, never hang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["RankFailed", "agree", "from_rank0", "gather"]


class RankFailed(RuntimeError):
    """Another rank failed a phase this rank got through: ``failures`` are
    ``(rank, reason)``; this rank stopped too, and nothing was published."""

    def __init__(self, what: str, failures: Sequence[tuple[int, str]]) -> None:
        self.failures = tuple(failures)
        named = "; ".join(f"rank {rank}: {reason}" for rank, reason in self.failures)
        super().__init__(f"{what} failed on another rank ({named}): nothing was written")


def _reason(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def gather(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (one collective)."""
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, value)
    return found


def agree(what: str, error: BaseException | None, value: Any = None) -> list[Any]:
    """One collective: raise ``error`` on the rank that had it and RankFailed on
    every other rank when any rank had one; else every rank's ``value``, in
    rank order."""
    found = gather((None if error is None else _reason(error), value))
    if error is not None:
        raise error
    failures = [(rank, reason) for rank, (reason, _) in enumerate(found) if reason is not None]
    if failures:
        raise RankFailed(what, failures)
    return [each for _, each in found]


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (one collective)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
