"""The safetensors dtypes: element width, kind and largest finite value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DTYPES", "FLOATING_KINDS", "DType"]

Kind = Literal["bool", "int", "float", "complex"]
FLOATING_KINDS: frozenset[str] = frozenset({"float", "complex"})


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    bits: int  # width of one element; C64 is 64 (two F32 parts)
    kind: Kind
    # Largest finite magnitude (for C64, of one F32 part); None for non-floating.
    max_finite: float | None
    has_nonfinite: bool  # has a NaN or infinity encoding at all

    @property
    def floating(self) -> bool:
        return self.kind in FLOATING_KINDS

    def nbytes(self, elements: int) -> int | None:
        """Bytes that ``elements`` elements take, or None when not a whole byte count."""
        bits = elements * self.bits
        return bits // 8 if bits % 8 == 0 else None


_F32_MAX = 3.4028234663852886e38

DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool", None, False),
        DType("U8", 8, "int", None, False),
        DType("I8", 8, "int", None, False),
        DType("U16", 16, "int", None, False),
        DType("I16", 16, "int", None, False),
        DType("U32", 32, "int", None, False),
        DType("I32", 32, "int", None, False),
        DType("U64", 64, "int", None, False),
        DType("I64", 64, "int", None, False),
        DType("F64", 64, "float", 1.7976931348623157e308, True),
        DType("F32", 32, "float", _F32_MAX, True),
        DType("F16", 16, "float", 65504.0, True),
        DType("BF16", 16, "float", 3.3895313892515355e38, True),
        DType("C64", 64, "complex", _F32_MAX, True),
        DType("F8_E5M2", 8, "float", 57344.0, True),
        DType("F8_E4M3", 8, "float", 448.0, True),
        DType("F8_E8M0", 8, "float", 2.0**127, True),
        DType("F8_E4M3FNUZ", 8, "float", 240.0, True),
        DType("F8_E5M2FNUZ", 8, "float", 57344.0, True),
        DType("F6_E2M3", 6, "float", 7.5, False),
        DType("F6_E3M2", 6, "float", 28.0, False),
        DType("F4", 4, "float", 6.0, False),
    )
}
