"""Content ids: what binds a report to the exact evidence it judged (spec section 7)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import rfc8785

__all__ = ["EVIDENCE_ID_KEY", "EVIDENCE_ID_PREFIX", "evidence_content_id"]

EVIDENCE_ID_PREFIX = "training-incident-evidence@sha256:"
EVIDENCE_ID_KEY = "evidence_content_id"


def evidence_content_id(manifest: Mapping[str, Any]) -> str:
    """``training-incident-evidence@sha256:`` + SHA-256 of the RFC 8785 form of the
    manifest object without its ``evidence_content_id`` key."""
    body = {key: value for key, value in manifest.items() if key != EVIDENCE_ID_KEY}
    canonical: bytes = rfc8785.dumps(body)
    return EVIDENCE_ID_PREFIX + hashlib.sha256(canonical).hexdigest()
