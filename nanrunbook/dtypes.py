"""The safetensors dtypes: the one table of every per-dtype fact.

Each :class:`DType` carries its element width, its kind, the numpy/ml_dtypes and
torch names of the same bits, and for a floating dtype its bit layout
(:class:`FloatFormat`: exponent and mantissa bits, bias, sign, which codes are
NaN or infinite). Every other per-dtype fact (largest finite value, smallest
normal and subnormal, the codes the counter compares against, how many bytes
hold whole elements) is derived from those here, and nowhere else: a new dtype
is one row of :data:`DTYPES`.

Layouts follow spec section 6 and the OCP / ml_dtypes definitions:

* ``ieee``: exponent all ones is non-finite; mantissa 0 is infinity, else NaN;
* ``all_ones``: only the all-ones magnitude is NaN, no infinity (e4m3fn, and
  e8m0fnu, which has no sign, no zero and no mantissa);
* ``negative_zero``: the "fnuz" formats: the sign bit alone (0x80) is the only
  NaN, there is no negative zero and no infinity;
* ``None``: no NaN or infinity encoding (F4, F6): every element is finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "DTYPES",
    "FLOATING_KINDS",
    "NUMPY_DTYPES",
    "TORCH_DTYPES",
    "WHOLE_ELEMENTS_BYTES",
    "DType",
    "FloatFormat",
]

Kind = Literal["bool", "int", "float", "complex"]
NanEncoding = Literal["ieee", "all_ones", "negative_zero"]
FLOATING_KINDS: frozenset[str] = frozenset({"float", "complex"})


@dataclass(frozen=True, slots=True)
class FloatFormat:
    """The bit layout of one binary floating value (for C64: of one F32 part).

    A value's bits are ``sign | exponent | mantissa`` from the top; a *code* is
    the value's bits with the sign cleared. Codes order like the magnitudes they
    encode, and every non-finite code lies above every finite one (except the
    fnuz NaN, which is the sign bit alone).
    """

    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool = True
    infinity: bool = False  # exponent all ones with mantissa 0 is infinity
    nan: NanEncoding | None = None
    zero: bool = True  # e8m0fnu has no zero: its exponent 0 encodes 2**-127

    @property
    def bits(self) -> int:
        """Width of one value: sign, exponent and mantissa."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def sign(self) -> int:
        """The sign bit (the top bit), 0 for a format without sign."""
        return 1 << (self.exponent_bits + self.mantissa_bits) if self.signed else 0

    @property
    def code_mask(self) -> int:
        """Every bit but the sign."""
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    @property
    def first_nonfinite(self) -> int | None:
        """The smallest non-finite code, when non-finite codes lie above the finite ones."""
        if self.nan == "ieee":
            return ((1 << self.exponent_bits) - 1) << self.mantissa_bits
        if self.nan == "all_ones":
            return self.code_mask
        return None

    @property
    def infinity_code(self) -> int | None:
        return self.first_nonfinite if self.infinity else None

    @property
    def max_finite_code(self) -> int:
        first = self.first_nonfinite
        return self.code_mask if first is None else first - 1

    @property
    def min_normal_code(self) -> int:
        """The smallest code with a normal value: codes below it are zero or subnormal."""
        return 1 << self.mantissa_bits if self.zero else 0

    def value(self, bits: int) -> float:
        """The value of one value's bits, sign included: NaN and infinities as encoded."""
        code, negative = bits & self.code_mask, bool(bits & self.sign)
        first = self.first_nonfinite
        if self.nan == "negative_zero" and bits == self.sign:
            return math.nan
        if first is not None and code >= first:
            if code == self.infinity_code:
                return -math.inf if negative else math.inf
            return math.nan
        magnitude = self.decode(code)
        return -magnitude if negative else magnitude

    def decode(self, code: int) -> float:
        """The exact magnitude of a finite code (as a float64: every format here fits)."""
        return self.decoder()(code)

    def decoder(self) -> Callable[[int], float]:
        """:meth:`decode` with this format's constants bound: for callers that
        decode many codes (the counter, once per tensor)."""
        shift, low = self.mantissa_bits, (1 << self.mantissa_bits) - 1
        implicit, scale = 1 << self.mantissa_bits, -self.bias - self.mantissa_bits
        subnormal = self.zero  # exponent 0 is zero or subnormal, except in e8m0fnu
        ldexp = math.ldexp

        def decode(code: int) -> float:
            exponent = code >> shift
            if exponent == 0 and subnormal:
                return ldexp(code & low, 1 + scale)
            return ldexp(implicit + (code & low), exponent + scale)

        return decode


