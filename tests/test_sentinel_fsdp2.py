"""The sentinel under FSDP2: real fully sharded training (gloo, CPU, 2 and 4
processes spawned from the test, every collective with a timeout, every job a
deadline, every process exiting 0). The checks read each rank's local shards;
a custom reduce-scatter checks each rank's own gradients before the reduction;
every rank holds at one step with its shards and optimizer state bit-unchanged
and writes its bundle of the live held step into the incident set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fsdp_support import ShardedCase, sharded_worker
from test_sentinel_ranks import set_verdict, spawn

from nanrunbook import check_bundle
from nanrunbook.capture._state_manifest import FORMATS, verify_state_dir
from nanrunbook.capture.torch._dcp_reader import read_metadata


def run(tmp: Path, world: int, case: ShardedCase) -> list[dict[str, Any]]:
    return spawn(sharded_worker, tmp, world, case, deadline=240.0)


@pytest.mark.parametrize(
    ("world", "micro", "bf16"),
    [(2, 1, False), (4, 1, False), (2, 2, True)],
    ids=["2-ranks", "4-ranks", "2-ranks-accumulating-bf16"],
)
def test_a_nan_in_rank_1s_data_holds_every_rank_with_origin_rank_1(
    world: int, micro: int, bf16: bool, tmp_path: Path
) -> None:
    """The third: two micro-batches a step (the first without gradient sync, the
    NaN in it) under bfloat16 MixedPrecisionPolicy."""
    case = ShardedCase("fsdp-nan", scenario="nan-rank1", micro=micro, bf16=bf16)
    results = run(tmp_path, world, case)
    assert {r["held"] for r in results} == {3}, [r["reason"] for r in results]
    assert all(r["capture_error"] is None for r in results), [r["capture_error"] for r in results]
    assert all(r["finite"] and r["untouched"] for r in results), [r["changed"] for r in results]
    incident = tmp_path / "incident" / "fsdp-nan" / "3"
    origin, stage, decisions = set_verdict(incident)
    assert (origin, stage) == ([1], "input")  # ONE_RANK
    assert decisions[1] == "HOLD"
    assert all(r["origin"] == [1] for r in results)
    assert results[1]["reason"].startswith("non-finite loss")
    # Checked before the reduce-scatter: rank 0 knows its own gradients were finite.
    assert "own gradients were finite before the reduce-scatter" in results[0]["reason"]
    # The evidence is the live held step's, said so, and its tensors are local shards.
    report = check_bundle(incident / "rank-00000")
    environment = report.manifest.binding.details["environment"]
    assert environment["replay"] == "none" and "not a replay" in environment["evidence"]
    manifest = json.loads((incident / "rank-00000" / "manifest.json").read_text())
    backward = manifest["stages"][3]
    assert "not replayed" in backward["tensor_set"]["probe_source"]
    names = [t["name"] for t in backward["tensors"]]
    assert f"grad/0.weight@shard0of{world}" in names
    probe = next(t["probe"] for t in backward["tensors"] if t["name"].startswith("grad/0.weight"))
    assert "Shard(dim=0)" in probe and "global shape [32, 8]" in probe
    assert backward["tensors"][0]["shape"] == [32 // world, 8]
    inputs = [t["name"] for t in manifest["stages"][0]["tensors"]]
    assert inputs == (
        ["batch/x", "batch/y"]
        if micro == 1
        else ["batch/mb0/x", "batch/mb0/y", "batch/mb1/x", "batch/mb1/y"]
    )
    precision = report.manifest.binding.details["precision"]
    assert precision["compute_dtype"] == ("BF16" if bf16 else "F32")
    topology = report.manifest.binding.details["topology"]
    assert (topology["rank"], topology["world_size"], topology["sharding"]) == (0, world, "fsdp2")
    _one_sharded_capsule(incident, world, micro, results)


def _one_sharded_capsule(
    incident: Path, world: int, micro: int, results: list[dict[str, Any]]
) -> None:
    """Every rank wrote the one capsule in rank 0's bundle, verified from this
    process; nanrunbook replay started without torchrun refuses it in one line
    (exit 2: how it was started)."""
    capsule = incident / "rank-00000" / "capsule"
    assert {r["capsule"] for r in results} == {str(capsule)}, [r["capsule_error"] for r in results]
    manifest, violations = verify_state_dir(capsule, kind_format=FORMATS["capsule"])
    assert not violations and manifest is not None, violations
    assert sorted(manifest.header["ranks"]) == [str(r) for r in range(world)]
    assert f"state/__{world - 1}_0.distcp" in manifest.header["ranks"][str(world - 1)]
    for rank in range(world):
        incident_document = json.loads((capsule / f"rank-{rank:05d}" / "incident.json").read_text())
        assert incident_document["bundle"]["path"] == f"../../rank-{rank:05d}"
        micro_batches = json.loads(
            (capsule / f"rank-{rank:05d}" / "micro_batches.json").read_text()
        )
        assert len(micro_batches) == micro and micro_batches[0]["rng"] is not None
        recipe = json.loads((capsule / f"rank-{rank:05d}" / "recipe.json").read_text())
        assert recipe["micro_batches"] == micro and recipe["scaling"]["mode"] == "none"
    metadata = read_metadata(capsule).state_dict_metadata
    assert {k.split(".")[0] for k in metadata if k.startswith("batch_")} == {
        f"batch_{rank:05d}" for rank in range(world)
    }  # each rank's own batch, not one rank's as a replica
    shown = subprocess.run(
        [sys.executable, "-m", "nanrunbook", "replay", str(capsule), "--entry", "absent:build"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert f"written by {world} ranks under FSDP2" in shown.stderr, shown.stderr
    assert f"torchrun --nproc-per-node {world}" in shown.stderr


def test_one_ranks_non_finite_update_is_rolled_back_on_every_rank(tmp_path: Path) -> None:
    """A NaN written into rank 1's shard inside optimizer.step() (a silent
    corruption): found at the next step's vote, every rank rolls its shards and
    optimizer state back from its snapshot and holds at the step of the update;
    its gradients are gone, so no bundle, and the hold says why."""
    case = ShardedCase("fsdp-update", scenario="nan-update", snapshot=True)
    results = run(tmp_path, 2, case)
    assert [r["held"] for r in results] == [3, 3]
    assert all(r["finite"] and r["untouched"] for r in results), [r["changed"] for r in results]
    assert results[0]["reason"].startswith("another rank's update")
    assert results[1]["reason"].startswith("non-finite update after optimizer.step()")
    assert all("live gradients are gone" in r["capture_error"] for r in results)
    assert all(r["bundle"] is None for r in results)


def test_a_learning_rate_blowup_is_all_ranks(tmp_path: Path) -> None:
    results = run(tmp_path, 2, ShardedCase("fsdp-blowup", scenario="blowup", steps=30))
    [held] = {r["held"] for r in results}
    assert held is not None and all(r["finite"] and r["untouched"] for r in results)
    origin, stage, _ = set_verdict(tmp_path / "incident" / "fsdp-blowup" / str(held))
    assert origin == [0, 1] and stage is not None  # ALL_RANKS


def test_a_healthy_run_writes_no_set_and_trains_bit_for_bit_as_without_it(
    tmp_path: Path,
) -> None:
    """With gradient accumulation (no sync on the first micro-batch), bfloat16
    mixed precision and clipping through the sentinel (a DTensor norm)."""
    case = ShardedCase("fsdp-healthy", micro=2, bf16=True, clip=0.05, steps=5)
    results = run(tmp_path, 2, case)
    assert all(r["held"] is None and r["steps"] == 5 for r in results)
    assert all(r["state"] == r["plain_state"] for r in results)
    assert all(r["norm_type"] == "DTensor" for r in results)
    # Steps 2 to 5: one host read a step added (the sentinel's one read), nothing per tensor.
    for r in results:
        plain, watched = sum(r["plain_syncs"].values()), sum(r["host_syncs"].values())
        assert watched - plain == 4, (r["plain_syncs"], r["host_syncs"])
    assert results[0]["state"] != results[1]["state"]  # each rank holds its own shards
    assert not list((tmp_path / "incident" / "fsdp-healthy").glob("*/rank-*"))
    # A GradScaler is refused under FSDP2, with the reason.
    assert all(r["scaler_refused"].startswith("a GradScaler under FSDP2") for r in results)
