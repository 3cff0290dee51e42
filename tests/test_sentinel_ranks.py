"""The sentinel across ranks: real data-parallel training (gloo, CPU, 2 and 4
processes spawned from the test). No rank steps while another holds; each rank
writes its bundle into the incident set; the origin is the rank whose own
values went non-finite. Every rank takes the same branch and reaches the same
collectives, whatever happens on one rank only; every collective has a timeout,
every job a deadline, and every process must exit with 0 (a SIGABRT at exit is a
crash to torchrun and Slurm).

The 2-rank and the 4-rank jobs each run in one spawn (``jobs_worker``: a process
group of their own each, one after the other, in a directory of their own), and
the tests read what each left: the cost of spawning and importing torch is paid
twice, not thirteen times."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from sentinel_support import RankCase, jobs_worker, rank_worker, set_verdict

from nanrunbook import check_bundle


def spawn(
    worker: Callable[..., None], tmp: Path, world: int, *args: Any, deadline: float = 300.0
) -> list[dict[str, Any]]:
    """Run ``worker`` on ``world`` processes; a job that outlives ``deadline``
    seconds fails (its processes killed), and so does any exit code but 0."""
    _join(worker, tmp, world, args, deadline)
    return _results(tmp, world)


def _join(
    worker: Callable[..., None], tmp: Path, world: int, args: tuple[Any, ...], deadline: float
) -> None:
    context = mp.spawn(worker, args=(world, str(tmp), *args), nprocs=world, join=False)
    end = time.monotonic() + deadline
    try:
        while not context.join(timeout=max(0.5, end - time.monotonic())):
            if time.monotonic() > end:
                pytest.fail(f"the {world}-rank job did not end within {deadline:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    codes = [process.exitcode for process in context.processes]
    assert codes == [0] * world, f"exit codes {codes}"


def _results(tmp: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((tmp / f"result-{r}.json").read_text()) for r in range(world)]


Ran = dict[str, tuple[Path, list[dict[str, Any]]]]


def run_jobs(tmp: Path, world: int, jobs: dict[str, str | RankCase]) -> Ran:
    """Each job (a rank_worker scenario or a RankCase) in turn on one spawn of
    ``world`` processes: name -> (its directory, each rank's result). The deadline
    is one job's alone (300 s) and a minute more for each."""
    _join(jobs_worker, tmp, world, (tuple(jobs.items()),), 300.0 + 60.0 * len(jobs))
    return {name: (tmp / name, _results(tmp / name, world)) for name in jobs}


def run_ranks(tmp: Path, world: int, scenario: str) -> list[dict[str, Any]]:
    return spawn(rank_worker, tmp, world, scenario)


UPDATE_CASES = {
    f"update-{where}": RankCase(
        f"update-{where}",
        fault="nan-update",
        snapshot=True,
        checkpoint=where == "checkpoint",
        steps=3 if where == "close" else 8,
        timeout=20.0,
    )
    for where in ("step", "checkpoint", "close")
}
TWO_RANK_JOBS: dict[str, str | RankCase] = {
    "nan-rank1": "nan-rank1",
    "blowup": "blowup",
    "healthy": "healthy",
    "sdc-skip": RankCase("sdc-skip", fault="nan-update", policy="skip", timeout=20.0),
    "sdc-roll": RankCase(
        "sdc-roll", fault="nan-update", policy="skip", snapshot=True, timeout=20.0
    ),
    **UPDATE_CASES,
    "check-fails": RankCase("check-fails", fault="check-fails", timeout=20.0),
    # The group times out after 8 s; rank 1's capture takes 16 s more.
    "slow": RankCase("slow", timeout=8.0, slow=16.0),
}
FOUR_RANK_JOBS: dict[str, str | RankCase] = {
    "nan-rank1": "nan-rank1",
    "dp-groups": RankCase("dp-groups", groups=True),
    "groups-vote": RankCase("groups-vote", groups=True, vote_in_group=True, fault_ranks=(1, 3)),
}


Jobs = Callable[[int], Ran]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """world size -> what each of its jobs left; a world's jobs run when first asked."""

    @functools.cache
    def ran(world: int) -> Ran:
        jobs = {2: TWO_RANK_JOBS, 4: FOUR_RANK_JOBS}[world]
        return run_jobs(tmp_path_factory.mktemp(f"ranks-{world}"), world, jobs)

    return ran


@pytest.mark.parametrize("world", [2, 4])
def test_a_nan_in_one_ranks_data_holds_every_rank_at_one_step(world: int, ranks: Jobs) -> None:
    job, results = ranks(world)["nan-rank1"]
    assert {r["held"] for r in results} == {3}  # every rank, the same step
    assert all(r["finite"] and r["untouched"] for r in results), [r["changed"] for r in results]
    incident = job / "incident" / "nan-rank1" / "3"
    origin, stage, decisions = set_verdict(incident)
    assert (origin, stage) == ([1], "input")  # ONE_RANK: the rank whose data was bad
    assert decisions == {
        r: "HOLD" if r == 1 else "CONTINUE_BOUNDED_DIAGNOSTICS" for r in range(world)
    }
    assert all(r["origin"] == [1] for r in results)
    # Checked before the all-reduce: rank 0 knows its own gradients were finite.
    assert results[1]["reason"].startswith("non-finite loss")
    assert "own gradients were finite before the all-reduce" in results[0]["reason"]
    # Issue 27: each rank judges its own replay, named by rank, host and device,
    # and leaves its capsule in its own member bundle.
    for rank, result in enumerate(results):
        assert result["reproduced"].startswith(f"REPRODUCED on rank {rank}, host "), result
        assert result["capsule"] == str(incident / f"rank-{rank:05d}" / "capsule")
    for rank in range(world):
        lines = (job / "incident" / "nan-rank1" / f"telemetry-rank-{rank:05d}.jsonl").read_text()
        assert [json.loads(line)["step"] for line in lines.splitlines()] == [1, 2, 3]


def test_a_model_wide_blowup_is_all_ranks(ranks: Jobs) -> None:
    job, results = ranks(2)["blowup"]
    [held] = {r["held"] for r in results}
    assert held is not None and all(r["finite"] and r["untouched"] for r in results)
    origin, stage, _ = set_verdict(job / "incident" / "blowup" / str(held))
    assert origin == [0, 1] and stage is not None  # ALL_RANKS


def test_a_healthy_job_writes_no_set(ranks: Jobs) -> None:
    job, results = ranks(2)["healthy"]
    assert all(r["held"] is None and r["steps"] == 12 for r in results)
    assert not list((job / "incident" / "healthy").glob("*/rank-*"))


# ------------------------------------------------- groups: data x model parallel


def test_ddp_on_a_subgroup_averages_over_its_own_group(ranks: Jobs) -> None:
    """4 ranks, DDP over the data-parallel groups {0,1} and {2,3}, the sentinel
    voting over the world: the gradients are averaged within each group, as
    DDP alone does (over the world, all four would end equal)."""
    job, results = ranks(4)["dp-groups"]
    for r in results:
        assert r["before_fault"] == r["plain_before_fault"]  # bit for bit, as without it
    params = [r["before_fault"] for r in results]
    assert params[0] == params[1] and params[2] == params[3] and params[0] != params[2]
    assert {r["held"] for r in results} == {3}  # the world's vote holds every rank
    origin, stage, _ = set_verdict(job / "incident" / "dp-groups" / "3")
    assert (origin, stage) == ([1], "input")


def test_ranks_of_different_groups_never_share_a_file(ranks: Jobs) -> None:
    """Each group votes and holds on its own; files are named by the job's rank,
    and the bundles' topology records the group's rank beside it."""
    job, results = ranks(4)["groups-vote"]
    assert [r["held"] for r in results] == [3, 3, 3, 3]
    assert [r["origin"] for r in results] == [[1], [1], [3], [3]]
    root = job / "incident" / "groups-vote"
    assert sorted(p.name for p in root.iterdir()) == ["3"] + [
        f"telemetry-rank-{r:05d}.jsonl" for r in range(4)
    ]
    for rank in range(4):
        lines = [json.loads(x) for x in (root / f"telemetry-rank-{rank:05d}.jsonl").open()]
        assert [(x["step"], x["rank"], x["world_size"]) for x in lines] == [
            (s, rank, 4) for s in (1, 2, 3)
        ]
        topology = check_bundle(root / "3" / f"rank-{rank:05d}").manifest.binding.details[
            "topology"
        ]
        assert (topology["rank"], topology["world_size"]) == (rank, 4)
        assert (topology["group_rank"], topology["group_size"]) == (rank % 2, 2)
    origin, stage, _ = set_verdict(root / "3")
    assert (origin, stage) == ([1, 3], "input")


# ------------------------------------------- one rank only: the same branch for all


def test_one_replicas_corrupt_update_under_skip_without_snapshot_holds_every_rank(
    ranks: Jobs,
) -> None:
    _, results = ranks(2)["sdc-skip"]
    assert [(r["held"], r["contaminated"]) for r in results] == [(3, True), (3, True)]
    assert results[0]["reason"].startswith("another rank's update")
    assert results[1]["reason"].startswith("non-finite update after optimizer.step()")


def test_one_replicas_corrupt_update_under_skip_is_rolled_back_on_every_rank(
    ranks: Jobs,
) -> None:
    _, results = ranks(2)["sdc-roll"]
    assert [r["held"] for r in results] == [None, None]
    assert all(r["finite"] and r["steps"] == 8 for r in results)
    assert results[0]["params"] == results[1]["params"]  # the replicas did not diverge


@pytest.mark.parametrize("where", ["step", "checkpoint", "close"])
def test_one_ranks_non_finite_update_holds_every_rank_at_its_step(where: str, ranks: Jobs) -> None:
    """Found at the next step's vote, in checkpointed() or at close(): every rank
    rolls back and holds at the step of the update, into one step directory."""
    _, results = ranks(2)[f"update-{where}"]
    assert [r["held"] for r in results] == [3, 3]
    assert [r["contaminated"] for r in results] == [False, False]
    assert [Path(r["bundle"]).parent.name for r in results] == ["3", "3"]
    assert results[0]["reason"].startswith("another rank's update")
    assert all(r["before_fault"] == r["params"] for r in results)  # rolled back


def test_a_rank_whose_checks_raise_holds_the_others_then_raises(ranks: Jobs) -> None:
    _, results = ranks(2)["check-fails"]  # the others do not wait out the timeout
    assert results[1]["error"] == "out of memory in the per-step checks (injected)"
    assert results[0]["held"] == 3 and results[0]["error"] is None
    assert "another rank could not check its step" in results[0]["reason"]
    assert results[0]["before_fault"] == results[0]["params"]  # nothing stepped


def test_a_capture_longer_than_the_collective_timeout_keeps_its_hold(
    ranks: Jobs,
) -> None:
    """The group times out after 8 s; rank 1's capture takes 16 s more. The
    verdicts go through the store, which waits for it; each line is written first."""
    job, results = ranks(2)["slow"]
    assert [r["held"] for r in results] == [3, 3]
    assert [r["origin"] for r in results] == [[1], [1]]
    for rank in range(2):
        path = job / "incident" / "slow" / f"telemetry-rank-{rank:05d}.jsonl"
        lines = [json.loads(x) for x in path.open()]
        assert [(x["step"], x["held"]) for x in lines][-1] == (3, True)
