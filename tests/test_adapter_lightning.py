"""The sentinel in a real PyTorch Lightning Trainer (``SentinelCallback``): a run
that goes non-finite through real arithmetic holds at the step and stage where
the run, fit without the sentinel, first went non-finite, with the Trainer's
model, optimizer, LR scheduler, loops' counters and global step bit-identical
to before the step; the bundle checks HOLD at that stage and every step has its
telemetry line. A healthy fit trains bit for bit as without the callback. A
2-process ``strategy="ddp"`` fit on gloo holds every rank at one step."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_support import (
    Regression,
    StateAtStepStart,
    Truth,
    fit,
    loader,
    quiet_lightning,
    sentinel_facts,
)
from sentinel_support import (
    PARTS,
    assert_held_evidence,
    assert_rank1_data_held,
    bundles,
    state_bits,
    telemetry,
)

from nanrunbook.capture.adapters.lightning import SentinelCallback

HERE = Path(__file__).resolve().parent
quiet_lightning()


def _truth(make: Any, data: Any, steps: int, **options: Any) -> Truth:
    """The fit without the sentinel: where it first went non-finite."""
    truth = Truth()
    torch.manual_seed(0)
    fit(make(), data(), [truth], steps, **options)
    assert truth.step is not None, "the run never went non-finite"
    return truth


def _held_fit(
    tmp: Path, run_id: str, make: Any, data: Any, steps: int, **options: Any
) -> tuple[Any, Any, StateAtStepStart, Any]:
    torch.manual_seed(0)
    module, recorder = make(), StateAtStepStart()
    callback = SentinelCallback(**sentinel_facts(run_id, tmp))
    run, hold = fit(module, data(), [recorder, callback], steps, **options)
    return run, module, recorder, hold


def _assert_held_as_the_truth(
    tmp: Path, run_id: str, truth: Truth, run: Any, module: Any, recorder: Any, hold: Any
) -> None:
    assert hold is not None, "no hold"
    assert (hold.step, hold.stage) == (truth.step, truth.stage)
    # Model, optimizer, scheduler, the loops' progress and the global step: as
    # at the held step's first batch.
    assert recorder.now(run, module) == recorder.before
    assert run.global_step == truth.step - 1 == recorder.before[2]
    assert_held_evidence(tmp, run_id, hold.bundle, truth.step, truth.stage)


def test_an_absurd_learning_rate_holds_at_the_true_step_under_bf16_accumulation_and_clipping(
    tmp_path: Path,
) -> None:
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "precision": "bf16-mixed"}

    def make() -> Regression:
        return Regression(jump=1e30, jump_at=3)

    truth = _truth(make, loader, 10, **options)
    run, module, recorder, hold = _held_fit(tmp_path, "absurd-lr", make, loader, 10, **options)
    _assert_held_as_the_truth(tmp_path, "absurd-lr", truth, run, module, recorder, hold)
    assert "non-finite loss" in hold.reason


def test_a_corrupt_record_holds_at_its_step_with_the_input_named(tmp_path: Path) -> None:
    options = {"gradient_clip_val": 0.5}

    def make() -> Regression:
        return Regression(optimizer="sgd")

    def data() -> Any:
        return loader(corrupt=8 * 4 + 1)  # batch index 4: step 5

    truth = _truth(make, data, 8, **options)
    assert (truth.step, truth.stage) == (5, "input")
    run, module, recorder, hold = _held_fit(tmp_path, "corrupt", make, data, 8, **options)
    _assert_held_as_the_truth(tmp_path, "corrupt", truth, run, module, recorder, hold)


def test_a_healthy_fit_trains_bit_for_bit_as_without_the_callback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, "precision": "bf16-mixed"}
    ends = []
    for callbacks in ([], [SentinelCallback(**sentinel_facts("healthy", tmp_path))]):
        torch.manual_seed(0)
        module = Regression()
        with (
            caplog.at_level(logging.WARNING, logger="nanrunbook"),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            run, hold = fit(module, loader(), callbacks, 8, **options)
        assert not [w for w in caught if f"{os.sep}nanrunbook{os.sep}" in w.filename]
        assert hold is None
        scheduler = run.lr_scheduler_configs[0].scheduler
        ends.append((state_bits(module, run.optimizers[0], scheduler, same=False), run.global_step))
    assert ends[0] == ends[1] and ends[0][1] == 8
    assert not bundles(tmp_path, "healthy")
    assert not [r for r in caplog.records if r.name.startswith("nanrunbook")]
    lines = telemetry(tmp_path, "healthy")
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert not any(line["warnings"] or line["skipped"] or line["held"] for line in lines)
    # The callback leaves nothing on the instances once the fit ends (the step
    # there is the LR scheduler's own wrapper).
    step = vars(run.optimizers[0])["step"]
    assert "nanrunbook" not in getattr(step, "__func__", step).__code__.co_filename
    assert "training_step" not in vars(module)


def test_the_skip_policy_skips_the_corrupt_step_and_the_fit_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Regression(optimizer="sgd")
    callback = SentinelCallback(**sentinel_facts("skip", tmp_path, policy="skip"))
    run, hold = fit(module, loader(corrupt=8 * 4 + 1), [callback], 10, gradient_clip_val=0.5)
    assert hold is None and run.global_step == 10  # Lightning counts the skipped step
    assert run.lr_scheduler_configs[0].scheduler.last_epoch == 9  # the skipped step's call passed
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())
    lines = telemetry(tmp_path, "skip")
    assert [line["step"] for line in lines] == list(range(1, 11))
    assert [line["step"] for line in lines if line["skipped"]] == [5]
    assert not bundles(tmp_path, "skip")


def test_what_the_adapter_cannot_follow_is_refused_when_training_starts(tmp_path: Path) -> None:
    callback = SentinelCallback(**sentinel_facts("refused", tmp_path))
    with pytest.raises(TypeError, match="clip by norm"):
        fit(
            Regression(),
            loader(),
            [callback],
            2,
            gradient_clip_val=1.0,
            gradient_clip_algorithm="value",
        )
    late = SentinelCallback(
        **sentinel_facts(
            "refused", tmp_path, checkpoint={"id": "c", "step": 5, "verified_together": PARTS}
        )
    )
    with pytest.raises(ValueError, match="starts at global_step 0"):
        fit(Regression(), loader(), [late], 2)
    with pytest.raises(TypeError, match="the Trainer owns optimizer"):
        SentinelCallback(optimizer=None, **sentinel_facts("refused", tmp_path))


def test_a_nan_in_one_ranks_data_holds_both_ddp_ranks_at_one_step(tmp_path: Path) -> None:
    """``strategy="ddp"`` as a script (Lightning's launcher starts rank 1 with
    the same command), gloo, 2 CPU processes; the job has a deadline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    command = [sys.executable, str(HERE / "lightning_support.py"), str(tmp_path), "8"]
    job = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True)
    try:
        code = job.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # the launcher's rank 1 too
        job.wait()
        pytest.fail("the 2-rank Lightning job did not end within 240 s")
    assert code == 0
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert {r["held"] for r in results} == {4}, results  # rank 1's batch index 3
    assert all(r["untouched"] and r["finite"] and r["global_step"] == 3 for r in results)
    assert_rank1_data_held(tmp_path, "ddp", 4, results)
