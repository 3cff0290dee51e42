"""BundleWriter: evidence bundles from training code, sealed and written atomically.

Counts, digests and magnitudes come from the same engine ``check`` uses, and
``write`` runs the check itself on the finished bundle before it is moved into
place: the writer refuses exactly what the check would reject, with the same
violation codes.

Tensors are taken as numpy arrays (``ml_dtypes`` ones included),
:class:`RawTensor` bytes, or a framework's tensors once that framework's capture
module has registered its converter (importing :mod:`nanrunbook.capture.torch`
registers torch tensors of any device and dtype). The writer imports no
framework: framework modules import the writer, never the reverse. Each tensor
is copied to host bytes when it is observed, so later in-place changes to the
live tensor do not alter the evidence.

Given a ``spool_dir``, the writer streams: each tensor's bytes are counted,
hashed and appended to a data file in a private spool directory (made under
``spool_dir`` when the first tensor comes) as it is observed, and let go, so a
writer holds about one tensor in memory whatever the bundle's size. ``write``
then puts the header down and copies the spooled bytes after it in the kernel.
Without one, the bytes are kept in memory until ``write``, as ever. The file
bytes are the same either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanrunbook.capture.atomic import (
    atomic_directory,
    write_synced,
    write_synced_copy,
)
from nanrunbook.contract import BUNDLE_FORMAT, CONTRACT_VERSION, STAGE_ORDER, Caps
from nanrunbook.dtypes import DTYPES, NUMPY_DTYPES
from nanrunbook.errors import EvidenceRejected, Violation
from nanrunbook.manifest.content_id import EVIDENCE_ID_KEY, evidence_content_id
from nanrunbook.manifest.parse import RECOVERY_PARTS
from nanrunbook.records import Counts
from nanrunbook.strictjson import MAX_SAFE_INTEGER, child_path
from nanrunbook.tensors.counting import Tally, combine, tally_bytes
from nanrunbook.tensors.safetensors_write import RawTensor, safetensors_chunks, safetensors_header

if TYPE_CHECKING:
    from nanrunbook.verdict.report import Report

__all__ = ["NUMPY_DTYPES", "BundleWriter", "RawTensor", "as_raw", "register_converter"]

TENSOR_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"


# A framework's tensor type -> its converter to RawTensor; filled by the framework
# capture modules when they are imported (nanrunbook.capture.torch for torch).
_CONVERTERS: dict[type, Callable[[Any], RawTensor]] = {}


def register_converter(kind: type, convert: Callable[[Any], RawTensor]) -> None:
    """Let :func:`as_raw` (and so :class:`BundleWriter`) take instances of ``kind``
    (subclasses included): ``convert(value)`` returns the stored bytes."""
    _CONVERTERS[kind] = convert


def _converter(value: Any) -> Callable[[Any], RawTensor] | None:
    for kind in type(value).__mro__:
        if kind in _CONVERTERS:
            return _CONVERTERS[kind]
    return None


def as_raw(value: Any) -> RawTensor:
    """A numpy array (or anything ``numpy.asarray`` takes), a RawTensor, or a
    tensor of a framework whose converter is registered, as the bytes
    safetensors stores.

    ``ml_dtypes.float4_e2m1fn`` arrays (one element per byte) are packed two to a
    byte, the first element in the low nibble, as torch's ``float4_e2m1fn_x2``
    packs them. Raises TypeError for a dtype safetensors has no name for, and
    for a framework tensor whose capture module was not imported.
    """
    if isinstance(value, RawTensor):
        return value
    convert = _converter(value)
    if convert is not None:
        return convert(value)
    import numpy as np

    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError) as error:
        kind = f"{type(value).__module__}.{type(value).__name__}"
        raise TypeError(
            f"cannot take a {kind} as tensor bytes ({error}); import the capture module"
            " of its framework first (nanrunbook.capture.torch for torch) or pass a RawTensor"
        ) from None
    shape = tuple(int(d) for d in array.shape)
    if array.dtype.name == DTYPES["F4"].numpy:  # unpacked: one element per byte
        if array.size % 2:
            raise TypeError(f"F4 packs two elements to a byte; {array.size} elements do not")
        nibbles = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & 0x0F
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        return RawTensor("F4", shape, packed.astype(np.uint8).tobytes())
    name = NUMPY_DTYPES.get(array.dtype.name)
    if name is None:
        raise TypeError(
            f"no safetensors dtype for numpy dtype {array.dtype.name!r};"
            " pass the stored bytes as a RawTensor"
        )
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(array).tobytes()
    return RawTensor(name, shape, data)


def _seal(raw: RawTensor) -> tuple[Tally, str]:
    return tally_bytes(raw.dtype, raw.data), hashlib.sha256(raw.data).hexdigest()


# Below this many bytes a stage is counted and hashed in the calling thread.
_PARALLEL_BYTES = 8 << 20


def _seal_all(raws: list[RawTensor]) -> list[tuple[Tally, str]]:
    """Counts and SHA-256 of each tensor, in order; a large stage is spread over
    one thread per core (hashlib and numpy release the GIL), as check does."""
    if len(raws) < 2 or sum(len(r.data) for r in raws) < _PARALLEL_BYTES:
        return [_seal(raw) for raw in raws]
    from concurrent.futures import ThreadPoolExecutor

    by_size = sorted(range(len(raws)), key=lambda i: -len(raws[i].data))  # longest first
    with ThreadPoolExecutor(max_workers=min(len(raws), os.cpu_count() or 1)) as pool:
        done = dict(zip(by_size, pool.map(_seal, [raws[i] for i in by_size]), strict=True))
    return [done[i] for i in range(len(raws))]


@dataclass(frozen=True, slots=True)
class _Captured:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    probe: str
    sha256: str
    data: bytes | None  # None: the bytes are in the writer's spool, in capture order

    @property
    def tensor(self) -> RawTensor:
        """The tensor as observed (an in-memory writer's only)."""
        if self.data is None:
            raise ValueError(f"the bytes of {self.name!r} are spooled to disk, not in memory")
        return RawTensor(self.dtype, self.shape, self.data)


def _captured(name: str, raw: RawTensor, probe: str, digest: str, keep: bool) -> _Captured:
    data = raw.data if keep else None
    return _Captured(name, raw.dtype, raw.shape, len(raw.data), probe, digest, data)


SPOOL_PREFIX = ".nanrunbook-spool."


def _remove_spool(fd: int, directory: str, pid: int) -> None:
    if os.getpid() != pid:  # a forked child never removes its parent's spool
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


class _Spool:
    """Tensor bytes appended, in capture order, to one data file of a private
    directory made in ``parent`` (which must exist) at the first append. The directory goes when
    :meth:`release` is called, when the spool is garbage, or at exit."""

    def __init__(self, parent: Path) -> None:
        self.parent = parent
        self.fd = -1
        self.size = 0
        self.directory: Path | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def append(self, data: bytes) -> None:
        if self.fd < 0:  # the caller's directory must exist: the spool makes none
            directory = tempfile.mkdtemp(prefix=SPOOL_PREFIX, suffix=".tmp", dir=self.parent)
            try:
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                self.fd = os.open(os.path.join(directory, "data"), flags, 0o600)
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
            self.directory = Path(directory)
            self._finalizer = weakref.finalize(self, _remove_spool, self.fd, directory, os.getpid())
        view = memoryview(data)
        offset = self.size
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written
        self.size = offset

    def truncate(self, size: int) -> None:
        """Forget what was appended after ``size`` (a stage that failed midway)."""
        if self.fd >= 0 and self.size != size:
            os.ftruncate(self.fd, size)
        self.size = size

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.fd, self.size, self.directory = -1, 0, None


class BundleWriter:
    """Collects the five stages of one failing step and writes a sealed bundle.

    Record stages with :meth:`observe`, :meth:`summarize` or :meth:`not_run`;
    :meth:`not_run_rest` marks every stage not yet recorded as NOT_RUN (stages
    are written in contract order whatever order they are recorded in).
    Tensors are kept in memory, as host bytes, until :meth:`write`; given a
    ``spool_dir``, they are streamed to a private spool directory under it as
    they are observed instead (see the module's docstring); a write that fails
    or is refused removes the spool with it (the writer cannot write again).
    """

    def __init__(
        self,
        *,
        run_id: str,
        step: int,
        incident_owner: str,
        binding: Mapping[str, Mapping[str, Any]],
        last_known_good: Mapping[str, Any],
        evidence_id: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.run_id = run_id
        self.step = step
        self.incident_owner = incident_owner
        self.binding = {name: dict(fields) for name, fields in binding.items()}
        if "verified_together" not in last_known_good:
            # Never assumed: a bundle would claim a recovery point nobody verified.
            raise ValueError(
                "last_known_good needs 'verified_together': which of "
                f"{', '.join(RECOVERY_PARTS)} the checkpoint verified together"
                " (the writer does not assume it)"
            )
        self.last_known_good = dict(last_known_good)
        self.evidence_id = evidence_id or f"{run_id}.step-{step}"
        self._stages: list[dict[str, Any]] = []
        self._tensors: list[_Captured] = []
        self._spool = _Spool(Path(spool_dir)) if spool_dir is not None else None
        self._spent: str | None = None  # why the spooled bytes are gone
        self._written: tuple[Path, int] | None = None  # a bundle's tensor file holding them

    @property
    def recorded(self) -> tuple[str, ...]:
        return tuple(str(s["stage"]) for s in self._stages)

    def _base(
        self,
        stage: str,
        status: str,
        owner: str,
        probe_source: str,
        telemetry_id: str | None,
        tensor_set_id: str | None,
        gradients: str | None,
    ) -> dict[str, Any]:
        if stage not in STAGE_ORDER:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGE_ORDER)}")
        if stage in self.recorded:
            raise ValueError(f"stage {stage!r} is already recorded")
        record: dict[str, Any] = {
            "stage": stage,
            "status": status,
            "owner": owner,
            "telemetry_id": telemetry_id or f"tel-{self.step}-{stage}",
            "tensor_set": {
                "id": tensor_set_id or f"ts-{self.step}-{stage}",
                "probe_source": probe_source,
            },
        }
        if stage == "backward":
            record["gradients"] = gradients or "unscaled"
        elif gradients is not None:
            raise ValueError("only the backward stage has gradients")
        return record

    def observe(
        self,
        stage: str,
        tensors: Iterable[tuple[str, Any, str]],
        *,
        owner: str,
        probe_source: str,
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> Counts:
        """Record an OBSERVED stage with complete data: ``(name, tensor, probe)`` in
        capture order. Returns the stage's counts."""
        record = self._base(
            stage, "OBSERVED", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        if self._spool is None:
            raws = [(name, as_raw(value), probe) for name, value, probe in tensors]
            sealed = _seal_all([raw for _, raw, _ in raws])
            captured = [
                _captured(name, raw, probe, digest, keep=True)
                for (name, raw, probe), (_, digest) in zip(raws, sealed, strict=True)
            ]
        else:
            captured, sealed = self._stream(tensors)
        total = combine([tally for tally, _ in sealed])
        record.update(
            resolution="complete",
            tensors=[
                {
                    "name": c.name,
                    "file": TENSOR_FILE,
                    "dtype": c.dtype,
                    "shape": list(c.shape),
                    "sha256": c.sha256,
                    "probe": c.probe,
                }
                for c in captured
            ],
            counts=total.counts.as_dict(),
            finite_max_abs=total.max_abs,
        )
        self._stages.append(record)
        self._tensors.extend(captured)
        return total.counts

    def _stream(
        self, tensors: Iterable[tuple[str, Any, str]]
    ) -> tuple[list[_Captured], list[tuple[Tally, str]]]:
        """Count, hash and spool each tensor in turn, holding one at a time; a
        stage that fails midway leaves the spool as it was before it."""
        spool = self._spool
        assert spool is not None
        if self._spent is not None:
            raise RuntimeError(self._spent)
        start = spool.size
        captured: list[_Captured] = []
        sealed: list[tuple[Tally, str]] = []
        try:
            for name, value, probe in tensors:
                raw = as_raw(value)
                seal = _seal(raw)
                spool.append(raw.data)
                captured.append(_captured(name, raw, probe, seal[1], keep=False))
                sealed.append(seal)
                del raw
        except BaseException:
            spool.truncate(start)
            raise
        return captured, sealed

    def _put_tensor_file(self, path: Path) -> int:
        """Write the safetensors file of everything observed to ``path``; returns
        where its tensor data starts."""
        if self._spool is None:
            chunks = safetensors_chunks([(c.name, c.tensor) for c in self._tensors])
            write_synced(path, chunks)
            return 0  # where the data starts matters to a streaming writer only
        head = safetensors_header((c.name, c.dtype, c.shape, c.nbytes) for c in self._tensors)
        if self._written is not None:  # the spool went into a bundle: copy from there
            source, offset = self._written
            fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                write_synced_copy(path, head, fd, offset, os.fstat(fd).st_size - offset)
            finally:
                os.close(fd)
        else:
            write_synced_copy(path, head, self._spool.fd, 0, self._spool.size)
        return len(head)

    def summarize(
        self,
        stage: str,
        entries: Iterable[tuple[str, str, tuple[int, ...], str]],
        counts: Counts,
        *,
        owner: str,
        probe_source: str,
        finite_max_abs: float | None = None,
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> None:
        """Record an OBSERVED stage by declared counts only: ``(name, dtype, shape,
        probe)`` entries. The counts must cover every element (no samples)."""
        record = self._base(
            stage, "OBSERVED", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        record.update(
            resolution="summary",
            tensors=[
                {"name": name, "dtype": dtype, "shape": list(shape), "probe": probe}
                for name, dtype, shape, probe in entries
            ],
            counts=counts.as_dict(),
        )
        if finite_max_abs is not None:
            record["finite_max_abs"] = finite_max_abs
        self._stages.append(record)

    def not_run(
        self,
        stage: str,
        *,
        owner: str,
        reason: str,
        probe_source: str = "not captured: the stage did not run",
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> None:
        """Record a NOT_RUN stage, with the reason it did not run."""
        record = self._base(
            stage, "NOT_RUN", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        record["reason"] = reason
        self._stages.append(record)

    def annotate(self, stage: str, note: str) -> None:
        """Add ``note`` to a recorded stage's probe_source: how its tensors were
        captured, when that differs from how the live step made them."""
        for record in self._stages:
            if record["stage"] == stage:
                tensor_set = record["tensor_set"]
                tensor_set["probe_source"] = f"{tensor_set['probe_source']}; {note}"
                return
        raise ValueError(f"stage {stage!r} is not recorded")

    def nonfinite(self, stage: str) -> bool | None:
        """Whether an OBSERVED stage holds a non-finite element (None: not observed)."""
        for record in self._stages:
            if record["stage"] == stage and record["status"] == "OBSERVED":
                counts = record["counts"]
                return bool(counts["nan"] or counts["posinf"] or counts["neginf"])
        return None

    def not_run_rest(self, *, owner: str, reason: str) -> None:
        """Mark every stage not recorded yet as NOT_RUN, in contract order."""
        for stage in STAGE_ORDER:
            if stage not in self.recorded:
                self.not_run(stage, owner=owner, reason=reason)

    def manifest(self) -> dict[str, Any]:
        """The sealed manifest: everything recorded, with its evidence content id.

        Raises EvidenceRejected when a value has no exact JSON form (a NaN or
        infinite number, an integer outside +-(2^53 - 1), an object that is not
        a JSON value); numpy scalars are taken as the Python numbers they hold.
        """
        order = {stage: i for i, stage in enumerate(STAGE_ORDER)}
        document: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "contract_version": CONTRACT_VERSION,
            "evidence_id": self.evidence_id,
            "run": {"run_id": self.run_id, "step": self.step},
            "incident_owner": self.incident_owner,
            "binding": self.binding,
            "last_known_good": self.last_known_good,
            "stages": sorted(self._stages, key=lambda s: order[s["stage"]]),
        }
        violations: list[Violation] = []
        document = _json_value(document, "$", violations)
        if violations:
            raise EvidenceRejected(violations)
        document[EVIDENCE_ID_KEY] = evidence_content_id(document)
        return document

    def validate(self, *, caps: Caps | None = None) -> None:
        """Judge the manifest as ``check`` would, before any tensor data is written.

        Raises EvidenceRejected with the check's codes for every rule a manifest
        alone can break (fields, identifiers, transitions, counts, scaler, caps).
        """
        self._validated_manifest(caps)

    def _validated_manifest(self, caps: Caps | None) -> dict[str, Any]:
        import orjson

        from nanrunbook.manifest.parse import parse_manifest
        from nanrunbook.strictjson import load_manifest_bytes

        manifest = self.manifest()
        _, violations = parse_manifest(load_manifest_bytes(orjson.dumps(manifest)), caps)
        if violations:
            raise EvidenceRejected(violations)
        return manifest

    def write(
        self, target: str | Path, *, overwrite: bool = False, caps: Caps | None = None
    ) -> Path:
        """Write the bundle to ``target`` atomically and return its path.

        The bundle is built in a temporary directory beside ``target``, fsynced,
        checked with :func:`nanrunbook.check_bundle`, then renamed into place: an
        interrupted write (an exception, Ctrl-C, a killed process) leaves nothing
        at ``target`` and an existing bundle there as it was.

        Raises EvidenceRejected (nothing is written) when the check would reject
        the bundle, FileNotFoundError (naming ``target``) when the directory
        ``target`` would be in does not exist, and FileExistsError when
        ``target`` exists and ``overwrite`` is false, and RuntimeError when a
        streaming writer's earlier write failed and took its spooled bytes with
        it. ``overwrite`` replaces only a directory holding a manifest.json (a
        bundle), in one atomic swap where the system supports it.
        """
        self.write_checked(target, overwrite=overwrite, caps=caps)
        return Path(target)

    def write_checked(
        self, target: str | Path, *, overwrite: bool = False, caps: Caps | None = None
    ) -> Report:
        """:meth:`write`, returning the check's report on the bundle now at ``target``
        (the check made on the finished files before they were moved there)."""
        import orjson

        from nanrunbook.check import check_bundle

        target = Path(target)
        if not target.parent.is_dir():  # else the error names the hidden temporary
            raise FileNotFoundError(
                f"cannot write the bundle to {target}: its directory {target.parent} does not exist"
            )
        if overwrite and (target.exists() or target.is_symlink()):
            if target.is_symlink() or not target.is_dir():
                raise FileExistsError(f"{target} exists and is not a bundle directory")
            if not (target / MANIFEST_FILE).is_file():
                raise FileExistsError(
                    f"{target} exists and has no {MANIFEST_FILE}; refusing to replace it"
                )
        if self._spent is not None:
            raise RuntimeError(self._spent)
        if not overwrite and (target.exists() or target.is_symlink()):
            raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
        try:
            manifest = self._validated_manifest(caps)
            with atomic_directory(target, overwrite=overwrite) as temp:
                data_start = self._put_tensor_file(temp / TENSOR_FILE) if self._tensors else 0
                write_synced(
                    temp / MANIFEST_FILE, [orjson.dumps(manifest, option=orjson.OPT_INDENT_2)]
                )
                report = check_bundle(temp, caps=caps)  # raises EvidenceRejected; temp removed
        except BaseException:
            if self._spool is not None and self._spool.fd >= 0:
                # Nothing of a failed or refused write stays on disk, the spool included.
                self._spool.release()
                self._spent = (
                    f"the writer's spooled tensor bytes were removed when its write to"
                    f" {target} failed; record the stages again in a new BundleWriter"
                )
            raise
        if self._spool is not None and self._spool.fd >= 0:
            # The bundle now holds the spooled bytes (checked against their
            # digests): later writes copy from it, and the spool goes.
            self._written = (target / TENSOR_FILE, data_start)
            self._spool.release()
        return dataclasses.replace(report, bundle=str(target))


def _json_value(value: Any, path: str, violations: list[Violation]) -> Any:
    """``value`` as plain JSON data (dict, list, str, int, float, bool, None),
    with a violation for anything that has no exact JSON form."""
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)  # an enum's value, not its name
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            violations.append(
                Violation("JSON_INTEGER_OUT_OF_RANGE", path, "integer is outside +-(2^53 - 1)")
            )
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            violations.append(
                Violation("JSON_NONFINITE_NUMBER", path, f"{value!r} has no JSON form")
            )
        return float(value)
    if isinstance(value, Mapping):
        plain: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                violations.append(Violation("FIELD_TYPE", path, f"key {key!r} is not a string"))
                continue
            plain[key] = _json_value(item, child_path(path, key), violations)
        return plain
    if isinstance(value, list | tuple):
        return [_json_value(item, child_path(path, i), violations) for i, item in enumerate(value)]
    item = getattr(value, "item", None)  # a numpy scalar
    if type(value).__module__ == "numpy" and callable(item):
        return _json_value(item(), path, violations)
    violations.append(
        Violation("FIELD_TYPE", path, f"a {type(value).__name__} is not a JSON value")
    )
    return None
