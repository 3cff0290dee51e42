"""Benchmark: the manifest side of a check, piece by piece, in one process per tree.

    python bench/bench_manifest.py [--rounds 7] [--baseline DIR] [--tensors 20480]

Times each piece of the manifest side on the ``bundlegen.generate_many`` bundle
of ``--tensors`` 16-element tensors (the one ``bench_check.py --manifest-only``
checks), as the CPU time of the best of ``--repeat`` calls (steadier than wall
time on a shared machine; each piece runs on one thread), in a child process that imports nanrunbook
from this checkout (and, with ``--baseline DIR``, another child importing it
from DIR, an earlier tree unpacked there). The children alternate round by
round, so the noise of a shared machine falls on both alike; the table shows
each piece's median over the rounds and the same-run ratio.

Pieces: ``read`` (access.read_manifest_bytes), ``load`` (strictjson.load_manifest),
``declared`` (declared_values), ``parse`` (parse_manifest), ``content_id``
(content_id_violations), ``headers`` (safetensors.read_header of every tensor
file), and ``orjson`` (``orjson.loads`` of the manifest: the floor).
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

from bundlegen import ensure_many  # noqa: E402

PIECES = ("read", "load", "declared", "parse", "content_id", "headers", "orjson")

# Runs in the child, with nanrunbook imported from the tree on PYTHONPATH.
CHILD = r"""
import gc, json, os, sys, time
from pathlib import Path
import orjson
from nanrunbook.access import read_manifest_bytes
from nanrunbook.manifest.content_id import content_id_violations
from nanrunbook.manifest.declared import declared_values
from nanrunbook.manifest.parse import parse_manifest
from nanrunbook.strictjson import load_manifest
from nanrunbook.tensors.safetensors import read_header

bundle, repeat = Path(sys.argv[1]), int(sys.argv[2])
files = sorted(p.name for p in bundle.glob("*.safetensors"))
gc.disable()  # as check_bundle runs

def best(call):
    times = []
    for _ in range(repeat):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return min(times)

def headers():
    for name in files:
        fd = os.open(bundle / name, os.O_RDONLY)
        try:
            read_header(fd, name)
        finally:
            os.close(fd)

raw = read_manifest_bytes(bundle)
document = load_manifest(raw)
out = {
    "read": best(lambda: read_manifest_bytes(bundle)),
    "load": best(lambda: load_manifest(raw)),
    "declared": best(lambda: declared_values(document.value)),
    "parse": best(lambda: parse_manifest(document.value)),
    "content_id": best(lambda: content_id_violations(document)),
    "headers": best(headers),
    "orjson": best(lambda: orjson.loads(raw)),
}
assert not parse_manifest(document.value)[1] and not content_id_violations(document)
print(json.dumps(out))
import nanrunbook
print(nanrunbook.__file__, file=sys.stderr)
"""


def run_child(tree: Path, bundle: Path, repeat: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, "-c", CHILD, str(bundle.resolve()), str(repeat)]
    # cwd: ``python -c`` puts the working directory first on sys.path, ahead of
    # PYTHONPATH; run in the tree itself so that it is the one imported.
    done = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr}")
    if not done.stderr.startswith(str(tree)):
        raise SystemExit(f"{tree}: the child imported {done.stderr.strip()}")
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3, help="calls per piece per round")
    parser.add_argument("--tensors", type=int, default=20_480)
    parser.add_argument("--baseline", type=Path, help="an earlier source tree to compare")
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    args = parser.parse_args()
    bundle = ensure_many(args.cache, args.tensors)
    trees = {"this": ROOT}
    if args.baseline:
        trees["base"] = args.baseline.resolve()
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_child(tree, bundle, args.repeat))
    size = (bundle / "manifest.json").stat().st_size
    print(f"{bundle} ({size / 1e6:.1f} MB manifest), median of {args.rounds} rounds, CPU ms")
    header = f"{'piece':<12}" + "".join(f"{name:>10}" for name in trees)
    print(header + ("     ratio" if args.baseline else ""))
    for piece in (*PIECES, "total"):
        medians = {}
        for name in trees:
            values = [
                sum(r[p] for p in PIECES if p != "orjson") if piece == "total" else r[piece]
                for r in rounds[name]
            ]
            medians[name] = statistics.median(values)
        line = f"{piece:<12}" + "".join(f"{medians[n] * 1e3:10.1f}" for n in trees)
        if args.baseline:
            line += f"{medians['this'] / medians['base']:10.2f}"
        print(line)


if __name__ == "__main__":
    main()
