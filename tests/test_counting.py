"""Exact counting (spec section 6) against independent references.

References: ``ml_dtypes`` decodes the 8-bit, sub-byte and bfloat16 formats,
numpy's ``isnan``/``isinf``/``isfinite`` the IEEE ones. The sub-byte packing is
rebuilt here with Python integers, independently of the numpy code under test.
"""

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
from reference_tally import reference, reference_c64

from nanrunbook.dtypes import DTYPES
from nanrunbook.tensors.counting import BATCHABLE, Counter, Tally, count_segments, tally_bytes

# dtype -> (numpy/ml_dtypes scalar type, bytes per element) for formats whose
# every bit pattern fits a test table.
SMALL_FORMATS: dict[str, tuple[Any, int]] = {
    "F16": (np.float16, 2),
    "BF16": (ml_dtypes.bfloat16, 2),
    "F8_E5M2": (ml_dtypes.float8_e5m2, 1),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, 1),
    "F8_E8M0": (ml_dtypes.float8_e8m0fnu, 1),
    "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, 1),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, 1),
}
SUBBYTE = {
    "F4": (ml_dtypes.float4_e2m1fn, 4),
    "F6_E2M3": (ml_dtypes.float6_e2m3fn, 6),
    "F6_E3M2": (ml_dtypes.float6_e3m2fn, 6),
}
EMPTY = Tally(0, 0, 0, 0, 0, None)


