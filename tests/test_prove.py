"""Prove recovery (issue 28): a real run that blows up at step 8 with recovery
points every 3 steps written by the tool; resumed from the last verified one
with the learning rate halved it passes step 8 and 4 more steps (proven);
resumed without a change it holds again at step 8, REPRODUCED (not proven)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import recovery_run
from recovery_run import SPIKE, run_original

from nanrunbook import check_bundle
from nanrunbook.capture.mechanisms import LearningRate
from nanrunbook.capture.torch import latest_recovery_point, prove_recovery
from nanrunbook.capture.torch._entry import Built, EntryError, built_objects, parse_changes

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning")


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("run")
    hold, points = run_original(tmp)
    assert hold is not None and hold.step == SPIKE and hold.stage == "optimizer"
    latest = latest_recovery_point(points)
    assert latest is not None and latest.step == 6  # points at 3 and 6; 9 never came
    return {"bundle": hold.bundle, "point": Path(latest.path), "tmp": tmp}


def _build() -> Built:
    return built_objects(recovery_run.build())


def test_halving_the_learning_rate_is_proven(incident: dict[str, Any], tmp_path: Path) -> None:
    record = prove_recovery(
        incident["point"],
        incident["bundle"],
        build=_build,
        through=SPIKE,
        then=4,
        change=LearningRate(0.5),
        out=tmp_path / "proof",
    )
    assert record.proven, record.reasons
    assert record.digests_match and record.held_at is None
    assert record.steps_run == (7, 8, 9, 10, 11, 12)
    assert (record.diff_verdict, record.diff_outcome, record.changed_items) == (
        "ONE_MECHANISM_CHANGED",
        "FIXED",
        ("optimizer",),
    )
    assert check_bundle(record.new_bundle).decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"
    assert all(step == SPIKE for step, _ in record.warnings)  # the spike's own, not after
    document = json.loads((tmp_path / "proof" / "recovery.json").read_text())
    assert document["proven"] is True and document["change"] == "lr_factor=0.5"
    assert document["incident"]["owner"] == document["reopen"]["decided_by"] == "ml-oncall"


def test_no_change_holds_again_and_is_not_proven(incident: dict[str, Any], tmp_path: Path) -> None:
    record = prove_recovery(
        incident["point"], incident["bundle"], build=_build, through=SPIKE, then=4,
        out=tmp_path / "proof",
    )  # fmt: skip
    assert not record.proven
    assert record.held_at == SPIKE and record.diff_verdict == "REPRODUCED"
    assert "the run held again at the incident step" in record.reasons


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    return subprocess.run(
        [sys.executable, "-m", "nanrunbook", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip


def _prove(incident: dict[str, Any], cwd: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return _cli(
        cwd, "prove", str(incident["point"]), "--entry", "recovery_run:build",
        "--through", str(SPIKE), "--then", "2", "--incident", str(incident["bundle"]), *more,
    )  # fmt: skip


def test_the_cli_proves_and_says_so(incident: dict[str, Any], tmp_path: Path) -> None:
    done = _prove(incident, tmp_path, "--out", "proof", "--change", "lr_factor=0.5", "-f", "kv")
    assert done.returncode == 0, done.stderr
    assert "recovery=PROVEN" in done.stdout.splitlines()
    assert "diff_outcome=FIXED" in done.stdout.splitlines()
    usage = _prove(incident, tmp_path, "--out", "other", "--change", "momentum=0.9")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert "lr_factor=" in usage.stderr


def test_replay_and_prove_take_one_entry_and_one_change_vocabulary(
    incident: dict[str, Any], tmp_path: Path
) -> None:
    """The entry prove resumes (with its loader and sentinel= arguments) rebuilds
    the held step's capsule for replay too, the same change means the same in
    both, and a bad change is refused by both in the same words."""
    capsule = str(incident["bundle"] / "capsule")
    replayed = _cli(
        tmp_path, "replay", capsule, "--entry", "recovery_run:build", "--out", "replayed",
        "--change", "lr_factor=0.5", "-f", "kv",
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    lines = replayed.stdout.splitlines()
    assert "reproduction=REPRODUCED" in lines
    assert "change.1.verdict=ONE_MECHANISM_CHANGED" in lines, replayed.stdout
    assert "change.1.outcome=FIXED" in lines, replayed.stdout
    proved = _prove(incident, tmp_path, "--out", "proof", "--change", "lr_factor=0.5", "-f", "kv")
    assert proved.returncode == 0 and "recovery=PROVEN" in proved.stdout.splitlines()
    for bad in ("momentum=0.9", "lr_factor=1"):
        replay_usage = _cli(tmp_path, "replay", capsule, "--entry", "recovery_run:build",
                            "--out", "never", "--change", bad)  # fmt: skip
        prove_usage = _prove(incident, tmp_path, "--out", "never", "--change", bad)
        assert (replay_usage.returncode, prove_usage.returncode) == (2, 2)
        assert replay_usage.stderr.startswith("nanrunbook: replay: "), replay_usage.stderr
        assert prove_usage.stderr.startswith("nanrunbook: prove: "), prove_usage.stderr
        said = replay_usage.stderr.removeprefix("nanrunbook: replay: ")
        assert said == prove_usage.stderr.removeprefix("nanrunbook: prove: ")
        assert said.count("\n") == 1 and bad.split("=")[0] in said
    assert not (tmp_path / "never").exists()


def test_a_point_that_does_not_verify_is_rejected(incident: dict[str, Any], tmp_path: Path) -> None:
    broken = tmp_path / "point"
    subprocess.run(["cp", "-a", str(incident["point"]), str(broken)], check=True)
    (broken / "rng.json").write_text("{}")
    from nanrunbook.errors import EvidenceRejected

    with pytest.raises(EvidenceRejected) as info:
        prove_recovery(
            broken, incident["bundle"], build=_build, through=SPIKE, then=1,
            out=tmp_path / "proof",
        )  # fmt: skip
    assert "STATE_FILE_SIZE_MISMATCH" in info.value.codes
    assert not (tmp_path / "proof").exists()


@pytest.mark.parametrize("text", ["lr_factor=1", "lr_factor=x", "momentum=0.9", "precision=on"])
def test_a_change_that_is_not_one(text: str) -> None:
    with pytest.raises(EntryError):
        parse_changes([text])


def test_stated_or_verified_is_provenance_not_a_mechanism(
    incident: dict[str, Any], tmp_path: Path
) -> None:
    from nanrunbook.capture.seal import seal_bundle
    from nanrunbook.diff import diff_bundles

    stated = tmp_path / "stated"
    subprocess.run(["cp", "-a", str(incident["bundle"]), str(stated)], check=True)
    manifest = json.loads((stated / "manifest.json").read_text())
    assert manifest["binding"]["checkpoint"]["last_known_good_recovery"] == "verified"
    manifest["binding"]["checkpoint"]["last_known_good_recovery"] = "stated"
    (stated / "manifest.json").write_text(json.dumps(manifest))
    seal_bundle(stated, force=True)
    assert diff_bundles(incident["bundle"], stated).verdict == "REPRODUCED"


def test_a_change_that_cannot_apply_is_refused_before_anything_runs(
    incident: dict[str, Any], tmp_path: Path
) -> None:
    from nanrunbook.capture.mechanisms import AdamEps, ClipMaxNorm

    # prove's loop clips only with the change: no clipping to take away
    with pytest.raises(EntryError, match=r"--change clip=none: .* no clipping to take away"):
        prove_recovery(
            incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
            change=ClipMaxNorm(None), out=tmp_path / "proof",
        )  # fmt: skip
    # the run's SGD has no eps: refused before anything runs
    with pytest.raises(EntryError, match=r"--change eps=0\.001: param group 0 has no eps"):
        prove_recovery(
            incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
            change=AdamEps(1e-3), out=tmp_path / "proof",
        )  # fmt: skip
    [same] = parse_changes(["reduction=sum"])  # the incident's objective is already "sum"
    with pytest.raises(EntryError, match=r"--change reduction=sum: reduction 'sum' -> 'sum'"):
        prove_recovery(
            incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
            change=same, out=tmp_path / "proof",
        )  # fmt: skip
    taken = {**recovery_run.build(), "sentinel": {"capture_steps": (1,)}}
    with pytest.raises(EntryError, match="sets capture_steps: prove sets them itself"):
        prove_recovery(
            incident["point"], incident["bundle"], build=lambda: taken, through=SPIKE, then=1,
            out=tmp_path / "proof",
        )  # fmt: skip
    assert not (tmp_path / "proof").exists()


# Each of replay's other mechanisms in the live loop, from the incident step on
# (the batch's on the incident step's batch alone), and what it makes of step 8:
# the spike's gradient is 40000 on the float16 parameter, SGD at lr 2.
@pytest.mark.parametrize(
    ("text", "proven", "outcome", "item"),
    [
        ("clip=1", True, "FIXED", "optimizer"),  # the update is 2: finite
        ("clip=100000", False, "UNCHANGED", "optimizer"),  # clips nothing: 80000 again
        ("reduction=mean", True, "FIXED", "objective"),  # 40000 / 8 per step: 10000
        ("batch=drop:0", True, "FIXED", "batch"),  # example 0 is the spike's
        ("batch=drop:1", False, "UNCHANGED", "batch"),  # the spike stays
        ("batch=replace:0=1", True, "FIXED", "batch"),
        ("deterministic=on", False, "UNCHANGED", "environment"),  # not a kernel's doing
    ],
)
def test_every_mechanism_of_replay_is_proven_or_not_by_the_run(
    incident: dict[str, Any], tmp_path: Path, text: str, proven: bool, outcome: str, item: str
) -> None:
    import torch

    [change] = parse_changes([text])
    record = prove_recovery(
        incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
        change=change, out=tmp_path / "proof",
    )  # fmt: skip
    assert record.proven is proven, record.reasons
    assert (record.diff_verdict, record.diff_outcome) == ("ONE_MECHANISM_CHANGED", outcome)
    assert record.changed_items == (item,) and record.change == text
    assert record.held_at == (None if proven else SPIKE)
    if proven:
        assert record.steps_run == (7, 8, 9)
    assert record.new_bundle is not None
    manifest = json.loads((Path(record.new_bundle) / "manifest.json").read_text())
    assert manifest["binding"][item]["replay_change"]  # said as a replay says it
    assert not (Path(record.new_bundle) / "capsule").exists()  # the entry would not replay it
    assert not torch.are_deterministic_algorithms_enabled()  # put back when the proof ends


def test_a_change_that_does_not_act_or_fit_the_step_is_not_proven(
    incident: dict[str, Any], tmp_path: Path
) -> None:
    """Known only at the incident step: a reduction compute_loss never asks a
    torch.nn.functional loss for, an example step 8's batch does not have."""

    def by_hand() -> Built:
        def l1(model: Any, batch: Any) -> Any:
            return (model(batch) - batch[:, 5]).abs().sum()

        return built_objects({**recovery_run.build(), "compute_loss": l1})

    [mean] = parse_changes(["reduction=mean"])
    record = prove_recovery(
        incident["point"], incident["bundle"], build=by_hand, through=SPIKE, then=1,
        change=mean, out=tmp_path / "mean",
    )  # fmt: skip
    assert not record.proven
    assert any(r.startswith("--change reduction=mean did not act:") for r in record.reasons)
    [far] = parse_changes(["batch=drop:99"])
    record = prove_recovery(
        incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
        change=far, out=tmp_path / "far",
    )  # fmt: skip
    assert not record.proven and record.steps_run == (7,)
    assert "--change batch=drop:99 did not apply: the step has 8 examples (0 to 7):" \
        " no example 99" in record.reasons  # fmt: skip


