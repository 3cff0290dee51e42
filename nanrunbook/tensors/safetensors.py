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
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import count, repeat
from types import MappingProxyType
from typing import Any

from nanrunbook import strictjson
from nanrunbook.access import file_where, os_error
from nanrunbook.codes import SAFETENSORS_CODES as CODES
from nanrunbook.contract import TENSOR_HEADER_MAX_BYTES
from nanrunbook.dtypes import DTYPES
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.records import element_count, element_counts, frozen_records
from nanrunbook.strictjson import Dialect, pairs_of, parse_json

__all__ = [
    "CODES",
    "MAX_HEADER_LEN",
    "U64_MAX",
    "HeaderEntry",
    "TensorFileHeader",
    "read_header",
]

MAX_HEADER_LEN = TENSOR_HEADER_MAX_BYTES
U64_MAX = 2**64 - 1  # the format's integers, and so the most elements a file can hold
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
_METADATA = "__metadata__"


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

# The strict reader's rules, each a malformed header here. Control characters
# are not refused (the reference reader allows them; names are only shown
# quoted), and repeated keys are worded below, where their meaning is known.
HEADER_JSON = Dialect(
    codes={
        strictjson.NONFINITE: "HEADER_INVALID_JSON",
        strictjson.LONE_SURROGATE: "HEADER_INVALID_JSON",
        strictjson.TOO_DEEP: "HEADER_INVALID_JSON",
    },
    max_integer=U64_MAX,
)


def _is_u64(value: object) -> bool:
    # bool is an int subclass; floats such as 2.0 (or -0) are not integers either.
    return type(value) is int and 0 <= value <= U64_MAX


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


class _Refused(Exception):
    """One header violation that ends the reading: (code, message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def read_header(fd: int, relpath: str, *, max_header_len: int = MAX_HEADER_LEN) -> TensorFileHeader:
    """Read and check the safetensors header of an open tensor file.

    ``max_header_len`` is a tighter bound the caller derives from how many tensors the
    manifest binds to this file; the format's own cap (100,000,000) always applies.
    A length over either bound is refused before a single header byte is read.

    Raises EvidenceRejected listing every header violation found in the file.
    """
    where = file_where(relpath)  # names the file: messages do not repeat it
    try:
        size = os.fstat(fd).st_size
        header_len = _header_length(fd, size, max_header_len)
        data_start = 8 + header_len
        raw = _header_bytes(fd, relpath, header_len)
        plain = _plain_header(raw, data_start)
        root = plain[0] if plain is not None else _parse_header(raw)
    except _Refused as refused:
        raise EvidenceRejected([Violation(refused.code, where, str(refused))]) from None
    except OSError as err:
        raise os_error(relpath, err, "reading its header") from None

    violations: list[Violation] = []

    def add(code: str, message: str) -> None:
        violations.append(Violation(code, where, message))

    entries = _check_entries(
        root, size - data_start, data_start, add, plain[1] if plain is not None else None
    )
    if violations:
        raise EvidenceRejected(violations)
    return TensorFileHeader(
        path=relpath, size=size, data_start=data_start, entries=MappingProxyType(entries)
    )


def _header_length(fd: int, size: int, max_header_len: int) -> int:
    prefix = _read_exactly(fd, 8, 0) if size >= 8 else b""
    if len(prefix) < 8:
        raise _Refused(
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
        raise _Refused("HEADER_LENGTH_INVALID", problem)
    return header_len


def _header_bytes(fd: int, relpath: str, header_len: int) -> bytes:
    raw = _read_exactly(fd, header_len, 8)
    if len(raw) < header_len:
        raise _Refused("HEADER_LENGTH_INVALID", "the file shrank while its header was read")
    return raw


# The header rules but the depth: a tree :func:`_plain_header` takes is 3 deep.
_PLAIN_HEADER_JSON = Dialect(
    codes={k: v for k, v in HEADER_JSON.codes.items() if k != strictjson.TOO_DEEP},
    max_integer=HEADER_JSON.max_integer,
)


def _plain_header(raw: bytes, data_start: int) -> tuple[dict[str, Any], _Plain] | None:
    """The header as a writer writes it, read by orjson: its tree and its entries
    (:func:`_plain_entries`), or None, and :func:`_parse_header` reads it.

    :func:`~nanrunbook.strictjson.parse_floatless` asks that the tree hold no
    float; here every value is checked to be an entry of strings and integers,
    or a metadata string, so none can be (nor can the tree nest deeper than 3).
    """
    body = raw.rstrip(b" ")
    if not (body.startswith(b"{") and body.endswith(b"}")):
        return None
    root = strictjson.parse_floatless(body, _PLAIN_HEADER_JSON)
    if type(root) is not dict:
        return None
    metadata = root.get(_METADATA, {})
    if type(metadata) is not dict or not {*map(type, metadata.values())} <= {str}:
        return None
    plain = _plain_entries(root, data_start)
    return None if plain is None else (root, plain)


def _parse_header(raw: bytes) -> dict[str, Any]:
    """The header object, read by the strict reader under :data:`HEADER_JSON`."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        message = f"header is not UTF-8 (invalid byte at {err.start})"
        raise _Refused("HEADER_NOT_UTF8", message) from None
    if not raw.startswith(b"{"):
        raise _Refused("HEADER_INVALID_JSON", "header does not start with '{'")
    body = raw.rstrip(b" ")  # the reference writer pads with spaces, and only spaces
    if not body.endswith(b"}"):
        raise _Refused(
            "HEADER_INVALID_JSON", "header does not end with '}' followed only by space padding"
        )
    try:
        parsed = parse_json(body, HEADER_JSON)
    except json.JSONDecodeError as err:
        message = f"{err.msg} at byte {err.pos} of the header"
        raise _Refused("HEADER_INVALID_JSON", message) from None
    except RecursionError:
        message = "header nests too deep (a valid one is 3 deep)"
        raise _Refused("HEADER_INVALID_JSON", message) from None
    if parsed.violations:
        first = parsed.violations[0]  # one is enough: the header is not JSON the format allows
        raise _Refused(first.code, f"header {first.where}: {first.message}")
    if not isinstance(parsed.value, dict):
        raise _Refused("HEADER_INVALID_JSON", "header is not a JSON object")
    return parsed.value


