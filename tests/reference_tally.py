"""Expected tallies computed by float semantics with numpy: the independent
reference the bit-pattern counting engine is compared against."""

from __future__ import annotations

from typing import Any

import numpy as np

from nanrunbook.records import Extremes
from nanrunbook.tensors.counting import Tally


def reference(values: np.ndarray[Any, Any]) -> Tally:
    """The expected tally of real values (any float dtype), by float semantics."""
    with np.errstate(invalid="ignore"):  # NaN payload casts warn
        as64 = values.astype(np.float64)
    finite = np.isfinite(as64)
    return Tally(
        elements=int(as64.size),
        finite=int(finite.sum()),
        nan=int(np.isnan(as64).sum()),
        posinf=int(np.isposinf(as64).sum()),
        neginf=int(np.isneginf(as64).sum()),
        max_abs=float(np.abs(as64[finite]).max()) if finite.any() else None,
    )


def reference_c64(re: np.ndarray[Any, Any], im: np.ndarray[Any, Any]) -> Tally:
    """Expected C64 tally from the float32 parts, by float semantics (spec section 6)."""
    nan = np.isnan(re) | np.isnan(im)
    inf = ~nan & (np.isinf(re) | np.isinf(im))
    negative = np.where(np.isinf(re), np.signbit(re), np.signbit(im))
    finite = np.isfinite(re) & np.isfinite(im)
    mags = np.concatenate([np.abs(re[finite]), np.abs(im[finite])]).astype(np.float64)
    return Tally(
        elements=int(re.size),
        finite=int(finite.sum()),
        nan=int(nan.sum()),
        posinf=int((inf & ~negative).sum()),
        neginf=int((inf & negative).sum()),
        max_abs=float(mags.max()) if mags.size else None,
    )


def reference_extremes(values: np.ndarray[Any, Any], smallest_normal: float) -> Extremes:
    """Expected finite extremes of real values by float semantics; ``smallest_normal``
    comes from ``ml_dtypes.finfo`` / ``numpy.finfo``, not from nanrunbook's table."""
    with np.errstate(invalid="ignore"):
        as64 = values.astype(np.float64).reshape(-1)
    finite = as64[np.isfinite(as64)]
    mags = np.abs(finite)
    nonzero = mags[mags != 0]
    # -0 orders below +0, as in IEEE 754 totalOrder (numpy's min/max pick either).
    zero_signs = np.signbit(finite[finite == 0])
    low = high = None
    if finite.size:
        low, high = float(finite.min()), float(finite.max())
        if low == 0:
            low = -0.0 if zero_signs.any() else 0.0
        if high == 0:
            high = 0.0 if not zero_signs.all() else -0.0
    return Extremes(
        values=int(finite.size),
        min=low,
        max=high,
        min_nonzero_abs=float(nonzero.min()) if nonzero.size else None,
        zeros=int(np.count_nonzero(finite == 0)),
        subnormals=int(np.count_nonzero(nonzero < smallest_normal)),
    )


def reference_extremes_c64(re: np.ndarray[Any, Any], im: np.ndarray[Any, Any]) -> Extremes:
    """Expected C64 extremes: over the real and imaginary parts of finite elements."""
    finite = np.isfinite(re) & np.isfinite(im)
    parts = np.concatenate([re[finite], im[finite]])
    return reference_extremes(parts, float(np.finfo(np.float32).smallest_normal))