@dataclass(frozen=True, slots=True)
class DType:
    """One safetensors dtype: its width, kind, and names in numpy and torch."""

    name: str  # the safetensors name
    bits: int  # width of one element; C64 is 64 (two F32 parts)
    kind: Kind
    # numpy / ml_dtypes dtype name of one element (sub-byte ones unpacked, one per byte)
    numpy: str | None
    # torch dtype name (``torch.<name>``); for F4 the packed pair ``float4_e2m1fn_x2``
    torch: str | None
    format: FloatFormat | None = None  # floating dtypes: the layout of one value or part

    @property
    def floating(self) -> bool:
        return self.kind in FLOATING_KINDS

    @property
    def has_nonfinite(self) -> bool:
        """The dtype has a NaN or infinity encoding at all."""
        return self.format is not None and self.format.nan is not None

    @property
    def has_infinity(self) -> bool:
        return self.format is not None and self.format.infinity

    @property
    def max_finite(self) -> float | None:
        """Largest finite magnitude (for C64, of one F32 part); None for non-floating."""
        fmt = self.format
        return None if fmt is None else fmt.decode(fmt.max_finite_code)

    @property
    def min_normal(self) -> float | None:
        """Smallest normal magnitude; None for non-floating."""
        fmt = self.format
        return None if fmt is None else fmt.decode(fmt.min_normal_code)

    @property
    def min_subnormal(self) -> float | None:
        """Smallest subnormal magnitude; None when the dtype has no subnormal values."""
        fmt = self.format
        if fmt is None or not fmt.zero or fmt.mantissa_bits == 0:
            return None
        return fmt.decode(1)

    @property
    def whole_bytes(self) -> int:
        """The fewest bytes that hold whole elements: 3 for F6 (four elements)."""
        return math.lcm(self.bits, 8) // 8

    def nbytes(self, elements: int) -> int | None:
        """Bytes that ``elements`` elements take, or None when not a whole byte count."""
        bits = elements * self.bits
        return bits // 8 if bits % 8 == 0 else None


def _ieee(exponent_bits: int, mantissa_bits: int, bias: int) -> FloatFormat:
    return FloatFormat(exponent_bits, mantissa_bits, bias, infinity=True, nan="ieee")


_F32 = _ieee(8, 23, 127)

DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool", "bool", "bool"),
        DType("U8", 8, "int", "uint8", "uint8"),
        DType("I8", 8, "int", "int8", "int8"),
        DType("U16", 16, "int", "uint16", "uint16"),
        DType("I16", 16, "int", "int16", "int16"),
        DType("U32", 32, "int", "uint32", "uint32"),
        DType("I32", 32, "int", "int32", "int32"),
        DType("U64", 64, "int", "uint64", "uint64"),
        DType("I64", 64, "int", "int64", "int64"),
        DType("F64", 64, "float", "float64", "float64", _ieee(11, 52, 1023)),
        DType("F32", 32, "float", "float32", "float32", _F32),
        DType("F16", 16, "float", "float16", "float16", _ieee(5, 10, 15)),
        DType("BF16", 16, "float", "bfloat16", "bfloat16", _ieee(8, 7, 127)),
        DType("C64", 64, "complex", "complex64", "complex64", _F32),
        DType(
            "F8_E5M2",
            8,
            "float",
            "float8_e5m2",
            "float8_e5m2",
            _ieee(5, 2, 15),
        ),
        DType(
            "F8_E4M3",
            8,
            "float",
            "float8_e4m3fn",
            "float8_e4m3fn",
            FloatFormat(4, 3, 7, nan="all_ones"),
        ),
        DType(
            "F8_E8M0",
            8,
            "float",
            "float8_e8m0fnu",
            "float8_e8m0fnu",
            FloatFormat(8, 0, 127, signed=False, nan="all_ones", zero=False),
        ),
        DType(
            "F8_E4M3FNUZ",
            8,
            "float",
            "float8_e4m3fnuz",
            "float8_e4m3fnuz",
            FloatFormat(4, 3, 8, nan="negative_zero"),
        ),
        DType(
            "F8_E5M2FNUZ",
            8,
            "float",
            "float8_e5m2fnuz",
            "float8_e5m2fnuz",
            FloatFormat(5, 2, 16, nan="negative_zero"),
        ),
        DType("F6_E2M3", 6, "float", "float6_e2m3fn", None, FloatFormat(2, 3, 1)),
        DType("F6_E3M2", 6, "float", "float6_e3m2fn", None, FloatFormat(3, 2, 3)),
        DType("F4", 4, "float", "float4_e2m1fn", "float4_e2m1fn_x2", FloatFormat(2, 1, 1)),
    )
}

# numpy / ml_dtypes dtype name -> safetensors name, for the dtypes numpy stores as
# safetensors does (one element per item; sub-byte ones are packed by the writer).
NUMPY_DTYPES: MappingProxyType[str, str] = MappingProxyType(
    {d.numpy: d.name for d in DTYPES.values() if d.numpy is not None and d.bits % 8 == 0}
)
# torch dtype name (without ``torch.``) -> safetensors name.
TORCH_DTYPES: MappingProxyType[str, str] = MappingProxyType(
    {d.torch: d.name for d in DTYPES.values() if d.torch is not None}
)
# A byte count that is whole elements of every dtype: a chunk of a multiple of it
# never splits an element, whatever the dtype.
WHOLE_ELEMENTS_BYTES: int = math.lcm(*(d.whole_bytes for d in DTYPES.values()))
