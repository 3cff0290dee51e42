"""Every violation code nanrunbook can emit, with its one-line meaning.

Codes are stable: scripts and CI gates match on them. Each module declares the
codes it emits next to the rules; this catalogue gathers them for the man page,
the schema and the tests that keep all three in step.
"""

from __future__ import annotations

from types import MappingProxyType

from nanrunbook import access, strictjson
from nanrunbook.capture import _capsule_codes, _state_manifest, recovery, seal
from nanrunbook.manifest import content_id, fields, parse, rules
from nanrunbook.tensors import safetensors, verify
from nanrunbook.verdict import decision, incident_set, merge

__all__ = ["CODES"]


def _gather() -> dict[str, str]:
    merged: dict[str, str] = {}
    modules = (strictjson, fields, parse, content_id, rules, access, safetensors, verify)
    capture = (seal, _state_manifest, recovery, _capsule_codes)
    for module in (*modules, decision, incident_set, merge, *capture):
        for code, meaning in module.CODES.items():
            if code in merged:
                raise RuntimeError(f"violation code {code} is declared twice")
            merged[code] = meaning
    return dict(sorted(merged.items()))


CODES = MappingProxyType(_gather())
