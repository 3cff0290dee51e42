"""Element-level comparison of two stored tensors, read in bounded chunks from both files.

Exact by bit pattern: an element differs when its stored bits differ, so ``+0``
and ``-0`` differ, and so do two NaNs with different payloads; a tensor differs
exactly when its digest does. Only differing elements are decoded to values:

* ``max_abs_diff``, the largest ``|a - b|`` among differing elements finite on
  both sides, in float64 (for C64 the modulus of the complex difference; for
  integer and BOOL dtypes an exact integer). Only F64 can overflow it: then it
  is ``inf``.
* ``max_rel_diff``, the largest ``|a - b| / max(|a|, |b|)`` among the same
  elements, computed as ``|a/m - b/m|`` so it never overflows; it lies in
  [0, 2] (0 for ``+0`` against ``-0``).
* NaN and infinity that appear (non-finite in ``other`` only) or disappear
  (in ``base`` only), by the classes of spec section 6 (for C64 an element is
  NaN when a part is NaN, infinite when a part is infinite and none is NaN).

Both ranges are hashed as they are read: the digests are checked against the
manifest's, so the figures are about the bytes the check accepted, not bytes a
writer changed since. Memory per worker: two read buffers of at most 2 MiB and
float64 temporaries of at most ``CHUNK_ELEMENTS`` elements, whatever the size
of the tensors.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from nanrunbook.access import file_where, open_in_bundle
from nanrunbook.dtypes import DTYPES
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.records import element_count
from nanrunbook.tensors.counting import code_values
from nanrunbook.tensors.safetensors import U64_MAX, TensorFileHeader, read_header
from nanrunbook.tensors.scan import ShortRead, default_workers, fill_view
from nanrunbook.tensors.verify import header_limit

__all__ = [
    "CHUNK_ELEMENTS",
    "ElementDelta",
    "StoredTensor",
    "TensorPair",
    "compare_ranges",
    "compare_tensors",
]

_Array = npt.NDArray[Any]

# Elements per chunk: a multiple of 8, so F4 (two per byte) and F6 (four per
# three bytes) chunks are whole bytes; float64 temporaries stay at 2 MiB.
CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True, slots=True)
class ElementDelta:
    """How two tensors of one dtype and shape differ, element by element."""

    elements: int
    differing: int  # elements whose bits differ
    max_abs_diff: float | int | None  # None when no differing element is finite on both sides
    max_rel_diff: float | None
    nan_appeared: int  # NaN in other, not in base
    nan_disappeared: int
    inf_appeared: int  # +-inf in other, not in base
    inf_disappeared: int


# ------------------------------------------------------------------ decoding


@dataclass(frozen=True, slots=True)
class _Layout:
    """How one dtype's bytes become element codes, and codes become values."""

    bits_dtype: str  # numpy dtype of one element's code ("u1" for packed formats)
    unit_bytes: int  # bytes of the smallest whole group of elements
    unit_elements: int
    decode: Callable[[_Array], _Array] | None  # codes -> float64/complex128; None: integers
    signed: bool = False  # integers: two's complement


def _table(dtype: str) -> Callable[[_Array], _Array]:
    values = np.array(code_values(dtype), dtype=np.float64)

    def decode(codes: _Array) -> _Array:
        return values[codes]

    return decode


def _bf16(codes: _Array) -> _Array:
    return (codes.astype("<u4") << 16).view("<f4").astype(np.float64)


def _native(numpy_name: str, complex_values: bool) -> Callable[[_Array], _Array]:
    as_type = np.dtype(numpy_name).newbyteorder("<")
    target = np.complex128 if complex_values else np.float64

    def decode(codes: _Array) -> _Array:
        return codes.view(as_type).astype(target)

    return decode


