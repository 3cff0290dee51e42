"""The bundle on disk: manifest bytes, tensor files bound to entries, recounts.

Read-only by construction: files are opened O_RDONLY, never mapped, and read in
bounded chunks; no path leaves the bundle directory (see :mod:`nanrunbook.access`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import is_
from pathlib import Path

from nanrunbook.access import file_where, open_in_bundle
from nanrunbook.codes import VERIFY_CODES as CODES
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.records import (
    Counts,
    Manifest,
    StageFinding,
    StageRecord,
    TensorEntry,
    TensorFinding,
    frozen_records,
)
from nanrunbook.tensors.counting import combine
from nanrunbook.tensors.safetensors import (
    MAX_HEADER_LEN,
    HeaderEntry,
    TensorFileHeader,
    read_header,
)
from nanrunbook.tensors.scan import ScanJob, ShortRead, TensorScan, scan_all, scan_range

__all__ = ["CODES", "Progress", "header_limit", "verify_bundle"]

# A header holds at most the entries the manifest binds to its file; this much per
# entry is far more than any writer needs, and the base leaves room for __metadata__.
# Parsing JSON costs some 20 bytes of memory per byte: 4 MiB keeps the worst
# header within the memory of a normal check.
HEADER_BASE_BYTES = 4 * 1024 * 1024
HEADER_BYTES_PER_ENTRY = 4096


def header_limit(bound_entries: int) -> int:
    """The longest header read from a file the manifest binds ``bound_entries``
    tensor entries to (spec section 1): every command that reads headers uses it."""
    return min(HEADER_BASE_BYTES + HEADER_BYTES_PER_ENTRY * bound_entries, MAX_HEADER_LEN)


Progress = Callable[[int], None]

# Why a declared value and its recount differ, said after the difference itself.
RECOUNT_CAUSES = (
    "the manifest was edited after capture, the probe read another slice,"
    " or it ran before or after the value changed"
)


def _reject(code: str, where: str, message: str) -> EvidenceRejected:
    return EvidenceRejected([Violation(code, where, message)])


@dataclass(slots=True)
class _Bound:
    """The complete-stage entries bound to one file, in manifest order, and where
    the manifest declares each: columns, not a record per entry."""

    entries: list[TensorEntry] = field(default_factory=list)
    places: list[tuple[int, int]] = field(default_factory=list)  # (stage, tensor) indices

    def extend(self, other: _Bound) -> None:
        self.entries.extend(other.entries)
        self.places.extend(other.places)

    def path(self, k: int) -> str:
        """Entry ``k``'s JSON path: spelled only for a violation, not for every entry."""
        stage, tensor = self.places[k]
        return f"$.stages[{stage}].tensors[{tensor}]"


def verify_bundle(
    bundle: Path,
    manifest: Manifest,
    progress: Progress | None = None,
    *,
    workers: int | None = None,
) -> tuple[tuple[StageFinding, ...], list[Violation]]:
    """Bind every complete entry to its file, hash and recount it, compare.

    Every header is read and bound first; then every bound tensor is scanned on
    ``workers`` threads (default: one per usable core, see :func:`.scan.scan_all`).
    Findings and violations do not depend on the order the scans finish in: they
    are assembled in manifest order, as a one-thread scan would produce them.

    ``progress``, if given, is called in this thread with byte counts as tensor
    data is read; if it also has a ``start`` method, that is called once first
    with the total number of bytes to read.
    """
    violations: list[Violation] = []
    opened = _open_files(bundle, _bound_by_file(manifest), violations)
    scans: dict[str, TensorScan] = {}
    try:
        plans = [_plan_file(fd, relpath, bound) for fd, relpath, bound in opened]
        violations.extend(_scan_plans(plans, scans, progress, workers))
    finally:
        for fd, _, _ in opened:
            os.close(fd)
    findings = tuple(_stage_finding(stage, scans) for stage in manifest.stages)
    violations.extend(_recount_violations(manifest, findings))
    return findings, violations


