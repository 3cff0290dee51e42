"""The one strict JSON reader: manifest and safetensors header alike.

Regression tests for issue 10 items 1, 2 and 8 use real files built byte by
byte; the screening tests check that the C-speed screens never hide a
violation the full walk would report, with the same codes and JSON paths.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from bundlekit import copy_fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanrunbook import EvidenceRejected, check_bundle
from nanrunbook.strictjson import (
    MANIFEST,
    MAX_DEPTH,
    lexical_violations,
    load_manifest,
    load_manifest_bytes,
    parse_json,
)
from nanrunbook.tensors.safetensors import read_header

TENSOR_FILE = "tensors.safetensors"


def safetensors_file(header: bytes, data: bytes) -> bytes:
    """A safetensors file exactly as given: 8-byte length, header, data."""
    return struct.pack("<Q", len(header)) + header + data


def header_rejected(tmp_path: Path, content: bytes) -> EvidenceRejected:
    path = tmp_path / "t.safetensors"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(EvidenceRejected) as info:
            read_header(fd, "t.safetensors")
    finally:
        os.close(fd)
    return info.value


def header_accepted(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "t.safetensors"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        read_header(fd, "t.safetensors")
    finally:
        os.close(fd)


def bundle_with_header_text(tmp_path: Path, edit: tuple[bytes, bytes]) -> Path:
    """The valid fixture with one byte-level edit of its tensor file's header."""
    bundle = copy_fixture(tmp_path)
    raw = (bundle / TENSOR_FILE).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8 : 8 + length], raw[8 + length :]
    old, new = edit
    assert header.count(old) == 1
    header = header.replace(old, new)
    (bundle / TENSOR_FILE).write_bytes(safetensors_file(header, data))
    return bundle


def cli_exit(bundle: Path) -> int:
    command = [sys.executable, "-m", "nanrunbook", "check", "--format", "kv", str(bundle)]
    return subprocess.run(command, capture_output=True, timeout=60).returncode


# ------------------------------------------- issue 10 item 1: lone surrogates


@pytest.mark.parametrize(
    "header",
    [
        # the case, byte for byte
        rb'{"__metadata__":{"k":"\ud800"},"a":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}',
        rb'{"\udc00":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}',
        rb'{"__metadata__":{"\udbff":"v"},"a":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}',
        rb'{"a":{"dtype":"I32","shape":[4],"data_offsets":[0,16]},"b\uDFFFc":'
        rb'{"dtype":"I32","shape":[0],"data_offsets":[16,16]}}',
    ],
)
def test_lone_surrogate_escape_in_a_header_is_rejected(tmp_path: Path, header: bytes) -> None:
    error = header_rejected(tmp_path, safetensors_file(header, bytes(16)))
    assert error.codes == ("HEADER_INVALID_JSON",)
    assert "surrogate" in error.violations[0].message


def test_a_surrogate_pair_escape_in_a_header_is_one_character_and_accepted(
    tmp_path: Path,
) -> None:
    header = rb'{"__metadata__":{"k":"\ud83d\ude00"},"a":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}}'
    header_accepted(tmp_path, safetensors_file(header, bytes(16)))


def test_lone_surrogate_in_a_bundles_header_rejects_the_bundle_exit_3(tmp_path: Path) -> None:
    bundle = bundle_with_header_text(
        tmp_path, (b'{"batch/features"', b'{"\\udc00x":1,"batch/features"')
    )
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert "HEADER_INVALID_JSON" in info.value.codes
    assert cli_exit(bundle) == 3


def test_lone_surrogate_in_header_metadata_rejects_the_bundle(tmp_path: Path) -> None:
    bundle = bundle_with_header_text(
        tmp_path, (b'{"batch/features"', b'{"__metadata__":{"k":"\\ud800"},"batch/features"')
    )
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert info.value.codes == ("HEADER_INVALID_JSON",)
    assert cli_exit(bundle) == 3


