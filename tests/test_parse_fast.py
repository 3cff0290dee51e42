"""The column-wise paths accept nothing the detailed paths refuse.

The manifest parser and the header reader read a stage's (a header's) entries
column by column when every entry is well-formed; anything else goes down the
detailed path, which reads entry by entry and words every problem. Generated
near-valid entries check that whatever the column-wise path accepts, the
detailed path accepts too, entry by entry, with the same records.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from nanrunbook.dtypes import DTYPES
from nanrunbook.manifest.fields import Sink
from nanrunbook.manifest.parse import _plain_tensors, _printable, _tensor
from nanrunbook.records import element_count
from nanrunbook.strictjson import ObjectWithDuplicates
from nanrunbook.tensors.safetensors import _check_entries, _detailed_entry, _plain_entries

SHA = "0123456789abcdef" * 4
ODD_VALUES = st.sampled_from(
    [None, True, False, 0, -1, 1.0, -0.0, 2**53, 2**53 - 1, 2**64, 2**64 - 1, "", "x", [], {},
     "a\x00b", "a\x7fb", "a\u202eb", "a\nb", "x" * 1025, "n" * 257, "F32", "Q8", SHA, SHA.upper(),
     SHA[:-1] + "g", SHA[:-1] + "é", "../x.safetensors", "/abs", "a\\b", "t.safetensors", [16],
     [2, 3], [-1], [1.0], [True], [2**32, 2**32, 2], [2**53 - 1] * 3, [0, 2**64], [0, 8],
     [8, 0], [-0.0, 8], [1, 1, 1, 1, 1, 2**20], [0, 2**70, 1, 1, 1]]
)  # fmt: skip


@st.composite
def manifest_entry(draw: st.DrawFn, resolution: str | None) -> Any:
    entry: dict[str, Any] = {
        "name": draw(st.sampled_from(["w", "layers.0.weight", "n" * 256, "é", "b"])),
        "dtype": draw(st.sampled_from(["F32", "BF16", "I64", "F4", "F6_E2M3"])),
        "shape": draw(st.lists(st.integers(0, 2**20), max_size=5)),
        "probe": draw(st.sampled_from(["p", "x" * 1024, "param.grad", ""])),
    }
    if resolution != "summary" or draw(st.integers(0, 5)) == 0:
        entry["file"] = draw(st.sampled_from(["t.safetensors", "./a/b.safetensors"]))
        entry["sha256"] = SHA
    if draw(st.integers(0, 3)) == 0:  # break it a little
        key = draw(st.sampled_from([*entry, "extra"]))
        if draw(st.booleans()):
            entry[key] = draw(ODD_VALUES)
        else:
            entry.pop(key, None)
    return ObjectWithDuplicates(entry) if draw(st.integers(0, 19)) == 0 else entry


@st.composite
def manifest_stages(draw: st.DrawFn) -> tuple[list[Any], str | None]:
    resolution = draw(st.sampled_from(["complete", "complete", "summary", None, "other"]))
    return draw(st.lists(manifest_entry(resolution), min_size=1, max_size=4)), resolution


@settings(max_examples=3000, deadline=None)
@given(manifest_stages())
def test_plain_manifest_entries_are_ones_the_detailed_path_accepts(
    case: tuple[list[Any], str | None],
) -> None:
    entries, resolution = case
    plain = _plain_tensors(entries, resolution)
    if plain is None:
        return
    sink = Sink()
    detailed = [
        _tensor(sink, e, f"$.stages[0].tensors[{i}]", resolution) for i, e in enumerate(entries)
    ]
    assert sink.violations == []
    assert tuple(detailed) == plain


@st.composite
def header_entry(draw: st.DrawFn) -> Any:
    dtype = draw(st.sampled_from(["F32", "U8", "F4", "F6_E3M2", "C64", "BOOL"]))
    shape = draw(st.lists(st.integers(0, 2**10), max_size=5))
    begin = draw(st.integers(0, 2**20))
    entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin]}
    count = element_count(shape, 2**64)
    nbytes = None if count is None else DTYPES[dtype].nbytes(count)
    if nbytes is not None and draw(st.integers(0, 3)):  # mostly a length that matches
        entry["data_offsets"] = [begin, begin + nbytes]
    if draw(st.integers(0, 3)) == 0:
        key = draw(st.sampled_from([*entry, "crc"]))
        if draw(st.booleans()):
            entry[key] = draw(ODD_VALUES)
        else:
            entry.pop(key, None)
    return ObjectWithDuplicates(entry) if draw(st.integers(0, 19)) == 0 else entry


@st.composite
def headers(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(
        st.lists(st.sampled_from(["a", "b", "c", "__metadata__"]), max_size=4, unique=True)
    )
    root = {name: draw(header_entry()) for name in names}
    if "__metadata__" in root and draw(st.booleans()):
        root["__metadata__"] = {"format": "pt"}
    return root


@settings(max_examples=3000, deadline=None)
@given(headers())
def test_plain_header_entries_are_ones_the_detailed_path_accepts(root: dict[str, Any]) -> None:
    plain = _plain_entries(root, 64)
    if plain is None:
        return
    entries, ranges = plain
    problems: list[tuple[str, str]] = []

    def add(code: str, message: str) -> None:
        problems.append((code, message))

    detailed = {}
    for name, value in root.items():
        if name == "__metadata__":
            continue
        begin, end, entry = _detailed_entry(name, value, 64, add)
        assert (begin, end) == next((b, e) for b, e, _, n in ranges if n == name)
        detailed[name] = entry
    assert problems == []
    assert detailed == entries
    assert list(detailed) == list(entries)


@settings(max_examples=1000, deadline=None)
@given(headers(), st.integers(0, 2**21))
def test_a_header_reads_the_same_both_ways(root: dict[str, Any], data_size: int) -> None:
    """_check_entries with and without the column-wise path: same entries, same words."""
    import nanrunbook.tensors.safetensors as module

    found: list[list[tuple[str, str]]] = []
    results = []
    for plain in (module._plain_entries, lambda root, start: None):
        problems: list[tuple[str, str]] = []
        original = module._plain_entries
        module._plain_entries = plain
        try:
            results.append(_check_entries(root, data_size, 64, _collect(problems)))
        finally:
            module._plain_entries = original
        found.append(problems)
    assert results[0] == results[1]
    assert found[0] == found[1]


def _collect(problems: list[tuple[str, str]]) -> Any:
    return lambda code, message: problems.append((code, message))


def test_the_column_wise_paths_take_what_producers_write() -> None:
    entry = {
        "name": "w",
        "file": "t.safetensors",
        "dtype": "F32",
        "shape": [4, 4],
        "sha256": SHA,
        "probe": "p",
    }
    assert _plain_tensors([entry, {**entry, "name": "v"}], "complete") is not None
    root = {"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}, "__metadata__": {}}
    assert _plain_entries(root, 8) is not None


@settings(max_examples=1000, deadline=None)
@given(st.text(st.characters(max_codepoint=0x3000), max_size=8) | st.text(max_size=8))
def test_the_column_printable_test_is_isprintable(text: str) -> None:
    assert _printable(text) == text.isprintable()


def test_the_column_printable_test_knows_every_ascii_character() -> None:
    for code in range(0x80):
        assert _printable(f"a{chr(code)}b") == chr(code).isprintable(), code
