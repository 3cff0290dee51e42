"""Holding together across ranks: under ``torch.distributed`` no rank updates
while another holds, and every rank takes the same branch.

Each step every rank of the sentinel's group casts a vote, on the device, that
it saw a non-finite value (its local loss, its gradients, its last update) or
could not check its step; one all-reduce (MAX) of that vote is the step's one
collective, and it travels in the step's one host read. Only when some rank
voted does a second, rare, collective agree on everything that decides which
collectives follow (:class:`Proposal`: skip, roll back or hold; whether some
rank's last update went non-finite and whether every rank can roll it back; the
incident directory), so every rank skips, rolls back or holds at the same step
and no rank waits in a collective that another does not reach. After an agreed
hold each rank writes its own bundle into the incident set
(``<step>/rank-NNNNN/``, spec section 11, named by the global rank), then its
telemetry line, and only then the ranks exchange their verdicts, through the
job's c10d store with a long timeout of its own (:data:`EXCHANGE_TIMEOUT`), not
through a collective: a capture that outlasts the group's collective timeout
(NCCL's watchdog) must not cost the job its evidence. The group's rank 0 logs
the origin: the ranks whose local values went non-finite first.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from nanrunbook.contract import STAGE_ORDER
from nanrunbook.records import origin_of

__all__ = ["ACTIONS", "EXCHANGE_TIMEOUT", "KINDS", "LocalGradients", "Outcome", "Proposal", "Ranks"]

log = logging.getLogger("nanrunbook.sentinel")

if torch.distributed.is_available():
    # torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a
    # default argument, evaluated when the module is first imported. Imported after
    # init_process_group (DistributedDataParallel's construction imports it), those
    # defaults hold the default process group for the life of the process:
    # destroy_process_group() cannot free it, its gloo threads run on into
    # interpreter shutdown, and there one of them can abort the process
    # ("terminate called without an active exception", SIGABRT, which torchrun and
    # Slurm report as a crash). Imported here, before the job's
    # init_process_group, the defaults are None.
    import torch.distributed.nn


def group_pinned_by_torch() -> bool:
    """torch.distributed.nn was first imported after init_process_group (before
    this package), so its default arguments hold the default group for good."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None or not torch.distributed.is_available():
        return False
    kind = torch.distributed.ProcessGroup
    return any(
        isinstance(default, kind)
        for function in vars(functional).values()
        for default in getattr(function, "__defaults__", None) or ()
    )


# Outcomes of a step, least severe first.
KINDS = ("healthy", "probe", "incident", "hold", "update")
# What a rank does about a step, least severe first: the agreed one is the most severe.
ACTIONS = ("healthy", "probe", "skip", "hold")
# How long a rank that finished its capture waits for the others' verdicts.
EXCHANGE_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class Outcome:
    """What a step comes to: ``healthy`` (update), ``probe`` (the GradScaler skips,
    by design), ``incident`` (skip or hold, by policy), ``hold`` (hold whatever
    the policy), ``update`` (the previous update was non-finite)."""

    kind: str
    reason: str = ""
    stage: str | None = None


@dataclass(frozen=True)
class Proposal:
    """One rank's view of a voted step, or (from :meth:`Ranks.agree`) every
    rank's, combined: ``action`` the most severe of :data:`ACTIONS`;
    ``update`` some rank's previous update was non-finite; ``stuck`` some rank
    cannot roll it back (no snapshot); ``failed`` some rank could not check its
    step; ``attempt`` / ``previous_attempt`` the incident directory's attempt
    (``<step>.<attempt>``) for this step and the previous one, the first that
    is free on every rank."""

    action: str
    update: bool = False
    stuck: bool = False
    failed: bool = False
    attempt: int = 0
    previous_attempt: int = 0