# --------------------------------------------- issue 10 item 2: -0 is a float


@pytest.mark.parametrize(
    "header",
    [
        rb'{"a":{"dtype":"U8","shape":[8],"data_offsets":[-0,8]}}',
        rb'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]},'
        rb'"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}',
        rb'{"a":{"dtype":"U8","shape":[2,-0],"data_offsets":[0,0]},'
        rb'"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}',
        rb'{"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,-0]},'
        rb'"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}',
    ],
)
def test_negative_zero_where_a_header_wants_an_unsigned_integer(
    tmp_path: Path, header: bytes
) -> None:
    error = header_rejected(tmp_path, safetensors_file(header, bytes(8)))
    assert "HEADER_FIELD_INVALID" in error.codes


def test_negative_zero_offset_in_a_bundles_header_rejects_the_bundle_exit_3(
    tmp_path: Path,
) -> None:
    bundle = bundle_with_header_text(
        tmp_path, (b'"data_offsets":[0,256]', b'"data_offsets":[-0,256]')
    )
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert "HEADER_FIELD_INVALID" in info.value.codes
    assert cli_exit(bundle) == 3


def test_plain_zero_is_still_an_integer_in_a_header(tmp_path: Path) -> None:
    header = rb'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}'
    header_accepted(tmp_path, safetensors_file(header, bytes(8)))


def test_negative_zero_is_a_float_in_the_manifest_too() -> None:
    tree = load_manifest_bytes(b'{"a": -0, "b": 0, "c": [-0, -0.0, 0.0]}')
    assert tree["a"] == 0 and type(tree["a"]) is float and str(tree["a"]) == "-0.0"
    assert type(tree["b"]) is int
    assert [type(v) for v in tree["c"]] == [float, float, float]


