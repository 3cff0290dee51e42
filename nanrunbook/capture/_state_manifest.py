"""A state directory's manifest and its verification, torch-free.

A state directory (a recovery point, an incident capsule) is training state
written through torch.distributed.checkpoint plus JSON documents, with a JSON
manifest of every file's SHA-256 and size written last. Verifying one hashes
files and reads JSON: it never unpickles and never imports torch, so
``verify-recovery`` starts as fast as ``check``. Writing and loading live in
``capture/torch/_state_dir.py``, which re-exports these names.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pickletools
import re
import stat
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import orjson

from nanrunbook import strictjson
from nanrunbook.access import file_where
from nanrunbook.codes import STATE_DIRECTORY_CODES as CODES
from nanrunbook.errors import EvidenceRejected, Violation, quote

__all__ = [
    "CODES",
    "DCP_METADATA",
    "FORMATS",
    "MANIFEST_NAME",
    "METADATA_GLOBALS",
    "RANKS_KEY",
    "STATE_SUBDIR",
    "FileDigest",
    "StateDirManifest",
    "StateDirRejected",
    "manifest_document",
    "metadata_globals_refused",
    "read_document",
    "verify_state_dir",
    "verify_state_dir_reading",
]

MANIFEST_NAME = "manifest.json"
STATE_SUBDIR = "state"  # DCP's files go below it
DCP_METADATA = f"{STATE_SUBDIR}/.metadata"  # DCP's global metadata (a pickle)
# The header key of a directory every rank of a job wrote into: each rank's
# files, by rank ("0", "1", ...); its number of entries is the world size.
RANKS_KEY = "ranks"
_MANIFEST_MAX_BYTES = 16 * 1024 * 1024
_CHUNK = 1 << 20

FORMATS = MappingProxyType(
    {
        "capsule": "nanrunbook-capsule-v1",
        "recovery_point": "nanrunbook-recovery-point-v1",
    }
)


# The only globals DCP's metadata pickle may name (torch 2.13 writes these):
# its own metadata records, torch.Size, dtypes, layouts and memory formats by
# name, and the checkpoint id's path. Anything else is refused unread.
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_TORCH_CONSTANTS = frozenset(
    {
        *(
            f"{kind}{bits}"
            for kind in ("float", "int", "uint", "complex")
            for bits in (8, 16, 32, 64, 128)
        ),
        "bfloat16", "bool", "half", "double", "long", "short", "cfloat", "cdouble",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2", "qint8", "quint8", "qint32",
        "strided", "sparse_coo", "sparse_csr",
        "contiguous_format", "channels_last", "channels_last_3d", "preserve_format",
    }
)  # fmt: skip
METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA_MODULE, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "ChunkStorageMetadata",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13 names its module so
        ("collections", "OrderedDict"),
        *(("torch", name) for name in _TORCH_CONSTANTS),
    }
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
# Files are hashed on this many threads at once (hashlib releases the GIL):
# DCP writes a large state as two files, one per core.
HASH_THREADS = 2

Progress = Callable[[int], None]
_Read = TypeVar("_Read")


@dataclass(frozen=True, slots=True)
class FileDigest:
    """One listed file: its SHA-256 (lowercase hex) and size in bytes."""

    sha256: str
    size: int


@dataclass(frozen=True)
class StateDirManifest:
    """What a state directory's manifest.json says."""

    format: str
    files: Mapping[str, FileDigest]
    header: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(digest.size for digest in self.files.values())


class StateDirRejected(EvidenceRejected):
    """A state directory that is not what it must be: ``violations`` lists every
    reason found (exit 3, as rejected evidence)."""

    code = "STATE_DIR_REJECTED"

    @property
    def message(self) -> str:
        return f"state directory rejected: {self.summary}"

    def lines(self) -> list[str]:
        """One line per violation."""
        return [str(violation) for violation in self.violations]