class Ranks:
    """The job's ranks: one process (no collective ever), or a process group.

    ``rank`` and ``world_size`` are the job's (global): they name the files and
    the incident set's members, which ranks of every group share.
    ``group_rank`` and ``group_size`` are the sentinel's group's, which votes."""

    def __init__(self, group: Any = None) -> None:
        dist = torch.distributed
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group_rank = dist.get_rank(group) if self.distributed else 0
        self.group_size = dist.get_world_size(group) if self.distributed else 1
        self.members: tuple[int, ...] = (
            tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            if self.distributed
            else (0,)
        )
        self.alone = False  # set when this rank leaves the others (an error of its own)
        if self.distributed and group_pinned_by_torch():
            log.warning(
                "torch.distributed.nn was imported after init_process_group: its default"
                " arguments hold the process group, which destroy_process_group() cannot"
                " free, so its threads can abort the process at exit (SIGABRT); import"
                " nanrunbook.capture.torch before init_process_group"
            )

    @property
    def several(self) -> bool:
        """The sentinel's group has other ranks to vote with: it is initialised
        still (a flush at exit may come after destroy_process_group) and this
        rank has not left it."""
        dist = torch.distributed
        return self.group_size > 1 and not self.alone and dist.is_initialized()

    @property
    def member(self) -> int | None:
        """The rank that names this process's files: None in a job of one process."""
        return self.rank if self.world_size > 1 else None

    def vote(self, values: Sequence[Any], failed: bool = False) -> Any:
        """1.0 on every rank when any rank has a non-finite value among its
        ``values`` (device tensors) or ``failed``, else 0.0; None for one rank."""
        if not self.several:
            return None
        device = values[0].device if values else torch.device("cpu")
        try:
            flat = [v.detach().reshape(-1).double().to(device) for v in values]
            local = torch.cat(flat) if flat else torch.zeros(1, device=device)
            vote = (~torch.isfinite(local)).any().double().reshape(1)
        except Exception:  # the others wait in the all-reduce: this rank votes to hold
            log.exception("the vote's values could not be combined")
            failed = True
        if failed:
            vote = torch.ones(1, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return vote

    def agree(self, proposal: Proposal, device: Any) -> Proposal:
        """Every rank's proposal combined (a collective and a read, made only at
        a step some rank voted on)."""
        fields = [
            ACTIONS.index(proposal.action),
            proposal.update,
            proposal.stuck,
            proposal.failed,
            proposal.attempt,
            proposal.previous_attempt,
        ]
        code = torch.tensor([int(f) for f in fields], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(code, op=torch.distributed.ReduceOp.MAX, group=self.group)
        action, update, stuck, failed, attempt, previous_attempt = code.tolist()
        return Proposal(
            ACTIONS[action], bool(update), bool(stuck), bool(failed), attempt, previous_attempt
        )

    def origin(self, decision: str | None, stage: str | None, incident: str) -> tuple[int, ...]:
        """Exchange every rank's verdict after an agreed hold (through the store,
        ``incident`` naming the keys); the origin ranks (spec section 11): the
        HOLD ranks at the earliest stage, or () when they could not be exchanged.
        The group's rank 0 logs them."""
        if not self.several:
            return (self.rank,) if decision == "HOLD" else ()
        try:
            gathered = self._exchange(incident, [self.rank, decision, stage])
        except Exception as error:  # the hold stands, with its bundle and its line
            log.error("%s: the ranks' verdicts could not be exchanged: %s", incident, error)
            return ()
        holding = [(STAGE_ORDER.index(s), r) for r, d, s in gathered if d == "HOLD" and s]
        if not holding:
            origin: tuple[int, ...] = ()
        else:
            earliest = min(index for index, _ in holding)
            origin = tuple(sorted(r for index, r in holding if index == earliest))
        if self.group_rank == 0:
            kind = origin_of(origin, self.group_size)
            where = STAGE_ORDER[min(i for i, _ in holding)] if holding else "none"
            log.error(
                "%s held on all %d ranks of the group; origin ranks %s (%s) at %s",
                incident,
                self.group_size,
                ",".join(map(str, origin)) or "none",
                kind,
                where,
            )
        return origin

    def _exchange(self, incident: str, mine: list[Any]) -> list[Any]:
        """Every member's ``mine``, through the c10d store: a rank waits there for
        the others (up to EXCHANGE_TIMEOUT), not in a collective the job's
        watchdog would time out."""
        store = torch.distributed.distributed_c10d._get_default_store()
        members = ",".join(map(str, self.members))
        keys = [f"nanrunbook/verdict/{incident}/{members}/{r}" for r in self.members]
        store.set(keys[self.members.index(self.rank)], json.dumps(mine))
        store.wait(keys, EXCHANGE_TIMEOUT)
        return [json.loads(store.get(key)) for key in keys]


class LocalGradients:
    """A DistributedDataParallel communication hook that measures each gradient
    bucket on this rank before the all-reduce mixes it with the others' (then
    all-reduces it as DDP's default hook does, over the DDP module's own process
    group): the check before the collective, which tells the rank whose own
    gradients went non-finite. ``collective`` names it for the hold's reason."""

    collective = "all-reduce"

    def __init__(self, ddp: Any) -> None:
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
        # The hook's state is the group its all-reduce averages over: DDP's own
        # (a data-parallel subgroup in a data x model parallel job), never the
        # sentinel's voting group.
        ddp.register_comm_hook(ddp.process_group, hook)  # raises if the loop has its own

    def take(self) -> Any:
        """This step's bucket norms (a device tensor), or None; then forget them."""
        norms, self.norms = self.norms, []
        return torch.stack([n.to(norms[0].device) for n in norms]) if norms else None
