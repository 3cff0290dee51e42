"""The screened read (msgspec with one hook per float, then screens)
gives exactly what the hooked read gives, or declines.

``strictjson._parse_screened`` reads without the integer and object hooks, so
``-0``, integers past the range and repeated keys read differently there; its
screens must decline every such text, and every text that breaks a lexical
rule. Generated texts aim at each screen's edge (a colon spelled as an escape,
escaped backslashes, ``-0`` inside strings, integers at 2^53 and 2^64, nesting
at 32), for the manifest's dialect and the header's.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanrunbook import strictjson
from nanrunbook.records import TensorEntry, frozen_records
from nanrunbook.strictjson import MANIFEST, Dialect, Parsed, parse_json
from nanrunbook.tensors.safetensors import HEADER_JSON, HeaderEntry, read_header

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DIALECTS = [MANIFEST, HEADER_JSON]


def exact(value: Any) -> Any:
    """A value in a form where ``-0.0`` differs from ``0``, 1.0 from 1, and an
    object's class and every pair (repeats included) count."""
    if isinstance(value, dict):
        pairs = [(k, exact(v)) for k, v in strictjson.pairs_of(value)]
        return ("object", type(value).__name__, pairs)
    if isinstance(value, list):
        return ("array", [exact(v) for v in value])
    if isinstance(value, float):
        return ("float", repr(value), math.copysign(1.0, value))
    return (type(value).__name__, repr(value))


def outcome(read: Any, raw: bytes, dialect: Dialect) -> Any:
    try:
        parsed = read(raw, dialect)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError
        return ("raised", type(err).__name__, str(err))
    if parsed is None:
        return None
    assert isinstance(parsed, Parsed)
    return (exact(parsed.value), parsed.violations, [exact(f) for f in parsed.floats])


NUMBERS = st.sampled_from(
    ["0", "-0", "-0.0", "-0e0", "-0E+1", "0.0", "1.5", "2.0", "1e2", "1E400", "-1e400", "NaN",
     "-Infinity", "123456789012345", "1234567890123456", "9007199254740991",
     "9007199254740992", "-9007199254740991", "-9007199254740992", "9223372036854775807",
     "-9223372036854775808", "-9223372036854775809", "18446744073709551615",
     "18446744073709551616", "-18446744073709551615", "123456789012345678901234", "1" * 4400]
)  # fmt: skip
STRING_PARTS = st.sampled_from(
    ["a", ":", "-0", " -0", ":-0", ",-0]", "[", "]", "{", "}", "\\\\", '\\"', "\\u003a",
     "\\u003A", "\\\\u003a", "\\\\\\u003a", "\\n", "\\u001f", "\\u007f", "\\u0085", "\x7f",
     "\u0085", "\\ud800", "\\udc00", "\\ud83d\\ude00", "\U0001f600", "é", "\\/", "2.0"]
)  # fmt: skip
STRINGS = st.lists(STRING_PARTS, max_size=4).map(lambda parts: '"' + "".join(parts) + '"')
KEYS = st.one_of(st.sampled_from(['"a"', '"b"', '"a:"', '"\\u0061"', '"a\\u003a"']), STRINGS)
SPACE = st.sampled_from(["", " ", "\n  "])


@st.composite
def texts(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.integers(0, 9 if depth < 34 else 3))
    if kind <= 1:
        return draw(STRINGS)
    if kind <= 3:
        return draw(st.one_of(NUMBERS, st.sampled_from(["true", "false", "null"])))
    if kind == 4:  # a deep chain, about MAX_DEPTH levels
        levels = draw(st.integers(28, 36))
        return "[" * levels + draw(texts(depth + levels)) + "]" * levels
    space = draw(SPACE)
    if kind <= 6:
        items = draw(st.lists(texts(depth + 1), max_size=3))
        return "[" + space + ("," + space).join(items) + "]"
    keys = draw(st.lists(KEYS, max_size=3))
    members = [f"{k}{draw(SPACE)}:{space}{draw(texts(depth + 1))}" for k in keys]
    return "{" + ",".join(members) + "}"


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts(), st.sampled_from(DIALECTS), st.sampled_from([None, None, 0.5, 0.9]))
def test_the_screened_read_gives_what_the_hooked_read_gives_or_declines(
    text: str, dialect: Dialect, cut: float | None
) -> None:
    raw = text.encode()
    if cut is not None:  # malformed: cut short, as a file still being written
        raw = raw[: int(len(raw) * cut)]
    hooked = outcome(strictjson._parse_hooked, raw, dialect)
    screened = outcome(strictjson._parse_screened, raw, dialect)
    if screened is not None:
        if screened[0] == "raised":
            assert screened == hooked  # malformed text: the same error, word for word
        else:
            assert screened == hooked
            assert hooked[1] == ()  # it declines every text with a violation
    assert outcome(parse_json, raw, dialect) == hooked