def manifest_document(manifest: StateDirManifest) -> bytes:
    """manifest.json's bytes: sorted keys, so one state writes one manifest."""
    document = {
        "format": manifest.format,
        "files": {
            name: {"sha256": digest.sha256, "size": digest.size}
            for name, digest in sorted(manifest.files.items())
        },
        "header": dict(manifest.header),
    }
    return orjson.dumps(document, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def _unsafe_path(name: str) -> str | None:
    """Why a listed path is unsafe, or None. Stricter than a bundle's: one
    spelling per file ('.' and empty components refused), so the listing can be
    compared with what is on disk name for name."""
    if name == "":
        return "the path is empty"
    if name.startswith("/"):
        return "the path is absolute"
    if "\\" in name or "\x00" in name:
        return "the path contains a backslash or a NUL"
    parts = name.split("/")
    if ".." in parts:
        return "the path has a '..' component"
    if "." in parts or "" in parts:
        return "the path has a '.' or an empty component"
    return None


def _parse_manifest(
    raw: bytes, kind_format: str
) -> tuple[StateDirManifest | None, list[Violation]]:
    where = MANIFEST_NAME
    try:
        value = strictjson.load_manifest_bytes(raw)
    except EvidenceRejected as error:
        return None, [
            Violation(
                "STATE_MANIFEST_INVALID",
                where,
                v.message if v.where in ("$", where) else f"{v.where}: {v.message}",
            )
            for v in error.violations
        ]
    found = value.get("format")
    if found != kind_format:
        shown = quote(found) if isinstance(found, str) else "none"
        message = f"format {shown}, expected {kind_format!r}"
        return None, [Violation("STATE_FORMAT_UNKNOWN", where, message)]
    files, header = value.get("files"), value.get("header", {})
    if not isinstance(files, dict) or not isinstance(header, dict):
        message = "'files' and 'header' must be JSON objects"
        return None, [Violation("STATE_MANIFEST_INVALID", where, message)]
    violations: list[Violation] = []
    digests: dict[str, FileDigest] = {}
    for name, entry in files.items():
        shown = file_where(name)
        reason = _unsafe_path(name)
        if reason is not None:
            violations.append(Violation("STATE_PATH_UNSAFE", shown, reason))
            continue
        sha = entry.get("sha256") if isinstance(entry, dict) else None
        size = entry.get("size") if isinstance(entry, dict) else None
        if not (isinstance(sha, str) and _SHA256.fullmatch(sha)) or not (
            isinstance(size, int) and not isinstance(size, bool) and size >= 0
        ):
            message = "a file entry needs sha256 (64 lowercase hex) and size (bytes)"
            violations.append(Violation("STATE_MANIFEST_INVALID", shown, message))
            continue
        digests[name] = FileDigest(sha, size)
    return StateDirManifest(found, MappingProxyType(digests), MappingProxyType(header)), violations


def _read_manifest(root: Path) -> tuple[bytes | None, Violation | None]:
    path = root / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        message = "no manifest.json: an incomplete directory (its writer did not finish)"
        return None, Violation("STATE_MANIFEST_MISSING", MANIFEST_NAME, message)
    except OSError as error:
        return None, Violation("STATE_MANIFEST_INVALID", MANIFEST_NAME, _reason(error))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MANIFEST_MAX_BYTES:
            message = "not a regular file of at most 16 MiB"
            return None, Violation("STATE_MANIFEST_INVALID", MANIFEST_NAME, message)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(_MANIFEST_MAX_BYTES + 1), None
    finally:
        os.close(fd)


def _reason(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else type(error).__name__


def _on_disk(root: Path) -> tuple[dict[str, os.stat_result], list[Violation]]:
    """Every entry below ``root`` by relative posix path (symlinks not followed),
    and a violation for each symlink, each special file, each unreadable folder."""
    found: dict[str, os.stat_result] = {}
    violations: list[Violation] = []

    def walk(directory: Path, prefix: str) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda entry: entry.name)
        except OSError as error:
            where = file_where(prefix.rstrip("/") or ".")
            violations.append(Violation("STATE_FILE_UNREADABLE", where, _reason(error)))
            return
        for entry in entries:
            name = prefix + entry.name
            info = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                walk(Path(entry.path), name + "/")
            else:
                found[name] = info

    walk(root, "")
    return found, violations


def _digest(root: Path, name: str, progress: Progress | None) -> tuple[str, int] | Violation:
    where = file_where(name)
    try:
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            return Violation("STATE_FILE_SYMLINK", where, "the file is a symlink")
        return Violation("STATE_FILE_UNREADABLE", where, _reason(error))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return Violation("STATE_FILE_NOT_REGULAR", where, "not a regular file")
        hasher = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as handle:
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            while count := handle.readinto(buffer):
                hasher.update(view[:count])
                size += count
                if progress is not None:
                    progress(count)
        return hasher.hexdigest(), size
    except OSError as error:
        return Violation("STATE_FILE_UNREADABLE", where, _reason(error))
    finally:
        os.close(fd)


def verify_state_dir(
    path: Path, *, kind_format: str, progress: Any = None, require_state: bool = True
) -> tuple[StateDirManifest | None, tuple[Violation, ...]]:
    """Verify a state directory: every violation, never the first only.

    Reads manifest.json (strict JSON, the kind's format), then every file on
    disk against it: each listed file present, a regular file reached through
    no symlink, its size and SHA-256 as listed; no unlisted entry; DCP's
    metadata listed (unless ``require_state`` is false and no DCP file is), its
    pickle naming only DCP's own records (read as opcodes). Never unpickles. ``progress``: an object with ``start(total)``
    called once and called with byte counts as files are hashed (``check``'s bar).
    The manifest is returned when it could be parsed, even with violations."""
    manifest, violations, _ = verify_state_dir_reading(
        path, kind_format=kind_format, progress=progress, require_state=require_state
    )
    return manifest, violations


def verify_state_dir_reading(
    path: Path,
    *,
    kind_format: str,
    read: Callable[[StateDirManifest], _Read] | None = None,
    progress: Any = None,
    require_state: bool = True,
    metadata_unpickled: bool = False,
) -> tuple[StateDirManifest | None, tuple[Violation, ...], _Read | None]:
    """:func:`verify_state_dir`, and ``read(manifest)`` run while DCP's data
    files are hashed: only once the manifest, every other file (DCP's metadata
    pickle, the documents) and the listing have verified, so ``read`` sees
    verified metadata and documents and data files whose digests are still
    being taken. Its result is returned only when every digest matched too
    (else None, with the violations); a StateDirRejected it raises becomes its
    violations. ``read`` must change nothing the caller keeps until then: it
    reads into scratch, the caller restores from it after.
    ``metadata_unpickled``: every caller that reads this directory's state
    reads DCP's metadata through the restricted unpickler, which refuses every
    global the opcode scan would (the scan, for a verification that never
    unpickles, then is not run: on a 253 MiB point's 39 KB metadata it took
    17 ms of a core, the restricted unpickling 2 ms)."""
    root = Path(path)
    if not root.is_dir() or root.is_symlink():
        what = "is a symlink" if root.is_symlink() else "is not a directory"
        if not root.exists() and not root.is_symlink():
            what = "does not exist"
        return (
            None,
            (Violation("STATE_DIR_NOT_FOUND", quote(str(root)), f"the path {what}"),),
            None,
        )
    raw, missing = _read_manifest(root)
    if missing is not None or raw is None:
        return None, (missing,) if missing is not None else (), None
    manifest, violations = _parse_manifest(raw, kind_format)
    if manifest is None:
        return None, tuple(violations), None
    violations.extend(_ranks_violations(manifest))
    on_disk, walk_violations = _on_disk(root)
    violations.extend(walk_violations)
    on_disk.pop(MANIFEST_NAME, None)
    has_state = any(name.startswith(f"{STATE_SUBDIR}/") for name in manifest.files)
    if DCP_METADATA not in manifest.files and (require_state or has_state):
        message = "the manifest lists no DCP metadata: not a DCP checkpoint"
        violations.append(Violation("STATE_METADATA_MISSING", DCP_METADATA, message))
    unlisted = [
        Violation(
            "STATE_FILE_UNLISTED",
            file_where(name),
            f"{'a symlink' if stat.S_ISLNK(info.st_mode) else 'an entry'} the manifest does not list",
        )
        for name, info in sorted(on_disk.items())
        if name not in manifest.files
    ]
    if progress is not None and hasattr(progress, "start"):
        progress.start(manifest.total_bytes)
    shared = _locked(progress)
    data = {n for n in manifest.files if n.startswith(f"{STATE_SUBDIR}/") and n != DCP_METADATA}
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        # DCP's data files first, largest first (the threads finish together);
        # the rest (small) checked on this thread meanwhile.
        checks = {
            name: pool.submit(_check_file, root, name, manifest.files[name], on_disk, shared)
            for name in sorted(data, key=lambda name: (-manifest.files[name].size, name))
        }
        found: dict[str, list[Violation]] = {}
        for name in sorted(set(manifest.files) - data):
            found[name] = _check_file(root, name, manifest.files[name], on_disk, shared)
            if name == DCP_METADATA and not found[name] and not metadata_unpickled:
                found[name].extend(_metadata_violations(root))
        result: _Read | None = None
        read_violations: list[Violation] = []
        # The digests are of integrity, not authenticity (whoever rewrites a file
        # can rewrite the manifest): DCP reading a data file as it is hashed,
        # restricted and weights-only, trusts it no more than after.
        if read is not None and not (violations or unlisted or any(found.values())):
            try:
                result = read(manifest)
            except StateDirRejected as error:
                read_violations = list(error.violations)
        found.update((name, check.result()) for name, check in checks.items())
    for name in sorted(manifest.files):
        violations.extend(found[name])
    violations.extend(unlisted)
    if violations:
        return manifest, tuple(violations), None
    if read_violations:
        return manifest, tuple(read_violations), None
    return manifest, (), result


def _locked(progress: Progress | None) -> Progress | None:
    """``progress`` called under a lock: the hashing threads report at once."""
    if progress is None:
        return None
    lock = threading.Lock()

    def report(count: int) -> None:
        with lock:
            progress(count)

    return report


def _ranks_violations(manifest: StateDirManifest) -> list[Violation]:
    """A directory every rank wrote: each rank 0..N-1 lists its files, every
    listed file is one rank's, and no rank lists a file another does."""
    ranks = manifest.header.get(RANKS_KEY)
    if ranks is None:
        return []
    where = f"header.{RANKS_KEY}"
    if not (
        isinstance(ranks, dict)
        and ranks
        and set(ranks) == {str(rank) for rank in range(len(ranks))}
        and all(isinstance(files, list) for files in ranks.values())
    ):
        message = "each rank's files must be listed under its rank, 0 to the world size - 1"
        return [Violation("STATE_RANKS_INVALID", where, message)]
    owned = [name for files in ranks.values() for name in files]
    violations: list[Violation] = []
    twice = sorted({name for name in owned if owned.count(name) > 1})
    unowned = sorted(set(manifest.files) - set(owned))
    unknown = sorted(set(owned) - set(manifest.files))
    for names, what in (
        (twice, "listed by more than one rank"),
        (unowned, "listed by no rank"),
        (unknown, "a rank lists, the manifest does not"),
    ):
        if names:
            shown = ", ".join(quote(str(name)) for name in names[:3])
            message = f"{len(names)} file(s) {what}: {shown}"
            violations.append(Violation("STATE_RANKS_INVALID", where, message))
    return violations


def _metadata_violations(root: Path) -> list[Violation]:
    """DCP's metadata pickle, read as opcodes: refused if it names any global
    outside DCP's own records (a hostile pickle is caught here, unrun)."""
    try:
        raw = (root / DCP_METADATA).read_bytes()
    except OSError as error:
        return [Violation("STATE_FILE_UNREADABLE", DCP_METADATA, _reason(error))]
    refused = metadata_globals_refused(raw)
    if not refused:
        return []
    shown = ", ".join(quote(name) for name in refused[:3])
    more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
    message = f"the pickle names {shown}{more}: refused, never unpickled"
    return [Violation("STATE_METADATA_REFUSED", DCP_METADATA, message)]


def _check_file(
    root: Path,
    name: str,
    expected: FileDigest,
    on_disk: dict[str, os.stat_result],
    progress: Progress | None,
) -> list[Violation]:
    where = file_where(name)
    parts = name.split("/")
    for depth in range(1, len(parts)):
        folder = root.joinpath(*parts[:depth])
        if folder.is_symlink():
            message = f"directory {quote('/'.join(parts[:depth]))} on its path is a symlink"
            return [Violation("STATE_FILE_SYMLINK", where, message)]
    info = on_disk.get(name)
    if info is None:
        if (root / name).is_dir():
            return [Violation("STATE_FILE_NOT_REGULAR", where, "a directory, not a file")]
        return [Violation("STATE_FILE_MISSING", where, "the file does not exist")]
    if stat.S_ISLNK(info.st_mode):
        return [Violation("STATE_FILE_SYMLINK", where, "the file is a symlink")]
    if not stat.S_ISREG(info.st_mode):
        return [Violation("STATE_FILE_NOT_REGULAR", where, "not a regular file")]
    if info.st_size != expected.size:
        message = f"{info.st_size} bytes, the manifest says {expected.size}"
        return [Violation("STATE_FILE_SIZE_MISMATCH", where, message)]
    result = _digest(root, name, progress)
    if isinstance(result, Violation):
        return [result]
    digest, size = result
    if size != expected.size:
        message = f"{size} bytes read, the manifest says {expected.size}"
        return [Violation("STATE_FILE_SIZE_MISMATCH", where, message)]
    if digest != expected.sha256:
        message = f"sha256 {digest[:16]}..., the manifest says {expected.sha256[:16]}..."
        return [Violation("STATE_FILE_DIGEST_MISMATCH", where, message)]
    return []


def read_document(root: Path, name: str) -> Any:
    """A verified directory's JSON document ``<name>.json``, parsed strictly;
    raises StateDirRejected (STATE_DOCUMENT_INVALID)."""
    where = f"{name}.json"
    try:
        raw = (Path(root) / where).read_bytes()
        return strictjson.load_manifest_bytes(raw) if raw.lstrip()[:1] == b"{" else _scalar(raw)
    except EvidenceRejected as error:
        first = error.violations[0]
        raise StateDirRejected(
            [Violation("STATE_DOCUMENT_INVALID", where, first.message)]
        ) from None
    except OSError as error:
        raise StateDirRejected(
            [Violation("STATE_FILE_UNREADABLE", where, _reason(error))]
        ) from None


def _scalar(raw: bytes) -> Any:
    # strictjson reads objects; a document that is a list or a scalar is wrapped.
    return strictjson.load_manifest_bytes(b'{"v":' + raw + b"}")["v"]


_MARK = object()
_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
     "SHORT_BINSTRING"}
)  # fmt: skip
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def metadata_globals_refused(raw: bytes) -> list[str]:
    """The globals a pickle names outside :data:`METADATA_GLOBALS`, read from its
    opcodes without running it (a shadow stack follows the strings that
    STACK_GLOBAL takes, through the memo). A global whose name cannot be known
    statically, or a pickle that does not parse, is refused too."""
    refused: list[str] = []
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(raw):
            name = opcode.name
            if name in _STRING_OPS:
                stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
                continue
            if name in _PUT_OPS:
                memo[int(str(arg))] = stack[-1] if stack else None
                continue
            if name in _GET_OPS:
                stack.append(memo.get(int(str(arg))))
                continue
            if name in ("GLOBAL", "INST"):
                module, _, attribute = str(arg).partition(" ")
                if (module, attribute) not in METADATA_GLOBALS:
                    refused.append(f"{module}.{attribute}")
            elif name == "STACK_GLOBAL":
                top, below = (stack[-1], stack[-2]) if len(stack) >= 2 else (None, None)
                if not (isinstance(below, str) and isinstance(top, str)):
                    refused.append("a global whose name is computed")
                elif (below, top) not in METADATA_GLOBALS:
                    refused.append(f"{below}.{top}")
            elif name in ("EXT1", "EXT2", "EXT4"):
                refused.append("an extension-registry global")
            _shadow(stack, opcode)
    except (ValueError, IndexError, UnicodeDecodeError) as error:
        refused.append(f"an unreadable pickle ({error})")
    return refused


def _shadow(stack: list[Any], opcode: Any) -> None:
    """Pop and push as ``opcode`` does, by pickletools' own stack description."""
    before = opcode.stack_before
    if pickletools.markobject in before:
        while stack and stack[-1] is not _MARK:
            stack.pop()
        if not stack:
            raise ValueError("a mark is missing")
        stack.pop()
        below = before.index(pickletools.markobject)
        if below > len(stack):
            raise ValueError("the stack runs out")
        del stack[len(stack) - below :]
    elif before:
        if len(before) > len(stack):
            raise ValueError("the stack runs out")
        del stack[len(stack) - len(before) :]
    for item in opcode.stack_after:
        stack.append(_MARK if item is pickletools.markobject else None)