def table(dtype: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Every bit pattern of a small format, and its value per ml_dtypes/numpy."""
    scalar, width = SMALL_FORMATS[dtype]
    codes = np.arange(1 << (8 * width), dtype=f"<u{width}")
    with np.errstate(invalid="ignore"):
        return codes, codes.view(scalar).astype(np.float64)


def pack_subbyte(codes: list[int], bits: int) -> bytes:
    """Little-endian bit stream: element i at bits [i*bits, (i+1)*bits)."""
    stream = 0
    for i, code in enumerate(codes):
        stream |= code << (i * bits)
    return stream.to_bytes(len(codes) * bits // 8, "little")


def subbyte_values(dtype: str) -> list[float]:
    scalar, bits = SUBBYTE[dtype]
    return np.arange(1 << bits, dtype=np.uint8).view(scalar).astype(np.float64).tolist()


def feed_split(dtype: str, data: bytes, cuts: list[int]) -> Tally:
    counter = Counter(dtype)
    points = [0, *sorted(c * counter.align for c in cuts), len(data)]
    for start, end in itertools.pairwise(points):
        counter.feed(memoryview(data)[start:end])
    return counter.result()


# --- every bit pattern --------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(SMALL_FORMATS))
def test_every_bit_pattern_alone(dtype: str) -> None:
    codes, values = table(dtype)
    width = SMALL_FORMATS[dtype][1]
    for code, value in zip(codes.tolist(), values.tolist(), strict=True):
        got = tally_bytes(dtype, code.to_bytes(width, "little"))
        assert got == reference(np.array([value])), (dtype, hex(code), value)
        if got.max_abs is not None:
            assert math.copysign(1.0, got.max_abs) == 1.0


@pytest.mark.parametrize("dtype", sorted(SMALL_FORMATS))
def test_whole_table(dtype: str) -> None:
    codes, values = table(dtype)
    expected = reference(values)
    assert tally_bytes(dtype, codes.tobytes()) == expected
    assert expected.max_abs == DTYPES[dtype].max_finite
    # reversed, and split into pieces of 3 elements
    assert tally_bytes(dtype, codes[::-1].tobytes()) == expected
    cuts = list(range(0, codes.size, 3))
    assert feed_split(dtype, codes.tobytes(), cuts) == expected


@pytest.mark.parametrize("dtype", sorted(SMALL_FORMATS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_patterns_small_formats(dtype: str, data: st.DataObject) -> None:
    codes, values = table(dtype)
    picks = data.draw(st.lists(st.integers(0, codes.size - 1), max_size=200))
    chunk = codes[picks].tobytes()
    cuts = data.draw(st.lists(st.integers(0, len(picks)), max_size=6))
    expected = reference(values[picks])
    assert tally_bytes(dtype, chunk) == expected
    assert feed_split(dtype, chunk, cuts) == expected


# Formats with a sign bit: their all-finite chunks take the fast path, which reads the
# largest magnitude off an unsigned and a signed maximum. Exercise every sign mix.
SIGNED_FORMATS = ["BF16", "F16", "F8_E4M3", "F8_E5M2"]


def finite_codes(dtype: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    codes, values = table(dtype)
    keep = np.isfinite(values)
    return codes[keep], np.abs(values[keep])


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2"])
def test_fast_path_every_pair_of_finite_bytes(dtype: str) -> None:
    codes, mags = finite_codes(dtype)
    for a, mag_a in zip(codes.tolist(), mags.tolist(), strict=True):
        for b, mag_b in zip(codes.tolist(), mags.tolist(), strict=True):
            got = tally_bytes(dtype, bytes([a, b]))
            assert got == Tally(2, 2, 0, 0, 0, max(mag_a, mag_b)), (dtype, hex(a), hex(b))


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_fast_path_every_finite_magnitude_with_each_sign_mix(dtype: str) -> None:
    codes, mags = finite_codes(dtype)
    sign = 0x8000
    by_code = dict(zip(codes.tolist(), mags.tolist(), strict=True))
    for code in codes.tolist():
        if code & sign:
            continue
        mag = by_code[code]
        smaller = code // 2  # a positive finite pattern of no larger magnitude
        for pair in (
            (code | sign, smaller),  # the negative one is larger
            (smaller | sign, code),  # the positive one is larger
            (code | sign, smaller | sign),  # all negative: the signed maximum is < 0
            (code, smaller),  # all positive
        ):
            data = np.array(pair, dtype="<u2").tobytes()
            assert tally_bytes(dtype, data) == Tally(2, 2, 0, 0, 0, mag), (dtype, pair)


@pytest.mark.parametrize("dtype", SIGNED_FORMATS)
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_fast_path_random_finite_chunks(dtype: str, data: st.DataObject) -> None:
    codes, mags = finite_codes(dtype)
    picks = data.draw(st.lists(st.integers(0, codes.size - 1), min_size=1, max_size=300))
    got = tally_bytes(dtype, codes[picks].tobytes())
    assert got == Tally(len(picks), len(picks), 0, 0, 0, float(mags[picks].max()))


def test_special_encodings_by_name() -> None:
    # Spot checks written out by hand from the spec table.
    assert tally_bytes("F8_E4M3", bytes([0x7F, 0xFF, 0x7E])) == Tally(3, 1, 2, 0, 0, 448.0)
    assert tally_bytes("F8_E8M0", bytes([0xFF, 0x00, 0x7F])) == Tally(3, 2, 1, 0, 0, 1.0)
    assert tally_bytes("F8_E8M0", bytes([0x00])).max_abs == 2.0**-127
    assert tally_bytes("F8_E4M3FNUZ", bytes([0x80])) == Tally(1, 0, 1, 0, 0, None)
    assert tally_bytes("F8_E5M2FNUZ", bytes([0x80, 0x00])) == Tally(2, 1, 1, 0, 0, 0.0)
    assert tally_bytes("F8_E5M2", bytes([0x7C, 0xFC, 0x7D])) == Tally(3, 0, 1, 1, 1, None)
    assert tally_bytes("BF16", bytes.fromhex("807f80ff")) == Tally(2, 0, 0, 1, 1, None)


# --- sub-byte formats ---------------------------------------------------------


def test_f4_every_byte() -> None:
    values = subbyte_values("F4")
    for byte in range(256):
        expected = max(abs(values[byte & 0xF]), abs(values[byte >> 4]))
        assert tally_bytes("F4", bytes([byte])) == Tally(2, 2, 0, 0, 0, expected), hex(byte)
    assert tally_bytes("F4", bytes(range(256))).max_abs == 6.0 == DTYPES["F4"].max_finite


@pytest.mark.parametrize("dtype", ["F6_E2M3", "F6_E3M2"])
def test_f6_every_code_at_every_position(dtype: str) -> None:
    values = subbyte_values(dtype)
    for code in range(64):
        for position in range(4):
            codes = [0, 0, 0, 0]
            codes[position] = code
            got = tally_bytes(dtype, pack_subbyte(codes, 6))
            assert got == Tally(4, 4, 0, 0, 0, abs(values[code])), (code, position)
    every = pack_subbyte(list(range(64)), 6)
    assert tally_bytes(dtype, every) == Tally(64, 64, 0, 0, 0, DTYPES[dtype].max_finite)


def test_f6_bit_order_is_little_endian_stream() -> None:
    # 0x3F in the low six bits of byte 0 is element 0 = -7.5 (E2M3). Read MSB
    # first the same bytes would hold 1.875 and 2.0 instead.
    assert tally_bytes("F6_E2M3", bytes([0x3F, 0, 0])).max_abs == 7.5
    # Element 3 sits in the top six bits of byte 2.
    assert tally_bytes("F6_E3M2", bytes([0, 0, 0x7C])).max_abs == 28.0


@pytest.mark.parametrize("dtype", sorted(SUBBYTE))
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_random_subbyte(dtype: str, data: st.DataObject) -> None:
    bits = SUBBYTE[dtype][1]
    group = 2 if bits == 4 else 4
    values = subbyte_values(dtype)
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=120))
    codes = codes[: len(codes) - len(codes) % group]
    packed = pack_subbyte(codes, bits)
    expected = Tally(
        len(codes), len(codes), 0, 0, 0, max((abs(values[c]) for c in codes), default=None)
    )
    assert tally_bytes(dtype, packed) == expected
    cuts = data.draw(st.lists(st.integers(0, len(packed) // Counter(dtype).align), max_size=5))
    assert feed_split(dtype, packed, cuts) == expected


# --- F32 / F64 / C64 properties ----------------------------------------------

F32_SPECIAL = [
    0,
    0x8000_0000,
    1,
    0x8000_0001,
    0x007F_FFFF,
    0x0080_0000,
    0x7F7F_FFFF,
    0xFF7F_FFFF,
    0x7F80_0000,
    0xFF80_0000,
    0x7F80_0001,
    0x7FC0_0000,
    0xFFC0_0000,
    0x7FFF_FFFF,
    0xFFFF_FFFF,
    0x3F80_0000,
]
F64_SPECIAL = [
    0,
    1 << 63,
    1,
    0x000F_FFFF_FFFF_FFFF,
    0x7FEF_FFFF_FFFF_FFFF,
    0x7FF0_0000_0000_0000,
    0xFFF0_0000_0000_0000,
    0x7FF0_0000_0000_0001,
    0x7FF8_0000_0000_0000,
    0xFFFF_FFFF_FFFF_FFFF,
    0x3FF0_0000_0000_0000,
]


def f32_bits() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 2**32 - 1),
        st.sampled_from(F32_SPECIAL),
        st.floats(width=32).map(lambda x: struct.unpack("<I", struct.pack("<f", x))[0]),
    )


def f64_bits() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 2**64 - 1),
        st.sampled_from(F64_SPECIAL),
        st.floats().map(lambda x: struct.unpack("<Q", struct.pack("<d", x))[0]),
    )


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(f32_bits(), max_size=64), cuts=st.lists(st.integers(0, 64), max_size=5))
def test_f32_matches_numpy(patterns: list[int], cuts: list[int]) -> None:
    raw = np.array(patterns, dtype="<u4")
    expected = reference(raw.view("<f4"))
    assert tally_bytes("F32", raw.tobytes()) == expected
    cuts = [min(c, len(patterns)) for c in cuts]
    assert feed_split("F32", raw.tobytes(), cuts) == expected


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(f64_bits(), max_size=64), cuts=st.lists(st.integers(0, 64), max_size=5))
def test_f64_matches_numpy(patterns: list[int], cuts: list[int]) -> None:
    raw = np.array(patterns, dtype="<u8")
    expected = reference(raw.view("<f8"))
    assert tally_bytes("F64", raw.tobytes()) == expected
    cuts = [min(c, len(patterns)) for c in cuts]
    assert feed_split("F64", raw.tobytes(), cuts) == expected


@settings(max_examples=400, deadline=None)
@given(
    pairs=st.lists(st.tuples(f32_bits(), f32_bits()), max_size=48),
    cuts=st.lists(st.integers(0, 48), max_size=5),
)
def test_c64_matches_numpy(pairs: list[tuple[int, int]], cuts: list[int]) -> None:
    raw = np.array(pairs, dtype="<u4").reshape(-1, 2)
    parts = raw.view("<f4")
    expected = reference_c64(parts[:, 0], parts[:, 1])
    assert tally_bytes("C64", raw.tobytes()) == expected
    cuts = [min(c, len(pairs)) for c in cuts]
    assert feed_split("C64", raw.tobytes(), cuts) == expected


def test_c64_rules_by_hand() -> None:
    inf, nan = float("inf"), float("nan")
    z = np.array([complex(1e30, nan)], dtype="<c8")  # NaN element: its finite part is not counted
    assert tally_bytes("C64", z.tobytes()) == Tally(1, 0, 1, 0, 0, None)
    z = np.array([complex(-inf, nan)], dtype="<c8")  # any NaN part makes a NaN
    assert tally_bytes("C64", z.tobytes()) == Tally(1, 0, 1, 0, 0, None)
    z = np.array([complex(inf, -inf), complex(2.0, -inf), complex(-inf, inf), 3 - 4j])
    assert tally_bytes("C64", z.astype("<c8").tobytes()) == Tally(4, 1, 0, 1, 2, 4.0)
    assert tally_bytes("C64", np.array([-0.0 - 0.0j], "<c8").tobytes()) == Tally(1, 1, 0, 0, 0, 0.0)


def test_negative_zero_subnormals_and_extremes() -> None:
    cases = {
        "F32": ("<f4", [-0.0, np.float32(1e-45), -np.float32(3.4028235e38)]),
        "F64": ("<f8", [-0.0, 5e-324, -1.7976931348623157e308]),
        "F16": ("<f2", [-0.0, np.float16(6e-8), -65504.0]),
    }
    for dtype, (np_dtype, values) in cases.items():
        arr = np.array(values, dtype=np_dtype)
        got = tally_bytes(dtype, arr.tobytes())
        assert got == reference(arr)
        assert got.max_abs == DTYPES[dtype].max_finite
        assert tally_bytes(dtype, arr[:1].tobytes()).max_abs == 0.0
        assert tally_bytes(dtype, arr[1:2].tobytes()).max_abs == float(arr[1])
    pair = np.array([complex(-3.4028235e38, 1e-45)], dtype="<c8")
    assert tally_bytes("C64", pair.tobytes()).max_abs == DTYPES["C64"].max_finite


# --- chunking -----------------------------------------------------------------


def test_nan_at_end_and_start_of_chunks() -> None:
    nan = float("nan")
    first = np.array([1.0, -2.0, nan], dtype="<f4")
    second = np.array([nan, 0.5, -np.inf], dtype="<f4")
    counter = Counter("F32")
    counter.feed(first.tobytes())
    counter.feed(second.tobytes())
    assert counter.result() == Tally(6, 3, 2, 0, 1, 2.0)
    # a chunk of only non-finite elements adds no magnitude
    counter = Counter("F16")
    counter.feed(np.array([nan, np.inf], dtype="<f2").tobytes())
    assert counter.result() == Tally(2, 0, 1, 1, 0, None)
    counter.feed(np.array([3.0], dtype="<f2").tobytes())
    assert counter.result() == Tally(3, 1, 1, 1, 0, 3.0)


def test_nan_above_finite_max_in_same_chunk() -> None:
    # The largest sign-cleared pattern is the NaN; the finite max must ignore it.
    arr = np.array([0.25, np.nan, -7.0, np.inf], dtype="<f8")
    assert tally_bytes("F64", arr.tobytes()) == Tally(4, 2, 1, 1, 0, 7.0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_empty_and_alignment(dtype: str) -> None:
    counter = Counter(dtype)
    bits = DTYPES[dtype].bits
    assert counter.align == {4: 1, 6: 3}.get(bits, bits // 8)
    assert counter.result() == EMPTY
    counter.feed(b"")
    assert counter.result() == EMPTY
    assert tally_bytes(dtype, b"") == EMPTY
    if counter.align > 1:
        with pytest.raises(ValueError):
            counter.feed(bytes(counter.align + 1))
        with pytest.raises(ValueError):
            tally_bytes(dtype, bytes(counter.align - 1))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_scalar_zero_of_every_dtype(dtype: str) -> None:
    counter = Counter(dtype)
    per_unit = {4: 2, 6: 4}.get(DTYPES[dtype].bits, 1)
    got = tally_bytes(dtype, bytes(counter.align))
    floating = DTYPES[dtype].floating
    if dtype == "F8_E8M0":  # no zero: 0x00 is 2**-127
        assert got == Tally(1, 1, 0, 0, 0, 2.0**-127)
    else:
        assert got == Tally(per_unit, per_unit, 0, 0, 0, 0.0 if floating else None)


@pytest.mark.parametrize("dtype", [d.name for d in DTYPES.values() if not d.floating])
@settings(max_examples=20, deadline=None)
@given(data=st.binary(max_size=64))
def test_integer_and_bool_all_finite(dtype: str, data: bytes) -> None:
    width = DTYPES[dtype].bits // 8
    data = data[: len(data) - len(data) % width]
    n = len(data) // width
    assert tally_bytes(dtype, data) == Tally(n, n, 0, 0, 0, None)


def test_unknown_dtype_and_nonfinite_property() -> None:
    with pytest.raises(ValueError):
        Counter("F128")
    assert Tally(5, 1, 2, 1, 1, None).nonfinite == 4


def test_accepts_bytes_bytearray_memoryview_and_reuses_counter() -> None:
    arr = np.array([1.5, np.nan, -np.inf, 2.5] * 10, dtype="<f4")
    expected = reference(arr)
    raw = arr.tobytes()
    assert tally_bytes("F32", bytearray(raw)) == expected
    assert tally_bytes("F32", memoryview(raw)) == expected
    counter = Counter("F32")
    counter.feed(raw[:64])  # a large chunk, then smaller ones reuse scratch space
    counter.feed(raw[64:72])
    counter.feed(raw[72:])
    assert counter.result() == expected


# -- many small tensors at once (count_segments) ------------------------------------------


def interesting_bits(dtype: str) -> st.SearchStrategy[int]:
    """Any bit pattern, weighted towards zeros, subnormals, the largest finite codes
    and the non-finite ones, where the segment reductions could go wrong."""
    fmt = DTYPES[dtype].format
    width = DTYPES[dtype].bits
    anything = st.integers(0, (1 << width) - 1)
    if fmt is None:
        return anything
    sign = st.sampled_from([0, fmt.sign])
    special = st.sampled_from(
        [0, 1, fmt.min_normal_code, fmt.max_finite_code, fmt.code_mask]
        + ([fmt.first_nonfinite] if fmt.first_nonfinite is not None else [])
    )
    return st.one_of(anything, st.builds(lambda s, c: s | c, sign, special))


@pytest.mark.parametrize("dtype", sorted(BATCHABLE))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_segments_match_one_counter_each(dtype: str, data: st.DataObject) -> None:
    width = max(1, DTYPES[dtype].bits // 8)
    tensors = data.draw(
        st.lists(
            st.lists(interesting_bits(dtype), min_size=1, max_size=40), min_size=1, max_size=12
        )
    )
    blobs = [b"".join(code.to_bytes(width, "little") for code in codes) for codes in tensors]
    got = count_segments(dtype, b"".join(blobs), [len(blob) for blob in blobs])
    for blob, (tally, extremes) in zip(blobs, got, strict=True):
        counter = Counter(dtype)
        counter.feed(blob)
        # repr tells -0.0 from 0.0, which == does not
        assert repr((tally, extremes)) == repr((counter.result(), counter.extremes()))


def test_batchable_dtypes_are_the_whole_byte_ones() -> None:
    assert {
        name
        for name, d in DTYPES.items()
        if d.kind != "complex" and (d.format is None or d.format.bits % 8 == 0)
    } == BATCHABLE


@pytest.mark.parametrize("dtype", sorted(BATCHABLE))
def test_many_segments_match_one_counter_each(dtype: str) -> None:
    # Past a few hundred tensors the records are built in bulk (records.frozen_records).
    width = max(1, DTYPES[dtype].bits // 8)
    rng = np.random.default_rng(len(dtype))
    sizes = [int(n) * width for n in rng.integers(1, 9, 700)]
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    data[::5] = 0  # zeros and subnormals too
    blob = data.tobytes()
    got = count_segments(dtype, blob, sizes)
    start = 0
    for size, (tally, extremes) in zip(sizes, got, strict=True):
        counter = Counter(dtype)
        counter.feed(blob[start : start + size])
        start += size
        assert repr((tally, extremes)) == repr((counter.result(), counter.extremes()))
        assert type(tally) is Tally