def _bound_by_file(manifest: Manifest) -> dict[str, _Bound]:
    """Every complete-stage entry, by the file path its entry names."""
    by_file: dict[str, _Bound] = {}
    for s_index, stage in enumerate(manifest.stages):
        if stage.status != "OBSERVED" or stage.resolution != "complete":
            continue
        tensors = stage.tensors
        files = [entry.file for entry in tensors if entry.file is not None]
        assert len(files) == len(tensors)  # a complete stage names a file for each entry
        if len(set(files)) == 1:  # the usual stage, one file: bound in a few C passes
            bound = by_file.setdefault(files[0], _Bound())
            bound.entries.extend(tensors)
            bound.places.extend(zip(repeat(s_index), range(len(tensors))))
            continue
        for t_index, (relpath, entry) in enumerate(zip(files, tensors, strict=True)):
            bound = by_file.get(relpath) or by_file.setdefault(relpath, _Bound())
            bound.entries.append(entry)
            bound.places.append((s_index, t_index))
    return by_file


def _open_files(
    bundle: Path, by_file: dict[str, _Bound], violations: list[Violation]
) -> list[tuple[int, str, _Bound]]:
    """Open each file once: (fd, the first path naming it, every entry bound to it).

    Two spellings of one file ("t.safetensors", "./t.safetensors", a symlink) are
    one file: its tensors must be bound once across all of them. A file that cannot
    be opened adds its violations. The caller closes the fds.
    """
    opened: dict[tuple[int, int], tuple[int, str, _Bound]] = {}
    try:
        for relpath, bound in by_file.items():
            try:
                fd = open_in_bundle(bundle, relpath)
            except EvidenceRejected as err:
                violations.extend(err.violations)
                continue
            info = os.fstat(fd)
            identity = (info.st_dev, info.st_ino)
            if identity in opened:
                os.close(fd)
                opened[identity][2].extend(bound)
            else:
                opened[identity] = (fd, relpath, bound)
    except BaseException:
        for fd, _, _ in opened.values():
            os.close(fd)
        raise
    return list(opened.values())


def _scan_plans(
    plans: list[_FilePlan],
    scans: dict[str, TensorScan],
    progress: Progress | None,
    workers: int | None,
) -> list[Violation]:
    """Scan every planned tensor at once; each file's violations, in manifest order."""
    jobs = list(chain.from_iterable(plan.jobs for plan in plans))
    start = getattr(progress, "start", None)
    if callable(start):
        start(sum(job.length for job in jobs))
    # scan_range is looked up here, at call time, so a test may replace it.
    results = scan_all(jobs, workers=workers, progress=progress, scan=scan_range)
    found: list[Violation] = []
    done = 0
    for plan in plans:
        mine = results[done : done + len(plan.jobs)]
        done += len(plan.jobs)
        found.extend(_verify_file(plan, mine, scans))
    return found


def _recount_violations(manifest: Manifest, findings: tuple[StageFinding, ...]) -> list[Violation]:
    """Declared counts and finite_max_abs of complete stages against the recount."""
    found: list[Violation] = []
    for s_index, (stage, finding) in enumerate(zip(manifest.stages, findings, strict=True)):
        if stage.resolution != "complete" or any(t.counts is None for t in finding.tensors):
            continue
        found.extend(_compare_recount(stage.counts, finding, f"$.stages[{s_index}]"))
        if stage.finite_max_abs_declared and stage.finite_max_abs != finding.finite_max_abs:
            found.append(
                Violation(
                    "FINITE_MAX_ABS_RECOUNT_MISMATCH",
                    f"$.stages[{s_index}].finite_max_abs",
                    f"declared {stage.finite_max_abs!r}, recounted {finding.finite_max_abs!r}"
                    f" from the data; {RECOUNT_CAUSES}",
                )
            )
    return found


