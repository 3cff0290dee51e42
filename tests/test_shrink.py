"""Shrink: the first bad operation, the smallest batch, and the regression fixture.

Real CPU runs that go non-finite through real arithmetic. The generated tests
run under pytest in one fresh process for all the scenarios' fixtures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nanrunbook import check_bundle
from nanrunbook.capture.torch import tensor_to_raw
from nanrunbook.capture.torch.shrink import _fixture as fixture_module
from nanrunbook.capture.torch.shrink._ddmin import ddmin
from nanrunbook.capture.torch.shrink._failing_step import FailingStep
from nanrunbook.capture.torch.shrink._fixture import FixtureError, write_fixture
from nanrunbook.capture.torch.shrink._results import OpKey
from nanrunbook.capture.torch.shrink._shrink import ShrinkError, ShrinkOnHold, shrink
from tests import shrink_models as sm

ROOT = Path(__file__).resolve().parent.parent

BUNDLE: dict[str, Any] = {
    "incident_owner": "ml-oncall",
    "last_known_good": {
        "checkpoint_id": "ckpt-10",
        "step": 10,
        "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
    },
    "binding": {
        "checkpoint": {"id": "ckpt-10"},
        "data": {"id": "data-test"},
        "loader_cursor": {"id": "cursor-11"},
        "objective": {"id": "xent", "reduction": "mean"},
        "scheduler": {"id": "constant"},
    },
}


def identity(run: str) -> dict[str, Any]:
    return {**BUNDLE, "run_id": run, "step": 11}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- delta debugging


@pytest.mark.parametrize("bad", [0, 1, 31, 32, 37, 62, 63])
def test_one_bad_example_of_64_takes_at_most_12_trials(bad: int) -> None:
    found = ddmin(64, lambda subset: bad in subset)
    assert found.examples == (bad,) and found.one_minimal
    assert found.trials <= 12


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), min_size=1))
    )
)
def test_ddmin_finds_exactly_the_needed_set_of_a_monotone_failure(
    case: tuple[int, set[int]],
) -> None:
    size, needed = case
    calls: list[tuple[int, ...]] = []

    def fails(subset: tuple[int, ...]) -> bool:
        calls.append(subset)
        return needed <= set(subset)

    found = ddmin(size, fails)
    assert set(found.examples) == needed and found.one_minimal
    assert len(calls) == len(set(calls)) == found.trials  # no subset is tried twice
    assert () not in calls and tuple(range(size)) not in calls


def test_ddmin_tries_the_hint_first_and_stops_at_the_budget() -> None:
    seen: list[tuple[int, ...]] = []
    found = ddmin(16, lambda s: seen.append(s) or 9 in s, hint=[9])
    assert seen == [(9,)] and found.examples == (9,) and found.hint_used
    # a bad hint costs one trial, then the search runs as usual
    found = ddmin(16, lambda s: 9 in s, hint=[3])
    assert found.examples == (9,) and not found.hint_used
    found = ddmin(16, lambda s: len(s) == 16, max_trials=5)
    assert found.trials == 5 and not found.one_minimal and len(found.examples) == 16
    with pytest.raises(ValueError, match="at least one"):
        ddmin(0, lambda s: True)


# ---------------------------------------------------------------- scenarios


def norm_step(bad: int = 37, size: int = 64) -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(size, 8, generator=gen(1))
    x[bad] = 0.5  # a constant row: std 0
    model = sm.NormNet()
    return FailingStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
    )


def attention_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(16, 5, 8, generator=gen(2)) * 0.5
    x[11] *= 40  # scores beyond 88.7: exp overflows bf16
    model = sm.AttnNet()
    return FailingStep(
        model, torch.optim.AdamW(model.parameters()), sm.batch_of(x, 3), sm.xent_bf16
    )


def nan_data_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(64, 8, generator=gen(3))
    x[5, 3] = float("nan")
    model = sm.MLP()
    return FailingStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
    )


def sqrt_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(32, 8, generator=gen(4))
    x[20] = 0.0  # a zero feature vector: sqrt(0) in the norm, NaN in its gradient
    model = sm.SqrtNet()
    return FailingStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
    )


def bce_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(32, 8, generator=gen(5))
    x[9] *= 1000  # sigmoid rounds to 1: log(1 - p) = -inf
    model = nn.Sequential(nn.Linear(8, 1))
    batch = sm.batch_of(x, 2)
    batch["y"][9] = 0
    return FailingStep(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, sm.bce_by_hand)


def functional_attention_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(16, 5, 8, generator=gen(6)) * 0.5
    x[3] *= 40
    model = sm.FunctionalAttnNet()
    return FailingStep(
        model, torch.optim.AdamW(model.parameters()), sm.batch_of(x, 3), sm.xent_bf16
    )


def probed_attention_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(16, 5, 8, generator=gen(6)) * 0.5
    x[3] *= 40
    model = sm.ProbedAttnNet()
    return FailingStep(
        model, torch.optim.AdamW(model.parameters()), sm.batch_of(x, 3), sm.xent_bf16
    )


def sentinel_step() -> FailingStep:
    """As a sentinel holds a step: its objects, and a micro-batch whose autocast
    region the loop opened around compute_loss (not inside it)."""
    from nanrunbook.capture.torch.replay import Autocast, MicroBatch, RngState, leaf
    from nanrunbook.capture.torch.sentinel._capture import StepObjects

    torch.manual_seed(0)
    x = torch.randn(16, 5, 8, generator=gen(13)) * 0.5
    x[8] *= 40
    model = sm.AttnNet()
    objects = StepObjects(
        model, torch.optim.AdamW(model.parameters()), None, None, None, sm.xent, leaf
    )
    micro = MicroBatch(sm.batch_of(x, 3), RngState.now(), (Autocast("cpu", torch.bfloat16),))
    return FailingStep.of_micro_batch(objects, micro)


def scaled_fp16_step() -> FailingStep:
    torch.manual_seed(0)
    model = sm.MLP()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # too large for fp16 gradients
    batch = sm.batch_of(torch.randn(16, 8, generator=gen(14)), 4)
    return FailingStep(
        model, torch.optim.AdamW(model.parameters()), batch, sm.xent_fp16, scaler=scaler
    )


def siamese_step() -> FailingStep:
    torch.manual_seed(0)
    x, x2 = torch.randn(16, 8, generator=gen(7)), torch.randn(16, 8, generator=gen(8))
    x2[6] = x[6]  # a record paired with itself: distance 0
    model = sm.MLP()
    batch = {"x": x, "x2": x2}
    return FailingStep(model, torch.optim.Adam(model.parameters()), batch, sm.siamese_distance)


def guarded_step() -> FailingStep:
    torch.manual_seed(0)
    x = torch.randn(16, 8, generator=gen(9))
    x[2] = 0.25
    model = sm.GuardedNet()
    return FailingStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
    )


SCENARIOS = {
    "norm": (norm_step, {}),
    "attention": (attention_step, {}),
    "nandata": (nan_data_step, {"drop_names": True}),
    "sqrt": (sqrt_step, {}),
    "bce": (bce_step, {}),
    "fattention": (functional_attention_step, {}),
    "probed": (probed_attention_step, {}),
    "sentinel": (sentinel_step, {}),
    "scaled": (scaled_fp16_step, {}),
    "siamese": (siamese_step, {}),
    "guarded": (guarded_step, {}),
}


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario shrunk once, its fixture written under one directory."""
    root = tmp_path_factory.mktemp("fixtures")
    results = {}
    for name, (make, options) in SCENARIOS.items():
        step = make()
        results[name] = (
            step,
            shrink(step, fixture=root / name, bundle=identity(f"run-{name}"), **options),
        )
    return {"root": root, **results}


