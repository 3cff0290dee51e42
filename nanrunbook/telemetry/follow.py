"""Following a telemetry file as the sentinel appends to it, the way ``tail -F`` does.

A line is handed out only once its newline is written: a partial last line is
waited for, never reported. The file being replaced (a new inode at the path:
rotation) or shrinking (truncation, as ``copytruncate`` does) is noticed and
said, and reading starts again at the new file's first line; the old file is
read to its end first. A path that disappears is waited for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nanrunbook.telemetry.reader import (
    CHUNK_BYTES,
    BadLine,
    IncompleteLine,
    LineSplitter,
    TelemetryUnreadable,
    open_telemetry,
    parse_line,
)
from nanrunbook.telemetry.record import TelemetryRecord

__all__ = ["FollowNotice", "Follower"]


@dataclass(frozen=True, slots=True)
class FollowNotice:
    kind: str  # rotated, truncated, missing, returned
    message: str


Item = TelemetryRecord | BadLine | FollowNotice


class Follower:
    """Reads what has been appended since the last call; see the module docstring."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fd = open_telemetry(self.path)
        self._identity = self._file_identity(os.fstat(self._fd))
        self._position = 0
        self._missing = False
        self.splitter = LineSplitter()

    @staticmethod
    def _file_identity(stat: os.stat_result) -> tuple[int, int]:
        return stat.st_dev, stat.st_ino

    @property
    def lines(self) -> int:
        return self.splitter.line_number

    def incomplete(self) -> IncompleteLine | None:
        pending = self.splitter.pending
        if not pending.strip():
            return None
        return IncompleteLine(self.splitter.line_number + 1, len(pending))

    def close(self) -> None:
        os.close(self._fd)

    def read_available(self) -> list[Item]:
        """Every complete line written since the last call, then any notice about
        the file itself."""
        items = self._drain()
        return items + self._check_file()

    def _drain(self) -> list[Item]:
        items: list[Item] = []
        while chunk := os.read(self._fd, CHUNK_BYTES):
            self._position += len(chunk)
            for piece in self.splitter.feed(chunk):
                parsed = piece if isinstance(piece, BadLine) else parse_line(*piece)
                if parsed is not None:
                    items.append(parsed)
        return items

    def _check_file(self) -> list[Item]:
        size = os.fstat(self._fd).st_size
        if size < self._position:
            message = (
                f"{self.path} shrank from {self._position} to {size} bytes (truncated):"
                " reading it again from line 1"
            )
            os.lseek(self._fd, 0, os.SEEK_SET)
            self._restart()
            return [FollowNotice("truncated", message)]
        try:
            identity = self._file_identity(os.stat(self.path))
        except FileNotFoundError:
            if self._missing:
                return []
            self._missing = True
            message = f"{self.path} was removed or renamed: waiting for it to reappear"
            return [FollowNotice("missing", message)]
        if identity == self._identity:
            if self._missing:
                self._missing = False
                return [FollowNotice("returned", f"{self.path} is back (the same file)")]
            return []
        return self._reopen()

    def _reopen(self) -> list[Item]:
        """The path names another file now: finish the old one, then switch."""
        items = self._drain()
        lost = self.incomplete()
        try:
            fd = open_telemetry(self.path)
        except TelemetryUnreadable:
            return items  # replaced by something unreadable, or gone again: wait
        os.close(self._fd)
        self._fd = fd
        self._identity = self._file_identity(os.fstat(fd))
        self._restart()
        self._missing = False
        message = f"{self.path} was replaced (rotated): reading the new file from line 1"
        if lost is not None:
            message += f"; the old file ended inside line {lost.line}, which is lost"
        return [*items, FollowNotice("rotated", message)]

    def _restart(self) -> None:
        self._position = 0
        self.splitter.reset()
