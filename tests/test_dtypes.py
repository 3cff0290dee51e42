"""The one dtype table against numpy, ml_dtypes and torch: every fact it carries
or derives (range, encodings, names, widths) agrees with the libraries that
define those dtypes."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from nanrunbook.dtypes import DTYPES, NUMPY_DTYPES, TORCH_DTYPES, WHOLE_ELEMENTS_BYTES
from nanrunbook.tensors.scan import CHUNK_SIZE

FLOATING = sorted(d.name for d in DTYPES.values() if d.floating)


def numpy_type(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def every_value(dtype: str) -> np.ndarray[Any, Any]:
    """Every value a (part of a) dtype can hold, as float64 (F32/F64: a sample)."""
    d = DTYPES[dtype]
    numpy_name = "float32" if d.kind == "complex" else d.numpy
    assert numpy_name is not None
    t = numpy_type(numpy_name)
    if t.itemsize > 2:  # too many: a spread of random patterns, and the specials
        rng = np.random.default_rng(0)
        codes = rng.integers(0, 2 ** (8 * t.itemsize) - 1, 100_000, dtype=f"u{t.itemsize}")
        info = np.finfo(t)
        specials = [np.inf, -np.inf, np.nan, info.max, -info.max, info.smallest_subnormal, -0.0]
        with np.errstate(invalid="ignore"):
            codes = np.concatenate([codes, np.array(specials, dtype=t).view(codes.dtype)])
    else:
        codes = np.arange(1 << (8 * t.itemsize), dtype=f"u{t.itemsize}")
        if d.bits < 8:
            codes = codes[: 1 << d.bits]
    with np.errstate(invalid="ignore", over="ignore"):
        return codes.view(t).astype(np.float64)


@pytest.mark.parametrize("dtype", FLOATING)
def test_range_matches_finfo(dtype: str) -> None:
    d = DTYPES[dtype]
    info = ml_dtypes.finfo(numpy_type("float32" if d.kind == "complex" else str(d.numpy)))
    assert d.max_finite == float(info.max)
    assert d.min_normal == float(info.smallest_normal)
    if dtype == "F8_E8M0":  # no subnormals: finfo repeats the smallest normal value
        assert d.min_subnormal is None
    else:
        assert d.min_subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("dtype", FLOATING)
def test_encodings_match_the_values(dtype: str) -> None:
    d = DTYPES[dtype]
    values = every_value(dtype)
    assert d.has_infinity == bool(np.isinf(values).any())
    assert d.has_nonfinite == bool((~np.isfinite(values)).any())
    assert d.format is not None
    assert d.format.signed == bool(np.signbit(values).any())
    assert d.format.zero == bool((values == 0).any())
    finite = values[np.isfinite(values)]
    assert float(np.abs(finite).max()) == d.max_finite


def test_names_and_widths() -> None:
    for name, safetensors in NUMPY_DTYPES.items():
        assert numpy_type(name).itemsize * 8 == DTYPES[safetensors].bits, name
    for name, safetensors in TORCH_DTYPES.items():
        dtype = getattr(torch, name)
        per_item = 2 if safetensors == "F4" else 1  # float4_e2m1fn_x2: two F4 per byte
        assert torch.empty(0, dtype=dtype).element_size() * 8 == DTYPES[safetensors].bits * per_item
    for d in DTYPES.values():
        if d.numpy is not None:
            assert numpy_type(d.numpy).itemsize * 8 >= d.bits
        assert d.floating == (d.format is not None)
    # Every dtype but F6 (no torch type yet) has a torch name; F4 and F6 are packed.
    assert set(DTYPES) - set(TORCH_DTYPES.values()) == {"F6_E2M3", "F6_E3M2"}
    assert set(DTYPES) - set(NUMPY_DTYPES.values()) == {"F4", "F6_E2M3", "F6_E3M2"}


def test_chunk_size_is_whole_elements_of_every_dtype() -> None:
    for d in DTYPES.values():
        assert (d.whole_bytes * 8) % d.bits == 0 and d.whole_bytes * 8 >= d.bits
        assert WHOLE_ELEMENTS_BYTES % d.whole_bytes == 0
        assert CHUNK_SIZE % d.whole_bytes == 0
    assert WHOLE_ELEMENTS_BYTES == 24
