"""The examples are real training runs that go NaN on the CPU; each must capture a
bundle with replay_step and get HOLD at the stage where the symptom is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# example -> (earliest non-finite stage, first non-finite tensor, action)
EXPECTED = {
    "nan_loss_log_zero.py": ("loss", "loss", "hold-and-inspect-objective-reduction"),
    "fp16_overflow_gradscaler.py": ("forward", "act/0", "hold-and-replay-forward-activations"),
    "grad_nan_sqrt_zero.py": (
        "backward",
        "grad/0.weight",
        "hold-and-inspect-gradient-path-and-loss-scaling",
    ),
    "sentinel_warmup_blowup.py": ("loss", "loss", "hold-and-inspect-objective-reduction"),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


Ran = Callable[[str], "tuple[subprocess.CompletedProcess[str], Path]"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """Each example runs once per module: (its process, the bundle it wrote)."""
    done: dict[str, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def get(name: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        if name not in done:
            out = tmp_path_factory.mktemp(name.removesuffix(".py")) / "bundle"
            ran = run(str(EXAMPLES / name), "--out", str(out))
            # The sentinel's example is given its incident directory; every example
            # prints where its bundle is.
            printed = [line for line in ran.stdout.splitlines() if line.startswith("bundle: ")]
            bundle = Path(printed[-1].removeprefix("bundle: ")) if printed else out
            done[name] = (ran, bundle)
        return done[name]

    return get


def kv(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_every_example_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))
    assert scripts == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_goes_nan_captures_and_holds(name: str, ran: Ran) -> None:
    stage, tensor, action = EXPECTED[name]
    done, bundle = ran(name)
    assert done.returncode == 1, done.stdout + done.stderr  # HOLD, as the check answers
    assert "Traceback" not in done.stderr
    printed = kv(done.stdout)
    assert printed["decision"] == "HOLD" and printed["earliest_nonfinite"] == stage

    # The command line, on the bundle the example left, gives the same answer.
    checked = run("-m", "nanrunbook", "check", "--format", "kv", str(bundle))
    assert checked.returncode == 1, checked.stdout
    answer = kv(checked.stdout)
    assert (answer["decision"], answer["earliest_nonfinite"], answer["action"]) == (
        "HOLD",
        stage,
        action,
    )
    report = json.loads(run("-m", "nanrunbook", "check", "--format", "json", str(bundle)).stdout)
    assert report["first_nonfinite_tensor"] == tensor


def test_fp16_example_records_the_scalers_own_skip(ran: Ran) -> None:
    done, bundle = ran("fp16_overflow_gradscaler.py")
    assert done.returncode == 1, done.stdout + done.stderr
    manifest = json.loads((bundle / "manifest.json").read_bytes())
    scaler = manifest["binding"]["scaler"]
    assert scaler["mode"] == "dynamic"
    assert (scaler["found_inf"], scaler["step_skipped"]) == (True, True)
    assert scaler["scale_after"] == scaler["scale"] * scaler["backoff_factor"]
    assert manifest["binding"]["precision"]["compute_dtype"] == "F16"
    statuses = [s["status"] for s in manifest["stages"]]
    assert statuses == ["OBSERVED", "OBSERVED", "OBSERVED", "OBSERVED", "NOT_RUN"]
    # The float32 batch itself was finite: the overflow is fp16's, inside the forward.
    assert manifest["stages"][0]["counts"]["nan"] == 0
    assert manifest["stages"][0]["finite_max_abs"] > 65504


def test_log_zero_example_stops_before_backward(ran: Ran) -> None:
    done, bundle = ran("nan_loss_log_zero.py")
    assert done.returncode == 1, done.stdout + done.stderr
    manifest = json.loads((bundle / "manifest.json").read_bytes())
    assert [s["status"] for s in manifest["stages"]] == ["OBSERVED"] * 3 + ["NOT_RUN"] * 2
    assert manifest["stages"][1]["counts"]["nan"] == 0  # the probabilities were finite
    assert manifest["binding"]["scaler"]["mode"] == "none"


def test_sqrt_zero_example_holds_at_backward_under_a_finite_loss(ran: Ran) -> None:
    done, bundle = ran("grad_nan_sqrt_zero.py")
    assert done.returncode == 1, done.stdout + done.stderr
    stages = json.loads((bundle / "manifest.json").read_bytes())["stages"]
    assert [s["status"] for s in stages] == ["OBSERVED"] * 5  # no scaler: the copy stepped
    loss, backward, optimizer = stages[2], stages[3], stages[4]
    assert loss["counts"]["finite"] == loss["counts"]["elements"] == 1
    assert backward["counts"]["nan"] == backward["counts"]["elements"]  # every gradient
    assert optimizer["counts"]["nan"] > 0  # the update the real step would have applied


def test_sentinel_example_warns_before_it_holds(ran: Ran) -> None:
    done, bundle = ran("sentinel_warmup_blowup.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "GRAD_NORM_SPIKE" in done.stderr  # the log, before the hold
    [summary] = [line for line in done.stdout.splitlines() if line.startswith("telemetry:")]
    first_warning, held = (int(n) for n in re.findall(r"step (\d+)", summary))
    assert first_warning < held
    assert bundle.name == str(held) and bundle.parent.name == "example-warmup-blowup"


def test_fp16_example_warns_that_the_input_is_beyond_the_compute_dtype(ran: Ran) -> None:
    """Issue 11: the float32 batch holds 70354.1 while the compute dtype is F16: the
    cause of the overflow, named on the input, without changing the HOLD."""
    done, bundle = ran("fp16_overflow_gradscaler.py")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(run("-m", "nanrunbook", "check", "--format", "json", str(bundle)).stdout)
    beyond = [w for w in report["warnings"] if w["code"] == "BEYOND_COMPUTE_DTYPE"]
    assert [(w["stage"], w["tensor"], w["index"]) for w in beyond] == [("input", "batch/x", 0)]
    assert "F16" in beyond[0]["message"] and "65504" in beyond[0]["message"]
    x = report["stages"][0]["tensors"][0]
    assert x["extremes"]["max_abs"] > 65504 >= x["headroom"]["compute"]["max_finite"]
    assert (report["decision"], report["exit_code"]) == ("HOLD", 1)


def test_fp16_example_text_report_names_the_input_beyond_f16(ran: Ran) -> None:
    """Issue 11: the one-screen report shows the warning in its own section and the
    checklist names the extreme that overflowed F16, with its distance upstream."""
    done, bundle = ran("fp16_overflow_gradscaler.py")
    assert done.returncode == 1, done.stdout + done.stderr
    env = {**os.environ, "COLUMNS": "80"}

    def check(*options: str) -> str:
        # From the bundle's directory: a long temporary path would wrap the bundle
        # row and cost the screen a line, which cuts a step (by design).
        return subprocess.run(
            [sys.executable, "-m", "nanrunbook", "check", *options, bundle.name],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=bundle.parent,
        ).stdout

    text = check()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len(text.splitlines()) <= 40
    flat = " ".join(text.split())
    assert "Warnings (1, upstream first) BEYOND_COMPUTE_DTYPE input batch/x: max |value|" in flat
    assert re.search(
        r"Inspect upstream finite extremes: batch/x \(input, F32\) reached [\d.]+, 0\.1 bits "
        r"above F16's max \(compute dtype\), one stage before",
        flat,
    ), flat
    # In full with --checklist.
    flat = " ".join(check("--checklist").split())
    assert re.search(
        r"Inspect upstream finite extremes: batch/x \(input, F32\) reached [\d.]+, 0\.1 bits "
        r"above F16's max \(the compute dtype\), one stage before the first non-finite tensor\. "
        r"Warnings upstream: BEYOND_COMPUTE_DTYPE at batch/x \(input\)\.",
        flat,
    ), flat


REFUSING = ("nan_loss_log_zero.py", "fp16_overflow_gradscaler.py")
# Each example's main() on each --out given, its stdout and stderr captured: one
# process (one torch import) for them all, where a process each cost 4 imports.
_REFUSALS = """
import contextlib, io, json, runpy, sys
examples = sys.argv[1]
sys.path.insert(0, examples)  # as running a script does: its _report module
answers = []
for name, out in json.loads(sys.argv[2]):
    main = runpy.run_path(f"{examples}/{name}", run_name="example")["main"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["--out", out])
    answers.append([code, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(answers))
"""


Refusals = dict[str, dict[str, tuple[Path, list[Any]]]]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> Refusals:
    """example -> {"missing": ..., "taken": ...}: an --out in a directory that does
    not exist and one that exists, each with [exit code, stdout, stderr]."""
    tmp = tmp_path_factory.mktemp("refused")
    (tmp / "taken").mkdir()
    outs = {"missing": tmp / "no-such-dir" / "bundle", "taken": tmp / "taken"}
    given = [[name, str(out)] for name in REFUSING for out in outs.values()]
    done = run("-c", _REFUSALS, str(EXAMPLES), json.dumps(given))
    assert done.returncode == 0, done.stderr
    answers = iter(json.loads(done.stdout))
    return {name: {kind: (out, next(answers)) for kind, out in outs.items()} for name in REFUSING}


@pytest.mark.parametrize("name", REFUSING)
def test_an_out_that_cannot_be_written_is_one_line_and_exit_2(
    name: str, refusals: Refusals
) -> None:
    missing, answer = refusals[name]["missing"]
    assert answer == [2, "", f"--out {missing}: the directory {missing.parent} does not exist\n"]
    taken, (code, _, stderr) = refusals[name]["taken"]
    assert (code, stderr) == (2, f"--out {taken}: exists; give a new path for the bundle\n")
