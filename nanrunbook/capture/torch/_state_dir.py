"""A directory of training state: torch.distributed.checkpoint (DCP) files under
``state/``, JSON documents beside them, and a manifest of every file's SHA-256
and size written last. The one home of it for recovery points and capsules.

Written atomically (a temporary directory beside the target, every file and
folder fsync'd, the manifest last, a rename, the parent fsync'd: DCP's own
``.metadata`` rename does not fsync its folder). Read back only after
verification (``_state_manifest.verify_state_dir``, torch-free), with DCP's
``.metadata`` pickle read through an unpickler that resolves only DCP's own
metadata classes and every stored object read ``weights_only``: DCP's own
reader unpickles both freely.

Non-tensor state that must come back exact (random states, a loader's cursor,
a scheduler's ``inf``) goes in a document through :func:`encode_value`, a
tagged JSON form of tensors, arrays, tuples, non-string keys, large integers
and non-finite floats; :func:`decode_value` reads it back.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nanrunbook.capture._state_manifest import (
    CODES,
    DCP_METADATA,
    FORMATS,
    MANIFEST_NAME,
    RANKS_KEY,
    STATE_SUBDIR,
    FileDigest,
    StateDirManifest,
    StateDirRejected,
    manifest_document,
    read_document,
    verify_state_dir,
)
from nanrunbook.capture.atomic import (
    atomic_directory,
    fsync_directory,
    publish_directory,
    write_synced,
)
from nanrunbook.capture.incident import rank_member
from nanrunbook.capture.torch._dcp_reader import (
    RecordPlaces,
    WeightsOnlyPlanner,
    distributed,
    load_restricted,
    read_metadata,
    read_places,
    record_places,
    single_process_quiet,
)
from nanrunbook.capture.torch._every_rank import agree, from_rank0
from nanrunbook.errors import Violation, quote

__all__ = [
    "CODES",
    "FORMATS",
    "FileDigest",
    "StateDirManifest",
    "StateDirRejected",
    "StateOutline",
    "decode_value",
    "encode_value",
    "load_state_dir",
    "load_verified_state",
    "outline_verified_state_dir",
    "rank_documents",
    "read_state_dir",
    "read_verified_state_dir",
    "verify_state_dir",
    "write_state_dir",
]

_DOCUMENT_NAME = re.compile(r"[a-z][a-z0-9_]*")
_CHUNK = 1 << 20
# The files a rank writes into a directory every rank writes: DCP names its
# shards ``__<rank>_<n>.distcp``; the documents go in the rank's member folder.
_DCP_SHARD = re.compile(rf"{STATE_SUBDIR}/__(\d+)_\d+\.distcp")
_MEMBER = re.compile(r"rank-(\d{5})/")
_SHOWN = 4  # differences named in a key, shape or dtype refusal


def write_state_dir(
    path: Path,
    *,
    kind_format: str,
    state: Mapping[str, Any] | None,
    documents: Mapping[str, Any],
    header: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    every_rank: bool = False,
) -> StateDirManifest:
    """Write ``state`` through DCP and each document as ``<name>.json``, then the
    manifest, atomically at ``path`` (which must not exist: FileExistsError).
    A failure or a kill leaves nothing at ``path``. ``header`` may be a callable,
    called once the files are written, before the manifest: facts computed
    while DCP writes (a digest of the state in memory, say).

    ``every_rank`` (under torch.distributed with more than one rank): every
    rank calls this with the same ``path`` and its own ``state`` (its shards)
    and ``documents``; one directory holds them all (see :func:`_write_every_rank`)."""
    target = Path(path)
    for name in documents:
        if not _DOCUMENT_NAME.fullmatch(name):
            raise ValueError(f"document name {name!r} is not lower-case letters, digits and _")
    if every_rank and distributed() and dist.get_world_size() > 1:
        return _write_every_rank(target, kind_format, state, documents, header)
    _check_target(target)
    with atomic_directory(target) as temp:
        written: dict[str, FileDigest] = {}
        if state is not None:
            written = _save_hashed(temp, state)
        _write_documents(temp, documents)
        files = _digests(temp, written)
        if state is not None:
            fsync_directory(temp / STATE_SUBDIR)
        facts = header() if callable(header) else header
        manifest = StateDirManifest(kind_format, files, dict(facts))
        write_synced(temp / MANIFEST_NAME, [manifest_document(manifest)])
    return manifest


# DCP writes (and _HashingFileSystem hashes) two files at once above this many
# bytes of tensors: two cores; below it one file, as DCP's default.
_TWO_FILES_FROM = 8 << 20


def _save_hashed(root: Path, state: Mapping[str, Any]) -> dict[str, FileDigest]:
    """DCP's save of ``state`` below ``root / STATE_SUBDIR``, each file hashed as
    DCP writes it (no second read); the digests by path relative to ``root``."""
    tensors = [value for value in _flat(state).values() if isinstance(value, torch.Tensor)]
    large = sum(t.numel() * t.element_size() for t in tensors) >= _TWO_FILES_FROM
    writer = FileSystemWriter(
        root / STATE_SUBDIR, sync_files=True, thread_count=2 if large and len(tensors) > 1 else 1
    )
    hashing = _HashingFileSystem()
    writer.fs = hashing
    with single_process_quiet():
        dcp_save(dict(state), storage_writer=writer, no_dist=not distributed())
    return {
        path.relative_to(root).as_posix(): digest
        for path, digest in hashing.written.items()
        if path.is_relative_to(root)
    }


class _HashingFileSystem(FileSystem):
    """DCP's local file system, keeping the SHA-256 and size of every file it
    writes from the bytes as they go by (``written``, by path; a rename follows)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[Path, FileDigest] = {}
        self._lock = threading.Lock()  # DCP's writer threads finish files at once

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open(path, "wb") as handle:
            stream = _HashingStream(handle)
            yield stream
            stream.close()
        if stream.digest is not None:
            with self._lock:
                self.written[Path(path)] = stream.digest

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            digest = self.written.pop(Path(path), None)
            if digest is not None:
                self.written[Path(new_path)] = digest


