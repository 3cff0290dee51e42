"""The incident contract training-incident-v1: stage order, actions, caps, bounds.

The contract document is data, and its RFC 8785 digest is the contract content
id that every report carries: raising a cap changes the id, so two reports can
only be compared when they were judged under the same contract.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

from nanrunbook import access, strictjson
from nanrunbook.exits import Exit

__all__ = [
    "ACTIONS",
    "BUNDLE_FORMAT",
    "CONTINUE",
    "CONTRACT_VERSION",
    "HOLD",
    "NO_NONFINITE_ACTION",
    "ROOT_CAUSE_CLAIM",
    "SCALE_RANGE",
    "STAGE_ORDER",
    "Caps",
    "bounds",
    "contract_content_id",
    "contract_document",
    "is_contract_scale",
]

CONTRACT_VERSION = "training-incident-v1"
# The five boundaries of a training step, in the order a step crosses them.
STAGE_ORDER: tuple[str, ...] = ("input", "forward", "loss", "backward", "optimizer")
BUNDLE_FORMAT = "nanrunbook-bundle/1"
HOLD = "HOLD"
CONTINUE = "CONTINUE_BOUNDED_DIAGNOSTICS"
ROOT_CAUSE_CLAIM = "NONE_SYMPTOM_LOCATION_IS_NOT_CAUSALITY"
NO_NONFINITE_ACTION = "no-nonfinite-evidenced-check-other-signals"
ACTIONS: dict[str, str] = {
    "input": "hold-and-inspect-input-data-contract",
    "forward": "hold-and-replay-forward-activations",
    "loss": "hold-and-inspect-objective-reduction",
    "backward": "hold-and-inspect-gradient-path-and-loss-scaling",
    "optimizer": "hold-and-inspect-optimizer-state-and-update",
}
CONTRACT_ID_PREFIX = "training-incident-contract@sha256:"

# Bounds fixed by the format; unlike the caps, no option changes them. Those the
# manifest fields and the tensor headers enforce are defined here; the strict
# reader's (depth, safe integers) and the manifest's size are defined where they
# are enforced. :func:`bounds` reads them all when the document is built.
IDENTIFIER_MAX_CHARS = 256
IDENTIFIER_PATTERN = rf"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{{0,{IDENTIFIER_MAX_CHARS - 1}}}"
MAX_FREE_TEXT = 1024
MAX_TENSOR_NAME = 256
TENSOR_HEADER_MAX_BYTES = 100_000_000  # the safetensors format's own cap
# A loss scale is a power of two 2^k, SCALE_MIN_EXPONENT <= k <= SCALE_MAX_EXPONENT.
SCALE_MIN_EXPONENT = -24
SCALE_MAX_EXPONENT = 24
SCALE_MIN = 2.0**SCALE_MIN_EXPONENT
SCALE_MAX = 2.0**SCALE_MAX_EXPONENT
SCALE_RANGE = f"a power of two within [2^{SCALE_MIN_EXPONENT}, 2^{SCALE_MAX_EXPONENT}]"


def is_contract_scale(value: float) -> bool:
    """A loss scale the contract allows: a power of two within the range."""
    power_of_two = math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5
    return power_of_two and SCALE_MIN <= value <= SCALE_MAX


def bounds() -> dict[str, Any]:
    """The fixed bounds in force, read from the constants the checks enforce."""
    return {
        "manifest_max_bytes": access.MANIFEST_MAX_BYTES,
        "manifest_max_depth": strictjson.MAX_DEPTH,
        "safe_integer_max": strictjson.MAX_SAFE_INTEGER,
        "identifier_pattern": f"^{IDENTIFIER_PATTERN}$",
        "free_text_max_chars": MAX_FREE_TEXT,
        "tensor_name_max_chars": MAX_TENSOR_NAME,
        "tensor_header_max_bytes": TENSOR_HEADER_MAX_BYTES,
        "scale_min_exponent": SCALE_MIN_EXPONENT,
        "scale_max_exponent": SCALE_MAX_EXPONENT,
    }


@dataclass(frozen=True, slots=True)
class Caps:
    """Work bounds checked before any tensor data is read."""

    max_stage_elements: int = 2**31
    max_bundle_elements: int = 2**33
    max_stage_tensors: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_stage_elements", "max_bundle_elements", "max_stage_tensors"):
            value = getattr(self, name)
            # bool is an int subclass; a cap of True is a caller's bug.
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer")
            if value > strictjson.MAX_SAFE_INTEGER:
                limit = strictjson.power_of_two_text(strictjson.MAX_SAFE_INTEGER)
                raise ValueError(f"{name} must be at most {limit}")


def contract_document(caps: Caps | None = None) -> dict[str, Any]:
    """The contract in force, as ``nanrunbook contract --format json`` prints it."""
    caps = caps or Caps()
    return {
        "contract_version": CONTRACT_VERSION,
        "bundle_format": BUNDLE_FORMAT,
        "stage_order": list(STAGE_ORDER),
        "actions": dict(ACTIONS),
        "no_nonfinite_action": NO_NONFINITE_ACTION,
        "decisions": {
            HOLD: {
                "exit_code": int(Exit.HOLD),
                "when": "an OBSERVED stage has a non-finite element",
            },
            CONTINUE: {
                "exit_code": int(Exit.CONTINUE),
                "when": "no OBSERVED stage has a non-finite element",
            },
            "REJECTED": {
                "exit_code": int(Exit.REJECTED),
                "when": "the evidence breaks the contract",
            },
        },
        "root_cause_claim": ROOT_CAUSE_CLAIM,
        "caps": {
            "max_stage_elements": caps.max_stage_elements,
            "max_bundle_elements": caps.max_bundle_elements,
            "max_stage_tensors": caps.max_stage_tensors,
        },
        "bounds": bounds(),
    }


def contract_content_id(caps: Caps | None = None) -> str:
    canonical = strictjson.canonical_json(contract_document(caps))
    return CONTRACT_ID_PREFIX + hashlib.sha256(canonical).hexdigest()
