"""Exact finite extremes (min, max, smallest non-zero magnitude, zeros, subnormals)
against an independent reference: ``ml_dtypes``/numpy decode the same bits to
floats, and ``ml_dtypes.finfo`` gives the smallest normal magnitude."""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_tally import reference_extremes, reference_extremes_c64

from nanrunbook.dtypes import DTYPES
from nanrunbook.records import Extremes
from nanrunbook.tensors.counting import Counter, extremes_bytes

# dtype -> (numpy/ml_dtypes scalar type, bytes per element)
SMALL: dict[str, tuple[Any, int]] = {
    "F16": (np.float16, 2),
    "BF16": (ml_dtypes.bfloat16, 2),
    "F8_E5M2": (ml_dtypes.float8_e5m2, 1),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, 1),
    "F8_E8M0": (ml_dtypes.float8_e8m0fnu, 1),
    "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, 1),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, 1),
}
SUBBYTE: dict[str, tuple[Any, int]] = {
    "F4": (ml_dtypes.float4_e2m1fn, 4),
    "F6_E2M3": (ml_dtypes.float6_e2m3fn, 6),
    "F6_E3M2": (ml_dtypes.float6_e3m2fn, 6),
}


def normal(scalar: Any) -> float:
    return float(ml_dtypes.finfo(scalar).smallest_normal)


def table(dtype: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    scalar, width = SMALL[dtype]
    codes = np.arange(1 << (8 * width), dtype=f"<u{width}")
    return codes, codes.view(scalar)


def fed(dtype: str, data: bytes, cuts: list[int]) -> Extremes | None:
    counter = Counter(dtype)
    points = [0, *sorted(min(c * counter.align, len(data)) for c in cuts), len(data)]
    for start, end in itertools.pairwise(points):
        counter.feed(memoryview(data)[start:end])
    return counter.extremes()


def same(got: Extremes | None, expected: Extremes) -> bool:
    """Equal, with the sign of a zero minimum or maximum compared too."""
    if got != expected:
        return False
    assert got is not None
    for a, b in ((got.min, expected.min), (got.max, expected.max)):
        if a == 0 and b == 0 and math.copysign(1, a) != math.copysign(1, b):
            return False
    return True


# --- every bit pattern ---------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(SMALL))
def test_every_bit_pattern_alone(dtype: str) -> None:
    codes, values = table(dtype)
    smallest = normal(SMALL[dtype][0])
    width = SMALL[dtype][1]
    for code in codes.tolist():
        expected = reference_extremes(values[code : code + 1], smallest)
        got = extremes_bytes(dtype, code.to_bytes(width, "little"))
        assert same(got, expected), (dtype, hex(code), got, expected)


@pytest.mark.parametrize("dtype", sorted(SMALL))
def test_whole_table_forwards_backwards_and_in_pieces(dtype: str) -> None:
    codes, values = table(dtype)
    expected = reference_extremes(values, normal(SMALL[dtype][0]))
    assert extremes_bytes(dtype, codes.tobytes()) == expected
    assert extremes_bytes(dtype, codes[::-1].tobytes()) == expected
    assert fed(dtype, codes.tobytes(), list(range(0, codes.size, 7))) == expected
    assert expected.max_abs == DTYPES[dtype].max_finite


@pytest.mark.parametrize("dtype", sorted(SMALL))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_random_patterns(dtype: str, data: st.DataObject) -> None:
    codes, values = table(dtype)
    picks = data.draw(st.lists(st.integers(0, codes.size - 1), max_size=200))
    cuts = data.draw(st.lists(st.integers(0, len(picks)), max_size=6))
    expected = reference_extremes(values[picks], normal(SMALL[dtype][0]))
    assert same(extremes_bytes(dtype, codes[picks].tobytes()), expected)
    assert fed(dtype, codes[picks].tobytes(), cuts) == expected


@pytest.mark.parametrize("dtype", sorted(SMALL))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_finite_sign_mixes(dtype: str, data: st.DataObject) -> None:
    """All-finite chunks of one sign, the other, or both: the fast path's cases."""
    codes, values = table(dtype)
    with np.errstate(invalid="ignore"):
        as64 = values.astype(np.float64)
    finite = np.isfinite(as64)
    sign = data.draw(st.sampled_from(["positive", "negative", "both"]))
    keep = (
        finite
        & {
            "positive": ~np.signbit(as64),
            "negative": np.signbit(as64),
            "both": np.ones_like(finite),
        }[sign]
    )
    pool = codes[keep]
    if not pool.size:
        return
    picks = data.draw(st.lists(st.integers(0, pool.size - 1), min_size=1, max_size=100))
    chosen = pool[picks]
    expected = reference_extremes(chosen.view(SMALL[dtype][0]), normal(SMALL[dtype][0]))
    assert same(extremes_bytes(dtype, chosen.tobytes()), expected)


# --- wide formats --------------------------------------------------------------


def f32_bits() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 2**32 - 1),
        st.sampled_from([0, 1 << 31, 1, 0x8000_0001, 0x007F_FFFF, 0x0080_0000, 0x7F7F_FFFF]),
        st.sampled_from([0xFF7F_FFFF, 0x7F80_0000, 0xFF80_0000, 0x7FC0_0000, 0x807F_FFFF]),
        st.floats(width=32).map(lambda x: struct.unpack("<I", struct.pack("<f", x))[0]),
    )


