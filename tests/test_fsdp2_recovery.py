"""Sharded recovery points under FSDP2, and under DDP (gloo, CPU, 2 processes
in one spawned job): every rank writes its shards into one point with one manifest; the point
is verified from one ordinary process (no torch.distributed), a flipped byte in
one rank's file is found, and a fresh job resumes from it bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fsdp_support import ShardedCase, recovery_worker
from test_sentinel_ranks import spawn

from nanrunbook.capture.recovery import verify_recovery_point


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("fsdp2-recovery")
    return tmp, spawn(recovery_worker, tmp, 2, ShardedCase("fsdp-point"), deadline=180.0)


def _verify(path: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nanrunbook", "verify-recovery", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_every_rank_writes_one_point_that_one_process_verifies(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, results = job
    point = tmp / "point"
    manifest = json.loads((point / "manifest.json").read_text())
    ranks = manifest["header"]["ranks"]
    assert manifest["header"]["world_size"] == 2 and sorted(ranks) == ["0", "1"]
    assert "state/__1_0.distcp" in ranks["1"] and "rank-00001/rng.json" in ranks["1"]
    assert "state/.metadata" in ranks["0"] and "state/__0_0.distcp" in ranks["0"]
    assert sorted(manifest["files"]) == sorted(ranks["0"] + ranks["1"])
    assert not [p for p in tmp.iterdir() if p.name.startswith(".point")]  # no temporary left
    verification = verify_recovery_point(point)  # this process never initialised a group
    assert verification.verified, verification.violations
    assert verification.world_size == 2
    shown = _verify(point)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert all(r["last_known_good"] == "fsdp-point.recovery-2" for r in results)


def test_a_flipped_byte_in_one_ranks_file_is_not_verified(
    job: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    tmp, _ = job
    copy = tmp_path / "point"
    shutil.copytree(tmp / "point", copy)
    shard = copy / "state" / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    shard.write_bytes(bytes(raw))
    shown = _verify(copy)
    assert shown.returncode == 3, shown.stdout + shown.stderr
    assert "STATE_FILE_DIGEST_MISMATCH" in shown.stdout
    assert "state/__1_0.distcp" in shown.stdout


def test_a_fresh_job_resumes_bit_for_bit_on_every_rank(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = job
    for rank, r in enumerate(results):
        assert r["restored_exactly"]
        assert r["cursor"] == {"rank": rank, "batches": 2}  # each rank's own data position
        assert r["resumed"] == r["uninterrupted"], rank
        assert r["resumed_lr"] == r["lr"]
    assert results[0]["resumed"] != results[1]["resumed"]  # each rank its own shards


def test_a_failure_on_one_rank_stops_every_rank_and_leaves_nothing(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, results = job
    assert results[0]["exists"].startswith("FileExistsError")
    assert results[1]["exists"].startswith("RankFailed") and "rank 0" in results[1]["exists"]
    assert results[1]["bad_data"].startswith("TypeError")
    assert results[0]["bad_data"].startswith("RankFailed") and "rank 1" in results[0]["bad_data"]
    assert not (tmp / "bad").exists()
    assert not [p for p in tmp.iterdir() if p.name.startswith((".bad", ".point"))]


def test_another_world_size_is_refused_with_the_reason(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    """One process (world size 1) loading the 2-rank point."""
    import torch

    from nanrunbook.capture._state_manifest import StateDirRejected
    from nanrunbook.capture.torch import load_recovery_point

    tmp, _ = job
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(StateDirRejected) as refused:
        load_recovery_point(tmp / "point", model=model, optimizer=optimizer)
    [violation] = refused.value.violations
    assert violation.code == "RECOVERY_WORLD_SIZE_MISMATCH"
    assert "written by 2 ranks, loaded on 1" in violation.message


def test_under_ddp_one_point_of_every_rank_resumes_bit_for_bit(
    job: tuple[Path, list[dict[str, Any]]],
) -> None:
    tmp, results = job
    verification = verify_recovery_point(tmp / "ddp-point")
    assert verification.verified and verification.world_size == 2, verification.violations
    for rank, r in enumerate(results):
        assert r["ddp_exactly"] and r["ddp_same"] and r["ddp_cursor"] == {"rank": rank}


def test_a_manifest_that_does_not_list_each_ranks_files_is_not_verified(
    job: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A rank's shard listed by no rank, then a rank left out of the listing."""
    tmp, _ = job
    copy = tmp_path / "point"
    shutil.copytree(tmp / "point", copy)
    manifest_path = copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["header"]["ranks"]["1"].remove("state/__1_0.distcp")
    manifest_path.write_text(json.dumps(manifest))
    codes = {(v.code, v.where) for v in verify_recovery_point(copy).violations}
    assert codes == {("STATE_RANKS_INVALID", "header.ranks")}
    del manifest["header"]["ranks"]["1"]
    manifest_path.write_text(json.dumps(manifest))
    codes = {(v.code, v.where) for v in verify_recovery_point(copy).violations}
    assert codes == {
        ("STATE_RANKS_INVALID", "header.ranks"),
        ("RECOVERY_HEADER_INVALID", "header.ranks"),
    }
