"""Headroom facts and early warnings, end to end through check_bundle, for every
floating dtype, against a reference written here: ml_dtypes/numpy decode the same
bits to floats, ``finfo`` gives each dtype's range, and the thresholds are applied
with exact rational arithmetic."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from fixtures_support import OWNER, binding
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanrunbook
from nanrunbook import WarningThresholds, check_bundle, headroom, report_document
from nanrunbook.capture import BundleWriter, RawTensor
from nanrunbook.verdict.precision import closest_to_limit
from nanrunbook.warning_codes import WARNING_CODES

STAGES = ("input", "forward", "loss", "backward", "optimizer")
COMPUTED = ("input", "forward", "loss")
# safetensors dtype -> the numpy/ml_dtypes type of one value (C64: of one part), bits
TYPES: dict[str, tuple[Any, int]] = {
    "F64": (np.float64, 64),
    "F32": (np.float32, 32),
    "F16": (np.float16, 16),
    "BF16": (ml_dtypes.bfloat16, 16),
    "C64": (np.float32, 64),
    "F8_E5M2": (ml_dtypes.float8_e5m2, 8),
    "F8_E4M3": (ml_dtypes.float8_e4m3fn, 8),
    "F8_E8M0": (ml_dtypes.float8_e8m0fnu, 8),
    "F8_E4M3FNUZ": (ml_dtypes.float8_e4m3fnuz, 8),
    "F8_E5M2FNUZ": (ml_dtypes.float8_e5m2fnuz, 8),
    "F6_E2M3": (ml_dtypes.float6_e2m3fn, 6),
    "F6_E3M2": (ml_dtypes.float6_e3m2fn, 6),
    "F4": (ml_dtypes.float4_e2m1fn, 4),
}
FLOATING = sorted(TYPES)
SCALE = 1024.0


def info(dtype: str) -> Any:
    return ml_dtypes.finfo(TYPES[dtype][0])


# ---- codes and their values, from the libraries -------------------------------------


def code_table(dtype: str) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Bit patterns of one value (all of them for small formats, a spread with every
    special value for F32/F64) and their values as float64."""
    scalar, bits = TYPES[dtype]
    width = np.dtype(scalar).itemsize
    if width <= 2:
        codes = np.arange(1 << (8 * width if bits >= 8 else bits), dtype=f"<u{width}")
    else:
        fi = np.finfo(scalar)
        specials = [0.0, -0.0, fi.max, -fi.max, fi.smallest_normal, fi.smallest_subnormal]
        specials += [np.nextafter(fi.max, 0, dtype=scalar), 1.0, -2.5, np.inf, -np.inf, np.nan]
        specials += [fi.max / 3, -float(fi.smallest_subnormal) * 3, 65504.0, 70354.1, 1e-30]
        rng = np.random.default_rng(len(dtype))
        spread = rng.integers(0, 2 ** (8 * width) - 1, 64, dtype=f"<u{width}")
        with np.errstate(over="ignore"):
            chosen = np.array(specials, dtype=scalar).view(f"<u{width}")
        codes = np.concatenate([chosen, spread])
    with np.errstate(invalid="ignore", over="ignore"):
        return codes, codes.view(scalar).astype(np.float64)