def test_constant_row_in_64_is_found_at_the_normalisation_with_one_row(shrunk: Any) -> None:
    _, result = shrunk["norm"]
    op = result.operation
    assert (op.stage, op.key, op.type_name, op.made_here) == (
        "forward",
        OpKey("module", "norm", 1),
        "Normalise",
        True,
    )
    assert result.examples == (37,) and result.minimal and result.batch_size == 64
    assert result.nonfinite_rows == (37,) and result.interaction is None
    assert result.replays <= 12 and result.replays == 2  # the survey, then the hinted row
    (given,) = op.inputs
    assert given.nonfinite == 0 and given.shape == (64, 8)
    assert given.finite_max_abs == pytest.approx(float(norm_step().batch["x"].abs().max()))
    (made,) = op.outputs
    assert (made.nan, made.posinf, made.neginf) == (8, 0, 0)


@pytest.mark.parametrize("bad", [0, 37, 63])
def test_plain_delta_debugging_takes_at_most_12_trials(bad: int) -> None:
    result = shrink(norm_step(bad), hint=False)
    assert result.examples == (bad,) and result.minimal
    assert result.trials <= 12 and result.replays == result.trials + 1


def test_bf16_exp_overflow_is_found_at_the_exp(shrunk: Any) -> None:
    step, result = shrunk["attention"]
    op = result.operation
    assert (op.stage, op.key.path, op.type_name, op.autocast) == (
        "forward",
        "attn.exp",
        "Exp",
        "cpu:bfloat16",
    )
    assert op.inputs[0].dtype == "bfloat16" and op.inputs[0].nonfinite == 0
    assert op.outputs[0].posinf > 0 and op.outputs[0].nan == 0
    assert result.examples == (11,)
    # the fixture holds the exp's input bits exactly: bf16 scores of example 11
    model = step.model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = step.batch["x"][11:12]
        scores = model.attn.q(x) @ model.attn.k(x).transpose(-1, -2)
    assert scores.dtype == torch.bfloat16
    fixture = shrunk["root"] / "attention"
    stored = read_safetensors(fixture / "inputs.safetensors")
    assert stored["op/input/0"] == ("BF16", [1, 5, 5], tensor_to_raw(scores).data)


