"""watch's fast path held to its strict one: the line msgspec vouches for is the
record parse_record makes of it, and a file summarised the fast way (runs of
uneventful lines counted at once) is summarised exactly as record by record.
Random lines, valid and not, and random runs: the fast path may decline any
line, but it may never count one differently."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
import telemetry_runs
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from nanrunbook.telemetry.reader import IncompleteLine, TelemetryReader, parse_line
from nanrunbook.telemetry.record import TelemetryRecord, common_line, headroom_bits
from nanrunbook.telemetry.series import Downsampler
from nanrunbook.telemetry.summary import Summariser, WatchSummary
from nanrunbook.telemetry.trend import SlidingTrend
from nanrunbook.telemetry.watch import consume, summarise_file


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return telemetry_runs.write_all(tmp_path_factory.mktemp("runs"))


SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=300)

# ------------------------------------------------------------ random lines

WEIRD: list[Any] = [
    None, 0, -1, 1, 2**63, 2**64, 1.5, 0.0, -0.0, 1e308, True, False, "", "x", "F32",
    [], {}, [1], {"code": "A", "message": "m"}, [{"code": "A", "message": "m"}],
]  # fmt: skip
RAW_WEIRD = [
    b"1e400",
    b"-1e400",
    b"1" + b"0" * 400,
    b"01",
    b"1.",
    b'"\\ud800"',
    b'"\xff"',
    b'"\xc3\xa9"',
    b"NaN",
    b"Infinity",
    b"1E2",
    b"-0",
    b"0e0",
    b'"\\u0000"',
    b"[[[[[[[[]]]]]]]]",
]


def _document(rng: random.Random, step: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    max_abs = rng.choice([None, 0.0, 1e-3, rng.uniform(0.01, 10.0), 6e4])
    dtype = rng.choice(["F32", "F16", "BF16", None])
    headroom = rng.choice([headroom_bits(max_abs, dtype), None, 0.0, 0.5, rng.uniform(0, 140)])
    loss_class = rng.choice(["finite"] * 8 + ["nan", "posinf"])
    skipped = rng.random() < 0.1
    return {
        "format": "nanrunbook-telemetry/1",
        "run_id": rng.choice(["run", "run-2", "é"]),
        "rank": rank,
        "world_size": world,
        "step": step,
        "time": 1.7e9 + step,
        "loss": rng.uniform(0, 5) if loss_class == "finite" else None,
        "loss_class": loss_class,
        "grad": {
            "nan": rng.choice([0] * 9 + [1]),
            "posinf": rng.choice([0] * 9 + [2]),
            "neginf": 0,
            "max_abs": max_abs,
            "dtype": dtype,
            "headroom_bits": headroom,
            "norm": rng.choice([None, 1.25]),
        },
        "update": rng.choice(
            [None, {"nan": 0, "posinf": 0, "neginf": 0, "max_abs": rng.choice([None, 1e-4])}]
        ),
        "scale": rng.choice([None, 1024.0, 2048.0, 512.0]),
        "found_inf": rng.choice([None, False, skipped]),
        "skipped": skipped,
        "held": rng.random() < 0.03,
        "warnings": rng.choice([[]] * 9 + [[{"code": "GRAD_NORM_SPIKE", "message": "m"}]]),
        "bundle": rng.choice([None] * 9 + ["bundles/x", ""]),
    }


def _mutated(rng: random.Random, document: dict[str, Any]) -> bytes:
    """The document as a line, sometimes changed where a parser could differ."""
    document = {**document, "grad": dict(document["grad"])}
    roll = rng.random()
    if roll < 0.15:
        del document[rng.choice(list(document))]
    elif roll < 0.3:
        document[rng.choice(list(document))] = rng.choice(WEIRD)
    elif roll < 0.4:
        document["grad"][rng.choice(list(document["grad"]))] = rng.choice(WEIRD)
    elif roll < 0.5:
        document[rng.choice(["lr", "activations", "extra"])] = rng.choice([None, 0.01, {"a": 1}])
    # json, not orjson: it writes integers past 64 bits too
    raw = json.dumps(document, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()
    roll = rng.random()
    if roll < 0.1:  # a value orjson cannot write: as text
        key = rng.choice([b'"time":', b'"loss":', b'"max_abs":', b'"step":', b'"run_id":'])
        at = raw.find(key)
        if at >= 0:
            end = at + len(key)
            stop = min(i for i in (raw.find(b",", end), raw.find(b"}", end)) if i >= 0)
            raw = raw[:end] + rng.choice(RAW_WEIRD) + raw[stop:]
    elif roll < 0.15:  # a duplicate key, last one wins in orjson
        raw = raw[:-1] + b',"skipped":' + rng.choice([b"false", b"true", b"0"]) + b"}"
    elif roll < 0.2:
        raw = raw[:-1] + b',"zz":' + rng.choice(RAW_WEIRD) + b"}"
    elif roll < 0.25:
        raw = raw[: rng.randrange(len(raw))]
    elif roll < 0.3:
        raw = b" " + raw + b"\r"
    return raw


def _uneventful(record: TelemetryRecord) -> bool:
    return (
        not record.skipped
        and not record.held
        and not record.warnings
        and record.nonfinite_part() is None
        and record.grad.nonfinite == 0
        and (record.update is None or record.update.nonfinite == 0)
    )


@SLOW
@given(st.integers(0, 2**32))
def test_a_line_the_fast_path_takes_is_the_record_parse_record_makes(seed: int) -> None:
    rng = random.Random(seed)
    raw = _mutated(rng, _document(rng, rng.randrange(100), rng.randrange(3), rng.randrange(4)))
    fast = common_line(raw)
    strict = parse_line(1, raw)
    if fast is None:
        return
    assert isinstance(strict, TelemetryRecord), (raw, strict)
    assert _uneventful(strict), raw
    grad = strict.grad
    update = None if strict.update is None else strict.update.max_abs
    assert (
        fast.run_id, fast.rank, fast.world_size, fast.step, fast.time, fast.loss, fast.scale,
        fast.found_inf, fast.bundle, fast.grad.max_abs, fast.grad.dtype, fast.grad.headroom_bits,
        fast.grad.norm, None if fast.update is None else fast.update.max_abs,
    ) == (
        strict.run_id, strict.rank, strict.world_size, strict.step, strict.time, strict.loss,
        strict.scale, strict.found_inf, strict.bundle, grad.max_abs, grad.dtype,
        grad.headroom_bits, grad.norm, update,
    ), raw  # fmt: skip
    for value in (fast.time, fast.loss, fast.scale, fast.grad.max_abs):
        assert value is None or type(value) is float  # not an int: as parse_record makes it


def test_the_fast_path_takes_the_usual_lines(runs: dict[str, Path]) -> None:
    """It declines the eventful ones, not the rest: the healthy run's lines all
    decode the fast way."""
    raws = runs["healthy"].read_bytes().splitlines()
    taken = [raw for raw in raws if common_line(raw) is not None]
    assert len(taken) == len(raws) > 20


# ------------------------------------------------------------ random files


def _strictly(path: Path, since: int | None, window: int) -> WatchSummary:
    """The summary record by record: every line through parse_line and add."""
    summariser = Summariser(str(path), since=since, window=window)
    reader = TelemetryReader(path)
    for item in reader:
        if isinstance(item, IncompleteLine):
            summariser.add_incomplete(item)
        else:
            consume(summariser, item)
    return summariser.summary(lines=reader.lines)


def _headroom(rng: random.Random, count: int) -> list[float | None]:
    """Steady, noisy, falling towards the dtype's max, or unknown."""
    shape = rng.choice(["steady", "noisy", "falling", "none", "mixed"])
    if shape == "none":
        return [None] * count
    base = rng.uniform(1, 130)
    if shape == "steady":
        return [base] * count
    if shape == "falling":
        return [max(0.0, base - i * rng.uniform(0.01, 3)) for i in range(count)]
    noise = [base + rng.gauss(0, rng.choice([0.1, 3, 30])) for _ in range(count)]
    if shape == "mixed":
        return [None if rng.random() < 0.05 else v for v in noise]
    return noise