def raw(dtype: str, codes: list[int]) -> RawTensor:
    scalar, bits = TYPES[dtype]
    if bits < 8:  # little-endian bit stream
        stream = sum(code << (i * bits) for i, code in enumerate(codes))
        return RawTensor(dtype, (len(codes),), stream.to_bytes(len(codes) * bits // 8, "little"))
    width = np.dtype(scalar).itemsize
    data = np.array(codes, dtype=f"<u{width}").tobytes()
    return RawTensor(dtype, (len(codes) // 2,) if dtype == "C64" else (len(codes),), data)


def values_of(dtype: str, codes: list[int]) -> tuple[np.ndarray[Any, Any], bool]:
    """The finite values (C64: the parts of finite elements) and whether every element
    is finite, by the libraries' decoding."""
    scalar, _ = TYPES[dtype]
    width = np.dtype(scalar).itemsize
    with np.errstate(invalid="ignore", over="ignore"):
        values = np.array(codes, dtype=f"<u{width}").view(scalar).astype(np.float64)
    if dtype == "C64":
        pairs = values.reshape(-1, 2)
        finite = np.isfinite(pairs).all(axis=1)
        return pairs[finite].reshape(-1), bool(finite.all())
    finite = np.isfinite(values)
    return values[finite], bool(finite.all())


def pick(dtype: str, where: Any, count: int = 1) -> list[int]:
    """``count`` codes whose values satisfy ``where`` (cycling), or [] when none does."""
    codes, values = code_table(dtype)
    with np.errstate(invalid="ignore"):
        chosen = codes[where(values)].tolist()
    return [chosen[i % len(chosen)] for i in range(count)] if chosen else []


# ---- the reference --------------------------------------------------------------------


def reference(stage: str, dtype: str, codes: list[int], compute: str, scaled: bool) -> list[str]:
    """The warning codes the spec'd rules give one tensor, computed independently."""
    finite, all_finite = values_of(dtype, codes)
    found: list[str] = []
    if not finite.size:
        return found
    top = float(np.abs(finite).max())
    if top:
        biggest = float(info(dtype).max)
        if top == biggest:
            found.append("AT_DTYPE_MAX")
        elif Fraction(biggest) < Fraction(top) * 2:
            found.append("NEAR_DTYPE_MAX")
        if stage in COMPUTED and compute != dtype and compute in TYPES:
            limit = float(info(compute).max)
            if top > limit:
                found.append("BEYOND_COMPUTE_DTYPE")
            elif Fraction(limit) < Fraction(top) * 2:
                found.append("NEAR_DTYPE_MAX")
    if stage == "backward" and all_finite:
        small = np.count_nonzero(np.abs(finite) < float(info(dtype).smallest_normal))
        if dtype == "F8_E8M0":
            small = 0  # finfo's smallest_normal is its smallest value: nothing below
        low_precision = TYPES[dtype][1] <= 16 and dtype != "C64"
        all_zero_scaled = scaled and not np.any(finite)
        if all_zero_scaled or (low_precision and small / finite.size > 0.5):
            found.append("GRADIENT_UNDERFLOW")
    return found


# ---- bundles --------------------------------------------------------------------------

Tensor = tuple[str, str, list[int]]  # stage, dtype, codes


def write(tmp: Path, tensors: list[Tensor], compute: str, scaled: bool) -> Path:
    items = binding()
    items["precision"] = {"id": "p", "param_dtype": "F32", "compute_dtype": compute}
    if scaled:
        items["scaler"] = {"id": "static", "mode": "static", "scale": SCALE}
    writer = BundleWriter(
        run_id="run-test",
        step=10,
        incident_owner="ml-oncall",
        binding=items,
        last_known_good={
            "checkpoint_id": "ckpt-9",
            "step": 9,
            "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
        },
    )
    for stage in STAGES:
        mine = [
            (f"{stage}/{i}", raw(d, c), "p") for i, (s, d, c) in enumerate(tensors) if s == stage
        ]
        mine = mine or [(f"{stage}/filler", np.ones(2, dtype="float32"), "p")]
        writer.observe(stage, mine, owner=OWNER, probe_source="p")
    bundle = tmp / f"bundle-{len(list(tmp.iterdir()))}"
    return writer.write(bundle)


def expected_warnings(
    tensors: list[Tensor], compute: str, scaled: bool
) -> list[tuple[str, str, int]]:
    found = []
    for stage in STAGES:
        mine = [(d, c) for s, d, c in tensors if s == stage]
        for index, (dtype, codes) in enumerate(mine):
            found.extend(
                (code, stage, index) for code in reference(stage, dtype, codes, compute, scaled)
            )
    return found


def got_warnings(report: nanrunbook.Report) -> list[tuple[str, str, int]]:
    return [(w.code, w.stage, w.index) for w in report.warnings]


def cases(dtype: str) -> list[Tensor]:
    """One tensor for each warning this dtype can raise (and cannot: checked too)."""
    fi = info(dtype)
    top = float(fi.max)
    normal = float(fi.smallest_normal)
    _, values = code_table(dtype)
    runner_up = float(np.abs(values[np.isfinite(values) & (np.abs(values) < top)]).max())
    two = 2 if dtype == "C64" else 1  # C64: codes are F32 parts, two per element
    return [
        ("forward", dtype, pick(dtype, lambda v: v == top) + pick(dtype, lambda v: v == normal)),
        ("optimizer", dtype, pick(dtype, lambda v: np.abs(v) == runner_up, 2 * two)),
        # backward: mostly zero or subnormal, and all zero (under a loss scale)
        (
            "backward",
            dtype,
            pick(dtype, lambda v: np.abs(v) < normal, 3 * two) + pick(dtype, lambda v: v == 1, two),
        ),
        (
            "backward",
            dtype,
            pick(dtype, lambda v: v == 0, 2 * two) or pick(dtype, lambda v: v == normal, 2 * two),
        ),
        # zeros beside a NaN: the NaN, not underflow, is what this gradient shows
        ("backward", dtype, pick(dtype, lambda v: v == 0, 2 * two) + pick(dtype, np.isnan, two)),
    ]


def compute_cases(compute: str) -> list[Tensor]:
    """F64 inputs beyond, and near, the compute dtype's largest finite value."""
    limit = float(info(compute).max)
    f64 = np.array([limit * 1.25, limit * 0.75, limit, 1.0], dtype=np.float64).view("<u8").tolist()
    if compute == "F64":  # nothing is beyond F64: its first input holds 1.0 only
        f64[0] = f64[-1]
    return [
        ("input", "F64", f64[:1] + f64[-1:]),
        ("input", "F64", f64[1:2]),
        ("loss", "F64", f64[2:3]),
    ]


@pytest.mark.parametrize("dtype", FLOATING)
def test_every_warning_for_every_floating_dtype(tmp_path: Path, dtype: str) -> None:
    tensors = [t for t in cases(dtype) + compute_cases(dtype) if t[2]]
    tensors = [(s, d, c[: len(c) - len(c) % 2]) if d == "C64" else (s, d, c) for s, d, c in tensors]
    if TYPES[dtype][1] == 6:  # F6 stores whole groups of four
        tensors = [
            (s, d, (c * 4)[: 4 * max(1, len(c) // 4)]) if d == dtype else (s, d, c)
            for s, d, c in tensors
        ]
    if dtype == "F4":
        tensors = [
            (s, d, c + c[-1:] if len(c) % 2 else c) if d == dtype else (s, d, c)
            for s, d, c in tensors
        ]
    report = check_bundle(write(tmp_path, tensors, compute=dtype, scaled=True))
    expected = expected_warnings(tensors, dtype, scaled=True)
    assert got_warnings(report) == expected
    assert {w.code for w in report.warnings} <= set(CHECK_CODES)
    # What the reference says, spelled out: each code fires where this dtype allows it.
    assert ("AT_DTYPE_MAX", "forward", 0) in expected
    # e8m0 has no zero, and its value below 2**127 is 2**126, exactly 1 bit below.
    e8m0 = dtype == "F8_E8M0"
    assert (("NEAR_DTYPE_MAX", "optimizer", 0) in expected) != e8m0
    assert (("GRADIENT_UNDERFLOW", "backward", 1) in expected) != e8m0  # all zero, scaled
    low_precision = dtype not in ("F32", "F64", "C64") and not e8m0
    assert (("GRADIENT_UNDERFLOW", "backward", 0) in expected) == low_precision
    has_nan = TYPES[dtype][1] >= 8  # F4 and F6 have no NaN: their tensor 2 is all zero
    assert (("GRADIENT_UNDERFLOW", "backward", 2) in expected) != has_nan
    assert (("BEYOND_COMPUTE_DTYPE", "input", 0) in expected) == (dtype != "F64")
    assert ("NEAR_DTYPE_MAX", "input", 1) in expected  # 0.75 x the compute maximum


@pytest.mark.parametrize("dtype", FLOATING)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_tensors_match_the_reference(
    tmp_path: Path, dtype: str, data: st.DataObject
) -> None:
    codes, _ = code_table(dtype)
    group = {"C64": 2, "F4": 2, "F6_E2M3": 4, "F6_E3M2": 4}.get(dtype, 1)
    picked = data.draw(st.lists(st.integers(0, codes.size - 1), min_size=1, max_size=12))
    chosen = [int(codes[i]) for i in picked]
    chosen = (chosen * group)[: group * max(1, len(chosen) // group)]
    stage = data.draw(st.sampled_from(STAGES))
    compute = data.draw(st.sampled_from([*FLOATING, "I32"]))
    scaled = data.draw(st.booleans())
    tensors = [(stage, dtype, chosen)]
    report = check_bundle(write(tmp_path, tensors, compute=compute, scaled=scaled))
    assert got_warnings(report) == expected_warnings(tensors, compute, scaled)


# ---- the named cases of the issue -------------------------------------------------------


def test_f16_value_of_exactly_65504_is_at_dtype_max(tmp_path: Path) -> None:
    codes = np.array([65504.0, -3.0, 0.5], dtype="<f2").view("<u2").tolist()
    report = check_bundle(write(tmp_path, [("forward", "F16", codes)], compute="F16", scaled=False))
    (warning,) = report.warnings
    assert (warning.code, warning.stage, warning.tensor, warning.index) == (
        "AT_DTYPE_MAX",
        "forward",
        "forward/0",
        0,
    )
    assert "65504" in warning.message and "F16" in warning.message
    assert report.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS" and report.exit_code == 0


def test_warnings_never_change_the_decision_or_exit_code(tmp_path: Path) -> None:
    f16 = np.array([65504.0, np.inf], dtype="<f2").view("<u2").tolist()
    bundle = write(tmp_path, [("forward", "F16", f16)], compute="F16", scaled=False)
    loud = check_bundle(bundle)
    quiet = check_bundle(bundle, thresholds=WarningThresholds(near_max_bits=0, underflow_share=1))
    assert [w.code for w in loud.warnings] == ["AT_DTYPE_MAX"]
    assert (loud.decision, loud.exit_code) == (quiet.decision, quiet.exit_code)
    assert loud.decision.decision == "HOLD"


def test_thresholds_are_settable_and_checked(tmp_path: Path) -> None:
    # 40000 is 0.71 bits below 65504: near under 1 bit, not under 0.5.
    codes = np.array([40000.0, 1.0], dtype="<f2").view("<u2").tolist()
    grads = np.array([0.0, 0.0, 1e-6, 1.0], dtype="<f2").view("<u2").tolist()
    tensors = [("optimizer", "F16", codes), ("backward", "F16", grads)]
    bundle = write(tmp_path, tensors, compute="F32", scaled=False)
    assert [w.code for w in check_bundle(bundle).warnings] == [
        "GRADIENT_UNDERFLOW",
        "NEAR_DTYPE_MAX",
    ]
    strict = WarningThresholds(near_max_bits=0.5, underflow_share=0.75)
    assert check_bundle(bundle, thresholds=strict).warnings == ()
    only_bf16 = WarningThresholds(underflow_dtypes=frozenset({"BF16"}))
    assert [w.code for w in check_bundle(bundle, thresholds=only_bf16).warnings] == [
        "NEAR_DTYPE_MAX"
    ]
    for bad in ({"near_max_bits": -1}, {"near_max_bits": math.inf}, {"underflow_share": 1.5}):
        with pytest.raises(ValueError):
            WarningThresholds(**bad)
    with pytest.raises(ValueError, match="I32"):
        WarningThresholds(underflow_dtypes=frozenset({"I32"}))


CHECK_CODES = ("AT_DTYPE_MAX", "NEAR_DTYPE_MAX", "BEYOND_COMPUTE_DTYPE", "GRADIENT_UNDERFLOW")


def test_codes_are_declared_and_documented() -> None:
    """The check's warning codes are in the one catalogue (which also holds the
    telemetry's) and each is described, with its threshold's default, in WARNINGS."""
    assert set(CHECK_CODES) <= set(WARNING_CODES)
    page = (Path(__file__).resolve().parent.parent / "man" / "nanrunbook.1").read_text()
    section = page.split(".SH WARNINGS\n", 1)[1].split("\n.SH ", 1)[0]
    documented = re.findall(r"^\.TP\n\.B (\S+)$", section, re.MULTILINE)
    assert set(CHECK_CODES) <= set(documented)
    for default in ("near_max_bits", "(default 1)", "underflow_share", "(default 0.5)"):
        assert default in section


# ---- headroom facts ---------------------------------------------------------------------


def test_headroom_facts_in_the_compute_dtype(tmp_path: Path) -> None:
    values = np.array([70354.1, -12.5, 3e-6, 0.0], dtype="<f4")
    tensors = [("input", "F32", values.view("<u4").tolist())]
    report = check_bundle(write(tmp_path, tensors, compute="F16", scaled=False))
    room = next(h for h in headroom(report) if h.stage == "input" and h.index == 0)
    assert (room.tensor, room.dtype, room.counts.finite) == ("input/0", "F32", 4)
    top = float(np.float32(70354.1))
    assert room.own.bits == math.log2(float(np.finfo(np.float32).max)) - math.log2(top)
    compute = room.compute
    assert compute is not None and compute.dtype == "F16" and compute.max_finite == 65504.0
    assert compute.bits is not None and compute.bits < 0
    assert compute.exp_limit == math.log(65504) and compute.square_limit == math.sqrt(65504)
    assert compute.reciprocal_limit == 1 / 65504
    assert compute.exp_overflows and compute.square_overflows and compute.sum_can_overflow
    assert compute.reciprocal_overflows  # 3e-6 < 1/65504
    assert not room.own.exp_overflows or top > math.log(float(np.finfo(np.float32).max))
    # No compute headroom outside the stages computed in the compute dtype.
    assert all(h.compute is None for h in headroom(report) if h.stage not in COMPUTED)


def test_json_document_carries_extremes_headroom_and_warnings(tmp_path: Path) -> None:
    codes = np.array([65504.0, -0.0, 6e-8], dtype="<f2").view("<u2").tolist()
    report = check_bundle(write(tmp_path, [("forward", "F16", codes)], compute="F16", scaled=False))
    document = report_document(report)
    tensor = document["stages"][1]["tensors"][0]
    assert tensor["extremes"] == {
        "values": 3,
        "min": -0.0,
        "max": 65504.0,
        "max_abs": 65504.0,
        "min_nonzero_abs": float(np.float16(6e-8)),
        "zeros": 1,
        "subnormals": 1,
    }
    assert (
        tensor["headroom"]["own"]["bits"] == 0.0 and tensor["headroom"]["compute"]["dtype"] == "F16"
    )
    assert document["warnings"] == [
        {
            "code": "AT_DTYPE_MAX",
            "stage": "forward",
            "tensor": "forward/0",
            "index": 0,
            "message": report.warnings[0].message,
        }
    ]
    filler = document["stages"][0]["tensors"][0]
    assert filler["extremes"]["max"] == 1.0 and filler["headroom"]["compute"]["dtype"] == "F16"


def brute_closest(report: nanrunbook.Report, stages: set[str]) -> Any:
    """Every tensor's headroom to every limit, the least first; the first on a tie."""
    best = None
    for room in headroom(report):
        if room.stage not in stages:
            continue
        for limit in (room.own, room.compute):
            if limit is None or limit.bits is None:
                continue
            if best is None or limit.bits < best[1].bits:
                best = (room, limit)
    return best


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_closest_to_limit_is_the_least_headroom_of_all(tmp_path: Path, data: st.DataObject) -> None:
    # Ties included: a few codes of a few dtypes, drawn again and again.
    dtypes = ["F16", "BF16", "F32", "F8_E4M3"]
    tensors: list[Tensor] = []
    for _ in range(data.draw(st.integers(1, 8))):
        dtype = data.draw(st.sampled_from(dtypes))
        codes, values = code_table(dtype) if dtype != "F32" else (None, None)
        if codes is None:
            pool = np.array([1.0, 2.0, 65504.0, 3e38], dtype="<f4").view("<u4").tolist()
        else:
            finite = np.isfinite(values)
            pool = [int(c) for c in codes[finite][:: max(1, int(finite.sum()) // 6)]]
        chosen = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))
        tensors.append((data.draw(st.sampled_from(STAGES)), dtype, chosen))
    compute = data.draw(st.sampled_from(dtypes))
    report = check_bundle(write(tmp_path, tensors, compute=compute, scaled=False))
    for stages in ({"input"}, {"input", "forward"}, set(STAGES)):
        assert closest_to_limit(report, stages) == brute_closest(report, stages)
