"""Bounded passes over tensor bytes: SHA-256 and exact counts together, on every core.

:func:`scan_range` reads one tensor's byte range with ``os.preadv``
(``os.pread`` where it is missing) into one reused buffer, chunk by chunk, and
feeds each chunk to its SHA-256 and to its exact :class:`~.counting.Counter`:
never mapped, never loaded whole, so memory stays bounded by the buffer however
large the tensor (spec section 1). The kernel is told the range is read
sequentially (``POSIX_FADV_SEQUENTIAL``), so it reads ahead.

:func:`scan_all` runs many tensors on a pool of threads, one per usable core,
each with its own preallocated buffer. ``os.preadv``, ``hashlib`` (on buffers
over 2 KiB) and numpy's reductions release the GIL, so the threads hash and
count on all cores at once. Tensors are handed out longest first, so the
biggest ones do not start last and leave the other cores idle at the end; the
results come back in the order of the jobs, whatever order they finish in. One
tensor is one SHA-256 stream: it is never split across threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Any, Literal, Protocol

from nanrunbook.dtypes import WHOLE_ELEMENTS_BYTES
from nanrunbook.records import Extremes, frozen_records
from nanrunbook.tensors.counting import BATCHABLE, Counter, Tally, segment_columns

__all__ = [
    "CHUNK_SIZE",
    "MAX_WORKERS",
    "ScanFunction",
    "ScanJob",
    "ShortRead",
    "TensorScan",
    "default_workers",
    "fill_view",
    "scan_all",
    "scan_range",
]

# 2 MiB rounded down to whole elements of every dtype, so no element straddles two
# chunks. Measured by bench/bench_scan.py: chunks that stay in a core's L2 cache
# between the read, the count and the hash beat larger ones; much smaller ones pay
# per-call costs.
CHUNK_SIZE = 2 * 1024 * 1024 // WHOLE_ELEMENTS_BYTES * WHOLE_ELEMENTS_BYTES


@dataclass(frozen=True, slots=True)
class TensorScan:
    """One tensor's bytes as read: their digest, exact counts and finite extremes."""

    sha256: str  # lowercase hex of the exact bytes
    tally: Tally
    extremes: Extremes | None = None  # of a floating tensor's finite values


class ShortRead(Exception):
    """The file ended before ``offset + length`` (it is shorter, or shrank while read)."""

    def __init__(self, offset: int, length: int, got: int) -> None:
        self.offset = offset
        self.length = length
        self.got = got
        super().__init__(f"file ended after {got} of {length} bytes from offset {offset}")


def _read_into(fd: int, view: memoryview, position: int) -> int:
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], position)
    data = os.pread(fd, len(view), position)
    view[: len(data)] = data
    return len(data)


def _advise_sequential(fd: int, offset: int, length: int) -> None:
    if length and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # a hint only: some file systems refuse it
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)


def scan_range(
    fd: int,
    offset: int,
    length: int,
    dtype: str,
    *,
    buffer: bytearray | None = None,
    on_chunk: Callable[[int], None] | None = None,
    spare: bytearray | None = None,
) -> TensorScan:
    """Hash and count the bytes ``[offset, offset + length)`` of the open file ``fd``.

    ``buffer``, when given, is reused for the reads; its size rounded down to the
    dtype's alignment is the chunk size. ``spare``, a second buffer of the same
    size, lets a helper thread read and count the next chunk while this thread
    hashes the current one (used when a core would otherwise sit idle; the range
    must span more than one chunk). ``on_chunk``, when given, is called in this
    thread with each chunk's byte count once it is hashed and counted; an
    exception it raises stops the scan. Raises :class:`ShortRead` when the file
    ends early, ``ValueError`` for a negative range, a length that is not whole
    elements or a buffer smaller than one element group, and lets ``OSError``
    from the reads through.
    """
    if offset < 0 or length < 0:
        raise ValueError(f"invalid byte range offset={offset} length={length}")
    counter = Counter(dtype)
    align = counter.align
    if length % align:
        raise ValueError(f"{dtype} range of {length} bytes is not whole elements")
    if buffer is None:
        buffer = bytearray(min(CHUNK_SIZE, length))
        chunk = len(buffer)
    else:
        chunk = len(buffer) - len(buffer) % align
        if chunk == 0 and length:
            raise ValueError(f"buffer of {len(buffer)} bytes is smaller than one {dtype} unit")
    _advise_sequential(fd, offset, length)
    digest = hashlib.sha256()
    if spare is not None and len(spare) >= chunk and length > chunk:
        _overlapped(fd, offset, length, chunk, (buffer, spare), digest, counter, on_chunk)
        return _scanned(digest, counter)
    done = 0
    view = memoryview(buffer)
    try:
        while done < length:
            want = min(chunk, length - done)
            filled = fill_view(fd, view[:want], offset + done)
            if filled < want:
                raise ShortRead(offset, length, done + filled)
            piece = view[:want]
            digest.update(piece)
            counter.feed(piece)
            done += want
            if on_chunk is not None:
                on_chunk(want)
    finally:
        view.release()
    return _scanned(digest, counter)


