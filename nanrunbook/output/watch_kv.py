"""``watch --format kv``: fixed ``key=value`` lines for shell playbooks.

Only shell-safe values are printed: numbers, fixed words, warning codes (the
telemetry parser admits only ``[A-Z][A-Z0-9_]*``) and run ids with every
character outside ``[A-Za-z0-9._/+=@:,-]`` replaced by ``?``. Messages and
paths, which are free text, are left to the text and json formats.
"""

from __future__ import annotations

import re

from nanrunbook.telemetry.summary import WATCH_FORMAT, Occurrences, Streak, WatchEvent, WatchSummary

__all__ = ["event_value", "summary_lines"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._/+=@:,-]")


def _safe(text: str) -> str:
    return _UNSAFE.sub("?", text) or "?"


def _number(value: float | int | None) -> str:
    if value is None:
        return "none"
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _steps(seen: Occurrences) -> str:
    return ",".join(str(s) for s in seen.steps) or "none"


def _streak(streak: Streak | None) -> list[str]:
    return [str(streak.length if streak else 0), _number(streak.first_step if streak else None)]


def summary_lines(summary: WatchSummary) -> list[str]:
    first = summary.first_nonfinite
    trend = summary.headroom
    scale = summary.scale
    backoff_streak = None if scale is None else scale.longest_backoff_streak
    lr, compute = summary.learning_rate, summary.compute_headroom
    sampled = summary.activations_sampled
    lines = [
        f"watch_format={WATCH_FORMAT}",
        f"status={summary.status}",
        f"lines={summary.lines}",
        f"records={summary.records}",
        f"bad_lines={summary.bad_lines}",
        f"run={_safe(summary.run_ids[0]) if summary.run_ids else 'none'}",
        f"first_step={_number(summary.first_step)}",
        f"last_step={_number(summary.last_step)}",
        f"first_warning_step={_number(summary.first_warning_step)}",
        f"first_nonfinite_step={_number(first.step if first else None)}",
        f"first_nonfinite={first.part if first else 'none'}",
        f"nonfinite_steps={summary.nonfinite.count}",
        f"holds={summary.holds.count}",
        f"hold_steps={_steps(summary.holds)}",
        f"skips={summary.skips.count}",
        f"skip_steps={_steps(summary.skips)}",
        "longest_skip_streak={} {}".format(*_streak(summary.longest_skip_streak)),
        f"scaler_overflows={summary.scaler_overflows.count}",
        f"backoffs={0 if scale is None else scale.backoffs.count}",
        "longest_backoff_streak={} {}".format(*_streak(backoff_streak)),
        f"scale_last={_number(None if scale is None else scale.last)}",
        f"scale_min={_number(None if scale is None else scale.min)}",
        f"headroom_dtype={_safe(trend.dtype) if trend else 'none'}",
        f"headroom_bits={_number(trend.last_bits if trend else None)}",
        f"headroom_slope={_number(trend.slope_bits_per_step if trend else None)}",
        f"headroom_direction={trend.direction if trend else 'none'}",
        f"warnings={len(summary.warnings)}",
        *(f"warning={w.code} {w.first_step} {w.count} {w.source}" for w in summary.warnings),
        *(f"bad_line={b.line} {b.kind}" for b in summary.bad_examples),
        f"incomplete_line={_number(summary.incomplete.line if summary.incomplete else None)}",
        f"rotations={summary.rotations}",
        f"truncations={summary.truncations}",
        f"lr_last={_number(None if lr is None else lr.last)}",
        f"compute_headroom_dtype={_safe(compute.dtype) if compute else 'none'}",
        f"compute_headroom_bits={_number(compute.bits if compute else None)}",
        f"compute_headroom_min_bits={_number(compute.min_bits if compute else None)}",
        f"activations_sampled_step={_number(sampled.step if sampled else None)}",
        f"files={len(summary.files) or 1}",
        f"origin_ranks={','.join(map(str, first.origin_ranks)) if first else 'none'}",
        f"origin={first.origin if first else 'NONE'}",
    ]
    return lines


def event_value(event: WatchEvent) -> str:
    """``KIND [STEP|LINE] [CODE]``: the value of one ``event=`` line."""
    words = [event.kind]
    if event.line is not None:
        words.append(str(event.line))
    elif event.step is not None:
        words.append(str(event.step))
    if event.code is not None:
        words.append(event.code)
    return " ".join(words)
