"""The capsule of a held step under FSDP2: one directory every rank writes into
(``write_state_dir(every_rank=True)``), inside rank 0's bundle.

At an FSDP2 hold the update was held on every rank, so the real state is the
pre-step state: each rank's parameter and optimizer shards go through DCP
(``get_state_dict``), its micro-batches under a key of its own (DCP writes a
plain tensor that several ranks hold under one key once: each rank's batch is
its own), and its micro-batches' documents, random states, recipe and
environment and recipe (scaling, clipping, accumulation) in its
``rank-NNNNN/`` folder. Every rank calls
:func:`write_sharded_capsule` at the agreed hold, whatever its bundle came to:
a rank whose bundle failed stops every rank's capsule (nothing written), so
no rank waits in a collective another never reaches.

Each rank's ``incident.json`` also holds what its bundle's binding was made
of beyond the objects (:class:`BindingFacts`: the loop's stated items, the
incident owner, the last known-good state, the voting group), so that
``nanrunbook replay`` under ``torchrun`` (:mod:`..sharded_replay`) binds each
rank's replay as the incident bundle was bound.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nanrunbook.capture.incident import CAPSULE_DIRECTORY, rank_member
from nanrunbook.capture.torch._every_rank import agree, from_rank0
from nanrunbook.capture.torch._state_dir import encode_value, write_state_dir
from nanrunbook.capture.torch.capsule._contents import encode_micro_batches
from nanrunbook.capture.torch.capsule._write import (
    CAPSULE_FORMAT,
    clipping_document,
    scheduler_state,
)
from nanrunbook.capture.torch.replay import Clipping, MicroBatch

__all__ = ["SHARDED_REPLAY", "BindingFacts", "write_sharded_capsule"]

log = logging.getLogger("nanrunbook.sentinel")

SHARDED_REPLAY = (
    "every rank's shards: replay it under torchrun with the world size it was written by"
)


@dataclass(frozen=True)
class BindingFacts:
    """What a rank's bundle binding was made of besides the live objects."""

    incident_owner: str
    last_known_good: Mapping[str, Any]
    given: Mapping[str, Mapping[str, Any]]  # the loop's stated binding items
    topology: Mapping[str, Any] | None  # the voting group's part of the topology item


def _recipe(
    optimizer: Any, micro: int, loss_scale: float | None, clipping: Clipping | None
) -> dict[str, Any]:
    """How the step was run, beyond its batches: scaling, clipping, accumulation."""
    return {
        "scaling": {"mode": "static" if loss_scale else "none", "scale": loss_scale},
        "clipping": clipping_document(optimizer, clipping),
        "micro_batches": micro,
    }


def _documents(
    micro_batches: Sequence[MicroBatch],
    scheduler: Any,
    incident: Mapping[str, Any],
    environment: Mapping[str, Any],
    recipe: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    micro, batch_state = encode_micro_batches(micro_batches)
    documents = {
        "incident": dict(incident),
        "micro_batches": micro,
        "scheduler": scheduler_state(scheduler),
        "environment": dict(environment),
        "recipe": dict(recipe),
    }
    return documents, batch_state


def write_sharded_capsule(
    bundle: Path | None,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    micro_batches: Sequence[MicroBatch],
    loss_scale: float | None,
    clipping: Clipping | None,
    run_id: str,
    step: int,
    evidence_content_id: str | None,
    failed: str | None,
    binding: BindingFacts,
) -> tuple[Path | None, str | None]:
    """Every rank at the agreed FSDP2 hold: write the one capsule into rank 0's
    bundle (``bundle``: this rank's, None when its capture failed, ``failed``
    why). Never raises: the hold stands without a capsule, the reason returned."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        place = from_rank0(None if bundle is None else str(Path(bundle) / CAPSULE_DIRECTORY))
        error: BaseException | None = None
        documents: dict[str, Any] = {}
        state: dict[str, Any] = {}
        try:
            if bundle is None or place is None:
                raise RuntimeError(failed or "rank 0 wrote no bundle")
            incident = {
                "run_id": run_id,
                "step": step,
                "rank": rank,
                "bundle": {
                    "path": f"../../{rank_member(rank)}",
                    "evidence_content_id": evidence_content_id,
                },
                "contaminated": False,
                "incident_owner": binding.incident_owner,
                "last_known_good": encode_value(dict(binding.last_known_good)),
                "given": encode_value({k: dict(v) for k, v in binding.given.items()}),
                "topology": None
                if binding.topology is None
                else encode_value(dict(binding.topology)),
            }
            param = next(iter(model.parameters()), None)
            environment = {
                "torch": str(torch.__version__),
                "world_size": world,
                "rank": rank,
                "sharding": "fsdp2",
                "device": str(param.device) if param is not None else "cpu",
            }
            recipe = _recipe(optimizer, len(micro_batches), loss_scale, clipping)
            documents, batch_state = _documents(
                micro_batches, scheduler, incident, environment, recipe
            )
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            if batch_state:
                state[f"batch_{rank:05d}"] = batch_state  # this rank's own, not a replica
        except Exception as caught:  # every rank learns it, below
            error = caught
        agree("the sharded capsule", error)
        header = {
            "run_id": run_id,
            "step": step,
            "torch": str(torch.__version__),
            "world_size": world,
            "sharding": "fsdp2",
            "replay": SHARDED_REPLAY,
        }
        target = Path(place)
        write_state_dir(
            target,
            kind_format=CAPSULE_FORMAT,
            state=state,
            documents=documents,
            header=header,
            every_rank=True,
        )
    except Exception as error:  # a full disk, another rank's failure: the hold stands
        log.error("step %d: no sharded capsule: %s", step, error)
        return None, f"{type(error).__name__}: {error}"
    if rank == 0:
        log.error("step %d: sharded capsule %s (%d ranks)", step, target, world)
    return target, None
