"""Tests for nanrunbook.tensors.safetensors: safe resolution and the strict safetensors header."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from nanrunbook.access import check_relative_path, open_in_bundle
from nanrunbook.codes import CODES
from nanrunbook.errors import EvidenceRejected
from nanrunbook.tensors import safetensors as tensorfile
from nanrunbook.tensors.safetensors import HeaderEntry, TensorFileHeader, read_header

# ----------------------------------------------------------------------------- helpers


def raw_file(header: bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def hdr(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def entry(dtype: str, shape: list[Any], begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    b = tmp_path / "bundle"
    b.mkdir()
    return b


def parse(path: Path, content: bytes, **kw: Any) -> TensorFileHeader:
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(fd, "t.safetensors", **kw)
    finally:
        os.close(fd)


def rejected(path: Path, content: bytes, **kw: Any) -> EvidenceRejected:
    with pytest.raises(EvidenceRejected) as info:
        parse(path, content, **kw)
    for v in info.value.violations:
        assert v.code in CODES
        assert v.where == "t.safetensors"
        assert "t.safetensors" not in v.message  # issue 10: the where is not repeated
    return info.value


def codes(path: Path, content: bytes, **kw: Any) -> list[str]:
    return list(rejected(path, content, **kw).codes)


@pytest.fixture
def f(tmp_path: Path) -> Path:
    return tmp_path / "t.safetensors"


# ---------------------------------------------------------------- reference writer


def test_reference_writer_output_accepted_with_padding_scalar_and_empty(f: Path) -> None:
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "scalar": np.array(1.5, dtype=np.float32),
        "ids": np.arange(3, dtype=np.int8),
        "h": np.ones((5,), dtype=np.float16),
    }
    content = st_save(tensors, metadata={"producer": "test"})
    n = struct.unpack("<Q", content[:8])[0]
    assert content[8 : 8 + n].endswith(b" "), "reference writer is expected to pad"
    header = parse(f, content)
    assert header.size == len(content)
    assert header.data_start == 8 + n
    assert set(header.entries) == set(tensors)  # __metadata__ is not a tensor
    order = [k for k in json.loads(content[8 : 8 + n]) if k != "__metadata__"]
    assert list(header.entries) == order
    for name, array in tensors.items():
        e = header.entries[name]
        assert isinstance(e, HeaderEntry)
        assert e.name == name
        assert e.shape == array.shape
        assert content[e.begin : e.end] == array.tobytes()
    assert header.entries["scalar"].shape == ()
    assert header.entries["empty"].begin == header.entries["empty"].end


def test_reference_writer_file_through_open_in_bundle(bundle: Path) -> None:
    (bundle / "t.safetensors").write_bytes(st_save({"a": np.ones((4,), dtype=np.float64)}))
    fd = open_in_bundle(bundle, "t.safetensors")
    try:
        header = read_header(fd, "t.safetensors")
    finally:
        os.close(fd)
    assert header.entries["a"].dtype == "F64"
    assert header.entries["a"].end - header.entries["a"].begin == 32


def test_entries_are_read_only(f: Path) -> None:
    header = parse(f, raw_file(hdr({"a": entry("U8", [2], 0, 2)}), b"xy"))
    with pytest.raises(TypeError):
        header.entries["b"] = header.entries["a"]  # type: ignore[index]


# ------------------------------------------------------------------ framing / JSON


def test_unpadded_header_accepted(f: Path) -> None:
    h = parse(f, raw_file(hdr({"a": entry("U8", [2], 0, 2)}), b"xy"))
    assert h.entries["a"] == HeaderEntry("a", "U8", (2,), h.data_start, h.data_start + 2)


def test_space_padded_header_accepted(f: Path) -> None:
    parse(f, raw_file(hdr({"a": entry("U8", [2], 0, 2)}) + b"       ", b"xy"))


def test_empty_object_with_no_data_accepted(f: Path) -> None:
    assert dict(parse(f, raw_file(b"{}")).entries) == {}


@pytest.mark.parametrize("suffix", [b"\n", b"  \n", b"\t", b"\x00", b" x"])
def test_non_space_after_closing_brace_rejected(f: Path, suffix: bytes) -> None:
    assert codes(f, raw_file(hdr({"a": entry("U8", [2], 0, 2)}) + suffix, b"xy")) == [
        "HEADER_INVALID_JSON"
    ]


@pytest.mark.parametrize("prefix", [b" ", b"\n", b"\xef\xbb\xbf"])
def test_header_must_start_with_brace(f: Path, prefix: bytes) -> None:
    assert codes(f, raw_file(prefix + hdr({"a": entry("U8", [2], 0, 2)}), b"xy")) == [
        "HEADER_INVALID_JSON"
    ]


def test_not_utf8(f: Path) -> None:
    assert codes(f, raw_file(b'{"\xff":1}')) == ["HEADER_NOT_UTF8"]


@pytest.mark.parametrize(
    "header",
    [
        b'{"a":}',
        b"{} {}",
        b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"U8","shape":[Infinity],"data_offsets":[0,0]}}',
        b'{"a":{"dtype":"U8","shape":[-Infinity],"data_offsets":[0,0]}}',
        b"{'a':1}",
    ],
)
def test_invalid_json(f: Path, header: bytes) -> None:
    assert codes(f, raw_file(header)) == ["HEADER_INVALID_JSON"]


def test_nesting_100000_deep_rejected(f: Path) -> None:
    header = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = rejected(f, raw_file(header))
    assert error.codes == ("HEADER_INVALID_JSON",)
    assert "deep" in error.violations[0].message


# ------------------------------------------------------------------- length prefix


def test_file_shorter_than_8_bytes(f: Path) -> None:
    assert codes(f, b"\x02\x00\x00") == ["HEADER_LENGTH_INVALID"]
    assert codes(f, b"") == ["HEADER_LENGTH_INVALID"]


def test_zero_length(f: Path) -> None:
    assert codes(f, raw_file(b"", length=0)) == ["HEADER_LENGTH_INVALID"]


def test_length_u64_max(f: Path) -> None:
    assert codes(f, raw_file(b"{}", length=2**64 - 1)) == ["HEADER_LENGTH_INVALID"]


def test_length_above_format_cap_even_with_larger_caller_bound(f: Path) -> None:
    error = rejected(f, raw_file(b"{}", length=100_000_001), max_header_len=2**40)
    assert error.codes == ("HEADER_LENGTH_INVALID",)
    assert "100000000" in error.violations[0].message


def test_length_just_past_end_of_file(f: Path) -> None:
    header = hdr({"a": entry("U8", [2], 0, 2)})
    # 8 + N == size + 1: refused from the fstat size, before reading the header
    error = rejected(f, raw_file(header, b"xy", length=len(header) + 3))
    assert error.codes == ("HEADER_LENGTH_INVALID",)
    assert "past the end" in error.violations[0].message
    # 8 + N == size exactly: the header is read, and the tensor range runs past the end
    # (issue 10: a file cut short is FILE_TRUNCATED, no longer HEADER_OFFSETS_INVALID)
    assert codes(f, raw_file(header + b"  ")) == ["FILE_TRUNCATED"]


@pytest.fixture
def pread_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    log: list[int] = []
    real = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        log.append(n)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting)
    yield log


def test_100mb_whitespace_header_refused_by_bound_without_reading(
    f: Path, pread_log: list[int]
) -> None:
    n = 100_000_000
    with f.open("wb") as out:
        out.write(struct.pack("<Q", n) + b"{")
        block = b" " * (1 << 20)
        left = n - 2
        while left:
            out.write(block[: min(left, len(block))])
            left -= min(left, len(block))
        out.write(b"}")
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(EvidenceRejected) as info:
            read_header(fd, "t.safetensors", max_header_len=4096)
    finally:
        os.close(fd)
    assert info.value.codes == ("HEADER_LENGTH_INVALID",)
    message = info.value.violations[0].message
    assert "4096" in message
    assert "without reading" in message
    assert sum(pread_log) == 8


def test_header_within_bound_reads_exactly_n_bytes(f: Path, pread_log: list[int]) -> None:
    header = hdr({"a": entry("U8", [2], 0, 2)}) + b"  "
    parse(f, raw_file(header, b"xy"), max_header_len=len(header))
    assert sum(pread_log) == 8 + len(header)
    pread_log.clear()
    assert codes(f, raw_file(header, b"xy"), max_header_len=len(header) - 1) == [
        "HEADER_LENGTH_INVALID"
    ]
    assert sum(pread_log) == 8


# ------------------------------------------------------------------ tensor entries


def test_duplicate_tensor_name(f: Path) -> None:
    header = b'{"a":' + hdr(entry("U8", [1], 0, 1)) + b',"a":' + hdr(entry("U8", [1], 1, 2)) + b"}"
    error = rejected(f, raw_file(header, b"xy"))
    assert error.codes == ("HEADER_DUPLICATE_NAME",)
    assert "'a'" in error.violations[0].message


def test_duplicate_name_detected_even_when_first_entry_is_invalid(f: Path) -> None:
    header = b'{"a":1,"a":' + hdr(entry("U8", [1], 0, 1)) + b"}"
    assert "HEADER_DUPLICATE_NAME" in codes(f, raw_file(header, b"x"))


def test_duplicate_key_inside_entry_is_field_invalid(f: Path) -> None:
    header = b'{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert codes(f, raw_file(header, b"x")) == ["HEADER_FIELD_INVALID"]


def test_unknown_field(f: Path) -> None:
    e = entry("U8", [1], 0, 1) | {"crc": "00"}
    error = rejected(f, raw_file(hdr({"a": e}), b"x"))
    assert error.codes == ("HEADER_FIELD_UNKNOWN",)
    assert "'crc'" in error.violations[0].message


@pytest.mark.parametrize("missing", ["dtype", "shape", "data_offsets"])
def test_missing_field(f: Path, missing: str) -> None:
    e = entry("U8", [1], 0, 1)
    del e[missing]
    assert "HEADER_FIELD_INVALID" in codes(f, raw_file(hdr({"a": e}), b"x"))


def test_entry_not_an_object(f: Path) -> None:
    assert codes(f, raw_file(hdr({"a": [1, 2]}), b"")) == ["HEADER_FIELD_INVALID"]


def test_dtype_not_a_string(f: Path) -> None:
    assert codes(f, raw_file(hdr({"a": entry(8, [1], 0, 1)}), b"x")) == ["HEADER_FIELD_INVALID"]  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["F128", "f32", "", "float32", "F8_E4M3FN"])
def test_unknown_dtype(f: Path, dtype: str) -> None:
    assert codes(f, raw_file(hdr({"a": entry(dtype, [1], 0, 1)}), b"x")) == ["HEADER_DTYPE_UNKNOWN"]


@pytest.mark.parametrize(
    "shape",
    [[-1], [2.0], [2.5], [True], [False, 2], ["2"], [None], [[2]], 2, {"a": 1}, [2**64]],
)
def test_bad_shape_dims(f: Path, shape: Any) -> None:
    assert codes(f, raw_file(hdr({"a": entry("U8", shape, 0, 2)}), b"xy")) == [
        "HEADER_FIELD_INVALID"
    ]


def test_huge_integer_literal_does_not_crash(f: Path) -> None:
    header = b'{"a":{"dtype":"U8","shape":[' + b"9" * 10_000 + b'],"data_offsets":[0,1]}}'
    assert codes(f, raw_file(header, b"x")) == ["HEADER_FIELD_INVALID"]


@pytest.mark.parametrize(
    "offsets",
    [[0], [0, 1, 2], [1, 0], [-1, 0], [0.0, 1], [False, True], [0, "1"], "0,1", [0, 2**64]],
)
def test_bad_data_offsets(f: Path, offsets: Any) -> None:
    e = {"dtype": "U8", "shape": [1], "data_offsets": offsets}
    # unknown range: gaps/trailing are not reported, only the field itself
    assert codes(f, raw_file(hdr({"a": e}), b"x")) == ["HEADER_FIELD_INVALID"]


def test_length_mismatch(f: Path) -> None:
    error = rejected(f, raw_file(hdr({"a": entry("F32", [2], 0, 4)}), b"xxxx"))
    assert error.codes == ("HEADER_LENGTH_MISMATCH",)
    assert "8" in error.violations[0].message


@pytest.mark.parametrize("shape", [[2**32, 2**32, 2**32], [2**64 - 1, 2**64 - 1], [2**63] * 10_000])
def test_shape_product_overflowing_64_bits(f: Path, shape: list[int]) -> None:
    assert codes(f, raw_file(hdr({"a": entry("F32", shape, 0, 4)}), b"xxxx")) == [
        "HEADER_LENGTH_MISMATCH"
    ]


def test_zero_dim_in_a_huge_shape_is_zero_elements(f: Path) -> None:
    h = parse(f, raw_file(hdr({"a": entry("F32", [2**64 - 1, 2**64 - 1, 0], 0, 0)})))
    assert h.entries["a"].begin == h.entries["a"].end


def test_scalar_is_one_element(f: Path) -> None:
    parse(f, raw_file(hdr({"s": entry("F64", [], 0, 8)}), b"\0" * 8))
    assert codes(f, raw_file(hdr({"s": entry("F64", [], 0, 0)}))) == ["HEADER_LENGTH_MISMATCH"]


def test_f4_odd_element_count(f: Path) -> None:
    assert codes(f, raw_file(hdr({"a": entry("F4", [3], 0, 2)}), b"xy")) == [
        "HEADER_SUBBYTE_ALIGNMENT"
    ]
    parse(f, raw_file(hdr({"a": entry("F4", [4], 0, 2)}), b"xy"))


def test_f6_alignment(f: Path) -> None:
    parse(f, raw_file(hdr({"a": entry("F6_E2M3", [4], 0, 3)}), b"xyz"))
    assert codes(f, raw_file(hdr({"a": entry("F6_E3M2", [2], 0, 2)}), b"xy")) == [
        "HEADER_SUBBYTE_ALIGNMENT"
    ]


def test_metadata_non_string_value(f: Path) -> None:
    header = hdr({"__metadata__": {"a": "b", "n": 1}, "t": entry("U8", [1], 0, 1)})
    error = rejected(f, raw_file(header, b"x"))
    assert error.codes == ("HEADER_FIELD_INVALID",)
    assert "'n'" in error.violations[0].message


@pytest.mark.parametrize("metadata", [[], "x", 1, None, {"a": {"b": "c"}}])
def test_metadata_must_be_object_of_strings(f: Path, metadata: Any) -> None:
    assert codes(f, raw_file(hdr({"__metadata__": metadata}))) == ["HEADER_FIELD_INVALID"]


def test_metadata_is_ignored_when_valid(f: Path) -> None:
    h = parse(
        f, raw_file(hdr({"__metadata__": {"format": "np"}, "t": entry("U8", [1], 0, 1)}), b"x")
    )
    assert list(h.entries) == ["t"]


def test_metadata_duplicate_keys_rejected(f: Path) -> None:
    assert codes(f, raw_file(b'{"__metadata__":{"a":"1","a":"2"}}')) == ["HEADER_FIELD_INVALID"]
    assert codes(f, raw_file(b'{"__metadata__":{},"__metadata__":{}}')) == ["HEADER_FIELD_INVALID"]


# -------------------------------------------------------------------------- tiling


def offsets_codes(f: Path, ranges: list[tuple[int, int]], data_size: int) -> EvidenceRejected:
    header = hdr({f"t{i}": entry("U8", [e - b], b, e) for i, (b, e) in enumerate(ranges)})
    return rejected(f, raw_file(header, b"\0" * data_size))


def test_gap(f: Path) -> None:
    error = offsets_codes(f, [(0, 2), (3, 5)], 5)
    assert error.codes == ("HEADER_OFFSETS_INVALID",)
    assert "gap" in error.violations[0].message


def test_first_range_not_at_zero_is_a_gap(f: Path) -> None:
    error = offsets_codes(f, [(1, 3)], 3)
    assert error.codes == ("HEADER_OFFSETS_INVALID",)
    assert "gap" in error.violations[0].message


def test_overlap(f: Path) -> None:
    error = offsets_codes(f, [(0, 4), (2, 6)], 6)
    assert error.codes == ("HEADER_OFFSETS_INVALID",)
    assert "overlaps" in error.violations[0].message


def test_identical_ranges_overlap(f: Path) -> None:
    assert offsets_codes(f, [(0, 4), (0, 4)], 4).codes == ("HEADER_OFFSETS_INVALID",)


def test_trailing_bytes(f: Path) -> None:
    error = offsets_codes(f, [(0, 4)], 5)
    assert error.codes == ("HEADER_OFFSETS_INVALID",)
    assert "trailing" in error.violations[0].message


def test_data_but_no_tensors_is_trailing(f: Path) -> None:
    assert codes(f, raw_file(b"{}", b"x")) == ["HEADER_OFFSETS_INVALID"]


def test_range_past_end_of_file(f: Path) -> None:
    # issue 10: a file cut short is FILE_TRUNCATED, no longer HEADER_OFFSETS_INVALID
    error = offsets_codes(f, [(0, 4), (4, 8)], 6)
    assert error.codes == ("FILE_TRUNCATED",)
    header_end = f.stat().st_size - 6
    assert error.violations[0].message.startswith(
        f"the file has {header_end + 6} bytes but its header's byte ranges need {header_end + 8}"
    )


def test_a_file_cut_short_is_one_violation_that_names_the_file_once(f: Path) -> None:
    """Issue 10 item 7: one FILE_TRUNCATED, however many tensors lost data; the
    message does not repeat the file its ``where`` names."""
    error = offsets_codes(f, [(4 * i, 4 * i + 4) for i in range(5)], 3)
    assert error.codes == ("FILE_TRUNCATED",)
    (violation,) = error.violations
    assert violation.where == "t.safetensors" and "t.safetensors" not in violation.message
    # A header that could not tile a longer file either is wrong, not cut short: one
    # violation for the ranges past the end, one for the overlap.
    both = offsets_codes(f, [(0, 4), (2, 6), (6, 20), (20, 24)], 8)
    assert both.codes == ("HEADER_OFFSETS_INVALID", "HEADER_OFFSETS_INVALID")
    assert "and 1 more" in both.violations[0].message


def test_zero_length_ranges_on_boundaries_accepted(f: Path) -> None:
    header = hdr(
        {
            "z0": entry("F32", [0], 0, 0),
            "a": entry("U8", [2], 0, 2),
            "z1": entry("I64", [3, 0], 2, 2),
            "b": entry("U8", [2], 2, 4),
            "z2": entry("U8", [0], 4, 4),
        }
    )
    h = parse(f, raw_file(header, b"abcd"))
    assert list(h.entries) == ["z0", "a", "z1", "b", "z2"]


def test_zero_length_range_strictly_inside_another_is_overlap(f: Path) -> None:
    header = hdr({"a": entry("U8", [4], 0, 4), "z": entry("U8", [0], 2, 2)})
    assert codes(f, raw_file(header, b"abcd")) == ["HEADER_OFFSETS_INVALID"]


def test_zero_length_range_past_end_rejected(f: Path) -> None:
    header = hdr({"a": entry("U8", [4], 0, 4), "z": entry("U8", [0], 9, 9)})
    assert codes(f, raw_file(header, b"abcd")) == ["HEADER_OFFSETS_INVALID"]


def test_unsorted_header_order_that_tiles_is_accepted_and_order_kept(f: Path) -> None:
    header = hdr({"b": entry("U8", [2], 2, 4), "a": entry("U8", [2], 0, 2)})
    h = parse(f, raw_file(header, b"abcd"))
    assert list(h.entries) == ["b", "a"]
    assert h.entries["b"].begin == h.data_start + 2


def test_all_violations_of_a_file_listed(f: Path) -> None:
    header = (
        b'{"a":'
        + hdr(entry("U8", [2], 0, 2))
        + b',"a":'
        + hdr(entry("U8", [2], 2, 4))
        + b',"b":'
        + hdr(entry("U8", [2], 6, 8) | {"x": 1})
        + b',"c":'
        + hdr(entry("Q8", [1], 8, 9))
        + b',"d":'
        + hdr(entry("F32", [1], 9, 10))
        + b"}"
    )
    got = codes(f, raw_file(header, b"\0" * 12))
    assert sorted(got) == sorted(
        [
            "HEADER_DUPLICATE_NAME",
            "HEADER_FIELD_UNKNOWN",
            "HEADER_DTYPE_UNKNOWN",
            "HEADER_LENGTH_MISMATCH",
            "HEADER_OFFSETS_INVALID",  # gap [4, 6)
            "HEADER_OFFSETS_INVALID",  # trailing [10, 12)
        ]
    )


def test_untrusted_names_are_quoted_and_never_in_where(f: Path) -> None:
    name = "evil\n\x1b[31mred\u202e"
    header = hdr({name: entry("F32", [1], 0, 1)})
    error = rejected(f, raw_file(header, b"x"))
    assert error.codes == ("HEADER_LENGTH_MISMATCH",)
    v = error.violations[0]
    assert v.where == "t.safetensors"
    assert v.message.isascii()
    assert "\n" not in v.message and "\x1b" not in v.message


# --------------------------------------------------------------------------- paths


@pytest.mark.parametrize(
    "good", ["t.safetensors", "sub/t.safetensors", "a..b", ".hidden", "..a", "./a", "a/./b", "a//b"]
)
def test_check_relative_path_accepts(good: str) -> None:
    assert check_relative_path(good) == []


@pytest.mark.parametrize(
    "bad",
    ["", "/etc/passwd", "..", "../x", "a/../b", "a/..", "a\\b", "..\\x", "a\x00b"],
)  # fmt: skip
def test_check_relative_path_rejects(bad: str) -> None:
    violations = check_relative_path(bad)
    assert violations
    assert {v.code for v in violations} == {"FILE_PATH_UNSAFE"}
    for v in violations:
        assert "\x00" not in v.where and "\x00" not in v.message


def open_codes(bundle: Path, relpath: str) -> tuple[str, ...]:
    with pytest.raises(EvidenceRejected) as info:
        fd = open_in_bundle(bundle, relpath)
        os.close(fd)
    for v in info.value.violations:
        assert v.code in CODES
    return info.value.codes


@pytest.mark.parametrize("bad", ["/etc/passwd", "../bundle/t.safetensors", "a\\b", "a\x00b", ""])
def test_open_rejects_unsafe_paths(bundle: Path, bad: str) -> None:
    (bundle / "t.safetensors").write_bytes(b"x")
    assert set(open_codes(bundle, bad)) == {"FILE_PATH_UNSAFE"}


def test_open_regular_file(bundle: Path) -> None:
    (bundle / "sub").mkdir()
    (bundle / "sub" / "t.safetensors").write_bytes(b"hello")
    fd = open_in_bundle(bundle, "sub/t.safetensors")
    try:
        assert os.pread(fd, 5, 0) == b"hello"
        assert os.get_inheritable(fd) is False
    finally:
        os.close(fd)


def test_open_missing(bundle: Path) -> None:
    assert open_codes(bundle, "nope.safetensors") == ("FILE_MISSING",)
    assert open_codes(bundle, "nodir/nope.safetensors") == ("FILE_MISSING",)
    assert open_codes(bundle / "absent", "t.safetensors") == ("FILE_MISSING",)


def test_open_symlink_inside_accepted(bundle: Path) -> None:
    (bundle / "data").mkdir()
    (bundle / "data" / "real.safetensors").write_bytes(b"inside")
    (bundle / "link.safetensors").symlink_to("data/real.safetensors")
    (bundle / "dirlink").symlink_to("data")
    for rel in ("link.safetensors", "dirlink/real.safetensors"):
        fd = open_in_bundle(bundle, rel)
        try:
            assert os.pread(fd, 6, 0) == b"inside"
        finally:
            os.close(fd)


def test_open_bundle_given_through_symlink(tmp_path: Path, bundle: Path) -> None:
    (bundle / "t.safetensors").write_bytes(b"x")
    alias = tmp_path / "alias"
    alias.symlink_to(bundle)
    os.close(open_in_bundle(alias, "t.safetensors"))


def test_open_symlink_out_of_bundle(tmp_path: Path, bundle: Path) -> None:
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"secret")
    (bundle / "abs.safetensors").symlink_to(secret)
    (bundle / "rel.safetensors").symlink_to("../secret.safetensors")
    (bundle / "outdir").symlink_to(tmp_path)
    # a sibling whose name starts with the bundle's name is still outside
    sibling = tmp_path / "bundle2"
    sibling.mkdir()
    (sibling / "t.safetensors").write_bytes(b"x")
    (bundle / "sib.safetensors").symlink_to(sibling / "t.safetensors")
    for rel in (
        "abs.safetensors",
        "rel.safetensors",
        "outdir/secret.safetensors",
        "sib.safetensors",
    ):
        assert open_codes(bundle, rel) == ("FILE_OUTSIDE_BUNDLE",), rel


def test_open_dev_null_via_symlink_is_outside(bundle: Path) -> None:
    (bundle / "null.safetensors").symlink_to("/dev/null")
    assert open_codes(bundle, "null.safetensors") == ("FILE_OUTSIDE_BUNDLE",)


def test_open_symlink_loop(bundle: Path) -> None:
    (bundle / "a").symlink_to("b")
    (bundle / "b").symlink_to("a")
    (bundle / "self").symlink_to("self")
    for rel in ("a", "self", "self/x"):
        assert open_codes(bundle, rel)[0] in {"FILE_UNREADABLE", "FILE_MISSING"}


def test_open_symlink_to_bundle_itself(bundle: Path) -> None:
    (bundle / "here").symlink_to(".")
    assert open_codes(bundle, "here") == ("FILE_NOT_REGULAR",)


def test_open_directory(bundle: Path) -> None:
    (bundle / "d.safetensors").mkdir()
    assert open_codes(bundle, "d.safetensors") == ("FILE_NOT_REGULAR",)


def test_open_fifo_does_not_block(bundle: Path) -> None:
    os.mkfifo(bundle / "f.safetensors")
    result: list[tuple[str, ...]] = []
    worker = threading.Thread(
        target=lambda: result.append(open_codes(bundle, "f.safetensors")), daemon=True
    )
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "open_in_bundle blocked on a FIFO"
    assert result == [("FILE_NOT_REGULAR",)]


def test_open_socket(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(bundle)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind("s.safetensors")
        assert open_codes(bundle, "s.safetensors") == ("FILE_NOT_REGULAR",)


def test_open_fifo_swapped_in_after_stat_still_not_regular(
    bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fstat of the opened fd is authoritative, and O_NONBLOCK keeps the open from blocking."""
    os.mkfifo(bundle / "f.safetensors")
    (bundle / "r").write_bytes(b"x")
    real_stat = os.stat

    def lying_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if path == "f.safetensors":
            return real_stat(bundle / "r")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", lying_stat)
    result: list[tuple[str, ...]] = []
    worker = threading.Thread(
        target=lambda: result.append(open_codes(bundle, "f.safetensors")), daemon=True
    )
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "open blocked on a FIFO"
    assert result == [("FILE_NOT_REGULAR",)]