def _run_lines(rng: random.Random) -> list[bytes]:
    ranks = rng.choice([1, 1, 1, 2, 3])
    count = rng.choice([5, 40, 300, 1500])
    headroom = [_headroom(rng, count) for _ in range(ranks)]
    steps = [rng.randrange(5) for _ in range(ranks)]
    scales = [rng.choice([None, 1024.0]) for _ in range(ranks)]
    # The learning rate and the model's float16 output, as the sentinel appends them.
    lr = rng.choice([None, 0.1, "scheduled"])
    output_bits = rng.choice([None, rng.uniform(0.5, 12)])
    lines = []
    for i in range(count):
        for rank in range(ranks):
            steps[rank] += rng.choice([1] * 30 + [0, 2, -3])
            document = _document(rng, steps[rank], rank, ranks)
            if rng.random() < 0.9:  # mostly uneventful
                document.update(loss=rng.uniform(0, 5), loss_class="finite", skipped=False,
                                held=False, warnings=[], bundle=None)  # fmt: skip
                document["grad"].update(nan=0, posinf=0, neginf=0)
                document["update"] = None
            scale = scales[rank]
            if scale is not None:
                scale = (
                    scale / 2
                    if rng.random() < 0.02
                    else scale * 2
                    if rng.random() < 0.02
                    else scale
                )
                scales[rank] = scale
            document["scale"] = scale if rng.random() < 0.98 else None
            bits = headroom[rank][i]
            document["grad"]["headroom_bits"] = bits
            if bits is not None:
                document["grad"]["max_abs"] = 3.4e38 / 2**bits if bits < 1000 else 1.0
                document["grad"]["dtype"] = "F32"
            if lr is not None:
                document["lr"] = 0.1 * (1 + i % 7) if lr == "scheduled" else lr
            if output_bits is not None and rng.random() < 0.95:
                bits = max(0.0, output_bits + rng.gauss(0, 0.5))
                document["output"] = {
                    "max_abs": 65504.0 / 2**bits, "where": "output", "dtype": "F16",
                    "headroom_bits": bits, "nonfinite": [] if rng.random() < 0.98 else ["output"],
                }  # fmt: skip
            raw = orjson.dumps(document)
            if rng.random() < 0.01:
                raw = _mutated(rng, document)
            lines.append(raw)
    return lines


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(st.integers(0, 2**32))
@example(seed=246)  # a line with headroom_bits under 1 and no max_abs (a TypeError once)
def test_a_file_summarised_the_fast_way_is_summarised_as_record_by_record(
    tmp_path_factory: pytest.TempPathFactory, seed: int
) -> None:
    rng = random.Random(seed)
    path = tmp_path_factory.mktemp("fast") / "telemetry.jsonl"
    lines = _run_lines(rng)
    ending = rng.choice([b"\n", b"", b'\n{"format": "nanrunbook-tel'])
    path.write_bytes(b"\n".join(lines) + ending)
    since = rng.choice([None, None, 3, 200])
    window = rng.choice([8, 9, 50])
    fast = summarise_file(path, since=since, window=window)
    assert fast == _strictly(path, since, window)