class _HashingStream(io.RawIOBase):
    """A file DCP writes through: each write goes to the file and into a
    SHA-256. ``digest`` is set on close only when the bytes hashed are the
    file's (written in order, no seek, the size on disk theirs); else None
    and the file is read back."""

    def __init__(self, handle: IO[bytes]) -> None:
        super().__init__()
        self._handle = handle
        self._hasher = hashlib.sha256()
        self._size = 0
        self._in_order = True
        self.digest: FileDigest | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        count = self._handle.write(view)
        self._hasher.update(view[:count])  # releases the GIL: the other writer thread runs
        self._size += count
        return count

    def tell(self) -> int:
        return self._handle.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._in_order = False
        return self._handle.seek(offset, whence)

    def fileno(self) -> int:
        self._handle.flush()  # DCP fsyncs the descriptor: what is buffered goes first
        return self._handle.fileno()

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> None:
        if not self.closed:
            self._handle.flush()
            on_disk = os.fstat(self._handle.fileno()).st_size
            if self._in_order and on_disk == self._size == self._handle.tell():
                self.digest = FileDigest(self._hasher.hexdigest(), self._size)
            super().close()
            self._handle.close()


def _check_target(target: Path) -> None:
    if target.exists() or target.is_symlink():
        raise FileExistsError(f"{target} exists: a state directory is never overwritten")
    if not target.parent.is_dir():
        raise FileNotFoundError(
            f"{target.parent} is not a directory: make the one the state goes in"
        )


def _write_documents(folder: Path, documents: Mapping[str, Any]) -> None:
    for name, value in documents.items():
        write_synced(folder / f"{name}.json", [orjson.dumps(value, option=orjson.OPT_SORT_KEYS)])


def _owner(name: str) -> int:
    """The rank that wrote a file of a directory every rank writes (rank 0: DCP's
    metadata and anything at the top)."""
    found = _DCP_SHARD.fullmatch(name) or _MEMBER.match(name)
    return int(found.group(1)) if found else 0