def test_negative_zero_where_the_manifest_wants_an_integer(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    text = (bundle / "manifest.json").read_text()
    assert '"rank": 0' in text
    (bundle / "manifest.json").write_text(text.replace('"rank": 0', '"rank": -0', 1))
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert [(v.code, v.where) for v in info.value.violations] == [
        ("FIELD_TYPE", "$.binding.topology.rank")
    ]


# ------------------------------------------- issue 10 item 8: truncated manifest


def test_a_truncated_manifest_says_it_may_be_truncated(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    raw = (bundle / "manifest.json").read_bytes()
    for cut in (len(raw) // 2, len(raw) - 3, 1, 0):
        (bundle / "manifest.json").write_bytes(raw[:cut])
        with pytest.raises(EvidenceRejected) as info:
            check_bundle(bundle)
        (violation,) = info.value.violations
        assert violation.code == "MANIFEST_INVALID_JSON"
        assert "truncated" in violation.message
        assert "still being written" in violation.message


def test_a_manifest_cut_inside_a_string_says_it_may_be_truncated(tmp_path: Path) -> None:
    bundle = copy_fixture(tmp_path)
    raw = (bundle / "manifest.json").read_bytes()
    cut = raw.index(b'"ml-oncall"') + 4
    (bundle / "manifest.json").write_bytes(raw[:cut])
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert "truncated" in info.value.violations[0].message


@pytest.mark.parametrize(
    "text", [b'{"a": 1,, "b": 2}', b'{"a": 1} x', b"{'a': 1}", b'{"a": 1}}', b'{"a" 1}']
)
def test_malformed_but_complete_json_does_not_blame_truncation(text: bytes) -> None:
    with pytest.raises(EvidenceRejected) as info:
        load_manifest_bytes(text)
    (violation,) = info.value.violations
    assert violation.code == "MANIFEST_INVALID_JSON"
    assert "truncated" not in violation.message


# ------------------------------------------------------------------ screening


def test_nesting_of_exactly_the_bound_is_accepted_and_one_more_rejected() -> None:
    inside = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    assert load_manifest_bytes(('{"a": ' + inside + "}").encode())
    with pytest.raises(EvidenceRejected) as info:
        load_manifest_bytes(('{"a": [' + inside + "]}").encode())
    assert info.value.codes == ("MANIFEST_TOO_DEEP",)
    assert info.value.violations[0].where == "$.a" + "[0]" * (MAX_DEPTH - 1)


@pytest.mark.parametrize(
    "text",
    [
        # brackets inside strings never count, escaped quotes never end a string
        '{"a": "' + "[" * 40 + '", "b": [[["]]]]]]]]"]]]}',
        '{"a": "\\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "b": ["\\\\", "[[["]}',
        '{"' + "{" * 40 + '": ["x", "' + "]" * 40 + '"]}',
    ],
)
def test_brackets_in_strings_do_not_count_as_nesting(text: str) -> None:
    assert load_manifest_bytes(text.encode())


@pytest.mark.parametrize(
    ("text", "code", "where"),
    [
        ('{"a": "x\\u007fy"}', "JSON_CONTROL_CHARACTER", "$.a"),
        ('{"a": "x\x7fy"}', "JSON_CONTROL_CHARACTER", "$.a"),
        ('{"a": "x\u009by"}', "JSON_CONTROL_CHARACTER", "$.a"),
        ('{"a": "x\\u0085y"}', "JSON_CONTROL_CHARACTER", "$.a"),
        ('{"a": ["x\\ty"]}', "JSON_CONTROL_CHARACTER", "$.a[0]"),
        ('{"a\\n": 1}', "JSON_CONTROL_CHARACTER", "$['a\\n']"),
        ('{"a": "\\uDBFF"}', "JSON_LONE_SURROGATE", "$.a"),
        ('{"a": "\\ude00\\ud83d"}', "JSON_LONE_SURROGATE", "$.a"),
        ('{"a": 1e400}', "JSON_NONFINITE_NUMBER", "$.a"),
        ('{"a": [NaN]}', "JSON_NONFINITE_NUMBER", "$.a[0]"),
        ('{"a": 9007199254740992}', "JSON_INTEGER_OUT_OF_RANGE", "$.a"),
        ('{"a": -9007199254740992}', "JSON_INTEGER_OUT_OF_RANGE", "$.a"),
        ('{"a": 1, "a": 2}', "JSON_DUPLICATE_KEY", "$.a"),
    ],
)
def test_each_rule_is_found_with_its_path(text: str, code: str, where: str) -> None:
    with pytest.raises(EvidenceRejected) as info:
        load_manifest_bytes(text.encode())
    assert [(v.code, v.where) for v in info.value.violations] == [(code, where)]


def test_the_safe_integer_bounds_themselves_are_accepted() -> None:
    tree = load_manifest_bytes(b'{"a": 9007199254740991, "b": -9007199254740991}')
    assert tree == {"a": 2**53 - 1, "b": -(2**53) + 1}


# An oracle written again from the spec, per character: what the screened
# reader must report, in the same order and with the same paths.


def _oracle(text: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []

    def pairs(items: list[tuple[str, Any]]) -> Any:
        keys = [k for k, _ in items]
        obj: dict[str, Any] = {}
        for key, value in items:
            obj.setdefault(key, value)
        return ("OBJ", obj, [k for i, k in enumerate(keys) if k in keys[:i]])

    def number(literal: str) -> Any:
        value = (
            float(literal) if any(c in literal for c in ".eE") or literal == "-0" else int(literal)
        )
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return ("NONFINITE",)
        if isinstance(value, int) and abs(value) > 2**53 - 1:
            return ("RANGE",)
        return value

    tree = json.loads(
        text,
        object_pairs_hook=pairs,
        parse_int=number,
        parse_float=number,
        parse_constant=lambda _: ("NONFINITE",),
    )

    def key_path(path: str, key: str) -> str:
        from nanrunbook.strictjson import child_path

        return child_path(path, key)

    def string(s: str, path: str) -> None:
        if any(unicodedata.category(ch) == "Cc" for ch in s):
            found.append(("JSON_CONTROL_CHARACTER", path))
        if any(unicodedata.category(ch) == "Cs" for ch in s):
            found.append(("JSON_LONE_SURROGATE", path))

    def walk(value: Any, path: str, depth: int) -> None:
        container = isinstance(value, list) or (isinstance(value, tuple) and value[0] == "OBJ")
        if container and depth + 1 > 32:
            found.append(("MANIFEST_TOO_DEEP", path))
            return
        if isinstance(value, tuple) and value[0] == "OBJ":
            _, obj, repeated = value
            found.extend(("JSON_DUPLICATE_KEY", key_path(path, k)) for k in repeated)
            for key, item in obj.items():
                string(key, key_path(path, key))
                walk(item, key_path(path, key), depth + 1)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(value, str):
            string(value, path)
        elif value == ("NONFINITE",):
            found.append(("JSON_NONFINITE_NUMBER", path))
        elif value == ("RANGE",):
            found.append(("JSON_INTEGER_OUT_OF_RANGE", path))

    walk(tree, "$", 0)
    return found


_CHARS = st.sampled_from(
    [
        "a",
        "[",
        "]",
        "{",
        "}",
        '"',
        "\\",
        ":",
        ",",
        "\x7f",
        "\x85",
        "\u009f",
        "é",
        "\U0001f600",
        "\u2028",
    ]
)
_ESCAPES = st.sampled_from(
    ["\\n", "\\t", "\\\\", '\\"', "\\/", "\\u0000", "\\u001F", "\\u007f", "\\u0080", "\\u00a0",
     "\\ud800", "\\uDFFF", "\\ud83d\\ude00", "\\u00e9", "\\u2028", "[", "]"]
)  # fmt: skip
_STRING_TEXT = st.lists(st.one_of(_CHARS.filter(lambda c: c not in '"\\'), _ESCAPES), max_size=6)


@st.composite
def json_texts(draw: st.DrawFn, depth: int = 0) -> str:
    """JSON text (not a tree) so escapes, number spellings and repeats survive."""
    kind = draw(st.integers(0, 9 if depth < 36 else 5))
    if kind <= 1:
        return '"' + "".join(draw(_STRING_TEXT)) + '"'
    if kind == 2:
        return draw(
            st.sampled_from(
                ["0", "-0", "1.5", "-0.0", "1e400", "-1e400", "NaN", "Infinity", "-Infinity",
                 "9007199254740991", "9007199254740992", "-9007199254740992", "123456789012345678901",
                 "1E2", "true", "null"]
            )
        )  # fmt: skip
    if kind <= 5 and depth > 0:
        return draw(st.sampled_from(["1", "false", '"x"']))
    if kind <= 7:
        items = draw(st.lists(json_texts(depth + 1), max_size=3))
        return "[" + ",".join(items) + "]"
    keys = draw(
        st.lists(st.one_of(st.sampled_from(["a", "b"]), _STRING_TEXT.map("".join)), max_size=3)
    )
    values = [draw(json_texts(depth + 1)) for _ in keys]
    return "{" + ",".join(f'"{k}":{v}' for k, v in zip(keys, values, strict=True)) + "}"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_texts())
def test_screened_reader_reports_what_a_per_character_walk_reports(text: str) -> None:
    document = '{"k": ' + text + "}"
    try:
        expected = _oracle(document)
    except (ValueError, RecursionError):
        return  # not JSON at all: nothing to compare
    parsed = parse_json(document.encode(), MANIFEST)
    got = [(v.code, v.where) for v in parsed.violations]
    assert got == expected
    assert got == [(v.code, v.where) for v in lexical_violations(parsed.value)]


def test_load_manifest_keeps_every_float_for_the_canonical_form() -> None:
    document = load_manifest(b'{"a": [1.5, -0, 2, 1e2], "b": {"c": 0.5}, "d": "1.5"}')
    assert document.floats == (1.5, -0.0, 100.0, 0.5)
