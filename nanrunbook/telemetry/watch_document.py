"""The watch summary and its events as JSON documents (``watch --format json``).

``watch_format`` versions the summary document: an incompatible change to its
keys bumps it. Keys are documented in nanrunbook(1), WATCH.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from nanrunbook.telemetry.record import record_document
from nanrunbook.telemetry.summary import WATCH_FORMAT, WatchEvent, WatchSummary

__all__ = ["event_document", "watch_document"]


def watch_document(summary: WatchSummary) -> dict[str, Any]:
    """Everything the summary holds, for programs."""
    return {
        "watch_format": WATCH_FORMAT,
        "path": summary.path,
        "status": summary.status,
        "since": summary.since,
        "window": summary.window,
        "lines": summary.lines,
        "records": summary.records,
        "before_since": summary.before_since,
        "bad_lines": summary.bad_lines,
        "bad_examples": [asdict(bad) for bad in summary.bad_examples],
        "incomplete_line": None if summary.incomplete is None else asdict(summary.incomplete),
        "run_ids": list(summary.run_ids),
        "ranks": list(summary.ranks),
        "world_size": summary.world_size,
        "first_step": summary.first_step,
        "last_step": summary.last_step,
        "first_time": summary.first_time,
        "last_time": summary.last_time,
        "step_regressions": summary.step_regressions,
        "holds": asdict(summary.holds),
        "skips": asdict(summary.skips),
        "longest_skip_streak": _maybe(summary.longest_skip_streak),
        "scaler_overflows": asdict(summary.scaler_overflows),
        "scale": _maybe(summary.scale),
        "nonfinite": asdict(summary.nonfinite),
        "first_nonfinite": _maybe(summary.first_nonfinite),
        "first_warning_step": summary.first_warning_step,
        "warnings": [asdict(w) for w in summary.warnings],
        "headroom": _headroom(summary),
        "bundles": list(summary.bundles),
        "last": None if summary.last is None else record_document(summary.last),
        "rotations": summary.rotations,
        "truncations": summary.truncations,
        "series": [asdict(bucket) for bucket in summary.series],
        "learning_rate": _maybe(summary.learning_rate),
        "compute_headroom": _maybe(summary.compute_headroom),
        "activations_sampled": _sampled(summary),
        "files": list(summary.files),
        "rank_rows": [asdict(row) for row in summary.rank_rows],
    }


def _sampled(summary: WatchSummary) -> dict[str, Any] | None:
    sample = summary.activations_sampled
    if sample is None:
        return None
    stats = sample.activations
    return {
        "step": sample.step,
        "rank": sample.rank,
        **asdict(stats),
        "nonfinite": list(stats.nonfinite),
    }


def _maybe(value: Any) -> Any:
    return None if value is None else asdict(value)


def _headroom(summary: WatchSummary) -> dict[str, Any] | None:
    trend = summary.headroom
    if trend is None:
        return None
    return {**asdict(trend), "direction": trend.direction}


def event_document(event: WatchEvent) -> dict[str, Any]:
    return {"event": event.kind, **{k: v for k, v in asdict(event).items() if k != "kind"}}
