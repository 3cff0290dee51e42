"""Benchmark: incident sets and per-rank reports of 8, 128, 1,024 and 16,384 small ranks.

    python bench/bench_scale.py [--ranks 8,128,1024,16384] [--runs 1]

For each size N it generates once into ``.bench-cache/`` an incident set of N
small members (rank r of world size N, about 6 KB each; rank 1 holds at input,
the others are finite, so the set answers HOLD with origin rank 1) and the N
reports ``nanrunbook check --format json`` gives of its members, one file per
rank (as N nodes of one rank would write them; taken from the set's own report).
Then it times, each in its own process:

* ``check``       -- ``nanrunbook check --format kv`` of the set directory;
* ``merge``       -- ``nanrunbook merge --format kv`` of the N reports (streamed:
  a report is judged and let go);
* ``merge-json``  -- ``nanrunbook merge --format json``, whose answer prints every
  member's whole report (spooled to a temporary file as it is read, so its
  peak does not grow with them either).

It prints each one's time, its time per rank beyond the program's start-up
(``nanrunbook --version``, timed too) and that per-rank time's ratio to the
previous size's (about 1.0 once the start-up no longer dominates: linear in
the ranks), and the peak RSS against the reports' bytes (flat: the streamed
merge's peak does not grow with them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "tests")]

from bench_check import Command, nanrunbook_argv, run_rounds, tree_env  # noqa: E402
from fixtures_support import binding  # noqa: E402

LAYOUT_VERSION = 2  # bump when the generated sets change
RUN, STEP = "run-scale", 9042


def _binding(rank: int, world_size: int) -> dict[str, Any]:
    """The tests' binding, as rank ``rank`` of ``world_size`` states it at STEP."""
    return {
        **binding(),
        "batch": {"id": f"batch-{STEP}.rank-{rank}"},
        "loader_cursor": {"id": f"cursor-{STEP}"},
        "topology": {
            "id": f"world-{world_size}.rank-{rank}",
            "world_size": world_size,
            "rank": rank,
        },
    }


def _member(target: Path, rank: int, world_size: int) -> None:
    """One small bundle by the capture writer: rank 1 holds at input."""
    import numpy as np

    from nanrunbook.capture import BundleWriter

    binding = _binding(rank, world_size)
    writer = BundleWriter(
        run_id=RUN,
        step=STEP,
        incident_owner="ml-oncall",
        binding=binding,
        last_known_good={
            "checkpoint_id": binding["checkpoint"]["id"],
            "step": STEP - 1,
            "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
        },
        evidence_id=f"{RUN}.step-{STEP}.rank-{rank}",
    )
    for index, stage in enumerate(("input", "forward", "loss", "backward", "optimizer")):
        values = np.arange(16, dtype="float32") + index + rank
        held = rank == 1 and stage == "input"
        if held:
            values[3] = np.nan
        extra: dict[str, Any] = {"gradients": "unscaled"} if stage == "backward" else {}
        writer.observe(
            stage, [(f"{stage}/x", values, "x")], owner="ml-oncall", probe_source="p", **extra
        )
        if held:
            writer.not_run_rest(owner="ml-oncall", reason="the input is non-finite")
            break
    writer.write(target)


def ensure(cache: Path, world_size: int) -> tuple[Path, Path]:
    """The cached set and reports directory for ``world_size`` ranks, generated in
    a process of its own: a child's peak RSS counts its parent's at the fork (Linux
    keeps it across exec), and the generation parses the set's whole report."""
    base = cache / f"scale-{world_size}-v{LAYOUT_VERSION}"
    if not (base / "complete").is_file():
        here = [sys.executable, __file__, "--generate", str(world_size), "--cache", str(cache)]
        subprocess.run(here, env=tree_env(ROOT), check=True)
    return base / "set", base / "reports"


def generate(cache: Path, world_size: int) -> None:
    base = cache / f"scale-{world_size}-v{LAYOUT_VERSION}"
    incident, reports = base / "set", base / "reports"
    print(f"generating {base} (once) ...", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    incident.mkdir(parents=True)
    for rank in range(world_size):
        _member(incident / f"rank-{rank:05d}", rank, world_size)
    document = subprocess.run(
        [*nanrunbook_argv(), "check", "--format", "json", str(incident)],
        env=tree_env(ROOT),
        capture_output=True,
        check=False,
    ).stdout
    reports.mkdir()
    for member in json.loads(document)["members"]:
        text = json.dumps(member["report"], indent=2) + "\n"
        (reports / f"{member['name']}.json").write_text(text)
    (base / "complete").write_text("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,128,1024,16384")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    parser.add_argument("--generate", type=int, help=argparse.SUPPRESS)  # ensure()'s child
    args = parser.parse_args()
    if args.generate is not None:
        generate(args.cache, args.generate)
        return
    sizes = [int(n) for n in args.ranks.split(",")]
    env = tree_env(ROOT)
    program = nanrunbook_argv()
    rows = []
    startup = Command("start-up", [*program, "--version"], 0, env)
    run_rounds([startup], max(3, args.runs))
    print(f"machine    {os.cpu_count()} CPUs; 1-min load {os.getloadavg()[0]:.2f} before")
    for size in sizes:
        incident, reports = ensure(args.cache, size)
        names = sorted(p.name for p in reports.iterdir())
        report_bytes = sum((reports / n).stat().st_size for n in names)
        # Relative names, run from the reports' directory: 16,384 paths fit in argv.
        commands = [
            Command("check", [*program, "check", "--format", "kv", str(incident)], 1, env),
            Command("merge", [*program, "merge", "--format", "kv", *names], 1, env),
            Command("merge-json", [*program, "merge", "--format", "json", *names], 1, env),
        ]
        cwd = Path.cwd()
        os.chdir(reports)
        try:
            run_rounds(commands, args.runs)
        finally:
            os.chdir(cwd)
        rows.append((size, report_bytes, commands))
    print()
    print(f"start-up {startup.median:.3f} s, peak RSS {startup.peak_mb:.1f} MB")
    print(
        f"{'ranks':>6} {'reports MB':>10} {'command':10} {'s':>8} {'ms/rank':>8}"
        f" {'x prev':>7} {'peak RSS MB':>11}"
    )
    previous: dict[str, float] = {}
    for size, report_bytes, commands in rows:
        for c in commands:
            per_rank = max(c.median - startup.median, 0.0) / size
            ratio = per_rank / previous[c.name] if previous.get(c.name) else float("nan")
            previous[c.name] = per_rank
            print(
                f"{size:6d} {report_bytes / 1e6:10.1f} {c.name:10} {c.median:8.3f}"
                f" {per_rank * 1e3:8.3f} {ratio:7.2f} {c.peak_mb:11.1f}"
            )
    print(f"1-min load {os.getloadavg()[0]:.2f} after (2 CPUs: above ~0.5, others ran too)")


if __name__ == "__main__":
    main()
