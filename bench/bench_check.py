"""Benchmark: ``nanrunbook check`` on a big bundle against the SHA-256 floor and torch.

    python bench/bench_check.py [--size 1GiB] [--runs 5] [--no-torch] [--baseline DIR]
                                [--manifest-only]

Generates a bundle of ``--size`` bytes once into ``.bench-cache/`` (see
``bundlegen.py``), then times, alternating round by round so that the noise of
a shared machine falls on every command alike, each in its own subprocess:

* ``check``  -- the real CLI, ``nanrunbook check --format kv BUNDLE`` (HOLD, exit 1);
* ``sha256`` -- one ``hashlib.sha256`` stream over the same tensor files
  (``sha_floor.py``): the floor of any design that hashes on one core;
* ``torch``  -- ``safetensors.torch.load_file`` + ``torch.isfinite`` per tensor
  (``torch_naive.py``), what one would write without nanrunbook;
* ``tiny``   -- ``nanrunbook check`` on the smallest fixture: start-up cost;
* ``library`` -- the same check as ``check`` through ``nanrunbook.check_bundle``
  and the kv renderer in a plain ``python -c``: the difference to ``check`` is
  the cost of the command-line framework's start-up;
* ``base``   -- with ``--baseline DIR``, ``nanrunbook check`` from another source
  tree (say ``git archive`` of an earlier commit unpacked in DIR), so a change is
  measured against its parent in the same rounds.

``check`` and ``library`` run the nanrunbook of this checkout (``PYTHONPATH`` is
set to it), whatever an installed copy points at.

The manifest side has rows of its own, on bundles of many small tensors (16
F32 elements each, ``bundlegen.generate_many``), where the data costs nothing
and JSON, fields and headers are the whole check:

* ``many``   -- ``nanrunbook check`` on 20,480 tensors (a 6.6 MB manifest);
* ``orjson`` -- ``orjson.loads`` of that manifest alone, in its own process: the
  floor of reading it at all;
* ``few``    -- ``nanrunbook check`` on 50 tensors: the everyday bundle;
* ``many-base``, ``few-base`` -- with ``--baseline DIR``, the same from DIR.

``--manifest-only`` runs just these, without the 1 GiB bundle.

It prints the median wall time of each, the ratios, and the peak RSS of each
subprocess (``ru_maxrss`` from ``wait4``). Every timed run reads files that the
previous rounds (and an untimed warm-up) just read: the runs are warm-cache,
as the output says.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bundlegen import ensure_bundle, ensure_many, parse_size, show_size, tensor_files  # noqa: E402

TINY = ROOT / "fixtures" / "continue-all-finite"
# The same check and kv output through the library, without the CLI framework:
# shows what the command line's own start-up costs.
LIBRARY = (
    "import sys; from nanrunbook import check_bundle;"
    " from nanrunbook.output.renderers import RENDERERS;"
    " r = check_bundle(sys.argv[1]); RENDERERS['kv'].report(r, sys.stdout); sys.exit(r.exit_code)"
)


MANY_TENSORS = 20_480
FEW_TENSORS = 50
ORJSON_ONLY = "import sys, orjson; orjson.loads(open(sys.argv[1], 'rb').read())"


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that makes a child import nanrunbook from ``tree``."""
    return {**os.environ, "PYTHONPATH": str(tree)}


@dataclass
class Command:
    name: str
    argv: list[str]
    expect: int  # exit status
    env: dict[str, str] | None = None
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)  # user + system seconds
    rss_kib: list[int] = field(default_factory=list)

    def run(self) -> None:
        started = time.perf_counter()
        process = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env
        )
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        if code != self.expect:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise SystemExit(f"{self.name}: exit {code}, expected {self.expect}\n{err}")
        if process.stderr:
            process.stderr.close()
        self.walls.append(wall)
        self.cpus.append(usage.ru_utime + usage.ru_stime)
        self.rss_kib.append(usage.ru_maxrss)  # KiB on Linux

    @property
    def median(self) -> float:
        return statistics.median(self.walls)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpus)

    @property
    def peak_mb(self) -> float:
        return max(self.rss_kib) * 1024 / 1e6


def nanrunbook_argv() -> list[str]:
    """This tree's program, started as the baseline's is (:func:`baseline_argv`):
    like with like. (The installed console script measured 1.02 x its start-up:
    it is compiled at every start and puts its own folder first on the path.)"""
    return [sys.executable, "-P", "-m", "nanrunbook"]


