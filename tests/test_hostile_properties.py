"""Hostile evidence, generated: structural mutants of the fixture bundles (issue 5).

Every mutant of a fixture bundle (keys deleted, duplicated, added and retyped at
every JSON path of the manifest and of the safetensors headers; stages swapped;
counts, ids, scales, shapes, dtypes, offsets, header lengths and raw bytes
perturbed) is checked, and for each:

* the library returns a Report or raises EvidenceRejected, nothing else; every
  violation has a known code and a one-line printable message;
* every renderer's output is terminal- and shell-safe (``kv`` lines match the
  fixed alphabet; text has no control or bidi character);
* the bundle directory is byte-identical afterwards (listing, modes, mtimes, hashes);
* the answer agrees with an independent oracle, ``oracle()`` below: a compact
  re-implementation of SPEC-bundle-v1 over the raw manifest dict with a numpy /
  ml_dtypes recount; the oracle uses nothing from nanrunbook (the tests import the
  checker, its renderers and, to reseal, its content id). An accepted mutant must
  satisfy every rule, with the oracle's decision, earliest stage, first non-finite
  tensor and per-stage counts; a mutant the oracle accepts must be accepted too.

Raw mutants mostly stop at the evidence content id, so mutants are also resealed
(content id; tensor digests; and "deep": counts, finite_max_abs and the dynamic
scaler's found_inf recomputed) to reach the contract rules behind it.

Sizes: the ``hostile-ci`` profile (default, derandomized) runs 2,400 library
mutants, 60 CLI mutants and 600 kv paths (about 90 s on 2 cores);
``HYPOTHESIS_PROFILE=fuzz`` (``make fuzz``) runs the ``hostile-fuzz`` profile, 20
times more and random; ``HOSTILE_EXAMPLES=N`` sets the library count. The counts
run are printed at the end of the module.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import re
import shutil
import struct
import tempfile
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import rfc8785
from hostile_support import (
    KV_LINE,
    TENSOR_FILE,
    TRACEBACK,
    VALID_FIXTURES,
    BundleModel,
    Pairs,
    Raw,
    Tensor,
    TensorFile,
    add_oddities,
    run_cli,
    snapshot,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# ------------------------------------------------------------------------- profiles

settings.register_profile(
    "hostile-ci",
    max_examples=2400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "hostile-fuzz",
    max_examples=48000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = "hostile-fuzz" if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else "hostile-ci"
_BASE = settings.get_profile(PROFILE)
# HOSTILE_EXAMPLES=N overrides the profile's count (a quick local run, a long soak).
LIBRARY_EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", _BASE.max_examples))
CLI_EXAMPLES = max(1, LIBRARY_EXAMPLES // 40)
KV_EXAMPLES = max(1, LIBRARY_EXAMPLES // 4)

CASES_RUN = {"library": 0, "library_accepted": 0, "cli": 0, "kv_where": 0}


@pytest.fixture(scope="module", autouse=True)
def _report_case_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    line = (
        f"hostile mutants ({PROFILE}): {CASES_RUN['library']} library "
        f"({CASES_RUN['library_accepted']} accepted), {CASES_RUN['cli']} CLI, "
        f"{CASES_RUN['kv_where']} kv paths"
    )
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(f"\n{line}")


# =========================================================================== oracle
#
# Independent of nanrunbook: the spec's rules, written again from the spec text.

STAGES = ("input", "forward", "loss", "backward", "optimizer")
BINDING_ITEMS = (
    "model", "checkpoint", "data", "batch", "loader_cursor", "objective", "optimizer",
    "scheduler", "scaler", "random_state", "environment", "topology", "precision",
)  # fmt: skip
TYPED = {
    "topology": ("world_size", "rank"),
    "precision": ("param_dtype", "compute_dtype"),
    "objective": ("reduction",),
    "scaler": ("mode", "scale"),
}
DYNAMIC = ("growth_factor", "backoff_factor", "found_inf", "step_skipped", "scale_after")
RECOVERY = {"model", "optimizer", "scheduler", "scaler", "data_position"}
IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,255}")
HEX64 = re.compile(r"[0-9a-f]{64}")
CID = "training-incident-evidence@sha256:"
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
SURROGATE = re.compile("[\ud800-\udfff]")
SAFE_MAX = 2**53 - 1
U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class DT:
    bits: int
    floating: bool
    max_finite: float | None
    decode: Callable[[bytes], np.ndarray] | None  # to float64 (complex: (n, 2) parts)
    can_nan: bool = True
    can_inf: bool = True


def _np(kind: Any) -> Callable[[bytes], np.ndarray]:
    return lambda data: np.frombuffer(data, dtype=kind).astype(np.float64)


def _f4(data: bytes) -> np.ndarray:
    raw = np.frombuffer(data, dtype=np.uint8)
    codes = np.empty(raw.size * 2, dtype=np.uint8)
    codes[0::2] = raw & 0x0F
    codes[1::2] = raw >> 4
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def _f6(kind: Any) -> Callable[[bytes], np.ndarray]:
    def decode(data: bytes) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        fields = bits.reshape(-1, 6).astype(np.uint8)
        codes = (fields << np.arange(6, dtype=np.uint8)).sum(axis=1).astype(np.uint8)
        return codes.view(kind).astype(np.float64)

    return decode


def _c64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4").astype(np.float64).reshape(-1, 2)


def _fmax(kind: Any) -> float:
    return float(ml_dtypes.finfo(kind).max)


ODTYPES: dict[str, DT] = {
    **{
        n: DT(b, False, None, None, False, False)
        for n, b in (
            ("BOOL", 8),
            ("U8", 8),
            ("I8", 8),
            ("U16", 16),
            ("I16", 16),
            ("U32", 32),
            ("I32", 32),
            ("U64", 64),
            ("I64", 64),
        )
    },
    "F64": DT(64, True, float(np.finfo(np.float64).max), _np("<f8")),
    "F32": DT(32, True, float(np.finfo(np.float32).max), _np("<f4")),
    "F16": DT(16, True, float(np.finfo(np.float16).max), _np("<f2")),
    "BF16": DT(16, True, _fmax(ml_dtypes.bfloat16), _np(ml_dtypes.bfloat16)),
    "C64": DT(64, True, float(np.finfo(np.float32).max), _c64),
    "F8_E5M2": DT(8, True, _fmax(ml_dtypes.float8_e5m2), _np(ml_dtypes.float8_e5m2)),
    "F8_E4M3": DT(
        8, True, _fmax(ml_dtypes.float8_e4m3fn), _np(ml_dtypes.float8_e4m3fn), True, False
    ),
    "F8_E8M0": DT(
        8, True, _fmax(ml_dtypes.float8_e8m0fnu), _np(ml_dtypes.float8_e8m0fnu), True, False
    ),
    "F8_E4M3FNUZ": DT(
        8, True, _fmax(ml_dtypes.float8_e4m3fnuz), _np(ml_dtypes.float8_e4m3fnuz), True, False
    ),
    "F8_E5M2FNUZ": DT(
        8, True, _fmax(ml_dtypes.float8_e5m2fnuz), _np(ml_dtypes.float8_e5m2fnuz), True, False
    ),
    "F6_E2M3": DT(
        6, True, _fmax(ml_dtypes.float6_e2m3fn), _f6(ml_dtypes.float6_e2m3fn), False, False
    ),
    "F6_E3M2": DT(
        6, True, _fmax(ml_dtypes.float6_e3m2fn), _f6(ml_dtypes.float6_e3m2fn), False, False
    ),
    "F4": DT(4, True, _fmax(ml_dtypes.float4_e2m1fn), _f4, False, False),
}


@dataclass(frozen=True)
class Tally:
    elements: int
    finite: int
    nan: int
    posinf: int
    neginf: int
    max_abs: float | None  # of finite floating elements


def recount(dtype: str, data: bytes) -> Tally:
    dt = ODTYPES[dtype]
    count = len(data) * 8 // dt.bits
    if dt.decode is None:
        return Tally(count, count, 0, 0, 0, None)
    with np.errstate(invalid="ignore"):
        values = dt.decode(data)
    if dtype == "C64":
        re_, im = values[:, 0], values[:, 1]
        nan = np.isnan(re_) | np.isnan(im)
        inf = ~nan & (np.isinf(re_) | np.isinf(im))
        sign = np.where(np.isinf(re_), re_, im) < 0
        finite = ~nan & ~inf
        mags = np.abs(values[finite])
        top = float(mags.max()) if mags.size else None
        neg = int((inf & sign).sum())
        return Tally(count, int(finite.sum()), int(nan.sum()), int(inf.sum()) - neg, neg, top)
    nan = np.isnan(values)
    pos = np.isposinf(values)
    neg = np.isneginf(values)
    finite = np.isfinite(values)
    top = float(np.abs(values[finite]).max()) if finite.any() else None
    return Tally(count, int(finite.sum()), int(nan.sum()), int(pos.sum()), int(neg.sum()), top)


class Reject(Exception):
    """The oracle's refusal, with a short reason for failure messages."""