def _scanned(digest: Any, counter: Counter) -> TensorScan:
    return TensorScan(digest.hexdigest(), counter.result(), counter.extremes())


def fill_view(fd: int, view: memoryview, position: int) -> int:
    """Fill ``view`` from ``position``; fewer bytes only at the end of the file.

    A read may return less than asked; only 0 is the end of the file.
    """
    filled = 0
    while filled < len(view):
        got = _read_into(fd, view[filled:], position + filled)
        if got == 0:
            break
        filled += got
    return filled


def _overlapped(
    fd: int,
    offset: int,
    length: int,
    chunk: int,
    buffers: tuple[bytearray, bytearray],
    digest: Any,
    counter: Counter,
    on_chunk: Callable[[int], None] | None,
) -> None:
    """Double buffering: a helper reads and counts chunk k+1 while this thread hashes chunk k."""
    free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    ready: queue.SimpleQueue[tuple[memoryview, int] | BaseException] = queue.SimpleQueue()
    for buffer in buffers:
        free.put(memoryview(buffer))

    def produce() -> None:
        done = 0
        try:
            while done < length:
                view = free.get()
                if view is None:  # the hashing side stopped
                    return
                want = min(chunk, length - done)
                filled = fill_view(fd, view[:want], offset + done)
                if filled < want:
                    raise ShortRead(offset, length, done + filled)
                counter.feed(view[:want])
                ready.put((view, want))
                done += want
        except BaseException as error:  # handed to the hashing side, raised there
            ready.put(error)

    helper = threading.Thread(target=produce, name="nanrunbook-read", daemon=True)
    helper.start()
    try:
        done = 0
        while done < length:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            view, want = item
            digest.update(view[:want])
            free.put(view)
            done += want
            if on_chunk is not None:
                on_chunk(want)
    finally:
        free.put(None)
        helper.join()


class ScanFunction(Protocol):
    """The signature of :func:`scan_range`, as :func:`scan_all` calls it."""

    def __call__(
        self,
        fd: int,
        offset: int,
        length: int,
        dtype: str,
        *,
        buffer: bytearray | None = ...,
        on_chunk: Callable[[int], None] | None = ...,
        spare: bytearray | None = ...,
    ) -> TensorScan: ...


@dataclass(frozen=True, slots=True)
class ScanJob:
    """One tensor to scan: a byte range of an open file, and its dtype."""

    fd: int
    offset: int
    length: int
    dtype: str


# Past a few cores the memory bus, not SHA-256, limits the scan; the cap keeps the
# buffers (up to three chunks per worker) small on a large machine too.
MAX_WORKERS = 16


def default_workers() -> int:
    """The cores this process may run on (its CPU affinity), 1 to MAX_WORKERS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


Overlap = Literal["tail", "never", "always"]


class _Cancelled(Exception):
    """Raised inside a worker's scan when the caller stopped waiting (Ctrl-C)."""


_WAIT_SECONDS = 0.25  # the longest the caller's thread blocks without checking signals


