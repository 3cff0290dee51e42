"""Strict JSON: the one reader of manifest.json and safetensors headers, and the
RFC 8785 form that content ids hash.

``json.loads`` accepts duplicate keys, ``NaN``/``Infinity`` literals, number
literals that overflow to infinity, integers of any size, ``-0`` as the integer
0, and escapes of lone UTF-16 surrogates. The spec rejects all of them, with the
JSON path of each. A :class:`Dialect` names the rules a kind of document applies
and the code each one reports: the manifest's are :data:`MANIFEST`, a header's
live with the header code.

A big text (:data:`SCREEN_FROM_BYTES`) is read at C speed unless something is
wrong. ``msgspec`` parses with one hook, per float literal (reading what
``json`` reads without hooks, twice as fast); ``orjson`` writes the tree back
(refusing lone surrogates and integers out of range), and counting colons in
both texts shows whether a key repeats. The string rules and the nesting depth
are screened over that compact text with ``bytes`` searches, ``translate`` and
compiled patterns. Only when a screen finds something, or the text is small,
is it read with hooks on every number and object, which leave markers where a
literal breaks a rule, and the tree walked, to name the path of every violation.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import rfc8785

from nanrunbook.errors import EvidenceRejected, Violation, quote

__all__ = [
    "CODES",
    "MANIFEST",
    "MAX_DEPTH",
    "MAX_SAFE_INTEGER",
    "Dialect",
    "Parsed",
    "canonical_json",
    "child_path",
    "has_control_character",
    "load_manifest",
    "load_manifest_bytes",
    "pairs_of",
    "parse_floatless",
    "parse_json",
]

MAX_DEPTH = 32
# Integers beyond this are not exact in an IEEE double; RFC 8785 refuses them.
MAX_SAFE_INTEGER = 2**53 - 1


def power_of_two_text(limit: int) -> str:
    """How the docs spell a bound one below a power of two: ``2^53 - 1``."""
    return f"2^{(limit + 1).bit_length() - 1} - 1"


# The lexical rules, each a kind a Dialect maps to its own code.
DUPLICATE_KEY = "duplicate_key"
NONFINITE = "nonfinite"
INTEGER_RANGE = "integer_range"
CONTROL = "control_character"
LONE_SURROGATE = "lone_surrogate"
TOO_DEEP = "too_deep"

CODES = {
    "MANIFEST_NOT_UTF8": "manifest.json is not UTF-8, or starts with a byte-order mark",
    "MANIFEST_INVALID_JSON": "manifest.json is not one well-formed JSON value",
    "MANIFEST_TOO_DEEP": f"manifest.json nests objects and arrays more than {MAX_DEPTH} deep",
    "MANIFEST_NOT_OBJECT": "manifest.json is not a JSON object",
    "JSON_DUPLICATE_KEY": "an object repeats a key",
    "JSON_NONFINITE_NUMBER": "a NaN or Infinity literal, or a number that overflows to infinity",
    "JSON_INTEGER_OUT_OF_RANGE": (
        f"an integer outside +-({power_of_two_text(MAX_SAFE_INTEGER)}), the RFC 8785 safe range"
    ),
    "JSON_CONTROL_CHARACTER": "a string or key contains a C0, DEL or C1 control character",
    "JSON_LONE_SURROGATE": "a string or key escapes a lone UTF-16 surrogate, which has no UTF-8 form",
}


@dataclass(frozen=True, slots=True)
class Dialect:
    """The lexical rules one kind of document applies, and the code each reports.

    A rule whose kind is not in ``codes`` is not applied. An integer literal past
    ``max_integer`` either way is kept out of the tree as an
    :class:`OutOfRangeInteger` marker, a violation only where INTEGER_RANGE applies.
    """

    codes: Mapping[str, str]
    max_integer: int


MANIFEST = Dialect(
    codes={
        DUPLICATE_KEY: "JSON_DUPLICATE_KEY",
        NONFINITE: "JSON_NONFINITE_NUMBER",
        INTEGER_RANGE: "JSON_INTEGER_OUT_OF_RANGE",
        CONTROL: "JSON_CONTROL_CHARACTER",
        LONE_SURROGATE: "JSON_LONE_SURROGATE",
        TOO_DEEP: "MANIFEST_TOO_DEEP",
    },
    max_integer=MAX_SAFE_INTEGER,
)

_SAFE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class NonFiniteNumber:
    """Marker for a ``NaN``/``Infinity`` literal or an overflowing number."""

    text: str


@dataclass(frozen=True, slots=True)
class OutOfRangeInteger:
    """Marker for an integer literal past the dialect's ``max_integer``."""

    text: str


