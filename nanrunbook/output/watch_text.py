"""``watch --format text``: the summary an on-call engineer reads at a glance,
with plots, and one line per live event. Lines of facts, built here as plain
strings; the text renderer prints them through rich (colour on a terminal)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from nanrunbook.telemetry.summary import (
    STEPS_KEPT,
    ActivationSample,
    ComputeHeadroom,
    HeadroomTrend,
    Occurrences,
    RankRow,
    ScaleSummary,
    Streak,
    ValueRange,
    WatchEvent,
    WatchSummary,
)

__all__ = ["STATUS_MEANING", "event_line", "summary_facts", "summary_sections"]

STATUS_MEANING = {
    "ALARM": "a held update or a non-finite step is recorded",
    "WARNINGS": "warnings or bad lines, no hold and no non-finite step",
    "OK": "nothing alarming",
    "EMPTY": "no telemetry record",
}


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _steps(seen: Occurrences) -> str:
    if not seen.count:
        return "none"
    shown = ", ".join(str(s) for s in seen.steps)
    if seen.count > len(seen.steps):
        return f"{seen.count}: steps {shown}, ... (first {STEPS_KEPT}), last {seen.last_step}"
    return f"{seen.count}: step{'s' if seen.count > 1 else ''} {shown}"


def _streak(streak: Streak | None, what: str) -> str:
    if streak is None:
        return ""
    return (
        f"; longest {what} streak {streak.length}"
        f" (steps {streak.first_step} to {streak.last_step}, rank {streak.rank})"
    )


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _scale(scale: ScaleSummary | None) -> str:
    if scale is None:
        return "none recorded"
    backoffs = scale.backoffs.count
    line = (
        f"{scale.first:.10g} -> {scale.last:.10g} (least {scale.min:.10g}, most {scale.max:.10g})"
    )
    line += f"; {backoffs} backoff{'s' if backoffs != 1 else ''}"
    if backoffs:
        line += f" at {_steps(scale.backoffs).split(': ', 1)[1]}"
    return line + _streak(scale.longest_backoff_streak, "backoff")


def _headroom(trend: HeadroomTrend | None) -> str:
    if trend is None:
        return "unknown (no gradient max abs with a known dtype)"
    line = (
        f"{trend.dtype}, last {trend.points} records (steps {trend.first_step}"
        f" to {trend.last_step}, rank {trend.rank}): {trend.first_bits:.1f} -> {trend.last_bits:.1f}"
        f" bits (least {trend.min_bits:.1f}), {trend.direction}"
    )
    slope = trend.slope_bits_per_step
    if trend.direction != "steady" and slope is not None:
        line += f" {abs(slope):.3g} bits/step"
    if trend.direction == "falling" and trend.steps_to_zero is not None:
        line += f": 0 bits in about {trend.steps_to_zero:.0f} steps at this rate"
    return line


def _range(values: ValueRange) -> str:
    return (
        f"{values.first:.4g} -> {values.last:.4g} (least {values.min:.4g}, most {values.max:.4g})"
    )


def _compute(compute: ComputeHeadroom, gradients: HeadroomTrend | None) -> str:
    """The reduced-precision values' own headroom; said first when it is
    tighter than the gradients', so a float32 gradient line never reassures
    about float16 activations."""
    line = f"{compute.dtype} {compute.where}, step {compute.step} (rank {compute.rank}): "
    if compute.nonfinite:
        line += "non-finite, no headroom left"
    else:
        line += f"{compute.bits:.2f} bits below the {compute.dtype} max"
    if compute.min_step != compute.step and not compute.min_nonfinite:
        line += f" (least {compute.min_bits:.2f}, step {compute.min_step}, {compute.min_where})"
    if gradients is not None and compute.bits < gradients.last_bits:
        line += f"; tighter than the gradients' {gradients.dtype} ({gradients.last_bits:.1f} bits)"
    return line


def _sampled(sample: ActivationSample | None, last_step: int | None) -> str:
    if sample is None:
        return "not sampled in these records (Thresholds.sample_every)"
    stats = sample.activations
    ago = ""
    if last_step is not None and last_step > sample.step:
        gap = last_step - sample.step
        ago = f", {gap} step{'s' if gap != 1 else ''} before the last record"
    line = f"last sampled at step {sample.step} (rank {sample.rank}{ago})"
    if stats.max_abs is not None:
        line += f": max abs {stats.max_abs:.4g} at {stats.where or '-'} ({stats.dtype or '-'})"
        if stats.headroom_bits is not None:
            line += f", {stats.headroom_bits:.2f} bits below its max"
    if stats.nonfinite:
        shown = ", ".join(stats.nonfinite[:3]) + (" ..." if len(stats.nonfinite) > 3 else "")
        line += f"; non-finite in {shown}"
    return line


def _steps_line(summary: WatchSummary) -> str:
    if summary.first_step is None:
        return "none"
    span = ""
    if summary.first_time is not None and summary.last_time is not None:
        span = f", {_time(summary.first_time)} to {_time(summary.last_time)}"
    since = f" (from step {summary.since}: {summary.before_since} earlier records set aside)"
    return f"{summary.first_step} to {summary.last_step}{span}" + (
        since if summary.since is not None else ""
    )


def summary_facts(summary: WatchSummary) -> list[tuple[str, str]]:
    """(label, value) lines under the status line."""
    bad = f", {summary.bad_lines} bad" if summary.bad_lines else ""
    ranks = ", ".join(str(r) for r in summary.ranks[:8]) + (
        " ..." if len(summary.ranks) > 8 else ""
    )
    first_warning = "none"
    if summary.warnings:
        first = min(summary.warnings, key=lambda w: w.first_step)
        first_warning = f"step {first.first_step}: {first.code} ({first.source})"
    nonfinite = "none"
    if summary.first_nonfinite is not None:
        found = summary.first_nonfinite
        what, kind = found.part.split(":")
        count = summary.nonfinite.count
        where = f"rank {found.rank}"
        if len(summary.ranks) > 1:
            where = _origin(summary)
        nonfinite = f"step {found.step}: {what} {kind} ({where}); {count} such step"
        nonfinite += "s" if count != 1 else ""
    read = f"{summary.lines} lines, {summary.records} records{bad}"
    files = len(summary.files)
    facts = [
        ("files", f"{summary.path}: {files} files, {read}")
        if files
        else ("file", f"{summary.path}: {read}"),
        (
            "run",
            f"{', '.join(summary.run_ids) or '-'}; rank {ranks or '-'} of {summary.world_size or '-'}",
        ),
        ("steps", _steps_line(summary)),
        ("first warning", first_warning),
        ("first non-finite", nonfinite),
        ("held updates", _steps(summary.holds)),
        ("skipped updates", _steps(summary.skips) + _streak(summary.longest_skip_streak, "skip")),
        ("scaler overflows", _overflows(summary)),
        ("loss scale", _scale(summary.scale)),
    ]
    if summary.learning_rate is not None:
        facts.append(("learning rate", _range(summary.learning_rate)))
    compute, trend = summary.compute_headroom, summary.headroom
    if compute is not None:
        facts.append(("compute headroom", _compute(compute, trend)))
    facts.append(("gradient headroom", _headroom(trend)))
    if compute is not None or summary.activations_sampled is not None:
        facts.append(("activations", _sampled(summary.activations_sampled, summary.last_step)))
    if summary.last is not None:
        last = summary.last
        loss = _g(last.loss) if last.loss_class == "finite" else last.loss_class
        lr = "" if last.lr is None else f", lr {_g(last.lr)}"
        facts.append(
            (
                "last record",
                f"step {last.step}: loss {loss}, grad norm {_g(last.grad.norm)},"
                f" grad max abs {_g(last.grad.max_abs)}, scale {_g(last.scale)}{lr}",
            )
        )
    if summary.bundles:
        facts.append(("bundles", ", ".join(summary.bundles)))
    return facts


def _origin(summary: WatchSummary) -> str:
    """Where a job's first non-finite step began: its origin ranks, how many of
    the world they are, and what the other ranks showed at that step."""
    found = summary.first_nonfinite
    assert found is not None
    ranks = ", ".join(str(r) for r in found.origin_ranks[:8])
    ranks += " ..." if len(found.origin_ranks) > 8 else ""
    plural = "s" if len(found.origin_ranks) > 1 else ""
    line = f"began on rank{plural} {ranks}: {found.origin} of {summary.world_size or '-'}"
    others = [(r, p) for r, p in found.parts if r not in found.origin_ranks]
    if others:
        shown = ", ".join(f"rank {r} {p.replace(':', ' ')}" for r, p in others[:3])
        line += f"; then {shown}" + (" ..." if len(others) > 3 else "")
    return line


def _overflows(summary: WatchSummary) -> str:
    seen = summary.scaler_overflows
    if not seen.count:
        return "none"
    return _steps(seen) + " (found inf, update skipped by the scaler: its probing, not an incident)"


def summary_sections(summary: WatchSummary) -> Iterable[tuple[str, list[str]]]:
    """(heading, lines) sections after the facts: warnings, bad lines, notes."""
    if summary.warnings:
        width = max(len(w.code) for w in summary.warnings)
        lines = [
            f"step {w.first_step:<8} {w.code:<{width}}  x{w.count:<6} ({w.source}) {w.message}"
            for w in summary.warnings
        ]
        yield "Warnings, by the step each first appeared", lines
    if summary.bad_lines:
        lines = [f"line {b.line:<8} {b.kind}: {b.reason}" for b in summary.bad_examples]
        shown = len(summary.bad_examples)
        yield f"Bad lines: {summary.bad_lines} (the first {shown} shown)", lines
    if len(summary.rank_rows) > 1:
        yield "Ranks, where they differ", _rank_table(summary)
    notes = _notes(summary)
    if notes:
        yield "Notes", notes


_RANK_COLUMNS: tuple[tuple[str, Callable[[RankRow], str]], ...] = (
    ("records", lambda r: str(r.records)),
    ("steps", lambda r: f"{r.first_step}-{r.last_step}" if r.first_step is not None else "-"),
    ("held", lambda r: str(r.holds)),
    ("skipped", lambda r: str(r.skips)),
    ("non-finite", lambda r: str(r.nonfinite)),
    ("first non-finite", lambda r: (r.first_nonfinite or "-").replace(":", " ")),
    ("warnings", lambda r: str(r.warnings)),
)


def _rank_table(summary: WatchSummary) -> list[str]:
    """One line per rank, only the columns whose values differ between ranks."""
    rows = summary.rank_rows[:16]
    columns = [
        (name, cells)
        for name, cell in _RANK_COLUMNS
        if len(set(cells := [cell(r) for r in summary.rank_rows])) > 1
    ]
    if not columns:
        return [
            f"all {len(summary.rank_rows)} ranks alike: "
            + ", ".join(f"{name} {cell(summary.rank_rows[0])}" for name, cell in _RANK_COLUMNS[:5])
        ]
    widths = [max(len(name), *(len(c) for c in cells[: len(rows)])) for name, cells in columns]
    lines = ["rank    " + "  ".join(n.ljust(w) for (n, _), w in zip(columns, widths, strict=True))]
    for i, row in enumerate(rows):
        cells = [cells[i].ljust(w) for (_, cells), w in zip(columns, widths, strict=True)]
        lines.append(f"{row.rank:<6}  " + "  ".join(cells).rstrip())
    if len(summary.rank_rows) > len(rows):
        lines.append(f"... and {len(summary.rank_rows) - len(rows)} more ranks (json has them all)")
    return [line.rstrip() for line in lines]


def _notes(summary: WatchSummary) -> list[str]:
    notes = []
    if summary.incomplete is not None:
        notes.append(
            f"line {summary.incomplete.line} is incomplete ({summary.incomplete.size} bytes,"
            " no newline yet): the writer may be mid-line; it is not counted"
        )
    if summary.step_regressions:
        notes.append(
            f"{summary.step_regressions} time(s) a rank's step went back (a resume from a checkpoint?)"
        )
    if summary.rotations or summary.truncations:
        notes.append(
            f"the file was rotated {summary.rotations} and truncated {summary.truncations} time(s)"
            " while followed; line numbers restart at each"
        )
    if len(summary.run_ids) > 1:
        notes.append("the file holds more than one run id")
    return notes


def event_line(event: WatchEvent) -> str:
    """One live event as one line."""
    where = f"step {event.step}" if event.step is not None else ""
    if event.line is not None:
        where = f"line {event.line}"
    if event.kind == "warning":
        return f"{where}  warning {event.code} ({event.source}): {event.message}"
    if event.kind == "bad_line":
        return f"{where}  bad line: {event.message}"
    if event.kind in ("hold", "nonfinite"):
        return f"{where}  {'HELD' if event.kind == 'hold' else 'NON-FINITE'}: {event.message}"
    return f"{event.kind}: {event.message}"