def test_replays_per_group_rate_is_proven_too(incident: dict[str, Any], tmp_path: Path) -> None:
    """``lr=1`` (replay's per-group form, every group) is the halved rate here."""
    [change] = parse_changes(["lr=1"])
    record = prove_recovery(
        incident["point"], incident["bundle"], build=_build, through=SPIKE, then=1,
        change=change, out=tmp_path / "proof",
    )  # fmt: skip
    assert record.proven, record.reasons
    assert record.change == "lr=1" and record.changed_items == ("optimizer",)


def test_the_cli_takes_clip_and_refuses_clip_none_in_one_line(
    incident: dict[str, Any], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from nanrunbook.cli import app

    def prove(*more: str) -> Any:
        args = ["prove", str(incident["point"]), "--entry", "recovery_run:build",
                "--through", str(SPIKE), "--then", "1", "--incident", str(incident["bundle"])]  # fmt: skip
        return CliRunner().invoke(app, [*args, *more], prog_name="nanrunbook")

    done = prove("--out", str(tmp_path / "proof"), "--change", "clip=1", "-f", "kv")
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert "recovery=PROVEN" in lines and "change=clip=1" in lines, done.output
    refused = prove("--out", str(tmp_path / "never"), "--change", "clip=none")
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert refused.output.count("\n") == 1 and "no clipping to take away" in refused.output
    assert not (tmp_path / "never").exists()
