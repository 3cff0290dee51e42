"""``nanrunbook replay`` of a sharded capsule as a distributed job: a real
2-rank FSDP2 hold (gloo, CPU, one spawned job) writes the capsule, a real
``torchrun --nproc-per-node 2`` replays it, every rank writing its bundle into
``--out`` as an incident set that checks as the incident's; a job of another
world size, or no job, is refused in one line (exit 2) on every rank, and a
rank whose entry fails stops the other with its reason."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fsdp_support import ShardedCase, sharded_worker
from test_sentinel_ranks import set_verdict, spawn

from nanrunbook import check_bundle

TESTS = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def capsule(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fsdp2-replay")
    results = spawn(
        sharded_worker,
        tmp,
        2,
        ShardedCase("fsdp-replay", scenario="nan-rank1", torchrun=True),
        deadline=240.0,
    )
    assert all(r["capsule"] for r in results), [r["capsule_error"] for r in results]
    return Path(results[0]["capsule"])


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _replay(
    capsule: Path, out: Path, *launch: str, fmt: str = "json",
    entry: str = "fsdp_support:replay_build",
) -> Any:  # fmt: skip
    command = [
        *launch, "-m", "nanrunbook", "replay", str(capsule),
        "--entry", entry, "--out", str(out), "--format", fmt,
    ]  # fmt: skip
    environment = {**os.environ, "NANRUNBOOK_REPLAY_TIMEOUT": "30"}
    return subprocess.run(
        command, cwd=TESTS, env=environment, capture_output=True, text=True, timeout=240,
        check=False,
    )  # fmt: skip


def _torchrun(nproc: int) -> list[str]:
    return [
        str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()),
    ]  # fmt: skip


def test_torchrun_replays_every_rank_and_reproduces_the_incident_set(
    capsule: Path, tmp_path: Path
) -> None:
    out = tmp_path / "replay"
    shown = _replay(capsule, out, *_torchrun(2))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    document = json.loads(shown.stdout)  # printed once, by rank 0
    assert document["verdict"] == "REPRODUCED" and document["world_size"] == 2
    assert [r["verdict"] for r in document["ranks"]] == ["REPRODUCED", "REPRODUCED"]
    replayed = out / "fsdp-replay" / "3"
    incident = capsule.parent.parent
    assert sorted(p.name for p in replayed.iterdir()) == ["rank-00000", "rank-00001"]
    for rank in (0, 1):
        member = f"rank-{rank:05d}"
        theirs, ours = check_bundle(incident / member), check_bundle(replayed / member)
        assert ours.decision == theirs.decision, rank
        assert ours.manifest.binding.details == theirs.manifest.binding.details, rank
        manifest = json.loads((replayed / member / "manifest.json").read_text())
        sources = [stage["tensor_set"]["probe_source"] for stage in manifest["stages"]]
        assert all("replayed by nanrunbook replay under torchrun" in s for s in sources)
    # The replay's incident set answers as the incident's: rank 1 began it, at input.
    assert set_verdict(replayed) == set_verdict(incident)
    assert set_verdict(replayed)[:2] == ([1], "input")


def test_another_world_size_no_job_or_a_failing_rank_is_refused_on_every_rank(
    capsule: Path, tmp_path: Path
) -> None:
    alone = _replay(capsule, tmp_path / "alone", sys.executable, fmt="text")
    assert alone.returncode == 2, alone.stdout + alone.stderr
    assert "written by 2 ranks under FSDP2" in alone.stderr
    assert "torchrun --nproc-per-node 2" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1 and "Traceback" not in alone.stderr
    one = _replay(capsule, tmp_path / "one", *_torchrun(1), fmt="text")
    # torchrun exits 1 for a failed child and prints its own summary: the rank's
    # code is in it, and the rank itself said one line.
    assert one.returncode == 1 and re.search(r"exitcode\s*: 2 ", one.stderr), one.stderr
    lines = [line for line in one.stderr.splitlines() if line.startswith("nanrunbook: replay:")]
    assert len(lines) == 1 and "this job has 1" in lines[0], one.stderr
    assert "nanrunbook/" not in one.stderr  # no frame of ours
    # A rank whose entry fails stops the other (which built its model) with its reason.
    failing = _replay(capsule, tmp_path / "failing", *_torchrun(2), fmt="text",
                      entry="fsdp_support:replay_build_failing_on_rank_1")  # fmt: skip
    assert failing.returncode == 1, failing.stderr
    assert len(re.findall(r"exitcode\s*: 2 ", failing.stderr)) == 2, failing.stderr
    said = [line for line in failing.stderr.splitlines() if line.startswith("nanrunbook: replay:")]
    assert (
        said
        == [
            "nanrunbook: replay: rank 1: the entry replay_build_failing_on_rank_1() failed:"
            " RuntimeError: no data on this node"
        ]
        * 2
    ), failing.stderr
    assert not [p.name for p in tmp_path.iterdir()]  # no --out made


def test_a_change_or_a_bad_timeout_of_a_sharded_replay_is_refused_in_one_line(
    capsule: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from nanrunbook.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before any process group is started

    def replay(*more: str) -> Any:
        command = ["replay", str(capsule), "--entry", "absent:build", "--out", str(tmp_path / "o")]
        return CliRunner().invoke(app, [*command, *more], prog_name="nanrunbook")

    changed = replay("--change", "lr=0.001")
    monkeypatch.setenv("NANRUNBOOK_REPLAY_TIMEOUT", "soon")
    late = replay()
    for result, said in (
        (changed, "--change is not built for a sharded capsule's replay"),
        (late, "NANRUNBOOK_REPLAY_TIMEOUT='soon': expected a positive number of seconds"),
    ):
        assert result.exit_code == 2, result.output
        assert said in result.output
        assert len([line for line in result.output.splitlines() if line]) == 1
    assert not (tmp_path / "o").exists()


def test_the_library_refuses_to_open_a_sharded_capsule_as_one_processs(capsule: Path) -> None:
    """``Capsule.open`` takes one process's capsule; a sharded one is verified,
    then refused with the code that names how it is replayed."""
    from nanrunbook.capture.torch import Capsule
    from nanrunbook.errors import EvidenceRejected

    with pytest.raises(EvidenceRejected) as info:
        Capsule.open(capsule)
    assert info.value.codes == ("CAPSULE_SHARDED",)
    assert "replay it under torchrun" in info.value.violations[0].message


def _sharded_result(root: Path) -> Any:
    """A two-rank replay's record as the job gathers it, under long paths: rank 1
    reproduced its incident member, rank 0 differs at its decision."""
    from nanrunbook.capture._state_manifest import StateDirManifest
    from nanrunbook.capture.torch.sharded_replay import RankReplay, ShardedCapsule, ShardedReplay

    incident = root / "incident" / "fsdp-replay" / "3"
    capsule = ShardedCapsule(
        incident / "rank-00000" / "capsule",
        StateDirManifest("nanrunbook-capsule-v1", {}, {"run_id": "fsdp-replay", "step": 3}),
        2,
    )
    out = root / ("a-rather-long-directory-for-the-replays-" * 3) / "of-this-incident"
    ranks = tuple(
        RankReplay(
            rank,
            out / "fsdp-replay" / "3" / f"rank-{rank:05d}",
            incident / f"rank-{rank:05d}",
            verdict,
            differs,
            "HOLD",
            "input",
            exit_code,
        )
        for rank, verdict, differs, exit_code in (
            (0, "NOT_REPRODUCED", "decision", 1),
            (1, "REPRODUCED", None, 0),
        )
    )
    return ShardedReplay(capsule, out, ranks)


def _rendered(fmt: str, result: Any, *, require_fixed: bool = False) -> str:
    import io

    from nanrunbook.output.renderers import RENDERERS

    out = io.StringIO()
    RENDERERS[fmt].sharded_replay(result, out, require_fixed=require_fixed)
    return out.getvalue()


def test_the_sharded_answer_in_text_keeps_80_columns_and_kv_and_json_their_lines(
    tmp_path: Path,
) -> None:
    """Rank 0 prints the job's answer through the renderer: text wrapped to 80
    columns, paths folded; kv's lines as playbooks parse them; json the document."""
    from nanrunbook.capture.torch.sharded_replay import sharded_document
    from nanrunbook.output.json import json_text

    result = _sharded_result(tmp_path)
    text = _rendered("text", result).splitlines()
    assert max(len(line) for line in text) <= 80, text
    assert text[0] == "capsule" and text[-1] == "every rank: MIXED"
    joined = "".join(text)
    assert f"{result.out / 'fsdp-replay' / '3'}rank 0: NOT_REPRODUCED (decision differs)" in joined
    assert f"its incident bundle{result.ranks[1].incident}: HOLD at input" in joined
    assert _rendered("kv", result).splitlines() == [
        "capsule_run=fsdp-replay",
        "capsule_step=3",
        "world_size=2",
        "reproduction=MIXED",
        "rank.0.reproduction=NOT_REPRODUCED",
        "rank.0.decision=HOLD",
        "rank.0.earliest_nonfinite_stage=input",
        f"rank.0.bundle={result.ranks[0].bundle}",
        "rank.1.reproduction=REPRODUCED",
        "rank.1.decision=HOLD",
        "rank.1.earliest_nonfinite_stage=input",
        f"rank.1.bundle={result.ranks[1].bundle}",
    ]
    for required in (False, True):
        shown = _rendered("json", result, require_fixed=required)
        assert shown == json_text(sharded_document(result, require_fixed=required))
