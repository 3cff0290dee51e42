"""Early warnings from the first few steps, on real CPU runs (tests/warning_runs.py,
shared with bench/bench_warnings.py): through the sentinel and through watch on
the telemetry it wrote, and on the same file with its warnings taken off (a file
from an older sentinel)."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import torch
import warning_runs
from torch import nn

from nanrunbook.capture.torch import Sentinel, Thresholds
from nanrunbook.telemetry import summarise_file

DIVERGING = [n for n, (diverging, _) in warning_runs.RUNS.items() if diverging]
HEALTHY = [n for n, (diverging, _) in warning_runs.RUNS.items() if not diverging]
DERIVED = {"LOSS_DIVERGENCE", "GRAD_NORM_DIVERGENCE", "WEIGHT_NORM_GROWTH", "NEAR_DTYPE_MAX"}


@pytest.mark.parametrize("name", DIVERGING)
def test_a_diverging_run_warns_by_a_step_after_its_onset(name: str, tmp_path: Path) -> None:
    outcome = warning_runs.run(name, tmp_path)
    onset = outcome.onset
    assert onset is not None, "the run does not diverge as built"
    early = [w for w in outcome.warnings() if w[1] in warning_runs.EARLY_CODES]
    assert early, f"no early warning; the lines carry {outcome.warnings()}"
    step, code, message = early[0]
    assert step <= onset + 1
    if outcome.first_nonfinite is not None:
        assert step < outcome.first_nonfinite
    if code in ("LOSS_DIVERGENCE", "GRAD_NORM_DIVERGENCE", "WEIGHT_NORM_GROWTH"):
        # signal and value, the statistics compared with, where the trend began
        assert "running minimum" in message and "above the median" in message
        assert "rising since step" in message
    assert outcome.telemetry is not None
    watched = summarise_file(outcome.telemetry)
    assert watched.first_warning_step is not None and watched.first_warning_step <= onset + 1
    older = summarise_file(warning_runs.stripped(outcome.telemetry))
    derived = [w for w in older.warnings if w.source == "watch" and w.code in DERIVED]
    assert derived and min(w.first_step for w in derived) <= onset + 1


@pytest.mark.parametrize("name", HEALTHY)
def test_a_healthy_run_gets_no_warning(name: str, tmp_path: Path) -> None:
    outcome = warning_runs.run(name, tmp_path)
    assert outcome.onset is None and outcome.first_nonfinite is None
    assert outcome.warnings() == []
    assert outcome.telemetry is not None
    lines = outcome.lines()
    assert all(line["weight_norm"] is not None for line in lines if line["update"] is not None)
    assert summarise_file(outcome.telemetry).warnings == ()
    assert summarise_file(warning_runs.stripped(outcome.telemetry)).warnings == ()


def test_the_probing_run_really_probes_and_the_output_is_read_every_step(
    tmp_path: Path,
) -> None:
    lines = warning_runs.run("gradscaler_probing", tmp_path).lines()
    assert sum(line["found_inf"] is True for line in lines) >= 2  # backoffs happened
    assert all(line["output"]["dtype"] == "F16" for line in lines)  # every step, not sampled


def test_watch_fast_path_derives_what_record_by_record_does(tmp_path: Path) -> None:
    from nanrunbook.telemetry import Summariser, parse_record

    outcome = warning_runs.run("weight_growth", tmp_path)
    assert outcome.telemetry is not None
    older = warning_runs.stripped(outcome.telemetry)
    fast = summarise_file(older)
    slow = Summariser(str(older))
    for raw in older.read_bytes().splitlines():
        slow.add(parse_record(orjson.loads(raw)))
    tallies = [(w.code, w.count, w.first_step, w.message) for w in fast.warnings]
    assert tallies == [(w.code, w.count, w.first_step, w.message) for w in slow.summary().warnings]
    assert any(code == "WEIGHT_NORM_GROWTH" for code, *_ in tallies)


# ------------------------------------------------------------ the detector


def test_a_fast_drop_never_warns_a_rise_above_the_minimum_does() -> None:
    from nanrunbook.telemetry._early import DEFAULT_LIMITS, Divergence

    detector = Divergence(DEFAULT_LIMITS["loss"])
    drop = [2500.0, 900.0, 80.0, 12.0, 9.0, 10.0, 8.5, 9.5, 9.0, 8.8, 9.2]
    for step, value in enumerate(drop, start=1):
        assert detector.add(step, value) is None
    rise = detector.add(12, 90.0)
    assert rise is not None and rise.minimum == 8.5 and rise.minimum_step == 7
    assert rise.began == 10 and rise.seen == 11 and rise.median == pytest.approx(9.5)
    assert "10.6x its running minimum 8.5 (step 7)" in rise.describe("loss")


def test_noise_needs_a_larger_rise_and_the_minimum_count_is_kept() -> None:
    from nanrunbook.telemetry._early import DEFAULT_LIMITS, Divergence

    noisy = Divergence(DEFAULT_LIMITS["grad_norm"])
    for step, value in enumerate([1.0, 30.0, 0.5, 40.0, 1.0, 25.0, 0.8, 35.0], start=1):
        noisy.add(step, value)
    assert noisy.add(9, 45.0) is None  # 90x the minimum, within the signal's own spread
    early = Divergence(DEFAULT_LIMITS["grad_norm"])
    assert early.add(1, 1.0) is None and early.add(2, 1.1) is None
    assert early.add(3, 1000.0) is None  # two values seen: fewer than min_steps
    quiet = Divergence(DEFAULT_LIMITS["grad_norm"])
    for step, value in enumerate([1.0, 1.1, 1.0], start=1):
        quiet.add(step, value)
    assert quiet.add(4, 1000.0) is not None  # from the fourth step on
    for value in (0.0, -1.0, math.inf, math.nan, None):
        assert quiet.add(5, value) is None  # not fed: log space, finite


def _periodic(period: int, blow_up_at: int | None = None) -> list[float]:
    """A fast early drop, then a smooth loss cycling 2.2x up and down every
    ``period`` steps; from ``blow_up_at`` on, 3x a step on top."""
    values = []
    for t in range(1, 481):
        value = 10 * math.exp(-t / 10) + math.exp(0.8 * math.sin(2 * math.pi * t / period))
        if blow_up_at is not None and t >= blow_up_at:
            value *= 3.0 ** (t - blow_up_at + 1)
        values.append(value)
    return values


@pytest.mark.parametrize("period", [40, 80, 120])
def test_a_smooth_periodic_loss_warns_at_most_on_its_first_rise(period: int) -> None:
    """Once the loss has come back from a cycle, a rise no higher than that
    cycle is quiet (the old rule warned on the rise of every cycle but the
    first); a blow-up out of the cycle still warns at once."""
    from nanrunbook.telemetry._early import DEFAULT_LIMITS, Divergence

    detector = Divergence(DEFAULT_LIMITS["loss"])
    warned = [t for t, v in enumerate(_periodic(period), 1) if detector.add(t, v)]
    assert all(t <= 3 * period for t in warned), warned  # the first rise after the drop only
    assert detector.bump > math.log(4)  # the cycle, measured: more than the 4x ratio
    blowing = Divergence(DEFAULT_LIMITS["loss"])
    warned = [t for t, v in enumerate(_periodic(period, 400), 1) if blowing.add(t, v)]
    assert min(t for t in warned if t > 3 * period) in (400, 401)


def test_a_healthy_periodic_run_is_quiet_once_it_has_cycled(tmp_path: Path) -> None:
    """A real run whose loss cycles every epoch (tests/warning_runs.py,
    periodic_noise): through the sentinel and watch, no warning after the
    first epoch's rise (the old rule warned again in the third epoch)."""
    outcome = warning_runs.run("periodic_noise", tmp_path)
    losses = [v for v in outcome.losses if v is not None]
    third = losses[2 * warning_runs.PERIOD :]
    assert max(third) / min(third) > 4  # each cycle rises more than the 4x ratio
    late = [(s, c) for s, c, _ in outcome.warnings() if s > 2 * warning_runs.PERIOD]
    assert late == [] and outcome.first_nonfinite is None
    assert outcome.telemetry is not None
    summary = summarise_file(warning_runs.stripped(outcome.telemetry))
    assert all(w.last_step <= 2 * warning_runs.PERIOD for w in summary.warnings), summary.warnings


