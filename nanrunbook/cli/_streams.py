"""Standard streams whose reader may go away (``| head -1``, ``grep -q``, a closed
``2>&1`` pipe) without changing what the command does or the exit code it returns.

A write to a pipe whose reader has gone raises ``BrokenPipeError`` wherever it
happens: in a renderer, in a diagnostic line on stderr written after the verdict
is known, in click's usage message. Caught there, it ended the command with
whatever code the catcher chose (``watch`` returned 0 for an empty file, whose
answer is 3). Here the stream itself absorbs it: the descriptor is pointed at
/dev/null, later writes are dropped, and the command runs on to its own exit code.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["ReaderProofStream", "reader_gone", "reader_proof_streams", "silence"]


class ReaderProofStream:
    """A text stream that never raises ``BrokenPipeError``; everything else is the
    wrapped stream's. ``reader_gone`` is true once a write or flush found no reader."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # as a text stream refuses bytes (click probes it)
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if not self.reader_gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._lose_reader()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._lose_reader()
        except ValueError:  # closed by the command itself: nothing left to write
            pass

    def _lose_reader(self) -> None:
        self.reader_gone = True
        silence(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def silence(stream: IO[str]) -> None:
    """Point a closed pipe's stream at /dev/null: what it still buffers goes there at
    the next flush, and the interpreter's final flush stays quiet. A stream without
    a descriptor of its own is left as it is."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


def reader_gone(stream: object) -> bool:
    """True when ``stream`` is a :class:`ReaderProofStream` whose reader went away."""
    return bool(getattr(stream, "reader_gone", False))


@contextlib.contextmanager
def reader_proof_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`ReaderProofStream` for the block
    (a descriptor closed at start, ``>&-``, is /dev/null), then as they were."""
    saved = sys.stdout, sys.stderr
    opened: list[IO[str]] = []

    def proof(stream: IO[str] | None) -> Any:
        if stream is None:
            stream = open(os.devnull, "w")  # noqa: SIM115 - closed after the block
            opened.append(stream)
        return stream if isinstance(stream, ReaderProofStream) else ReaderProofStream(stream)

    sys.stdout, sys.stderr = proof(sys.stdout), proof(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for stream in opened:
            stream.close()