def _write_every_rank(
    target: Path,
    kind_format: str,
    state: Mapping[str, Any] | None,
    documents: Mapping[str, Any],
    header: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
) -> StateDirManifest:
    """Rank 0 makes one temporary directory; every rank writes its DCP shards
    into it (DCP's save, itself collective, raises on every rank when one
    fails), then its documents into its member folder, then hashes its own
    files; the digests are gathered to rank 0, which writes the one manifest
    (every rank's files under the header's ``ranks``), fsyncs and renames.
    Each phase ends in an agreement (:func:`agree`): every rank raises when any
    rank failed, and rank 0 removes the temporary; nothing is at ``target``."""
    rank = dist.get_rank()
    made: str | None = None
    error: BaseException | None = None
    if rank == 0:
        try:
            _check_target(target)
            made = tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as caught:
            error = caught
    agree("preparing the state directory", error)
    temp = Path(from_rank0(made))
    try:
        written = _save_hashed(temp, state) if state is not None else {}
        own: dict[str, FileDigest] = {}
        try:
            folder = temp / rank_member(rank)
            folder.mkdir()
            _write_documents(folder, documents)
            fsync_directory(folder)
            own = _digests(temp, written, lambda name: _owner(name) == rank)
        except Exception as caught:  # every rank learns it, below
            error = caught
        shards = agree("writing a rank's files", error, own)
        manifest: StateDirManifest | None = None
        if rank == 0:
            try:
                manifest = _publish(temp, target, kind_format, shards, header, state is not None)
            except Exception as caught:
                error = caught
        agree("publishing the state directory", error)
        published: StateDirManifest = from_rank0(manifest)
        return published
    except BaseException:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise


def _publish(
    temp: Path,
    target: Path,
    kind_format: str,
    shards: list[dict[str, FileDigest]],
    header: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
    has_state: bool,
) -> StateDirManifest:
    """Rank 0's part: every file on disk hashed by its rank, the manifest, the rename."""
    files = {name: digest for own in shards for name, digest in own.items()}
    present = {
        (Path(folder) / name).relative_to(temp).as_posix()
        for folder, _, names in os.walk(temp)
        for name in names
    }
    stray = sorted(present - set(files))
    if stray:
        raise RuntimeError(f"{len(stray)} file(s) no rank hashed, such as {quote(stray[0])}")
    if has_state:
        fsync_directory(temp / STATE_SUBDIR)
    facts = dict(header() if callable(header) else header)
    facts[RANKS_KEY] = {str(rank): sorted(own) for rank, own in enumerate(shards)}
    manifest = StateDirManifest(kind_format, files, facts)
    write_synced(temp / MANIFEST_NAME, [manifest_document(manifest)])
    fsync_directory(temp)
    publish_directory(temp, target)
    return manifest


def _digests(
    root: Path,
    written: Mapping[str, FileDigest],
    keep: Callable[[str], bool] | None = None,
) -> dict[str, FileDigest]:
    """Every file below ``root`` (that ``keep`` keeps, by relative name): as
    hashed while written (``written``, when its size on disk is that), else
    read and hashed once: the single SHA-256 pass."""
    found: dict[str, FileDigest] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            full = Path(folder) / name
            relative = full.relative_to(root).as_posix()
            if keep is not None and not keep(relative):
                continue
            known = written.get(relative)
            if known is not None and full.stat().st_size == known.size:
                found[relative] = known
                continue
            hasher = hashlib.sha256()
            size = 0
            with open(full, "rb", buffering=0) as handle:
                buffer = bytearray(_CHUNK)
                view = memoryview(buffer)
                while count := handle.readinto(buffer):
                    hasher.update(view[:count])
                    size += count
            found[relative] = FileDigest(hasher.hexdigest(), size)
    return found


def _flat(state: Mapping[str, Any]) -> dict[str, Any]:
    flat, _ = flatten_state_dict(dict(state))
    return flat