def test_nan_in_one_example_is_that_example(shrunk: Any) -> None:
    _, result = shrunk["nandata"]
    op = result.operation
    assert op.stage == "input" and not op.made_here
    assert op.key == OpKey("module", "net.0", 1)  # the first module the NaN went through
    assert result.examples == (5,) and result.nonfinite_rows == (5,)
    assert result.replays == 1  # the survey: the examples are judged on the data
    names = list(read_safetensors(shrunk["root"] / "nandata" / "inputs.safetensors"))
    assert names == ["t0", "t1"]  # drop_names: no tensor names kept


def test_backward_nan_from_sqrt_at_zero_is_the_norm_module(shrunk: Any) -> None:
    _, result = shrunk["sqrt"]
    op = result.operation
    assert op.stage == "backward" and op.key == OpKey("module", "norm", 1, backward=True)
    assert op.type_name == "L2Norm" and op.made_here
    assert all(f.nonfinite == 0 for f in op.grad_outputs)
    assert op.outputs[0].nan > 0
    assert op.inputs[0].finite_min is not None
    assert result.examples == (20,)


def test_loss_term_is_the_log_in_compute_loss(shrunk: Any) -> None:
    _, result = shrunk["bce"]
    op = result.operation
    assert op.stage == "loss"
    assert op.key == OpKey("function", "", 0, "torch.log", 2)
    assert op.inputs[0].finite_min == 0.0 and op.outputs[0].neginf == 1
    assert result.examples == (9,)


def test_exp_inside_a_module_is_found_at_its_function(shrunk: Any) -> None:
    _, result = shrunk["fattention"]
    op = result.operation
    assert op.key == OpKey("function", "attn", 1, "torch.exp", 1)
    assert op.describe() == "torch.exp in module 'attn'" and op.autocast == "cpu:bfloat16"
    assert result.examples == (3,)