def scan_all(
    jobs: Sequence[ScanJob],
    *,
    workers: int | None = None,
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[int], None] | None = None,
    scan: ScanFunction = scan_range,
    overlap: Overlap = "tail",
) -> list[TensorScan | Exception]:
    """Scan every job, ``workers`` threads at a time (default: :func:`default_workers`).

    Returns one result per job, in the order of ``jobs``: its :class:`TensorScan`,
    or the exception its scan raised (:class:`ShortRead`, ``OSError``...); one
    job's failure does not stop the others. ``progress`` is called in the
    caller's thread with byte counts as chunks are done, adding up to the total
    length.

    Jobs go to the workers longest first. Once no job is left to start, a core
    would go idle while the last tensors are hashed, so those run overlapped: a
    helper thread reads and counts the next chunk while the worker hashes (with
    ``overlap="tail"``, the default; ``"never"`` and ``"always"`` exist to
    measure the alternatives; ``workers=1`` never overlaps). With the default
    ``scan``, tensors of at most :data:`BATCH_TENSOR_BYTES` go in batches of
    neighbours instead, one read each (:func:`_scan_batch`); a bundle of nothing
    but tiny tensors is then scanned on one thread unless ``workers`` is given.

    Memory: each worker owns one buffer of ``chunk_size`` bytes (less when every
    job is shorter), a second one while it overlaps, and per tensor one scratch
    chunk for chunks that hold non-finite elements (plus, while such a chunk is
    counted, a copy of its finite values), or for a batch its own buffer of at
    most :data:`BATCH_SPAN_BYTES` and its counting's scratch: bounded by the
    workers and the chunk size, whatever the size of the tensors.

    An exception in the caller's thread while it waits (``KeyboardInterrupt``
    from Ctrl-C, or one raised by ``progress``) stops the workers at their next
    chunk, waits briefly for them to let go of the files, and is raised again.
    The workers are daemon threads: they never keep the process alive.
    """
    # Small tensors go in batches, unless a caller supplied its own scan function.
    units = (
        _units(jobs, chunk_size) if scan is scan_range else [_Unit((k,)) for k in range(len(jobs))]
    )
    longest = max((jobs[unit.members[0]].length for unit in units if not unit.batch), default=0)
    cores = workers if workers is not None else default_workers()
    if workers is None and _python_bound(jobs, units):
        cores = 1
    plan = _Plan(max(1, min(chunk_size, longest)), cores, overlap, scan)
    if min(cores, len(units)) <= 1:
        return _scan_in_turn(jobs, units, _Scanner(plan, jobs), progress)
    return _Pool(jobs, units, plan, progress).run(min(cores, len(units)))


# Below this many bytes per tensor on average, batches of tiny tensors spend their
# time in Python (a digest and a few records each), under the GIL: a second thread
# only contends for it (measured: a 20,480-tensor bundle of 64-byte tensors checks
# faster on one thread than on two).
_TINY_AVERAGE_BYTES = 4096


def _python_bound(jobs: Sequence[ScanJob], units: Sequence[_Unit]) -> bool:
    """Whether every unit is a batch of tensors too small for threads to pay."""
    if not units or not all(unit.batch for unit in units):
        return False
    return sum(job.length for job in jobs) < _TINY_AVERAGE_BYTES * len(jobs)


# A tensor up to this size is read and counted with its neighbours in one batch
# (see _scan_batch); bigger ones are each a stream of chunks of their own.
BATCH_TENSOR_BYTES = 64 * 1024
# Bytes between two small tensors that a batch reads past rather than split.
_BATCH_GAP_BYTES = 64 * 1024
# The most bytes one batch spans: its counting keeps a few 8-byte integers per
# value for a moment (up to some 50 MiB for 1-byte values at 2 MiB), so batches
# stay well below a chunk; a quarter MiB still holds 4,096 tensors of 64 bytes.
BATCH_SPAN_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class _Unit:
    """What one worker takes at a time: one job, or a batch of small ones of one
    file, read together: the byte range ``[offset, end)`` covers every member."""

    members: tuple[int, ...]  # indices into the jobs
    batch: bool = False
    offset: int = 0
    end: int = 0


