"""Benchmark: ``nanrunbook diff`` of two bundles against checking both, same run.

    python bench/bench_diff.py [--size 1GiB] [--runs 5]

Generates once into ``.bench-cache/`` (see ``bundlegen.py``) a bundle of
``--size`` bytes and a second one that differs from it in a few tensors
(``PERTURBED``: one activation, one gradient, one optimizer update; every 7th
element's lowest bit flipped), then times, alternating round by round so that
the noise of a shared machine falls on every command alike, each in its own
subprocess:

* ``diff``    -- ``nanrunbook diff --format kv BASE OTHER``: checks both, then
  compares the differing tensors element by element (exit 0, REPRODUCED);
* ``check2``  -- ``nanrunbook check --format kv`` of BASE, then of OTHER, as
  two commands in one shell: what the diff replaces (exit 1, HOLD);
* ``lib-diff`` / ``lib-check2`` -- the same through the library in a plain
  ``python -c`` (``diff_bundles`` against two ``check_bundle`` calls): the
  ratio without the command-line start-ups.

It prints the median wall time of each, the ratios (goal: diff <= 1.3 x
check2) and the peak RSS of each subprocess. Runs are warm-cache: an untimed
warm-up of each command reads every file first.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_check import Command, nanrunbook_argv  # noqa: E402
from bundlegen import ensure_bundle, parse_size, show_size, tensor_files  # noqa: E402

PERTURBED = ("act/layers.1", "grad/layers.0.weight", "update/layers.2.weight")
LIB_DIFF = (
    "import sys; from nanrunbook import diff_bundles; "
    "c = diff_bundles(sys.argv[1], sys.argv[2]); print(c.verdict); sys.exit(c.exit_code())"
)
LIB_CHECK2 = (
    "import sys; from nanrunbook import check_bundle; "
    "r = [check_bundle(p) for p in sys.argv[1:3]]; sys.exit(r[-1].exit_code)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bundle size, e.g. 1GiB, 256MiB")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    args = parser.parse_args()

    size = parse_size(args.size)
    base = ensure_bundle(args.cache, size)
    other = ensure_bundle(args.cache, size, PERTURBED)
    cli = nanrunbook_argv()
    two_checks = " ; ".join(
        f"{' '.join(cli)} check --format kv {path} >/dev/null" for path in (base, other)
    )
    commands = [
        Command("diff", [*cli, "diff", "--format", "kv", str(base), str(other)], expect=0),
        Command("check2", ["sh", "-c", two_checks], expect=1),
        Command("lib-diff", [sys.executable, "-c", LIB_DIFF, str(base), str(other)], expect=0),
        Command("lib-check2", [sys.executable, "-c", LIB_CHECK2, str(base), str(other)], expect=1),
    ]
    data = sum(p.stat().st_size for b in (base, other) for p in tensor_files(b))
    print(f"bundles    {base}\n           {other}")
    print(f"           {data / 2**30:.2f} GiB of tensor files; {len(PERTURBED)} tensors differ")
    print(f"machine    {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"load       1-min load average {os.getloadavg()[0]:.2f} before the runs")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "nanrunbook")], check=True)
    for command in commands:  # warm-up, untimed
        command.run()
        command.walls.clear()
        command.rss_kib.clear()
    for round_ in range(args.runs):
        order = commands[round_ % len(commands) :] + commands[: round_ % len(commands)]
        for command in order:
            command.run()
        print(
            f"round {round_ + 1}/{args.runs}: "
            + "  ".join(f"{c.name} {c.walls[-1]:.3f}s" for c in commands),
            flush=True,
        )
    by = {c.name: c for c in commands}
    print()
    print(f"{'command':10} {'median s':>9} {'min s':>7} {'max s':>7} {'peak RSS MB':>12}")
    for c in commands:
        print(
            f"{c.name:10} {c.median:9.3f} {min(c.walls):7.3f} {max(c.walls):7.3f} {c.peak_mb:12.1f}"
        )
    print()
    ratio = by["diff"].median / by["check2"].median
    print(f"diff / check2          {ratio:.2f} x   (goal <= 1.3) at {show_size(size)} each")
    lib = by["lib-diff"].median / by["lib-check2"].median
    print(f"lib-diff / lib-check2  {lib:.2f} x   (the same without the CLI start-ups)")
    print(f"1-min load average     {os.getloadavg()[0]:.2f} after the runs")


if __name__ == "__main__":
    main()