_Add = Callable[[str, str], None]
# A tensor's byte range relative to the data area, with its header position
# (to keep header order among equal ranges) and name.
_Range = tuple[int, int, int, str]
_Plain = tuple[dict[str, HeaderEntry], list[_Range]]  # the entries, their ranges


def _check_entries(
    root: dict[str, Any], data_size: int, data_start: int, add: _Add, plain: _Plain | None = None
) -> dict[str, HeaderEntry]:
    """Every entry checked, and its range in the tiling; the well-formed ones returned.
    ``plain``: the root's :func:`_plain_entries`, when they were read already."""
    if plain is None:
        plain = _plain_entries(root, data_start)
    if plain is not None:
        if _METADATA in root:
            _check_metadata(root[_METADATA], add)
        if not _tiles_exactly(plain[1], data_size):
            _check_tiling(plain[1], data_size, data_start, True, add)
        return plain[0]
    entries: dict[str, HeaderEntry] = {}
    ranges: list[_Range] = []
    names: set[str] = set()
    all_ranges_known = True
    seen_metadata = False
    for index, (name, value) in enumerate(pairs_of(root)):
        if name == _METADATA:
            if seen_metadata:
                add("HEADER_FIELD_INVALID", "__metadata__ appears twice")
            seen_metadata = True
            _check_metadata(value, add)
            continue
        if name in names:
            add("HEADER_DUPLICATE_NAME", f"tensor {quote(name)} appears more than once")
        names.add(name)
        begin, end, entry = _detailed_entry(name, value, data_start, add)
        if begin is None or end is None:
            all_ranges_known = False
            continue
        ranges.append((begin, end, index, name))
        if entry is not None and name not in entries:
            entries[name] = entry
    _check_tiling(ranges, data_size, data_start, all_ranges_known, add)
    return entries


_Entry = tuple[int | None, int | None, "HeaderEntry | None"]  # range (None: unknown), record
_FIELDS = operator.itemgetter(*_TENSOR_FIELDS)


