"""The progress bar ``nanrunbook check`` shows on stderr while it reads tensor data.

Shown only when stderr is a terminal, and only once reading has taken longer
than :data:`DELAY` seconds: a small bundle prints nothing, and nothing is ever
written to stdout. rich is imported only when the bar is actually shown. The bar
is transient: it is erased when the read ends, before the report is printed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["DELAY", "ByteProgress", "check_progress"]

DELAY = 0.3  # seconds of reading before the bar appears


class ByteProgress:
    """A progress sink for ``check_bundle(progress=...)``: told the total bytes
    to read with :meth:`start`, then called with byte counts as they are read."""

    def __init__(self, stream: TextIO, *, delay: float = DELAY) -> None:
        self._stream = stream
        self._delay = delay
        self._total = 0
        self._done = 0
        self._began = time.monotonic()
        self._bar: Any = None  # rich.progress.Progress once shown
        self._task: Any = None

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def start(self, total: int) -> None:
        self._total = total
        self._done = 0
        self._began = time.monotonic()

    def extend(self, total: int) -> None:
        """More bytes to read under the same bar: the members of an incident set
        each add theirs as their read begins."""
        self._total += total
        if self._bar is not None:
            self._bar.update(self._task, total=self._total)

    def __call__(self, nbytes: int) -> None:
        self._done += nbytes
        if self._bar is None:
            if self._total and time.monotonic() - self._began >= self._delay:
                self._show()
            return
        self._bar.update(self._task, completed=self._done)

    def _show(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        bar = Progress(
            TextColumn("reading tensors"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=self._stream),
            transient=True,
        )
        self._task = bar.add_task("read", total=self._total, completed=self._done)
        bar.start()
        self._bar = bar

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextmanager
def check_progress(enabled: bool, stream: TextIO | None = None) -> Iterator[ByteProgress | None]:
    """A :class:`ByteProgress` on ``stream`` (default stderr) when ``enabled`` and
    the stream is a terminal, else None; the bar is gone when the block exits."""
    import sys

    target = stream if stream is not None else sys.stderr
    if not enabled or not _is_terminal(target):
        yield None
        return
    progress = ByteProgress(target)
    try:
        yield progress
    finally:
        progress.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