# Characters that make a text malformed near where msgspec's grammar and json's
# could part: whitespace JSON does not allow, number forms, escapes, literals.
EDITS = st.sampled_from(
    [*'[]{}:,"\\ -+.0123456789eEafnrtux/',
     "\x0b", "\x0c", "\xa0", "\u2028", "\t", "\n", "\r", "\x00", "\x7f", "é", "\U0001f600",
     "NaN", "Infinity", "true", "nul", "\\u", "\\ud800", "\\udc00", "0x1", "1.", ".5", "01"]
)  # fmt: skip


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts(),
    st.lists(st.tuples(st.floats(0, 1), st.integers(0, 2), EDITS), min_size=1, max_size=3),
)
def test_an_edited_text_reads_as_the_hooked_read_reads_it_or_declines(
    text: str, edits: list[tuple[float, int, str]]
) -> None:
    """Edits near the grammar's edges: the screened read never takes a text the
    hooked read refuses, nor reads one differently."""
    for where, kind, part in edits:
        at = int(where * len(text))
        text = (
            (text[:at] + part + text[at + (kind > 0) :]) if kind < 2 else text[:at] + text[at + 1 :]
        )
    raw = text.encode("utf-8", "surrogatepass")
    screened = outcome(strictjson._parse_screened, raw, MANIFEST)
    if screened is not None:
        assert screened == outcome(strictjson._parse_hooked, raw, MANIFEST)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1, "a": 2}',
        '{"a": 1, "a": ":"}',  # the repeat's colon is not made up by a string's
        '{"a": 1, "a": "\\u003a"}',  # nor by an escaped one
        '{"a": "\\u003a", "a": "\\u003a"}',
        '{"x": {"k": [1, 2]}, "x": {}}',
        "[-0]",
        "-0",
        '{"a": -0}',
        "[1, -0 ]",
        "[9007199254740992]",
        "[-9007199254740992]",
        '["\\ud800"]',
        '["\\u007f"]',
        '["\\u0085"]',
        '["\\n"]',
        "[1e400]",
        "[NaN]",
        "[" * 33 + "]" * 33,
    ],
)
def test_the_screened_read_declines_what_only_hooks_see(text: str) -> None:
    """Each reads differently without the hooks (-0, a repeat) or breaks a rule."""
    assert strictjson._parse_screened(text.encode(), MANIFEST) is None


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "\\\\u003a", "b": 1}',  # an escaped backslash, then text: no colon escape
        '{"a": "rank-0", "b": "-0", "c": "x-0]"}',  # -0 inside strings only
        '{"a": "[[[[", "b": "]]]]"}',  # brackets inside strings do not nest
        '{"a": "\\ud83d\\ude00", "b": "\U0001f600"}',  # a surrogate pair is one character
        '{"a": [-0.0, 2.0, 1e2], "b": 9007199254740991}',
        "[" * 32 + "]" * 32,
    ],
)
def test_the_screened_read_takes_clean_text_with_lookalikes(text: str) -> None:
    raw = text.encode()
    assert strictjson._parse_screened(raw, MANIFEST) is not None
    assert outcome(strictjson._parse_screened, raw, MANIFEST) == outcome(
        strictjson._parse_hooked, raw, MANIFEST
    )


def test_header_dialect_keeps_integers_to_2_64() -> None:
    raw = b'{"a": [18446744073709551615, 9007199254740993, -9223372036854775808]}'
    screened = strictjson._parse_screened(raw, HEADER_JSON)
    assert screened is not None and screened.value == json.loads(raw)
    assert strictjson._parse_screened(b"[18446744073709551616]", HEADER_JSON) is None
    assert strictjson._parse_screened(b"[9007199254740992]", MANIFEST) is None


def _fixture_documents() -> list[tuple[str, bytes, Dialect]]:
    documents: list[tuple[str, bytes, Dialect]] = []
    for bundle in sorted(p for p in FIXTURES.iterdir() if p.is_dir()):
        if bundle.name.startswith("rejected"):
            continue
        documents.append((bundle.name, (bundle / "manifest.json").read_bytes(), MANIFEST))
        for path in sorted(bundle.glob("*.safetensors")):
            content = path.read_bytes()
            (length,) = struct.unpack("<Q", content[:8])
            header = content[8 : 8 + length].rstrip(b" ")
            documents.append((f"{bundle.name}/{path.name}", header, HEADER_JSON))
    return documents


