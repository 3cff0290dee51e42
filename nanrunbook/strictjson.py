"""Strict JSON for manifest.json: lexical rules the standard library lets through.

``json.loads`` accepts duplicate keys, ``NaN``/``Infinity`` literals, number
literals that overflow to infinity and integers of any size. The spec rejects all
of them, with the JSON path of each, so the hooks below never raise: they leave
markers in the parsed tree and :func:`lexical_violations` collects them all in one
walk, together with control characters and excessive nesting.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nanrunbook.errors import EvidenceRejected, Violation, quote

__all__ = [
    "CODES",
    "MAX_DEPTH",
    "MAX_SAFE_INTEGER",
    "child_path",
    "has_control_character",
    "load_manifest_bytes",
]

MAX_DEPTH = 32
MAX_SAFE_INTEGER = 2**53 - 1

CODES = {
    "MANIFEST_NOT_UTF8": "manifest.json is not UTF-8, or starts with a byte-order mark",
    "MANIFEST_INVALID_JSON": "manifest.json is not one well-formed JSON value",
    "MANIFEST_TOO_DEEP": "manifest.json nests objects and arrays more than 32 deep",
    "MANIFEST_NOT_OBJECT": "manifest.json is not a JSON object",
    "JSON_DUPLICATE_KEY": "an object repeats a key",
    "JSON_NONFINITE_NUMBER": "a NaN or Infinity literal, or a number that overflows to infinity",
    "JSON_INTEGER_OUT_OF_RANGE": "an integer outside +-(2^53 - 1), the RFC 8785 safe range",
    "JSON_CONTROL_CHARACTER": "a string or key contains a C0, DEL or C1 control character",
    "JSON_LONE_SURROGATE": "a string or key escapes a lone UTF-16 surrogate, which has no UTF-8 form",
}

_SAFE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class NonFiniteNumber:
    """Marker for a ``NaN``/``Infinity`` literal or an overflowing number."""

    text: str


@dataclass(frozen=True, slots=True)
class OutOfRangeInteger:
    """Marker for an integer literal outside the safe range."""

    text: str


class ObjectWithDuplicates(dict[str, Any]):
    """A parsed object that repeated keys; the first value of each key is kept."""

    duplicates: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    repeated: list[str] = []
    for key, value in pairs:
        if key in result:
            repeated.append(key)
        else:
            result[key] = value
    if not repeated:
        return result
    marked = ObjectWithDuplicates(result)
    marked.duplicates = tuple(repeated)
    return marked


def _parse_int(text: str) -> int | OutOfRangeInteger:
    # Length first: int() of a huge literal is slow and raises past 4300 digits.
    if len(text) > 20:
        return OutOfRangeInteger(text)
    value = int(text)
    return value if abs(value) <= MAX_SAFE_INTEGER else OutOfRangeInteger(text)


def _parse_float(text: str) -> float | NonFiniteNumber:
    value = float(text)
    return value if math.isfinite(value) else NonFiniteNumber(text)


_DECODER = json.JSONDecoder(
    object_pairs_hook=_object_pairs,
    parse_int=_parse_int,
    parse_float=_parse_float,
    parse_constant=NonFiniteNumber,
)


def child_path(path: str, key: str | int) -> str:
    """JSON path of a child; untrusted keys are shown quoted and escaped."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _SAFE_KEY.fullmatch(key):
        return f"{path}.{key}"
    return f"{path}[{quote(key)}]"


def has_control_character(text: str) -> bool:
    """True for C0, DEL and C1 controls (category Cc)."""
    return any(unicodedata.category(ch) == "Cc" for ch in text)


def _string_violations(text: str, path: str, what: str) -> Iterator[Violation]:
    if has_control_character(text):
        yield Violation("JSON_CONTROL_CHARACTER", path, f"{what} has a control character")
    if any(unicodedata.category(ch) == "Cs" for ch in text):
        yield Violation("JSON_LONE_SURROGATE", path, f"{what} has a lone surrogate escape")


def _walk(value: Any, path: str, depth: int) -> Iterator[Violation]:
    if isinstance(value, dict):
        depth += 1
        if depth > MAX_DEPTH:
            yield Violation("MANIFEST_TOO_DEEP", path, f"nesting passes {MAX_DEPTH} levels here")
            return
        for key in getattr(value, "duplicates", ()):
            yield Violation(
                "JSON_DUPLICATE_KEY", child_path(path, key), f"key {quote(key)} appears twice"
            )
        for key, item in value.items():
            yield from _string_violations(key, child_path(path, key), "key")
            yield from _walk(item, child_path(path, key), depth)
    elif isinstance(value, list):
        depth += 1
        if depth > MAX_DEPTH:
            yield Violation("MANIFEST_TOO_DEEP", path, f"nesting passes {MAX_DEPTH} levels here")
            return
        for index, item in enumerate(value):
            yield from _walk(item, child_path(path, index), depth)
    elif isinstance(value, str):
        yield from _string_violations(value, path, "string")
    elif isinstance(value, NonFiniteNumber):
        yield Violation(
            "JSON_NONFINITE_NUMBER", path, f"{quote(value.text)} is not a finite number"
        )
    elif isinstance(value, OutOfRangeInteger):
        yield Violation("JSON_INTEGER_OUT_OF_RANGE", path, "integer is outside +-(2^53 - 1)")


def lexical_violations(value: Any) -> list[Violation]:
    """Every lexical violation left as a marker in a parsed tree, in document order."""
    return list(_walk(value, "$", 0))


def load_manifest_bytes(raw: bytes) -> dict[str, Any]:
    """Parse manifest bytes strictly; raise EvidenceRejected listing every lexical violation.

    The result is a plain tree of dict, list, str, int, float, bool and None.
    """
    if raw.startswith(b"\xef\xbb\xbf"):
        raise EvidenceRejected(
            [Violation("MANIFEST_NOT_UTF8", "manifest.json", "starts with a UTF-8 byte-order mark")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise EvidenceRejected(
            [Violation("MANIFEST_NOT_UTF8", "manifest.json", f"invalid UTF-8 at byte {err.start}")]
        ) from None
    try:
        value = _DECODER.decode(text)
    except json.JSONDecodeError as err:
        raise EvidenceRejected(
            [
                Violation(
                    "MANIFEST_INVALID_JSON",
                    "manifest.json",
                    f"{err.msg} at line {err.lineno} column {err.colno}",
                )
            ]
        ) from None
    except RecursionError:
        raise EvidenceRejected(
            [Violation("MANIFEST_TOO_DEEP", "manifest.json", f"nesting passes {MAX_DEPTH} levels")]
        ) from None
    violations = lexical_violations(value)
    if not isinstance(value, dict):
        violations.insert(
            0, Violation("MANIFEST_NOT_OBJECT", "$", "the manifest must be one JSON object")
        )
    if violations:
        raise EvidenceRejected(violations)
    assert isinstance(value, dict)
    return value
