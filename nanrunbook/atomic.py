"""Atomic writes: a temporary sibling, fsync, rename. Nothing half-written is ever
seen at the target path, and an existing target is replaced only when asked."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_directory", "atomic_write", "fsync_directory"]


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=parent))
            os.rmdir(old)
            os.rename(target, old)
            os.rename(temp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, target)
        fsync_directory(parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