@dataclass(frozen=True, slots=True)
class _FilePlan:
    """One opened tensor file: its bound entries and what to scan, or why not."""

    fd: int
    relpath: str
    bound: _Bound
    header: TensorFileHeader | None
    refused: list[Violation]  # header or binding violations: nothing is scanned
    jobs: list[ScanJob]  # one per bound entry, in manifest order


def _plan_file(fd: int, relpath: str, bound: _Bound) -> _FilePlan:
    try:
        header = read_header(fd, relpath, max_header_len=header_limit(len(bound.entries)))
    except EvidenceRejected as err:
        return _FilePlan(fd, relpath, bound, None, list(err.violations), [])
    stored = _bound_cleanly(header, bound.entries)
    if stored is None:
        refused = _binding_violations(header, relpath, bound)
        if refused:
            return _FilePlan(fd, relpath, bound, header, refused, [])
        stored = [header.entries[entry.name] for entry in bound.entries]
    jobs = frozen_records(
        ScanJob,
        [fd] * len(stored),
        [entry.begin for entry in stored],
        [entry.end - entry.begin for entry in stored],
        [entry.dtype for entry in stored],
    )
    return _FilePlan(fd, relpath, bound, header, [], jobs)


def _bound_cleanly(
    header: TensorFileHeader, entries: list[TensorEntry]
) -> list[HeaderEntry] | None:
    """The header entry of each bound entry when the binding holds (every name
    stored, none left unbound, dtypes and shapes alike); else None, and
    :func:`_binding_violations` words what is wrong."""
    found: list[HeaderEntry] = []
    stored = header.entries.get
    for entry in entries:
        match = stored(entry.name)
        if match is None or match.dtype != entry.dtype or match.shape != entry.shape:
            return None
        found.append(match)
    if len({entry.name for entry in entries}) != len(header.entries):
        return None  # a stored tensor is left unbound
    return found


def _verify_file(
    plan: _FilePlan,
    results: Sequence[TensorScan | Exception],
    scans: dict[str, TensorScan],
) -> list[Violation]:
    """A file's violations from its scans, taken in manifest order."""
    if plan.header is None or plan.refused:
        return plan.refused
    entries = plan.bound.entries
    if set(map(type, results)) <= {TensorScan}:  # every tensor read: no failure to stop at
        done: Sequence[TensorScan] = results  # type: ignore[assignment]
        found = [
            _digest_mismatch(plan.bound, k, scan)
            for k, (entry, scan) in enumerate(zip(entries, done, strict=True))
            if scan.sha256 != entry.sha256
        ]
        scans.update(zip([entry.name for entry in entries], done, strict=True))
    else:
        failed, found = _verify_each(plan, results, scans)
        if failed is not None:
            return [failed]
    if os.fstat(plan.fd).st_size != plan.header.size:
        found.append(
            Violation(
                "FILE_CHANGED",
                file_where(plan.relpath),
                "the file changed size while it was read",
            )
        )
    return found


def _verify_each(
    plan: _FilePlan,
    results: Sequence[TensorScan | Exception],
    scans: dict[str, TensorScan],
) -> tuple[Violation | None, list[Violation]]:
    """One scan at a time, up to the first that failed: that failure (the file's
    one violation) or None, and the digest mismatches before it."""
    found: list[Violation] = []
    for k, (entry, scan) in enumerate(zip(plan.bound.entries, results, strict=True)):
        if isinstance(scan, ShortRead):
            where = file_where(plan.relpath)
            return Violation("FILE_CHANGED", where, "the file shrank while it was read"), found
        if isinstance(scan, OSError):  # an I/O error is unreadable evidence, not our defect
            reason = os.strerror(scan.errno) if scan.errno else type(scan).__name__
            where = file_where(plan.relpath)
            return Violation("FILE_UNREADABLE", where, f"{reason} while reading data"), found
        if isinstance(scan, Exception):
            raise scan
        if scan.sha256 != entry.sha256:
            found.append(_digest_mismatch(plan.bound, k, scan))
        scans[entry.name] = scan
    return None, found


