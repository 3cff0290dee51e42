"""``watch`` of a whole job: every rank's telemetry read at once (a run
directory, several files, or one file the ranks share), one summary, the first
non-finite step's origin ranks by the incident set's rule, a step counted once,
and ``--follow`` following every file. The job is real: two gloo processes
under the sentinel, the NaN in rank 1's data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from nanrunbook import check_incident_set
from nanrunbook.cli import app
from nanrunbook.exits import Exit
from nanrunbook.telemetry.record import GradientStats, TelemetryRecord, record_line
from nanrunbook.telemetry.summary import Summariser
from nanrunbook.telemetry.watch import follow, summarise_job

runner = CliRunner()


def watch(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["watch", *args], prog_name="nanrunbook", env={"COLUMNS": "80"})
    assert "Traceback" not in result.output
    return result.exit_code, result.stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of a 2-rank job whose rank 1 read a NaN at step 3."""
    from test_sentinel_ranks import run_ranks

    tmp = tmp_path_factory.mktemp("job")
    run_ranks(tmp, 2, "nan-rank1")
    return tmp / "incident" / "nan-rank1"


def _fact(text: str, label: str) -> str:
    """A summary line's value, a wrapped value joined."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"  {label}  "))
    value = lines[at][19:].strip()
    for line in lines[at + 1 :]:
        if line[:19].strip():
            break
        value += " " + line.strip()
    return value


def test_a_jobs_run_directory_names_the_rank_the_nan_began_on(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's loss went NaN; after the all-reduce rank 0's gradients did too.
    The origin is rank 1, as the check of the job's incident set says; the held
    step (on both ranks) counts once."""
    monkeypatch.chdir(job.parent)  # the files line unwrapped, however long the temporary path
    code, text = watch(job.name)
    assert code == Exit.HOLD
    assert all(len(line) <= 80 for line in text.splitlines())
    assert _fact(text, "files") == f"{job.name}: 2 files, 6 lines, 6 records"
    assert _fact(text, "first non-finite") == (
        "step 3: loss nan (began on rank 1: ONE_RANK of 2; then rank 0 grad nan); 1 such step"
    )
    assert _fact(text, "held updates") == "1: step 3"
    checked = check_incident_set(job / "3")
    assert (checked.origin_ranks, checked.origin) == ((1,), "ONE_RANK")
    found = dict(line.split("=", 1) for line in watch(str(job), "--format", "kv")[1].splitlines())
    assert (found["origin_ranks"], found["origin"], found["files"]) == ("1", "ONE_RANK", "2")
    assert found["holds"] == "1" and found["first_nonfinite"] == "loss:nan"
    document = json.loads(watch(str(job), "--format", "json")[1])
    first = document["first_nonfinite"]
    assert (first["rank"], first["origin_ranks"], first["origin"]) == (1, [1], "ONE_RANK")
    assert first["parts"] == [[0, "grad:nan"], [1, "loss:nan"]]
    assert [row["rank"] for row in document["rank_rows"]] == [0, 1]
    assert len(document["files"]) == 2


def test_the_files_given_or_joined_in_one_say_the_same(job: Path, tmp_path: Path) -> None:
    """The job's two files given one by one, or appended into one file (the
    old reading named rank 0 and counted the held step twice)."""
    files = sorted(job.glob("telemetry-rank-*.jsonl"))
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(b"".join(f.read_bytes() for f in files))
    for args in ([str(f) for f in files], [str(joined)]):
        code, text = watch(*args)
        assert code == Exit.HOLD, args
        assert _fact(text, "first non-finite").startswith(
            "step 3: loss nan (began on rank 1: ONE_RANK"
        )
        assert _fact(text, "held updates") == "1: step 3"
    one, two = summarise_job(files), summarise_job([joined])
    assert one.first_nonfinite == two.first_nonfinite and one.holds == two.holds


