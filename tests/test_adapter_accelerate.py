"""The sentinel in a real Accelerate loop (``AcceleratorSentinel``): a run that
goes non-finite through real arithmetic holds at the step and stage where the
same loop without the sentinel first went non-finite, with the model,
optimizer, scheduler and ``accelerator.step`` bit-identical to before the step;
the bundle checks HOLD at that stage, every step has its telemetry line. A
healthy loop trains bit for bit as without the adapter. A 2-process job under
``torchrun`` (gloo) holds every rank at one step."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from accelerate_support import batches, run
from sentinel_support import assert_held_evidence, assert_rank1_data_held, bundles, telemetry

HERE = Path(__file__).resolve().parent


def _assert_held_as_the_truth(tmp: Path, run_id: str, truth: Any, held: Any) -> None:
    hold = held.hold
    assert hold is not None, "no hold"
    assert (hold.step, hold.stage) == truth.truth
    assert held.after == held.before  # model, optimizer, scheduler, accelerator.step
    assert held.steps == hold.step - 1
    assert_held_evidence(tmp, run_id, hold.bundle, hold.step, hold.stage)


def test_an_absurd_learning_rate_holds_at_the_true_step_under_bf16_accumulation_and_clipping(
    tmp_path: Path,
) -> None:
    options: dict[str, Any] = {"jump": 1e30, "mixed_precision": "bf16"}
    truth = run(batches(20), tmp=None, **options)
    assert truth.truth is not None
    held = run(batches(20), tmp=tmp_path, run_id="absurd-lr", **options)
    _assert_held_as_the_truth(tmp_path, "absurd-lr", truth, held)


def test_a_corrupt_record_holds_at_its_step_with_the_input_named(tmp_path: Path) -> None:
    options: dict[str, Any] = {"optimizer": "sgd", "clip": 0.5}
    data = batches(16, corrupt=8 * 6 + 3)  # batch 6, accumulating 2: step 4
    truth = run(data, tmp=None, **options)
    assert truth.truth == (4, "input")
    held = run(batches(16, corrupt=8 * 6 + 3), tmp=tmp_path, run_id="corrupt", **options)
    _assert_held_as_the_truth(tmp_path, "corrupt", truth, held)


def test_a_healthy_loop_trains_bit_for_bit_as_without_the_adapter(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    options: dict[str, Any] = {"mixed_precision": "bf16"}
    plain = run(batches(16), tmp=None, **options)
    with (
        caplog.at_level(logging.WARNING, logger="nanrunbook"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        watched = run(batches(16), tmp=tmp_path, run_id="healthy", **options)
    assert not [w for w in caught if f"{os.sep}nanrunbook{os.sep}" in w.filename]
    assert plain.truth is None and watched.hold is None
    assert watched.final == plain.final and watched.steps == 8
    assert not bundles(tmp_path, "healthy")
    assert not [r for r in caplog.records if r.name.startswith("nanrunbook")]
    lines = telemetry(tmp_path, "healthy")
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert not any(line["warnings"] or line["skipped"] or line["held"] for line in lines)


def test_what_the_adapter_cannot_follow_is_refused(tmp_path: Path) -> None:
    from accelerate import Accelerator
    from torch import nn, optim

    from nanrunbook.capture.adapters.accelerate import AcceleratorSentinel

    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="the accelerator owns process_group"):
        AcceleratorSentinel(
            Accelerator(cpu=True),
            model,
            optim.SGD(model.parameters()),
            lambda m, b: m(b),
            process_group=None,
            run_id="r",
            checkpoint={},
            data={},
            objective={},
        )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_nan_in_one_ranks_data_holds_both_torchrun_ranks_at_one_step(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2`` (``accelerate launch --cpu`` runs one
    process); the job has a deadline."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(HERE / "accelerate_support.py"),
        str(tmp_path),
    ]
    job = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True)
    try:
        code = job.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        pytest.fail("the 2-rank Accelerate job did not end within 240 s")
    assert code == 0
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in results)
    assert {r["held"] for r in results} == {3}, results
    assert all(r["untouched"] and r["finite"] for r in results), results
    assert_rank1_data_held(tmp_path, "ddp", 3, results)
