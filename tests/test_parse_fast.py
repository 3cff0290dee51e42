"""The plain-entry paths accept nothing the detailed paths refuse.

The manifest parser and the header reader read a well-formed tensor entry
without their per-field bookkeeping; anything else goes down the detailed path,
which words every problem. Generated near-valid entries check that whatever
the plain path accepts, the detailed path accepts too, with the same record.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nanrunbook.manifest.fields import Sink
from nanrunbook.manifest.parse import _plain_tensor, _tensor
from nanrunbook.strictjson import ObjectWithDuplicates
from nanrunbook.tensors.safetensors import _detailed_entry, _plain_entry

SHA = "0123456789abcdef" * 4
ODD_VALUES = st.sampled_from(
    [None, True, False, 0, -1, 1.0, -0.0, 2**53, 2**53 - 1, 2**64, 2**64 - 1, "", "x", [], {},
     "a\x00b", "a\u202eb", "a\nb", "x" * 1025, "n" * 257, "F32", "Q8", SHA, SHA.upper(),
     "../x.safetensors", "/abs", "a\\b", "t.safetensors", [16], [2, 3], [-1], [1.0], [True],
     [2**32, 2**32, 2], [2**53 - 1] * 3, [0, 2**64], [0, 8], [8, 0], [-0.0, 8]]
)  # fmt: skip


@st.composite
def manifest_entries(draw: st.DrawFn) -> tuple[Any, str | None]:
    resolution = draw(st.sampled_from(["complete", "summary", None, "other"]))
    entry: dict[str, Any] = {
        "name": draw(st.sampled_from(["w", "layers.0.weight", "n" * 256, "é"])),
        "dtype": draw(st.sampled_from(["F32", "BF16", "I64", "F4", "F6_E2M3"])),
        "shape": draw(st.lists(st.integers(0, 2**20), max_size=4)),
        "probe": draw(st.sampled_from(["p", "x" * 1024, "param.grad"])),
    }
    if resolution != "summary" or draw(st.booleans()):
        entry["file"] = draw(st.sampled_from(["t.safetensors", "./a/b.safetensors"]))
        entry["sha256"] = SHA
    for _ in range(draw(st.integers(0, 2))):  # break it a little
        key = draw(st.sampled_from([*entry, "extra"]))
        if draw(st.booleans()):
            entry[key] = draw(ODD_VALUES)
        else:
            entry.pop(key, None)
    value: Any = entry
    if draw(st.integers(0, 9)) == 0:
        value = ObjectWithDuplicates(entry)
    return value, resolution


@settings(max_examples=3000, deadline=None)
@given(manifest_entries())
def test_plain_manifest_entry_is_one_the_detailed_path_accepts(
    case: tuple[Any, str | None],
) -> None:
    value, resolution = case
    plain = _plain_tensor(value, resolution, set())
    if plain is None:
        return
    sink = Sink()
    detailed = _tensor(sink, value, "$.stages[0].tensors[0]", resolution)
    assert sink.violations == []
    assert detailed == plain


@st.composite
def header_entries(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["F32", "U8", "F4", "F6_E3M2", "C64", "BOOL"]))
    shape = draw(st.lists(st.integers(0, 2**10), max_size=3))
    begin = draw(st.integers(0, 2**20))
    length = draw(st.integers(0, 2**12))
    entry: dict[str, Any] = {
        "dtype": dtype,
        "shape": shape,
        "data_offsets": [begin, begin + length],
    }
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from([*entry, "crc"]))
        if draw(st.booleans()):
            entry[key] = draw(ODD_VALUES)
        else:
            entry.pop(key, None)
    if draw(st.booleans()):  # a length that matches, so some entries are well-formed
        from nanrunbook.dtypes import DTYPES
        from nanrunbook.records import element_count

        shape_now, dtype_now, offsets = (
            entry.get("shape"),
            entry.get("dtype"),
            entry.get("data_offsets"),
        )
        if (
            isinstance(shape_now, list)
            and all(type(d) is int and d >= 0 for d in shape_now)
            and isinstance(dtype_now, str)
            and dtype_now in DTYPES
            and isinstance(offsets, list)
            and len(offsets) == 2
            and type(offsets[0]) is int
        ):
            count = element_count(shape_now, 2**64)
            nbytes = None if count is None else DTYPES[dtype_now].nbytes(count)
            if nbytes is not None:
                entry["data_offsets"] = [offsets[0], offsets[0] + nbytes]
    return ObjectWithDuplicates(entry) if draw(st.integers(0, 9)) == 0 else entry


@settings(max_examples=3000, deadline=None)
@given(header_entries())
def test_plain_header_entry_is_one_the_detailed_path_accepts(value: Any) -> None:
    plain = _plain_entry("t", value, 64)
    if plain is None:
        return
    problems: list[tuple[str, str]] = []
    detailed = _detailed_entry(
        "t", value, 64, lambda code, message: problems.append((code, message))
    )
    assert problems == []
    assert detailed == plain


def test_the_plain_paths_take_what_producers_write() -> None:
    entry = {
        "name": "w",
        "file": "t.safetensors",
        "dtype": "F32",
        "shape": [4, 4],
        "sha256": SHA,
        "probe": "p",
    }
    assert _plain_tensor(entry, "complete", set()) is not None
    header = {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}
    assert _plain_entry("w", header, 8) is not None
