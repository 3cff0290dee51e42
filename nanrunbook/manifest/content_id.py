"""Content ids: what binds a report to the exact evidence it judged (spec section 7)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from nanrunbook.codes import CONTENT_ID_CODES as CODES
from nanrunbook.errors import Violation
from nanrunbook.strictjson import Parsed, canonical_json, canonical_member_dropped

__all__ = [
    "CODES",
    "EVIDENCE_ID_FORM",
    "EVIDENCE_ID_KEY",
    "EVIDENCE_ID_PREFIX",
    "content_id_violations",
    "evidence_content_id",
]

EVIDENCE_ID_PREFIX = "training-incident-evidence@sha256:"
EVIDENCE_ID_KEY = "evidence_content_id"
EVIDENCE_ID_FORM = re.compile(re.escape(EVIDENCE_ID_PREFIX) + r"[0-9a-f]{64}")


def evidence_content_id(
    manifest: Mapping[str, Any], *, floats: Iterable[float] | None = None
) -> str:
    """``training-incident-evidence@sha256:`` + SHA-256 of the RFC 8785 form of the
    manifest object without its ``evidence_content_id`` key.

    ``floats``: every float of a manifest the strict reader returned
    (:attr:`~nanrunbook.strictjson.Parsed.floats`), for the fast canonical form.
    """
    body = {key: value for key, value in manifest.items() if key != EVIDENCE_ID_KEY}
    if not isinstance(manifest.get(EVIDENCE_ID_KEY, ""), str):
        floats = None  # the floats listed may include some of the dropped value
    return EVIDENCE_ID_PREFIX + hashlib.sha256(canonical_json(body, floats)).hexdigest()


def content_id_violations(document: Parsed) -> list[Violation]:
    """EVIDENCE_CONTENT_ID_MISMATCH when a well-formed declared id is not the
    manifest's own (a malformed one is the parser's EVIDENCE_CONTENT_ID_INVALID)."""
    declared = document.value.get(EVIDENCE_ID_KEY)
    if not isinstance(declared, str) or not EVIDENCE_ID_FORM.fullmatch(declared):
        return []
    canonical = canonical_member_dropped(document, EVIDENCE_ID_KEY)
    recomputed = EVIDENCE_ID_PREFIX + hashlib.sha256(canonical).hexdigest()
    if declared == recomputed:
        return []
    return [
        Violation(
            "EVIDENCE_CONTENT_ID_MISMATCH",
            f"$.{EVIDENCE_ID_KEY}",
            f"the manifest's content recomputes to {recomputed}",
        )
    ]
