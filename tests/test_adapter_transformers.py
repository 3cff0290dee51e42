"""The sentinel in a Hugging Face ``transformers.Trainer``
(``nanrunbook.capture.adapters.transformers``): real Trainer runs of a tiny GPT-2
built from a config, on the CPU, nothing downloaded. A run that goes non-finite
holds at the step the run without the adapter first logs a non-finite value,
with the Trainer's state as before that step and a bundle that checks HOLD; a
healthy run trains bit for bit as the plain Trainer; under torchrun's DDP every
rank holds at one step and the set names the rank whose record was corrupt."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sentinel_support import assert_held_evidence, assert_rank1_data_held
from transformers_support import (
    EmbeddingRecords,
    first_nonfinite_step,
    make_trainer,
    sentinel_facts,
    telemetry_lines,
    trainer_bits,
)

from nanrunbook import check_bundle
from nanrunbook.capture.torch import SentinelHold
from nanrunbook.check_set import check_incident_set

HERE = Path(__file__).resolve().parent
DDP_DEADLINE = 240  # seconds for the whole torchrun job (about 20 on a shared 2-core machine)

# (precision, gradient_accumulation_steps, max_grad_norm, loss): the clip and
# the norm-only path (max_grad_norm=0); several micro-batches whose mean loss
# training_step divides, and a loss the model already divides by the step's
# token count (num_items_in_batch).
LOOPS = [("fp32", 2, 1.0, "mean"), ("bf16", 1, 0.0, "items")]
LOOP_NAMES = ("dtype", "accumulate", "clip", "loss")


def loop_of(dtype: str, accumulate: int, clip: float, loss: str) -> dict[str, Any]:
    return {
        "gradient_accumulation_steps": accumulate,
        "max_grad_norm": clip,
        "bf16": dtype == "bf16",
        "fp16": dtype == "fp16",
        "per_batch_mean": loss == "mean",
    }


def hold_of(trainer: Any) -> SentinelHold:
    with pytest.raises(SentinelHold) as raised:
        trainer.train()
    return raised.value


@pytest.mark.parametrize(LOOP_NAMES, LOOPS)
def test_an_absurd_learning_rate_holds_at_the_truths_step_with_the_trainer_as_before_it(
    tmp_path: Path, dtype: str, accumulate: int, clip: float, loss: str
) -> None:
    loop = {"learning_rate": 1e8, **loop_of(dtype, accumulate, clip, loss)}
    truth, _ = make_trainer(
        tmp_path / "plain", sentinel=None, watch_state=False, logging_nan_inf_filter=False, **loop
    )
    truth.train()
    onset = first_nonfinite_step(truth)
    assert onset is not None and onset > 1, truth.state.log_history

    trainer, watch = make_trainer(tmp_path / "run", sentinel=sentinel_facts("lr"), **loop)
    assert trainer.args.logging_nan_inf_filter  # the default: it hides a NaN loss from the log
    if dtype == "bf16":
        assert trainer.accelerator.native_amp  # autocast to bfloat16 on the CPU
    hold = hold_of(trainer)

    assert hold.step == onset
    assert trainer.state.global_step == onset - 1
    assert trainer_bits(trainer) == watch.before[onset]  # model, optimizer, scheduler, counters
    assert trainer.sentinel is None  # closed: its wrappers are off the Trainer's objects
    assert type(trainer.lr_scheduler) is torch.optim.lr_scheduler.LambdaLR

    assert hold.bundle == tmp_path / "run" / "incident" / "lr" / str(onset)
    # the replay on copies came out as the live step (each micro-batch's loss bits)
    assert hold.reproduced is not None and hold.reproduced.verdict == "REPRODUCED"
    assert hold.capsule == hold.bundle / "capsule"
    # HOLD at the sentinel's stage, a telemetry line for every step, the held one last
    assert_held_evidence(tmp_path / "run", "lr", hold.bundle, onset, hold.stage)
    binding = check_bundle(hold.bundle).manifest.binding
    assert binding.details["loader_cursor"]["global_step"] == onset - 1  # the data position
    assert binding.compute_dtype == ("BF16" if dtype == "bf16" else "F32")


def test_gradients_are_checked_before_the_trainers_clip(tmp_path: Path) -> None:
    """A finite loss whose backward overflows: the hold counts the gradients
    as backward left them. The Trainer's own clip would have scaled them by
    max_norm / inf = 0 first, every infinity into a NaN."""

    def loud(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1)) * 5e37

    trainer, watch = make_trainer(
        tmp_path, sentinel=sentinel_facts("loud"), compute_loss_func=loud, max_grad_norm=1.0
    )
    hold = hold_of(trainer)
    assert (hold.step, hold.stage) == (1, "backward")
    assert hold.reproduced is not None and hold.reproduced.verdict == "REPRODUCED"
    assert trainer_bits(trainer) == watch.before[1]

    report = check_bundle(hold.bundle)
    assert report.decision.decision == "HOLD"
    backward = next(s for s in report.stages if s.stage == "backward")
    assert backward.counts is not None
    line = telemetry_lines(tmp_path / "incident" / "loud" / "telemetry.jsonl")[-1]
    grad = line["grad"]
    assert line["loss_class"] == "finite" and math.isfinite(line["loss"])
    assert (grad["nan"], grad["posinf"], grad["neginf"]) == (
        backward.counts.nan,
        backward.counts.posinf,
        backward.counts.neginf,
    )
    assert grad["posinf"] + grad["neginf"] > 0  # infinities, not the clip's NaNs
    assert grad["nan"] + grad["posinf"] + grad["neginf"] < backward.counts.elements


def test_after_a_hold_grad_and_the_loss_accumulator_are_the_held_steps_until_train_again(
    tmp_path: Path,
) -> None:
    """As in a plain loop, a hold leaves the held step's gradients in ``.grad``
    (evidence; the loop's next zero_grad clears them), and the Trainer's loss
    accumulator its loss: the adapter puts back only what a new ``train()``
    carries over (the flos and token counters). Resumed with ``train()``, the
    Trainer zeroes both itself, and nothing of the held step is in its log."""
    loud = [True]

    def loss(outputs: Any, labels: Any, num_items_in_batch: Any = None) -> Any:
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        value = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return value * 5e37 if loud[0] else value

    trainer, _ = make_trainer(
        tmp_path, sentinel=sentinel_facts("again"), compute_loss_func=loss, max_steps=2,
        watch_state=False,
    )  # fmt: skip
    hold = hold_of(trainer)
    assert (hold.step, hold.stage) == (1, "backward")
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    assert grads and not all(bool(torch.isfinite(g).all()) for g in grads)  # the held step's
    assert float(trainer._tr_loss) > 1e30  # the held step's loss, 5e37 times the mean
    loud[0] = False
    trainer.train()  # resumed from the state before the held step
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.global_step == 2 and len(losses) == 2
    assert all(math.isfinite(v) and v < 10 for v in losses)  # no held step's loss in the log
    train_loss = trainer.state.log_history[-1]["train_loss"]
    assert train_loss == pytest.approx(sum(losses) / 2)


def _trained(trainer: Any) -> tuple[Any, list[dict[str, Any]]]:
    trainer.train()
    timing = ("train_runtime", "train_samples_per_second", "train_steps_per_second")
    log = [{k: v for k, v in e.items() if k not in timing} for e in trainer.state.log_history]
    return trainer_bits(trainer, same=False), log


@pytest.mark.parametrize(LOOP_NAMES, [*LOOPS, ("fp16", 2, 1.0, "items")])
def test_a_healthy_run_trains_bit_for_bit_as_without_the_adapter(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    dtype: str,
    accumulate: int,
    clip: float,
    loss: str,
) -> None:
    loop = loop_of(dtype, accumulate, clip, loss)
    plain, _ = make_trainer(tmp_path / "plain", sentinel=None, watch_state=False, **loop)
    expected = _trained(plain)
    watched, _ = make_trainer(
        tmp_path / "run", sentinel=sentinel_facts("ok"), watch_state=False, **loop
    )
    if dtype == "fp16":  # on the CPU accelerate runs fp16 in float32: no autocast, no scaler
        assert (watched.accelerator.native_amp, watched.accelerator.scaler) == (False, None)
    with caplog.at_level(logging.WARNING, logger="nanrunbook"):
        assert _trained(watched) == expected
    assert [r for r in caplog.records if r.name.startswith("nanrunbook")] == []
    incident = tmp_path / "run" / "incident" / "ok"
    assert sorted(p.name for p in incident.iterdir()) == ["telemetry.jsonl"]  # no bundle
    lines = telemetry_lines(incident / "telemetry.jsonl")
    assert [line["step"] for line in lines] == list(range(1, 7))
    assert all(not line["warnings"] and not line["held"] for line in lines)
    # The sentinel's loss is the one backpropagated: the Trainer logs the sum of
    # a step's micro-batch losses, the telemetry line their mean.
    logged = [entry["loss"] for entry in expected[1] if "loss" in entry]
    seen = [line["loss"] * accumulate for line in lines]
    assert seen == pytest.approx(logged, rel=1e-6)


def test_the_skip_policy_skips_one_corrupt_record_and_trains_on(tmp_path: Path) -> None:
    """policy="skip": the step that read the corrupt record changes no weight
    and no optimizer state, its scheduler step passes; the Trainer counts it
    (the data moved on) and trains to the end."""
    trainer, watch = make_trainer(
        tmp_path,
        sentinel={**sentinel_facts("skip"), "policy": "skip"},
        dataset=EmbeddingRecords(corrupt_read=10),
    )
    assert trainer.train().global_step == 6
    lines = telemetry_lines(tmp_path / "incident" / "skip" / "telemetry.jsonl")
    skipped = [line["step"] for line in lines if line["skipped"]]
    assert len(skipped) == 1 and not any(line["held"] for line in lines)
    (step,) = skipped
    after, before = watch.before[step + 1]["tensors"], watch.before[step]["tensors"]
    assert after["params"] == before["params"] and after["optimizer"] == before["optimizer"]
    assert watch.before[step + 1]["tensors"]["scheduler"] == before["scheduler"]
    assert trainer.lr_scheduler.last_epoch == 5  # six steps, one scheduler step passed
    assert list(tmp_path.glob("incident/skip/*/manifest.json")) == []


def test_what_the_trainer_owns_is_not_given_twice(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="the Trainer gives optimizer, scheduler itself"):
        make_trainer(
            tmp_path, sentinel={**sentinel_facts("x"), "optimizer": None, "scheduler": None}
        )
    facts = sentinel_facts("x")
    facts["checkpoint"] = {**facts["checkpoint"], "step": 5}
    trainer, _ = make_trainer(tmp_path, sentinel=facts)
    with pytest.raises(ValueError, match=r"checkpoint's step 5 is not .*global_step 0"):
        trainer.train()
    assert trainer.sentinel is None and trainer.state.global_step == 0
    # fp16 with accelerate's GradScaler (a GPU's): refused rather than half held
    trainer, _ = make_trainer(tmp_path, sentinel=sentinel_facts("x"))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(NotImplementedError, match="GradScaler"):
        trainer.train()


def test_ddp_under_torchrun_holds_every_rank_at_one_step(tmp_path: Path) -> None:
    """Two CPU processes (gloo) under torchrun, the Trainer's own DDP; rank 1's
    shard turns corrupt after a few records."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "transformers_ddp_worker.py"),
        str(tmp_path),
    ]
    # On the deadline torchrun is told to stop (it stops its workers, each in a
    # session of its own), then killed with its group: no process left behind.
    job = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = job.communicate(timeout=DDP_DEADLINE)
    except subprocess.TimeoutExpired:
        job.terminate()
        try:
            job.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"the 2-rank torchrun job did not end within {DDP_DEADLINE} s")
    assert job.returncode == 0, stderr[-3000:]
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert [r["distributed"] for r in results] == ["MULTI_CPU"] * 2
    held = {r["held"] for r in results}
    assert len(held) == 1 and held != {None}
    step = held.pop()
    assert step > 1  # it trained before the corrupt records
    assert all(r["global_step"] == step - 1 and r["untouched"] for r in results)
    # both ranks' origin rank 1 at input, the set's too, a telemetry line a step
    assert_rank1_data_held(tmp_path, "ddp", step, results)
    verdict = check_incident_set(tmp_path / "incident" / "ddp" / str(step))
    assert (verdict.decision, verdict.origin_ranks, verdict.ranks) == ("HOLD", (1,), (0, 1))
