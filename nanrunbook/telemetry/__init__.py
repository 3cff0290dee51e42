"""The sentinel's telemetry: one JSON line per step, read, summarised and sent on.

* :mod:`.record` — the ``nanrunbook-telemetry/1`` line: frozen records, the
  document, the strict parser, and the fast path's decoder of the uneventful
  line;
* :mod:`.reader` and :mod:`.follow` — a file read once or followed as it grows,
  in bounded memory, bad lines reported by number;
* :mod:`.summary` and :mod:`.series` — what the lines say about the run, and a
  bounded downsampled series for plots;
* :mod:`.watch` — the two joined: :func:`summarise_file` and :func:`follow`;
* :mod:`.sinks` — where a writer sends records: a JSONL file, ``logging``,
  TensorBoard.

Rendering (text, plots, JSON, kv, SVG) lives in :mod:`nanrunbook.output`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanrunbook.telemetry.reader import (
        BadLine,
        IncompleteLine,
        TelemetryUnreadable,
        read_telemetry,
    )
    from nanrunbook.telemetry.record import (
        TELEMETRY_FORMAT,
        ActivationStats,
        GradientStats,
        TelemetryLineError,
        TelemetryRecord,
        TelemetryWarning,
        UpdateStats,
        headroom_bits,
        loss_fields,
        parse_record,
        record_document,
        record_line,
    )
    from nanrunbook.telemetry.sinks import (
        JsonlSink,
        LoggingSink,
        SinkUnavailable,
        TelemetrySink,
        TensorBoardSink,
        scalars,
    )
    from nanrunbook.telemetry.summary import Summariser, WatchEvent, WatchSummary
    from nanrunbook.telemetry.watch import FollowInterrupted, follow, summarise_file

_LAZY = {
    "BadLine": ".reader",
    "IncompleteLine": ".reader",
    "TelemetryUnreadable": ".reader",
    "read_telemetry": ".reader",
    "TELEMETRY_FORMAT": ".record",
    "ActivationStats": ".record",
    "GradientStats": ".record",
    "TelemetryLineError": ".record",
    "TelemetryRecord": ".record",
    "TelemetryWarning": ".record",
    "UpdateStats": ".record",
    "headroom_bits": ".record",
    "loss_fields": ".record",
    "parse_record": ".record",
    "record_document": ".record",
    "record_line": ".record",
    "JsonlSink": ".sinks",
    "LoggingSink": ".sinks",
    "SinkUnavailable": ".sinks",
    "TelemetrySink": ".sinks",
    "TensorBoardSink": ".sinks",
    "scalars": ".sinks",
    "Summariser": ".summary",
    "WatchEvent": ".summary",
    "WatchSummary": ".summary",
    "FollowInterrupted": ".watch",
    "follow": ".watch",
    "summarise_file": ".watch",
}

__all__ = [
    "TELEMETRY_FORMAT",
    "ActivationStats",
    "BadLine",
    "FollowInterrupted",
    "GradientStats",
    "IncompleteLine",
    "JsonlSink",
    "LoggingSink",
    "SinkUnavailable",
    "Summariser",
    "TelemetryLineError",
    "TelemetryRecord",
    "TelemetrySink",
    "TelemetryUnreadable",
    "TelemetryWarning",
    "TensorBoardSink",
    "UpdateStats",
    "WatchEvent",
    "WatchSummary",
    "follow",
    "headroom_bits",
    "loss_fields",
    "parse_record",
    "read_telemetry",
    "record_document",
    "record_line",
    "scalars",
    "summarise_file",
]


def __getattr__(name: str) -> Any:
    # Names load on first use: the output formats import the summary types
    # without paying for the sinks (logging) or anything else here.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanrunbook.telemetry' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
