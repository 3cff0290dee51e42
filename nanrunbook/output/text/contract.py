"""The contract document in force (``contract``): plain lines, no rich."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

__all__ = ["render_contract"]


def render_contract(document: Mapping[str, Any], content_id: str, out: IO[str]) -> None:
    lines = [
        f"contract {document['contract_version']} for bundles {document['bundle_format']}",
        f"contract_content_id={content_id}",
        "stage order: " + " -> ".join(document["stage_order"]),
        "actions on HOLD (exit 1):",
        *(f"  {stage}: {action}" for stage, action in document["actions"].items()),
        f"CONTINUE_BOUNDED_DIAGNOSTICS (exit 0): {document['no_nonfinite_action']}",
        f"root cause claim: {document['root_cause_claim']}",
        "caps:",
        *(f"  {name}: {value}" for name, value in document["caps"].items()),
        "bounds:",
        *(f"  {name}: {value}" for name, value in document["bounds"].items()),
    ]
    out.write("\n".join(lines) + "\n")