@pytest.mark.parametrize(("name", "raw", "dialect"), _fixture_documents())
def test_what_producers_write_takes_the_screened_read(
    name: str, raw: bytes, dialect: Dialect
) -> None:
    """Accepted fixtures (manifests and headers) never pay for the hooked read."""
    assert strictjson._parse_screened(raw, dialect) is not None, name


# ------------------------------------------------------------ frozen_records


@dataclass(frozen=True, slots=True)
class Pair:
    left: int
    right: str


@pytest.mark.parametrize("rows", [2, 300])  # below and above the bulk threshold
def test_frozen_records_are_the_records_map_builds(rows: int) -> None:
    columns = (
        [f"w{i}" for i in range(rows)],
        ["F32", "BF16"] * (rows // 2),
        [(2, 3), ()] * (rows // 2),
        ["p", ""] * (rows // 2),
        ["t.st", None] * (rows // 2),
        ["0" * 64, None] * (rows // 2),
    )
    built = frozen_records(TensorEntry, *columns)
    assert built == list(map(TensorEntry, *columns))
    assert {type(r) for r in built} == {TensorEntry}
    assert list(map(hash, built)) == [hash(r) for r in map(TensorEntry, *columns)]
    assert repr(built[0]) == repr(TensorEntry(*(c[0] for c in columns)))
    with pytest.raises(FrozenInstanceError):
        built[-1].name = "x"  # type: ignore[misc]
    numbers = list(range(rows))
    assert frozen_records(Pair, numbers, map(str, numbers)) == list(
        map(Pair, numbers, map(str, numbers))
    )
    assert frozen_records(HeaderEntry, [], [], [], [], []) == []


def test_frozen_records_refuses_other_classes() -> None:
    @dataclass(slots=True)
    class Mutable:
        x: int

    @dataclass(frozen=True)
    class NoSlots:
        x: int

    @dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            if self.x < 0:
                raise ValueError("negative")

    for cls in (Mutable, NoSlots, Checked, int):
        with pytest.raises(TypeError):
            frozen_records(cls, list(range(300)))


def test_a_big_header_is_read_into_header_entries(tmp_path: Path) -> None:
    count = 300
    fields = ",".join(
        f'"t{i}":{{"dtype":"F32","shape":[2],"data_offsets":[{8 * i},{8 * i + 8}]}}'
        for i in range(count)
    )
    header = ("{" + fields + "}").encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8 * count))
    fd = os.open(path, os.O_RDONLY)
    try:
        entries = read_header(fd, "t.safetensors").entries
    finally:
        os.close(fd)
    start = 8 + len(header)
    expected = {
        f"t{i}": HeaderEntry(f"t{i}", "F32", (2,), start + 8 * i, start + 8 * i + 8)
        for i in range(count)
    }
    assert entries == expected
    assert {type(entry) for entry in entries.values()} == {HeaderEntry}


# ------------------------------------------------------------ parse_floatless


def holds_float(value: Any) -> bool:
    if isinstance(value, dict):
        return any(holds_float(v) for v in value.values())
    if isinstance(value, list):
        return any(holds_float(v) for v in value)
    return isinstance(value, float)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts(), st.sampled_from(DIALECTS))
def test_a_floatless_tree_is_the_hooked_tree(text: str, dialect: Dialect) -> None:
    raw = text.encode()
    tree = strictjson.parse_floatless(raw, dialect)
    if tree is None or holds_float(tree):
        return  # declined, or the caller would decline it
    hooked = strictjson._parse_hooked(raw, dialect)
    assert hooked.violations == ()
    assert exact(tree) == exact(hooked.value)
    assert hooked.floats == ()


HEADER_VALUES = st.sampled_from(
    ['"F32"', '"F4"', '"Q8"', "[2]", "[2, 3]", "[0, 8]", "[8, 16]", "[0, 24]", "[-0, 8]",
     "[0, 8.0]", "[0, 18446744073709551616]", "[0, 1e400]", "[]", "{}", '"x"', "-0", "1"]
)  # fmt: skip
HEADER_KEYS = st.sampled_from(['"dtype"', '"shape"', '"data_offsets"', '"crc"', '"dtype\\u003a"'])


@st.composite
def header_texts(draw: st.DrawFn) -> bytes:
    """Header text as writers spell it, and near it: repeats, -0, floats, escapes."""
    entries = []
    offset = 0
    for name in draw(st.lists(st.sampled_from(['"a"', '"b"', '"a\\u003a"', '"a"']), max_size=3)):
        fields = {"dtype": '"F32"', "shape": "[2]", "data_offsets": f"[{offset}, {offset + 8}]"}
        offset += 8
        members = [f'"{k}": {v}' for k, v in fields.items()]
        if draw(st.integers(0, 2)) == 0:  # change or add a field
            members.append(f"{draw(HEADER_KEYS)}: {draw(HEADER_VALUES)}")
        entries.append(f"{name}: {{{', '.join(draw(st.permutations(members)))}}}")
    if draw(st.booleans()):
        entries.append(draw(st.sampled_from(
            ['"__metadata__": {"format": "pt"}', '"__metadata__": {"n": 1.5}',
             '"__metadata__": {"a": "x", "a": "y"}', '"__metadata__": []']
        )))  # fmt: skip
    return ("{" + ", ".join(draw(st.permutations(entries))) + "}").encode()


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header_texts(), st.sampled_from([0, 8, 16, 24]))
def test_a_header_reads_the_same_with_and_without_orjson(
    tmp_path_factory: pytest.TempPathFactory, header: bytes, data_size: int
) -> None:
    import nanrunbook.tensors.safetensors as module

    path = tmp_path_factory.mktemp("h") / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data_size))
    results = []
    original = module._plain_header
    for plain_header in (original, lambda raw, start: None):
        module._plain_header = plain_header
        fd = os.open(path, os.O_RDONLY)
        try:
            results.append(read_header(fd, "t.safetensors"))
        except Exception as err:  # EvidenceRejected: compare the violations
            results.append(getattr(err, "violations", err))
        finally:
            os.close(fd)
            module._plain_header = original
    assert results[0] == results[1]