def test_a_step_held_by_the_sentinel_replays_its_autocast_region(shrunk: Any) -> None:
    _, result = shrunk["sentinel"]
    op = result.operation
    assert (op.key.path, op.autocast, result.examples) == ("attn.exp", "cpu:bfloat16", (8,))
    document = json.loads((shrunk["root"] / "sentinel" / "fixture.json").read_text())
    assert document["inputs"]["op"]["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    assert document["bundle"]["stage"] == "forward"


def test_bf16_exp_overflow_marked_by_a_named_probe_is_the_probes_operation(shrunk: Any) -> None:
    _, result = shrunk["probed"]
    op = result.operation
    assert op.stage == "forward"
    assert op.key == OpKey("probe", "attn", 1, "attn.weights", 1)
    assert op.made_by == OpKey("function", "attn", 1, "torch.exp", 1)
    assert op.describe() == "probe 'attn.weights' in module 'attn', made by torch.exp"
    assert op.autocast == "cpu:bfloat16" and op.made_here
    (scores,) = op.inputs  # what the exp saw: the bf16 scores, finite and large
    assert scores.dtype == "bfloat16" and scores.nonfinite == 0 and scores.finite_max_abs > 88.7
    assert op.outputs[0].posinf > 0
    assert result.examples == (3,) and result.replays == 3  # survey, made-by survey, one trial
    document = json.loads((shrunk["root"] / "probed" / "fixture.json").read_text())
    assert document["operation"]["made_by"] == "torch.exp in module 'attn'"
    assert document["program"]["current"]["class"] == "tests.shrink_models.ProbedAttention"


def test_backward_of_a_function_in_compute_loss(shrunk: Any) -> None:
    _, result = shrunk["siamese"]
    op = result.operation
    assert op.stage == "backward"
    assert op.key == OpKey("function", "", 0, "torch.Tensor.sqrt", 1, backward=True)
    assert op.inputs[0].finite_min == 0.0 and result.examples == (6,)


def test_a_loss_scale_too_large_for_fp16_overflows_the_loss_backward(shrunk: Any) -> None:
    _, result = shrunk["scaled"]
    op = result.operation
    assert op.stage == "backward"
    # the cast of the scaled gradient back to fp16, inside cross_entropy's backward
    assert op.key == OpKey("function", "", 0, "torch.nn.functional.cross_entropy", 1, True)
    assert op.grad_outputs[0].dtype == "float32" and op.grad_outputs[0].nonfinite == 0
    assert op.outputs[0].dtype == "float16" and op.outputs[0].posinf > 0
    assert result.nonfinite_rows == tuple(range(16)) and len(result.examples) == 1
    document = json.loads((shrunk["root"] / "scaled" / "fixture.json").read_text())
    assert document["facts"]["loss_scale"]["scale"] == 2.0**24
    assert document["inputs"]["loss"]["loss_scale"] == 2.0**24


def test_export_failure_falls_back_to_the_class_path_with_a_note(shrunk: Any) -> None:
    document = json.loads((shrunk["root"] / "guarded" / "fixture.json").read_text())
    program = document["program"]
    assert program["frozen"] is None
    assert program["frozen_note"].startswith("torch.export could not trace it")
    assert "falling back to tests.shrink_models.GuardedNormalise" in program["frozen_note"]
    assert program["current"]["class"] == "tests.shrink_models.GuardedNormalise"
    assert program["frozen_note"] in document["notes"]
    assert not (shrunk["root"] / "guarded" / "program.pt2").exists()


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    base = 8 + length
    return {
        name: (
            e["dtype"],
            e["shape"],
            blob[base + e["data_offsets"][0] : base + e["data_offsets"][1]],
        )
        for name, e in header.items()
    }


def test_fixture_pins_the_shrunk_examples_exactly_and_its_bundle_holds(shrunk: Any) -> None:
    step, _ = shrunk["norm"]
    fixture = shrunk["root"] / "norm"
    stored = read_safetensors(fixture / "inputs.safetensors")
    assert stored["op/input/0"] == ("F32", [1, 8], tensor_to_raw(step.batch["x"][37:38]).data)
    document = json.loads((fixture / "fixture.json").read_text())
    assert document["shrink"]["examples"] == [37]
    assert document["facts"]["reduction"] == "mean"
    assert document["facts"]["loss_scale"] == {"mode": "none", "scale": 1}
    assert document["facts"]["optimizer"]["class"] == "SGD"
    bundle = document["bundle"]
    assert (bundle["decision"], bundle["stage"]) == ("HOLD", "forward")
    report = check_bundle(fixture / "bundle")
    assert report.decision.earliest_nonfinite_stage == "forward"
    batch = json.loads((fixture / "bundle" / "manifest.json").read_text())["binding"]["batch"]
    assert batch["size"] == 1  # only the shrunk example is in the bundle


def test_every_generated_test_passes_in_a_fresh_process(shrunk: Any, tmp_path: Path) -> None:
    root = shrunk["root"]
    report = tmp_path / "junit.xml"
    done = run_pytest(*[str(root / name) for name in SCENARIOS], f"--junitxml={report}", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        scenario = case.get("classname", "").split(".")[-1].removeprefix("test_nonfinite_run_")
        kind = "skipped" if case.find("skipped") is not None else "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            kind = "failed"
        outcomes.setdefault(scenario.split("_step")[0], {})[case.get("name", "")] = kind
    expected = dict.fromkeys(
        [
            "test_inputs_and_programs_are_the_captured_bits",
            "test_frozen_program_reproduces",
            "test_current_code",
            "test_bundle_holds_at_the_same_stage",
        ],
        "passed",
    )
    for name in SCENARIOS:
        want = (
            {**expected, "test_frozen_program_reproduces": "skipped"}
            if name == "guarded"
            else expected
        )
        assert outcomes[name] == want, name


def run_pytest(*args: str, cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """pytest in a fresh process; ``path`` goes first on PYTHONPATH (then the checkout,
    for the models' module and nanrunbook)."""
    paths = [str(p) for p in (path, ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
        timeout=900,
    )


# ---------------------------------------------------------------- the caller's state


def bits(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    raw = tensor_to_raw(tensor)
    return raw.dtype, raw.shape, raw.data


def snapshot(step: FailingStep) -> dict[str, Any]:
    """Every bit of the caller's state a shrink could disturb."""
    model, optimizer = step.model, step.optimizer
    state: dict[str, Any] = {
        f"state/{k}": (id(v), bits(v)) for k, v in model.state_dict(keep_vars=True).items()
    }
    for name, param in model.named_parameters():
        state[f"grad/{name}"] = None if param.grad is None else bits(param.grad)
        state[f"hooks/{name}"] = dict(param._backward_hooks or {})
    state["modules"] = [
        (m.training, getattr(m, "inplace", None), len(m._forward_hooks), len(m._forward_pre_hooks),
         len(m._backward_hooks), len(m._backward_pre_hooks))
        for m in model.modules()
    ]  # fmt: skip
    saved = optimizer.state_dict()
    for index, entries in saved["state"].items():
        for key, value in entries.items():
            state[f"opt/{index}/{key}"] = bits(value) if torch.is_tensor(value) else repr(value)
    state["opt/groups"] = repr(saved["param_groups"])
    state["batch"] = {k: bits(v) for k, v in step.batch.items()}
    state["rng"] = bits(torch.get_rng_state())
    return state


class DropoutNormNet(sm.NormNet):
    def __init__(self) -> None:
        super().__init__()
        self.body.append(nn.Dropout(0.5))


def test_the_callers_model_optimizer_batch_and_rng_are_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DropoutNormNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):  # real steps: optimizer state and leftover gradients
        optimizer.zero_grad()
        sm.xent(model, sm.batch_of(torch.randn(64, 8, generator=gen(seed)), 4)).backward()
        optimizer.step()
    x = torch.randn(64, 8, generator=gen(5))
    x[17] = -1.5
    step = FailingStep(
        model, optimizer, sm.batch_of(x, 4), sm.xent, rng_state=torch.get_rng_state()
    )
    before = snapshot(step)
    result = shrink(step, fixture=tmp_path / "fx", bundle=identity("run-state"), hint=False)
    assert result.examples == (17,) and result.operation.key.path == "norm"
    assert snapshot(step) == before


# ---------------------------------------------------------------- interacting examples


def test_examples_that_meet_in_batch_statistics_are_said_to_interact() -> None:
    # Row 0 is zero and the others come in +- pairs, so the batch mean is exactly
    # zero: batch norm maps row 0 to a constant row, and the normalisation after
    # it divides by a zero std. No example does it alone.
    pairs = torch.tensor(
        [[1, 2, -1, 3, 0, 1, 2, 1], [2, 0, 1, 1, -2, 3, 1, 0], [3, 1, 1, 2, 2, 1, 0, 1.0]]
    )
    x = torch.cat([torch.zeros(1, 8), pairs, -pairs])
    torch.manual_seed(0)
    model = sm.BatchNormNet()
    step = FailingStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
    )
    result = shrink(step)
    assert result.operation.key.path == "norm" and result.nonfinite_rows == (0,)
    assert result.interaction is not None and "batch statistics (bn)" in result.interaction
    assert any("raised and counted as not reproducing" in note for note in result.notes)


def test_in_batch_negatives_need_both_examples() -> None:
    z = torch.randn(16, 2, generator=gen(10)) * 0.3
    z[3], z[12] = torch.tensor([7.0, 0.0]), torch.tensor([-13.0, 0.0])  # exp(91) overflows
    model = sm.PairNet()
    step = FailingStep(
        model,
        torch.optim.SGD([nn.Parameter(torch.zeros(1))]),
        {"z": z, "w": torch.zeros(16)},
        sm.pair_loss,
    )
    result = shrink(step)
    assert result.examples == (3, 12) and result.minimal
    assert (
        result.interaction == "these 2 examples make it go non-finite only together: they interact"
    )
    plain = shrink(step, hint=False)
    assert plain.examples == (3, 12) and plain.replays > result.replays
    cut = shrink(step, hint=False, max_replays=6)
    assert not cut.minimal and cut.replays == 6
    assert any("budget (6) ran out" in note for note in cut.notes)


# ---------------------------------------------------------------- reproduces, then fixed

BROKEN = """
import torch


class Standardise(torch.nn.Module):
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)
"""
FIXED_CODE = BROKEN.replace("x.std(-1, keepdim=True)", "(x.std(-1, keepdim=True) + 1e-6)")


def test_the_generated_test_goes_from_reproduces_to_fixed(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "flipmodel.py").write_text(BROKEN)
    sys.path.insert(0, str(code))
    try:
        import flipmodel  # type: ignore[import-not-found]

        torch.manual_seed(0)
        model = nn.Sequential(flipmodel.Standardise(), nn.Linear(8, 4))
        x = torch.randn(8, 8, generator=gen(11))
        x[6] = 2.0
        step = FailingStep(
            model, torch.optim.SGD(model.parameters(), lr=0.1), sm.batch_of(x, 4), sm.xent
        )
        fixture = tmp_path / "fixture"
        shrink(step, fixture=fixture, bundle=identity("run-flip"))
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("flipmodel", None)
    (test,) = fixture.glob("test_*.py")
    assert "\nFIXED = False\n" in test.read_text()

    def outcome() -> str:
        """The current-code test, run from the file as it is now on the code as it is now."""
        sys.modules.pop("flipmodel", None)
        spec = importlib.util.spec_from_file_location("generated_flip_test", test)
        assert spec is not None and spec.loader is not None
        generated = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(code))
        try:
            spec.loader.exec_module(generated)
            generated.test_current_code()
        except AssertionError as error:
            return f"failed: {error}"
        finally:
            sys.path.remove(str(code))
            sys.modules.pop("flipmodel", None)
        return "passed"

    assert outcome() == "passed"  # reproduces
    (code / "flipmodel.py").write_text(FIXED_CODE)  # the fix is in
    assert outcome().startswith("failed: the current code gives finite values")
    test.write_text(test.read_text().replace("\nFIXED = False\n", "\nFIXED = True\n"))
    assert outcome() == "passed"  # fixed
    (code / "flipmodel.py").write_text(BROKEN)  # the fix reverted: the flipped test says so
    assert outcome().startswith("failed: still 8 non-finite values")
    (code / "flipmodel.py").write_text(FIXED_CODE)
    done = run_pytest(str(fixture), cwd=tmp_path, path=code)  # as the README says, fresh
    assert done.stdout.strip().splitlines()[-1].startswith("4 passed"), done.stdout


# ---------------------------------------------------------------- the sentinel's hook, errors


def test_the_hold_hook_writes_the_fixture_or_logs_why_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hook = ShrinkOnHold(max_replays=8)
    caplog.set_level(logging.INFO, logger="nanrunbook.capture.torch.shrink")
    held = sqrt_step()
    finite = dataclasses.replace(held, batch=sm.batch_of(torch.randn(32, 8, generator=gen(12)), 4))
    fixture = tmp_path / "11.shrink"
    # two micro-batches of one step: the first is finite on its own, the second is shrunk
    result = hook([finite, held], stage="backward", fixture=fixture, bundle=identity("r"))
    assert result is not None and result.fixture == str(fixture)
    assert check_bundle(fixture / "bundle").decision.earliest_nonfinite_stage == "backward"
    assert "shrink: first bad operation: backward of module 'norm' (L2Norm)" in caplog.text
    assert hook(finite, stage="loss", fixture=tmp_path / "x", bundle=identity("r")) is None
    assert "no result for the loss hold: no step goes non-finite replayed alone" in caplog.text
    assert hook(norm_step(), stage="backward", fixture=tmp_path / "x", bundle=identity("r")) is None
    assert "no result for the backward hold: the replay goes non-finite at forward" in caplog.text
    assert not (tmp_path / "x").exists()


def test_a_stage_the_replay_does_not_reach_is_refused() -> None:
    with pytest.raises(ShrinkError, match="goes non-finite at forward, not at backward"):
        shrink(norm_step(), stage="backward")
    # a bundle whose capture chose fewer modules sees the same value one stage later
    earlier = shrink(norm_step(), stage="loss")
    assert earlier.operation.stage == "forward"
    assert earlier.notes == (
        "the bundle answered loss; a module it did not capture is already non-finite",
    )
    with pytest.raises(ShrinkError, match="max_replays"):
        shrink(norm_step(), max_replays=1)
    with pytest.raises(ShrinkError, match="fixture needs bundle="):
        shrink(norm_step(), fixture="/nonexistent/fx")


def test_the_fixture_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = norm_step()
    result = shrink(step)
    target = tmp_path / "fx"
    target.mkdir()
    (target / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        write_fixture(target, step, result, bundle=identity("run-atomic"))
    assert [p.name for p in target.iterdir()] == ["keep"]
    broken = {**identity("run-atomic"), "binding": {}}
    with pytest.raises(FixtureError, match="bundle needs checkpoint, data, loader_cursor"):
        write_fixture(tmp_path / "new", step, result, bundle=broken)

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt  # as if Ctrl-C came while the bundle was replayed

    monkeypatch.setattr(fixture_module, "_bundle", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_fixture(tmp_path / "new", step, result, bundle=identity("run-atomic"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fx"]  # no temporary left behind
    monkeypatch.undo()
    with pytest.raises(FixtureError, match="did not go non-finite again"):
        write_fixture(tmp_path / "other", step, shrink(norm_step(bad=3)), bundle=identity("r"))


TRAINING_SCRIPT = '''
"""A training script as people write them: compute_loss at its top level."""
import sys

import torch
from torch import nn

from nanrunbook.capture.torch.shrink._failing_step import FailingStep
from nanrunbook.capture.torch.shrink._shrink import shrink


def compute_loss(model, batch):
    p = torch.sigmoid(model(batch["x"])[:, 0])
    y = batch["y"].float()
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
    x[9] *= 1000  # sigmoid rounds to 1: log(1 - p) = -inf
    y = torch.ones(32, dtype=torch.long)
    y[9] = 0
    model = nn.Sequential(nn.Linear(8, 1))
    step = FailingStep(model, torch.optim.SGD(model.parameters(), lr=0.1), {"x": x, "y": y},
                       compute_loss)
    bundle = {"run_id": "script", "step": 11, **BUNDLE}
    shrink(step, fixture=sys.argv[1], bundle=bundle)
'''


@pytest.mark.parametrize("guarded", [True, False])
def test_a_compute_loss_in_a_training_scripts_main_gets_its_current_code_test(
    guarded: bool, tmp_path: Path
) -> None:
    """The usual case: compute_loss is defined in the script that trains
    (``__main__``). The generated test imports that script by its path, under
    another name so its main guard does not run; a script that would run code
    when imported gets no current-code test, and the fixture says why."""
    source = TRAINING_SCRIPT.replace("**BUNDLE", f"**{BUNDLE!r}")
    if not guarded:
        source = source.replace("\ndef compute_loss", "\nprint('training')\n\n\ndef compute_loss")
    script = tmp_path / "train.py"
    script.write_text(source)
    fixture = tmp_path / "fixture"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(fixture)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    program = json.loads((fixture / "fixture.json").read_text())["program"]
    if not guarded:
        assert program["current"] is None
        line = source.splitlines().index("print('training')") + 1
        assert f"runs code when imported (line {line})" in program["current_note"]
        return
    assert program["current"]["script"] == str(script.resolve())
    report = tmp_path / "junit.xml"
    ran = run_pytest(str(fixture), f"--junitxml={report}", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    cases = {c.get("name"): c for c in ET.parse(report).getroot().iter("testcase")}
    current = cases["test_current_code"]
    assert current.find("skipped") is None and current.find("failure") is None


def test_the_fixture_readme_lists_only_the_files_written(shrunk: Any) -> None:
    for name in SCENARIOS:
        fixture = shrunk["root"] / name
        readme = (fixture / "README.md").read_text()
        listed = re.findall(r"^\| `([^`]+)` \|", readme, flags=re.M)
        written = {p.name + ("/" if p.is_dir() else "") for p in fixture.iterdir()} - {"README.md"}
        assert set(listed) == written, name
    assert "program.pt2" not in (shrunk["root"] / "guarded" / "README.md").read_text()