def test_thresholds_hold_the_divergence_limits() -> None:
    limits = Thresholds(loss_ratio=3.0, divergence_min_steps=5).divergence_limits()
    assert limits["loss"].ratio == 3.0 and limits["grad_norm"].min_steps == 5
    with pytest.raises(ValueError, match="ratio"):
        Thresholds(grad_norm_ratio=1.0)
    with pytest.raises(ValueError, match="min_steps"):
        Thresholds(divergence_min_steps=0)


# ----------------------------------------------- a norm beyond float32, gradients finite


def test_a_gradient_norm_that_overflows_float32_is_a_warning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def compute_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return (model(batch) * 1e19).sum()  # gradients ~1e19: finite, their squares not

    telemetry = tmp_path / "t.jsonl"
    sentinel = Sentinel(
        model,
        optimizer,
        compute_loss,
        run_id="norm",
        checkpoint={"id": "c", "verified_together": warning_runs.PARTS},
        data={"id": "d"},
        objective={"id": "o", "reduction": "sum"},
        incident_dir=tmp_path / "incident",
        telemetry=telemetry,
    )
    sentinel.forward(torch.ones(8, 64)).backward()
    optimizer.step()
    sentinel.close()
    (line,) = [orjson.loads(raw) for raw in telemetry.read_bytes().splitlines()]
    assert line["grad"]["nan"] == line["grad"]["posinf"] == 0 and not line["held"]
    (warning,) = [w for w in line["warnings"] if w["code"] == "GRAD_NORM_OVERFLOW"]
    assert "overflows float32" in warning["message"] and "8e+19" in warning["message"]
