"""Tensor files inside a bundle: safe resolution and a strict safetensors header parser.

Spec section 1: a tensor file is named by a relative path that stays inside the
bundle after symlinks are resolved and names a regular file; its header is checked
at least as strictly as the safetensors format asks, stricter than the reference
reader (which accepts duplicate names and unknown fields).

Only the header is read here, with ``os.pread`` and never more than the declared
length, after that length was compared with the file size and the caller's bound.
Tensor names are untrusted: they appear only quoted in messages, never in ``where``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from nanrunbook.access import file_where, os_error
from nanrunbook.dtypes import DTYPES
from nanrunbook.errors import EvidenceRejected, Violation, quote

__all__ = [
    "CODES",
    "MAX_HEADER_LEN",
    "HeaderEntry",
    "TensorFileHeader",
    "read_header",
]

MAX_HEADER_LEN = 100_000_000
_U64_MAX = 2**64 - 1
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
_METADATA = "__metadata__"

CODES: dict[str, str] = {
    "HEADER_LENGTH_INVALID": (
        "the 8-byte header length is missing, zero, above the bound, or past the end of the file"
    ),
    "HEADER_NOT_UTF8": "a safetensors header is not UTF-8",
    "HEADER_INVALID_JSON": (
        "a safetensors header is not one JSON object from '{' to '}' (space padding allowed),"
        " uses NaN/Infinity, or nests too deep"
    ),
    "HEADER_DUPLICATE_NAME": "a safetensors header names the same tensor twice",
    "HEADER_FIELD_UNKNOWN": "a tensor entry has a field other than dtype, shape, data_offsets",
    "HEADER_FIELD_INVALID": (
        "a tensor entry or __metadata__ is missing a field, repeats one, or has the wrong type"
    ),
    "HEADER_DTYPE_UNKNOWN": "a tensor entry has a dtype the safetensors format does not define",
    "HEADER_LENGTH_MISMATCH": "a tensor's byte range length does not match its dtype and shape",
    "HEADER_SUBBYTE_ALIGNMENT": (
        "a sub-byte dtype tensor's element count times bit width is not a multiple of 8"
    ),
    "HEADER_OFFSETS_INVALID": (
        "tensor byte ranges do not tile the data area exactly (gap, overlap or trailing bytes)"
    ),
    "FILE_TRUNCATED": "a tensor file is shorter than its header's byte ranges need (cut short)",
}


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor of a safetensors header; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # 8 + header_len + data_offsets[0]
    end: int  # absolute, exclusive


@dataclass(frozen=True, slots=True)
class TensorFileHeader:
    """A checked header: every tensor of the file, in header order."""

    path: str  # the manifest's relative path, for messages
    size: int  # file size from fstat
    data_start: int  # 8 + header_len
    entries: Mapping[str, HeaderEntry]


# -------------------------------------------------------------------------- header


class _Object:
    """A parsed JSON object, every key/value pair kept in order (duplicates included)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


class _HugeInteger:
    """An integer literal too long to be a u64 (kept out of ``int()``, which is slow)."""

    __slots__ = ()


class _NonFiniteLiteral(ValueError):
    pass


def _parse_int(text: str) -> int | _HugeInteger:
    return _HugeInteger() if len(text.lstrip("-")) > 20 else int(text)


def _parse_constant(text: str) -> Any:
    raise _NonFiniteLiteral(text)


_DECODER = json.JSONDecoder(
    object_pairs_hook=_Object,
    parse_int=_parse_int,
    parse_constant=_parse_constant,
)


def _is_u64(value: object) -> bool:
    # bool is an int subclass; floats such as 2.0 are not integers either.
    return type(value) is int and 0 <= value <= _U64_MAX


