"""The parallel scan: same results as one thread, in job order, whatever finishes first.

Covers ``scan_all`` on many tensors (NaN on chunk boundaries, tensors smaller
than a chunk, empty tensors, scalars) against ``workers=1`` and an independent
reference, ``verify_bundle`` with several workers against one, short reads and
digest mismatches, cancellation, and the CLI: its progress bar (stderr at a
terminal, text format only) and Ctrl-C on a big bundle (exit 130, one line).
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from bundlekit import copy_fixture, load, read_tensor_file, save, write_tensor_file
from fixtures_support import OWNER, binding
from hypothesis import given, settings
from hypothesis import strategies as st

from nanrunbook.capture import BundleWriter, RawTensor
from nanrunbook.contract import Caps
from nanrunbook.errors import Violation
from nanrunbook.manifest.parse import parse_manifest
from nanrunbook.records import StageFinding
from nanrunbook.strictjson import load_manifest_bytes
from nanrunbook.tensors.counting import extremes_bytes, tally_bytes
from nanrunbook.tensors.scan import CHUNK_SIZE, ScanJob, ShortRead, TensorScan, scan_all, scan_range
from nanrunbook.tensors.verify import verify_bundle

# The five parts a recovery point verifies together, stated as every caller must.
RECOVERY = ["model", "optimizer", "scheduler", "scaler", "data_position"]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8, "C64": 8}
NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "I64": "<i8",
    "C64": "<c8",
}


def make_values(dtype: str, n: int, rng: np.random.Generator, nan_at: list[int]) -> bytes:
    if n == 0:
        return b""
    if dtype == "I64":
        return rng.integers(-(2**40), 2**40, n, dtype="<i8").tobytes()
    if dtype == "C64":
        values = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype("<c8")
        for i in nan_at:
            values[i % n] = complex(np.nan, 1.0)
        return values.tobytes()
    values = rng.standard_normal(n).astype(np.float32).astype(NUMPY[dtype])
    for k, i in enumerate(nan_at):
        values[i % n] = [np.nan, np.inf, -np.inf][k % 3] if dtype != "F8_E4M3" else np.nan
    return values.tobytes()


@contextmanager
def file_with(content: bytes) -> Iterator[int]:
    with tempfile.TemporaryFile() as handle:
        handle.write(content)
        handle.flush()
        yield handle.fileno()


def many_tensors(chunk: int, seed: int) -> tuple[bytes, list[ScanJob], list[bytes]]:
    """One file of tensors of every size class around ``chunk`` bytes."""
    rng = np.random.default_rng(seed)
    blobs: list[tuple[str, bytes]] = []
    for dtype, width in ITEMSIZE.items():
        per_chunk = chunk // width
        sizes = [0, 1, per_chunk - 1, per_chunk, per_chunk + 1, 3 * per_chunk + 2]
        for n in sizes:
            # non-finite elements at the last of a chunk and the first of the next
            nan_at = [per_chunk - 1, per_chunk] if n > per_chunk else []
            blobs.append((dtype, make_values(dtype, n, rng, nan_at)))
    content = bytearray(b"\x7fHEADER\x00\xff")
    jobs = []
    for dtype, blob in blobs:
        jobs.append(ScanJob(-1, len(content), len(blob), dtype))
        content += blob
    return bytes(content), jobs, [blob for _, blob in blobs]


def in_memory(dtype: str, blob: bytes) -> TensorScan:
    """The scan a tensor held in memory gets: its digest, tally and extremes."""
    return TensorScan(
        hashlib.sha256(blob).hexdigest(), tally_bytes(dtype, blob), extremes_bytes(dtype, blob)
    )


def with_fd(jobs: list[ScanJob], fd: int) -> list[ScanJob]:
    return [ScanJob(fd, j.offset, j.length, j.dtype) for j in jobs]


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_many_tensors_match_one_thread_and_reference(workers: int) -> None:
    chunk = 96  # a multiple of every alignment; many chunks per tensor
    content, jobs, blobs = many_tensors(chunk, seed=workers)
    with file_with(content) as fd:
        jobs = with_fd(jobs, fd)
        one = scan_all(jobs, workers=1, chunk_size=chunk)
        many = scan_all(jobs, workers=workers, chunk_size=chunk)
        default = scan_all(jobs)
    expected = [in_memory(job.dtype, blob) for job, blob in zip(jobs, blobs, strict=True)]
    assert one == expected
    assert many == expected
    assert default == expected
    assert any(r.tally.nonfinite for r in expected if isinstance(r, TensorScan))


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=24),
    chunk_units=st.integers(1, 12),
    workers=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_jobs_any_chunk_any_workers(
    sizes: list[int], chunk_units: int, workers: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dtypes = list(ITEMSIZE)
    content = bytearray(b"pre")
    jobs, blobs = [], []
    for k, n in enumerate(sizes):
        dtype = dtypes[k % len(dtypes)]
        blob = make_values(dtype, n, rng, [int(rng.integers(0, max(n, 1)))] if n % 3 == 0 else [])
        jobs.append(ScanJob(-1, len(content), len(blob), dtype))
        blobs.append(blob)
        content += blob
    with file_with(bytes(content)) as fd:
        got = scan_all(with_fd(jobs, fd), workers=workers, chunk_size=24 * chunk_units)
    for result, job, blob in zip(got, jobs, blobs, strict=True):
        assert result == in_memory(job.dtype, blob)


@pytest.mark.parametrize("overlap", ["never", "tail", "always"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_overlap_modes_same_results(overlap: Any, workers: int) -> None:
    content, jobs, _ = many_tensors(48, seed=workers)
    with file_with(content) as fd:
        jobs = with_fd(jobs, fd)
        expected = scan_all(jobs, workers=1, chunk_size=48, overlap="never")
        assert scan_all(jobs, workers=workers, chunk_size=48, overlap=overlap) == expected
        one = [jobs[-1]]  # a single tensor of several chunks: overlapped on 2+ cores
        assert scan_all(one, workers=workers, chunk_size=48, overlap=overlap) == expected[-1:]


def test_only_the_tail_is_overlapped() -> None:
    spares: list[bool] = []

    def scan(fd: int, offset: int, length: int, dtype: str, **kwargs: Any) -> TensorScan:
        spares.append(kwargs["spare"] is not None)
        return scan_range(fd, offset, length, dtype, **kwargs)

    data = bytes(480)
    with file_with(data) as fd:
        scan_all([ScanJob(fd, 0, 480, "F32")] * 6, workers=1, chunk_size=48, scan=scan)
        assert spares == [False] * 6  # one worker: nothing to overlap with
        spares.clear()
        scan_all([ScanJob(fd, 0, 480, "F32")], workers=2, chunk_size=48, scan=scan)
        assert spares == [True]
        spares.clear()
        scan_all([ScanJob(fd, 0, 480, "F32")] * 6, workers=2, chunk_size=48, scan=scan)
        assert spares.count(True) in (1, 2)  # the last one or two started
        assert spares[:4] == [False] * 4
        spares.clear()
        scan_all([ScanJob(fd, 0, 48, "F32")], workers=2, chunk_size=48, scan=scan)
        assert spares == [False]  # one chunk: nothing to overlap


def test_results_in_job_order_when_finishing_out_of_order() -> None:
    # The longest job is handed out first and finishes last: order must not change.
    content, jobs, blobs = many_tensors(48, seed=7)
    with file_with(content) as fd:
        jobs = with_fd(jobs, fd)
        finished: list[int] = []
        lock = threading.Lock()

        def scan(fd: int, offset: int, length: int, dtype: str, **kwargs: Any) -> TensorScan:
            result = scan_range(fd, offset, length, dtype, **kwargs)
            with lock:
                finished.append(offset)
            return result

        got = scan_all(jobs, workers=4, chunk_size=48, scan=scan)
    assert [r.sha256 for r in got if isinstance(r, TensorScan)] == [
        hashlib.sha256(b).hexdigest() for b in blobs
    ]
    assert finished != sorted(finished)  # they did finish in another order


def test_short_read_and_os_error_are_per_job_results() -> None:
    data = np.arange(64, dtype="<f4").tobytes()
    with file_with(data) as fd:
        jobs = [
            ScanJob(fd, 0, 64, "F32"),
            ScanJob(fd, 200, 64, "F32"),  # past the end: a short read
            ScanJob(fd, 64, 64, "F32"),
            ScanJob(-5, 0, 8, "F32"),  # a bad descriptor
            ScanJob(fd, 128, 128, "F32"),
        ]
        # chunk_size=24 scans each job alone; the default batches these small ones,
        # and a batch whose read fails falls back to one scan per member.
        for workers, chunk in ((1, 24), (3, 24), (1, CHUNK_SIZE), (3, CHUNK_SIZE)):
            got = scan_all(jobs, workers=workers, chunk_size=chunk)
            assert isinstance(got[1], ShortRead) and got[1].got == 56
            assert isinstance(got[3], OSError)
            for index, begin, end in ((0, 0, 64), (2, 64, 128), (4, 128, 256)):
                result = got[index]
                assert isinstance(result, TensorScan)
                assert result.sha256 == hashlib.sha256(data[begin:end]).hexdigest()


def test_progress_adds_up_in_the_callers_thread() -> None:
    content, jobs, blobs = many_tensors(96, seed=3)
    caller = threading.get_ident()
    seen: list[int] = []

    def progress(nbytes: int) -> None:
        assert threading.get_ident() == caller
        seen.append(nbytes)

    with file_with(content) as fd:
        for workers in (1, 2):
            seen.clear()
            scan_all(with_fd(jobs, fd), workers=workers, chunk_size=96, progress=progress)
            assert sum(seen) == sum(len(b) for b in blobs)
            assert max(seen) <= 96


def test_an_error_in_the_caller_stops_the_workers() -> None:
    data = bytes(24 * 4096)
    with file_with(data) as fd:
        jobs = [ScanJob(fd, 0, len(data), "F32") for _ in range(6)]
        calls = 0

        def progress(nbytes: int) -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            scan_all(jobs, workers=3, chunk_size=24, progress=progress)
        deadline = time.monotonic() + 10
        while any(t.name.startswith("nanrunbook-scan") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "scan workers still running"
            time.sleep(0.01)


def test_memory_is_one_chunk_per_worker() -> None:
    # Buffers are sized by the chunk, never by the tensor.
    sizes: list[int] = []

    def scan(fd: int, offset: int, length: int, dtype: str, **kwargs: Any) -> TensorScan:
        sizes.append(len(kwargs["buffer"]))
        return scan_range(fd, offset, length, dtype, **kwargs)

    data = bytes(4096)
    with file_with(data) as fd:
        scan_all([ScanJob(fd, 0, 4096, "F32")] * 4, workers=2, chunk_size=240, scan=scan)
        scan_all([ScanJob(fd, 0, 8, "F32")] * 2, workers=2, scan=scan)
    assert set(sizes) == {240, 8}


# --------------------------------------------------------------------------- bundles


def findings_and_violations(
    bundle: Path, workers: int
) -> tuple[tuple[StageFinding, ...], list[Violation]]:
    tree = load_manifest_bytes((bundle / "manifest.json").read_bytes())
    manifest, violations = parse_manifest(tree, Caps())
    assert manifest is not None, violations
    return verify_bundle(bundle, manifest, workers=workers)


def fixture_names() -> list[str]:
    names = []
    for path in sorted(FIXTURES.iterdir()):
        manifest = path / "manifest.json"
        if not manifest.is_file():
            continue
        try:
            tree = load_manifest_bytes(manifest.read_bytes())
        except Exception:
            continue
        if parse_manifest(tree, Caps())[0] is not None:
            names.append(path.name)
    return names


@pytest.mark.parametrize("name", fixture_names())
def test_every_fixture_same_with_four_workers(name: str) -> None:
    bundle = FIXTURES / name
    assert findings_and_violations(bundle, 4) == findings_and_violations(bundle, 1)


def big_writer(tmp_path: Path) -> Path:
    """Many tensors in two files' worth of stages, NaN on the default chunk boundary."""
    rng = np.random.default_rng(11)
    writer = BundleWriter(
        run_id="run-par",
        step=5,
        incident_owner="ml-oncall",
        binding=binding(),
        last_known_good={"checkpoint_id": "ckpt-9", "step": 4, "verified_together": RECOVERY},
    )
    per_chunk = CHUNK_SIZE // 2
    grad = rng.standard_normal(per_chunk + 100).astype(ml_dtypes.bfloat16)
    grad[per_chunk - 1] = np.nan
    stages: dict[str, list[tuple[str, Any, str]]] = {
        "input": [("x", rng.standard_normal((64, 8)).astype("<f4"), "x")],
        "forward": [
            (f"act/{i}", rng.standard_normal(37 * i + 1).astype("<f2"), "act") for i in range(20)
        ],
        "loss": [("loss", np.float32(2.5), "loss")],
        "backward": [
            ("grad/big", grad, "grad"),
            *((f"grad/{i}", rng.standard_normal(50 * i).astype("<f4"), "grad") for i in range(12)),
            ("grad/empty", RawTensor("F32", (0,), b""), "grad"),
        ],
        "optimizer": [
            ("opt/big", rng.standard_normal(per_chunk // 2 + 7).astype("<f4"), "opt"),
            *((f"opt/{i}", rng.standard_normal(10 + i).astype("<f8"), "opt") for i in range(8)),
        ],
    }
    for stage, tensors in stages.items():
        writer.observe(stage, tensors, owner=OWNER, probe_source="test")
    return writer.write(tmp_path / "big")


def test_many_tensor_bundle_same_with_any_workers(tmp_path: Path) -> None:
    bundle = big_writer(tmp_path)
    one = findings_and_violations(bundle, 1)
    assert one[1] == []
    backward = one[0][3]
    assert backward.counts is not None and backward.counts.nan == 1
    for workers in (2, 5):
        assert findings_and_violations(bundle, workers) == one


def test_digest_mismatches_reported_in_manifest_order(tmp_path: Path) -> None:
    bundle = big_writer(tmp_path)
    manifest = load(bundle)
    for stage in manifest["stages"]:
        for entry in stage["tensors"][::3]:
            entry["sha256"] = "0" * 64
    save(bundle, manifest)
    one = findings_and_violations(bundle, 1)
    codes = {v.code for v in one[1]}
    assert codes == {"DIGEST_MISMATCH"}
    assert len(one[1]) == sum(len(s["tensors"][::3]) for s in manifest["stages"])
    for workers in (2, 4):
        assert findings_and_violations(bundle, workers) == one


def test_short_read_in_one_file_same_as_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nanrunbook.tensors.verify as bundle_module

    bundle = copy_fixture(tmp_path)
    manifest = load(bundle)
    # Move the backward stage's tensors to a second file, and break one digest in each.
    header, data = read_tensor_file(bundle)
    moved = {e["name"] for e in manifest["stages"][3]["tensors"]}
    keep = {k: v for k, v in header.items() if k not in moved}
    other = {k: v for k, v in header.items() if k in moved}

    def pack(part: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        out, blob = {}, b""
        for name, item in sorted(part.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = item["data_offsets"]
            out[name] = {**item, "data_offsets": [len(blob), len(blob) + end - begin]}
            blob += data[begin:end]
        return out, blob

    write_tensor_file(bundle, *pack(keep))
    write_tensor_file(bundle, *pack(other), name="grads.safetensors")
    for entry in manifest["stages"][3]["tensors"]:
        entry["file"] = "grads.safetensors"
    manifest["stages"][0]["tensors"][0]["sha256"] = "1" * 64
    manifest["stages"][3]["tensors"][0]["sha256"] = "2" * 64
    save(bundle, manifest)

    second_tensor = pack(other)[0][manifest["stages"][3]["tensors"][1]["name"]]
    raw = (bundle / "grads.safetensors").read_bytes()
    grads_begin = 8 + struct.unpack("<Q", raw[:8])[0] + second_tensor["data_offsets"][0]
    real = bundle_module.scan_range

    def shrinking(fd: int, offset: int, length: int, dtype: str, **kwargs: Any) -> TensorScan:
        if offset == grads_begin and os.fstat(fd).st_size == len(raw):
            raise ShortRead(offset, length, 0)
        return real(fd, offset, length, dtype, **kwargs)

    monkeypatch.setattr(bundle_module, "scan_range", shrinking)
    one = findings_and_violations(bundle, 1)
    assert [(v.code, v.where) for v in one[1]] == [
        ("DIGEST_MISMATCH", "$.stages[0].tensors[0].sha256"),
        ("FILE_CHANGED", "grads.safetensors"),
    ]
    assert one[0][3].tensors[0].counts is not None  # read before the short read
    assert one[0][3].tensors[1].counts is None
    for workers in (2, 3):
        assert findings_and_violations(bundle, workers) == one


def test_read_errors_handled_as_one_thread_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nanrunbook.tensors.verify as bundle_module

    bundle = big_writer(tmp_path)
    error: Exception = OSError(5, "Input/output error")

    def failing(fd: int, offset: int, length: int, dtype: str, **kwargs: Any) -> TensorScan:
        if length == (CHUNK_SIZE // 4 + 7) * 4:  # opt/big
            raise error
        return scan_range(fd, offset, length, dtype, **kwargs)

    monkeypatch.setattr(bundle_module, "scan_range", failing)

    def outcome(workers: int) -> Any:
        try:
            return findings_and_violations(bundle, workers)
        except Exception as raised:
            return raised

    one = outcome(1)
    assert outcome(3) == one
    error = RuntimeError("a defect")  # not an I/O error: raised, whatever the workers
    for workers in (1, 3):
        with pytest.raises(RuntimeError, match="a defect"):
            findings_and_violations(bundle, workers)


# --------------------------------------------------------------------------- the CLI


def sparse_bundle(tmp_path: Path, tensors: int, each: int) -> Path:
    """The continue fixture plus ``tensors`` all-zero F32 tensors of ``each`` bytes,
    in a sparse file: gigabytes to read that take no disk space."""
    bundle = copy_fixture(tmp_path)
    header: dict[str, Any] = {}
    for i in range(tensors):
        header[f"zeros/{i}"] = {
            "dtype": "F32",
            "shape": [each // 4],
            "data_offsets": [i * each, (i + 1) * each],
        }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(bundle / "zeros.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.truncate(8 + len(text) + tensors * each)
    digest = hashlib.sha256()
    block = bytes(1 << 20)
    for _ in range(each >> 20):
        digest.update(block)
    manifest = load(bundle)
    stage = manifest["stages"][4]
    for i in range(tensors):
        stage["tensors"].append(
            {
                "name": f"zeros/{i}",
                "file": "zeros.safetensors",
                "dtype": "F32",
                "shape": [each // 4],
                "sha256": digest.hexdigest(),
                "probe": "zeros",
            }
        )
    stage["counts"]["elements"] += tensors * each // 4
    stage["counts"]["finite"] += tensors * each // 4
    save(bundle, manifest)
    return bundle


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "nanrunbook", *args]


def bytes_read(pid: int) -> int:
    with open(f"/proc/{pid}/io") as stats:
        for line in stats:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/PID/io")
def test_ctrl_c_stops_a_big_check_cleanly(tmp_path: Path) -> None:
    bundle = sparse_bundle(tmp_path, tensors=8, each=256 << 20)  # 2 GiB to read
    process = subprocess.Popen(
        cli("check", "--format", "kv", str(bundle)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # A shell may start background jobs with SIGINT ignored: give it back.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    while bytes_read(process.pid) < (64 << 20):  # well into the tensor data
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130, (out, err)
    assert err == b"nanrunbook: interrupted\n"
    assert out == b""


def run_on_terminal(args: list[str]) -> tuple[int, bytes, bytes]:
    """Run with stderr on a pseudo-terminal; return (exit, stdout, terminal output)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    assert process.stdout is not None
    terminal = b""
    out = b""
    streams = {leader: "tty", process.stdout.fileno(): "out"}
    while streams:
        ready, _, _ = select.select(list(streams), [], [], 60)
        assert ready, "timed out"
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the terminal is gone
                chunk = b""
            if not chunk:
                del streams[fd]
            elif streams[fd] == "tty":
                terminal += chunk
            else:
                out += chunk
    os.close(leader)
    return process.wait(timeout=60), out, terminal


def test_progress_bar_on_a_terminal_in_text_format_only(tmp_path: Path) -> None:
    bundle = sparse_bundle(tmp_path, tensors=8, each=256 << 20)
    started = time.monotonic()
    code, out, terminal = run_on_terminal(cli("check", str(bundle)))
    took = time.monotonic() - started
    assert code == 0
    # The bar appears once reading has taken 0.3 s: 2 GiB does on a few cores.
    if b"reading tensors" not in terminal and took < 1.0:
        pytest.skip(f"this machine read 2 GiB too fast ({took:.2f} s) to show the bar")
    assert b"reading tensors" in terminal
    assert b"reading tensors" not in out and b"\x1b[" not in out
    assert out.startswith(b"nanrunbook check: CONTINUE")
    code, out, terminal = run_on_terminal(cli("check", "--format", "kv", str(bundle)))
    assert code == 0
    assert terminal == b""
    assert b"decision=CONTINUE_BOUNDED_DIAGNOSTICS" in out


def test_progress_sink_only_for_text_at_a_terminal() -> None:
    from nanrunbook.output.progress import ByteProgress, check_progress

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            with check_progress(True, tty) as progress:
                assert isinstance(progress, ByteProgress)
            with check_progress(False, tty) as progress:  # json, kv
                assert progress is None
        with tempfile.TemporaryFile("w") as plain, check_progress(True, plain) as progress:
            assert progress is None  # not a terminal
    finally:
        os.close(leader)
        os.close(follower)


def test_progress_sink_shows_after_its_delay_and_erases() -> None:
    from nanrunbook.output.progress import ByteProgress

    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            quick = ByteProgress(tty, delay=3600)
            quick.start(100)
            quick(50)
            assert not quick.shown
            slow = ByteProgress(tty, delay=0)
            slow.start(100)
            slow(50)
            assert slow.shown
            slow(50)
            slow.close()
            assert not slow.shown
        screen = b""
        while select.select([leader], [], [], 0.5)[0]:
            screen += os.read(leader, 65536)
        assert b"reading tensors" in screen
    finally:
        os.close(leader)
        os.close(follower)


def test_no_progress_bar_for_a_quick_check() -> None:
    code, _, terminal = run_on_terminal(cli("check", str(FIXTURES / "continue-all-finite")))
    assert code == 0
    assert terminal == b""


def test_default_workers_follow_the_cores_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanrunbook.tensors import scan as scan_module

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    assert scan_module.default_workers() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert scan_module.default_workers() == scan_module.MAX_WORKERS