def test_the_real_runs_summarise_the_same_both_ways(runs: dict[str, Path]) -> None:
    for run in telemetry_runs.RUNS:
        assert summarise_file(runs[run]) == _strictly(runs[run], None, 50), run
        assert summarise_file(runs[run], window=8) == _strictly(runs[run], None, 8), run


def _plain_document(rng: random.Random, step: int) -> dict[str, Any]:
    """A plain step's line: finite, not held or skipped, no warning, no
    update, its gradients finite with 100 bits of headroom."""
    document = _document(rng, step)
    document.update(loss=1.0, loss_class="finite", skipped=False, held=False, warnings=[],
                    bundle=None, update=None, scale=1024.0)  # fmt: skip
    document["grad"].update(nan=0, posinf=0, neginf=0, headroom_bits=100.0, max_abs=1.0)
    return document


def _fast_as_strictly(path: Path, documents: list[dict[str, Any]]) -> WatchSummary:
    """The lines written to ``path`` and summarised: the fast way took at least
    one run of them whole, and its summary is the record-by-record one."""
    path.write_bytes(b"".join(orjson.dumps(document) + b"\n" for document in documents))
    calls = {"runs": 0}
    original = Summariser.add_lines

    def counted(self: Summariser, run: Any, raw: bytes) -> bool:
        taken = original(self, run, raw)
        calls["runs"] += taken
        return taken

    Summariser.add_lines = counted  # type: ignore[method-assign]
    try:
        fast = summarise_file(path)
    finally:
        Summariser.add_lines = original  # type: ignore[method-assign]
    assert calls["runs"] >= 1
    assert fast == _strictly(path, None, 50)
    return fast


def test_a_long_plain_run_goes_the_run_way_and_a_falling_one_warns_the_same(
    tmp_path: Path,
) -> None:
    """9,080 steps, headroom steady then falling to the dtype's max: the runs
    are counted at once where the trend cannot warn, line by line where it
    might, and the HEADROOM_FALLING tally is the record-by-record one."""
    rng = random.Random(5)
    documents = []
    for step in range(9_080):
        document = _plain_document(rng, step)
        bits = 100.0 + rng.gauss(0, 0.5) if step < 9_000 else 100.0 - (step - 9_000)
        document["grad"]["headroom_bits"] = bits
        documents.append(document)
    fast = _fast_as_strictly(tmp_path / "falling.jsonl", documents)
    codes = {w.code: w for w in fast.warnings}
    assert 9_000 < codes["HEADROOM_FALLING"].first_step < 9_080
    assert fast.headroom is not None and fast.headroom.direction == "falling"