def f64_bits() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 2**64 - 1),
        st.sampled_from([0, 1 << 63, 1, (1 << 63) | 1, 0x000F_FFFF_FFFF_FFFF]),
        st.sampled_from([0x0010_0000_0000_0000, 0x7FEF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000]),
        st.floats().map(lambda x: struct.unpack("<Q", struct.pack("<d", x))[0]),
    )


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(f32_bits(), max_size=64), cuts=st.lists(st.integers(0, 64), max_size=5))
def test_f32(patterns: list[int], cuts: list[int]) -> None:
    raw = np.array(patterns, dtype="<u4")
    expected = reference_extremes(raw.view("<f4"), float(np.finfo(np.float32).smallest_normal))
    assert same(extremes_bytes("F32", raw.tobytes()), expected)
    assert fed("F32", raw.tobytes(), cuts) == expected


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(f64_bits(), max_size=64), cuts=st.lists(st.integers(0, 64), max_size=5))
def test_f64(patterns: list[int], cuts: list[int]) -> None:
    raw = np.array(patterns, dtype="<u8")
    expected = reference_extremes(raw.view("<f8"), float(np.finfo(np.float64).smallest_normal))
    assert same(extremes_bytes("F64", raw.tobytes()), expected)
    assert fed("F64", raw.tobytes(), cuts) == expected


@settings(max_examples=300, deadline=None)
@given(
    pairs=st.lists(st.tuples(f32_bits(), f32_bits()), max_size=48),
    cuts=st.lists(st.integers(0, 48), max_size=5),
)
def test_c64_parts_of_finite_elements(pairs: list[tuple[int, int]], cuts: list[int]) -> None:
    raw = np.array(pairs, dtype="<u4").reshape(-1, 2)
    parts = raw.view("<f4")
    expected = reference_extremes_c64(parts[:, 0], parts[:, 1])
    assert extremes_bytes("C64", raw.tobytes()) == expected
    assert fed("C64", raw.tobytes(), cuts) == expected


def test_c64_by_hand() -> None:
    z = np.array([complex(1e30, np.nan), complex(-2.0, 0.0), complex(1e-45, 3.0)], dtype="<c8")
    got = extremes_bytes("C64", z.tobytes())
    # The NaN element's finite real part 1e30 is not a value: its element is not finite.
    assert got == Extremes(4, -2.0, 3.0, float(np.float32(1e-45)), 1, 1)


# --- sub-byte formats ----------------------------------------------------------


