"""The violation codes of an incident capsule beyond those of its state
directory (``_state_manifest``), torch-free so the code catalogue can list them."""

from __future__ import annotations

__all__ = ["CODES"]

CODES: dict[str, str] = {
    "CAPSULE_DOCUMENT_INVALID": (
        "a capsule document lacks a field or holds a value of the wrong kind"
    ),
    "CAPSULE_BUNDLE_DIFFERS": (
        "the bundle beside the capsule is not the one the capsule was written with"
        " (its evidence content id differs)"
    ),
    "CAPSULE_OBJECTS_DIFFER": (
        "the objects the entry built differ from the capsule's (optimizer class, param"
        " groups, scheduler, scaler, generators): its state cannot be loaded into them"
    ),
}