def _differences_flat(flat: Mapping[str, Any], saved: Mapping[str, Any]) -> list[Violation]:
    """Keys, shapes and dtypes of a flattened state against the saved state's."""
    violations: list[Violation] = []
    missing = sorted(set(flat) - set(saved))
    extra = sorted(set(saved) - set(flat))
    for what, keys in (("not saved", missing), ("saved but not in the state", extra)):
        if keys:
            shown = ", ".join(quote(k) for k in keys[:_SHOWN])
            more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
            message = f"{len(keys)} key(s) {what}: {shown}{more}"
            violations.append(Violation("STATE_KEYS_DIFFER", DCP_METADATA, message))
    shapes: list[str] = []
    dtypes: list[str] = []
    for key in sorted(set(flat) & set(saved)):
        value, stored = flat[key], saved[key]
        if isinstance(value, torch.Tensor) != isinstance(stored, TensorStorageMetadata):
            shapes.append(f"{quote(key)} (a tensor and a non-tensor)")
        elif isinstance(value, torch.Tensor) and isinstance(stored, TensorStorageMetadata):
            if tuple(value.shape) != tuple(stored.size):
                shapes.append(f"{quote(key)} {list(stored.size)} saved, {list(value.shape)} here")
            if value.dtype != stored.properties.dtype:
                dtypes.append(f"{quote(key)} {stored.properties.dtype} saved, {value.dtype} here")
    for code, found in (("STATE_SHAPE_MISMATCH", shapes), ("STATE_DTYPE_MISMATCH", dtypes)):
        if found:
            more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
            message = "; ".join(found[:_SHOWN]) + more
            violations.append(Violation(code, DCP_METADATA, message))
    return violations


def load_state_dir(
    path: Path, *, kind_format: str, state: Mapping[str, Any] | None
) -> tuple[StateDirManifest, dict[str, Any]]:
    """Verify the directory, then load its DCP state in place into ``state`` (its
    tensors are copied into; its non-tensor values replaced) and return the
    manifest and the JSON documents by name. Raises StateDirRejected with every
    violation: of the verification, then of keys, shapes and dtypes."""
    root = Path(path)
    manifest, violations = verify_state_dir(
        root, kind_format=kind_format, require_state=state is not None
    )
    if violations or manifest is None:
        raise StateDirRejected(violations)
    if state is not None:
        load_verified_state(root, state)
    return manifest, _documents(root, manifest)


def load_verified_state(
    path: Path, state: Mapping[str, Any], *, others: Callable[[str], bool] | None = None
) -> None:
    """Load a verified directory's DCP state in place into ``state`` (tensors,
    DTensors included, copied into: under torch.distributed every rank calls it
    and DCP reads each rank's shards; non-tensor values replaced). Keys, shapes
    (global ones) and dtypes are checked first: StateDirRejected. ``others``:
    the saved keys that are not this load's to take (another rank's own part)."""
    root = Path(path)
    saved = read_metadata(root).state_dict_metadata
    if others is not None:
        saved = {key: value for key, value in saved.items() if not others(key)}
    differences = _differences_flat(_flat(state), saved)
    if differences:
        raise StateDirRejected(differences)
    target = dict(state)
    load_restricted(target, root, WeightsOnlyPlanner())
    if isinstance(state, dict):
        state.update(target)  # non-tensor values DCP replaced at the top level


def read_state_dir(
    path: Path, *, kind_format: str, into: Mapping[str, Any] | None = None
) -> tuple[StateDirManifest, dict[str, Any], dict[str, Any]]:
    """Verify the directory, then read all of its DCP state as saved: the
    manifest, the state (nested as saved; dict keys come back as strings, as
    DCP stores them) and the documents. ``into``: top-level parts to load in
    place (a model's ``state_dict()``: its tensors are copied into, no second
    copy); their keys, shapes and dtypes must match the saved part's, every
    difference refused before anything is read (StateDirRejected)."""
    root = Path(path)
    manifest, violations = verify_state_dir(root, kind_format=kind_format)
    if violations or manifest is None:
        raise StateDirRejected(violations)
    return read_verified_state_dir(root, manifest, into=into)