def pack(codes: list[int], bits: int) -> bytes:
    """Little-endian bit stream: element i at bits [i*bits, (i+1)*bits)."""
    stream = 0
    for i, code in enumerate(codes):
        stream |= code << (i * bits)
    return stream.to_bytes(len(codes) * bits // 8, "little")


@pytest.mark.parametrize("dtype", sorted(SUBBYTE))
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_subbyte(dtype: str, data: st.DataObject) -> None:
    scalar, bits = SUBBYTE[dtype]
    group = 2 if bits == 4 else 4
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=120))
    codes = codes[: len(codes) - len(codes) % group]
    values = np.array(codes, dtype=np.uint8).view(scalar)
    expected = reference_extremes(values, normal(scalar))
    packed = pack(codes, bits)
    assert same(extremes_bytes(dtype, packed), expected)
    cuts = data.draw(st.lists(st.integers(0, len(packed) // Counter(dtype).align), max_size=5))
    assert fed(dtype, packed, cuts) == expected


@pytest.mark.parametrize("dtype", sorted(SUBBYTE))
def test_subbyte_every_code_at_every_position(dtype: str) -> None:
    scalar, bits = SUBBYTE[dtype]
    group = 2 if bits == 4 else 4
    for code in range(1 << bits):
        for position in range(group):
            codes = [0x1] * group  # a subnormal filler, so zeros come only from ``code``
            codes[position] = code
            values = np.array(codes, dtype=np.uint8).view(scalar)
            expected = reference_extremes(values, normal(scalar))
            assert same(extremes_bytes(dtype, pack(codes, bits)), expected), (code, position)


# --- by hand -------------------------------------------------------------------


def test_signed_zeros_keep_their_sign() -> None:
    only_negative = extremes_bytes("F32", np.array([-0.0, -0.0], "<f4").tobytes())
    assert only_negative == Extremes(2, -0.0, -0.0, None, 2, 0)
    assert only_negative is not None and only_negative.min is not None
    assert math.copysign(1, only_negative.min) == -1 and only_negative.max_abs == 0.0
    both = extremes_bytes("F16", np.array([0.0, -0.0], "<f2").tobytes())
    assert both is not None and both.min is not None and both.max is not None
    assert (math.copysign(1, both.min), math.copysign(1, both.max)) == (-1, 1)


def test_formats_without_zero_or_negative_zero() -> None:
    # e8m0: 0x00 is 2**-127, the smallest normal value; there is no zero, no subnormal.
    assert extremes_bytes("F8_E8M0", bytes([0x00, 0x7F, 0xFF])) == Extremes(
        2, 2.0**-127, 1.0, 2.0**-127, 0, 0
    )
    # fnuz: 0x80 is the NaN, not a negative zero.
    assert extremes_bytes("F8_E4M3FNUZ", bytes([0x80, 0x00, 0x81])) == Extremes(
        2, -(2.0**-10), 0.0, 2.0**-10, 1, 1
    )


def test_non_finite_values_are_left_out() -> None:
    data = np.array([np.nan, -np.inf, 0.5, np.inf, -1e-40, 0.0], dtype="<f4")
    assert extremes_bytes("F32", data.tobytes()) == Extremes(
        3, float(np.float32(-1e-40)), 0.5, float(np.float32(1e-40)), 1, 1
    )
    assert extremes_bytes("F16", np.array([np.nan], "<f2").tobytes()) == Extremes(
        0, None, None, None, 0, 0
    )


def test_integer_and_bool_have_no_extremes() -> None:
    for dtype in (d.name for d in DTYPES.values() if not d.floating):
        assert extremes_bytes(dtype, bytes(8)) is None


def test_big_chunks_take_every_path() -> None:
    """Chunks big enough for numpy's vector loops, with and without small values."""
    rng = np.random.default_rng(7)
    for scale in (1.0, 1e-3, 1e-6):
        data = (rng.standard_normal(300_001) * scale).astype("<f2")
        data[[5, 70_000]] = [0.0, -0.0]
        expected = reference_extremes(data, float(np.finfo(np.float16).smallest_normal))
        assert extremes_bytes("F16", data.tobytes()) == expected
        assert fed("F16", data.tobytes(), [1, 1000, 100_000, 250_000]) == expected
        data[123] = np.nan
        assert fed("F16", data.tobytes(), [1000, 200_000]) == reference_extremes(
            data, float(np.finfo(np.float16).smallest_normal)
        )


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F8_E4M3FNUZ"])
def test_chunks_after_small_values_keep_one_signed_extremes(dtype: str) -> None:
    """After a chunk with zeros or subnormals the counter reads small values more
    cheaply: the signed minimum and maximum of a one-signed tensor stay exact."""
    scalar = {
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "F32": np.float32,
        "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    }[dtype]
    smallest = normal(scalar)
    for chunks in (
        [[0.0, 2.0], [3.0, 4.0], [0.5]],  # all positive: the minimum is the first zero
        [[-0.0, -2.0], [-3.0], [-4.0, -0.5]],  # all negative: the maximum is -0.0
        [[-2.0, -1.0], [smallest / 2, -smallest], [-8.0]],  # mixed only in the middle
        [[1.0, 2.0], [0.0, 0.0], [-1.0, 5.0]],
        # the lowest code of the one sign arrives in a chunk read after small values
        [[4.0, smallest / 2], [0.0, 3.0]],
        [[-4.0, -smallest / 2], [-0.0, -3.0], [-1.0]],
    ):
        counter = Counter(dtype)
        flat = []
        for chunk in chunks:
            data = np.array(chunk, dtype=scalar)
            flat.extend(data.tolist())
            counter.feed(data.tobytes())
        expected = reference_extremes(np.array(flat, dtype=scalar), smallest)
        if dtype == "F8_E4M3FNUZ":  # no negative zero: -0.0 is stored as 0.0
            assert counter.extremes() == expected
        else:
            assert same(counter.extremes(), expected), (chunks, counter.extremes(), expected)
