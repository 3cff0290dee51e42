"""What only the training loop knows, stated once when the sentinel is built.

The checkpoint the run started from (and which parts it verified together), the
data source, the loader cursor and the objective. Everything else a bundle
binds, the sentinel derives. The statement is checked against the contract at
construction, so a run never learns at its first incident that its evidence
cannot be written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanrunbook.capture.writer import BundleWriter
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.errors import EvidenceRejected
from nanrunbook.manifest.fields import IDENTIFIER
from nanrunbook.manifest.parse import RECOVERY_PARTS

__all__ = ["LoopFacts", "recovery_point"]

Cursor = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None

# Stand-ins for the derived items, only to check the loop's statement early.
_DERIVED_PLACEHOLDERS: dict[str, dict[str, Any]] = {
    "model": {"id": "m"},
    "batch": {"id": "b"},
    "optimizer": {"id": "o"},
    "scheduler": {"id": "s"},
    "scaler": {"id": "none", "mode": "none", "scale": 1},
    "random_state": {"id": "r"},
    "environment": {"id": "e"},
    "topology": {"id": "t", "world_size": 1, "rank": 0},
    "precision": {"id": "p", "param_dtype": "F32", "compute_dtype": "F32"},
}


def recovery_point(checkpoint_id: str, step: int, parts: Any) -> dict[str, Any] | None:
    """A last_known_good record when ``parts`` names all five recovery parts, each
    once; None when it does not (that checkpoint is no recovery point)."""
    listed = list(parts)
    if sorted(listed) != sorted(RECOVERY_PARTS):
        return None
    return {"checkpoint_id": checkpoint_id, "step": step, "verified_together": listed}


@dataclass(frozen=True)
class RunChange:
    """A change a run made to one binding item (``prove``'s, to a resumed run)
    for steps ``first`` to ``last`` (None: to the end): in those steps' bundles
    the item's ``fields`` are these and ``note``, what changed, is its
    ``replay_change`` detail."""

    item: str
    note: str
    first: int
    last: int | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def covers(self, step: int) -> bool:
        return self.first <= step and (self.last is None or step <= self.last)


@dataclass(frozen=True)
class LoopFacts:
    run_id: str
    incident_owner: str
    checkpoint: Mapping[str, Any]  # the binding item (id, and step if known)
    data: Mapping[str, Any]
    objective: Mapping[str, Any]
    loader_cursor: Cursor
    start: Mapping[str, Any]  # the starting state as a recovery point
    changes: tuple[RunChange, ...] = ()  # what the run changed, from a step on (prove's)

    @property
    def start_step(self) -> int:
        return int(self.start["step"])

    @classmethod
    def of(
        cls,
        *,
        run_id: str,
        incident_owner: str,
        checkpoint: Mapping[str, Any],
        data: Mapping[str, Any],
        objective: Mapping[str, Any],
        loader_cursor: Cursor,
    ) -> LoopFacts:
        """Raise ValueError, with one line per problem, for a statement whose
        evidence the check would reject."""
        item = {k: v for k, v in checkpoint.items() if k != "verified_together"}
        if "verified_together" not in checkpoint:
            raise ValueError(
                "checkpoint needs 'verified_together': which of "
                f"{', '.join(RECOVERY_PARTS)} the starting checkpoint verified together"
            )
        step = item.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
        start = recovery_point(str(item.get("id")), step, checkpoint["verified_together"])
        if start is None:
            raise ValueError(
                "the starting checkpoint must be a recovery point: verified_together must"
                f" name {', '.join(RECOVERY_PARTS)}, got {list(checkpoint['verified_together'])}"
            )
        facts = cls(run_id, incident_owner, item, data, objective, loader_cursor, start)
        facts._validate()
        return facts

    def changed(self, step: int) -> tuple[RunChange, ...]:
        """What the run changed at step ``step``."""
        return tuple(change for change in self.changes if change.covers(step))

    def binding(self, step: int) -> dict[str, dict[str, Any]]:
        """The four items the loop supplies, the cursor read now."""
        cursor = self.loader_cursor() if callable(self.loader_cursor) else self.loader_cursor
        if cursor is None:
            cursor = {"id": f"{self.run_id}.step-{step}", "kind": "steps-since-start"}
        return {
            "checkpoint": dict(self.checkpoint),
            "data": dict(self.data),
            "loader_cursor": dict(cursor),
            "objective": dict(self.objective),
        }

    def _validate(self) -> None:
        if not isinstance(self.run_id, str) or not IDENTIFIER.fullmatch(self.run_id):
            raise ValueError(
                f"run_id {self.run_id!r} is not an identifier (letters, digits, ._:@/+=-)"
            )
        probe = BundleWriter(
            run_id=self.run_id,
            step=self.start_step + 1,
            incident_owner=self.incident_owner,
            binding={**_DERIVED_PLACEHOLDERS, **self.binding(self.start_step + 1)},
            last_known_good=self.start,
        )
        for stage in STAGE_ORDER:
            probe.observe(stage, [(stage, np.zeros(1, "<f4"), "p")], owner="o", probe_source="p")
        try:
            probe.validate()
        except EvidenceRejected as error:
            lines = [f"{v.code} {v.where}: {v.message}" for v in error.violations]
            raise ValueError(
                "the loop's statement cannot make a valid bundle: " + "; ".join(lines)
            ) from None
