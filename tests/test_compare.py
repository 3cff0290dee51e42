"""Element-level comparison: every dtype against numpy/ml_dtypes values of the same
bits, figured element by element in plain Python; chunk boundaries; changed files."""

from __future__ import annotations

import cmath
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from nanrunbook.capture import BundleWriter, RawTensor
from nanrunbook.diff import diff_bundles
from nanrunbook.dtypes import DTYPES
from nanrunbook.tensors.compare import DigestChanged, ElementDelta, compare_ranges
from nanrunbook.tensors.scan import ShortRead
from tests.diffkit import BINDING

ELEMENTS = 1000  # whole bytes for F4 (2 per byte) and F6 (4 per 3 bytes)

# numpy / ml_dtypes types that read one element's code: the independent decoder.
REFERENCE_TYPES: dict[str, Any] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": ml_dtypes.bfloat16,
    "C64": np.dtype("<c8"),
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F6_E2M3": ml_dtypes.float6_e2m3fn,
    "F6_E3M2": ml_dtypes.float6_e3m2fn,
    "F4": ml_dtypes.float4_e2m1fn,
    "BOOL": np.dtype("u1"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
}
SPECIALS = {  # bit patterns worth meeting: zeros, infinities, NaNs, extremes
    "F64": [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, 0x7FEF_FFFF_FFFF_FFFF, 1],
    "F32": [0, 1 << 31, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0001, 0x7F7F_FFFF, 1],
    "F16": [0, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x7BFF, 1],
    "BF16": [0, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x7F7F, 1],
    "C64": [0, 0x7F80_0000, 0x7FC0_0000 << 32, (0xFF80_0000 << 32) | 0x7FC0_0000, 1 << 63],
    "I64": [-(2**63) & (2**64 - 1), 2**63 - 1, 0],
    "U64": [2**64 - 1, 0],
}


def code_bits(dtype: str) -> int:
    return 64 if dtype == "C64" else DTYPES[dtype].bits


def random_codes(
    dtype: str, rng: np.random.Generator, n: int = ELEMENTS, *, specials: bool = True
) -> list[int]:
    bits = code_bits(dtype)
    codes = [int(c) for c in rng.integers(0, 2**bits, n, dtype=np.uint64, endpoint=False)]
    for index, special in enumerate(SPECIALS.get(dtype, []) if specials else []):
        codes[7 * index + 3] = special
    return codes


