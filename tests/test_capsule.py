"""The incident capsule: written at a hold beside the bundle, replayed after the
training process is gone (``Capsule``, ``nanrunbook replay``), bit for bit, and
with one mechanism changed; every bad input refused with its exit code, and
nothing in a capsule ever run."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from capsule_runs import BUILDS, build_regressor, train
from typer.testing import CliRunner

from nanrunbook.capture._state_manifest import (
    FileDigest,
    StateDirManifest,
    manifest_document,
)
from nanrunbook.capture.torch import Capsule
from nanrunbook.capture.torch._entry import EntryError, build, load_entry, parse_changes
from nanrunbook.capture.torch._state_dir import StateDirRejected
from nanrunbook.capture.torch.capsule import replay_capsule
from nanrunbook.cli import app
from nanrunbook.diff import diff_bundles

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
runner = CliRunner()


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One data-NaN run with two micro-batches a step, held at step 3."""
    return train("data-nan", tmp_path_factory.mktemp("held") / "incident")


@pytest.fixture
def incident(held: Any, tmp_path: Path) -> Path:
    """A copy of the held step's incident directory (bundle with its capsule)."""
    copy = tmp_path / "incident" / "3"
    shutil.copytree(held.bundle, copy)
    return copy


def cli(*args: str) -> Any:
    return runner.invoke(app, ["replay", *args], prog_name="nanrunbook")


def files_and_times(root: Path) -> dict[Path, tuple[bytes, int]]:
    return {
        p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()
    }


def reseal(capsule: Path) -> None:
    """Write the manifest again over the files as they are now (a forger's capsule)."""
    manifest = orjson.loads((capsule / "manifest.json").read_bytes())
    files = {}
    for path in sorted(capsule.rglob("*")):
        name = path.relative_to(capsule).as_posix()
        if path.is_file() and not path.is_symlink() and name != "manifest.json":
            data = path.read_bytes()
            files[name] = FileDigest(hashlib.sha256(data).hexdigest(), len(data))
    document = StateDirManifest(manifest["format"], files, manifest["header"])
    (capsule / "manifest.json").write_bytes(manifest_document(document))


# ------------------------------------------------------------ the capsule


def test_a_hold_leaves_a_capsule_that_names_its_bundle(held: Any) -> None:
    assert held.capsule == held.bundle / "capsule" and held.capsule_error is None
    assert f"capsule {held.capsule}" in str(held)
    capsule = Capsule.open(held.capsule)
    assert capsule.verify() == ()
    assert (capsule.run_id, capsule.step) == ("data-nan", 3)
    assert capsule.incident_bundle == held.bundle.resolve()
    assert capsule.bundle_evidence_id == held.report.manifest.evidence_content_id
    assert capsule.reproduced == held.reproduced and capsule.reproduced.verdict == "REPRODUCED"
    assert capsule.manifest.format == "nanrunbook-capsule-v1"
    assert len(capsule.documents["micro_batches"]) == 2
    # The bundle contract ignores the directory: the bundle checks as before.
    from nanrunbook import check_bundle

    assert check_bundle(held.bundle).decision.earliest_nonfinite_stage == "input"


@pytest.mark.parametrize(
    ("kind", "change", "outcome"),
    [
        # two micro-batches, dropout, batch norm, a scheduler
        ("data-nan", "batch=drop:10", "FIXED"),
        ("noisy", "batch=replace:10=11", "FIXED"),  # the loop's own generator, replayed
        ("eps0", "eps=1e-8", "FIXED"),  # a non-finite update, rolled back from the snapshot
        ("static", "precision=fp32", "FIXED"),  # a static loss scale overflowing fp16 grads
        # A LambdaLR warm-up written wrong: the held step's loss overflows on the
        # weights the absurd rate already made; its own rate cannot fix it.
        ("absurd-lr", "lr=0.01", "UNCHANGED"),
    ],
)
def test_each_kind_replays_bit_for_bit_and_a_change_is_judged(
    kind: str, change: str, outcome: str, tmp_path: Path
) -> None:
    hold = train(kind, tmp_path / "incident")
    assert hold.reproduced is not None and hold.reproduced.verdict == "REPRODUCED"
    result = replay_capsule(
        Capsule.open(hold.capsule),
        build(BUILDS[kind]),
        [(change, *parse_changes([change]))],
        tmp_path / "out",
    )
    assert result.reproduction is not None and result.reproduction.verdict == "REPRODUCED"
    assert result.reproduction.same_evidence  # the incident bundle, bit for bit
    [changed] = result.changes
    assert (changed.comparison.verdict, changed.comparison.outcome) == (
        "ONE_MECHANISM_CHANGED",
        outcome,
    )
    assert result.exit_code(require_fixed=True) == (0 if outcome == "FIXED" else 1)


