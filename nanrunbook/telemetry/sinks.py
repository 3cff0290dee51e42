"""Where a training loop sends its telemetry: a JSONL file, Python ``logging``,
TensorBoard scalars.

The interface a writer (the sentinel) plugs into is :class:`TelemetrySink`::

    sink.emit(record)   # once per step and rank, in step order
    sink.close()        # flush and release; emit is not called afterwards

Every sink is also a context manager that closes on exit. Sinks hold no
training state and never touch tensors: they only see the frozen
:class:`~nanrunbook.telemetry.record.TelemetryRecord` the writer built.

The numbers the scalar sinks send have one set of names, :func:`scalars`:
``loss`` (finite losses only), ``loss/nonfinite`` (0 or 1), ``grad/max_abs``,
``grad/headroom_bits``, ``grad/norm``, ``grad/nonfinite`` (count),
``update/max_abs``, ``update/nonfinite``, ``scale``, ``skipped`` and ``held``
(0 or 1), ``warnings`` (count). A name whose value is null is left out.
``logging`` lines and TensorBoard tags use exactly these names.

* :class:`JsonlSink` appends each record as one ``nanrunbook-telemetry/1``
  line with a single ``write(2)`` on an ``O_APPEND`` descriptor, so lines from
  several processes appending to one file on a local file system never
  interleave, and a reader never sees half a line followed by another line. A
  record that would not read back (a NaN where a finite number is required) is
  refused with TelemetryLineError before anything is written; a write that
  fails part-way (a full disk) is cut back off the file and raises. ``fsync=True``
  makes every line durable before ``emit`` returns (one fsync per step).
* :class:`LoggingSink` logs one INFO line per record (every ``every``-th
  record; warnings and holds always), each warning at WARNING and a held
  update at ERROR, to the logger ``nanrunbook.telemetry`` unless given another.
  Each log record carries the line's document as ``record.telemetry`` and the
  scalars as ``record.scalars`` for structured handlers.
* :class:`TensorBoardSink` calls ``add_scalar(name, value, step)`` for every
  scalar on a ``torch.utils.tensorboard.SummaryWriter`` it creates (or on any
  writer with that method, such as tensorboardX's). Without TensorBoard
  installed it refuses at construction with SinkUnavailable.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

from nanrunbook.telemetry.record import TelemetryRecord, record_document, record_line

__all__ = [
    "JsonlSink",
    "LoggingSink",
    "SinkUnavailable",
    "TelemetrySink",
    "TensorBoardSink",
    "scalars",
]


@runtime_checkable
class TelemetrySink(Protocol):
    def emit(self, record: TelemetryRecord) -> None: ...

    def close(self) -> None: ...


class SinkUnavailable(RuntimeError):
    """A sink's optional dependency is not installed."""


class _Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def scalars(record: TelemetryRecord) -> dict[str, float]:
    """The record's numbers under the names every scalar sink uses."""
    grad, update = record.grad, record.update
    values: dict[str, float | None] = {
        "loss": record.loss,
        "loss/nonfinite": float(record.loss_class != "finite"),
        "grad/max_abs": grad.max_abs,
        "grad/headroom_bits": grad.headroom_bits,
        "grad/norm": grad.norm,
        "grad/nonfinite": float(grad.nonfinite),
        "update/max_abs": None if update is None else update.max_abs,
        "update/nonfinite": None if update is None else float(update.nonfinite),
        "scale": record.scale,
        "skipped": float(record.skipped),
        "held": float(record.held),
        "warnings": float(len(record.warnings)),
    }
    return {name: value for name, value in values.items() if value is not None}


class JsonlSink(_Closing):
    """Appends ``nanrunbook-telemetry/1`` lines to ``path`` (created if missing)."""

    def __init__(self, path: Path | str, *, fsync: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._lock = threading.Lock()

    def emit(self, record: TelemetryRecord) -> None:
        line = record_line(record)  # refuses what would not read back, before writing
        with self._lock:
            if self._fd is None:
                raise ValueError(f"telemetry sink for {self.path} is closed")
            fd = self._fd
            size = os.fstat(fd).st_size
            view = memoryview(line)
            try:
                while view:  # a short write (a signal) is finished, not dropped
                    view = view[os.write(fd, view) :]
            except OSError:
                _cut_back(fd, size, len(line) - len(view))
                raise
            if self.fsync:
                os.fsync(fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _cut_back(fd: int, size: int, written: int) -> None:
    """After a write that failed part-way (a full disk): the part written is
    cut off the file, so a reader never sees half a line; only when the file
    ends with it (another process's line after it is left alone)."""
    try:
        if written and os.fstat(fd).st_size == size + written:
            os.ftruncate(fd, size)
    except OSError:
        pass


class LoggingSink(_Closing):
    """Logs each record through ``logging``; see the module docstring."""

    def __init__(
        self,
        logger: logging.Logger | str = "nanrunbook.telemetry",
        *,
        level: int = logging.INFO,
        every: int = 1,
    ) -> None:
        if every < 1:
            raise ValueError("every must be at least 1")
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level
        self.every = every
        self._seen = 0

    def emit(self, record: TelemetryRecord) -> None:
        self._seen += 1
        loud = record.held or record.warnings or record.loss_class != "finite"
        if not loud and (self._seen - 1) % self.every:
            return
        values = scalars(record)
        extra: dict[str, Any] = {"telemetry": record_document(record), "scalars": values}
        shown = " ".join(f"{name}={value:.6g}" for name, value in values.items())
        where = f"run {record.run_id} rank {record.rank} step {record.step}"
        self.logger.log(self.level, "%s: %s", where, shown, extra=extra)
        for warning in record.warnings:
            self.logger.warning("%s: %s %s", where, warning.code, warning.message, extra=extra)
        if record.held:
            bundle = f"; bundle {record.bundle}" if record.bundle else ""
            self.logger.error("%s: update held%s", where, bundle, extra=extra)

    def close(self) -> None:
        for handler in self.logger.handlers:
            handler.flush()


class TensorBoardSink(_Closing):
    """Scalars to TensorBoard under the names of :func:`scalars` (plus ``prefix``)."""

    def __init__(
        self, writer: Any = None, *, log_dir: Path | str | None = None, prefix: str = ""
    ) -> None:
        self._owned = writer is None
        if writer is None:
            writer = _summary_writer(log_dir)
        elif not callable(getattr(writer, "add_scalar", None)):
            raise TypeError("writer must have add_scalar(tag, value, step), as SummaryWriter does")
        self.writer = writer
        self.prefix = prefix

    def emit(self, record: TelemetryRecord) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(self.prefix + name, value, record.step)

    def close(self) -> None:
        if self._owned:
            self.writer.close()
        elif callable(getattr(self.writer, "flush", None)):
            self.writer.flush()


def _summary_writer(log_dir: Path | str | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise SinkUnavailable(
            "the TensorBoard sink needs torch.utils.tensorboard, which needs the tensorboard"
            f" package (pip install tensorboard): {error}"
        ) from None
    return SummaryWriter(log_dir=None if log_dir is None else str(log_dir))
