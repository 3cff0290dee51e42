"""A JSON Schema (draft 2020-12) of manifest.json, for producers and editors.

``nanrunbook schema`` prints it. It is built from the same constants the parser
uses, so it stays in step with the code, and it never rejects a manifest that
``nanrunbook check`` accepts. It states each record's shape, every field's type
and fixed form, and what a sibling's ``status``, ``resolution``, ``stage`` or
scaler ``mode`` requires or forbids. It cannot replace the contract checks:
JSON Schema has no way to see duplicate keys or the integer/float distinction
of a literal, compare one field with another, sum counts, require uniqueness of
an identifier across records, or read tensor data. :data:`SCHEMA_CODES` names
the violation codes the schema expresses (:data:`PARTIAL_CODES` those it only
expresses in part); every other code is the contract's alone.
"""

from __future__ import annotations

from typing import Any

from nanrunbook.contract import (
    BUNDLE_FORMAT,
    CONTRACT_VERSION,
    SCALE_MAX_EXPONENT,
    SCALE_MIN_EXPONENT,
    STAGE_ORDER,
)
from nanrunbook.dtypes import DTYPES
from nanrunbook.manifest.fields import IDENTIFIER, MAX_FREE_TEXT, MAX_TENSOR_NAME
from nanrunbook.manifest.parse import (
    BINDING_ITEMS,
    DYNAMIC_FIELDS,
    GRADIENT_FORMS,
    RECOVERY_PARTS,
    REDUCTIONS,
    RESOLUTIONS,
    SCALER_MODES,
    STATUSES,
    TOP_LEVEL_FIELDS,
    TYPED_FIELDS,
)
from nanrunbook.strictjson import MAX_SAFE_INTEGER