def _plain_entries(root: dict[str, Any], data_start: int) -> _Plain | None:
    """Every tensor entry of a header as a writer writes them, read column by column.

    Each test runs over a whole column in C (``map``, ``set``, ``zip``) instead of
    field by field in Python. None unless every entry is well-formed: then
    :func:`_detailed_entry` reads each one again and words each problem. It accepts
    every entry this accepts, with the same result (tests/test_parse_fast.py).
    The ranges are for :func:`_check_tiling`.
    """
    if type(root) is not dict:  # repeated names: the detailed path words them
        return None
    names = list(root)
    if _METADATA in root:
        names.remove(_METADATA)
    values = list(map(root.__getitem__, names))
    if set(map(type, values)) != {dict} or set(map(len, values)) != {len(_TENSOR_FIELDS)}:
        return None
    try:
        dtypes, shapes, offsets = zip(*map(_FIELDS, values), strict=True)
    except KeyError:
        return None
    if set(map(type, dtypes)) != {str}:
        return None
    kinds = set(dtypes)
    if not DTYPES.keys() >= kinds:
        return None
    if set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    begins, ends = zip(*offsets, strict=True)
    if {*map(type, begins), *map(type, ends)} != {int} or min(begins) < 0 or max(ends) > U64_MAX:
        return None
    if not all(map(operator.le, begins, ends)):
        return None
    elements = element_counts(shapes, U64_MAX, dim_limit=U64_MAX)
    if elements is None or list(map(operator.sub, ends, begins)) != _byte_lengths(
        elements, dtypes, kinds
    ):
        return None
    records = frozen_records(
        HeaderEntry,
        names,
        dtypes,
        map(tuple, shapes),
        map(operator.add, begins, repeat(data_start)),
        map(operator.add, ends, repeat(data_start)),
    )
    return dict(zip(names, records, strict=True)), list(zip(begins, ends, count(), names))


