"""Exact element counting by bit pattern (spec section 6).

A :class:`Counter` classifies the raw little-endian bytes of one tensor, fed in
chunks, into finite / NaN / +inf / -inf elements and tracks the largest finite
magnitude. Classification never converts data to a float: it works on unsigned
integer views of the bits.

The fast path relies on one property of sign-magnitude floating formats: with
the sign bit cleared, bit patterns order like the magnitudes they encode, and
every non-finite pattern lies above every finite one. So the largest magnitude
pattern of a chunk decides it: when it is below the first non-finite pattern,
the whole chunk is finite and it *is* the largest finite magnitude's pattern.
It comes from two read-only reductions over the bits, with no scratch written:
the unsigned maximum (a negative element, if any, wins it, and its low bits are
the largest negative magnitude) and the signed maximum (the largest positive
magnitude, or below zero when every element is negative). Only chunks holding a
non-finite element take the detailed path, which computes ``bits & ~sign`` into
a reused buffer. The largest finite pattern is kept as an integer and decoded to
an exact float64 once, in :meth:`Counter.result`.

Sub-byte formats (no NaN or infinity encodings, every element finite):

* ``F4`` (E2M1): two elements per byte, element ``2i`` in the low nibble and
  ``2i+1`` in the high nibble. This is PyTorch's ``float4_e2m1fn_x2`` layout
  (pytorch/pytorch ``torch/headeronly/util/Float4_e2m1fn_x2.h``: "val1 : val0"
  in bits "7654 : 3210"), the dtype safetensors maps ``F4`` to
  (safetensors/safetensors ``bindings/python/py_src/safetensors/torch.py``).
  The largest magnitude of a tensor does not depend on the nibble order anyway.
* ``F6_E2M3`` / ``F6_E3M2``: safetensors only fixes the width (``bitsize`` 6 in
  ``safetensors/src/tensor.rs``, citing the OCP MX spec, which leaves the
  memory layout unprescribed). We read the data as a little-endian bit stream,
  the same rule as the F4 layout above and zarr's ``packbits`` codec
  (zarr-developers/zarr-extensions ``codecs/packbits``): element ``i`` is bits
  ``[6i, 6i+6)``, so each 3-byte group ``b0 b1 b2`` forms the 24-bit word
  ``b0 | b1 << 8 | b2 << 16`` holding elements ``k = 0..3`` at ``word >> 6k``.
  (torchao's FP6-LLM packing is MSB-first instead; it is not a safetensors
  convention.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from nanrunbook.dtypes import DTYPES
from nanrunbook.records import Counts

__all__ = ["Counter", "Tally", "tally_bytes"]

_Array = npt.NDArray[Any]
_Chunk = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Tally:
    """Exact counts for one tensor (or any run of elements of one dtype)."""

    elements: int
    finite: int
    nan: int
    posinf: int
    neginf: int
    # Largest magnitude among finite elements, exact; None when the dtype is not
    # floating or no element is finite. For C64: largest |real| or |imag|.
    max_abs: float | None

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def counts(self) -> Counts:
        return Counts(self.elements, self.finite, self.nan, self.posinf, self.neginf)


def combine(tallies: Iterable[Tally]) -> Tally:
    """One tally for several tensors (a stage): counts add up, ``max_abs`` is the
    largest finite magnitude among them (None when none has one)."""
    parts = list(tallies)
    maxima = [t.max_abs for t in parts if t.max_abs is not None]
    return Tally(
        elements=sum(t.elements for t in parts),
        finite=sum(t.finite for t in parts),
        nan=sum(t.nan for t in parts),
        posinf=sum(t.posinf for t in parts),
        neginf=sum(t.neginf for t in parts),
        max_abs=max(maxima) if maxima else None,
    )


def _minifloat_magnitudes(exp_bits: int, man_bits: int, bias: int, count: int) -> tuple[float, ...]:
    """Exact magnitudes of the first ``count`` sign-cleared codes of a binary format."""
    assert exp_bits >= 1 and count <= 1 << (exp_bits + man_bits)
    values = []
    for code in range(count):
        exponent, mantissa = code >> man_bits, code & ((1 << man_bits) - 1)
        if exponent == 0:  # subnormal (or zero)
            values.append(math.ldexp(mantissa, 1 - bias - man_bits))
        else:
            values.append(math.ldexp((1 << man_bits) + mantissa, exponent - bias - man_bits))
    return tuple(values)


def _view_decoder(uint: str, flt: str, shift: int = 0) -> Callable[[int], float]:
    def decode(pattern: int) -> float:
        return float(np.array([pattern << shift], dtype=uint).view(flt)[0])

    return decode


def _table_decoder(table: Sequence[float]) -> Callable[[int], float]:
    def decode(pattern: int) -> float:
        return table[pattern]

    return decode


@dataclass(frozen=True, slots=True)
class _SignMagnitude:
    """A format whose non-finite codes are exactly ``bits & absmask >= first_nonfinite``."""

    uint: str  # numpy dtype of one element's bits, little-endian
    sign: int  # sign bit (the top bit of ``uint``), 0 when the format has none
    first_nonfinite: int  # smallest sign-cleared non-finite pattern
    has_inf: bool  # first_nonfinite is +infinity; above it is NaN
    decode: Callable[[int], float]

    @property
    def absmask(self) -> int:
        return (1 << (np.dtype(self.uint).itemsize * 8)) - 1 - self.sign

    @property
    def sint(self) -> str:
        """The signed integer dtype of the same width: its order puts negatives first."""
        return self.uint.replace("u", "i")


@dataclass(frozen=True, slots=True)
class _Fnuz:
    """FNUZ 8-bit formats: the only non-finite code is 0x80 (NaN); no negative zero."""

    decode: Callable[[int], float]


@dataclass(frozen=True, slots=True)
class _Complex64:
    """C64: pairs (real, imag) of little-endian F32."""


@dataclass(frozen=True, slots=True)
class _Packed:
    """F4 / F6: sub-byte sign-magnitude codes without NaN or infinity."""

    bits: int  # 4 or 6
    table: tuple[float, ...]  # magnitude of each sign-cleared code


@dataclass(frozen=True, slots=True)
class _Plain:
    """Integers and BOOL: every element finite, no magnitude."""

    width: int  # bytes per element


_Format = _SignMagnitude | _Fnuz | _Complex64 | _Packed | _Plain

_F32 = _SignMagnitude("<u4", 0x8000_0000, 0x7F80_0000, True, _view_decoder("<u4", "<f4"))
_FORMATS: dict[str, _Format] = {
    "F64": _SignMagnitude(
        "<u8", 0x8000_0000_0000_0000, 0x7FF0_0000_0000_0000, True, _view_decoder("<u8", "<f8")
    ),
    "F32": _F32,
    "F16": _SignMagnitude("<u2", 0x8000, 0x7C00, True, _view_decoder("<u2", "<f2")),
    # BF16 is the top half of an F32: shift into the top of a uint32.
    "BF16": _SignMagnitude("<u2", 0x8000, 0x7F80, True, _view_decoder("<u4", "<f4", 16)),
    "C64": _Complex64(),
    "F8_E5M2": _SignMagnitude(
        "u1", 0x80, 0x7C, True, _table_decoder(_minifloat_magnitudes(5, 2, 15, 0x7C))
    ),
    # e4m3fn: S.1111.111 is NaN, no infinity.
    "F8_E4M3": _SignMagnitude(
        "u1", 0x80, 0x7F, False, _table_decoder(_minifloat_magnitudes(4, 3, 7, 0x7F))
    ),
    # e8m0fnu: no sign, no zero, value 2**(b - 127); 0xFF is NaN.
    "F8_E8M0": _SignMagnitude(
        "u1", 0, 0xFF, False, _table_decoder(tuple(math.ldexp(1.0, b - 127) for b in range(255)))
    ),
    "F8_E4M3FNUZ": _Fnuz(_table_decoder(_minifloat_magnitudes(4, 3, 8, 0x80))),
    "F8_E5M2FNUZ": _Fnuz(_table_decoder(_minifloat_magnitudes(5, 2, 16, 0x80))),
    "F4": _Packed(4, _minifloat_magnitudes(2, 1, 1, 8)),
    "F6_E2M3": _Packed(6, _minifloat_magnitudes(2, 3, 1, 32)),
    "F6_E3M2": _Packed(6, _minifloat_magnitudes(3, 2, 3, 32)),
}
_FORMATS.update({d.name: _Plain(d.bits // 8) for d in DTYPES.values() if d.kind in ("int", "bool")})


def _align(fmt: _Format) -> int:
    if isinstance(fmt, _SignMagnitude):
        return np.dtype(fmt.uint).itemsize
    if isinstance(fmt, _Complex64):
        return 8
    if isinstance(fmt, _Packed):
        return 1 if fmt.bits == 4 else 3
    if isinstance(fmt, _Plain):
        return fmt.width
    return 1


class Counter:
    """Incremental exact classifier for one tensor's raw bytes (little-endian, as stored in safetensors).

    Every :meth:`feed` must be a whole number of ``align`` bytes (whole elements;
    for F6 whole groups of four). A chunk that is not raises ``ValueError``: the
    header validation elsewhere guarantees whole elements, so this is a bug.
    """

    __slots__ = (
        "_elements",
        "_fmt",
        "_max_code",
        "_nan",
        "_neginf",
        "_posinf",
        "_scratch",
        "align",
        "dtype",
    )

    def __init__(self, dtype: str) -> None:
        fmt = _FORMATS.get(dtype)
        if fmt is None or dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}")
        self.dtype = dtype
        self._fmt: _Format = fmt
        self.align: int = _align(fmt)
        self._elements = 0
        self._nan = 0
        self._posinf = 0
        self._neginf = 0
        self._max_code = -1  # largest finite sign-cleared code seen, -1 for none
        self._scratch: _Array | None = None

    def _buffer(self, n: int, dtype: str) -> _Array:
        """A reused scratch array of ``n`` elements of ``dtype``."""
        scratch = self._scratch
        if scratch is None or scratch.dtype != np.dtype(dtype) or scratch.size < n:
            scratch = np.empty(n, dtype=dtype)
            self._scratch = scratch
        return scratch[:n]

    def feed(self, chunk: _Chunk) -> None:
        size = memoryview(chunk).nbytes
        if size % self.align:
            raise ValueError(
                f"{self.dtype} chunk of {size} bytes is not a multiple of {self.align} bytes"
            )
        if size == 0:
            return
        fmt = self._fmt
        if isinstance(fmt, _SignMagnitude):
            self._feed_sign_magnitude(fmt, chunk)
        elif isinstance(fmt, _Fnuz):
            self._feed_fnuz(chunk)
        elif isinstance(fmt, _Complex64):
            self._feed_c64(chunk)
        elif isinstance(fmt, _Packed):
            self._feed_packed(fmt, chunk)
        else:
            self._elements += size // fmt.width

    def _feed_sign_magnitude(self, fmt: _SignMagnitude, chunk: _Chunk) -> None:
        bits = np.frombuffer(chunk, dtype=fmt.uint)
        n = bits.size
        self._elements += n
        if fmt.sign:
            # Largest negative magnitude (or the largest positive one when no element
            # is negative), then the largest positive magnitude (< 0 when none is).
            top = max(int(bits.max()) & fmt.absmask, int(bits.view(fmt.sint).max()))
        else:
            top = int(bits.max())
        first = fmt.first_nonfinite
        if top < first:  # whole chunk finite
            self._max_code = max(self._max_code, top)
            return
        if fmt.sign:
            mags = self._buffer(n, fmt.uint)
            np.bitwise_and(bits, fmt.absmask, out=mags)
        else:
            mags = bits
        if fmt.has_inf:
            nan = int(np.count_nonzero(mags > first))
            posinf = int(np.count_nonzero(bits == first))
            neginf = int(np.count_nonzero(bits == (first | fmt.sign)))
        else:
            nan = int(np.count_nonzero(mags >= first))
            posinf = neginf = 0
        self._nan += nan
        self._posinf += posinf
        self._neginf += neginf
        if nan + posinf + neginf < n:
            finite_top = int(np.max(mags, where=mags < first, initial=0))
            self._max_code = max(self._max_code, finite_top)

    def _feed_fnuz(self, chunk: _Chunk) -> None:
        bits = np.frombuffer(chunk, dtype="u1")
        n = bits.size
        self._elements += n
        mags = self._buffer(n, "u1")
        np.bitwise_and(bits, 0x7F, out=mags)
        nan = int(np.count_nonzero(bits == 0x80))
        self._nan += nan
        if nan < n:
            # 0x80 has magnitude bits 0, never above a finite element's.
            self._max_code = max(self._max_code, int(mags.max()))

    def _feed_c64(self, chunk: _Chunk) -> None:
        bits = np.frombuffer(chunk, dtype="<u4")
        self._elements += bits.size // 2
        mags = self._buffer(bits.size, "<u4")
        np.bitwise_and(bits, 0x7FFF_FFFF, out=mags)
        top = int(mags.max())
        inf = 0x7F80_0000
        if top < inf:
            self._max_code = max(self._max_code, top)
            return
        parts = mags.reshape(-1, 2)
        raw = bits.reshape(-1, 2)
        re, im = parts[:, 0], parts[:, 1]
        el_nan = np.logical_or(re > inf, im > inf)
        el_nonfinite = np.logical_or(re >= inf, im >= inf)
        el_inf = el_nonfinite & ~el_nan
        # The sign of the first infinite part: the real one if infinite, else the imaginary.
        first_sign = np.where(re == inf, raw[:, 0], raw[:, 1]) >> 31
        nan = int(np.count_nonzero(el_nan))
        infs = int(np.count_nonzero(el_inf))
        neginf = int(np.count_nonzero(el_inf & (first_sign == 1)))
        self._nan += nan
        self._posinf += infs - neginf
        self._neginf += neginf
        if nan + infs < parts.shape[0]:
            finite = ~el_nonfinite
            finite_top = int(np.max(parts, where=finite[:, None], initial=0))
            self._max_code = max(self._max_code, finite_top)

    def _feed_packed(self, fmt: _Packed, chunk: _Chunk) -> None:
        data = np.frombuffer(chunk, dtype="u1")
        if fmt.bits == 4:
            self._elements += 2 * data.size
            low = int(np.bitwise_and(data, 0x07).max())
            high = int(np.bitwise_and(data, 0x70).max()) >> 4
            self._max_code = max(self._max_code, low, high)
            return
        groups = data.reshape(-1, 3).astype("<u4")
        self._elements += 4 * groups.shape[0]
        words = groups[:, 0] | (groups[:, 1] << 8) | (groups[:, 2] << 16)
        for k in range(4):  # element k of each group: bits [6k, 6k+6); sign is the top bit
            field = int(((words >> (6 * k)) & 0x1F).max())
            self._max_code = max(self._max_code, field)

    def result(self) -> Tally:
        nonfinite = self._nan + self._posinf + self._neginf
        fmt = self._fmt
        max_abs: float | None = None
        if self._max_code >= 0:
            if isinstance(fmt, _SignMagnitude | _Fnuz):
                max_abs = fmt.decode(self._max_code)
            elif isinstance(fmt, _Complex64):
                max_abs = _F32.decode(self._max_code)
            elif isinstance(fmt, _Packed):
                max_abs = fmt.table[self._max_code]
        return Tally(
            elements=self._elements,
            finite=self._elements - nonfinite,
            nan=self._nan,
            posinf=self._posinf,
            neginf=self._neginf,
            max_abs=max_abs,
        )


def tally_bytes(dtype: str, data: _Chunk) -> Tally:
    """Count a whole tensor held in memory (convenience for small data and tests)."""
    counter = Counter(dtype)
    counter.feed(data)
    return counter.result()


def code_values(dtype: str) -> tuple[float, ...]:
    """The value of every bit pattern of a floating format of at most 8 bits, by code.

    For the F8 formats, F6_E2M3, F6_E3M2 and F4 (for F6 and F4, the code of one
    element, sign in its top bit): NaN and the infinities where the format has
    them. Built from the same format facts the counter uses, so comparison and
    counting never disagree about what a code means. ValueError for any other dtype.
    """
    fmt = _FORMATS.get(dtype)
    if isinstance(fmt, _SignMagnitude) and fmt.uint == "u1":
        sign, first = fmt.sign, fmt.first_nonfinite
        width = 256
    elif isinstance(fmt, _Fnuz):
        sign, first, width = 0x80, 0x80, 256
    elif isinstance(fmt, _Packed):
        sign, first, width = 1 << (fmt.bits - 1), 1 << fmt.bits, 1 << fmt.bits
    else:
        raise ValueError(f"{dtype} is not a floating format of at most 8 bits")
    values = []
    for code in range(width):
        magnitude_code = code & ~sign
        negative = bool(code & sign)
        if isinstance(fmt, _Fnuz) and code == 0x80:
            value = math.nan
        elif magnitude_code >= first:
            is_inf = isinstance(fmt, _SignMagnitude) and fmt.has_inf and magnitude_code == first
            value = math.inf if is_inf else math.nan
        elif isinstance(fmt, _Packed):
            value = fmt.table[magnitude_code]
        else:
            value = fmt.decode(magnitude_code)
        values.append(-value if negative and not math.isnan(value) else value)
    return tuple(values)
