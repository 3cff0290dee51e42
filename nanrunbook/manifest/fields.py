"""Typed field access over a parsed JSON object, collecting violations as it goes.

Each accessor returns the value when it has the right type and form, otherwise
None after recording one violation, so a parser can read every field of a record
and report all that is wrong in one pass.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from nanrunbook.codes import FIELD_CODES as CODES
from nanrunbook.contract import (
    IDENTIFIER_MAX_CHARS,
    IDENTIFIER_PATTERN,
    MAX_FREE_TEXT,
    MAX_TENSOR_NAME,
)
from nanrunbook.errors import Violation, quote
from nanrunbook.strictjson import child_path

__all__ = ["CODES", "IDENTIFIER", "MAX_FREE_TEXT", "MAX_TENSOR_NAME", "Fields", "Sink"]

IDENTIFIER = re.compile(IDENTIFIER_PATTERN)


class Sink:
    """Where violations collect."""

    def __init__(self) -> None:
        self.violations: list[Violation] = []

    def add(self, code: str, where: str, message: str) -> None:
        self.violations.append(Violation(code, where, message))

    def __len__(self) -> int:
        return len(self.violations)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction or exponent"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class Fields:
    """One JSON object at ``path``: checks its key set, then typed reads."""

    def __init__(
        self,
        sink: Sink,
        value: Any,
        path: str,
        *,
        required: Collection[str],
        optional: Collection[str] = (),
        open_ended: bool = False,
    ) -> None:
        self.sink = sink
        self.path = path
        self.ok = isinstance(value, dict)
        self.data: dict[str, Any] = value if isinstance(value, dict) else {}
        if not self.ok:
            sink.add("FIELD_TYPE", path, f"expected an object, got {json_type(value)}")
            return
        for key in required:
            if key not in self.data:
                sink.add(
                    "FIELD_MISSING", child_path(path, key), f"required field {key!r} is absent"
                )
        if not open_ended:
            known = set(required) | set(optional)
            for key in self.data:
                if key not in known:
                    sink.add("FIELD_UNKNOWN", child_path(path, key), f"unknown field {quote(key)}")

    def has(self, key: str) -> bool:
        return key in self.data

    def at(self, key: str) -> str:
        return child_path(self.path, key)

    def _wrong(self, key: str, expected: str) -> None:
        got = json_type(self.data[key])
        self.sink.add("FIELD_TYPE", self.at(key), f"expected {expected}, got {got}")

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def string(self, key: str) -> str | None:
        if key not in self.data:
            return None
        value = self.data[key]
        if not isinstance(value, str):
            self._wrong(key, "a string")
            return None
        return value

    def identifier(self, key: str) -> str | None:
        value = self.string(key)
        if value is not None and not IDENTIFIER.fullmatch(value):
            self.sink.add(
                "IDENTIFIER_INVALID",
                self.at(key),
                f"{quote(value)} is not an identifier (letters, digits, ._:@/+=-,"
                f" at most {IDENTIFIER_MAX_CHARS})",
            )
            return None
        return value

    def text(self, key: str) -> str | None:
        value = self.string(key)
        if value is not None and (len(value) > MAX_FREE_TEXT or not value.isprintable()):
            self.sink.add(
                "TEXT_INVALID",
                self.at(key),
                f"free text must be printable and at most {MAX_FREE_TEXT} characters",
            )
            return None
        return value

    def tensor_name(self, key: str) -> str | None:
        value = self.string(key)
        if value is not None and not (1 <= len(value) <= MAX_TENSOR_NAME and value.isprintable()):
            self.sink.add(
                "TENSOR_NAME_INVALID",
                self.at(key),
                f"a tensor name must be printable and 1 to {MAX_TENSOR_NAME} characters",
            )
            return None
        return value

    def choice(self, key: str, choices: Collection[str]) -> str | None:
        value = self.string(key)
        if value is not None and value not in choices:
            allowed = ", ".join(sorted(choices)) if len(choices) <= 8 else "a known value"
            self.sink.add(
                "VALUE_NOT_ALLOWED", self.at(key), f"{quote(value)} is not one of: {allowed}"
            )
            return None
        return value

    def integer(self, key: str, *, minimum: int | None = None) -> int | None:
        if key not in self.data:
            return None
        value = self.data[key]
        if not is_integer(value):
            self._wrong(key, "an integer")
            return None
        if minimum is not None and value < minimum:
            self.sink.add("FIELD_OUT_OF_RANGE", self.at(key), f"must be >= {minimum}")
            return None
        return int(value)

    def number(self, key: str) -> float | None:
        if key not in self.data:
            return None
        value = self.data[key]
        if not is_number(value):
            self._wrong(key, "a number")
            return None
        return float(value)

    def boolean(self, key: str) -> bool | None:
        if key not in self.data:
            return None
        value = self.data[key]
        if not isinstance(value, bool):
            self._wrong(key, "a boolean")
            return None
        return value

    def array(self, key: str) -> list[Any] | None:
        if key not in self.data:
            return None
        value = self.data[key]
        if not isinstance(value, list):
            self._wrong(key, "an array")
            return None
        return value
