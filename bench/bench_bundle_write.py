"""What writing a bundle costs in host memory and time: the in-memory writer
(every tensor's bytes held until ``write``) against the streaming one
(``spool_dir=``: each tensor spooled to disk as it is observed, then the header
and a kernel copy of the spool), in the same run.

For each: the peak of Python-held bytes (tracemalloc) while observing and
writing N MiB of tensors made one at a time, the peak RSS growth of a fresh
subprocess doing the same, and the wall time. The streaming writer's final
copy is timed with copy_file_range(2) (what it uses) and with a 1 MiB
read/write loop (shutil.copyfileobj), for comparison.

    python bench/bench_bundle_write.py [--megabytes 256] [--tensor-megabytes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nanrunbook.capture import BundleWriter
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.manifest.parse import RECOVERY_PARTS

OWNER = "ml-oncall"


def writer(spool: Path | None) -> BundleWriter:
    binding: dict[str, dict[str, Any]] = {
        name: {"id": f"{name}-1"}
        for name in (
            *("model", "checkpoint", "data", "batch", "loader_cursor", "optimizer"),
            *("scheduler", "random_state", "environment"),
        )
    }
    binding["objective"] = {"id": "objective", "reduction": "mean"}
    binding["scaler"] = {"id": "no-scaler", "mode": "none", "scale": 1}
    binding["topology"] = {"id": "single", "world_size": 1, "rank": 0}
    binding["precision"] = {"id": "fp32", "param_dtype": "F32", "compute_dtype": "F32"}
    return BundleWriter(
        run_id="bench",
        step=2,
        incident_owner=OWNER,
        binding=binding,
        last_known_good={
            "checkpoint_id": "c1",
            "step": 1,
            "verified_together": list(RECOVERY_PARTS),
        },
        spool_dir=spool,
    )


def tensors(stage: str, total: int, each: int) -> Iterator[tuple[str, Any, str]]:
    rng = np.random.default_rng(0)
    for i in range(total // each):
        yield f"{stage}/t{i}", rng.standard_normal(each // 4, dtype=np.float32), "bench"


def write_bundle(out: Path, stream: bool, total: int, each: int) -> None:
    w = writer(out / "spool" if stream else None)
    per_stage = total // len(STAGE_ORDER)
    for stage in STAGE_ORDER:
        extra = {"gradients": "unscaled"} if stage == "backward" else {}
        w.observe(stage, tensors(stage, per_stage, each), owner=OWNER, probe_source="p", **extra)
    w.write(out / "bundle")


def measure(stream: bool, total: int, each: int) -> tuple[int, float]:
    out = Path(tempfile.mkdtemp(prefix="bench-bundle-write-"))
    try:
        tracemalloc.start()
        start = time.perf_counter()
        write_bundle(out, stream, total, each)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak, elapsed
    finally:
        shutil.rmtree(out, ignore_errors=True)


def timed(stream: bool, total: int, each: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        out = Path(tempfile.mkdtemp(prefix="bench-bundle-write-"))
        try:
            start = time.perf_counter()
            write_bundle(out, stream, total, each)
            best = min(best, time.perf_counter() - start)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    return best


def rss_child(stream: bool, total: int, each: int) -> int:
    """Peak RSS growth (bytes) of a fresh interpreter writing the bundle."""
    result = subprocess.run(
        [
            *(sys.executable, __file__, "--child", "stream" if stream else "memory"),
            *("--megabytes", str(total >> 20), "--tensor-megabytes", str(each >> 20)),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return int(json.loads(result.stdout)["rss_growth"])


def child(stream: bool, total: int, each: int) -> None:
    out = Path(tempfile.mkdtemp(prefix="bench-bundle-write-"))
    try:
        write_bundle(out, stream, 5 * each, each)  # warm: imports, first allocations
        shutil.rmtree(out / "bundle")
        before = peak_rss()
        write_bundle(out, stream, total, each)
        after = peak_rss()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"rss_growth": after - before}))


def peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM where /proc has it (ru_maxrss
    starts at the parent's peak: fork copies the high-water mark, exec keeps it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def buffered_copy(source: int, offset: int, length: int, destination: int) -> None:
    with open(source, "rb", closefd=False) as src, open(destination, "wb", closefd=False) as dst:
        src.seek(offset)
        shutil.copyfileobj(src, dst, 1 << 20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256, help="tensor MiB in the bundle")
    parser.add_argument("--tensor-megabytes", type=int, default=4, help="MiB per tensor")
    parser.add_argument("--child", choices=["memory", "stream"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    total, each = args.megabytes << 20, args.tensor_megabytes << 20
    if args.child:
        child(args.child == "stream", total, each)
        return 0
    print(f"writing a bundle of {args.megabytes} MiB ({args.tensor_megabytes} MiB tensors)")
    figures = {}
    for stream in (False, True):
        peak, _ = measure(stream, total, each)
        figures[stream] = (peak, timed(stream, total, each), rss_child(stream, total, each))
    for stream, (peak, seconds, rss) in figures.items():
        name = "streaming (spool_dir)" if stream else "in memory"
        print(
            f"  {name:22s} python-held peak {peak / 2**20:8.1f} MiB"
            f" ({peak / each:5.2f} tensors), RSS growth {rss / 2**20:8.1f} MiB,"
            f" {seconds:6.2f} s"
        )
    ratio = figures[True][1] / figures[False][1]
    print(f"  write time, streaming / in memory: {ratio:.2f}")
    import nanrunbook.capture.atomic as atomic

    kernel = figures[True][1]
    real = atomic.copy_range
    atomic.copy_range = buffered_copy
    try:
        buffered = timed(True, total, each)
    finally:
        atomic.copy_range = real
    print(
        f"  streaming with copy_file_range {kernel:.2f} s, with a 1 MiB copyfileobj"
        f" loop {buffered:.2f} s (on {os.statvfs(tempfile.gettempdir()).f_bsize}-byte blocks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
