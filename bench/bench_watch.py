"""Benchmark: ``nanrunbook watch`` on a million telemetry lines, against baselines.

    python bench/bench_watch.py [--lines 1000000] [--runs 5]

Generates ``--lines`` nanrunbook-telemetry/1 lines once into ``.bench-cache/``
(a long run shaped like tests/telemetry_runs.py's: a loss that drifts down,
gradient magnitudes with spikes, a dynamic loss scale that grows and backs off
with a skipped step at each overflow, an occasional warning) and a tenth of it,
then times, alternating round by round so that a shared machine's noise falls
on every command alike, each in its own subprocess:

* ``watch``   -- the real CLI, ``nanrunbook watch --format kv FILE``;
* ``text``    -- ``nanrunbook watch FILE``: the text summary and terminal plots;
* ``loads``   -- a bare loop of ``orjson.loads`` over the file's lines: the floor
  of any Python reader of this format;
* ``wc``      -- ``wc -l``: reading the bytes at all;
* ``watch/10`` -- ``watch --format kv`` on the tenth-size file: peak memory
  must not grow with the file.

It prints the median wall time of each, the ratios to the baselines, and the
CPU time (user + system) and peak RSS of each subprocess (``ru_utime``,
``ru_stime`` and ``ru_maxrss`` from ``wait4``), warm page cache. On a shared
machine the CPU time moves less with the load than the wall time does.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench-cache"
LOADS = (
    "import sys, orjson\n"
    "n = 0\n"
    "with open(sys.argv[1], 'rb') as f:\n"
    "    for line in f:\n"
    "        orjson.loads(line); n += 1\n"
)


def _line(step: int, rng: random.Random, state: dict[str, float]) -> bytes:
    max_abs = 0.05 * math.exp(rng.gauss(0, 0.3)) * (30 if rng.random() < 0.001 else 1)
    overflow = step > 0 and step % 2000 == 0
    scale = state["scale"]
    if overflow:
        state["scale"] = scale / 2
    elif step % 500 == 0:
        state["scale"] = min(scale * 2, 2.0**24)
    warnings = []
    if step % 50_000 == 25_000:
        warnings.append({"code": "GRAD_NORM_SPIKE", "message": "norm 12x the running median"})
    return (
        orjson.dumps(
            {
                "format": "nanrunbook-telemetry/1",
                "run_id": "bench-run",
                "rank": 0,
                "world_size": 1,
                "step": step,
                "time": 1.7645e9 + step * 0.8,
                "loss": 3.0 * math.exp(-step / 300_000) + rng.random() * 0.05,
                "loss_class": "finite",
                "grad": {
                    "nan": 0,
                    "posinf": 1 if overflow else 0,
                    "neginf": 0,
                    "max_abs": max_abs,
                    "dtype": "F32",
                    "headroom_bits": math.log2(3.4028234663852886e38 / max_abs),
                    "norm": None if overflow else max_abs * 40,
                },
                "update": {
                    "nan": 0,
                    "posinf": 0,
                    "neginf": 0,
                    "max_abs": 0.0 if overflow else 1e-4,
                },
                "scale": scale,
                "found_inf": overflow,
                "skipped": overflow,
                "held": False,
                "warnings": warnings,
                "bundle": None,
            }
        )
        + b"\n"
    )


def ensure_file(lines: int) -> Path:
    path = CACHE / f"telemetry-{lines}.jsonl"
    if path.exists():
        return path
    CACHE.mkdir(exist_ok=True)
    rng, state = random.Random(0), {"scale": 65536.0}
    temp = path.with_suffix(".tmp")
    with open(temp, "wb") as out:
        for start in range(0, lines, 10_000):
            out.write(
                b"".join(_line(s, rng, state) for s in range(start, min(lines, start + 10_000)))
            )
    temp.rename(path)
    return path


@dataclass
class Command:
    name: str
    argv: list[str]
    expect: int
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)  # user + system seconds
    rss_kib: list[int] = field(default_factory=list)

    def run(self) -> None:
        started = time.perf_counter()
        process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        err = process.stderr.read().decode(errors="replace") if process.stderr else ""
        if code != self.expect:
            raise SystemExit(f"{self.name}: exit {code}, expected {self.expect}\n{err}")
        self.walls.append(wall)
        self.cpus.append(usage.ru_utime + usage.ru_stime)
        self.rss_kib.append(usage.ru_maxrss)

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)

    @property
    def peak_mb(self) -> float:
        return max(self.rss_kib) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    big, small = ensure_file(args.lines), ensure_file(args.lines // 10)
    watch = [sys.executable, "-m", "nanrunbook", "watch"]
    commands = [
        Command("watch", [*watch, "--format", "kv", str(big)], 0),
        Command("text", [*watch, str(big)], 0),
        Command("loads", [sys.executable, "-c", LOADS, str(big)], 0),
        Command("wc", ["wc", "-l", str(big)], 0),
        Command("watch/10", [*watch, "--format", "kv", str(small)], 0),
    ]
    for command in commands:  # warm-up: page cache, .pyc files
        command.run()
        command.walls.clear()
        command.cpus.clear()
    for _ in range(args.runs):
        for command in commands:
            command.run()
    by = {c.name: c for c in commands}
    size = big.stat().st_size / 1e6
    print(f"{args.lines} lines ({size:.0f} MB), median of {args.runs} alternating warm-cache runs")
    print(f"{platform.python_implementation()} {platform.python_version()}, load {os.getloadavg()}")
    for command in commands:
        print(
            f"  {command.name:<9} {command.median:7.2f} s wall {command.cpu:7.2f} s CPU"
            f"   peak RSS {command.peak_mb:6.1f} MB"
        )
    print(
        f"  watch / orjson.loads loop  {by['watch'].median / by['loads'].median:.2f} x wall,"
        f" {by['watch'].cpu / by['loads'].cpu:.2f} x CPU"
    )
    print(f"  watch / wc -l              {by['watch'].median / by['wc'].median:.1f} x")
    print(f"  lines per CPU second       {args.lines / by['watch'].cpu:,.0f} (watch)")
    growth = by["watch"].peak_mb / by["watch/10"].peak_mb
    print(f"  peak RSS, 10x the lines    {growth:.2f} x")


if __name__ == "__main__":
    main()
