"""The sentinel across ranks: real data-parallel training (gloo, CPU, 2 and 4
processes spawned from the test). No rank steps while another holds; each rank
writes its bundle into the incident set; the origin is the rank whose own
values went non-finite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from sentinel_support import rank_worker

from nanrunbook import check_bundle
from nanrunbook.records import STAGE_ORDER


def run_ranks(tmp: Path, world: int, scenario: str) -> list[dict[str, Any]]:
    mp.spawn(rank_worker, args=(world, str(tmp), scenario), nprocs=world, join=True)
    return [json.loads((tmp / f"result-{r}.json").read_text()) for r in range(world)]


def set_verdict(incident: Path) -> tuple[list[int], str | None, dict[int, str]]:
    """Spec section 11 from the members: origin ranks, earliest stage, decisions."""
    decisions, stages = {}, {}
    for member in sorted(incident.iterdir()):
        report = check_bundle(member)
        rank = report.manifest.binding.rank
        assert member.name == f"rank-{rank:05d}"
        decisions[rank] = report.decision.decision
        if report.decision.decision == "HOLD":
            stages[rank] = report.decision.earliest_nonfinite_stage
    if not stages:
        return [], None, decisions
    earliest = min(stages.values(), key=STAGE_ORDER.index)
    return sorted(r for r, s in stages.items() if s == earliest), earliest, decisions


@pytest.mark.parametrize("world", [2, 4])
def test_a_nan_in_one_ranks_data_holds_every_rank_at_one_step(world: int, tmp_path: Path) -> None:
    results = run_ranks(tmp_path, world, "nan-rank1")
    assert {r["held"] for r in results} == {3}  # every rank, the same step
    assert all(r["finite"] and r["untouched"] for r in results), [r["changed"] for r in results]
    incident = tmp_path / "incident" / "nan-rank1" / "3"
    origin, stage, decisions = set_verdict(incident)
    assert (origin, stage) == ([1], "input")  # ONE_RANK: the rank whose data was bad
    assert decisions == {
        r: "HOLD" if r == 1 else "CONTINUE_BOUNDED_DIAGNOSTICS" for r in range(world)
    }
    assert all(r["origin"] == [1] for r in results)
    # Checked before the all-reduce: rank 0 knows its own gradients were finite.
    assert results[1]["reason"].startswith("non-finite loss")
    assert "own gradients were finite before the all-reduce" in results[0]["reason"]
    for rank in range(world):
        lines = (
            tmp_path / "incident" / "nan-rank1" / f"telemetry-rank-{rank:05d}.jsonl"
        ).read_text()
        assert [json.loads(line)["step"] for line in lines.splitlines()] == [1, 2, 3]


def test_a_model_wide_blowup_is_all_ranks(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "blowup")
    [held] = {r["held"] for r in results}
    assert held is not None and all(r["finite"] and r["untouched"] for r in results)
    origin, stage, _ = set_verdict(tmp_path / "incident" / "blowup" / str(held))
    assert origin == [0, 1] and stage is not None  # ALL_RANKS


def test_a_healthy_job_writes_no_set(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, "healthy")
    assert all(r["held"] is None and r["steps"] == 12 for r in results)
    assert not list((tmp_path / "incident" / "healthy").glob("*/rank-*"))
