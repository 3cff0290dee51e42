"""The fast RFC 8785 form agrees with ``rfc8785`` byte for byte.

Generated over every JSON value the spec admits: keys and strings of any
Unicode scalar values (key order by UTF-16 code units), integers of the safe
range, every finite float (ES6 number form), nesting; and through the strict
reader, from JSON text spelled as producers spell it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import rfc8785
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from property_budget import examples

from nanrunbook import EvidenceRejected, strictjson
from nanrunbook.manifest.content_id import evidence_content_id
from nanrunbook.strictjson import MANIFEST, canonical_json, parse_json

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SAFE = 2**53 - 1


def floats_in(value: Any) -> Iterator[float]:
    if isinstance(value, dict):
        for item in value.values():
            yield from floats_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from floats_in(item)
    elif isinstance(value, float):
        yield value


# Text that looks like a number where only a number can stand, so the fast
# path's count of float tokens meets strings that would fool a plain search.
TRICKY = st.sampled_from(
    [":2.0,", "[1e+16]", ",-0.0}", ":100.0]", "2.0", "a:1e-7,b", "\ud7ff", "\ue000", "\uffff",
     "\U00010000", "\U0010ffff", "\x00", "\x1f", "\x7f", "\u2028", '"', "\\", "/", "é"]
)  # fmt: skip
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=8),
    TRICKY,
    st.lists(TRICKY, max_size=3).map("".join),
)
NUMBERS = st.one_of(
    st.integers(-SAFE, SAFE),
    st.sampled_from([SAFE, -SAFE, 0, -1, 2**31, 10**15]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        [0.0, -0.0, 2.0, 1e16, 1e21, 1e-7, 1e-6, 5e-324, 1.7976931348623157e308, 0.1,
         123456789012345680000.0, 100.0, -2.5, 65536.0, 1e20, 1e-5]
    ),
)  # fmt: skip
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=30,
)


@settings(
    max_examples=examples(300, 1500), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(JSON_VALUES)
def test_fast_form_equals_rfc8785_for_every_json_value(value: Any) -> None:
    assert canonical_json(value, list(floats_in(value))) == rfc8785.dumps(value)


@settings(
    max_examples=examples(120, 600), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.dictionaries(TEXT, JSON_VALUES, max_size=6), st.booleans())
def test_fast_form_of_a_strictly_read_document_equals_rfc8785(value: Any, ascii_only: bool) -> None:
    """From JSON text as a producer writes it (escaped or raw UTF-8, indented)."""
    text = json.dumps(value, ensure_ascii=ascii_only, indent=2).encode()
    parsed = parse_json(text, MANIFEST)
    assert canonical_json(parsed.value, parsed.floats) == rfc8785.dumps(parsed.value)


def _readable(bundle: Path) -> bool:
    try:
        strictjson.load_manifest((bundle / "manifest.json").read_bytes())
    except EvidenceRejected:
        return False  # rejected-json-lexical: no content id to compute
    return True


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and _readable(p))
)
def test_fixture_content_ids_take_the_fast_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    document = strictjson.load_manifest((FIXTURES / name / "manifest.json").read_bytes())
    expected = evidence_content_id(document.value)  # rfc8785 itself
    calls: list[Any] = []
    real = rfc8785.dumps
    monkeypatch.setattr(rfc8785, "dumps", lambda v: calls.append(v) or real(v))
    assert evidence_content_id(document.value, floats=document.floats) == expected
    assert all(not isinstance(v, dict) for v in calls)  # only single floats went to rfc8785


@pytest.mark.parametrize(
    ("value", "floats"),
    [
        ({"\U00010000": 1, "\ue000": 2}, []),  # key order differs past U+FFFF
        ({"a": "x:2.0,", "b": 2.0}, [2.0]),  # a float's token also stands in a string
        ({"a": 2.0}, [2.0, 2.0]),  # floats listed that the value does not hold
        ({"a": 2**53}, []),  # outside the safe range
    ],
)
def test_fast_path_declines_when_it_cannot_be_sure(value: Any, floats: list[float]) -> None:
    try:
        expected = rfc8785.dumps(value)
    except rfc8785.CanonicalizationError:
        with pytest.raises(rfc8785.CanonicalizationError):
            canonical_json(value, floats)
        return
    assert strictjson._canonical_fast(value, floats) is None
    assert canonical_json(value, floats) == expected


def test_orjson_float_tokens_round_trip() -> None:
    """The fast path reads orjson's token back to the float it spells."""
    for value in (2.0, 1e16, -0.0, 5e-324, 1.7976931348623157e308, 0.1, 1 / 3):
        token = orjson.dumps(value)
        assert float(token) == value and math.copysign(1, float(token)) == math.copysign(1, value)