def test_the_library_replays_with_the_entry_function(held: Any, tmp_path: Path) -> None:
    capsule = Capsule.open(held.capsule)
    report = capsule.replay(build_regressor, out=tmp_path / "again")
    assert report.manifest.evidence_content_id == capsule.bundle_evidence_id
    [drop] = parse_changes(["batch=drop:10"])
    fixed = capsule.replay(build_regressor, out=tmp_path / "dropped", change=drop)
    assert fixed.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"
    assert diff_bundles(tmp_path / "again", tmp_path / "dropped").outcome == "FIXED"


def test_an_fp16_overflow_replays_from_a_fresh_process_and_fp32_fixes_it(tmp_path: Path) -> None:
    """The training process holds and exits; another process replays the capsule."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    trained = subprocess.run(
        [sys.executable, str(TESTS / "capsule_runs.py"), "fp16", str(tmp_path / "incident")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    capsule = Path(trained.stdout.strip().splitlines()[-1])
    assert capsule.is_dir() and capsule.name == "capsule"
    replay = [sys.executable, "-m", "nanrunbook", "replay", str(capsule), "--entry"]
    replayed = subprocess.run(
        [*replay, "capsule_runs:build_fp16", "--change", "precision=fp32", "--format", "kv",
         "--out", str(tmp_path / "out"), "--require-fixed"],
        capture_output=True, text=True, timeout=300, env=env, cwd=TESTS,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    lines = replayed.stdout.splitlines()
    for expected in (
        "held_process=REPRODUCED",
        "reproduction=REPRODUCED",
        "reproduction.verdict=REPRODUCED",
        "reproduction.same_evidence=true",
        "change.1.verdict=ONE_MECHANISM_CHANGED",
        "change.1.outcome=FIXED",
        "change.1.changed=precision",
    ):
        assert expected in lines, replayed.stdout


def test_text_output_says_reproduced_and_the_change(incident: Path, tmp_path: Path) -> None:
    result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--change", "lr=0:0.5", "--out", str(tmp_path / "out"))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "held process: REPRODUCED on host" in result.output
    assert "nanrunbook diff: REPRODUCED" in result.output
    assert "--change lr=0:0.5" in result.output
    assert "ONE_MECHANISM_CHANGED optimizer: UNCHANGED" in result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if "/" not in line)
    document = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                   "--format", "json", "--out", str(tmp_path / "json"))  # fmt: skip
    parsed = orjson.loads(document.output)
    assert parsed["reproduction"]["verdict"] == "REPRODUCED" and parsed["exit_code"] == 0
    assert parsed["held_process"]["verdict"] == "REPRODUCED"


def test_the_text_answer_keeps_80_columns_with_a_long_out_path(
    incident: Path, tmp_path: Path
) -> None:
    """Each line wraps as the other text answers do; a path is folded, not lost."""
    out = tmp_path / ("a-rather-long-directory-for-the-replays-" * 3) / "of-this-incident"
    result = runner.invoke(
        app,
        ["replay", str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
         "--change", "lr=0:0.5", "--out", str(out)],
        prog_name="nanrunbook", env={"COLUMNS": "80"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    widest = max(lines, key=len)
    assert len(widest) <= 80, f"{len(widest)} columns: {widest!r}"
    # The same facts in the same order: capsule, held process, replay, its diff,
    # then the change and its diff.
    starts = [
        "capsule",
        "held process: REPRODUCED on host",
        "replay as recorded:",
        "against the incident bundle",
        "nanrunbook diff: REPRODUCED",
        "--change lr=0:0.5:",
        "against the replay as recorded:",
        "nanrunbook diff: ONE_MECHANISM_CHANGED optimizer: UNCHANGED",
    ]
    found = [next(i for i, line in enumerate(lines) if line.startswith(s)) for s in starts]
    assert found == sorted(found), lines
    assert lines[found[5] - 1] == ""  # a blank line before each change, as before
    joined = "".join(lines)  # a folded path is whole again once its lines are joined
    for path in (incident / "capsule", out / "replay", out / "change-1-lr"):
        assert str(path) in joined, path


def test_kv_and_json_answers_are_the_diff_lines_and_the_replay_document(
    incident: Path, tmp_path: Path
) -> None:
    """kv: the capsule's lines, then each comparison's diff lines under its
    prefix, as shell playbooks parse them; json: the replay document."""
    import io

    from nanrunbook.capture.torch.capsule import replay_document
    from nanrunbook.output.json import json_text
    from nanrunbook.output.renderers import RENDERERS

    texts = ["lr=0:0.5", "batch=drop:10"]
    result = replay_capsule(
        Capsule.open(incident / "capsule"),
        build(load_entry("capsule_runs:build_regressor")),
        list(zip(texts, parse_changes(texts), strict=True)),
        tmp_path / "out",
    )

    def rendered(fmt: str, *args: Any, method: str = "replay", **options: Any) -> str:
        out = io.StringIO()
        getattr(RENDERERS[fmt], method)(*args, out, **options)
        return out.getvalue()

    kv = rendered("kv", result, require_fixed=True).splitlines()
    diff_keys = [
        line.partition("=")[0]
        for line in rendered("kv", result.reproduction, method="diff").splitlines()
    ]
    assert kv[:5] == [
        "capsule_run=data-nan",
        "capsule_step=3",
        "held_process=REPRODUCED",
        "reproduction=REPRODUCED",
        "changes=2",
    ]
    assert [line.partition("=")[0] for line in kv[5:]] == [
        f"{prefix}.{key}"
        for prefix in ("reproduction", "change.1", "change.2")
        for key in diff_keys
    ]
    assert "change.2.outcome=FIXED" in kv and "change.1.outcome=UNCHANGED" in kv
    for required in (False, True):
        assert rendered("json", result, require_fixed=required) == json_text(
            replay_document(result, require_fixed=required)
        )
    assert orjson.loads(rendered("json", result, require_fixed=True))["exit_code"] == 1


def test_require_fixed_with_a_change_that_does_not_fix_exits_1(
    incident: Path, tmp_path: Path
) -> None:
    result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--change", "eps=0.001", "--require-fixed", "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 1, result.output


# ------------------------------------------------------------ bad input


def test_an_edited_and_a_truncated_file_are_both_named(incident: Path, tmp_path: Path) -> None:
    capsule = incident / "capsule"
    data = next((capsule / "state").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    (capsule / "recipe.json").write_bytes((capsule / "recipe.json").read_bytes()[:-5])
    result = cli(str(capsule), "--entry", "capsule_runs:build_regressor",
                 "--format", "kv", "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 3, result.output
    assert "violation=STATE_FILE_DIGEST_MISMATCH" in result.output
    assert "violation=STATE_FILE_SIZE_MISMATCH" in result.output
    assert not (tmp_path / "o").exists()


def test_a_half_written_capsule_and_another_version_are_rejected(
    incident: Path, tmp_path: Path
) -> None:
    capsule = incident / "capsule"
    manifest = capsule / "manifest.json"
    saved = manifest.read_bytes()
    manifest.write_bytes(saved.replace(b"nanrunbook-capsule-v1", b"nanrunbook-capsule-v2"))
    other = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv")
    assert other.exit_code == 3 and "violation=STATE_FORMAT_UNKNOWN" in other.output
    manifest.unlink()
    half = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv")
    assert half.exit_code == 3 and "violation=STATE_MANIFEST_MISSING" in half.output


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("no_such_module_27:build", "ModuleNotFoundError: No module named 'no_such_module_27'"),
        ("capsule_runs:HELD", "HELD is a int, not callable"),
        ("capsule_runs:nothing_here", "capsule_runs has no nothing_here"),
        ("capsule_runs", "expected module:function"),
        ("capsule_runs:_nan_micro_batches", "failed: TypeError:"),
        ("capsule_runs:train", "failed: TypeError:"),
    ],
)
def test_a_bad_entry_is_a_usage_error_with_its_own_line(
    entry: str, said: str, incident: Path, tmp_path: Path
) -> None:
    result = cli(str(incident / "capsule"), "--entry", entry, "--out", str(tmp_path / "o"))
    assert result.exit_code == 2, result.output
    assert said in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line]) == 1


def wrong_return() -> list[Any]:
    return [1, 2]


def missing_optimizer() -> dict[str, Any]:
    return {"model": torch.nn.Linear(2, 2), "compute_loss": len, "schedular": None}


def test_an_entry_returning_the_wrong_things_is_refused() -> None:
    with pytest.raises(EntryError, match="returned a list: expected a dict or a dataclass"):
        build(wrong_return)
    with pytest.raises(EntryError, match="missing optimizer; unknown field"):
        build(missing_optimizer)


def other_width() -> dict[str, Any]:
    from sentinel_support import Regressor

    built = build_regressor()
    model = Regressor(width=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return {**built, "model": model, "optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2)}  # fmt: skip


def in_double() -> dict[str, Any]:
    built = build_regressor()
    built["model"].double()
    return built


def with_sgd() -> dict[str, Any]:
    built = build_regressor()
    built["optimizer"] = torch.optim.SGD(built["model"].parameters(), lr=0.1)
    built["scheduler"] = None
    return built


@pytest.mark.parametrize(
    ("entry", "codes"),
    [
        ("test_capsule:other_width", ["STATE_SHAPE_MISMATCH"]),
        ("test_capsule:in_double", ["STATE_DTYPE_MISMATCH"]),
        ("test_capsule:with_sgd", ["CAPSULE_OBJECTS_DIFFER"] * 2),
    ],
)
def test_built_objects_that_do_not_fit_are_named(
    entry: str, codes: list[str], incident: Path, tmp_path: Path
) -> None:
    result = cli(str(incident / "capsule"), "--entry", entry, "--format", "kv",
                 "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 3, result.output
    found = [
        line.split()[0] for line in result.output.splitlines() if line.startswith("violation=")
    ]
    assert found == [f"violation={code}" for code in codes]
    with pytest.raises(StateDirRejected) as error:
        Capsule.open(incident / "capsule").load(build(load_entry(entry)))
    assert (
        "body.0.weight" in str(error.value)
        or "optimizer SGD" in str(error.value)
        or "Adam" in str(error.value)
    )


def test_an_unknown_mechanism_or_value_lists_the_valid_ones(incident: Path, tmp_path: Path) -> None:
    for change in ("colour=blue", "precision=fp8", "batch=shuffle", "lr=fast"):
        result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                     "--change", change, "--out", str(tmp_path / "o"))  # fmt: skip
        assert result.exit_code == 2, (change, result.output)
        assert not (tmp_path / "o").exists()
    assert "valid are precision=fp32" in cli(str(incident / "capsule"), "--entry", "x:y",
                                             "--change", "colour=blue").output  # fmt: skip
    # A change that cannot act is a usage error too, with its reason.
    result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--change", "reduction=sum", "--out", str(tmp_path / "r"))  # fmt: skip
    assert result.exit_code == 2 and "no torch.nn.functional loss" in result.output


def test_a_document_that_does_not_read_is_rejected(incident: Path) -> None:
    capsule = incident / "capsule"
    document = orjson.loads((capsule / "incident.json").read_bytes())
    del document["step"]
    (capsule / "incident.json").write_bytes(orjson.dumps(document))
    reseal(capsule)
    result = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv")
    assert result.exit_code == 3, result.output
    code = "CAPSULE_DOCUMENT_INVALID"
    assert f"violation={code}" in result.output


@pytest.mark.parametrize("run_id", ["x$(touch pwned)", "a b", "", 7])
def test_a_run_id_a_shell_would_read_as_a_command_is_rejected(
    incident: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_id: Any
) -> None:
    # The run id names the replay's directory and stands in the kv answer
    # that playbooks eval: an identifier, as every bundle's run id is.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    capsule = incident / "capsule"
    document = orjson.loads((capsule / "incident.json").read_bytes())
    document["run_id"] = run_id
    (capsule / "incident.json").write_bytes(orjson.dumps(document))
    reseal(capsule)
    result = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv")
    assert result.exit_code == 3, result.output
    assert "violation=CAPSULE_DOCUMENT_INVALID" in result.output
    assert "$(" not in result.output
    assert [p.name for p in here.iterdir()] == []  # nothing ran, no replay directory


class _Run:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_capsule_runs_nothing(incident: Path, tmp_path: Path) -> None:
    capsule = incident / "capsule"
    marker = tmp_path / "ran"
    (capsule / "state" / ".metadata").write_bytes(pickle.dumps(_Run(str(marker))))
    reseal(capsule)  # its digests agree: only the restricted reader stands in the way
    result = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv",
                 "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 3 and "violation=STATE_METADATA_REFUSED" in result.output
    assert not marker.exists()


def test_a_manifest_pointing_outside_and_a_symlink_out_are_rejected(
    incident: Path, tmp_path: Path
) -> None:
    capsule = incident / "capsule"
    outside = tmp_path / "secret.json"
    outside.write_bytes(b"{}")
    recipe = capsule / "recipe.json"
    recipe.unlink()
    recipe.symlink_to(outside)
    manifest = orjson.loads((capsule / "manifest.json").read_bytes())
    manifest["files"]["../../secret.json"] = {"sha256": "0" * 64, "size": 2}
    (capsule / "manifest.json").write_bytes(orjson.dumps(manifest))
    result = cli(str(capsule), "--entry", "capsule_runs:build_regressor", "--format", "kv")
    assert result.exit_code == 3, result.output
    assert "violation=STATE_PATH_UNSAFE" in result.output
    assert "violation=STATE_FILE_SYMLINK" in result.output


def test_a_replay_never_writes_into_the_capsule_or_the_bundle(
    incident: Path, tmp_path: Path
) -> None:
    before = files_and_times(incident)
    ok = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
             "--change", "batch=drop:10", "--out", str(tmp_path / "o"))  # fmt: skip
    assert ok.exit_code == 0, ok.output
    inside = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--out", str(incident / "capsule" / "replays"))  # fmt: skip
    assert inside.exit_code == 2 and "a replay never writes there" in inside.output
    again = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                "--out", str(tmp_path / "o"))  # fmt: skip
    assert again.exit_code == 2 and "exists" in again.output
    assert files_and_times(incident) == before


def test_a_bundle_that_is_not_the_capsules_own_is_refused(incident: Path, tmp_path: Path) -> None:
    from nanrunbook.capture.seal import seal_bundle

    manifest = orjson.loads((incident / "manifest.json").read_bytes())
    manifest["incident_owner"] = "someone-else"
    del manifest["evidence_content_id"]
    (incident / "manifest.json").write_bytes(orjson.dumps(manifest))
    seal_bundle(incident)  # a valid bundle, another evidence
    result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--format", "kv", "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 3, result.output
    code = "CAPSULE_BUNDLE_DIFFERS"
    assert f"violation={code}" in result.output
    assert not (tmp_path / "o").exists()


def test_a_captured_step_that_goes_on_leaves_a_capsule_of_its_pre_step_state(
    tmp_path: Path,
) -> None:
    """capture_steps= captures step 2, which goes on: its capsule is written at
    its decision, before the update (the real state is still the pre-step
    state), replays to its bundle bit for bit, and the run ends as the same run
    without the capture; no other step writes one."""
    from sentinel_support import facts, mse, quiet_thresholds, regression_batch

    from nanrunbook.capture.torch import Sentinel

    def run(capture: list[int], where: Path) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        built = build_regressor()
        model, optimizer, scheduler = built["model"], built["optimizer"], built["scheduler"]
        sentinel = Sentinel(model, optimizer, mse, scheduler=scheduler, capture_steps=capture,
                            thresholds=quiet_thresholds(), **facts("captured", where))  # fmt: skip
        for i in (1, 2, 3):
            optimizer.zero_grad()
            sentinel.forward(regression_batch(i)).backward()
            optimizer.step()
            scheduler.step()
        sentinel.close()
        return model, sentinel

    plain, _ = run([], tmp_path / "plain")
    model, sentinel = run([2], tmp_path / "captured")
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name  # the capture changed nothing of the run
    bundle = sentinel.captured[2]
    steps = sorted(p.name for p in bundle.parent.iterdir() if p.is_dir())
    assert steps == ["2"] and (bundle / "capsule").is_dir()  # one step asked for, one capsule
    capsule = Capsule.open(bundle / "capsule")
    report = capsule.replay(build_regressor, out=tmp_path / "again")
    assert report.manifest.evidence_content_id == capsule.bundle_evidence_id
    assert report.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"


def test_a_captured_step_that_goes_on_keeps_its_forwards_running_stats(tmp_path: Path) -> None:
    """A BatchNorm run whose step 2 is captured (capture_steps=) and goes on ends
    bit for bit as the same run without the capture: the capture replays from
    the pre-forward buffers and the run keeps the ones its forward wrote."""
    from sentinel_support import facts, mse_column, quiet_thresholds, regression_batch

    from nanrunbook.capture.torch import Sentinel
    from nanrunbook.capture.torch.replay._binding import model_item

    before: dict[Path, str] = {}  # the model item's id before step 2's forward

    def run(capture: list[int], where: Path) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sentinel = Sentinel(model, optimizer, mse_column, capture_steps=capture,
                            thresholds=quiet_thresholds(), **facts("bn", where))  # fmt: skip
        for i in (1, 2, 3):
            if i == 2:
                before[where] = model_item(model, optimizer)["id"]
            optimizer.zero_grad()
            sentinel.forward(regression_batch(i)).backward()
            optimizer.step()
        sentinel.close()
        return model, sentinel

    plain, _ = run([], tmp_path / "plain")
    captured, sentinel = run([2], tmp_path / "captured")
    assert 2 in sentinel.captured
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), captured.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name  # running_mean, running_var, num_batches_tracked...
    assert int(captured[1].num_batches_tracked) == 3
    manifest = orjson.loads((sentinel.captured[2] / "manifest.json").read_bytes())
    assert manifest["binding"]["model"]["id"] == before[tmp_path / "captured"]  # pre-step state


def test_a_capsule_that_travelled_alone_still_replays(incident: Path, tmp_path: Path) -> None:
    alone = tmp_path / "mailed" / "capsule"
    shutil.copytree(incident / "capsule", alone)
    result = cli(str(alone), "--entry", "capsule_runs:build_regressor",
                 "--change", "batch=drop:10", "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "no incident bundle beside the capsule" in result.output
    assert "ONE_MECHANISM_CHANGED batch: FIXED" in result.output


def test_a_capsule_one_process_wrote_is_refused_under_a_job_of_several_ranks(
    incident: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 starts each rank
    result = cli(str(incident / "capsule"), "--entry", "capsule_runs:build_regressor",
                 "--out", str(tmp_path / "o"))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "written by one process, this job has 2 ranks" in result.output
    assert len([line for line in result.output.splitlines() if line]) == 1
    assert not (tmp_path / "o").exists()