def _layout(dtype: str) -> _Layout:
    """Read from the dtype table: widths, whole-element groups, and how to decode."""
    info = DTYPES[dtype]
    fmt = info.format
    width = max(1, info.bits // 8)
    if fmt is None:  # integers and BOOL
        assert info.numpy is not None
        return _Layout(f"<u{width}", width, 1, None, np.dtype(info.numpy).kind == "i")
    if fmt.bits <= 8:  # F8, F6, F4: every code's value from the table
        unit = info.whole_bytes
        return _Layout("u1", unit, unit * 8 // info.bits, _table(dtype))
    if fmt.bits == 16 and fmt.exponent_bits == 8:  # BF16: the top half of an F32
        return _Layout("<u2", 2, 1, _bf16)
    assert info.numpy is not None
    return _Layout(f"<u{width}", width, 1, _native(info.numpy, info.kind == "complex"))


def _codes(layout: _Layout, chunk: memoryview) -> _Array:
    """One code per element, in element order (packed formats unpacked)."""
    data = np.frombuffer(chunk, dtype=layout.bits_dtype)
    if layout.unit_elements == 2:  # F4: element 2i in the low nibble
        return np.stack((data & 0x0F, data >> 4), axis=1).reshape(-1)
    if layout.unit_elements == 4:  # F6: little-endian bit stream, 6 bits each
        groups = data.reshape(-1, 3).astype("<u4")
        words = groups[:, 0] | (groups[:, 1] << 8) | (groups[:, 2] << 16)
        fields = [(words >> (6 * k)) & 0x3F for k in range(4)]
        return np.stack(fields, axis=1).reshape(-1).astype(np.uint8)
    return data


class _Accumulator:
    """Running figures over the differing elements of one tensor pair."""

    def __init__(self, layout: _Layout) -> None:
        self.layout = layout
        self.elements = 0
        self.differing = 0
        self.max_abs: float | int | None = None
        self.max_rel: float | None = None
        self.nan_appeared = self.nan_disappeared = 0
        self.inf_appeared = self.inf_disappeared = 0

    def feed(self, base: memoryview, other: memoryview) -> None:
        a, b = _codes(self.layout, base), _codes(self.layout, other)
        self.elements += a.size
        differ = a != b
        count = int(np.count_nonzero(differ))
        if count == 0:
            return
        self.differing += count
        if count < a.size:  # a diverged replay differs almost everywhere: no gather then
            a, b = a[differ], b[differ]
        if self.layout.decode is None:
            self._integers(a, b)
            return
        with np.errstate(invalid="ignore"):  # casting a signalling NaN warns
            self._floats(self.layout.decode(a), self.layout.decode(b))

    def _keep(self, abs_diff: float | int, rel_diff: float) -> None:
        if self.max_abs is None or abs_diff > self.max_abs:
            self.max_abs = abs_diff
        if self.max_rel is None or rel_diff > self.max_rel:
            self.max_rel = rel_diff

    def _integers(self, a: _Array, b: _Array) -> None:
        # Differences and magnitudes in the unsigned type of the same width:
        # exact (wrap-around arithmetic), even for I64 -2^63 against 2^63 - 1.
        if self.layout.signed:
            sa, sb = a.view(a.dtype.str.replace("u", "i")), b.view(b.dtype.str.replace("u", "i"))
            diff = np.where(sa >= sb, a - b, b - a)
            mag_a = np.where(sa < 0, ~a + a.dtype.type(1), a)
            mag_b = np.where(sb < 0, ~b + b.dtype.type(1), b)
        else:
            diff = np.where(a >= b, a - b, b - a)
            mag_a, mag_b = a, b
        largest = np.maximum(mag_a, mag_b)  # > 0: the two values differ
        rel = diff.astype(np.float64) / largest.astype(np.float64)
        self._keep(int(diff.max()), float(rel.max()))

    def _floats(self, va: _Array, vb: _Array) -> None:
        nan_a, nan_b = np.isnan(va), np.isnan(vb)
        inf_a, inf_b = np.isinf(va) & ~nan_a, np.isinf(vb) & ~nan_b
        self.nan_appeared += int(np.count_nonzero(nan_b & ~nan_a))
        self.nan_disappeared += int(np.count_nonzero(nan_a & ~nan_b))
        self.inf_appeared += int(np.count_nonzero(inf_b & ~inf_a))
        self.inf_disappeared += int(np.count_nonzero(inf_a & ~inf_b))
        finite = ~(nan_a | nan_b | inf_a | inf_b)
        if not finite.any():
            return
        fa, fb = va[finite], vb[finite]
        with np.errstate(over="ignore", invalid="ignore"):
            abs_diff = np.abs(fa - fb)
            largest = np.maximum(np.abs(fa), np.abs(fb))
            scale = np.where(largest > 0, largest, 1.0)
            rel = np.abs(fa / scale - fb / scale)
        self._keep(float(abs_diff.max()), float(rel.max()))

    def result(self) -> ElementDelta:
        return ElementDelta(
            elements=self.elements,
            differing=self.differing,
            max_abs_diff=self.max_abs,
            max_rel_diff=self.max_rel,
            nan_appeared=self.nan_appeared,
            nan_disappeared=self.nan_disappeared,
            inf_appeared=self.inf_appeared,
            inf_disappeared=self.inf_disappeared,
        )


# -------------------------------------------------------------- the ranges


@dataclass(frozen=True, slots=True)
class _Range:
    fd: int
    offset: int


class DigestChanged(Exception):
    """A compared range hashes to other than its manifest digest: the file changed."""

    def __init__(self, side: int, sha256: str) -> None:
        self.side = side  # 0 base, 1 other
        self.sha256 = sha256
        super().__init__(f"side {side} hashes to {sha256}")


class _Cancelled(Exception):
    pass


def compare_ranges(
    dtype: str,
    length: int,
    base: tuple[int, int],
    other: tuple[int, int],
    *,
    digests: tuple[str, str] | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    cancel: threading.Event | None = None,
) -> ElementDelta:
    """Compare ``length`` bytes of one dtype at ``base`` and ``other`` ((fd, offset) each).

    ``digests``, when given, are the SHA-256 hex digests both ranges must have;
    a range that hashes otherwise raises :class:`DigestChanged`. Raises
    :class:`~.scan.ShortRead` when a file ends early and lets ``OSError`` through.
    """
    layout = _layout(dtype)
    if chunk_elements <= 0 or chunk_elements % 8:
        raise ValueError("chunk_elements is a positive multiple of 8")
    chunk = chunk_elements // layout.unit_elements * layout.unit_bytes
    if length % layout.unit_bytes:
        raise ValueError(f"{dtype} range of {length} bytes is not whole elements")
    size = min(chunk, length)
    buffers = (memoryview(bytearray(size)), memoryview(bytearray(size)))
    hashes = (hashlib.sha256(), hashlib.sha256())
    accumulator = _Accumulator(layout)
    done = 0
    while done < length:
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        want = min(size, length - done)
        pieces = []
        for (fd, offset), buffer, digest in zip((base, other), buffers, hashes, strict=True):
            got = fill_view(fd, buffer[:want], offset + done)
            if got < want:
                raise ShortRead(offset, length, done + got)
            digest.update(buffer[:want])
            pieces.append(buffer[:want])
        accumulator.feed(pieces[0], pieces[1])
        done += want
    if digests is not None:
        for side, (digest, expected) in enumerate(zip(hashes, digests, strict=True)):
            if digest.hexdigest() != expected:
                raise DigestChanged(side, digest.hexdigest())
    return accumulator.result()


# ------------------------------------------------------------ bundle tensors


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A checked manifest entry whose bytes are in a bundle file."""

    bundle: Path
    file: str  # the manifest's relative path
    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    side: str  # "base" or "other": the prefix of every violation about it
    path: str  # the entry's JSON path in its manifest

    @property
    def where(self) -> str:
        return f"{self.side}/{self.path}"


@dataclass(frozen=True, slots=True)
class TensorPair:
    """Two stored tensors of one dtype and shape whose digests differ."""

    base: StoredTensor
    other: StoredTensor


class _Files:
    """Open tensor files and their headers, one per (bundle, file), closed together."""

    def __init__(self, bound: dict[tuple[Path, str], int]) -> None:
        self._bound = bound  # entries the manifest binds to each file: the header bound
        self._open: dict[tuple[Path, str], tuple[int, TensorFileHeader]] = {}

    def locate(self, tensor: StoredTensor) -> tuple[int, int]:
        """(fd, offset) of the tensor's bytes; EvidenceRejected when the file no
        longer holds it as the check saw it."""
        key = (tensor.bundle, tensor.file)
        if key not in self._open:
            try:
                fd = open_in_bundle(tensor.bundle, tensor.file)
            except EvidenceRejected as error:
                raise _sided(error, tensor.side) from None
            try:
                limit = header_limit(self._bound[key])  # the check's bound: the same files
                header = read_header(fd, tensor.file, max_header_len=limit)
            except EvidenceRejected as error:
                os.close(fd)
                raise _sided(error, tensor.side) from None
            except BaseException:
                os.close(fd)
                raise
            self._open[key] = (fd, header)
        fd, header = self._open[key]
        entry = header.entries.get(tensor.name)
        if entry is None or (entry.dtype, entry.shape) != (tensor.dtype, tensor.shape):
            raise EvidenceRejected([_changed(tensor, "no longer holds the tensor the check read")])
        return fd, entry.begin

    def close(self) -> None:
        for fd, _ in self._open.values():
            os.close(fd)
        self._open.clear()


def _sided(error: EvidenceRejected, side: str) -> EvidenceRejected:
    return EvidenceRejected(
        Violation(v.code, f"{side}/{v.where}", v.message) for v in error.violations
    )


def _changed(tensor: StoredTensor, what: str) -> Violation:
    return Violation(
        "FILE_CHANGED",
        tensor.where,
        f"{quote(tensor.file)} {what} ({quote(tensor.name)}): it changed after the check",
    )


def compare_tensors(
    pairs: Sequence[TensorPair],
    *,
    workers: int | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> list[ElementDelta]:
    """Compare each pair element by element, on ``workers`` threads (default: one
    per usable core), results in the order of ``pairs``.

    Files are opened through the bundle's safe access and headers re-read with
    the check's bound; a file that no longer holds what the check read, or
    bytes that hash otherwise, raise EvidenceRejected (FILE_CHANGED,
    DIGEST_MISMATCH, FILE_UNREADABLE) at the tensor's ``where``.
    """
    bound: dict[tuple[Path, str], int] = {}
    for pair in pairs:
        for tensor in (pair.base, pair.other):
            key = (tensor.bundle, tensor.file)
            bound[key] = bound.get(key, 0) + 1
    files = _Files(bound)
    try:
        jobs = []
        for pair in pairs:
            length = _nbytes(pair.base)
            jobs.append((pair, length, files.locate(pair.base), files.locate(pair.other)))

        def run(job: Any, cancel: threading.Event) -> ElementDelta:
            pair, length, base, other = job
            return compare_ranges(
                pair.base.dtype,
                length,
                base,
                other,
                digests=(pair.base.sha256, pair.other.sha256),
                chunk_elements=chunk_elements,
                cancel=cancel,
            )

        results = _run_all(jobs, run, workers or default_workers())
    finally:
        files.close()
    violations = [
        v
        for pair, result in zip(pairs, results, strict=True)
        if isinstance(result, Exception)
        for v in _violations(pair, result)
    ]
    if violations:
        raise EvidenceRejected(violations)
    return [r for r in results if isinstance(r, ElementDelta)]


def _nbytes(tensor: StoredTensor) -> int:
    elements = element_count(tensor.shape, U64_MAX)
    nbytes = None if elements is None else DTYPES[tensor.dtype].nbytes(elements)
    assert nbytes is not None  # the check accepted the header
    return nbytes


def _violations(pair: TensorPair, error: Exception) -> list[Violation]:
    if isinstance(error, DigestChanged):
        tensor = pair.other if error.side else pair.base
        return [
            Violation(
                "DIGEST_MISMATCH",
                f"{tensor.where}.sha256",
                f"the data of {quote(tensor.name)} now hashes to {error.sha256}:"
                " it changed after the check",
            )
        ]
    if isinstance(error, ShortRead):
        return [_changed(pair.base, "ended early"), _changed(pair.other, "ended early")]
    if isinstance(error, OSError):
        reason = os.strerror(error.errno) if error.errno else type(error).__name__
        return [
            Violation(
                "FILE_UNREADABLE",
                f"{t.side}/{file_where(t.file)}",
                f"{reason} while comparing data",
            )
            for t in (pair.base, pair.other)
        ]
    raise error


_WAIT_SECONDS = 0.25


def _run_all(
    jobs: Sequence[Any],
    run: Callable[[Any, threading.Event], ElementDelta],
    workers: int,
) -> list[ElementDelta | Exception]:
    """Run every job on up to ``workers`` daemon threads, longest first; a job's
    exception is its result. Ctrl-C (or any exception while waiting) stops the
    workers at their next chunk and is raised again."""
    results: list[ElementDelta | Exception | None] = [None] * len(jobs)
    pending: queue.SimpleQueue[int] = queue.SimpleQueue()
    for index in sorted(range(len(jobs)), key=lambda i: jobs[i][1], reverse=True):
        pending.put(index)
    cancel = threading.Event()
    ended: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

    def work() -> None:
        try:
            while not cancel.is_set():
                try:
                    index = pending.get_nowait()
                except queue.Empty:
                    break
                try:
                    results[index] = run(jobs[index], cancel)
                except _Cancelled:
                    break
                except Exception as error:
                    results[index] = error
        except BaseException as error:  # MemoryError for a buffer, say
            ended.put(error)
            return
        ended.put(None)

    count = max(1, min(workers, len(jobs)))
    threads = [
        threading.Thread(target=work, name=f"nanrunbook-compare-{k}", daemon=True)
        for k in range(count)
    ]
    try:
        for thread in threads:
            thread.start()
        running = count
        while running:
            try:
                crash = ended.get(timeout=_WAIT_SECONDS)
            except queue.Empty:
                continue
            running -= 1
            if crash is not None:
                raise crash
    except BaseException:
        cancel.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=1.0)
        raise
    finished: list[ElementDelta | Exception] = []
    for result in results:
        if result is None:
            raise RuntimeError("a comparison was left without a result")
        finished.append(result)
    return finished