# -------------------------------------------------- canonical_member_dropped

ID = "training-incident-evidence@sha256:" + "0123456789abcdef" * 4
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53) + 1, 2**53 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([2.0, -0.0, 1e16, 1e-7, 0.5]),
    st.text(max_size=6),
    st.sampled_from([ID, "x:2.0,", '"evidence_content_id":"' + ID + '"', "\U0001f600", "\x7f"]),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "evidence_content_id", "é"]), inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.sampled_from(["a", "b", "z", "\U00010000", "ｚ"]), VALUES, max_size=4),
    st.one_of(st.none(), st.just(ID), VALUES),
    st.booleans(),
    st.sampled_from([None, 2]),
)
def test_the_member_dropped_form_is_rfc8785_of_the_rest(
    rest: dict[str, Any], declared: Any, ascii_only: bool, indent: int | None
) -> None:
    import rfc8785

    document = dict(rest)
    if declared is not None:
        document["evidence_content_id"] = declared
    text = json.dumps(document, ensure_ascii=ascii_only, indent=indent).encode()
    parsed = parse_json(text, MANIFEST)
    body = {k: v for k, v in parsed.value.items() if k != "evidence_content_id"}
    expected = rfc8785.dumps(body)
    assert strictjson.canonical_member_dropped(parsed, "evidence_content_id") == expected


def test_the_member_dropped_form_cuts_the_text_for_a_producers_manifest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No second orjson pass over the tree, and rfc8785 sees single floats only."""
    import orjson
    import rfc8785

    manifest = FIXTURES / "hold-backward-dynamic-skip" / "manifest.json"
    parsed = strictjson.load_manifest(manifest.read_bytes())
    assert parsed.sorted_compact is not None
    body = {k: v for k, v in parsed.value.items() if k != "evidence_content_id"}
    expected = rfc8785.dumps(body)
    calls: list[Any] = []
    real_rfc, real_orjson = rfc8785.dumps, orjson.dumps
    monkeypatch.setattr(rfc8785, "dumps", lambda v: calls.append(v) or real_rfc(v))
    monkeypatch.setattr(orjson, "dumps", lambda v, **k: calls.append(v) or real_orjson(v, **k))
    assert strictjson.canonical_member_dropped(parsed, "evidence_content_id") == expected
    # Only the member itself (to find its text), the floats and single floats.
    whole = [v for v in calls if isinstance(v, dict) and set(v) != {"evidence_content_id"}]
    assert whole == []