__all__ = ["DIALECT", "PARTIAL_CODES", "SCHEMA_CODES", "manifest_schema"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"

# C0, DEL and C1 controls. Searched for (not anchored): "$" also matches before a
# final newline in some regex dialects, so "^[^...]*$" would let one through.
_CONTROL = "[\\u0000-\\u001f\\u007f-\\u009f]"
_EVIDENCE_ID = "^training-incident-evidence@sha256:[0-9a-f]{64}$"
_SHA256 = "^[0-9a-f]{64}$"
_STAGE_FIELDS_OF_OBSERVED = ("resolution", "tensors", "counts")
_FORBIDDEN_IF_NOT_RUN = ("resolution", "tensors", "counts", "finite_max_abs")

SCHEMA_CODES: frozenset[str] = frozenset(
    {
        "FIELD_MISSING",
        "FIELD_UNKNOWN",
        "FIELD_TYPE",
        "FIELD_OUT_OF_RANGE",
        "VALUE_NOT_ALLOWED",
        "IDENTIFIER_INVALID",
        "TEXT_INVALID",
        "TENSOR_NAME_INVALID",
        "FORMAT_UNSUPPORTED",
        "CONTRACT_VERSION_UNSUPPORTED",
        "EVIDENCE_CONTENT_ID_INVALID",
        "DIGEST_INVALID",
        "DTYPE_UNKNOWN",
        "SHAPE_INVALID",
        "LAST_KNOWN_GOOD_INCOMPLETE",
        "STAGES_NOT_FIVE",
        "STAGE_FIELD_NOT_ALLOWED",
        "ENTRY_FIELD_NOT_ALLOWED",
        "TENSORS_EMPTY",
        "SCALER_FIELD_NOT_ALLOWED",
        "STAGE_ORDER",
        "TRANSITION_INPUT_NOT_OBSERVED",
        "TRANSITION_OBSERVED_AFTER_NOT_RUN",
        "FILE_PATH_UNSAFE",
        "SCALER_SCALE_NOT_ONE",
        "SCALER_SCALE_UNSAFE",
        "SCALER_FACTOR_INVALID",
        "FINITE_MAX_ABS_INVALID",
        "JSON_CONTROL_CHARACTER",
        "JSON_INTEGER_OUT_OF_RANGE",
    }
)
"""Violation codes the schema expresses: a manifest that earns one fails the schema,
unless the code is also in :data:`PARTIAL_CODES`."""

PARTIAL_CODES: dict[str, str] = {
    "FIELD_TYPE": "JSON Schema's integer type also matches 3.0 and -0; check rejects both",
    "TEXT_INVALID": "the schema rejects control characters only; check also rejects every "
    "other non-printable character (bidi overrides, format characters, non-ASCII spaces)",
    "TENSOR_NAME_INVALID": "as TEXT_INVALID: control characters only",
    "JSON_INTEGER_OUT_OF_RANGE": "bounded only in fields the contract types as integers; "
    "check rejects an unsafe integer literal anywhere",
    "JSON_CONTROL_CHARACTER": "in every string value and binding detail key; the other "
    "objects are closed, so a key with a control character is an unknown field",
}
"""Codes the schema expresses only in part, and what it leaves to ``check``."""


def _string(**extra: Any) -> dict[str, Any]:
    return {"type": "string", "not": {"pattern": _CONTROL}, **extra}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/$defs/{name}"}


def _closed(
    properties: dict[str, Any], required: tuple[str, ...] | list[str], **extra: Any
) -> dict[str, Any]:
    return {
        "type": "object",
        "required": list(required),
        "properties": properties,
        "additionalProperties": False,
        **extra,
    }


def _forbid(keys: tuple[str, ...] | list[str]) -> dict[str, Any]:
    return {"not": {"anyOf": [{"required": [key]} for key in keys]}}


def _when(key: str, value: str) -> dict[str, Any]:
    return {"properties": {key: {"const": value}}, "required": [key]}


def _integer(minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": MAX_SAFE_INTEGER}


def _powers_of_two() -> list[float]:
    """Every scale the contract allows outside mode none: 2^k within [SCALE_MIN, SCALE_MAX]."""
    return [2.0**k for k in range(SCALE_MIN_EXPONENT, SCALE_MAX_EXPONENT + 1)]


def _binding_item(name: str) -> dict[str, Any]:
    typed: dict[str, Any] = {"id": _ref("identifier")}
    required = ["id", *TYPED_FIELDS.get(name, ())]
    item: dict[str, Any] = {
        "type": "object",
        "required": required,
        "properties": typed,
        "propertyNames": {"not": {"pattern": _CONTROL}},
        "additionalProperties": _ref("binding_detail"),
    }
    if name == "topology":
        typed["world_size"] = _integer(1)
        typed["rank"] = _integer(0)
    elif name == "precision":
        typed["param_dtype"] = _ref("dtype")
        typed["compute_dtype"] = _ref("dtype")
    elif name == "objective":
        typed["reduction"] = {"enum": list(REDUCTIONS)}
    elif name == "scaler":
        typed.update(
            mode={"enum": list(SCALER_MODES)},
            scale={"type": "number"},
            growth_factor={"type": "number", "exclusiveMinimum": 1},
            backoff_factor={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            found_inf={"type": "boolean"},
            step_skipped={"type": "boolean"},
            scale_after={"type": "number"},
        )
        item["allOf"] = [
            {"if": _when("mode", "none"), "then": {"properties": {"scale": {"const": 1}}}},
            {
                "if": {
                    "properties": {"mode": {"enum": ["static", "dynamic"]}},
                    "required": ["mode"],
                },
                "then": {"properties": {"scale": {"enum": _powers_of_two()}}},
            },
            {
                "if": _when("mode", "dynamic"),
                "then": {"required": list(DYNAMIC_FIELDS)},
                "else": {
                    "if": {"required": ["mode"]},
                    "then": _forbid(DYNAMIC_FIELDS),
                },
            },
        ]
    return item


def _tensor_entry() -> dict[str, Any]:
    return _closed(
        {
            "name": _string(minLength=1, maxLength=MAX_TENSOR_NAME),
            "file": _ref("relative_path"),
            "dtype": _ref("dtype"),
            "shape": {"type": "array", "items": _integer(0)},
            "sha256": _string(pattern=_SHA256),
            "probe": _ref("free_text"),
        },
        ("name", "dtype", "shape", "probe"),
    )


def _stage_record() -> dict[str, Any]:
    record = _closed(
        {
            "stage": {"enum": list(STAGE_ORDER)},
            "status": {"enum": list(STATUSES)},
            "owner": _ref("identifier"),
            "telemetry_id": _ref("identifier"),
            "tensor_set": _closed(
                {"id": _ref("identifier"), "probe_source": _ref("free_text")},
                ("id", "probe_source"),
            ),
            "resolution": {"enum": list(RESOLUTIONS)},
            "gradients": {"enum": list(GRADIENT_FORMS)},
            "tensors": {"type": "array", "minItems": 1, "items": _ref("tensor_entry")},
            "counts": _closed(
                {key: _integer(0) for key in ("elements", "finite", "nan", "posinf", "neginf")},
                ("elements", "finite", "nan", "posinf", "neginf"),
            ),
            "finite_max_abs": {"type": ["number", "null"], "minimum": 0},
            "reason": _ref("free_text"),
        },
        ("stage", "status", "owner", "telemetry_id", "tensor_set"),
    )
    record["allOf"] = [
        {
            "if": _when("stage", "backward"),
            "then": {"required": ["gradients"]},
            "else": {"if": {"required": ["stage"]}, "then": _forbid(["gradients"])},
        },
        {
            "if": _when("status", "NOT_RUN"),
            "then": {"required": ["reason"], **_forbid(_FORBIDDEN_IF_NOT_RUN)},
        },
        {"if": _when("status", "OBSERVED"), "then": {"required": list(_STAGE_FIELDS_OF_OBSERVED)}},
        {
            "if": _when("resolution", "complete"),
            "then": {"properties": {"tensors": {"items": {"required": ["file", "sha256"]}}}},
        },
        {
            "if": _when("resolution", "summary"),
            "then": {"properties": {"tensors": {"items": _forbid(["file", "sha256"])}}},
        },
    ]
    return record


def _stages() -> dict[str, Any]:
    not_run = _when("status", "NOT_RUN")
    # prefixItems, not items, applies to the five positions: each is a stage record
    # whose stage is fixed by its position; the input stage is OBSERVED.
    positions: list[dict[str, Any]] = [
        {"$ref": "#/$defs/stage_record", "properties": {"stage": {"const": stage}}}
        for stage in STAGE_ORDER
    ]
    positions[0]["properties"]["status"] = {"const": "OBSERVED"}
    # A NOT_RUN stage is followed by NOT_RUN stages only.
    suffix = [
        {
            "if": {"prefixItems": [*([{}] * index), not_run]},
            "then": {"prefixItems": [*([{}] * (index + 1)), not_run]},
        }
        for index in range(len(STAGE_ORDER) - 1)
    ]
    return {
        "type": "array",
        "minItems": len(STAGE_ORDER),
        "maxItems": len(STAGE_ORDER),
        "prefixItems": positions,
        "items": False,
        "allOf": suffix,
    }


def manifest_schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of a ``nanrunbook-bundle/1`` manifest.json."""
    binding_items = {name: _binding_item(name) for name in BINDING_ITEMS}
    return {
        "$schema": DIALECT,
        "title": f"{BUNDLE_FORMAT} manifest.json (contract {CONTRACT_VERSION})",
        "description": (
            "The shape of an evidence manifest. Passing this schema is necessary, not "
            "sufficient: `nanrunbook check` also enforces the strict JSON rules, the "
            "relations between fields, the tensor data and the content ids "
            "(nanrunbook-bundle(5))."
        ),
        "type": "object",
        "required": list(TOP_LEVEL_FIELDS),
        "additionalProperties": False,
        "properties": {
            "format": {"const": BUNDLE_FORMAT},
            "contract_version": {"const": CONTRACT_VERSION},
            "evidence_id": _ref("identifier"),
            "evidence_content_id": _string(pattern=_EVIDENCE_ID),
            "run": _closed({"run_id": _ref("identifier"), "step": _integer(0)}, ("run_id", "step")),
            "incident_owner": _ref("identifier"),
            "binding": _closed(binding_items, BINDING_ITEMS),
            "last_known_good": _closed(
                {
                    "checkpoint_id": _ref("identifier"),
                    "step": _integer(0),
                    "verified_together": {
                        "type": "array",
                        "minItems": len(RECOVERY_PARTS),
                        "maxItems": len(RECOVERY_PARTS),
                        "uniqueItems": True,
                        "items": {"enum": list(RECOVERY_PARTS)},
                    },
                },
                ("checkpoint_id", "step", "verified_together"),
            ),
            "stages": _stages(),
        },
        "$defs": {
            "identifier": _string(pattern=f"^{IDENTIFIER.pattern}$"),
            "free_text": _string(maxLength=MAX_FREE_TEXT),
            "dtype": {"enum": list(DTYPES)},
            "relative_path": _string(
                minLength=1,
                allOf=[
                    {"not": {"pattern": "^/"}},
                    {"not": {"pattern": "\\\\"}},
                    {"not": {"pattern": "(^|/)\\.\\.(/|$)"}},
                ],
            ),
            "binding_detail": {"anyOf": [_string(), {"type": "number"}]},
            "tensor_entry": _tensor_entry(),
            "stage_record": _stage_record(),
        },
    }