def read_verified_state_dir(
    path: Path, manifest: StateDirManifest, *, into: Mapping[str, Any] | None = None
) -> tuple[StateDirManifest, dict[str, Any], dict[str, Any]]:
    """:func:`read_state_dir` for a caller that has just verified ``path`` itself
    (``verify_state_dir``, or a kind's verifier built on it, which returned
    ``manifest`` without a violation): the files are not hashed a second time.
    The metadata is still read restricted and every object weights-only."""
    root = Path(path)
    metadata = read_metadata(root)
    given = _flat(into) if into else {}
    parts = set(into or ())
    saved = metadata.state_dict_metadata
    inside = {k: v for k, v in saved.items() if _top(metadata, k) in parts}
    differences = _differences_flat(given, inside)
    if differences:
        raise StateDirRejected(differences)
    template: dict[str, Any] = {}
    for key, stored in saved.items():
        if key in given:
            template[key] = given[key]
        elif isinstance(stored, TensorStorageMetadata):
            template[key] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
        else:
            template[key] = None
    planner = WeightsOnlyPlanner(flatten_state_dict=False)
    load_restricted(template, root, planner)
    loaded: dict[str, Any] = planner.state_dict  # DCP's copy of the flat dict, values set
    return manifest, _nested(metadata, loaded), _documents(root, manifest)


@dataclass(frozen=True)
class StateOutline:
    """A verified directory's state before its tensors are read: DCP's metadata
    (read restricted), every non-tensor value (read weights-only) by DCP's flat
    key, the documents, and where each tensor record's elements lie. Making it
    changes nothing the caller holds."""

    root: Path
    metadata: Metadata
    values: Mapping[str, Any] = field(repr=False)
    documents: Mapping[str, Any] = field(repr=False)
    places: RecordPlaces = field(repr=False)  # where each tensor record's elements lie

    def saved(self) -> dict[str, Any]:
        """The state as saved, nested, each tensor a meta tensor of its saved
        shape and dtype (nothing read): what a load is checked against."""
        flat = {
            key: torch.empty(tuple(stored.size), dtype=stored.properties.dtype, device="meta")
            if isinstance(stored, TensorStorageMetadata)
            else self.values[key]
            for key, stored in self.metadata.state_dict_metadata.items()
        }
        return _nested(self.metadata, flat)

    def read(self, into: Mapping[str, Any]) -> dict[str, Any]:
        """Every tensor read, nested as saved: straight into the tensor of
        ``into`` (a state dict of the same structure, a model's and an
        optimizer's, say) at its key when that is a CPU tensor of the saved
        shape and dtype, else into a new one. Only the tensors of ``into`` that
        are returned change; a record that cannot be read changes none
        (StateDirRejected)."""
        live = _flat(into)
        targets: dict[str, Any] = {}
        template: dict[str, Any] = {}  # what DCP reads, planned
        direct: list[tuple[torch.Tensor, Any]] = []  # a whole record into its tensor: no planning
        for key, stored in self.metadata.state_dict_metadata.items():
            if not isinstance(stored, TensorStorageMetadata):
                continue
            here = live.get(key)
            size, dtype = tuple(stored.size), stored.properties.dtype
            if (
                isinstance(here, torch.Tensor)
                and here.device.type == "cpu"
                and (tuple(here.shape), here.dtype) == (size, dtype)
            ):
                target = here  # itself: a restore from it copies nothing
            else:
                target = torch.empty(size, dtype=dtype)
            targets[key] = target
            place = self.places.whole(key, target.detach())
            if place is not None:
                direct.append((target.detach(), place))
            else:
                template[key] = target
        if template:  # first: a record of DCP's way that fails leaves every target as it was
            planner = WeightsOnlyPlanner(flatten_state_dict=False)
            load_restricted(template, self.root, planner, self.places)
        read_places(self.root, direct)
        return _nested(self.metadata, {**self.values, **targets})