def test_follow_follows_every_file_of_the_job(job: Path, tmp_path: Path) -> None:
    """--follow on the run directory reads every rank's file, and a rank's
    file that appears while it follows."""
    run = tmp_path / "run"
    run.mkdir()
    files = sorted(job.glob("telemetry-rank-*.jsonl"))
    (run / files[0].name).write_bytes(files[0].read_bytes())
    events = []
    polls = {"n": 0}

    def sleep(_: float) -> None:
        polls["n"] += 1
        if polls["n"] == 2:  # rank 1's file appears
            (run / files[1].name).write_bytes(files[1].read_bytes())

    summariser = Summariser(str(run))
    summary = follow(
        summariser, events.append, stop_after_idle=5, sleep=sleep, clock=lambda: polls["n"],
        paths=[run],
    )  # fmt: skip
    assert summary.first_nonfinite is not None
    assert summary.first_nonfinite.origin_ranks == (1,)
    assert summary.holds.count == 1 and summary.records == 6 and len(summary.files) == 2
    said = [e.message for e in events]
    assert any("telemetry-rank-00001.jsonl appeared" in m for m in said), said
    # rank 0's file was there first: its step-3 grad:nan, then rank 1's loss:nan
    assert [e.code for e in events if e.kind == "nonfinite"] == ["loss:nan"]
    code, text = watch(str(job), "--follow", "--stop-after-idle", "0.5", "--no-plots")
    assert code == Exit.HOLD and "began on rank 1: ONE_RANK of 2" in text


# ---------------------------------------------------------------- the rule alone


def _record(rank: int, step: int, part: str | None, world: int = 3) -> TelemetryRecord:
    grad = GradientStats(nan=4 if part in ("grad", "update") else 0)
    return TelemetryRecord(
        "job", rank, world, step, 1.0, None if part == "loss" else 1.0,
        "nan" if part == "loss" else "finite", grad, None, None, None, False, part is not None,
        (), None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("parts", "origin", "ranks"),
    [
        ({0: "grad", 1: "loss", 2: "grad"}, "ONE_RANK", (1,)),
        ({0: "loss", 1: "grad", 2: "loss"}, "SOME_RANKS", (0, 2)),
        ({0: "grad", 1: "grad", 2: "grad"}, "ALL_RANKS", (0, 1, 2)),
    ],
)
def test_the_origin_is_the_earliest_stage_at_the_first_step(
    parts: dict[int, str], origin: str, ranks: tuple[int, ...]
) -> None:
    """Records read out of step order (a later step first) still give the
    first non-finite step and its earliest stage's ranks."""
    summariser = Summariser("job")
    summariser.add(_record(0, 9, "loss"))  # a later step, read first
    for rank, part in parts.items():
        summariser.add(_record(rank, 5, part))
    first = summariser.summary().first_nonfinite
    assert first is not None and first.step == 5
    assert (first.origin, first.origin_ranks, first.rank) == (origin, ranks, ranks[0])
    assert summariser.summary().nonfinite.count == 2  # steps 5 and 9, each once


def test_a_ranks_step_seen_again_counts_again() -> None:
    """One rank's record of a step it recorded before (a resume) is another
    occurrence; another rank's of the same step is not."""
    summariser = Summariser("job")
    for rank in (0, 1, 0):
        summariser.add(_record(rank, 4, "loss"))
    assert summariser.summary().holds.count == 2
    assert math.isfinite(orjson.loads(record_line(_record(0, 4, None)))["loss"])


def test_follow_waits_for_a_run_directory_and_reads_it_as_a_job(job: Path, tmp_path: Path) -> None:
    """A run directory given to --follow before the run made it: waited for,
    then every rank's file in it followed (not refused as a directory)."""
    run = tmp_path / "later"
    polls = {"n": 0}

    def sleep(_: float) -> None:
        polls["n"] += 1
        if polls["n"] == 2:
            run.mkdir()
            for path in sorted(job.glob("telemetry-rank-*.jsonl")):
                (run / path.name).write_bytes(path.read_bytes())

    events: list[object] = []
    summary = follow(
        Summariser(str(run)), events.append, stop_after_idle=3, wait_for_file=10, sleep=sleep,
        clock=lambda: polls["n"],
    )  # fmt: skip
    assert summary.records == 6 and len(summary.files) == 2 and summary.holds.count == 1
    assert summary.first_nonfinite is not None and summary.first_nonfinite.origin_ranks == (1,)