def test_open_does_not_follow_a_symlink_swapped_in_after_resolution(
    tmp_path: Path, bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulate the race: realpath saw a real file, then a symlink out replaced it."""
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "t.safetensors").write_bytes(b"secret")
    (bundle / "t.safetensors").symlink_to(secret_dir / "t.safetensors")
    (bundle / "sub").symlink_to(secret_dir)

    def no_resolution(path: Any, *, strict: bool = False) -> str:
        return str(os.path.abspath(path))

    monkeypatch.setattr(os.path, "realpath", no_resolution)
    assert open_codes(bundle, "t.safetensors") in {("FILE_NOT_REGULAR",), ("FILE_UNREADABLE",)}
    assert open_codes(bundle, "sub/t.safetensors") == ("FILE_UNREADABLE",)


def test_open_permission_error_is_unreadable(bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (bundle / "t.safetensors").write_bytes(b"x")
    real_open = os.open

    def denying_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_NONBLOCK:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", denying_open)
    with pytest.raises(EvidenceRejected) as info:
        open_in_bundle(bundle, "t.safetensors")
    assert info.value.codes == ("FILE_UNREADABLE",)
    assert re.search("denied", info.value.violations[0].message, re.IGNORECASE)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_open_chmod_000_is_unreadable(bundle: Path) -> None:
    target = bundle / "t.safetensors"
    target.write_bytes(b"x")
    target.chmod(0)
    try:
        assert open_codes(bundle, "t.safetensors") == ("FILE_UNREADABLE",)
    finally:
        target.chmod(0o600)


def test_open_never_leaks_directory_fds(bundle: Path) -> None:
    (bundle / "d").mkdir()
    (bundle / "d" / "t.safetensors").write_bytes(b"x")
    (bundle / "d" / "dir.safetensors").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        os.close(open_in_bundle(bundle, "d/t.safetensors"))
        open_codes(bundle, "d/dir.safetensors")
        open_codes(bundle, "d/missing")
    assert len(os.listdir("/proc/self/fd")) == before


def test_read_header_on_unreadable_fd(bundle: Path) -> None:
    fd = os.open(bundle, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(EvidenceRejected) as info:
            read_header(fd, "t.safetensors")
    finally:
        os.close(fd)
    assert info.value.codes[0] in {"FILE_UNREADABLE", "HEADER_LENGTH_INVALID"}


# ---------------------------------------------------------------------------- docs


def test_codes_table_covers_every_code_the_module_emits() -> None:
    # Path rules live in nanrunbook.access, the header in tensors.safetensors.
    import nanrunbook.access as access

    source = Path(tensorfile.__file__).read_text() + Path(access.__file__).read_text()
    emitted = set(re.findall(r'"((?:FILE|HEADER)_[A-Z0-9_]+)"', source))
    declared = set(tensorfile.CODES) | {c for c in access.CODES if c.startswith("FILE_")}
    assert emitted == declared
    assert all(desc and "\n" not in desc for desc in CODES.values())
