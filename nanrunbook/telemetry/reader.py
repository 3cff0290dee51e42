"""Reading a telemetry file as a stream: whole lines in, records or bad lines out.

Memory is bounded whatever the file holds: it is read in 1 MiB chunks, and a
line longer than :data:`MAX_LINE_BYTES` is reported (TOO_LONG) and skipped up
to its newline rather than accumulated. Blank lines are skipped silently.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import orjson

from nanrunbook.telemetry.record import TelemetryLineError, TelemetryRecord, parse_record

__all__ = [
    "MAX_LINE_BYTES",
    "BadLine",
    "IncompleteLine",
    "LineSplitter",
    "TelemetryReader",
    "TelemetryUnreadable",
    "directory_meant",
    "open_telemetry",
    "parse_line",
    "read_telemetry",
]

MAX_LINE_BYTES = 1 << 20
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that is not a telemetry record: where (1-based, in the file as
    read since it was opened, rotated or truncated), what kind, and why."""

    line: int
    kind: str  # NOT_JSON, NOT_AN_OBJECT, FOREIGN_FORMAT, INVALID_FIELD, TOO_LONG
    reason: str


@dataclass(frozen=True, slots=True)
class IncompleteLine:
    """The file ends inside a line: the writer may be mid-line. Not an error."""

    line: int
    size: int


class TelemetryUnreadable(Exception):
    """The telemetry path cannot be read at all: missing, not a file, no permission."""


class LineSplitter:
    """Bytes in, whole lines out; keeps the partial last line for the next feed.

    ``feed`` returns ``(line_number, raw)`` pairs, where ``raw`` is the line
    without its newline, or a :class:`BadLine` for a line over the size bound.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self.max_line = max_line
        self.line_number = 0  # of the last complete line handed out
        self._pending = b""
        self._overlong = False  # inside a line already reported as too long

    @property
    def pending(self) -> bytes:
        return self._pending

    def reset(self) -> None:
        """Start again at line 1 (the file was truncated or replaced)."""
        self.line_number = 0
        self._pending = b""
        self._overlong = False

    def feed(self, chunk: bytes) -> list[tuple[int, bytes] | BadLine]:
        pieces = chunk.split(b"\n")
        pieces[0] = self._pending + pieces[0]
        self._pending = pieces.pop()
        first = self.line_number + 1
        self.line_number += len(pieces)
        out: list[tuple[int, bytes] | BadLine]
        if self._overlong or (pieces and max(map(len, pieces)) > self.max_line):
            out = self._screened(first, pieces)
        else:  # the usual chunk, numbered in one pass rather than line by line
            out = list(zip(count(first), pieces))
        if len(self._pending) > self.max_line:
            if not self._overlong:
                out.append(self._too_long(self.line_number + 1))
                self._overlong = True
            self._pending = b""
        return out

    def _screened(self, first: int, pieces: list[bytes]) -> list[tuple[int, bytes] | BadLine]:
        out: list[tuple[int, bytes] | BadLine] = []
        for number, raw in enumerate(pieces, first):
            if self._overlong:
                self._overlong = False  # its report was made when it passed the bound
            elif len(raw) > self.max_line:
                out.append(self._too_long(number))
            else:
                out.append((number, raw))
        return out

    def _too_long(self, line: int) -> BadLine:
        return BadLine(
            line, "TOO_LONG", f"longer than {self.max_line} bytes; skipped to its newline"
        )


def parse_line(line: int, raw: bytes) -> TelemetryRecord | BadLine | None:
    """One line as a record, a bad line, or None when blank."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if not raw.strip():
            return None
        return BadLine(line, "NOT_JSON", f"not JSON ({_short(str(error))})")
    try:
        return parse_record(document)
    except TelemetryLineError as error:
        return BadLine(line, error.kind, error.reason)


def _short(text: str, limit: int = 80) -> str:
    text = text.split(": line ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def open_telemetry(path: Path) -> int:
    """An O_RDONLY descriptor for a regular file (a FIFO or a device would block
    or never end), or TelemetryUnreadable with a one-line reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TelemetryUnreadable(f"{path}: no such file") from None
    except OSError as error:
        raise TelemetryUnreadable(f"{path}: {error.strerror or error}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise TelemetryUnreadable(f"{path}: {directory_meant(path)}")
        raise TelemetryUnreadable(f"{path}: not a regular file, not a telemetry file")
    os.set_blocking(fd, True)
    return fd


def directory_meant(path: Path) -> str:
    """What a directory given for telemetry most likely meant."""
    from nanrunbook.errors import quote

    if (path / "manifest.json").exists():
        return (
            "is an evidence bundle, not telemetry: judge it with"
            f" nanrunbook check {quote(str(path))}"
        )
    found = sorted(path.glob("telemetry*.jsonl"))[:3]
    if found:
        named = ", ".join(quote(p.name) for p in found)
        return f"is a directory, not a telemetry file; it holds {named}"
    return "is a directory, not a telemetry file"


class TelemetryReader:
    """Iterates over every record and bad line of a file, in order, then an
    IncompleteLine if it ends inside a line that does not parse. Iterating
    raises TelemetryUnreadable, before yielding anything, when the path cannot
    be read. ``lines`` is how many lines have been read so far."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.lines = 0
        self._splitter: LineSplitter | None = None

    def __iter__(self) -> Iterator[TelemetryRecord | BadLine | IncompleteLine]:
        for pieces in self.batches():
            for piece in pieces:
                parsed = piece if isinstance(piece, BadLine) else parse_line(*piece)
                if parsed is not None:
                    yield parsed
        ending = self.ending()
        if ending is not None:
            yield ending

    def batches(self) -> Iterator[list[tuple[int, bytes] | BadLine]]:
        """The file's complete lines, one chunk's worth at a time, as
        :meth:`LineSplitter.feed` hands them out (for a caller that parses them
        its own way); then :meth:`ending` judges an unfinished last line."""
        fd = open_telemetry(self.path)
        self._splitter = splitter = LineSplitter()
        try:
            while chunk := os.read(fd, CHUNK_BYTES):
                yield splitter.feed(chunk)
                self.lines = splitter.line_number
        except OSError as error:
            raise TelemetryUnreadable(f"{self.path}: {error.strerror or error}") from None
        finally:
            os.close(fd)

    def ending(self) -> TelemetryRecord | BadLine | IncompleteLine | None:
        """After :meth:`batches`: the unfinished last line, judged (see
        :func:`finish`), or None when the file ends with a newline."""
        splitter = self._splitter
        if splitter is None or not splitter.pending.strip():
            return None
        self.lines += 1
        return finish(splitter)


def read_telemetry(path: Path | str) -> TelemetryReader:
    """The records and bad lines of a telemetry file, streamed (see TelemetryReader)."""
    return TelemetryReader(path)


def finish(splitter: LineSplitter) -> TelemetryRecord | BadLine | IncompleteLine:
    """The file ends without a newline. A whole JSON object there is judged as a
    line (the writer added no final newline); anything else is an incomplete
    line that the writer may still be writing."""
    line = splitter.line_number + 1
    parsed = parse_line(line, splitter.pending)
    if parsed is None or (isinstance(parsed, BadLine) and parsed.kind == "NOT_JSON"):
        return IncompleteLine(line, len(splitter.pending))
    return parsed
