"""Atomic writes: a temporary sibling, fsync, rename. Nothing half-written is ever
seen at the target path, and an existing target is replaced only when asked."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "atomic_directory",
    "atomic_write",
    "copy_range",
    "fsync_directory",
    "publish_directory",
    "write_synced",
    "write_synced_copy",
]


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_RENAMEAT2_ARGS = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)


def _renameat2(source: Path, destination: Path, flags: int) -> bool:
    """Linux renameat2(2): True when done, False when the kernel, the C library or
    the file system lacks it (the caller falls back to plain renames)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    function.argtypes = _RENAMEAT2_ARGS
    function.restype = ctypes.c_int
    if function(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(destination), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(source), None, str(destination))


def write_synced(path: Path, chunks: Iterable[bytes]) -> None:
    """Create ``path`` (it must not exist) with ``chunks``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
        os.fsync(fd)
    finally:
        os.close(fd)


# copy_file_range(2) cannot serve these (another file system, an old kernel, a
# file system without it): the bytes are copied through a small buffer instead.
_NO_COPY_RANGE = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}
)
_COPY_BUFFER = 1 << 20


def copy_range(source: int, offset: int, length: int, destination: int) -> None:
    """Copy ``length`` bytes of the file ``source`` from ``offset`` to the current
    position of ``destination``, in the kernel where it can (no bytes through
    Python), else through a 1 MiB buffer: memory stays bounded whatever the size."""
    done = 0
    if hasattr(os, "copy_file_range"):
        while done < length:
            try:
                copied = os.copy_file_range(source, destination, length - done, offset + done)
            except OSError as error:
                if done or error.errno not in _NO_COPY_RANGE:
                    raise
                break
            if copied == 0:
                raise OSError(errno.EIO, f"the source ended {length - done} bytes early")
            done += copied
    while done < length:
        chunk = os.pread(source, min(_COPY_BUFFER, length - done), offset + done)
        if not chunk:
            raise OSError(errno.EIO, f"the source ended {length - done} bytes early")
        view = memoryview(chunk)
        while view:
            view = view[os.write(destination, view) :]
        done += len(chunk)


def write_synced_copy(path: Path, head: bytes, source: int, offset: int, length: int) -> None:
    """Create ``path`` (it must not exist) with ``head`` then ``length`` bytes of
    the file ``source`` from ``offset``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(head)
        while view:
            view = view[os.write(fd, view) :]
        copy_range(source, offset, length, fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace the file at ``path`` with ``data`` atomically."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.unlink(temp)
    try:
        write_synced(Path(temp), [data])
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


@contextmanager
def atomic_directory(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success move it to
    ``target``. On any exception, Ctrl-C included, the temporary is removed and
    ``target`` is left as it was."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    parent = target.parent
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    try:
        yield temp
        for child in temp.iterdir():
            if child.is_file():
                with open(child, "rb") as handle:
                    os.fsync(handle.fileno())
        fsync_directory(temp)
        if target.exists():
            if not overwrite:
                raise FileExistsError(f"{target} appeared while the bundle was written")
            # One atomic swap where the system has it: no instant without a bundle.
            if _renameat2(temp, target, _RENAME_EXCHANGE):
                shutil.rmtree(temp, ignore_errors=True)  # the temp now holds the old one
            else:
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
                os.rmdir(old)
                os.rename(target, old)
                os.rename(temp, target)
                shutil.rmtree(old, ignore_errors=True)
            fsync_directory(parent)
        else:
            publish_directory(temp, target)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def publish_directory(temp: Path, target: Path) -> None:
    """Move the finished, fsync'd directory ``temp`` to ``target``, which must not
    exist (FileExistsError if one appeared), then fsync the parent."""
    if not _renameat2(temp, target, _RENAME_NOREPLACE):  # EEXIST if one appeared
        if target.exists():
            raise FileExistsError(f"{target} appeared while the directory was written")
        os.rename(temp, target)
    fsync_directory(target.parent)