def baseline_argv(tree: Path) -> list[str]:
    """The baseline tree's own program: ``python -P -m nanrunbook`` (``-P``: not the
    current directory first, so PYTHONPATH picks the tree), whatever entry point
    the installed script names. Checked to import from ``tree``."""
    argv = [sys.executable, "-P", "-m", "nanrunbook"]
    probe = [sys.executable, "-P", "-c", "import nanrunbook; print(nanrunbook.__file__)"]
    found = subprocess.run(probe, env=tree_env(tree), capture_output=True, text=True).stdout
    if not Path(found.strip()).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"--baseline {tree}: nanrunbook imports from {found.strip()!r}")
    return argv


def torch_available() -> bool:
    probe = [sys.executable, "-c", "import torch, safetensors.torch"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bundle size, e.g. 1GiB, 4GiB, 256MiB")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    parser.add_argument(
        "--baseline", type=Path, help="another nanrunbook source tree, timed as 'base'"
    )
    parser.add_argument(
        "--manifest-only", action="store_true", help="only the many-tensor rows (no 1 GiB bundle)"
    )
    return parser.parse_args()


def build_commands(bundle: Path, args: argparse.Namespace) -> list[Command]:
    check = nanrunbook_argv()
    mine = tree_env(ROOT)
    commands = [
        Command("check", [*check, "check", "--format", "kv", str(bundle)], 1, mine),
        Command("sha256", [sys.executable, str(HERE / "sha_floor.py"), str(bundle)], expect=0),
        Command("tiny", [*check, "check", "--format", "kv", str(TINY)], 0, mine),
        Command("library", [sys.executable, "-c", LIBRARY, str(bundle)], 1, mine),
    ]
    if args.baseline:
        base_argv = [*baseline_argv(args.baseline), "check", "--format", "kv", str(bundle)]
        commands.append(Command("base", base_argv, 1, tree_env(args.baseline.resolve())))
    if args.no_torch:
        print("torch baseline skipped (--no-torch)")
    elif torch_available():
        commands.append(
            Command("torch", [sys.executable, str(HERE / "torch_naive.py"), str(bundle)], expect=0)
        )
    else:
        print("torch baseline skipped: torch is not installed (pip install torch==2.13.0)")
    return commands


def manifest_commands(args: argparse.Namespace) -> list[Command]:
    many, few = ensure_many(args.cache, MANY_TENSORS), ensure_many(args.cache, FEW_TENSORS)
    check = [*nanrunbook_argv(), "check", "--format", "kv"]
    mine = tree_env(ROOT)
    commands = [
        Command("many", [*check, str(many)], 1, mine),
        Command("orjson", [sys.executable, "-c", ORJSON_ONLY, str(many / "manifest.json")], 0),
        Command("few", [*check, str(few)], 1, mine),
    ]
    if args.baseline:
        base = tree_env(args.baseline.resolve())
        base_check = [*baseline_argv(args.baseline), "check", "--format", "kv"]
        commands.append(Command("many-base", [*base_check, str(many)], 1, base))
        commands.append(Command("few-base", [*base_check, str(few)], 1, base))
    print(f"many       {many} ({(many / 'manifest.json').stat().st_size / 1e6:.1f} MB manifest)")
    print(f"few        {few}")
    return commands


def describe_setup(bundle: Path | None, data_bytes: int, baseline: Path | None) -> None:
    if bundle is not None:
        files = len(tensor_files(bundle))
        print(f"bundle     {bundle} ({data_bytes / 2**30:.2f} GiB in {files} files)")
    print(
        f"machine    {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}"
    )
    print(f"load       1-min load average {os.getloadavg()[0]:.2f} before the runs")
    print("cache      warm: an untimed warm-up run of each command read every file first,")
    print("           and the bundle fits in memory, so each timed run reads the page cache")
    # An installed package has its bytecode compiled (pip does it); this tree may not,
    # when PYTHONDONTWRITEBYTECODE is set. Compile it so start-up is measured as installed.
    for tree in [ROOT, *([baseline] if baseline else [])]:
        compile_tree = [sys.executable, "-m", "compileall", "-q", str(tree / "nanrunbook")]
        subprocess.run(compile_tree, check=True)
    print("bytecode   nanrunbook compiled first, as an installed package is")
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
    print(f"RSS        this script: {own:.1f} MB (a child's peak RSS cannot be below it)")