def _units(jobs: Sequence[ScanJob], chunk_size: int) -> list[_Unit]:
    """Every job as a unit of its own, except small ones of a :data:`BATCHABLE`
    dtype, batched by file in byte order while a batch spans at most
    :data:`BATCH_SPAN_BYTES` (and ``chunk_size``) bytes."""
    limit = min(BATCH_TENSOR_BYTES, chunk_size)
    span = min(BATCH_SPAN_BYTES, chunk_size)
    units: list[_Unit] = []
    small: dict[int, list[int]] = {}
    for index, job in enumerate(jobs):
        if 0 < job.length <= limit and job.dtype in BATCHABLE:
            small.setdefault(job.fd, []).append(index)
        else:
            units.append(_Unit((index,)))
    offsets = [job.offset for job in jobs]
    for members in small.values():
        members.sort(key=offsets.__getitem__)
        first = 0
        start = end = offsets[members[0]]
        for position, index in enumerate(members):
            offset = offsets[index]
            stop = offset + jobs[index].length
            if offset - end > _BATCH_GAP_BYTES or stop - start > span:
                units.append(_Unit(tuple(members[first:position]), True, start, end))
                first = position
                start = end = offset
            end = max(end, stop)
        units.append(_Unit(tuple(members[first:]), True, start, end))
    return units


def _scan_batch(jobs: Sequence[ScanJob], unit: _Unit) -> list[TensorScan | Exception]:
    """Read a batch's byte range once; hash each member; count its members of one
    dtype together (:func:`~.counting.segment_columns`). A read that fails or ends
    early sends every member to :func:`scan_range`, so each gets its own error."""
    members = list(map(jobs.__getitem__, unit.members))
    view = memoryview(bytearray(unit.end - unit.offset))
    try:
        filled = fill_view(members[0].fd, view, unit.offset)
    except OSError:
        filled = -1
    if filled < len(view):
        return [_one_scan(job) for job in members]
    base = unit.offset
    pieces = [view[job.offset - base : job.offset - base + job.length] for job in members]
    lengths = [job.length for job in members]
    digests = [hashlib.sha256(piece).hexdigest() for piece in pieces]
    dtypes = [job.dtype for job in members]
    if len(set(dtypes)) == 1:  # the usual batch: one count over every member
        tallies, extremes = segment_columns(dtypes[0], b"".join(pieces), lengths)
        scanned: list[TensorScan | Exception] = frozen_records(
            TensorScan, digests, tallies, extremes
        )
        return scanned
    by_dtype: dict[str, list[int]] = {}
    for position, dtype in enumerate(dtypes):
        by_dtype.setdefault(dtype, []).append(position)
    results: list[TensorScan | Exception] = [None] * len(members)  # type: ignore[list-item]
    for dtype, positions in by_dtype.items():
        mine = [pieces[p] for p in positions]
        tallies, extremes = segment_columns(dtype, b"".join(mine), [lengths[p] for p in positions])
        scans = frozen_records(TensorScan, [digests[p] for p in positions], tallies, extremes)
        for position, scan in zip(positions, scans, strict=True):
            results[position] = scan
    return results


def _one_scan(job: ScanJob) -> TensorScan | Exception:
    try:
        return scan_range(job.fd, job.offset, job.length, job.dtype)
    except Exception as error:
        return error


@dataclass(frozen=True, slots=True)
class _Plan:
    """What every worker of one :func:`scan_all` shares."""

    size: int  # bytes of a read buffer
    cores: int
    overlap: Overlap
    scan: ScanFunction

    def overlapped(self, job: ScanJob, tail: bool) -> bool:
        """Whether a helper thread should read ahead for ``job`` (``tail``: nothing
        is left to start, so a core would otherwise idle)."""
        if self.cores < 2 or job.length <= self.size or self.overlap == "never":
            return False
        return self.overlap == "always" or tail


class _Scanner:
    """One worker's scan: its read buffer, and an overlap buffer once needed."""

    def __init__(self, plan: _Plan, jobs: Sequence[ScanJob]) -> None:
        self.plan = plan
        self.jobs = jobs
        self.buffer = bytearray(plan.size)
        self.spare: bytearray | None = None

    def run(
        self, unit: _Unit, tail: bool, on_chunk: Callable[[int], None] | None
    ) -> list[TensorScan | Exception]:
        """The unit's results, one per member; a single job's error is raised."""
        if unit.batch:
            results = _scan_batch(self.jobs, unit)
            if on_chunk is not None:
                on_chunk(sum(self.jobs[k].length for k in unit.members))
            return results
        job = self.jobs[unit.members[0]]
        use = self.plan.overlapped(job, tail)
        if use and self.spare is None:
            self.spare = bytearray(self.plan.size)
        scanned = self.plan.scan(
            job.fd,
            job.offset,
            job.length,
            job.dtype,
            buffer=self.buffer,
            on_chunk=on_chunk,
            spare=self.spare if use else None,
        )
        return [scanned]