def _read_exactly(fd: int, count: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < count:
        chunk = os.pread(fd, count - got, offset + got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


@dataclass(slots=True)
class _Range:
    name: str
    begin: int  # relative to the data area
    end: int


def read_header(fd: int, relpath: str, *, max_header_len: int = MAX_HEADER_LEN) -> TensorFileHeader:
    """Read and check the safetensors header of an open tensor file.

    ``max_header_len`` is a tighter bound the caller derives from how many tensors the
    manifest binds to this file; the format's own cap (100,000,000) always applies.
    A length over either bound is refused before a single header byte is read.

    Raises EvidenceRejected listing every header violation found in the file.
    """
    where = file_where(relpath)  # names the file: messages do not repeat it

    def fail(code: str, message: str) -> EvidenceRejected:
        return EvidenceRejected([Violation(code, where, message)])

    try:
        size = os.fstat(fd).st_size
        prefix = _read_exactly(fd, 8, 0) if size >= 8 else b""
    except OSError as err:
        raise os_error(relpath, err, "reading its header length") from None
    if len(prefix) < 8:
        raise fail(
            "HEADER_LENGTH_INVALID",
            f"the file is {size} bytes, shorter than the 8-byte header length",
        )
    header_len = int.from_bytes(prefix, "little")
    problem = None
    if header_len == 0:
        problem = "header length is 0"
    elif header_len > MAX_HEADER_LEN:
        problem = f"header length {header_len} is above the format's cap of {MAX_HEADER_LEN}"
    elif header_len > max_header_len:
        problem = (
            f"header length {header_len} is above {max_header_len}, the bound for the number"
            " of tensors the manifest binds to this file; refused without reading it"
        )
    elif 8 + header_len > size:
        problem = f"header length {header_len} runs past the end of the {size}-byte file"
    if problem is not None:
        raise fail("HEADER_LENGTH_INVALID", problem)

    try:
        raw = _read_exactly(fd, header_len, 8)
    except OSError as err:
        raise os_error(relpath, err, "reading its header") from None
    if len(raw) < header_len:
        raise fail("HEADER_LENGTH_INVALID", "the file shrank while its header was read")

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise fail(
            "HEADER_NOT_UTF8", f"header is not UTF-8 (invalid byte at {err.start})"
        ) from None
    if not text.startswith("{"):
        raise fail("HEADER_INVALID_JSON", "header does not start with '{'")
    body = text.rstrip(" ")  # the reference writer pads with spaces, and only spaces
    if not body.endswith("}"):
        raise fail(
            "HEADER_INVALID_JSON", "header does not end with '}' followed only by space padding"
        )
    try:
        parsed = _DECODER.decode(body)
    except _NonFiniteLiteral as err:
        raise fail("HEADER_INVALID_JSON", f"header uses the literal {quote(err)}") from None
    except json.JSONDecodeError as err:
        raise fail("HEADER_INVALID_JSON", f"{err.msg} at byte {err.pos} of the header") from None
    except RecursionError:
        raise fail("HEADER_INVALID_JSON", "header nests too deep (a valid one is 3 deep)") from None
    except ValueError as err:  # defensive: any other literal the decoder refuses
        raise fail("HEADER_INVALID_JSON", f"header is not valid JSON ({quote(err)})") from None
    if not isinstance(parsed, _Object):
        raise fail("HEADER_INVALID_JSON", "header is not a JSON object")

    data_start = 8 + header_len
    violations, entries = _check_entries(parsed, size - data_start, data_start, where)
    if violations:
        raise EvidenceRejected(violations)
    return TensorFileHeader(
        path=relpath, size=size, data_start=data_start, entries=MappingProxyType(entries)
    )


def _check_entries(
    root: _Object, data_size: int, data_start: int, where: str
) -> tuple[list[Violation], dict[str, HeaderEntry]]:
    violations: list[Violation] = []

    def add(code: str, message: str) -> None:
        violations.append(Violation(code, where, message))

    entries: dict[str, HeaderEntry] = {}
    ranges: list[_Range] = []
    names: set[str] = set()
    all_ranges_known = True
    seen_metadata = False
    for name, value in root.pairs:
        if name == _METADATA:
            if seen_metadata:
                add("HEADER_FIELD_INVALID", "__metadata__ appears twice")
            seen_metadata = True
            _check_metadata(value, add)
            continue
        tensor = quote(name)
        if name in names:
            add("HEADER_DUPLICATE_NAME", f"tensor {tensor} appears more than once")
        names.add(name)
        if not isinstance(value, _Object):
            add("HEADER_FIELD_INVALID", f"tensor {tensor}: entry is not an object")
            all_ranges_known = False
            continue
        fields: dict[str, Any] = {}
        for key, item in value.pairs:
            if key not in _TENSOR_FIELDS:
                add("HEADER_FIELD_UNKNOWN", f"tensor {tensor}: unknown field {quote(key)}")
            elif key in fields:
                add("HEADER_FIELD_INVALID", f"tensor {tensor}: field {key!r} appears twice")
            else:
                fields[key] = item
        for key in _TENSOR_FIELDS:
            if key not in fields:
                add("HEADER_FIELD_INVALID", f"tensor {tensor}: field {key!r} is missing")

        dtype = fields.get("dtype")
        if "dtype" in fields and not isinstance(dtype, str):
            add("HEADER_FIELD_INVALID", f"tensor {tensor}: dtype is not a string")
            dtype = None
        elif isinstance(dtype, str) and dtype not in DTYPES:
            add("HEADER_DTYPE_UNKNOWN", f"tensor {tensor}: unknown dtype {quote(dtype)}")
            dtype = None

        shape = fields.get("shape")
        if "shape" in fields and not (
            isinstance(shape, list) and all(_is_u64(dim) for dim in shape)
        ):
            add(
                "HEADER_FIELD_INVALID",
                f"tensor {tensor}: shape is not a list of integers in [0, 2^64-1]",
            )
            shape = None

        offsets = fields.get("data_offsets")
        if "data_offsets" in fields and not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_u64(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            add(
                "HEADER_FIELD_INVALID",
                f"tensor {tensor}: data_offsets is not two integers 0 <= begin <= end < 2^64",
            )
            offsets = None
        if offsets is None:
            all_ranges_known = False
            continue
        begin, end = offsets
        ranges.append(_Range(name, begin, end))

        if dtype is None or shape is None:
            continue
        elements = _element_count(shape)
        expected = None if elements is None else DTYPES[dtype].nbytes(elements)
        if elements is None:
            add(
                "HEADER_LENGTH_MISMATCH",
                f"tensor {tensor}: byte range is {end - begin} bytes but {dtype}"
                f" shape {quote(shape)} has more than 2^64 elements",
            )
        elif expected is None:
            add(
                "HEADER_SUBBYTE_ALIGNMENT",
                f"tensor {tensor}: {elements} {dtype} elements are {elements * DTYPES[dtype].bits}"
                " bits, not a whole number of bytes",
            )
        elif end - begin != expected:
            add(
                "HEADER_LENGTH_MISMATCH",
                f"tensor {tensor}: byte range is {end - begin} bytes but {dtype}"
                f" shape {quote(shape)} needs {expected}",
            )
        elif name not in entries:
            entries[name] = HeaderEntry(
                name, dtype, tuple(shape), data_start + begin, data_start + end
            )

    _check_tiling(ranges, data_size, data_start, all_ranges_known, add)
    return violations, entries


def _element_count(shape: list[int]) -> int | None:
    """Product of the dims (1 for a scalar), or None past 2^64 elements.

    Python ints never overflow, but a long shape of huge dims would make one huge
    product slowly; no file can hold 2^64 elements, so stop there.
    """
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > _U64_MAX:
            return None
    return count


_Add = Callable[[str, str], None]


def _check_metadata(value: Any, add: _Add) -> None:
    if not isinstance(value, _Object):
        add("HEADER_FIELD_INVALID", "__metadata__ is not an object")
        return
    keys: set[str] = set()
    for key, item in value.pairs:
        if key in keys:
            add("HEADER_FIELD_INVALID", f"__metadata__ key {quote(key)} appears twice")
        keys.add(key)
        if not isinstance(item, str):
            add("HEADER_FIELD_INVALID", f"__metadata__ value of {quote(key)} is not a string")


def _check_tiling(
    ranges: list[_Range], data_size: int, data_start: int, complete: bool, add: _Add
) -> None:
    """The byte ranges, sorted by (begin, end), must tile [0, data_size) exactly.

    Each range must begin where the previous one ended; a zero-length range is fine on
    any boundary of the tiling (so also at 0 and at the end) but one strictly inside
    another range counts as an overlap, as in the reference reader. When some entry's
    range is unknown (invalid data_offsets), gaps and trailing bytes are not reported:
    the missing range might fill them; overlaps still are.

    Ranges past the end of the file are one violation, however many there are: a
    FILE_TRUNCATED when the ranges would tile a longer file exactly (the file was cut
    short), else a HEADER_OFFSETS_INVALID (the header is wrong anyway).
    """
    past = [r for r in ranges if r.end > data_size]
    if past:
        needed = max(r.end for r in past)
        if complete and not _tiling_problems(ranges, needed, complete):
            add(
                "FILE_TRUNCATED",
                f"the file has {data_start + data_size} bytes but its header's byte ranges"
                f" need {data_start + needed}: cut short (still being written, or copied in"
                " part)",
            )
        else:
            first = past[0]
            more = f" (and {len(past) - 1} more)" if len(past) > 1 else ""
            add(
                "HEADER_OFFSETS_INVALID",
                f"tensor {quote(first.name)}: byte range [{first.begin}, {first.end}) runs past"
                f" the end of the {data_size}-byte data area{more}",
            )
    for problem in _tiling_problems(ranges, data_size, complete):
        add("HEADER_OFFSETS_INVALID", problem)


def _tiling_problems(ranges: list[_Range], data_size: int, complete: bool) -> list[str]:
    """Gaps, overlaps and trailing bytes of the ranges within [0, data_size)."""
    problems: list[str] = []
    cursor = 0
    holder: _Range | None = None  # the range that reached ``cursor``
    for r in sorted(ranges, key=lambda r: (r.begin, r.end)):
        if r.begin > cursor:
            gap_end = min(r.begin, data_size)
            if complete and gap_end > cursor:
                problems.append(
                    f"gap of {gap_end - cursor} unbound bytes at data offset {cursor},"
                    f" before tensor {quote(r.name)}"
                )
        elif r.begin < cursor and holder is not None:
            problems.append(
                f"tensor {quote(r.name)}: byte range [{r.begin}, {r.end}) overlaps tensor"
                f" {quote(holder.name)} [{holder.begin}, {holder.end})"
            )
        if r.end >= cursor:
            cursor, holder = r.end, r
    if complete and cursor < data_size:
        problems.append(
            f"{data_size - cursor} trailing bytes at data offset {cursor} are not bound by"
            " any tensor"
        )
    return problems