class ObjectWithDuplicates(dict[str, Any]):
    """A parsed object that repeated keys: the first value of each key is kept,
    ``pairs`` holds every pair in document order."""

    duplicates: tuple[str, ...] = ()
    pairs: tuple[tuple[str, Any], ...] = ()


def pairs_of(obj: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """Every key/value pair of a parsed object as the text has them, repeats included."""
    return obj.pairs if isinstance(obj, ObjectWithDuplicates) else obj.items()


def _with_duplicates(pairs: list[tuple[str, Any]]) -> ObjectWithDuplicates:
    result = ObjectWithDuplicates()
    repeated: list[str] = []
    for key, value in pairs:
        if key in result:
            repeated.append(key)
        else:
            result[key] = value
    result.duplicates = tuple(repeated)
    result.pairs = tuple(pairs)
    return result


@dataclass(frozen=True, slots=True)
class Parsed:
    """A document as the reader left it.

    ``violations`` are the lexical ones, ``where`` being the JSON path, in document
    order. ``floats`` are the values of every float literal (``-0`` included),
    which lets :func:`canonical_json` take its fast path. ``sorted_compact``, when
    the screened read made it, is ``orjson``'s compact form of the tree with keys
    sorted, integers within 2^53 - 1: what :func:`canonical_member_dropped` starts from.
    """

    value: Any
    violations: tuple[Violation, ...]
    floats: tuple[float, ...]
    sorted_compact: bytes | None = None


def parse_json(raw: bytes, dialect: Dialect) -> Parsed:
    """Parse UTF-8 JSON text strictly under ``dialect``.

    Raises UnicodeDecodeError, json.JSONDecodeError (malformed text) and
    RecursionError (nesting too deep for the parser); the caller words them.
    """
    screened = _parse_screened(raw, dialect) if len(raw) >= SCREEN_FROM_BYTES else None
    return screened or _parse_hooked(raw, dialect)


# Below this size the hooked read costs less than importing msgspec and reading
# screened: measured in fresh processes, reading, parsing and the content id of a
# 1.6 MB manifest took 4.5 ms less hooked, of a 6.6 MB one 11 ms less screened.
SCREEN_FROM_BYTES = 3 << 20


def _parse_screened(raw: bytes, dialect: Dialect) -> Parsed | None:
    """The document read by ``msgspec`` with one hook, per float literal, when
    screens over the text and the tree show it breaks none of the rules; else
    None, and :func:`_parse_hooked` reads it again to name every violation.

    msgspec reads what ``json`` reads without hooks (the same grammar, integers
    of any size, the same strings; tests/test_screened_reader.py) at twice the
    speed. Without the integer and object hooks an integer literal ``-0`` reads
    as 0, one past the range as a plain int, and a repeated key keeps its last
    value: the screens decline all three. They may decline a clean text (then
    the hooked read finds nothing); they never pass one the hooked read would fault.
    """
    if dialect.max_integer < MAX_SAFE_INTEGER:
        return None  # orjson's integer screen cannot see a tighter bound
    import msgspec  # here: only a big text pays for its import

    # Python's UTF-8 rules, and its error, as the hooked read's; ASCII is UTF-8 as it
    # stands, and msgspec reads it without a decoded copy (3 ms of 6.5 MB, measured).
    text = raw if raw.isascii() else raw.decode("utf-8")
    floats: list[float] = []
    nonfinite: list[str] = []

    def parse_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            nonfinite.append(literal)
        floats.append(value)
        return value

    try:
        value = msgspec.json.Decoder(float_hook=parse_float).decode(text)
    except (msgspec.DecodeError, RecursionError):  # malformed, too deep, a huge integer
        return None  # the hooked read words it (stopping where json stops)
    if nonfinite:
        return None
    compact = _compact_as_hooked(raw, value, dialect, orjson.OPT_SORT_KEYS)
    if compact is None:
        return None
    # Integers past 2^53 - 1 would have no RFC 8785 form: only then is it kept.
    exact = dialect.max_integer == MAX_SAFE_INTEGER
    return Parsed(value, (), tuple(floats), compact if exact else None)


def parse_floatless(raw: bytes, dialect: Dialect) -> Any | None:
    """``orjson``'s tree of the text, for a caller that then confirms it holds no
    float: that tree is :func:`parse_json`'s, with no violation. None when the
    screens cannot be sure (then :func:`parse_json` reads it).

    orjson reads faster than ``json`` where a text holds many small objects (a
    safetensors header), but it reads an integer past 2^64 as a float, which only
    the caller's check of the tree can see.
    """
    if dialect.max_integer < MAX_SAFE_INTEGER:
        return None
    try:
        value = orjson.loads(raw)  # refuses NaN, Infinity, overflow, lone surrogates
    except orjson.JSONDecodeError:
        return None
    return value if _compact_as_hooked(raw, value, dialect) is not None else None


def _compact_as_hooked(raw: bytes, value: Any, dialect: Dialect, option: int = 0) -> bytes | None:
    """orjson's compact form of ``value`` (with ``option``) when ``value``, read from
    ``raw`` without integer and object hooks, is what :func:`_parse_hooked` reads,
    with no violation (its floats aside); else None."""
    if b"-0" in raw and _may_hold_negative_zero_integer(raw):
        return None
    # orjson refuses lone surrogates and integers outside the range (at most
    # 2^53 - 1 with OPT_STRICT_INTEGER; else -2^63 .. 2^64 - 1, within U64_MAX).
    if dialect.max_integer < _U64_MAX:
        option |= orjson.OPT_STRICT_INTEGER
    try:
        compact = orjson.dumps(value, option=option)
    except orjson.JSONEncodeError:
        return None
    if _colons(raw) != compact.count(b":"):
        return None  # a repeated key
    # The tree's own text is shorter, and spells each control character the one
    # way the string screens look for (an escape below U+0020, DEL and C1 raw).
    return None if _may_break_rules(compact, dialect) else compact


_U64_MAX = 2**64 - 1  # the widest integer orjson writes
_NEGATIVE_ZERO = re.compile(rb"-0(?![.eE0-9])")
_BEFORE_A_VALUE = frozenset(b":,[ \t\n\r")


def _may_hold_negative_zero_integer(raw: bytes) -> bool:
    """Whether an integer literal ``-0`` may stand in the text: a ``-0`` with no
    fraction, exponent or digit after it, at the start or after a byte that may
    come before a value (a string holding ``"a -0"`` also answers yes)."""
    return any(
        match.start() == 0 or raw[match.start() - 1] in _BEFORE_A_VALUE
        for match in _NEGATIVE_ZERO.finditer(raw)
    )


def _colons(raw: bytes) -> int:
    """The colons of the text as parsed: one per key, and those its strings hold,
    spelled raw or as an escape.

    ``orjson`` writes every colon raw, so the compact form of the tree has as many
    only when no key was dropped, that is when no object repeats a key: a repeat
    loses its key and the strings of its value, never gains any.
    """
    colons = raw.count(b":")
    if b"\\" in raw:
        # Escaped backslashes first, left to right as a parser reads them, so that
        # every backslash left starts an escape.
        unescaped = raw.replace(b"\\\\", b"")
        colons += unescaped.count(b"\\u003a") + unescaped.count(b"\\u003A")
    return colons


def _parse_hooked(raw: bytes, dialect: Dialect) -> Parsed:
    """:func:`parse_json` with a hook on every number and object, so a literal that
    breaks a rule leaves a marker; the tree is walked to name each violation."""
    text = raw.decode("utf-8")
    floats: list[float] = []
    flagged: list[bool] = []  # a hook left a marker or met a repeated key
    limit = dialect.max_integer

    def parse_int(literal: str) -> int | float | OutOfRangeInteger:
        # 15 characters hold no integer past 2^53: the common case costs one int().
        if len(literal) < 16:
            if literal == "-0":  # the float negative zero, not the integer 0
                floats.append(-0.0)
                return -0.0
            return int(literal)
        # Length first: int() of a huge literal is slow and raises past 4300 digits.
        value = int(literal) if len(literal) <= 21 else None
        if value is None or abs(value) > limit:
            flagged.append(True)
            return OutOfRangeInteger(literal)
        return value

    def parse_float(literal: str) -> float | NonFiniteNumber:
        value = float(literal)
        if math.isfinite(value):
            floats.append(value)
            return value
        flagged.append(True)
        return NonFiniteNumber(literal)

    def parse_constant(literal: str) -> NonFiniteNumber:
        flagged.append(True)
        return NonFiniteNumber(literal)

    def object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        flagged.append(True)
        return _with_duplicates(pairs)

    decoder = json.JSONDecoder(
        object_pairs_hook=object_pairs,
        parse_int=parse_int,
        parse_float=parse_float,
        parse_constant=parse_constant,
    )
    value = decoder.decode(text)
    violations: list[Violation] = []
    if flagged or _may_break_rules(raw, dialect):
        _walk(value, "$", 0, dialect, violations)
    return Parsed(value, tuple(violations), tuple(floats))


# ------------------------------------------------------------------- screens
#
# Each screen may answer "maybe" for a clean text (then the walk finds nothing);
# none may answer "clean" for a text the walk would fault.

# Escapes that can spell a C0, DEL or C1 control character (and some that cannot).
_CONTROL_ESCAPE = re.compile(rb"\\(?:[bfnrt]|u00[01789])")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_C1_UTF8 = re.compile(rb"\xc2[\x80-\x9f]")  # U+0080..U+009F encoded
_ANY_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
_SQUARE = bytes.maketrans(b"{}", b"[]")


def _may_break_rules(raw: bytes, dialect: Dialect) -> bool:
    """Whether a string or the nesting might break one of the dialect's rules."""
    codes = dialect.codes
    if b"\\" in raw:
        if CONTROL in codes and _CONTROL_ESCAPE.search(raw):
            return True
        if LONE_SURROGATE in codes and _SURROGATE_ESCAPE.search(raw):
            return True
    # A raw C0 character in a string is malformed JSON already; DEL and C1 are not.
    if CONTROL in codes and (b"\x7f" in raw or (b"\xc2" in raw and _C1_UTF8.search(raw))):
        return True
    return TOO_DEEP in codes and _nesting_depth(raw, MAX_DEPTH) > MAX_DEPTH


def _nesting_depth(raw: bytes, limit: int) -> int:
    """The depth of the brackets outside strings in well-formed JSON text, or
    ``limit + 1`` once it is known to pass ``limit``."""
    if b"\\" in raw:  # escaped backslashes first, so that each \" left is an escaped quote
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(None, _NOT_STRUCTURE)  # brackets and quotes left
    # Quotes alternate, opening and closing a string. Dropping two adjacent ones
    # drops an empty string, or the nothing between two strings (which joins
    # them): either way the quotes left still enclose only what strings hold.
    structure = structure.replace(b'""', b"")
    if b'"' in structure:  # some string holds a bracket
        structure = b"".join(structure.split(b'"')[0::2])
    # The parser matched every bracket with its own kind, so one kind will do.
    brackets = structure.translate(_SQUARE)
    for depth in range(limit + 1):
        if not brackets:
            return depth
        brackets = brackets.replace(b"[]", b"")  # one level: every innermost pair
    return limit + 1


# ---------------------------------------------------------------------- walk

_CONTROL_CHARACTER = re.compile("[\x00-\x1f\x7f-\x9f]")  # category Cc
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # category Cs


def has_control_character(text: str) -> bool:
    """True for C0, DEL and C1 controls (category Cc)."""
    return _CONTROL_CHARACTER.search(text) is not None


def child_path(path: str, key: str | int) -> str:
    """JSON path of a child; untrusted keys are shown quoted and escaped."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if _SAFE_KEY.fullmatch(key):
        return f"{path}.{key}"
    return f"{path}[{quote(key)}]"


def _string(text: str, path: str, what: str, dialect: Dialect, out: list[Violation]) -> None:
    codes = dialect.codes
    if CONTROL in codes and _CONTROL_CHARACTER.search(text):
        out.append(Violation(codes[CONTROL], path, f"{what} has a control character"))
    if LONE_SURROGATE in codes and _LONE_SURROGATE.search(text):
        out.append(Violation(codes[LONE_SURROGATE], path, f"{what} has a lone surrogate escape"))


def _walk(value: Any, path: str, depth: int, dialect: Dialect, out: list[Violation]) -> None:
    codes = dialect.codes
    if isinstance(value, dict | list):
        depth += 1
        if depth > MAX_DEPTH and TOO_DEEP in codes:
            out.append(Violation(codes[TOO_DEEP], path, f"nesting passes {MAX_DEPTH} levels here"))
            return
        if isinstance(value, list):
            for index, item in enumerate(value):
                _walk(item, child_path(path, index), depth, dialect, out)
            return
        if DUPLICATE_KEY in codes:
            for key in getattr(value, "duplicates", ()):
                message = f"key {quote(key)} appears twice"
                out.append(Violation(codes[DUPLICATE_KEY], child_path(path, key), message))
        for key, item in value.items():
            _string(key, child_path(path, key), "key", dialect, out)
            _walk(item, child_path(path, key), depth, dialect, out)
    elif isinstance(value, str):
        _string(value, path, "string", dialect, out)
    elif isinstance(value, NonFiniteNumber):
        if NONFINITE in codes:
            message = f"{quote(value.text)} is not a finite number"
            out.append(Violation(codes[NONFINITE], path, message))
    elif isinstance(value, OutOfRangeInteger) and INTEGER_RANGE in codes:
        message = f"integer is outside +-({power_of_two_text(dialect.max_integer)})"
        out.append(Violation(codes[INTEGER_RANGE], path, message))


def lexical_violations(value: Any, dialect: Dialect = MANIFEST) -> list[Violation]:
    """Every lexical violation in a parsed tree, in document order (walks it all)."""
    out: list[Violation] = []
    _walk(value, "$", 0, dialect, out)
    return out


# ------------------------------------------------------------------ manifest

_MANIFEST = "manifest.json"


def _manifest_rejected(code: str, message: str) -> EvidenceRejected:
    return EvidenceRejected([Violation(code, _MANIFEST, message)])


def load_manifest(raw: bytes) -> Parsed:
    """Parse manifest bytes strictly; raise EvidenceRejected listing every lexical
    violation. The value is a plain tree of dict, list, str, int, float, bool, None.
    """
    if raw.startswith(b"\xef\xbb\xbf"):
        raise _manifest_rejected("MANIFEST_NOT_UTF8", "starts with a UTF-8 byte-order mark")
    try:
        parsed = parse_json(raw, MANIFEST)
    except UnicodeDecodeError as err:
        raise _manifest_rejected(
            "MANIFEST_NOT_UTF8", f"invalid UTF-8 at byte {err.start}"
        ) from None
    except json.JSONDecodeError as err:
        # json's "Unterminated string starting at" ends in its own "at".
        message = f"{err.msg.removesuffix(' at')} at line {err.lineno} column {err.colno}"
        if _ends_inside_a_value(raw):
            message += (
                "; the file ends before its JSON does: it may be truncated or still being written"
            )
        raise _manifest_rejected("MANIFEST_INVALID_JSON", message) from None
    except RecursionError:
        raise _manifest_rejected(
            "MANIFEST_TOO_DEEP", f"nesting passes {MAX_DEPTH} levels"
        ) from None
    violations = list(parsed.violations)
    if not isinstance(parsed.value, dict):
        violations.insert(
            0, Violation("MANIFEST_NOT_OBJECT", "$", "the manifest must be one JSON object")
        )
    if violations:
        raise EvidenceRejected(violations)
    return parsed


def load_manifest_bytes(raw: bytes) -> dict[str, Any]:
    """The tree of :func:`load_manifest`."""
    value: dict[str, Any] = load_manifest(raw).value
    return value


def _ends_inside_a_value(raw: bytes) -> bool:
    """Whether malformed text stops inside a string, object or array, as a file
    cut short (or read while it is written) does."""
    text = raw.rstrip()
    if not text:
        return True
    text = _ANY_ESCAPE.sub(b"", text) if b"\\" in text else text
    if text.endswith(b"\\") or text.count(b'"') % 2:
        return True  # inside a string
    outside = b"".join(text.split(b'"')[0::2])
    opened = outside.count(b"[") + outside.count(b"{")
    return opened > outside.count(b"]") + outside.count(b"}")


# ------------------------------------------------------------ canonical form

_ASTRAL_LEADS = (b"\xf0", b"\xf1", b"\xf2", b"\xf3", b"\xf4")  # of characters past U+FFFF
_NUMBER_END = rb"(?=[,\]}])"
_SAFE_MEMBER = re.compile(r"[ !#-\[\]-~]*")  # printable ASCII but " and \: written as it is


def canonical_member_dropped(parsed: Parsed, key: str) -> bytes:
    """The RFC 8785 form of a parsed object without its member ``key``, byte for
    byte ``canonical_json`` of that smaller object.

    From :attr:`Parsed.sorted_compact` when the screened read made it and the
    member is found there exactly once: its text is cut out, not the whole tree
    written again. A member of printable ASCII other than quotes and backslashes
    cannot be spelled inside a string (every quote there is escaped), so each
    place its text stands is that member, at some depth; once only, the top one.
    """
    obj: dict[str, Any] = parsed.value
    body = {name: item for name, item in obj.items() if name != key}
    floats = None if not isinstance(obj.get(key, ""), str) else parsed.floats
    member = orjson.dumps({key: obj[key]})[1:-1] if key in obj else None
    compact = parsed.sorted_compact
    if compact is None or member is None or not _plain_member(key, obj[key]):
        return canonical_json(body, floats)
    start = compact.find(member)
    end = start + len(member)
    if start < 0 or compact.find(member, end) >= 0:
        return canonical_json(body, floats)  # not once only
    if compact[start - 1 : start] == b",":
        start -= 1  # the comma before it
    elif compact[end : end + 1] == b",":
        end += 1  # the first member: the comma after it
    fast = _canonical_from(compact, parsed.floats, (start, end, b""))
    return fast if fast is not None else canonical_json(body, floats)


def _plain_member(key: str, value: Any) -> bool:
    return all(isinstance(text, str) and _SAFE_MEMBER.fullmatch(text) for text in (key, value))


def canonical_json(value: Any, floats: Iterable[float] | None = None) -> bytes:
    """The RFC 8785 (JCS) form of ``value``, byte for byte what ``rfc8785.dumps`` gives.

    ``floats``, when given, are every float ``value`` holds (a :class:`Parsed`
    tree's ``floats``); then ``orjson`` writes the form when it provably gives the
    same bytes, and ``rfc8785`` (pure Python) only when it cannot be sure.
    """
    if floats is not None:
        fast = _canonical_fast(value, floats)
        if fast is not None:
            return fast
    canonical: bytes = rfc8785.dumps(value)
    return canonical


def _canonical_fast(value: Any, floats: Iterable[float]) -> bytes | None:
    """orjson's sorted compact form with its float tokens rewritten, or None.

    For JSON values orjson writes what JCS writes (same escapes, no spaces, the
    integers of the safe range alike; tests/test_canonical.py checks it) except in
    two places: it orders keys by code point where JCS orders them by UTF-16 code
    unit, which differs only for characters past U+FFFF (then: None), and it
    spells floats its own way (``2.0``, ``1e+16``). Each float's token is found
    where only a number can stand (after ``:``, ``,`` or ``[`` and before ``,``,
    ``]`` or ``}``) and rewritten, once the count found there equals the count of
    floats spelled so: a string holding such text would add to the count.
    """
    try:
        out = orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER)
    except (orjson.JSONEncodeError, TypeError):
        return None
    return _canonical_from(out, floats)


def _canonical_from(
    out: bytes, floats: Iterable[float], cut: tuple[int, int, bytes] | None = None
) -> bytes | None:
    """:func:`_canonical_fast` from orjson's sorted compact form ``out``, with the
    text of one member ``cut`` out (a float token found in it would make a count
    differ: then None)."""
    if not out.isascii() and any(lead in out for lead in _ASTRAL_LEADS):
        return None
    edits: list[tuple[int, int, bytes]] = [cut] if cut else []
    floats = list(floats)
    tokens = Counter(orjson.dumps(floats)[1:-1].split(b",")) if floats else Counter()
    for token, count in tokens.items():
        canonical: bytes = rfc8785.dumps(float(token))
        if canonical == token:
            continue
        found = [
            m.start()
            for m in re.finditer(re.escape(token) + _NUMBER_END, out)
            if m.start() > 0 and out[m.start() - 1] in b":,["
        ]
        if len(found) != count:
            return None
        edits.extend((start, start + len(token), canonical) for start in found)
    return _apply(out, sorted(edits)) if edits else out


def _apply(out: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    parts: list[bytes] = []
    done = 0
    for start, end, replacement in edits:
        parts += (out[done:start], replacement)
        done = end
    parts.append(out[done:])
    return b"".join(parts)
