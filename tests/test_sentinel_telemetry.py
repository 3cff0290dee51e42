"""The framework-free parts of the sentinel: its warnings and its line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanrunbook.capture.telemetry import (
    EarlyWarnings,
    TelemetryFile,
    Thresholds,
    alert,
    finite_or_none,
    headroom_bits,
    loss_class,
    magnitude_alerts,
)
from nanrunbook.telemetry.record import (
    ActivationStats,
    GradientStats,
    TelemetryRecord,
    UpdateStats,
    parse_record,
    record_line,
)

# The fields appended to the line after its fixed shape, in the order they were added.
APPENDED_KEYS = ["activations", "lr", "grad_headroom_from", "weight_norm", "output", "reproduced"]


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
        alert("SOMETHING_NEW", "x")
    with pytest.raises(ValueError, match="spike_ratio"):
        Thresholds(spike_ratio=1.0)
    with pytest.raises(ValueError, match="backoff_hold"):
        Thresholds(backoff_hold=0)


def test_lines_carry_no_nan_and_are_whole(tmp_path: Path) -> None:
    """The sentinel records a non-finite number as unknown (null); a record the
    serialiser refuses is a lost line, counted, never an error in the loop."""
    telemetry = TelemetryFile(tmp_path / "deep" / "t.jsonl")
    grad = GradientStats(nan=2, max_abs=finite_or_none(math.inf), norm=finite_or_none(math.nan))
    record = TelemetryRecord(
        run_id="r",
        rank=0,
        world_size=1,
        step=1,
        time=1.5,
        loss=None,
        loss_class="nan",
        grad=grad,
        update=None,
        scale=None,
        found_inf=None,
        skipped=False,
        held=True,
        warnings=(),
        bundle=None,
    )
    telemetry.append(record)
    telemetry.append(record)
    telemetry.append(replace(record, step=2, scale=math.inf))  # refused: counted as lost
    assert telemetry.lost is not None and telemetry.lost.lines == 1
    telemetry.append(replace(record, step=3))
    telemetry.close()
    text = (tmp_path / "deep" / "t.jsonl").read_text()
    assert text.endswith("\n") and "NaN" not in text and "Infinity" not in text
    first = json.loads(text.splitlines()[0])
    assert (first["loss"], first["grad"]["max_abs"], first["grad"]["norm"]) == (None, None, None)
    last = json.loads(text.splitlines()[-1])
    assert last["step"] == 3 and last["warnings"][0]["code"] == "TELEMETRY_LINES_LOST"


def full_record() -> TelemetryRecord:
    """A record with every field of the line set, as the sentinel builds one."""
    return TelemetryRecord(
        run_id="run-1",
        rank=1,
        world_size=2,
        step=7,
        time=1764500000.5,
        loss=2.5,
        loss_class="finite",
        grad=GradientStats(0, 0, 0, 3.0, "F32", 126.5, 4.0),
        update=UpdateStats(0, 0, 0, 0.25),
        scale=65536.0,
        found_inf=False,
        skipped=False,
        held=False,
        warnings=(alert("NEAR_DTYPE_MAX", "m"),),
        bundle="incident/run-1/7",
        activations=ActivationStats(60000.0, "act/fc1", "F16", 0.125, ("act/fc2",)),
        lr=0.001,
        grad_headroom_from="max_abs",
        weight_norm=12.0,
        output=ActivationStats(1000.0, "output", "F16", 6.0, ()),
        reproduced="NOT_REPRODUCED",
    )


def test_the_line_is_the_one_the_sentinel_wrote_before() -> None:
    """The one serialiser writes the bytes the sentinel's own line writer
    (``StepTelemetry.line()``, before the records were one) wrote for this
    record: its keys, their order, the nested objects' keys, every field set
    (and ``reproduced``, appended since)."""
    expected = (
        b'{"format":"nanrunbook-telemetry/1","run_id":"run-1","rank":1,"world_size":2,'
        b'"step":7,"time":1764500000.5,"loss":2.5,"loss_class":"finite",'
        b'"grad":{"nan":0,"posinf":0,"neginf":0,"max_abs":3.0,"dtype":"F32",'
        b'"headroom_bits":126.5,"norm":4.0},'
        b'"update":{"nan":0,"posinf":0,"neginf":0,"max_abs":0.25},"scale":65536.0,'
        b'"found_inf":false,"skipped":false,"held":false,'
        b'"warnings":[{"code":"NEAR_DTYPE_MAX","message":"m"}],"bundle":"incident/run-1/7",'
        b'"activations":{"max_abs":60000.0,"where":"act/fc1","dtype":"F16",'
        b'"headroom_bits":0.125,"nonfinite":["act/fc2"]},"lr":0.001,'
        b'"grad_headroom_from":"max_abs","weight_norm":12.0,'
        b'"output":{"max_abs":1000.0,"where":"output","dtype":"F16","headroom_bits":6.0,'
        b'"nonfinite":[]},"reproduced":"NOT_REPRODUCED"}\n'
    )
    assert record_line(full_record()) == expected


def test_a_record_round_trips_whole() -> None:
    """What the writer writes, the reader reads back: every field, activations
    and lr included (the reader used to drop both)."""
    import orjson

    record = full_record()
    back = parse_record(orjson.loads(record_line(record)))
    assert back == record
    assert back.activations is not None and back.activations.where == "act/fc1"
    assert back.lr == 0.001
    sparse = replace(record, activations=None, lr=None, output=None, warnings=())
    assert parse_record(orjson.loads(record_line(sparse))) == sparse


def test_the_record_fields_are_the_line_keys_in_order() -> None:
    from dataclasses import fields

    from nanrunbook.telemetry.record import record_document

    document = record_document(full_record())
    assert list(document) == ["format", *(f.name for f in fields(TelemetryRecord))]


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

    from nanrunbook.telemetry.record import (
        HEADROOM_SOURCES,
        TELEMETRY_FORMAT,
        common_line,
        record_document,
    )

    nan, posinf, neginf = counts
    grad_max = finite_or_none(grad_max)
    written = TelemetryRecord(
        run_id="run-1",
        rank=0,
        world_size=1,
        step=7,
        time=1764500000.5,
        loss=finite_or_none(loss),
        loss_class=loss_class([loss]),
        grad=GradientStats(
            nan, posinf, neginf, grad_max, "F32", headroom_bits(grad_max, "F32"), None
        ),
        update=UpdateStats(0, 0, 0, 1.0) if with_update else None,
        scale=finite_or_none(scale),
        found_inf=found_inf,
        skipped=skipped,
        held=held,
        warnings=(),
        bundle=None,
        reproduced=reproduced,
        grad_headroom_from=headroom_from,
        weight_norm=finite_or_none(weight_norm),
        output=None
        if output_max is None
        else ActivationStats(
            output_max if math.isfinite(output_max) else None,
            "output" if math.isfinite(output_max) else None,
            "F16",
            headroom_bits(output_max, "F16"),
            ("output",) if output_nonfinite else (),
        ),
    )
    raw = record_line(written)[:-1]
    line = orjson.loads(raw)
    document = line
    assert document["format"] == TELEMETRY_FORMAT
    record = parse_record(document)
    assert record == written  # nothing dropped
    assert record.step == 7 and record.held is held and record.skipped is skipped
    assert record.loss_class == line["loss_class"]
    assert record.weight_norm == document["weight_norm"]
    assert (record.output is None) is (output_max is None)
    # The reader writes back exactly the fields the writer put in the fixed shape.
    fixed = record_document(record)
    assert {k: v for k, v in document.items() if k in fixed} == fixed
    # The appended fields: last on the line in the order they were added, read by
    # both parsers, one vocabulary.
    assert list(document)[-len(APPENDED_KEYS) :] == APPENDED_KEYS
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
    from nanrunbook.telemetry.summary import Summariser

    summariser = Summariser("synthetic")
    grad = GradientStats(0, 0, 0, None, "F16", 0.5, 40000.0)
    record = TelemetryRecord(
        "r", 0, 1, 3, 0.0, 1.0, "finite", grad, None, None, None, False, False, (), None,
        source,
    )  # fmt: skip
    [event] = [e for e in summariser.add(record) if e.code == "NEAR_DTYPE_MAX"]
    assert (said in event.message) if said else "bounded by" not in event.message


def test_every_line_a_real_sentinel_writes_reads_back_whole(tmp_path: Path) -> None:
    """A real float16-autocast run under the sentinel (sampled activations, the
    output extreme every step, lr, warnings, a hold): every line it wrote is
    what the reader's record writes back, byte for byte."""
    import orjson
    from warning_runs import run

    outcome = run("activations_fp16", tmp_path)
    raws = outcome.telemetry.read_bytes().splitlines()
    records = [parse_record(orjson.loads(raw)) for raw in raws]
    assert [record_line(r) for r in records] == [raw + b"\n" for raw in raws]
    assert any(r.activations is not None and r.activations.where for r in records)
    assert all(r.lr is not None for r in records) and any(r.held for r in records)