def test_a_plain_float16_run_with_its_lr_goes_the_run_way_and_keeps_both(
    tmp_path: Path,
) -> None:
    """A long plain run whose lines carry the learning rate (scheduled) and the
    model's float16 output creeping towards the max: counted a run at once,
    the lr range, the compute headroom and the series are the record-by-record
    ones."""
    rng = random.Random(7)
    documents = []
    for step in range(3_000):
        document = _plain_document(rng, step)
        document["lr"] = 1e-3 * (1 + (step // 100) % 5)
        bits = 12.0 - step / 300 + rng.gauss(0, 0.1)
        document["output"] = {
            "max_abs": 65504.0 / 2**bits, "where": "output", "dtype": "F16",
            "headroom_bits": bits, "nonfinite": [],
        }  # fmt: skip
        documents.append(document)
    fast = _fast_as_strictly(tmp_path / "fp16.jsonl", documents)
    assert fast.learning_rate is not None and fast.learning_rate.max == pytest.approx(5e-3)
    compute = fast.compute_headroom
    assert compute is not None and compute.dtype == "F16" and compute.step == 2_999
    assert 1.0 < compute.min_bits < 3.0
    assert any(b.compute_headroom_min is not None for b in fast.series)


# ------------------------------------------------------------ the parts


@settings(deadline=None, max_examples=200)
@given(st.integers(0, 2**32))
def test_a_trend_extended_is_the_trend_added_point_by_point_to_the_last_bit(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([2, 3, 8, 50])
    one, many = SlidingTrend(size), SlidingTrend(size)
    step = rng.randrange(100)
    for _ in range(rng.randrange(1, 6)):
        steps, values = [], []
        for _ in range(rng.choice([1, 5, 2 * size, 2 * size + 1, 3 * size + 7, 200])):
            step += rng.choice([1, 1, 2, 0, -3])
            steps.append(step)
            values.append(rng.uniform(-100, 100) * rng.choice([1, 1e-3, 1e6]))
        for point in zip(steps, values, strict=True):
            one.add(*point)
        many.extend(steps, values)
        assert [repr(v) for v in _state(one)] == [repr(v) for v in _state(many)]
        assert one.slope() == many.slope()


def _state(trend: SlidingTrend) -> list[Any]:
    return [trend._origin, *trend.xs, *trend.ys, trend._sx, trend._sxx, trend._sy, trend._sxy]


@settings(deadline=None, max_examples=300)
@given(st.integers(0, 2**32))
def test_the_steepest_bound_holds_for_every_slope_it_covers(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([8, 9, 50, 200])
    trend = SlidingTrend(size)
    step, scale = rng.randrange(10 ** rng.randrange(1, 12)), 10.0 ** rng.randrange(-3, 30)
    for _ in range(rng.randrange(1, 5)):
        steps, values = [], []
        for _ in range(rng.choice([3, 20, 2 * size + 3])):
            step += rng.choice([1, 1, 1, 2, 50])
            steps.append(step)
            values.append(scale * (1 + rng.gauss(0, rng.choice([1e-9, 1e-3, 1]))))
        bound = trend.steepest(steps, values, fewest=8)
        for point in zip(steps, values, strict=True):
            slope = trend.add(*point)
            if len(trend) >= 8 and slope is not None:
                assert abs(slope) <= bound, (slope, bound)
    assert math.isinf(trend.steepest([step, step], [1.0, 1.0], fewest=8))


@settings(deadline=None, max_examples=200)
@given(st.integers(0, 2**32))
def test_a_series_extended_is_the_series_added_record_by_record(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([2, 4, 8, 256])
    one, many = Downsampler(capacity), Downsampler(capacity)
    step = 0
    for _ in range(rng.randrange(1, 8)):
        columns: list[list[Any]] = [[], [], [], [], [], [], [], []]
        for _ in range(rng.choice([1, 3, 17, 100, 1000])):
            step += 1
            row = [
                step,
                rng.choice([0.0, -0.0, rng.uniform(-5, 5)]),
                rng.choice([None, 0.0, -0.0, rng.random()]),
                rng.choice([None, rng.uniform(1, 9)]),
                rng.choice([None, 2.0, -0.0, rng.random()]),
                rng.choice([None, 0.0, rng.uniform(0, 50)]),  # grad norm
                rng.choice([None, 1e-3, rng.random()]),  # lr
                rng.choice([None, 0.0, rng.uniform(0, 15)]),  # compute headroom
            ]
            for column, value in zip(columns, row, strict=True):
                column.append(value)
            one.add(*row[:5], grad_norm=row[5], lr=row[6], compute_headroom=row[7])
        many.extend(*columns)
        assert [[repr(v) for v in b] for b in one._buckets] == [
            [repr(v) for v in b] for b in many._buckets
        ]
        assert one.buckets() == many.buckets()
