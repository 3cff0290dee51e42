"""Holding together across ranks: under ``torch.distributed`` no rank updates
while another holds.

Each step every rank casts a vote, on the device, that it saw a non-finite value
(its local loss, its gradients, its last update); one all-reduce (MAX) of that
vote is the step's one collective, and it travels in the step's one host read.
Only when some rank voted does a second, rare, collective agree on the outcome
(the most severe one wins), so every rank skips, rolls back or holds at the same
step. Each rank then captures its own bundle into the incident set
(``<step>/rank-NNNNN/``, spec section 11); the ranks' verdicts are gathered and
rank 0 logs the origin: the ranks whose local values went non-finite first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nanrunbook.records import STAGE_ORDER

__all__ = ["KINDS", "LocalGradients", "Outcome", "Ranks"]

log = logging.getLogger("nanrunbook.sentinel")

# Outcomes of a step, least severe first: the agreed one is the most severe.
KINDS = ("healthy", "probe", "incident", "hold", "update")


@dataclass(frozen=True)
class Outcome:
    """What a step comes to: ``healthy`` (update), ``probe`` (the GradScaler skips,
    by design), ``incident`` (skip or hold, by policy), ``hold`` (hold whatever
    the policy), ``update`` (the previous update was non-finite)."""

    kind: str
    reason: str = ""
    stage: str | None = None


class Ranks:
    """The job's ranks: one process (no collective ever), or a process group."""

    def __init__(self, group: Any = None) -> None:
        dist = torch.distributed
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    @property
    def several(self) -> bool:
        return self.world_size > 1

    def vote(self, values: Sequence[Any]) -> Any:
        """1.0 on every rank when any rank has a non-finite value among its
        ``values`` (device tensors), else 0.0; None for a single process."""
        if not self.several:
            return None
        flat = [v.detach().reshape(-1).double() for v in values]
        device = flat[0].device if flat else torch.device("cpu")
        local = torch.cat([f.to(device) for f in flat]) if flat else torch.zeros(1)
        vote = (~torch.isfinite(local)).any().double().reshape(1)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return vote

    def agree(self, outcome: Outcome, device: Any) -> Outcome:
        """The most severe outcome of all ranks (a collective and a read, made
        only at a step some rank voted on)."""
        code = torch.tensor([KINDS.index(outcome.kind)], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(code, op=torch.distributed.ReduceOp.MAX, group=self.group)
        agreed = KINDS[int(code.item())]
        if agreed == outcome.kind:
            return outcome
        if agreed == "update":  # this rank's update was finite: the policy decides
            agreed = "incident"
        return Outcome(agreed, f"another rank's values went non-finite ({agreed})", None)

    def origin(self, decision: str | None, stage: str | None, step: int) -> tuple[int, ...]:
        """Gather every rank's verdict; the origin ranks (spec section 11): the
        HOLD ranks at the earliest stage. Rank 0 logs them."""
        if not self.several:
            return (0,) if decision == "HOLD" else ()
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(
            gathered, (self.rank, decision, stage), group=self.group
        )
        holding = [(STAGE_ORDER.index(s), r) for r, d, s in gathered if d == "HOLD" and s]
        if not holding:
            origin: tuple[int, ...] = ()
        else:
            earliest = min(index for index, _ in holding)
            origin = tuple(sorted(r for index, r in holding if index == earliest))
        if self.rank == 0:
            kind = (
                "NONE"
                if not origin
                else "ONE_RANK"
                if len(origin) == 1
                else ("ALL_RANKS" if len(origin) == self.world_size else "SOME_RANKS")
            )
            where = STAGE_ORDER[min(i for i, _ in holding)] if holding else "none"
            log.error(
                "step %d held on all %d ranks; origin ranks %s (%s) at %s",
                step,
                self.world_size,
                ",".join(map(str, origin)) or "none",
                kind,
                where,
            )
        return origin


class LocalGradients:
    """A DistributedDataParallel communication hook that measures each gradient
    bucket on this rank before the all-reduce mixes it with the others' (then
    all-reduces it as DDP's default hook does): the check before the
    collective, which tells the rank whose own gradients went non-finite."""

    def __init__(self, ddp: Any, group: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.norms: list[Any] = []

        def hook(state: Any, bucket: Any) -> Any:
            self.norms.append(torch.linalg.vector_norm(bucket.buffer().detach().float()))
            return allreduce_hook(state, bucket)

        # DDP reads the hook's annotations as objects, not as postponed strings.
        hook.__annotations__ = {
            "state": object,
            "bucket": torch.distributed.GradBucket,  # type: ignore[attr-defined]
            "return": torch.futures.Future[torch.Tensor],
        }
        ddp.register_comm_hook(group, hook)  # raises if the loop registered its own

    def take(self) -> Any:
        """This step's bucket norms (a device tensor), or None; then forget them."""
        norms, self.norms = self.norms, []
        return torch.stack([n.to(norms[0].device) for n in norms]) if norms else None
