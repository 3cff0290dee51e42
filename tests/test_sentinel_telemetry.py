"""The framework-free parts of the sentinel: its warnings and its line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanrunbook.capture.telemetry import (
    Alert,
    EarlyWarnings,
    GradTelemetry,
    StepTelemetry,
    TelemetryFile,
    Thresholds,
    headroom_bits,
    loss_class,
    magnitude_alerts,
)


def test_a_spike_is_judged_against_a_sliding_median_not_an_early_maximum() -> None:
    """A norm that drifts up 20x over 200 steps is not a spike (an early-maximum
    rule would fire on it); one step at 20x the recent median is."""
    early = EarlyWarnings(Thresholds(spike_window=50, spike_history=20, spike_ratio=10))
    drifting = [1.0 * 1.015**i for i in range(200)]
    assert not any(early.gradient_norm(n) for n in drifting)
    assert drifting[-1] > 19 * drifting[0]
    [alert] = early.gradient_norm(20 * drifting[-1])
    assert alert.code == "GRAD_NORM_SPIKE" and "median" in alert.message
    # One outlier does not move the median: the next ordinary norm is not a spike.
    assert early.gradient_norm(drifting[-1]) == []


def test_no_spike_is_judged_before_enough_history() -> None:
    early = EarlyWarnings(Thresholds(spike_history=20))
    assert not any(early.gradient_norm(1000.0 if i == 5 else 1.0) for i in range(19))


def test_streaks_and_the_floor() -> None:
    early = EarlyWarnings(Thresholds(backoff_warn=2, skip_warn=2, scale_floor=4.0))
    assert early.scaler(True, 64.0, 32.0) == []
    assert [a.code for a in early.scaler(True, 32.0, 16.0)] == ["LOSS_SCALE_BACKOFF_STREAK"]
    assert early.scaler(False, 16.0, 16.0) == []  # a clean step ends the streak
    assert [a.code for a in early.scaler(True, 4.0, 2.0)] == ["LOSS_SCALE_BELOW_FLOOR"]
    assert early.skipped(True) == [] and len(early.skipped(True)) == 1
    assert early.skipped(False) == []


def test_magnitudes_near_and_at_the_dtype_maximum() -> None:
    assert magnitude_alerts("g", [(1.0, "F16"), (30000.0, "F16")]) == []
    [near] = magnitude_alerts("g", [(40000.0, "F16"), (1.0, "F32")])
    assert near.code == "NEAR_DTYPE_MAX" and "F16" in near.message
    [at] = magnitude_alerts("g", [(65504.0, "F16")])
    assert at.code == "AT_DTYPE_MAX"
    assert magnitude_alerts("g", [(None, "F16"), (5.0, None)]) == []
    assert headroom_bits(65504.0 / 8, "F16") == pytest.approx(3.0)


def test_loss_class_is_the_worst() -> None:
    assert loss_class([1.0, 2.0]) == "finite"
    assert loss_class([1.0, math.inf, -math.inf]) == "posinf"
    assert loss_class([-math.inf, math.nan]) == "nan"


def test_unknown_codes_and_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown warning code"):
        Alert("SOMETHING_NEW", "x")
    with pytest.raises(ValueError, match="spike_ratio"):
        Thresholds(spike_ratio=1.0)
    with pytest.raises(ValueError, match="backoff_hold"):
        Thresholds(backoff_hold=0)


def test_lines_carry_no_nan_and_are_whole(tmp_path: Path) -> None:
    telemetry = TelemetryFile(tmp_path / "deep" / "t.jsonl")
    record = StepTelemetry(
        run_id="r",
        rank=0,
        world_size=1,
        step=1,
        time=1.5,
        loss=math.nan,
        loss_class="nan",
        grad=GradTelemetry(nan=2, max_abs=math.inf, norm=math.nan),
        update=None,
        scale=None,
        found_inf=None,
        skipped=False,
        held=True,
    )
    telemetry.append(record)
    telemetry.append(record)
    telemetry.close()
    text = (tmp_path / "deep" / "t.jsonl").read_text()
    assert text.endswith("\n") and "NaN" not in text and "Infinity" not in text
    first = json.loads(text.splitlines()[0])
    assert (first["loss"], first["grad"]["max_abs"], first["grad"]["norm"]) == (None, None, None)


# ---- the writer's line and the reader's parser are one format ------------------------

_maybe = st.none() | st.floats(allow_nan=True, allow_infinity=True, width=32)
_count = st.integers(0, 2**40)


@settings(max_examples=200, deadline=None)
@given(
    loss=st.floats(allow_nan=True, allow_infinity=True),
    grad_max=_maybe,
    counts=st.tuples(_count, _count, _count),
    scale=_maybe,
    found_inf=st.none() | st.booleans(),
    skipped=st.booleans(),
    held=st.booleans(),
    with_update=st.booleans(),
    headroom_from=st.none() | st.sampled_from(["max_abs", "tensor_norm", "total_norm"]),
    weight_norm=_maybe,
    output_max=_maybe,
    output_nonfinite=st.booleans(),
    reproduced=st.none() | st.sampled_from(["REPRODUCED", "NOT_REPRODUCED"]),
)
def test_every_sentinel_line_reads_back_with_the_watch_parser(
    loss: float,
    grad_max: float | None,
    counts: tuple[int, int, int],
    scale: float | None,
    found_inf: bool | None,
    skipped: bool,
    held: bool,
    with_update: bool,
    headroom_from: Any,
    weight_norm: float | None,
    output_max: float | None,
    output_nonfinite: bool,
    reproduced: str | None,
) -> None:
    import orjson

    from nanrunbook.capture.telemetry import (
        Activations,
        GradTelemetry,
        StepTelemetry,
        UpdateTelemetry,
        headroom_bits,
        loss_class,
    )
    from nanrunbook.telemetry.record import (
        HEADROOM_SOURCES,
        TELEMETRY_FORMAT,
        common_line,
        parse_record,
        record_document,
    )

    nan, posinf, neginf = counts
    line = StepTelemetry(
        run_id="run-1",
        rank=0,
        world_size=1,
        step=7,
        time=1764500000.5,
        loss=loss,
        loss_class=loss_class([loss]),
        grad=GradTelemetry(
            nan, posinf, neginf, grad_max, "F32", headroom_bits(grad_max, "F32"), None
        ),
        update=UpdateTelemetry(0, 0, 0, 1.0) if with_update else None,
        scale=scale,
        found_inf=found_inf,
        skipped=skipped,
        held=held,
        bundle=None,
        reproduced=reproduced,
        grad_headroom_from=headroom_from,
        weight_norm=weight_norm,
        output=None
        if output_max is None
        else Activations(
            output_max if math.isfinite(output_max) else None,
            "output" if math.isfinite(output_max) else None,
            "F16",
            headroom_bits(output_max, "F16"),
            ("output",) if output_nonfinite else (),
        ),
    ).line()
    raw = orjson.dumps(line)
    document = orjson.loads(raw)
    assert document["format"] == TELEMETRY_FORMAT
    record = parse_record(document)
    assert record.step == 7 and record.held is held and record.skipped is skipped
    assert record.loss_class == line["loss_class"]
    assert record.weight_norm == document["weight_norm"]
    assert (record.output is None) is (output_max is None)
    # The reader writes back exactly the fields the writer put in the fixed shape.
    fixed = record_document(record)
    assert {k: v for k, v in document.items() if k in fixed} == fixed
    # The appended fields: last on the line in the order they were added, read by
    # both parsers, one vocabulary.
    assert list(document)[-4:] == ["grad_headroom_from", "weight_norm", "output", "reproduced"]
    assert record.reproduced == document["reproduced"] == reproduced
    assert record.grad_headroom_from == headroom_from
    assert set(HEADROOM_SOURCES) == {"max_abs", "tensor_norm", "total_norm"}
    fast = common_line(raw)
    if fast is not None:
        assert fast.grad_headroom_from == headroom_from


@pytest.mark.parametrize(
    ("source", "said"),
    [("total_norm", "bounded by the total gradient norm"), ("max_abs", None), (None, None)],
)
def test_watch_says_which_bound_a_near_max_headroom_is(source: Any, said: str | None) -> None:
    """watch reads grad_headroom_from: a NEAR_DTYPE_MAX it derives from a
    headroom that is only a bound says so (the values may be further from the
    max than it shows)."""
    from nanrunbook.telemetry.record import GradientStats, TelemetryRecord
    from nanrunbook.telemetry.summary import Summariser

    summariser = Summariser("synthetic")
    grad = GradientStats(0, 0, 0, None, "F16", 0.5, 40000.0)
    record = TelemetryRecord(
        "r", 0, 1, 3, 0.0, 1.0, "finite", grad, None, None, None, False, False, (), None,
        source,
    )  # fmt: skip
    [event] = [e for e in summariser.add(record) if e.code == "NEAR_DTYPE_MAX"]
    assert (said in event.message) if said else "bounded by" not in event.message
