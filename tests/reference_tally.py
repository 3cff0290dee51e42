"""Expected tallies computed by float semantics with numpy: the independent
reference the bit-pattern counting engine is compared against."""

from __future__ import annotations

from typing import Any

import numpy as np

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
