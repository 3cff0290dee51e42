"""Time and peak memory of ``nanrunbook check`` on every hostile case (issue 5).

Each case of ``tests/hostile_support.CASES`` is built in a temporary directory
and checked by the CLI in its own child process (``--format kv``); the child's
wall time and peak RSS come from /usr/bin/time (``os.wait4`` where it is
missing). A valid fixture is measured first as the baseline of a normal check. These are figures for the README and a
report, not assertions: a test must never depend on the speed of the machine.

    .venv/bin/python fuzz/measure_cases.py [--repeat N] [CASE ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import hostile_support as hs  # noqa: E402

TIME = shutil.which("time", path="/usr/bin:/bin")


def measure(bundle: Path) -> tuple[int, float, float]:
    """(exit code, seconds, peak RSS in MiB) of one ``check --format kv`` child.

    The child is started by /usr/bin/time, whose own small process is its parent:
    a child forked straight from this script would inherit this script's memory
    high-water mark (the cases are built here) and report it as its own.
    """
    command = [*hs.CLI, "check", "--format", "kv", str(bundle)]
    with tempfile.NamedTemporaryFile("r", suffix=".time") as figures:
        if TIME:
            command = [TIME, "-f", "%e %M", "-o", figures.name, *command]
        start = time.monotonic()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.monotonic() - start
        code = os.waitstatus_to_exitcode(status)
        if TIME:
            text = Path(figures.name).read_text().split()
            # time prints "Command exited with non-zero status N" first when N != 0
            seconds, kib = float(text[-2]), int(text[-1])
            return code, seconds, kib / 1024
        return code, elapsed, usage.ru_maxrss / 1024  # may include this script's peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the slowest is shown")
    args = parser.parse_args()
    names = args.cases or sorted(hs.CASES)
    unknown = set(names) - set(hs.CASES)
    if unknown:
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")

    rows: list[tuple[str, int, float, float]] = []
    baseline = [measure(hs.FIXTURES / "hold-backward-dynamic-skip") for _ in range(args.repeat)]
    rows.append(
        (
            "(baseline: valid fixture)",
            baseline[0][0],
            max(b[1] for b in baseline),
            max(b[2] for b in baseline),
        )
    )
    for name in names:
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(prefix="measure-") as tmp:
                bundle = hs.CASES[name](Path(tmp))
                runs.append(measure(bundle))
        rows.append((name, runs[0][0], max(r[1] for r in runs), max(r[2] for r in runs)))

    width = max(len(r[0]) for r in rows)
    print(f"{'case':<{width}}  exit  seconds  peak RSS MiB")
    for name, code, seconds, rss in rows:
        print(f"{name:<{width}}  {code:>4}  {seconds:7.2f}  {rss:12.1f}")
    cases = rows[1:]
    slowest = max(cases, key=lambda r: r[2])
    largest = max(cases, key=lambda r: r[3])
    print(
        f"\n{len(cases)} cases; slowest {slowest[0]} {slowest[2]:.2f} s; "
        f"largest {largest[0]} {largest[3]:.1f} MiB; baseline {rows[0][3]:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