def run_rounds(commands: list[Command], runs: int) -> None:
    """An untimed warm-up of each, then ``runs`` rounds, each starting one later."""
    for command in commands:
        command.run()
        command.walls.clear()
        command.cpus.clear()
        command.rss_kib.clear()
    for round_ in range(runs):
        order = commands[round_ % len(commands) :] + commands[: round_ % len(commands)]
        for command in order:
            command.run()
        print(
            f"round {round_ + 1}/{runs}: "
            + "  ".join(f"{c.name} {c.walls[-1]:.3f}s" for c in commands),
            flush=True,
        )


def report(commands: list[Command], args: argparse.Namespace, data_bytes: int) -> None:
    by = {c.name: c for c in commands}
    print()
    print(
        f"{'command':9} {'median s':>9} {'min s':>7} {'max s':>7} {'cpu s':>7}"
        f" {'peak RSS MB':>12}  (runs: {args.runs}; cpu: median user + system)"
    )
    for c in commands:
        print(
            f"{c.name:9} {c.median:9.3f} {min(c.walls):7.3f} {max(c.walls):7.3f} {c.cpu:7.3f}"
            f" {c.peak_mb:12.1f}"
        )
    print()
    report_manifest(by)
    if "check" in by:
        report_data(by, args, data_bytes)
    print(f"1-min load average    {os.getloadavg()[0]:.2f} after the runs (2 CPUs: above ~0.5,")
    print("                      others were running too and the ratios are pessimistic)")


def paired(mine: Command, other: Command) -> float:
    """The median of the round-by-round wall ratios: a round runs every command
    once, close together in time, so a drift of the machine's speed between
    rounds falls on both (steadier than a ratio of medians for short commands)."""
    return statistics.median(a / b for a, b in zip(mine.walls, other.walls, strict=True))


def report_manifest(by: dict[str, Command]) -> None:
    many, orjson, few = by["many"], by["orjson"], by["few"]
    print(
        f"many / orjson.loads   {many.median / orjson.median:.2f} x   wall {many.median:.3f} s"
        f" (target <= 0.5 s), cpu {many.cpu:.3f} s, for {MANY_TENSORS:,} tensors"
    )
    print(f"few tensors check     {few.median:.3f} s, cpu {few.cpu:.3f} s ({FEW_TENSORS} tensors)")
    for name in ("many", "few"):
        base = by.get(f"{name}-base")
        if base is not None:
            mine = by[name]
            print(
                f"{name} / {name}-base".ljust(22)
                + f"wall {paired(mine, base):.2f} x paired ({mine.median:.3f} s vs"
                f" {base.median:.3f} s), cpu {mine.cpu / base.cpu:.2f} x"
                f" ({mine.cpu:.3f} s vs {base.cpu:.3f} s)"
            )


def report_data(by: dict[str, Command], args: argparse.Namespace, data_bytes: int) -> None:
    check, sha = by["check"], by["sha256"]
    print(
        f"check / sha256 floor  {check.median / sha.median:.2f} x   (target <= 0.75, at least"
        f" < 1.0)  check reads {data_bytes / check.median / 1e9:.2f} GB/s"
    )
    print(f"  paired, by round    {paired(check, sha):.2f} x")
    if "torch" in by:
        print(f"torch / check         {by['torch'].median / check.median:.1f} x   (target >= 5)")
    if "base" in by:
        base = by["base"]
        print(
            f"base / sha256 floor   {base.median / sha.median:.2f} x   "
            f"check / base {paired(check, base):.3f} x paired   ({args.baseline})"
        )
        print(
            f"cpu: check / base     {check.cpu / base.cpu:.3f} x   "
            f"check / sha256 {check.cpu / sha.cpu:.2f} x (less sensitive to load)"
        )
    lib = by["library"].median / sha.median
    print(f"library / sha256      {lib:.2f} x   (the same check without the CLI framework)")
    size = show_size(parse_size(args.size))
    print(f"check peak RSS        {check.peak_mb:.1f} MB (target <= 160) at {size}")
    print(f"tiny fixture check    {by['tiny'].median:.3f} s (target < 0.4)")


def main() -> None:
    args = parse_args()
    commands: list[Command] = []
    data_bytes = 0
    bundle = None
    if not args.manifest_only:
        bundle = ensure_bundle(args.cache, parse_size(args.size))
        data_bytes = sum(p.stat().st_size for p in tensor_files(bundle))
        commands += build_commands(bundle, args)
    commands += manifest_commands(args)
    describe_setup(bundle, data_bytes, args.baseline)
    run_rounds(commands, args.runs)
    report(commands, args, data_bytes)


if __name__ == "__main__":
    main()
