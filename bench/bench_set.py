"""Benchmark: an incident set of 8 x 128 MiB against one 1 GiB bundle, same run.

    python bench/bench_set.py [--members 8] [--member-size 128MiB] [--size 1GiB] [--runs 5]

Generates once into ``.bench-cache/`` (see ``bundlegen.py``) the 1 GiB bundle of
``bench_check.py`` and a set of ``--members`` bundles of ``--member-size`` each
(distinct data per rank, ``binding.topology`` rank r of world size 8; each
member holds at backward, so the set answers HOLD with origin ALL_RANKS), then
times, alternating round by round, each in its own process:

* ``bundle``  -- ``nanrunbook check --format kv`` on the 1 GiB bundle;
* ``set``     -- ``nanrunbook check --format kv`` on the set directory: members in
  parallel under one budget of scan workers (``nanrunbook.check_set``);
* ``serial``  -- the same members checked one after another through
  ``nanrunbook.check_bundle`` (each with every worker) in one ``python -c``:
  what the set would cost without scheduling members together.

It prints the median wall and CPU (user + system) time of each, the set / bundle
ratios (the target is about 1.0: a set checks as fast as one bundle of the same
bytes), and the peak RSS of each process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_check import Command, nanrunbook_argv, run_rounds, tree_env  # noqa: E402
from bundlegen import ensure_bundle, parse_size, show_size, tensor_files  # noqa: E402

SET_LAYOUT_VERSION = 1  # bump when the generated set changes

# Each member its own data (seed = rank), in a subprocess as ensure_bundle does.
GENERATE = (
    f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]; from pathlib import Path; "
    "from bundlegen import generate; generate(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
)
SERIAL = (
    "import sys; from pathlib import Path; from nanrunbook import EvidenceRejected, check_bundle\n"
    "codes = set()\n"
    "for member in sorted(Path(sys.argv[1]).glob('rank-*')):\n"
    "    try: codes.add(check_bundle(member).exit_code)\n"
    "    except EvidenceRejected: codes.add(3)\n"
    "sys.exit(max(codes))"
)


def ensure_set(cache: Path, members: int, member_size: int) -> Path:
    """The cached set: member r generated with seed r, then made rank r of ``members``."""
    target = cache / f"set-{members}x{show_size(member_size)}-v{SET_LAYOUT_VERSION}"
    if (target / "complete").is_file():
        return target
    print(f"generating {target} (once) ...", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    for rank in range(members):
        member = target / f"rank-{rank:05d}"
        if not (member / "manifest.json").is_file():
            subprocess.run(
                [sys.executable, "-c", GENERATE, str(member), str(member_size), str(rank)],
                check=True,
            )
        _make_rank(member, rank, members)
    (target / "complete").write_text("")  # a file, not a member: sets ignore it
    return target


def _make_rank(member: Path, rank: int, world_size: int) -> None:
    sys.path.insert(0, str(ROOT))
    from nanrunbook.manifest.content_id import EVIDENCE_ID_KEY, evidence_content_id

    path = member / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["binding"]["topology"] = {"id": "ddp", "world_size": world_size, "rank": rank}
    manifest["evidence_id"] = f"run-bench.step-9042.rank-{rank}"
    manifest[EVIDENCE_ID_KEY] = evidence_content_id(manifest)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--member-size", default="128MiB")
    parser.add_argument("--size", default="1GiB", help="the single bundle to compare with")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    args = parser.parse_args()

    bundle = ensure_bundle(args.cache, parse_size(args.size))
    incident = ensure_set(args.cache, args.members, parse_size(args.member_size))
    set_bytes = sum(f.stat().st_size for m in incident.glob("rank-*") for f in tensor_files(m))
    bundle_bytes = sum(f.stat().st_size for f in tensor_files(bundle))
    check = nanrunbook_argv()
    env = tree_env(ROOT)  # this checkout's code, whatever is installed
    commands = [
        Command("bundle", [*check, "check", "--format", "kv", str(bundle)], expect=1, env=env),
        Command("set", [*check, "check", "--format", "kv", str(incident)], expect=1, env=env),
        Command("serial", [sys.executable, "-c", SERIAL, str(incident)], expect=1, env=env),
    ]
    print(f"bundle     {bundle} ({bundle_bytes / 2**30:.2f} GiB)")
    print(f"set        {incident} ({set_bytes / 2**30:.2f} GiB in {args.members} members)")
    print(f"machine    {os.cpu_count()} CPUs; 1-min load {os.getloadavg()[0]:.2f} before")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "nanrunbook")], check=True)
    run_rounds(commands, args.runs)
    by = {c.name: c for c in commands}
    print()
    print(
        f"{'command':8} {'median s':>9} {'min s':>7} {'max s':>7} {'cpu s':>7} {'peak RSS MB':>12}"
    )
    for c in commands:
        print(
            f"{c.name:8} {c.median:9.3f} {min(c.walls):7.3f} {max(c.walls):7.3f} {c.cpu:7.3f}"
            f" {c.peak_mb:12.1f}"
        )
    per_round = [s / b for s, b in zip(by["set"].walls, by["bundle"].walls, strict=True)]
    print()
    print(
        f"set / bundle    {by['set'].median / by['bundle'].median:.2f} x  (median of"
        f" per-round ratios {statistics.median(per_round):.2f}; target about 1.0)"
    )
    print(f"serial / set    {by['serial'].median / by['set'].median:.2f} x")
    cpu = by["set"].cpu / by["bundle"].cpu
    print(f"cpu set/bundle  {cpu:.2f} x  (median user + system: less sensitive to load)")
    print(f"1-min load      {os.getloadavg()[0]:.2f} after (2 CPUs: above ~0.5, others ran too)")


if __name__ == "__main__":
    main()