def outline_verified_state_dir(path: Path, manifest: StateDirManifest) -> StateOutline:
    """The outline of a directory the caller has just verified (its tensors are
    read by :meth:`StateOutline.read`)."""
    root = Path(path)
    metadata = read_metadata(root)
    values: dict[str, Any] = {
        key: None
        for key, stored in metadata.state_dict_metadata.items()
        if not isinstance(stored, TensorStorageMetadata)
    }
    if values:
        planner = WeightsOnlyPlanner(flatten_state_dict=False)
        load_restricted(values, root, planner)
        values = dict(planner.state_dict)
    places = record_places(root, metadata)
    return StateOutline(root, metadata, values, _documents(root, manifest), places)


def _nested(metadata: Metadata, flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        set_element(nested, _path(metadata, key), value)
    return nested


def _top(metadata: Metadata, key: str) -> str:
    return str(_path(metadata, key)[0])


def _path(metadata: Metadata, key: str) -> tuple[Any, ...]:
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    found = mappings.get(key)
    return tuple(found) if isinstance(found, tuple | list) and found else (key,)


def _documents(root: Path, manifest: StateDirManifest) -> dict[str, Any]:
    return {
        name.removesuffix(".json"): read_document(root, name.removesuffix(".json"))
        for name in manifest.files
        if "/" not in name and name.endswith(".json")
    }


def rank_documents(path: Path, manifest: StateDirManifest, rank: int) -> dict[str, Any]:
    """The JSON documents ``rank`` wrote into a directory every rank wrote."""
    folder = f"{rank_member(rank)}/"
    return {
        name.removeprefix(folder).removesuffix(".json"): read_document(
            Path(path), name.removesuffix(".json")
        )
        for name in manifest.files
        if name.startswith(folder) and name.endswith(".json")
    }


# The tagged JSON form of non-tensor state: exact, and read back with no pickle.
_TAG = "$"


def encode_value(value: Any, where: str = "$") -> Any:
    """``value`` as JSON that :func:`decode_value` reads back exactly: tensors and
    numpy arrays as dtype, shape and base64 bytes; tuples, dicts with keys that
    are not plain strings, integers past 2^53 and non-finite floats tagged.
    Raises TypeError naming the path of a value it cannot represent."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if abs(value) <= 2**53 - 1 else {_TAG: "int", "v": str(value)}
    if isinstance(value, float):
        if math.isfinite(value) and not (value == 0.0 and math.copysign(1.0, value) < 0):
            return value
        return {_TAG: "float", "v": repr(value)}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    if isinstance(value, np.ndarray):
        return {
            _TAG: "ndarray",
            "dtype": value.dtype.str,
            "shape": list(value.shape),
            "b64": base64.b64encode(np.ascontiguousarray(value).tobytes()).decode(),
        }
    if isinstance(value, np.generic):
        return encode_value(value.item(), where)
    if isinstance(value, list):
        return [encode_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "v": [encode_value(x, f"{where}[{i}]") for i, x in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith(_TAG) for k in value):
            return {k: encode_value(v, f"{where}.{k}") for k, v in value.items()}
        return {
            _TAG: "dict",
            "v": [
                [encode_value(k, where), encode_value(v, f"{where}.{k}")] for k, v in value.items()
            ],
        }
    raise TypeError(f"{where}: a {type(value).__name__} cannot be recorded exactly as JSON")


def _encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {
        _TAG: "tensor",
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "b64": base64.b64encode(data).decode(),
    }


def decode_value(value: Any) -> Any:
    """What :func:`encode_value` encoded."""
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag is None:
        return {k: decode_value(v) for k, v in value.items()}
    if tag == "int":
        return int(value["v"])
    if tag == "float":
        return float(value["v"])
    if tag == "tuple":
        return tuple(decode_value(item) for item in value["v"])
    if tag == "dict":
        return {decode_value(k): decode_value(v) for k, v in value["v"]}
    if tag == "ndarray":
        raw = base64.b64decode(value["b64"], validate=True)
        array = np.frombuffer(raw, dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        return array.copy()
    if tag == "tensor":
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {quote(value['dtype'])}")
        data = bytearray(base64.b64decode(value["b64"], validate=True))
        shape = [int(n) for n in value["shape"]]
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape).clone()
    raise ValueError(f"unknown tag {quote(tag)}")
