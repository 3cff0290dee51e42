"""One bounded pass over a tensor's bytes: SHA-256 and exact counts together.

The bytes are read with ``os.preadv`` (``os.pread`` where it is missing) into
one reused buffer, never mapped and never loaded whole: memory stays bounded by
the buffer however large the tensor (spec section 1).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from .counting import Counter, Tally

__all__ = ["CHUNK_SIZE", "ShortRead", "TensorScan", "scan_range"]

# 4 MiB rounded down to a multiple of 24, so every dtype's Counter.align (1, 2,
# 3, 4 or 8 bytes) divides it and no element straddles two chunks.
CHUNK_SIZE = (4 * 1024 * 1024 // 24) * 24


@dataclass(frozen=True, slots=True)
class TensorScan:
    sha256: str  # lowercase hex of the exact bytes
    tally: Tally


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


def scan_range(
    fd: int, offset: int, length: int, dtype: str, *, buffer: bytearray | None = None
) -> TensorScan:
    """Hash and count the bytes ``[offset, offset + length)`` of the open file ``fd``.

    ``buffer``, when given, is reused for the reads; its size rounded down to the
    dtype's alignment is the chunk size. Raises :class:`ShortRead` when the file
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
    digest = hashlib.sha256()
    done = 0
    view = memoryview(buffer)
    try:
        while done < length:
            want = min(chunk, length - done)
            filled = 0
            while filled < want:  # a read may return less than asked; only 0 is EOF
                got = _read_into(fd, view[filled:want], offset + done + filled)
                if got == 0:
                    raise ShortRead(offset, length, done + filled)
                filled += got
            piece = view[:want]
            digest.update(piece)
            counter.feed(piece)
            done += want
    finally:
        view.release()
    return TensorScan(sha256=digest.hexdigest(), tally=counter.result())
