"""What a manifest declares about its place in a job: contract, run, step, topology.

An incident set (spec section 11) compares these across its members, accepted
or rejected: a member rejected for its data still says which rank it is. Each
value is read under its own field rule (an identifier, an integer in range), so
a value that breaks its rule is not declared; a manifest that is not strict JSON
declares nothing: it was rejected before its topology could be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanrunbook.manifest.fields import Fields, Sink
from nanrunbook.records import Manifest

__all__ = ["NOTHING_DECLARED", "Declared", "declared_by_manifest", "declared_values"]


@dataclass(frozen=True, slots=True)
class Declared:
    """The values a member bundle declares; None where it declares none that is valid."""

    contract_version: str | None = None
    run_id: str | None = None
    step: int | None = None
    world_size: int | None = None
    rank: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "contract_version": self.contract_version,
            "run_id": self.run_id,
            "step": self.step,
            "world_size": self.world_size,
            "rank": self.rank,
        }


NOTHING_DECLARED = Declared()


def _fields(value: Any, path: str) -> Fields | None:
    # open_ended, no required keys: only the typed reads below record anything,
    # into a sink nobody reads (the bundle's own check reports the violations).
    return (
        Fields(Sink(), value, path, required=(), open_ended=True)
        if isinstance(value, dict)
        else None
    )


def declared_values(tree: Any) -> Declared:
    """The declared values of a strictly parsed manifest tree."""
    top = _fields(tree, "$")
    if top is None:
        return NOTHING_DECLARED
    run = _fields(top.raw("run"), "$.run")
    binding = _fields(top.raw("binding"), "$.binding")
    topology = _fields(binding.raw("topology"), "$.binding.topology") if binding else None
    world_size = topology.integer("world_size", minimum=1) if topology else None
    rank = topology.integer("rank", minimum=0) if topology else None
    if rank is not None and (world_size is None or rank >= world_size):
        rank = None  # a rank is read only together with the world it lies in
    return Declared(
        contract_version=top.identifier("contract_version"),
        run_id=run.identifier("run_id") if run else None,
        step=run.integer("step", minimum=0) if run else None,
        world_size=world_size,
        rank=rank,
    )


def declared_by_manifest(manifest: Manifest) -> Declared:
    """The declared values of an accepted manifest."""
    return Declared(
        contract_version=manifest.contract_version,
        run_id=manifest.run_id,
        step=manifest.step,
        world_size=manifest.binding.world_size,
        rank=manifest.binding.rank,
    )