def need(condition: bool, reason: str) -> None:
    if not condition:
        raise Reject(reason)


@dataclass
class Verdict:
    accepted: bool
    reason: str = ""
    decision: str | None = None
    earliest: str | None = None
    first_tensor: str | None = None
    counts: list[tuple[int, ...] | None] = field(default_factory=list)
    max_abs: list[float | None] = field(default_factory=list)


def _strict_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        need(key not in result, f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constant(text: str) -> Any:
    raise Reject(f"literal {text}")


def _safe_int(text: str) -> int | float:
    if text == "-0":
        return -0.0  # spec section 1 and 2: -0 is not an integer
    need(len(text) <= 17, "integer literal too long")
    value = int(text)
    need(abs(value) <= SAFE_MAX, "integer out of the safe range")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    need(math.isfinite(value), "number overflows")
    return value


def _lexical(value: Any, depth: int) -> None:
    if isinstance(value, dict | list):
        need(depth < 32, "nesting deeper than 32")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _text_ok(key)
            _lexical(item, depth + 1)
    elif isinstance(value, str):
        _text_ok(value)


def _no_lone_surrogate(value: Any) -> None:
    """Spec section 1: a header is parsed as strictly as the manifest."""
    if isinstance(value, dict):
        for key, item in value.items():
            need(not SURROGATE.search(key), "lone surrogate in a header")
            _no_lone_surrogate(item)
    elif isinstance(value, list):
        for item in value:
            _no_lone_surrogate(item)
    elif isinstance(value, str):
        need(not SURROGATE.search(value), "lone surrogate in a header")


def _text_ok(text: str) -> None:
    need(not CONTROL.search(text), "control character")
    need(not SURROGATE.search(text), "lone surrogate")


def _obj(value: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    need(type(value) is dict, "not an object")
    keys = set(value)
    need(set(required) <= keys, f"missing {set(required) - keys}")
    need(keys <= set(required) | set(optional), f"unknown {keys - set(required) - set(optional)}")
    return value  # type: ignore[no-any-return]


def _int(value: Any, minimum: int = 0) -> int:
    need(type(value) is int and value >= minimum, "not an integer >= minimum")
    return value  # type: ignore[no-any-return]


def _num(value: Any) -> float:
    need(type(value) in (int, float), "not a number")
    return float(value)


def _ident(value: Any) -> str:
    need(type(value) is str and IDENT.fullmatch(value) is not None, "not an identifier")
    return value  # type: ignore[no-any-return]


def _free_text(value: Any) -> str:
    need(type(value) is str and len(value) <= 1024 and value.isprintable(), "bad free text")
    return value  # type: ignore[no-any-return]


def _power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and float(x).hex().startswith("0x1.0000000000000p")


def _product(shape: list[int]) -> int:
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > U64_MAX:
            return U64_MAX + 1
    return n


def _scaler(s: dict[str, Any]) -> dict[str, Any]:
    mode = s["mode"]
    need(mode in ("none", "static", "dynamic"), "scaler mode")
    scale = _num(s["scale"])
    if mode != "dynamic":
        need(not any(k in s for k in DYNAMIC), "dynamic field in non-dynamic mode")
    if mode == "none":
        need(scale == 1, "mode none scale != 1")
        return s
    need(_power_of_two(scale) and 2.0**-24 <= scale <= 2.0**24, "unsafe scale")
    if mode == "dynamic":
        need(all(k in s for k in DYNAMIC), "dynamic field missing")
        growth, backoff, after = (
            _num(s[k]) for k in ("growth_factor", "backoff_factor", "scale_after")
        )
        need(type(s["found_inf"]) is bool and type(s["step_skipped"]) is bool, "bool fields")
        need(growth > 1 and 0 < backoff < 1, "factors")
        if s["found_inf"]:
            need(s["step_skipped"] is True and after == scale * backoff, "found_inf transition")
        else:
            need(
                s["step_skipped"] is False and after in (scale, scale * growth), "no-inf transition"
            )
    return s


def _binding(b: Any) -> dict[str, Any]:
    _obj(b, BINDING_ITEMS)
    for name in BINDING_ITEMS:
        item = b[name]
        need(type(item) is dict, f"binding {name} not an object")
        typed = ("id", *TYPED.get(name, ()))
        need(all(k in item for k in typed), f"binding {name} typed field missing")
        _ident(item["id"])
        skip = set(typed) | (set(DYNAMIC) if name == "scaler" else set())
        for key, value in item.items():
            if key not in skip:
                need(type(value) in (str, int, float), f"binding detail {key} type")
    topo = b["topology"]
    world = _int(topo["world_size"], 1)
    need(_int(topo["rank"]) < world, "rank")
    for key in ("param_dtype", "compute_dtype"):
        need(b["precision"][key] in ODTYPES and type(b["precision"][key]) is str, "precision dtype")
    need(b["objective"]["reduction"] in ("mean", "sum", "none"), "reduction")
    need(type(b["objective"]["reduction"]) is str, "reduction type")
    return _scaler(b["scaler"])


def _safe_relpath(path: str) -> bool:
    return (
        path != ""
        and not path.startswith("/")
        and "\\" not in path
        and "\x00" not in path
        and ".." not in path.split("/")
    )


def _entry(e: Any, complete: bool) -> dict[str, Any]:
    keys = ("name", "dtype", "shape", "probe") + (("file", "sha256") if complete else ())
    _obj(e, keys)
    need(type(e["name"]) is str and 1 <= len(e["name"]) <= 256 and e["name"].isprintable(), "name")
    need(type(e["dtype"]) is str and e["dtype"] in ODTYPES, "dtype")
    need(type(e["shape"]) is list and all(type(d) is int and d >= 0 for d in e["shape"]), "shape")
    _free_text(e["probe"])
    if complete:
        need(type(e["file"]) is str and _safe_relpath(e["file"]), "file path")
        need(type(e["sha256"]) is str and HEX64.fullmatch(e["sha256"]) is not None, "sha256 form")
    return e  # type: ignore[no-any-return]


def _stage(rec: Any, index: int) -> dict[str, Any]:
    optional = ("resolution", "gradients", "tensors", "counts", "finite_max_abs", "reason")
    _obj(rec, ("stage", "status", "owner", "telemetry_id", "tensor_set"), optional)
    need(rec["stage"] == STAGES[index], "stage order")
    need(rec["status"] in ("OBSERVED", "NOT_RUN"), "status")
    _ident(rec["owner"])
    _ident(rec["telemetry_id"])
    tset = _obj(rec["tensor_set"], ("id", "probe_source"))
    _ident(tset["id"])
    _free_text(tset["probe_source"])
    if rec["stage"] == "backward":
        need(rec.get("gradients") in ("unscaled", "scaled"), "backward gradients")
    else:
        need("gradients" not in rec, "gradients outside backward")
    if rec["status"] == "NOT_RUN":
        need(
            not any(k in rec for k in ("resolution", "tensors", "counts", "finite_max_abs")),
            "NOT_RUN fields",
        )
        need("reason" in rec, "NOT_RUN reason")
        _free_text(rec["reason"])
        return rec  # type: ignore[no-any-return]
    need(all(k in rec for k in ("resolution", "tensors", "counts")), "OBSERVED fields")
    if "reason" in rec:
        _free_text(rec["reason"])
    need(rec["resolution"] in ("complete", "summary"), "resolution")
    need(type(rec["tensors"]) is list and len(rec["tensors"]) > 0, "tensors")
    need(len(rec["tensors"]) <= 4096, "cap: stage tensors")
    for e in rec["tensors"]:
        _entry(e, rec["resolution"] == "complete")
    c = _obj(rec["counts"], ("elements", "finite", "nan", "posinf", "neginf"))
    values = [_int(c[k]) for k in ("elements", "finite", "nan", "posinf", "neginf")]
    need(sum(values[1:]) == values[0], "counts do not reconcile")
    need(values[0] == sum(_product(e["shape"]) for e in rec["tensors"]), "elements != shapes")
    if "finite_max_abs" in rec and rec["finite_max_abs"] is not None:
        need(type(rec["finite_max_abs"]) in (int, float), "finite_max_abs type")
    return rec  # type: ignore[no-any-return]


def _nonfinite(rec: dict[str, Any]) -> int:
    c = rec["counts"]
    return int(c["nan"] + c["posinf"] + c["neginf"])


def _summary_possible(rec: dict[str, Any]) -> None:
    """Declared counts and finite_max_abs of a summary: only what some data could give."""
    floating = nan_able = inf_able = always = other = 0
    for e in rec["tensors"]:
        dt, n = ODTYPES[e["dtype"]], _product(e["shape"])
        if dt.floating:
            floating += n
            always += 0 if dt.can_nan else n
        else:
            other += n
        nan_able += n if dt.can_nan else 0
        inf_able += n if dt.can_inf else 0
    c = rec["counts"]
    need(c["nan"] + c["posinf"] + c["neginf"] <= nan_able, "summary: impossible non-finite count")
    need(c["posinf"] + c["neginf"] <= inf_able, "summary: infinities in dtypes without one")
    _max_abs_rule(rec, max(always, c["finite"] - other), min(c["finite"], floating))


def _max_abs_rule(rec: dict[str, Any], least: int, most: int) -> None:
    """finite_max_abs against the number of finite floating elements, known within
    [least, most]."""
    if "finite_max_abs" not in rec:
        return
    value = rec["finite_max_abs"]
    if value is None:
        need(least == 0, "finite_max_abs null with finite floating elements")
        return
    need(most >= 1, "finite_max_abs without a finite floating element")
    need(value >= 0, "finite_max_abs negative")
    ceiling = max(ODTYPES[e["dtype"]].max_finite or 0.0 for e in rec["tensors"])
    need(value <= ceiling, "finite_max_abs excessive")


def _read_header(raw: bytes) -> tuple[dict[str, tuple[str, list[int], int, int]], int]:
    """name -> (dtype, shape, begin, end) with absolute offsets; and the data start."""
    need(len(raw) >= 8, "file shorter than 8 bytes")
    n = int.from_bytes(raw[:8], "little")
    need(0 < n <= 100_000_000 and 8 + n <= len(raw), "header length")
    try:
        text = raw[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError:
        raise Reject("header not UTF-8") from None
    need(text.startswith("{") and text.rstrip(" ").endswith("}"), "header framing")
    try:
        header = json.loads(
            text.rstrip(" "),
            object_pairs_hook=_strict_pairs,
            parse_constant=_no_constant,
            parse_int=lambda literal: -0.0 if literal == "-0" else int(literal),
        )
    except (ValueError, RecursionError) as err:
        raise Reject(f"header JSON: {type(err).__name__}") from None
    need(type(header) is dict, "header not an object")
    _no_lone_surrogate(header)
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    for name, value in header.items():
        if name == "__metadata__":
            need(type(value) is dict and all(type(v) is str for v in value.values()), "metadata")
            continue
        _obj(value, ("dtype", "shape", "data_offsets"))
        dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
        need(type(dtype) is str and dtype in ODTYPES, "header dtype")
        need(
            type(shape) is list and all(type(d) is int and 0 <= d <= U64_MAX for d in shape),
            "hdr shape",
        )
        need(
            type(offsets) is list
            and len(offsets) == 2
            and all(type(o) is int and 0 <= o <= U64_MAX for o in offsets)
            and offsets[0] <= offsets[1],
            "header offsets",
        )
        count = _product(shape)
        need(count <= U64_MAX and count * ODTYPES[dtype].bits % 8 == 0, "element count / sub-byte")
        need(offsets[1] - offsets[0] == count * ODTYPES[dtype].bits // 8, "byte length")
        entries[name] = (dtype, list(shape), 8 + n + offsets[0], 8 + n + offsets[1])
    cursor = 8 + n
    for _, _, begin, end in sorted(entries.values(), key=lambda e: (e[2], e[3])):
        need(begin == cursor, "ranges do not tile")
        cursor = end
    need(cursor == len(raw), "trailing or missing data")
    return entries, 8 + n


def oracle(bundle: Path) -> Verdict:
    try:
        return _oracle(bundle)
    except Reject as err:
        return Verdict(False, str(err))


def _resolve(root: str, relpath: str) -> os.stat_result:
    # POSIX: a trailing slash names a directory (the project's documented choice too).
    need(not relpath.endswith("/"), "a path ending in / names a directory")
    try:
        target = os.path.realpath(os.path.join(root, relpath), strict=True)
    except OSError:
        raise Reject(f"cannot resolve {relpath!r}") from None
    need(target != root and os.path.commonpath([root, target]) == root, "outside the bundle")
    info = os.stat(target)
    need(os.path.isfile(target) and not os.path.islink(target), "not a regular file")
    return info


def _oracle(bundle: Path) -> Verdict:
    need(bundle.is_dir(), "bundle not a directory")
    root = os.path.realpath(bundle)
    manifest_info = _resolve(root, "manifest.json")
    need(manifest_info.st_size <= 16 * 1024 * 1024, "manifest too large")
    raw = (bundle / "manifest.json").read_bytes()
    need(not raw.startswith(b"\xef\xbb\xbf"), "BOM")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Reject("manifest not UTF-8") from None
    try:
        m = json.loads(
            text,
            object_pairs_hook=_strict_pairs,
            parse_constant=_no_constant,
            parse_int=_safe_int,
            parse_float=_finite_float,
        )
    except (ValueError, RecursionError) as err:
        raise Reject(f"manifest JSON: {type(err).__name__}: {err}") from None
    _lexical(m, 0)
    top = (
        "format", "contract_version", "evidence_id", "evidence_content_id", "run",
        "incident_owner", "binding", "last_known_good", "stages",
    )  # fmt: skip
    _obj(m, top)
    need(m["format"] == "nanrunbook-bundle/1", "format")
    need(m["contract_version"] == "training-incident-v1", "contract_version")
    _ident(m["evidence_id"])
    _ident(m["incident_owner"])
    cid = m["evidence_content_id"]
    need(
        type(cid) is str and cid.startswith(CID) and HEX64.fullmatch(cid[len(CID) :]) is not None,
        "cid form",
    )
    body = {k: v for k, v in m.items() if k != "evidence_content_id"}
    need(cid == CID + hashlib.sha256(rfc8785.dumps(body)).hexdigest(), "content id mismatch")
    run = _obj(m["run"], ("run_id", "step"))
    _ident(run["run_id"])
    step = _int(run["step"])
    lkg = _obj(m["last_known_good"], ("checkpoint_id", "step", "verified_together"))
    _ident(lkg["checkpoint_id"])
    need(_int(lkg["step"]) < step, "last known-good not before the run step")
    parts = lkg["verified_together"]
    need(
        type(parts) is list and len(parts) == 5 and all(type(p) is str for p in parts), "lkg parts"
    )
    need(set(parts) == RECOVERY, "lkg parts set")
    scaler = _binding(m["binding"])

    stages = m["stages"]
    need(type(stages) is list and len(stages) == 5, "five stages")
    records = [_stage(rec, i) for i, rec in enumerate(stages)]
    need(records[0]["status"] == "OBSERVED", "input not OBSERVED")
    seen_nonfinite = seen_not_run = False
    for rec in records:
        if rec["status"] == "NOT_RUN":
            need(seen_nonfinite or rec["stage"] == "input", "NOT_RUN without an earlier non-finite")
            seen_not_run = True
        else:
            need(not seen_not_run, "OBSERVED after NOT_RUN")
            seen_nonfinite = seen_nonfinite or _nonfinite(rec) > 0
    for key in ("telemetry_id",):
        values = [r[key] for r in records]
        need(len(set(values)) == 5, "duplicate telemetry_id")
    need(len({r["tensor_set"]["id"] for r in records}) == 5, "duplicate tensor_set id")
    names = [e["name"] for r in records for e in r.get("tensors", [])]
    need(len(set(names)) == len(names), "duplicate tensor name")
    total = 0
    for rec in records:
        if rec["status"] == "OBSERVED":
            need(rec["counts"]["elements"] <= 2**31, "cap: stage elements")
            total += rec["counts"]["elements"]
    need(total <= 2**33, "cap: bundle elements")
    backward = records[3]
    if backward.get("gradients") == "scaled":
        need(scaler["mode"] != "none", "scaled gradients without a scaler")
    if scaler["mode"] == "dynamic" and backward["status"] == "OBSERVED":
        need(scaler["found_inf"] == (_nonfinite(backward) > 0), "found_inf mismatch")

    # --- files: resolve, group by identity, parse headers, bind, hash, recount
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    paths: dict[tuple[int, int], str] = {}
    for rec in records:
        if rec["status"] == "OBSERVED" and rec["resolution"] == "complete":
            for e in rec["tensors"]:
                info = _resolve(root, e["file"])
                key = (info.st_dev, info.st_ino)
                groups.setdefault(key, []).append(e)
                paths[key] = e["file"]
    tallies: dict[str, Tally] = {}
    for key, bound in groups.items():
        data = (Path(root) / paths[key]).read_bytes()
        header, _ = _read_header(data)
        need(set(header) == {e["name"] for e in bound}, "unbound tensor or entry not in file")
        for e in bound:
            dtype, shape, begin, end = header[e["name"]]
            need(dtype == e["dtype"] and shape == e["shape"], "entry differs from header")
            need(hashlib.sha256(data[begin:end]).hexdigest() == e["sha256"], "digest mismatch")
            tallies[e["name"]] = recount(dtype, data[begin:end])

    verdict = Verdict(True)
    for rec in records:
        if rec["status"] == "NOT_RUN":
            verdict.counts.append(None)
            verdict.max_abs.append(None)
            continue
        c = rec["counts"]
        declared = (c["elements"], c["finite"], c["nan"], c["posinf"], c["neginf"])
        if rec["resolution"] == "summary":
            _summary_possible(rec)
            verdict.counts.append(declared)
            verdict.max_abs.append(
                None if rec.get("finite_max_abs") is None else float(rec["finite_max_abs"])
            )
            continue
        parts_ = [tallies[e["name"]] for e in rec["tensors"]]
        counted = tuple(
            sum(getattr(t, f) for t in parts_)
            for f in ("elements", "finite", "nan", "posinf", "neginf")
        )
        need(counted == declared, "declared counts differ from the recount")
        maxima = [
            t.max_abs
            for t, e in zip(parts_, rec["tensors"], strict=True)
            if t.max_abs is not None and ODTYPES[e["dtype"]].floating
        ]
        top = max(maxima) if maxima else None
        if "finite_max_abs" in rec:
            stated = rec["finite_max_abs"]
            need((stated is None) == (top is None), "finite_max_abs null differs from the recount")
            need(stated is None or float(stated) == top, "finite_max_abs differs from the recount")
        verdict.counts.append(counted)
        verdict.max_abs.append(top)
    for rec, counts in zip(records, verdict.counts, strict=True):
        if counts is not None and sum(counts[2:]) > 0:
            verdict.earliest = rec["stage"]
            if rec["resolution"] == "complete":
                verdict.first_tensor = next(
                    e["name"] for e in rec["tensors"] if _nonfinite_tally(tallies[e["name"]])
                )
            break
    verdict.decision = "HOLD" if verdict.earliest else "CONTINUE_BOUNDED_DIAGNOSTICS"
    return verdict


def _nonfinite_tally(t: Tally) -> int:
    return t.nan + t.posinf + t.neginf


# ======================================================================== mutations
#
# A mutant is a fixture, a short list of operations, and a reseal mode. Each
# operation is a name and three selector integers, taken modulo whatever it
# chooses from, so every draw applies and shrinks well.

Op = tuple[str, int, int, int]


def _walk_tree(value: Any, out: list[tuple[Any, Any]]) -> None:
    """(container, key) of every value below ``value``, depth first."""
    if type(value) is dict:
        for key in list(value):
            out.append((value, key))
            _walk_tree(value[key], out)
    elif type(value) is list:
        for index in range(len(value)):
            out.append((value, index))
            _walk_tree(value[index], out)


def _slots(tree: Any, kind: Callable[[Any], bool] = lambda v: True) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    _walk_tree(tree, out)
    return [(c, k) for c, k in out if kind(c[k])]


def _pick(items: list[Any], selector: int) -> Any:
    return items[selector % len(items)] if items else None


DTYPE_NAMES = sorted(ODTYPES)
VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 3.0, 0.5, -0.0, 1e308, 2**31, 2**33, 2**53 - 1,
    Raw("9007199254740992"), Raw("-9007199254740992"), Raw("NaN"), Raw("Infinity"),
    Raw("-Infinity"), Raw("1e999"), Raw("1.0"), Raw("-0"), Raw("1E2"), Raw("[" * 40 + "]" * 40),
    "", "x", "OBSERVED", "NOT_RUN", "complete", "summary", "scaled", "unscaled",
    "dynamic", "static", "none", "input", "backward", "F32", "BF16", "I64", "F8_E4M3",
    "C64", "F4", "F6_E2M3", "NOPE", "[red]x[/red]", "a\u202eb", "a\x1bb", "\x9b",
    "\ud800", "é", "x" * 257, "y" * 1025, "$(rm -rf /)", [], [1], [8, 8], {}, {"id": "x"},
]  # fmt: skip
KEYS = [
    "id", "gradients", "reason", "file", "sha256", "finite_max_abs", "resolution", "counts",
    "tensors", "found_inf", "scale", "extra", "__metadata__", "dtype", "shape", "data_offsets",
    "evidence_content_id", "\x07", "[red]k",
]  # fmt: skip
STRINGS = [
    "tensors.safetensors", "./tensors.safetensors", "alias.safetensors", "tensors.safetensors/",
    ".//tensors.safetensors", "missing.safetensors", "../outside.safetensors", "/etc/passwd",
    "a\\b", "a\x00b", ".", "", "manifest.json", "fifo", "dir", "loop-a", "zero", "outside",
    "dir/../tensors.safetensors", "x" * 256, "x" * 257, "-dash", "has space", "ok.id:@/+=-",
    "[bold]b[/bold]", "`id`", "a\u202eb", "a\u200bb", "a\u00a0b", "\U0001f600",
]  # fmt: skip
NUMBERS: list[Callable[[float], Any]] = [
    lambda x: x + 1, lambda x: x - 1, lambda x: x * 2, lambda x: x / 2, lambda x: -x,
    lambda x: 0, lambda x: 0.0, lambda x: 1, lambda x: float(x),
    lambda x: math.nextafter(float(x), math.inf), lambda x: math.nextafter(float(x), -math.inf),
    lambda x: 2.0**-24, lambda x: 2.0**24, lambda x: 2.0**25, lambda x: 2.0**-25, lambda x: 3.0,
    lambda x: 65504.0, lambda x: 65536.0, lambda x: 448.0, lambda x: 3.4028234663852886e38,
    lambda x: 3.4e38, lambda x: 1e300, lambda x: 2**31 + 1, lambda x: 2**33 + 1,
    lambda x: 4097, lambda x: 2**53 - 1,
]  # fmt: skip


def _value(selector: int) -> Any:
    return copy.deepcopy(VALUES[selector % len(VALUES)])


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_num(v: Any) -> bool:
    return type(v) in (int, float)


def _is_dict(v: Any) -> bool:
    return type(v) is dict


def _is_list(v: Any) -> bool:
    return type(v) is list


def tree_op(tree: Any, name: str, a: int, b: int, c: int, strings: list[str]) -> None:
    """One structural mutation of a JSON tree (a manifest or a header)."""
    if name == "delete":
        slot = _pick(_slots(tree), a)
        if slot:
            del slot[0][slot[1]]
    elif name == "retype":
        slot = _pick(_slots(tree), a)
        if slot:
            slot[0][slot[1]] = _value(b)
    elif name == "add_key":
        slot = _pick(_slots(tree, _is_dict), a)
        target = slot[0][slot[1]] if slot else tree
        if isinstance(target, dict):
            target[KEYS[b % len(KEYS)]] = _value(c)
    elif name == "dup_key":
        slot = _pick(_slots(tree, lambda v: _is_dict(v) and bool(v)), a)
        if slot:
            obj = slot[0][slot[1]]
            pairs = Pairs(obj.items())
            key, value = pairs[b % len(pairs)]
            pairs.insert(c % (len(pairs) + 1), (key, value if c % 2 else _value(c)))
            slot[0][slot[1]] = pairs
    elif name == "dup_item":
        slot = _pick(_slots(tree, lambda v: _is_list(v) and bool(v)), a)
        if slot:
            items = slot[0][slot[1]]
            items.insert(c % (len(items) + 1), copy.deepcopy(items[b % len(items)]))
    elif name == "swap":
        slot = _pick(_slots(tree, lambda v: _is_list(v) and len(v) > 1), a)
        if slot:
            items = slot[0][slot[1]]
            i, j = b % len(items), c % len(items)
            items[i], items[j] = items[j], items[i]
    elif name == "int":
        slot = _pick(_slots(tree, _is_int), a)
        if slot:
            value = slot[0][slot[1]]
            delta = [1, -1, 2, -2, 8, -8, 64, 2**31, 2**32, -value, value, 2**64 - value][b % 12]
            slot[0][slot[1]] = value + delta
    elif name == "num":
        slot = _pick(_slots(tree, _is_num), a)
        if slot:
            slot[0][slot[1]] = NUMBERS[b % len(NUMBERS)](slot[0][slot[1]])
    elif name == "str":
        slot = _pick(_slots(tree, lambda v: type(v) is str), a)
        if slot:
            pool = strings + STRINGS + [v for v in VALUES if isinstance(v, str)] + DTYPE_NAMES
            slot[0][slot[1]] = pool[b % len(pool)]
    elif name == "bool":
        slot = _pick(_slots(tree, lambda v: type(v) is bool), a)
        if slot:
            slot[0][slot[1]] = not slot[0][slot[1]]


TREE_OPS = (
    "delete",
    "retype",
    "add_key",
    "dup_key",
    "dup_item",
    "swap",
    "int",
    "num",
    "str",
    "bool",
)


def _strings(tree: Any) -> list[str]:
    return sorted({c[k] for c, k in _slots(tree, lambda v: type(v) is str)})


def _stage_records(model: BundleModel) -> list[dict[str, Any]]:
    stages = model.manifest.get("stages") if isinstance(model.manifest, dict) else None
    return [s for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []


def _remove_file_tensors(model: BundleModel, names: set[str]) -> None:
    for tf in model.files.values():
        tf.tensors = [t for t in tf.tensors if t.name not in names]


def _entry_names(stage: dict[str, Any]) -> set[str]:
    tensors = stage.get("tensors")
    if not isinstance(tensors, list):
        return set()
    return {e["name"] for e in tensors if isinstance(e, dict) and isinstance(e.get("name"), str)}


def _tensor_refs(model: BundleModel) -> list[tuple[dict[str, Any], Tensor]]:
    refs = []
    for _, _, entry in model.entries():
        name = entry.get("name")
        found = model.find_tensor(name) if isinstance(name, str) else None
        if found is not None:
            refs.append((entry, found[1]))
    return refs


def _shapes_for(count: int, variant: int) -> list[int]:
    divisors = [d for d in range(2, min(count, 64) + 1) if count % d == 0]
    options: list[list[int]] = [[count], [1, count], [count, 1, 1]]
    if count == 1:
        options.append([])
    if divisors:
        d = divisors[variant % len(divisors)]
        options.append([d, count // d])
    return options[variant % len(options)]


# Sign-cleared bit patterns of +infinity and of the largest finite value, per dtype
# with an infinity; written little-endian into one element.
INF_BITS = {"F64": (0x7FF0000000000000, 64), "F32": (0x7F800000, 32), "F16": (0x7C00, 16),
            "BF16": (0x7F80, 16), "F8_E5M2": (0x7C, 8), "C64": (0x7F800000, 32)}  # fmt: skip


def _set_element(tensor: Tensor, index: int, pattern: int) -> None:
    dt = ODTYPES.get(tensor.dtype)
    width = max(1, (dt.bits if dt else 8) // 8)
    if len(tensor.data) < width:
        return
    count = len(tensor.data) // width
    start = (index % count) * width
    data = bytearray(tensor.data)
    inf, bits = INF_BITS.get(tensor.dtype, ((1 << (width * 8 - 1)) - 1, width * 8))
    sign = 1 << (bits - 1)
    choice = pattern % 9
    if choice == 0:  # +inf (all-ones exponent for dtypes without infinity: NaN)
        value = inf
    elif choice == 1:  # -inf
        value = inf | sign
    elif choice == 2:  # NaN
        value = inf | 1
    elif choice == 3:  # largest finite
        value = inf - 1
    elif choice == 4:  # negative zero
        value = sign
    elif choice == 5:  # all ones
        value = (1 << bits) - 1
    elif choice == 6:  # zero
        value = 0
    elif choice == 7:  # flip one bit
        value = int.from_bytes(data[start : start + bits // 8], "little") ^ (1 << (index % bits))
    else:  # the FNUZ NaN / e4m3 NaN byte
        value = 0x80 if bits == 8 else 0x7F << (bits - 8)
    data[start : start + bits // 8] = (value & ((1 << bits) - 1)).to_bytes(bits // 8, "little")
    tensor.data = bytes(data)


def _compose(
    first: Callable[[Any], Any] | None, then: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    return then if first is None else (lambda x: then(first(x)))


HEADER_LENGTHS: list[Callable[[int, int], int]] = [
    lambda n, size: 0, lambda n, size: 1, lambda n, size: 7, lambda n, size: n - 1,
    lambda n, size: n + 1, lambda n, size: size - 8, lambda n, size: size - 7,
    lambda n, size: size, lambda n, size: 2**64 - 1, lambda n, size: 100_000_001,
    lambda n, size: 100_000_000, lambda n, size: 2**63, lambda n, size: n + 8, lambda n, size: n - 8,
]  # fmt: skip


def apply_op(model: BundleModel, op: Op) -> None:
    name, a, b, c = op
    if name in TREE_OPS:
        tree_op(model.manifest, name, a, b, c, _strings(model.manifest))
    elif name in TARGETED_OPS:
        targeted_op(model, name, a, b, c)
    elif name.startswith("hdr_") and name != "hdr_len":
        tf = _pick(list(model.files.values()), c)
        inner = name[4:]

        def edit(header: Any, inner: str = inner) -> Any:
            tree_op(header, inner, a, b, c, _strings(header) + list(header))
            return header

        tf.header_edit = _compose(tf.header_edit, edit)
    elif name == "hdr_len":
        tf = _pick(list(model.files.values()), c)

        def length(raw: bytes) -> bytes:
            n = int.from_bytes(raw[:8], "little")
            value = HEADER_LENGTHS[b % len(HEADER_LENGTHS)](n, len(raw)) % 2**64
            return struct.pack("<Q", value) + raw[8:]

        tf.raw_edit = _compose(tf.raw_edit, length)
    elif name == "file_bytes":
        tf = _pick(list(model.files.values()), c)

        def bytes_edit(raw: bytes) -> bytes:
            kind = b % 4
            if kind == 0:
                return raw[: max(0, len(raw) - 1 - a % 64)]
            if kind == 1:
                return raw + bytes([a % 256]) * (1 + c % 16)
            if not raw:
                return raw
            pos = a % len(raw)
            flipped = raw[pos] ^ (1 << (c % 8)) if kind == 2 else c % 256
            return raw[:pos] + bytes([flipped]) + raw[pos + 1 :]

        tf.raw_edit = _compose(tf.raw_edit, bytes_edit)
    elif name == "manifest_bytes":

        def manifest_edit(raw: bytes) -> bytes:
            kind = b % 6
            if kind == 0:
                return b"\xef\xbb\xbf" + raw
            if kind == 1:
                return raw[: a % max(1, len(raw))]
            if kind == 2:
                return raw + [b" \n\t", b"x", b"{}", b"\x00", b"\xff"][c % 5]
            if kind == 3:
                return b"\n  " + raw  # leading whitespace: still one JSON value
            if not raw:
                return raw
            pos = a % len(raw)
            new = raw[pos] ^ (1 << (c % 8)) if kind == 4 else c % 256
            return raw[:pos] + bytes([new]) + raw[pos + 1 :]

        model.manifest_raw_edit = _compose(model.manifest_raw_edit, manifest_edit)
    elif name == "compact":
        model.indent = False
    elif name == "not_run":
        stages = _stage_records(model)
        stage = _pick(stages, a)
        if stage:
            _remove_file_tensors(model, _entry_names(stage))
            for key in ("resolution", "tensors", "counts", "finite_max_abs"):
                stage.pop(key, None)
            stage["status"] = "NOT_RUN"
            stage["reason"] = "not reached: an earlier stage was non-finite"
            if b % 2:  # and every later stage too, as the contract requires
                for later in stages[stages.index(stage) + 1 :]:
                    _remove_file_tensors(model, _entry_names(later))
                    for key in ("resolution", "tensors", "counts", "finite_max_abs"):
                        later.pop(key, None)
                    later["status"] = "NOT_RUN"
                    later["reason"] = "not reached"
    elif name == "summary":
        stage = _pick(_stage_records(model), a)
        if stage and isinstance(stage.get("tensors"), list):
            stage["resolution"] = "summary"
            for entry in stage["tensors"]:
                if isinstance(entry, dict):
                    entry.pop("file", None)
                    entry.pop("sha256", None)
            if b % 4:  # usually the data leaves the file as well
                _remove_file_tensors(model, _entry_names(stage))
    elif name == "drop_tensor":
        refs = _tensor_refs(model)
        if refs:
            entry, tensor = refs[a % len(refs)]
            for stage in _stage_records(model):
                if isinstance(stage.get("tensors"), list) and entry in stage["tensors"]:
                    stage["tensors"].remove(entry)
            _remove_file_tensors(model, {tensor.name})
    elif name == "retype_tensor":
        refs = _tensor_refs(model)
        if refs:
            entry, tensor = refs[a % len(refs)]
            nbits = len(tensor.data) * 8
            fits = [
                d
                for d in DTYPE_NAMES
                if nbits % ODTYPES[d].bits == 0 and (ODTYPES[d].bits != 6 or (nbits // 6) % 4 == 0)
            ]
            dtype = fits[b % len(fits)]
            shape = _shapes_for(nbits // ODTYPES[dtype].bits, c)
            tensor.dtype, tensor.shape = dtype, shape
            entry["dtype"], entry["shape"] = dtype, list(shape)
    elif name == "rename_tensor":
        refs = _tensor_refs(model)
        if refs:
            entry, tensor = refs[a % len(refs)]
            others = sorted({t.name for tf in model.files.values() for t in tf.tensors})
            pool = [
                *others,
                "[red]n[/red]",
                "$(x)",
                "a\u202eb",
                "x" * 256,
                "x" * 257,
                "",
                "__metadata__",
                "é/ü",
            ]
            entry["name"] = tensor.name = pool[b % len(pool)]
    elif name == "data":
        refs = _tensor_refs(model)
        if refs:
            _set_element(refs[a % len(refs)][1], c, b)
    elif name == "file_order":
        tf = _pick(list(model.files.values()), a)
        tf.tensors.reverse() if b % 2 else tf.tensors.sort(key=lambda t: len(t.data))
    elif name == "metadata":
        tf = _pick(list(model.files.values()), a)
        tf.metadata = [{"k": "v"}, {}, {"k": 1}, {"k": None}, {"k": ["v"]}, {"format": "pt"}][b % 6]  # type: ignore[assignment]
    elif name == "pad":
        tf = _pick(list(model.files.values()), a)
        tf.pad = [b"", b"\n", b"\x00", b"\t", b" "][b % 5]
    elif name == "split_file":
        refs = _tensor_refs(model)
        if refs:
            entry, tensor = refs[a % len(refs)]
            target = ["second.safetensors", "sub/third.safetensors"][b % 2]
            _remove_file_tensors(model, {tensor.name})
            model.files.setdefault(target, TensorFile([])).tensors.append(tensor)
            entry["file"] = target
    elif name == "alias_file":
        refs = _tensor_refs(model)
        if refs:
            entry, _ = refs[a % len(refs)]
            entry["file"] = [
                "./tensors.safetensors",
                "alias.safetensors",
                ".//tensors.safetensors",
            ][b % 3]


SCALER_VALUES: list[Any] = [
    0, 1, 1.0, 0.5, 2.0, 3.0, 2.0**-24, 2.0**-25, 2.0**24, 2.0**25, 65536, 32768.0, 1024,
    -1024, 0.25, 1e-300, True, False, None, "dynamic", "static", "none", 2**53 - 1,
]  # fmt: skip
FMA_VALUES: list[Any] = [
    None, 0, 0.0, -0.0, -1.0, 1.0, 2.0, 4.0, 448.0, 65504.0, 65505.0, 3.4028234663852886e38,
    3.4028235e38, 3.3895313892515355e38, 1.7976931348623157e308, 57344.0, 6.0, 2.0**127, True,
]  # fmt: skip
TARGETED_OPS = (
    "entry_file",
    "scaler",
    "scaler_mode",
    "ids",
    "fma",
    "counts",
    "lkg",
    "stage_swap",
    "gradients",
)


def targeted_op(model: BundleModel, name: str, a: int, b: int, c: int) -> None:
    """Mutations aimed at one rule, so they are not left to chance."""
    m = model.manifest
    stages = _stage_records(model)
    if name == "entry_file":
        entries = [e for _, _, e in model.entries()]
        if entries:
            entries[a % len(entries)]["file"] = STRINGS[b % 23]
    elif name in ("scaler", "scaler_mode"):
        scaler = m.get("binding", {}).get("scaler") if isinstance(m.get("binding"), dict) else None
        if not isinstance(scaler, dict):
            return
        if name == "scaler":
            key = ("mode", "scale", *DYNAMIC)[a % 7]
            scaler[key] = SCALER_VALUES[b % len(SCALER_VALUES)]
            return
        mode = ("none", "static", "dynamic")[a % 3]
        scaler["mode"] = mode
        scale = [1, 1024.0, 65536, 0.5, 2.0**-24][b % 5]
        scaler["scale"] = scale
        for key in DYNAMIC:
            scaler.pop(key, None)
        if mode == "dynamic":
            found = bool(c % 2)
            scaler.update(growth_factor=2.0, backoff_factor=0.5, found_inf=found, step_skipped=found,
                          scale_after=scale * 0.5 if found else scale * [1, 2][c // 2 % 2])  # fmt: skip
    elif name == "ids" and stages:
        src, dst = stages[a % len(stages)], stages[b % len(stages)]
        which = c % 3
        if which == 0 and "telemetry_id" in src:
            dst["telemetry_id"] = src["telemetry_id"]
        elif (
            which == 1
            and isinstance(src.get("tensor_set"), dict)
            and isinstance(dst.get("tensor_set"), dict)
        ):
            dst["tensor_set"]["id"] = src["tensor_set"].get("id")
        else:
            entries = [e for _, _, e in model.entries()]
            if len(entries) > 1:
                entries[a % len(entries)]["name"] = entries[b % len(entries)].get("name")
    elif name == "fma" and stages:
        stage = stages[a % len(stages)]
        if b % 7 == 0:
            stage.pop("finite_max_abs", None)
        else:
            stage["finite_max_abs"] = FMA_VALUES[b % len(FMA_VALUES)]
    elif name == "counts" and stages:
        counts = stages[a % len(stages)].get("counts")
        if isinstance(counts, dict):
            keys = ["finite", "nan", "posinf", "neginf"]
            src, dst = keys[b % 4], keys[c % 4]
            if _is_int(counts.get(src)) and _is_int(counts.get(dst)) and counts[src] > 0:
                moved = 1 + c % max(1, counts[src])
                moved = min(moved, counts[src])
                counts[src] -= moved
                counts[dst] += moved
    elif name == "lkg":
        lkg = m.get("last_known_good")
        run = m.get("run")
        if isinstance(lkg, dict) and isinstance(run, dict) and _is_int(run.get("step")):
            if a % 2:
                lkg["step"] = run["step"] + [-1, 0, 1, -run["step"]][b % 4]
            else:
                parts = ["model", "optimizer", "scheduler", "scaler", "data_position"]
                variants = [
                    parts[::-1],
                    parts[:4],
                    [*parts, "model"],
                    [*parts[:4], "checkpoint"],
                    [*parts[:4], 5],
                ]
                lkg["verified_together"] = variants[b % len(variants)]
    elif name == "stage_swap" and len(stages) > 1:
        records = m["stages"]
        i, j = a % len(records), b % len(records)
        records[i], records[j] = records[j], records[i]
    elif name == "gradients" and stages:
        stage = stages[a % len(stages)]
        stage["gradients"] = ["scaled", "unscaled"][b % 2]
        if c % 3 == 0:
            del stage["gradients"]


MODEL_OPS = (
    "hdr_delete", "hdr_retype", "hdr_add_key", "hdr_dup_key", "hdr_int", "hdr_num", "hdr_str",
    "hdr_swap", "hdr_dup_item", "hdr_len", "file_bytes", "manifest_bytes", "compact", "not_run",
    "summary", "drop_tensor", "retype_tensor", "rename_tensor", "data", "data", "data",
    "file_order", "metadata", "pad", "split_file", "alias_file",
)  # fmt: skip
ALL_OPS = TREE_OPS + MODEL_OPS + TARGETED_OPS
RESEALS = ("none", "content_id", "digests", "deep", "deep", "deep")


def deep_reseal(model: BundleModel) -> None:
    """Counts, finite_max_abs and the dynamic scaler's verdict from the data, so mutants
    reach past the recount rules (the data stays as mutated)."""
    backward_nonfinite: bool | None = None
    for stage in _stage_records(model):
        tensors = stage.get("tensors")
        if stage.get("resolution") != "complete" or not isinstance(tensors, list) or not tensors:
            continue
        tallies, floating = [], []
        for entry in tensors:
            found = (
                model.find_tensor(entry.get("name"))
                if isinstance(entry, dict) and isinstance(entry.get("name"), str)
                else None
            )
            if found is None or found[1].dtype not in ODTYPES:
                break
            tensor = found[1]
            dt = ODTYPES[tensor.dtype]
            if len(tensor.data) * 8 % dt.bits:
                break
            t = recount(tensor.dtype, tensor.data)
            tallies.append(t)
            if dt.floating and t.max_abs is not None:
                floating.append(t.max_abs)
        else:
            stage["counts"] = {
                key: sum(getattr(t, key) for t in tallies)
                for key in ("elements", "finite", "nan", "posinf", "neginf")
            }
            stage["finite_max_abs"] = max(floating) if floating else None
            if stage.get("stage") == "backward" and stage.get("status") == "OBSERVED":
                backward_nonfinite = any(_nonfinite_tally(t) for t in tallies)
    binding = model.manifest.get("binding") if isinstance(model.manifest, dict) else None
    scaler = binding.get("scaler") if isinstance(binding, dict) else None
    if (
        backward_nonfinite is not None
        and isinstance(scaler, dict)
        and scaler.get("mode") == "dynamic"
    ):
        scale, backoff = scaler.get("scale"), scaler.get("backoff_factor")
        if _is_num(scale) and _is_num(backoff):
            scaler["found_inf"] = scaler["step_skipped"] = backward_nonfinite
            scaler["scale_after"] = scale * backoff if backward_nonfinite else scale


def build_mutant(fixture: str, ops: list[Op], reseal: str) -> BundleModel:
    model = BundleModel.from_fixture(fixture)
    for op in ops:
        apply_op(model, op)
    if reseal == "deep":
        deep_reseal(model)
    if reseal in ("digests", "deep"):
        model.reseal_digests()
    if reseal != "none":
        model.reseal_content_id()
    return model


op_strategy = st.tuples(
    st.sampled_from(ALL_OPS),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
)
mutant_strategy = st.tuples(
    st.sampled_from(
        (*VALID_FIXTURES, "rejected-caps", "rejected-counts-recount", "rejected-transitions")
    ),
    st.lists(op_strategy, min_size=1, max_size=4),
    st.sampled_from(RESEALS),
)


# ========================================================================== checks

KNOWN_CODES: set[str] | None = None


def known_codes() -> set[str]:
    global KNOWN_CODES
    if KNOWN_CODES is None:
        from nanrunbook.codes import CODES  # the catalogue, not a rule

        KNOWN_CODES = set(CODES)
    return KNOWN_CODES


UNSAFE_TEXT = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def assert_text_safe(text: str) -> None:
    """Only newlines and printable characters: no control, no bidi override."""
    bad = UNSAFE_TEXT.search(text)
    assert bad is None, (
        f"unsafe character {bad.group()!r} in {text[max(0, bad.start() - 60) : bad.end() + 20]!r}"
    )
    for ch in set(text) - set("\n"):
        assert unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp"), repr(ch)


def render_all(outcome: Any, bundle: str) -> dict[str, str]:
    from nanrunbook import EvidenceRejected, contract_content_id
    from nanrunbook.output.renderers import RENDERERS

    out = {}
    for name, renderer in RENDERERS.items():
        buffer = io.StringIO()
        if isinstance(outcome, EvidenceRejected):
            renderer.rejection(outcome, bundle, contract_content_id(), buffer)
        else:
            renderer.report(outcome, buffer)
        out[name] = buffer.getvalue()
    return out


def check_outputs(outputs: dict[str, str]) -> None:
    for line in outputs["kv"].splitlines():
        assert KV_LINE.fullmatch(line), f"kv line not shell-safe: {line!r}"
    assert_text_safe(outputs["text"])
    json.loads(outputs["json"])
    for text in outputs.values():
        assert not TRACEBACK.search(text)


def compare(report: Any, verdict: Verdict, context: str) -> None:
    assert verdict.accepted, f"accepted, but the oracle rejects ({verdict.reason}): {context}"
    d = report.decision
    assert d.decision == verdict.decision, context
    assert d.earliest_nonfinite_stage == verdict.earliest, context
    assert d.first_nonfinite_tensor == verdict.first_tensor, context
    for finding, counts, top in zip(report.stages, verdict.counts, verdict.max_abs, strict=True):
        got = finding.counts
        got_tuple = (
            None if got is None else (got.elements, got.finite, got.nan, got.posinf, got.neginf)
        )
        assert got_tuple == counts, f"{finding.stage}: {got_tuple} != {counts}: {context}"
        assert finding.finite_max_abs == top, (
            f"{finding.stage}: {finding.finite_max_abs} != {top}: {context}"
        )


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hostile-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


_COUNTER = [0]


def materialise(workdir: Path, model: BundleModel) -> tuple[Path, Path]:
    _COUNTER[0] += 1
    case = workdir / f"case-{_COUNTER[0]}"
    case.mkdir()
    outside = case / "outside.safetensors"
    outside.write_bytes(model.files[TENSOR_FILE].to_bytes() if TENSOR_FILE in model.files else b"")
    bundle = case / "bundle"
    model.write(bundle)
    if not (bundle / "fifo").exists():
        add_oddities(bundle, outside)
    return case, bundle


# ============================================================================ tests


@settings(_BASE, max_examples=LIBRARY_EXAMPLES)
@given(mutant=mutant_strategy)
def test_mutant_is_judged_safely_and_as_the_oracle_says(workdir: Path, mutant: Any) -> None:
    from nanrunbook import EvidenceRejected, Report, check_bundle

    fixture, ops, reseal = mutant
    context = f"{fixture} {ops} reseal={reseal}"
    model = build_mutant(fixture, ops, reseal)
    case, bundle = materialise(workdir, model)
    try:
        before = snapshot(case)
        try:
            outcome: Any = check_bundle(bundle)
        except EvidenceRejected as error:
            outcome = error
        # anything else propagates and fails the test: the library raises only EvidenceRejected
        assert snapshot(case) == before, f"the bundle changed: {context}"
        verdict = oracle(bundle)
        CASES_RUN["library"] += 1
        if isinstance(outcome, EvidenceRejected):
            codes = known_codes()
            for v in outcome.violations:
                assert v.code in codes, v
                assert "\n" not in v.message and v.message.isprintable(), v
                assert "\n" not in v.where, v
            assert not verdict.accepted, (
                f"rejected {[str(v) for v in outcome.violations][:4]} but the oracle accepts "
                f"({verdict.decision} {verdict.earliest}): {context}"
            )
        else:
            assert isinstance(outcome, Report)
            CASES_RUN["library_accepted"] += 1
            compare(outcome, verdict, context)
        check_outputs(render_all(outcome, str(bundle)))
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(_BASE, max_examples=CLI_EXAMPLES)
@given(mutant=mutant_strategy, fmt=st.sampled_from(("text", "json", "kv")))
def test_cli_on_mutant_answers_0_1_or_3_cleanly(workdir: Path, mutant: Any, fmt: str) -> None:
    from nanrunbook import EvidenceRejected, check_bundle

    fixture, ops, reseal = mutant
    model = build_mutant(fixture, ops, reseal)
    case, bundle = materialise(workdir, model)
    try:
        before = snapshot(case)
        try:
            expected = check_bundle(bundle).exit_code
        except EvidenceRejected:
            expected = 3
        result = run_cli(bundle, fmt)
        CASES_RUN["cli"] += 1
        assert snapshot(case) == before
        assert result.code == expected, (result, fixture, ops, reseal)
        assert result.stderr == "", result.stderr
        assert not TRACEBACK.search(result.stdout)
        if fmt == "kv":
            for line in result.stdout.splitlines():
                assert KV_LINE.fullmatch(line), line
        elif fmt == "json":
            assert json.loads(result.stdout)["exit_code"] == expected
        else:
            assert_text_safe(result.stdout)
    finally:
        shutil.rmtree(case, ignore_errors=True)


@settings(_BASE, max_examples=KV_EXAMPLES)
@given(
    where=st.one_of(
        st.text(), st.from_regex(r"\$(\.[a-z_]+|\[[0-9]+\]|\['[^']*'\])*", fullmatch=True)
    )
)
def test_kv_where_is_shell_safe_for_any_path(where: str) -> None:
    from nanrunbook.output.kv import kv_where

    CASES_RUN["kv_where"] += 1
    line = f"violation=SOME_CODE {kv_where(where)}"
    assert KV_LINE.fullmatch(line), line
