"""In-process benchmark of the scan designs, to choose between them.

    python bench/bench_scan.py [--size 1GiB] [--rounds 5]

On the cached benchmark bundle (many tensors, see ``bundlegen.py``) and on one
file holding a single big BF16 tensor, times in one process, alternating round
by round:

* ``sha256``   -- one hashlib stream over the same bytes (the one-core floor);
* ``seq``      -- ``scan_all(workers=1)``: the one-thread scan (read, hash, count);
* ``pool``     -- one worker per core, each reads, hashes and counts its tensors;
* ``tail``     -- the pool, and the last tensors overlapped (the default);
* ``pipe``     -- every worker overlapped: a helper reads and counts chunk k+1
  while the worker hashes chunk k (a reader/hasher pipeline, double-buffered);
* ``tail@S``   -- the default design with chunk size S;
* ``read``     -- only the reads (the kernel's copy from the page cache).

Prints medians and ratios to the ``sha256`` floor of the same run. No start-up
cost is included (see ``bench_check.py`` for the real CLI).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from bundlegen import ensure_bundle, parse_size, tensor_files  # noqa: E402

from nanrunbook.dtypes import WHOLE_ELEMENTS_BYTES  # noqa: E402
from nanrunbook.tensors.safetensors import read_header  # noqa: E402
from nanrunbook.tensors.scan import CHUNK_SIZE, ScanJob, scan_all  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def bundle_jobs(bundle: Path) -> list[ScanJob]:
    jobs = []
    for path in tensor_files(bundle):
        fd = os.open(path, os.O_RDONLY)
        header = read_header(fd, path.name)
        for entry in header.entries.values():
            jobs.append(ScanJob(fd, entry.begin, entry.end - entry.begin, entry.dtype))
    return jobs


def single_tensor(cache: Path, size: int) -> list[ScanJob]:
    path = cache / f"single-bf16-{size >> 20}MiB.bin"
    if not path.exists() or path.stat().st_size != size:
        import numpy as np

        rng = np.random.default_rng(1)
        with open(path.with_suffix(".partial"), "wb") as out:
            for _ in range(size // (8 * MiB)):
                out.write(rng.standard_normal(4 * MiB, dtype=np.float32).astype("<f2").tobytes())
        os.replace(path.with_suffix(".partial"), path)
    fd = os.open(path, os.O_RDONLY)
    return [ScanJob(fd, 0, size, "BF16")]


def sha_floor(jobs: list[ScanJob], buffer: bytearray) -> None:
    digest = hashlib.sha256()
    view = memoryview(buffer)
    size = len(view)
    for job in jobs:
        done = 0
        while done < job.length:
            n = os.preadv(job.fd, [view[: min(size, job.length - done)]], job.offset + done)
            digest.update(view[:n])
            done += n


def copy_only(jobs: list[ScanJob], buffer: bytearray) -> None:
    """Only the kernel's copy from the page cache: the read cost of a scan."""
    view = memoryview(buffer)
    size = len(view)
    for job in jobs:
        for done in range(0, job.length, size):
            os.preadv(job.fd, [view[: min(size, job.length - done)]], job.offset + done)


def chunk(size: int) -> int:
    return size - size % WHOLE_ELEMENTS_BYTES


def variants(jobs: list[ScanJob]) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {
        "sha256": lambda: sha_floor(jobs, bytearray(CHUNK_SIZE)),
        "read": lambda: copy_only(jobs, bytearray(CHUNK_SIZE)),
        "seq": lambda: scan_all(jobs, workers=1),
        "pool": lambda: scan_all(jobs, overlap="never"),
        "tail": lambda: scan_all(jobs),
        "pipe": lambda: scan_all(jobs, overlap="always"),
    }
    for size in (512 * KiB, 1 * MiB, 4 * MiB, 8 * MiB):
        out[f"tail@{size // KiB}K"] = functools.partial(scan_all, jobs, chunk_size=chunk(size))
    return out


def measure(name: str, jobs: list[ScanJob], rounds: int) -> None:
    total = sum(j.length for j in jobs)
    runs = variants(jobs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():  # warm-up: page cache and code paths
        fn()
    for _ in range(rounds):
        for key, fn in runs.items():
            started = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - started)
    floor = statistics.median(times["sha256"])
    print(f"\n{name}: {len(jobs)} tensors, {total / 2**30:.2f} GiB, warm cache, {rounds} rounds")
    print(f"  default chunk {CHUNK_SIZE} bytes, {os.cpu_count()} CPUs")
    for key, values in times.items():
        m = statistics.median(values)
        print(f"  {key:10} {m:7.3f} s  {total / m / 1e9:5.2f} GB/s  {m / floor:5.2f} x sha256")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--single", default="512MiB", help="size of the one-tensor file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=ROOT / ".bench-cache")
    args = parser.parse_args()
    bundle = ensure_bundle(args.cache, parse_size(args.size))
    measure(f"bundle {bundle.name}", bundle_jobs(bundle), args.rounds)
    measure("one BF16 tensor", single_tensor(args.cache, parse_size(args.single)), args.rounds)


if __name__ == "__main__":
    main()