def _digest_mismatch(bound: _Bound, k: int, scan: TensorScan) -> Violation:
    return Violation(
        "DIGEST_MISMATCH",
        f"{bound.path(k)}.sha256",
        f"the data of {quote(bound.entries[k].name)} hashes to {scan.sha256}",
    )


def _binding_violations(header: TensorFileHeader, relpath: str, bound: _Bound) -> list[Violation]:
    found: list[Violation] = []
    names = {entry.name for entry in bound.entries}
    for k, declared in enumerate(bound.entries):
        entry = header.entries.get(declared.name)
        if entry is None:
            found.append(
                Violation(
                    "TENSOR_NOT_IN_FILE",
                    f"{bound.path(k)}.name",
                    f"{quote(declared.name)} is not in {quote(relpath)}",
                )
            )
            continue
        if entry.dtype != declared.dtype:
            found.append(
                Violation(
                    "TENSOR_DTYPE_MISMATCH",
                    f"{bound.path(k)}.dtype",
                    f"the file stores {entry.dtype}, the entry says {declared.dtype}",
                )
            )
        if entry.shape != declared.shape:
            found.append(
                Violation(
                    "TENSOR_SHAPE_MISMATCH",
                    f"{bound.path(k)}.shape",
                    f"the file stores {list(entry.shape)}, the entry says {list(declared.shape)}",
                )
            )
    for name in header.entries:
        if name not in names:
            found.append(
                Violation(
                    "TENSOR_UNBOUND",
                    file_where(relpath),
                    f"{quote(name)} is stored but no manifest entry binds it",
                )
            )
    return found


def _stage_finding(stage: StageRecord, scans: dict[str, TensorScan]) -> StageFinding:
    if stage.status != "OBSERVED":
        return StageFinding(stage, None, None, None, ())
    if stage.resolution == "summary":
        tensors = tuple(TensorFinding(entry, None, None) for entry in stage.tensors)
        return StageFinding(stage, stage.counts, "declared", stage.finite_max_abs, tensors)
    read = [scans.get(entry.name) for entry in stage.tensors]
    # "None in read" would call each scan's __eq__: identity is tested in C.
    if any(map(is_, read, repeat(None))):  # not read: a file-level violation is already reported
        findings = tuple(
            TensorFinding(entry, None, None)
            if scan is None
            else TensorFinding(entry, scan.tally.counts, scan.tally.max_abs, scan.extremes)
            for entry, scan in zip(stage.tensors, read, strict=True)
        )
        return StageFinding(stage, stage.counts, "declared", stage.finite_max_abs, findings)
    scanned: list[TensorScan] = read  # type: ignore[assignment]
    tallies = [scan.tally for scan in scanned]
    # Records in bulk, a column at a time: a stage may hold thousands of tensors.
    counts = frozen_records(
        Counts,
        [t.elements for t in tallies],
        [t.finite for t in tallies],
        [t.nan for t in tallies],
        [t.posinf for t in tallies],
        [t.neginf for t in tallies],
    )
    findings = tuple(
        frozen_records(
            TensorFinding,
            stage.tensors,
            counts,
            [t.max_abs for t in tallies],
            [scan.extremes for scan in scanned],
        )
    )
    total = combine(tallies)
    return StageFinding(stage, total.counts, "recounted", total.max_abs, findings)


def _compare_recount(declared: Counts | None, finding: StageFinding, path: str) -> list[Violation]:
    recounted = finding.counts
    if declared is None or recounted is None or declared == recounted:
        return []
    return [
        Violation(
            "COUNTS_RECOUNT_MISMATCH",
            f"{path}.counts",
            f"declared {_show(declared)}, recounted {_show(recounted)} from the data;"
            f" {RECOUNT_CAUSES}",
        )
    ]


def _show(counts: Counts) -> str:
    return (
        f"finite={counts.finite} nan={counts.nan} posinf={counts.posinf} "
        f"neginf={counts.neginf} of {counts.elements}"
    )