def pack(dtype: str, codes: list[int]) -> bytes:
    """Element codes as safetensors stores them (F4 low nibble first, F6 a
    little-endian bit stream)."""
    bits = code_bits(dtype)
    if bits >= 8:
        return b"".join(c.to_bytes(bits // 8, "little") for c in codes)
    stream = sum(code << (bits * i) for i, code in enumerate(codes))
    return stream.to_bytes(len(codes) * bits // 8, "little")


def value(dtype: str, code: int) -> Any:
    """The element's value through numpy/ml_dtypes: a Python float, complex or int."""
    ref = np.dtype(REFERENCE_TYPES[dtype])
    width = max(1, code_bits(dtype) // 8)
    element = np.frombuffer(code.to_bytes(width, "little"), dtype=np.uint8).view(ref)[0]
    if DTYPES[dtype].kind in ("int", "bool"):
        return int(element)
    if dtype == "C64":
        return complex(element)
    return float(element)


def classes(v: Any) -> tuple[bool, bool]:
    """(NaN, infinite) by spec section 6 (C64: infinite only when no part is NaN)."""
    if isinstance(v, complex):
        nan = cmath.isnan(v)
        return nan, (not nan) and cmath.isinf(v)
    if isinstance(v, int):
        return False, False
    return math.isnan(v), math.isinf(v)


@dataclass
class Expected:
    differing: int = 0
    max_abs: Any = None
    max_rel: float | None = None
    nan_appeared: int = 0
    nan_disappeared: int = 0
    inf_appeared: int = 0
    inf_disappeared: int = 0


def reference(dtype: str, base: list[int], other: list[int]) -> Expected:
    expected = Expected()
    for a_code, b_code in zip(base, other, strict=True):
        if a_code == b_code:
            continue
        expected.differing += 1
        a, b = value(dtype, a_code), value(dtype, b_code)
        (nan_a, inf_a), (nan_b, inf_b) = classes(a), classes(b)
        expected.nan_appeared += nan_b and not nan_a
        expected.nan_disappeared += nan_a and not nan_b
        expected.inf_appeared += inf_b and not inf_a
        expected.inf_disappeared += inf_a and not inf_b
        if nan_a or nan_b or inf_a or inf_b:
            continue
        diff = abs(a - b)
        largest = max(abs(a), abs(b))
        rel = (diff / largest) if isinstance(diff, int) else abs(a / largest - b / largest)
        if largest == 0:
            rel = 0.0
        if expected.max_abs is None or diff > expected.max_abs:
            expected.max_abs = diff
        if expected.max_rel is None or rel > expected.max_rel:
            expected.max_rel = rel
    return expected


def assert_matches(delta: ElementDelta, expected: Expected, dtype: str) -> None:
    assert delta.elements == ELEMENTS
    assert (
        delta.differing,
        delta.nan_appeared,
        delta.nan_disappeared,
        delta.inf_appeared,
        delta.inf_disappeared,
    ) == (
        expected.differing,
        expected.nan_appeared,
        expected.nan_disappeared,
        expected.inf_appeared,
        expected.inf_disappeared,
    )
    assert delta.max_abs_diff == expected.max_abs
    if DTYPES[dtype].kind in ("int", "bool"):
        assert isinstance(delta.max_abs_diff, int)
        # float(d) / float(m) against the exactly rounded d / m: within one rounding.
        assert delta.max_rel_diff == pytest.approx(expected.max_rel, rel=1e-15)
    else:
        assert delta.max_rel_diff == expected.max_rel


def pair(dtype: str, seed: int) -> tuple[list[int], list[int]]:
    """Base codes, and other codes with about a third of the elements redrawn."""
    rng = np.random.default_rng(seed)
    base = random_codes(dtype, rng)
    redraw = random_codes(dtype, np.random.default_rng(seed + 1000), specials=False)
    other = [b if rng.random() < 0.35 else a for a, b in zip(base, redraw, strict=True)]
    if dtype in SPECIALS:  # specials on both sides, at other places
        for index, special in enumerate(SPECIALS[dtype]):
            other[7 * index + 3] = redraw[7 * index + 3]
            other[11 * index + 5] = special
    return base, other


def files(tmp_path: Path, base: bytes, other: bytes) -> tuple[int, int]:
    (tmp_path / "a").write_bytes(b"\xaa" * 5 + base)
    (tmp_path / "b").write_bytes(b"\xbb" * 3 + other)
    return os.open(tmp_path / "a", os.O_RDONLY), os.open(tmp_path / "b", os.O_RDONLY)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_figures_match_numpy_and_ml_dtypes_for_every_dtype(dtype: str, tmp_path: Path) -> None:
    base, other = pair(dtype, seed=sorted(DTYPES).index(dtype))
    expected = reference(dtype, base, other)
    assert expected.differing > 200
    data_a, data_b = pack(dtype, base), pack(dtype, other)
    fd_a, fd_b = files(tmp_path, data_a, data_b)
    try:
        for chunk in (8, 24, 64, 1 << 18):  # chunk boundaries anywhere, and one chunk
            delta = compare_ranges(dtype, len(data_a), (fd_a, 5), (fd_b, 3), chunk_elements=chunk)
            assert_matches(delta, expected, dtype)
    finally:
        os.close(fd_a)
        os.close(fd_b)


def test_floating_cases_meet_every_figure() -> None:
    """The random pairs reach every figure the comparison reports."""
    for dtype in ("F32", "F16", "BF16", "F8_E5M2", "C64", "F64"):
        expected = reference(dtype, *pair(dtype, seed=sorted(DTYPES).index(dtype)))
        assert expected.nan_appeared and expected.nan_disappeared, dtype
        assert expected.inf_appeared and expected.inf_disappeared, dtype
        assert expected.max_abs is not None and expected.max_rel is not None, dtype


def _bundle(path: Path, name: str, dtype: str, data: bytes) -> Path:
    writer = BundleWriter(
        run_id="run-compare",
        step=3,
        incident_owner="ml-oncall",
        binding=BINDING,
        last_known_good={
            "checkpoint_id": "ckpt-2",
            "step": 2,
            "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
        },
    )
    shape = (ELEMENTS // 10, 10)
    writer.observe("input", [("x", np.zeros(2, "<f4"), "x")], owner="o", probe_source="p")
    writer.observe(
        "forward", [(name, RawTensor(dtype, shape, data), "p")], owner="o", probe_source="p"
    )
    for stage in ("loss", "backward", "optimizer"):
        writer.observe(stage, [(stage, np.ones(1, "<f4"), "p")], owner="o", probe_source="p")
    return writer.write(path)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_diff_of_two_bundles_reports_the_same_figures(dtype: str, tmp_path: Path) -> None:
    base, other = pair(dtype, seed=sorted(DTYPES).index(dtype))
    a = _bundle(tmp_path / "a", "act/t", dtype, pack(dtype, base))
    b = _bundle(tmp_path / "b", "act/t", dtype, pack(dtype, other))
    result = diff_bundles(a, b, workers=2)
    first = result.first_divergence
    assert first is not None and first.name == "act/t" and first.base_stage == "forward"
    assert first.delta is not None
    assert_matches(first.delta, reference(dtype, base, other), dtype)
    assert [t.name for t in result.tensors if t.status == "identical"] == [
        "x",
        "loss",
        "backward",
        "optimizer",
    ]


def test_plus_and_minus_zero_and_nan_payloads_differ_by_bits(tmp_path: Path) -> None:
    base = np.array([0.0, np.nan, 1.0], "<f4").view("<u4")
    other = np.array([-0.0, np.nan, 1.0], "<f4").view("<u4").copy()
    other[1] |= 1  # another NaN payload
    fd_a, fd_b = files(tmp_path, base.tobytes(), other.tobytes())
    try:
        delta = compare_ranges("F32", 12, (fd_a, 5), (fd_b, 3))
    finally:
        os.close(fd_a)
        os.close(fd_b)
    assert (delta.differing, delta.max_abs_diff, delta.max_rel_diff) == (2, 0.0, 0.0)
    assert (delta.nan_appeared, delta.nan_disappeared) == (0, 0)


def test_empty_ranges_and_files_that_changed(tmp_path: Path) -> None:
    data = np.arange(64, dtype="<f4").tobytes()
    fd_a, fd_b = files(tmp_path, data, data[:-8])
    try:
        empty = compare_ranges("F32", 0, (fd_a, 5), (fd_b, 3))
        assert (empty.elements, empty.differing, empty.max_abs_diff) == (0, 0, None)
        with pytest.raises(ShortRead):
            compare_ranges("F32", len(data), (fd_a, 5), (fd_b, 3), chunk_elements=8)
        sha = "0" * 64
        with pytest.raises(DigestChanged) as caught:
            compare_ranges("F32", 32, (fd_a, 5), (fd_b, 3), digests=(sha, sha))
        assert caught.value.side == 0
        with pytest.raises(ValueError, match="whole elements"):
            compare_ranges("F32", 6, (fd_a, 5), (fd_b, 3))
    finally:
        os.close(fd_a)
        os.close(fd_b)