def _scan_in_turn(
    jobs: Sequence[ScanJob],
    units: Sequence[_Unit],
    scanner: _Scanner,
    progress: Callable[[int], None] | None,
) -> list[TensorScan | Exception]:
    """Every unit on this thread, in order (the last one overlapped when allowed)."""
    results: list[TensorScan | Exception | None] = [None] * len(jobs)
    for number, unit in enumerate(units):
        try:
            done = scanner.run(unit, number == len(units) - 1, progress)
        except Exception as error:
            done = [error]
        _place(results, unit, done)
    return _finished(results)


class _Pool:
    """Worker threads taking units longest first; the caller's thread relays progress."""

    def __init__(
        self,
        jobs: Sequence[ScanJob],
        units: Sequence[_Unit],
        plan: _Plan,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.jobs = jobs
        self.plan = plan
        self.progress = progress
        self.results: list[TensorScan | Exception | None] = [None] * len(jobs)
        self.pending: queue.SimpleQueue[_Unit] = queue.SimpleQueue()
        for unit in sorted(units, key=self._length, reverse=True):
            self.pending.put(unit)
        # Bytes done, from the workers to the caller's thread; None: a worker ended.
        self.events: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.cancel = threading.Event()
        self.crashed: list[BaseException] = []  # a worker's error outside any scan

    def _length(self, unit: _Unit) -> int:
        return unit.end - unit.offset if unit.batch else self.jobs[unit.members[0]].length

    def run(self, count: int) -> list[TensorScan | Exception]:
        threads = [
            threading.Thread(target=self._work, name=f"nanrunbook-scan-{k}", daemon=True)
            for k in range(count)
        ]
        try:
            for thread in threads:
                thread.start()
            self._relay(count)
        except BaseException:
            self.cancel.set()
            for thread in threads:
                if thread.is_alive():
                    thread.join(timeout=1.0)
            raise
        for thread in threads:
            thread.join()
        if self.crashed:
            raise self.crashed[0]
        return _finished(self.results)

    def _relay(self, running: int) -> None:
        """Pass progress on until every worker has ended, checking for signals often."""
        while running:
            try:
                event = self.events.get(timeout=_WAIT_SECONDS)
            except queue.Empty:
                continue
            if event is None:
                running -= 1
            elif self.progress is not None:
                self.progress(event)

    def _on_chunk(self, nbytes: int) -> None:
        if self.cancel.is_set():
            raise _Cancelled
        if self.progress is not None:
            self.events.put(nbytes)

    def _work(self) -> None:
        try:
            scanner = _Scanner(self.plan, self.jobs)
            while not self.cancel.is_set():
                try:
                    unit = self.pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    # tail: nothing is left to start, so overlap this one.
                    tail = self.pending.empty()
                    done = scanner.run(unit, tail, self._on_chunk)
                except _Cancelled:
                    return
                except Exception as error:
                    done = [error]
                _place(self.results, unit, done)
        except BaseException as error:  # MemoryError allocating the buffer, say
            self.crashed.append(error)
        finally:
            self.events.put(None)


def _place(
    results: list[TensorScan | Exception | None],
    unit: _Unit,
    done: Sequence[TensorScan | Exception],
) -> None:
    """Put a unit's results at its members' places (a batch holds thousands)."""
    if len(done) != len(unit.members):
        raise ValueError(f"{len(done)} results for a unit of {len(unit.members)} jobs")
    deque(map(results.__setitem__, unit.members, done), maxlen=0)


def _finished(results: list[TensorScan | Exception | None]) -> list[TensorScan | Exception]:
    # "None in results" would call each scan's __eq__: identity is tested in C.
    if any(map(is_, results, repeat(None))):
        raise RuntimeError("a scan job was left without a result")
    return results  # type: ignore[return-value]