def _byte_lengths(elements: list[int], dtypes: tuple[str, ...], kinds: set[str]) -> list[int]:
    """Each tensor's byte length, or ``[-1]`` when a sub-byte tensor ends mid-byte."""
    if len(kinds) == 1 and DTYPES[next(iter(kinds))].bits % 8 == 0:  # the common file
        return list(map(operator.mul, elements, repeat(DTYPES[dtypes[0]].bits // 8)))
    bits = list(map(operator.mul, elements, map(_BITS.__getitem__, dtypes)))
    if set(map(operator.mod, bits, repeat(8))) != {0}:
        return [-1]
    return list(map(operator.floordiv, bits, repeat(8)))


_BITS = {name: dtype.bits for name, dtype in DTYPES.items()}


def _tiles_exactly(ranges: list[_Range], data_size: int) -> bool:
    """Whether the ranges, in order, each begin where the one before ended, from 0
    to the end of the data area: then :func:`_check_tiling` has nothing to say."""
    begins, ends, _, _ = zip(*sorted(ranges), strict=True)
    return begins[0] == 0 and ends[-1] == data_size and begins[1:] == ends[:-1]


def _detailed_entry(name: str, value: Any, data_start: int, add: _Add) -> _Entry:
    """An entry's range (None when unknown) and, when it is well-formed, its record;
    every problem reported through ``add``."""
    tensor = quote(name)
    if not isinstance(value, dict):
        add("HEADER_FIELD_INVALID", f"tensor {tensor}: entry is not an object")
        return None, None, None
    fields = _entry_fields(value, tensor, add)
    dtype = fields.get("dtype")
    if "dtype" in fields and not isinstance(dtype, str):
        add("HEADER_FIELD_INVALID", f"tensor {tensor}: dtype is not a string")
        dtype = None
    elif isinstance(dtype, str) and dtype not in DTYPES:
        add("HEADER_DTYPE_UNKNOWN", f"tensor {tensor}: unknown dtype {quote(dtype)}")
        dtype = None
    shape = fields.get("shape")
    if "shape" in fields and not (isinstance(shape, list) and all(_is_u64(d) for d in shape)):
        message = f"tensor {tensor}: shape is not a list of integers in [0, 2^64-1]"
        add("HEADER_FIELD_INVALID", message)
        shape = None
    offsets = fields.get("data_offsets")
    if "data_offsets" in fields and not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_u64(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        message = f"tensor {tensor}: data_offsets is not two integers 0 <= begin <= end < 2^64"
        add("HEADER_FIELD_INVALID", message)
        offsets = None
    if offsets is None:
        return None, None, None
    begin, end = offsets
    if (
        dtype is None
        or shape is None
        or not _length_matches(tensor, dtype, shape, end - begin, add)
    ):
        return begin, end, None
    return begin, end, HeaderEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _entry_fields(value: dict[str, Any], tensor: str, add: _Add) -> dict[str, Any]:
    """The entry's known fields, first value of each; unknown, repeated and missing
    fields reported."""
    fields: dict[str, Any] = {}
    for key, item in pairs_of(value):
        if key not in _TENSOR_FIELDS:
            add("HEADER_FIELD_UNKNOWN", f"tensor {tensor}: unknown field {quote(key)}")
        elif key in fields:
            add("HEADER_FIELD_INVALID", f"tensor {tensor}: field {key!r} appears twice")
        else:
            fields[key] = item
    for key in _TENSOR_FIELDS:
        if key not in fields:
            add("HEADER_FIELD_INVALID", f"tensor {tensor}: field {key!r} is missing")
    return fields


def _length_matches(tensor: str, dtype: str, shape: list[int], length: int, add: _Add) -> bool:
    """Whether the byte range length is what the dtype and shape need."""
    elements = element_count(shape, U64_MAX)
    expected = None if elements is None else DTYPES[dtype].nbytes(elements)
    if elements is None:
        add(
            "HEADER_LENGTH_MISMATCH",
            f"tensor {tensor}: byte range is {length} bytes but {dtype}"
            f" shape {quote(shape)} has more than 2^64 elements",
        )
    elif expected is None:
        add(
            "HEADER_SUBBYTE_ALIGNMENT",
            f"tensor {tensor}: {elements} {dtype} elements are {elements * DTYPES[dtype].bits}"
            " bits, not a whole number of bytes",
        )
    elif length != expected:
        add(
            "HEADER_LENGTH_MISMATCH",
            f"tensor {tensor}: byte range is {length} bytes but {dtype}"
            f" shape {quote(shape)} needs {expected}",
        )
    return elements is not None and expected == length


def _check_metadata(value: Any, add: _Add) -> None:
    if not isinstance(value, dict):
        add("HEADER_FIELD_INVALID", "__metadata__ is not an object")
        return
    keys: set[str] = set()
    for key, item in pairs_of(value):
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
    past = [r for r in ranges if r[1] > data_size]
    if past:
        needed = max(end for _, end, _, _ in past)
        if complete and not _tiling_problems(ranges, needed, complete):
            add(
                "FILE_TRUNCATED",
                f"the file has {data_start + data_size} bytes but its header's byte ranges"
                f" need {data_start + needed}: cut short (still being written, or copied in"
                " part)",
            )
        else:
            begin, end, _, name = past[0]
            more = f" (and {len(past) - 1} more)" if len(past) > 1 else ""
            add(
                "HEADER_OFFSETS_INVALID",
                f"tensor {quote(name)}: byte range [{begin}, {end}) runs past"
                f" the end of the {data_size}-byte data area{more}",
            )
    for problem in _tiling_problems(ranges, data_size, complete):
        add("HEADER_OFFSETS_INVALID", problem)


def _tiling_problems(ranges: list[_Range], data_size: int, complete: bool) -> list[str]:
    """Gaps, overlaps and trailing bytes of the ranges within [0, data_size)."""
    problems: list[str] = []
    cursor = 0
    holder: _Range | None = None  # the range that reached ``cursor``
    for here in sorted(ranges):  # by (begin, end), then header order
        begin, end, _, name = here
        if begin > cursor:
            gap_end = min(begin, data_size)
            if complete and gap_end > cursor:
                problems.append(
                    f"gap of {gap_end - cursor} unbound bytes at data offset {cursor},"
                    f" before tensor {quote(name)}"
                )
        elif begin < cursor and holder is not None:
            problems.append(
                f"tensor {quote(name)}: byte range [{begin}, {end}) overlaps tensor"
                f" {quote(holder[3])} [{holder[0]}, {holder[1]})"
            )
        if end >= cursor:
            cursor, holder = end, here
    if complete and cursor < data_size:
        problems.append(
            f"{data_size - cursor} trailing bytes at data offset {cursor} are not bound by"
            " any tensor"
        )
    return problems
