"""How a verified state directory's DCP files are read: the metadata pickle
through an unpickler that resolves only DCP's own records, every stored
object ``weights_only``, and each tensor record's bytes read straight into the
tensor it restores.

DCP's own ``FileSystemReader`` unpickles the metadata freely and reads each
tensor with ``torch.load`` into a new tensor, then copies that into the target:
two copies and the weights-only unpickler per tensor. A record that holds
exactly its target's elements in order (``torch.save`` of a contiguous chunk,
which is what DCP writes for every plain tensor) is instead read with one
``preadv`` into the target's memory, on two threads: on a 253 MiB model and
Adam state, about a quarter of DCP's read. Every other record takes DCP's own
path. Every record is parsed, and every one of DCP's path loaded, before any
target is written, so a record that does not parse changes nothing.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from nanrunbook.capture._state_manifest import (
    DCP_METADATA,
    METADATA_GLOBALS,
    STATE_SUBDIR,
    StateDirRejected,
)
from nanrunbook.errors import Violation, quote

__all__ = [
    "RecordPlaces",
    "WeightsOnlyPlanner",
    "distributed",
    "load_restricted",
    "read_metadata",
    "read_places",
    "record_places",
    "single_process_quiet",
]

_SHOWN = 4  # refusals named in one violation
_READ_THREADS = 2  # the in-place reads: two cores


def distributed() -> bool:
    """This process is in a process group: DCP saves and loads collectively."""
    return bool(dist.is_available() and dist.is_initialized())


@contextmanager
def single_process_quiet() -> Iterator[None]:
    # DCP warns on every single-process save and load that it assumes one process.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


class _OpenFiles:
    """Each file of a state directory's DCP folder opened once, unbuffered,
    and closed with ``stack``."""

    def __init__(self, root: Path, stack: ExitStack) -> None:
        self._folder, self._stack = Path(root) / STATE_SUBDIR, stack
        self._open: dict[str, Any] = {}

    def __call__(self, relative: str) -> Any:
        if relative not in self._open:
            path = self._folder / relative
            handle = open(path, "rb", buffering=0)  # noqa: SIM115  # closed by the stack
            self._open[relative] = self._stack.enter_context(handle)
        return self._open[relative]


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only :data:`METADATA_GLOBALS`; anything else is refused unrun."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"refused global {module}.{name}")
        found = super().find_class(module, name)
        if module == "torch" and name != "Size":
            constant = (torch.dtype, torch.layout, torch.memory_format)
            if not isinstance(found, constant):
                raise pickle.UnpicklingError(f"refused global {module}.{name}")
        return found


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of a state directory through the restricted unpickler;
    raises StateDirRejected (STATE_METADATA_REFUSED) on anything else."""
    try:
        with open(Path(path) / DCP_METADATA, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as error:
        raise StateDirRejected(
            [Violation("STATE_METADATA_REFUSED", DCP_METADATA, f"{quote(error)}: not loaded")]
        ) from None
    except OSError as error:
        raise StateDirRejected(
            [Violation("STATE_FILE_UNREADABLE", DCP_METADATA, str(error.strerror))]
        ) from None
    if not isinstance(metadata, Metadata):
        message = "the pickle is not DCP's Metadata record"
        raise StateDirRejected([Violation("STATE_METADATA_REFUSED", DCP_METADATA, message)])
    return metadata


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype | None  # None: an untyped storage (the tensor names its dtype)
    key: str
    location: str
    numel: int  # elements of ``dtype``; bytes for an untyped storage


@dataclass(frozen=True)
class _Rebuilt:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> _Rebuilt:
    if not isinstance(storage, _Storage) or storage.dtype is None:
        raise pickle.UnpicklingError("not a typed storage")
    return _Rebuilt(storage, int(offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, _grad: Any, _hooks: Any, dtype: Any, *_: Any
) -> _Rebuilt:
    if not isinstance(storage, _Storage) or not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError("not an untyped storage and a dtype")
    return _Rebuilt(storage, int(offset), tuple(size), tuple(stride), dtype)


class _UntypedMark:
    """``torch.storage.UntypedStorage`` as a tensor record names it."""


class _RecordUnpickler(pickle.Unpickler):
    """A tensor record's ``data.pkl`` read for its layout alone: which storage,
    at what offset, with what size, stride and dtype. Its globals are mapped to
    recorders (nothing of torch's runs); any other global is refused, and the
    record then goes DCP's own way (``torch.load``, weights-only)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _UntypedMark
        if module == "torch":
            found = getattr(torch, name, None)
            if isinstance(found, torch.dtype):
                return found
            if name.endswith("Storage"):
                return _storage_dtype(name)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("not a storage")
        kind, key, location, numel = pid[1:]
        dtype = None if kind is _UntypedMark else kind
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("not a storage type")
        return _Storage(dtype, str(key), str(location), int(numel))


def _storage_dtype(name: str) -> torch.dtype:
    try:
        return cast(torch.dtype, torch.storage._get_dtype_from_pickle_storage_type(name))
    except (KeyError, AttributeError) as error:
        raise pickle.UnpicklingError(name) from error


@dataclass(frozen=True)
class _Place:
    """Where a plain tensor record's elements are, in its file."""

    path: str  # the file, relative to the state's folder
    offset: int  # from the file's start
    nbytes: int
    size: tuple[int, ...]
    dtype: torch.dtype


def _file_view(handle: Any, offset: int, length: int) -> IO[bytes]:
    return cast(IO[bytes], _create_file_view(handle, offset, length))


def _contiguous_stride(size: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for extent in reversed(size):
        stride.append(running)
        running *= max(extent, 1)
    return tuple(reversed(stride))


class _Archive(Protocol):
    """What a tensor record's place is read from: its members' bytes and spans."""

    def names(self) -> set[str]: ...
    def read(self, name: str) -> bytes: ...
    def span(self, name: str) -> tuple[int, int]: ...  # (offset in the record, size)


class _TorchArchive:
    """torch's own zip reader over the record (any zip torch.save writes)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        self._zip = torch._C.PyTorchFileReader(_file_view(handle, offset, length))

    def names(self) -> set[str]:
        return set(self._zip.get_all_records())

    def read(self, name: str) -> bytes:
        return self._zip.get_record(name)

    def span(self, name: str) -> tuple[int, int]:
        start = self._zip.get_record_offset(name)  # type: ignore[attr-defined]  # not in torch's stubs
        return int(start), int(self._zip.get_record_size(name))


_EOCD = struct.Struct("<4sHHHHIIH")  # the end of central directory record
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # a central directory entry
_LOCAL = struct.Struct("<4sHHHHHIIIHH")  # a member's local header
_TAIL = 4096  # the central directory of a torch.save record fits in it
_PICKLE_MAX = 1 << 16  # a tensor record's data.pkl is about 160 bytes


class _StoredZip:
    """A zip whose members are all stored (torch.save's), read from its
    central directory: the record's first and last 4 KiB hold it, the small
    members and the local headers, so two ``pread`` calls find a place where
    torch's reader, reading through Python file calls, takes five times as
    long. :meth:`of` answers None for anything else (zip64 sizes, compression,
    a comment, an inconsistent header), which torch's reader then reads."""

    def __init__(self, members: Mapping[str, tuple[int, int]], bytes_at: Any) -> None:
        self._members, self._bytes_at = members, bytes_at

    @classmethod
    def of(cls, fd: int, offset: int, length: int) -> _StoredZip | None:
        head = os.pread(fd, min(length, _TAIL), offset)
        tail_start = max(0, length - _TAIL)
        tail = os.pread(fd, length - tail_start, offset + tail_start)
        if len(head) != min(length, _TAIL) or len(tail) != length - tail_start:
            return None

        def bytes_at(at: int, count: int) -> bytes:  # within the record
            if at + count <= len(head):
                return head[at : at + count]
            if at >= tail_start:
                return tail[at - tail_start : at - tail_start + count]
            return os.pread(fd, count, offset + at)

        if length < _EOCD.size:
            return None
        sig, disk, cd_disk, here, total, cd_size, cd_offset, comment = _EOCD.unpack(
            bytes_at(length - _EOCD.size, _EOCD.size)
        )
        if sig != b"PK\x05\x06" or comment or disk or cd_disk or here != total:
            return None
        if 0xFFFFFFFF in (cd_size, cd_offset) or cd_offset + cd_size > length - _EOCD.size:
            return None
        central = bytes_at(cd_offset, cd_size)
        members: dict[str, tuple[int, int]] = {}
        at = 0
        for _ in range(total):
            if at + _CENTRAL.size > len(central):
                return None
            entry = _CENTRAL.unpack_from(central, at)
            sig, method, packed, size, local = entry[0], entry[4], entry[8], entry[9], entry[16]
            name_end = at + _CENTRAL.size + entry[10]
            name = central[at + _CENTRAL.size : name_end]
            at = name_end + entry[11] + entry[12]
            if sig != b"PK\x01\x02" or method != 0 or packed != size or 0xFFFFFFFF in (size, local):
                return None
            if local + _LOCAL.size > cd_offset:
                return None
            fields = _LOCAL.unpack(bytes_at(local, _LOCAL.size))
            if fields[0] != b"PK\x03\x04" or fields[3] != 0:
                return None
            start = local + _LOCAL.size + fields[9] + fields[10]
            if start + size > cd_offset:
                return None
            members[name.decode("utf-8", "replace")] = (start, size)
        # torch's reader names members without the archive's one folder: so do we
        folders = {name.partition("/")[0] for name in members}
        if len(folders) != 1 or any("/" not in name for name in members):
            return None
        spans = {name.partition("/")[2]: span for name, span in members.items()}
        return cls(spans, bytes_at)

    def names(self) -> set[str]:
        return set(self._members)

    def read(self, name: str) -> bytes:
        start, size = self._members[name]
        return cast(bytes, self._bytes_at(start, size))

    def span(self, name: str) -> tuple[int, int]:
        return self._members[name]


def _place(handle: Any, path: str, offset: int, length: int) -> _Place | None:
    """The elements of the ``torch.save`` record at ``offset``, ``length`` in
    ``handle``: where they lie, when the record holds one contiguous tensor of
    a whole little-endian CPU storage; else None (read DCP's way)."""
    try:
        archive: _Archive | None = _StoredZip.of(handle.fileno(), offset, length)
        if archive is None:
            archive = _TorchArchive(handle, offset, length)
        names = archive.names()
        if "byteorder" not in names or archive.read("byteorder") != b"little":
            return None
        if "data.pkl" not in names or archive.span("data.pkl")[1] > _PICKLE_MAX:
            return None
        rebuilt = _RecordUnpickler(io.BytesIO(archive.read("data.pkl"))).load()
        if not isinstance(rebuilt, _Rebuilt):
            return None
        storage, size = rebuilt.storage, rebuilt.size
        numel = math.prod(size)
        itemsize = rebuilt.dtype.itemsize
        stored = storage.numel if storage.dtype is not None else storage.numel // itemsize
        if (
            rebuilt.offset != 0
            or stored != numel
            or (storage.dtype is not None and storage.dtype != rebuilt.dtype)
            or storage.location != "cpu"
            or (numel > 1 and rebuilt.stride != _contiguous_stride(size))
        ):
            return None
        data = f"data/{storage.key}"
        if data not in names:
            return None
        start, recorded = archive.span(data)
        nbytes = numel * itemsize
        if recorded != nbytes or start < 0 or start + nbytes > length:
            return None
        return _Place(path, offset + start, nbytes, size, rebuilt.dtype)
    except (
        pickle.UnpicklingError,
        struct.error,
        RuntimeError,
        ValueError,
        TypeError,
        EOFError,
        OSError,
    ):
        return None
    except MemoryError:  # a damaged pickle's length asks for more than there is
        return None


def _place_of(handle: Any, info: Any) -> _Place | None:
    if info.transform_descriptors:  # compressed, say: DCP's own way
        return None
    return _place(handle, info.relative_path, info.offset, info.length)


@dataclass(frozen=True)
class RecordPlaces:
    """Where each tensor record's elements lie (None: read DCP's way), found
    ahead of the read: :func:`record_places`."""

    found: Mapping[Any, _Place | None]  # by DCP's storage index
    records: Mapping[str, int]  # how many records each tensor key has

    def whole(self, key: str, target: torch.Tensor) -> _Place | None:
        """The place of ``key``'s one record when it holds the whole tensor
        and ``target`` can take its bytes as they lie: read without DCP's
        planning (:func:`read_places`)."""
        if self.records.get(key) != 1:
            return None
        zeros = torch.Size([0] * target.dim())
        place = self.found.get(MetadataIndex(key, zeros, 0))
        if place is None or not _takes(place, target):
            return None
        return place


def record_places(root: Path, metadata: Metadata) -> RecordPlaces:
    """Every tensor record of a state directory parsed for where its elements
    lie (a caller parses them while the files are still being hashed; the read
    then only reads). Nothing is written."""
    tensors = {
        key for key, stored in metadata.state_dict_metadata.items()
        if isinstance(stored, TensorStorageMetadata)
    }  # fmt: skip
    found: dict[Any, _Place | None] = {}
    with ExitStack() as stack:
        files = _OpenFiles(root, stack)
        for index, info in (metadata.storage_data or {}).items():
            if index.fqn in tensors:
                found[index] = _place_of(files(info.relative_path), info)
    return RecordPlaces(found, Counter(index.fqn for index in found))


def read_places(root: Path, reads: Sequence[tuple[torch.Tensor, _Place]]) -> None:
    """Each place's bytes into its tensor, largest first on two threads. The
    bytes were verified a moment ago: a failure is the disk's, and the state
    is then partly read (STATE_READ_INTERRUPTED)."""
    try:
        with ExitStack() as stack:
            files = _OpenFiles(root, stack)
            fds = {place.path: files(place.path).fileno() for _, place in reads}
            largest_first = sorted(reads, key=lambda each: -each[1].nbytes)
            with ThreadPoolExecutor(_READ_THREADS) as pool:
                list(
                    pool.map(
                        lambda each: _read_exactly(each[0], fds[each[1].path], each[1]),
                        largest_first,
                    )
                )
    except OSError as error:
        message = f"{error}: the state is partly the directory's; do not go on from it"
        raise StateDirRejected(
            [Violation("STATE_READ_INTERRUPTED", STATE_SUBDIR, message)]
        ) from None


def _read_exactly(target: torch.Tensor, fd: int, place: _Place) -> None:
    offset, nbytes = place.offset, place.nbytes
    view = target.reshape(-1).view(torch.uint8).numpy().data.cast("B")
    done = 0
    while done < nbytes:  # preadv may return less (a signal, 2 GiB a call)
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise OSError(f"the file ended {nbytes - done} bytes early")
        done += count


class RestrictedReader(FileSystemReader):
    """DCP's file reader with the restricted metadata read and the in-place
    tensor read (the module's docstring)."""

    def __init__(self, root: Path, places: RecordPlaces | None = None) -> None:
        super().__init__(root / STATE_SUBDIR)
        self._root = root
        self._places = places

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self._root)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        values = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if values:  # they replace a dict's values: no tensor's memory is written
            super().read_data(LoadPlan(values), planner).wait()
        tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        direct: list[tuple[torch.Tensor, _Place]] = []
        held: list[tuple[torch.Tensor, torch.Tensor]] = []
        targets: list[tuple[ReadItem, torch.Tensor]] = []
        with ExitStack() as stack:
            files = _OpenFiles(self._root, stack)
            for item in tensors:
                info = self.storage_data[item.storage_index]
                handle = files(info.relative_path)
                target = planner.resolve_tensor(item).detach()
                targets.append((item, target))
                if self._places is not None and item.storage_index in self._places.found:
                    place = self._places.found[item.storage_index]
                else:
                    place = _place_of(handle, info)
                if place is not None and _fits(place, item, target):
                    direct.append((target, place))
                else:
                    held.append((target, self._load_record(handle, item, info, target)))
        # Every record parsed and every other one loaded: only now is a target
        # written.
        read_places(self._root, direct)
        for target, loaded in held:
            target.copy_(loaded)
        for item, target in targets:
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _load_record(
        self, handle: Any, item: ReadItem, info: Any, target: torch.Tensor
    ) -> torch.Tensor:
        """One record DCP's way (its stream transforms, ``torch.load``
        weights-only, the read's narrowing), into a tensor of its own."""
        stream = self.transforms.transform_load_stream(
            item,
            info.transform_descriptors or (),
            _file_view(handle, info.offset, info.length),
        )
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        loaded = torch.load(seekable, map_location="cpu", weights_only=True)
        loaded = narrow_tensor_by_index(loaded, item.storage_offsets, item.lengths)
        if target.size() != loaded.size():
            raise ValueError(
                f"{item.storage_index.fqn}: {list(loaded.size())} read, {list(target.size())} wanted"
            )
        return loaded


def _fits(place: _Place, item: ReadItem, target: torch.Tensor) -> bool:
    """The read takes the whole record into a target of its layout."""
    whole = all(offset == 0 for offset in item.storage_offsets)
    return whole and tuple(item.lengths) == place.size and _takes(place, target)


def _takes(place: _Place, target: torch.Tensor) -> bool:
    """``target`` holds the record's elements as they lie in the file."""
    return (
        tuple(target.shape) == place.size
        and target.dtype == place.dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
    )


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading stored non-tensor values ``weights_only``
    (DCP's own unpickles them freely)."""

    refused: list[str]

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as error:
            if not hasattr(self, "refused"):
                self.refused = []
            self.refused.append(f"{quote(read_item.dest_index.fqn)}: {_first_line(error)}")
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    found = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else "")
    return found[:200] or type(error).__name__


def load_restricted(
    template: dict[str, Any],
    root: Path,
    planner: WeightsOnlyPlanner,
    places: RecordPlaces | None = None,
) -> None:
    """DCP's load of ``template`` through the restricted reader and planner;
    whatever DCP cannot read (an object weights_only refuses, a file that does
    not hold what the metadata says) is refused, named, never a traceback."""
    try:
        with single_process_quiet():
            dcp_load(
                template,
                storage_reader=RestrictedReader(root, places),
                planner=planner,
                no_dist=not distributed(),
            )
    except StateDirRejected:
        raise
    except (Exception, CheckpointException) as error:  # DCP wraps each rank's failure
        if isinstance(error, CheckpointException):
            for failure, _ in error.failures.values():
                if isinstance(failure, StateDirRejected):  # this reader's own: named already
                    raise failure from None
        found: Sequence[str] = getattr(planner, "refused", [])
        message = "; ".join(found[:_SHOWN]) if found else _first_line(error)
        raise StateDirRejected(
            [Violation("STATE_DATA_REFUSED", STATE_SUBDIR, f"not loaded: {message}")]
        ) from None
