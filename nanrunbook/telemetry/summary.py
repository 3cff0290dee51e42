"""What a telemetry file says about a run, in bounded memory.

:class:`Summariser` takes records one at a time (and bad lines, and notices from
a follower) and keeps counts, the first few steps of each kind of occurrence,
per-rank streaks, a sliding window of gradient headroom, and a bounded
downsampled series; :meth:`Summariser.summary` freezes it into a
:class:`WatchSummary`. ``add`` returns the :class:`WatchEvent` objects a live
watcher prints as they happen.

What the summariser derives itself, beside the warnings the lines carry (each
documented in nanrunbook(1), WATCH):

* a step is *non-finite* when its loss is, or its update is, or its gradients
  are and a dynamic loss scaler did not absorb them (found_inf, skipped, finite
  loss: the scaler's designed probing, counted apart as scaler overflows);
* a *backoff* is a loss scale lower than the same rank's previous record; a
  *streak* is consecutive records of one rank that each back off (or skip);
* warnings where the lines lack them, under the check's codes where they mean
  the same: AT_DTYPE_MAX (headroom 0 bits), NEAR_DTYPE_MAX (below 1 bit), and
  HEADROOM_FALLING (the least-squares trend of the last ``window`` records'
  headroom reaches 0 bits within ``window`` steps and has fallen at least 4
  bits over the window); NEAR_DTYPE_MAX and AT_DTYPE_MAX of the model's output
  (the ``output`` field), too;
* LOSS_DIVERGENCE, GRAD_NORM_DIVERGENCE and WEIGHT_NORM_GROWTH, per rank, by
  the sentinel's own rule and default limits (``nanrunbook.telemetry._early``),
  from the loss, ``grad.norm`` and ``weight_norm`` series, where the lines
  lack them (a file from an older sentinel gets them too).

Records of several ranks (one file, or a job's files merged by step) make one
summary: a held, skipped or non-finite step counts once however many ranks
record it, and the first non-finite step names its origin ranks by the rule of
an incident set (spec section 11): the ranks whose part went non-finite at the
earliest stage (loss, then gradients, then the update) at that step.

Beside the gradients' headroom it keeps the *compute headroom*: the headroom of
the reduced-precision values themselves (the model's ``output`` every step,
the sampled ``activations``) to their own dtype's max, which under float16
autocast is the tighter one; and the last step activations were sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from operator import attrgetter, ge, lt
from typing import Literal, cast

import orjson

from nanrunbook.contract import STAGE_ORDER
from nanrunbook.exits import Exit
from nanrunbook.records import ONE_RANK, origin_of
from nanrunbook.telemetry._early import DEFAULT_LIMITS, SIGNALS, Divergence
from nanrunbook.telemetry.reader import BadLine, IncompleteLine
from nanrunbook.telemetry.record import (
    ActivationStats,
    CommonLine,
    CommonOutput,
    TelemetryRecord,
    headroom_bits,
    headroom_code,
    parse_record,
)
from nanrunbook.telemetry.series import Downsampler, SeriesBucket
from nanrunbook.telemetry.trend import SlidingTrend

__all__ = [
    "DERIVED_CODES",
    "WATCH_FORMAT",
    "ActivationSample",
    "ComputeHeadroom",
    "HeadroomTrend",
    "NonFiniteStep",
    "Occurrences",
    "RankRow",
    "ScaleSummary",
    "Streak",
    "Summariser",
    "ValueRange",
    "WarningTally",
    "WatchEvent",
    "WatchSummary",
]

WATCH_FORMAT = "nanrunbook-watch/1"
DEFAULT_WINDOW = 50
STEPS_KEPT = 10  # first steps listed per kind of occurrence
BAD_LINES_KEPT = 5
MAX_CODES = 64  # distinct warning codes tallied; more fold into OTHER_CODES
MAX_RANKS = 1024  # ranks with their own streaks and trend; more share one
MAX_RUN_IDS = 8
TREND_MIN_POINTS = 8
TREND_MIN_DROP_BITS = 4.0
MESSAGE_KEPT = 300  # characters of a warning's first message

Source = Literal["telemetry", "watch"]
# The warning codes the summariser derives itself (nanrunbook.warning_codes).
DERIVED_CODES = (
    "AT_DTYPE_MAX",
    "NEAR_DTYPE_MAX",
    "HEADROOM_FALLING",
    "LOSS_DIVERGENCE",  # these three: SIGNALS' codes
    "GRAD_NORM_DIVERGENCE",
    "WEIGHT_NORM_GROWTH",
)


@dataclass(frozen=True, slots=True)
class Occurrences:
    count: int
    steps: tuple[int, ...]  # the first STEPS_KEPT
    last_step: int | None


@dataclass(frozen=True, slots=True)
class Streak:
    """Consecutive records of one rank with the same occurrence."""

    length: int
    first_step: int
    last_step: int
    rank: int


@dataclass(frozen=True, slots=True)
class WarningTally:
    code: str
    count: int
    first_step: int
    last_step: int
    message: str  # the first occurrence's, cut at MESSAGE_KEPT characters
    source: Source  # "telemetry": carried by the lines; "watch": derived here


@dataclass(frozen=True, slots=True)
class NonFiniteStep:
    """The first step with a non-finite part, and the ranks it began on."""

    step: int
    rank: int  # the first origin rank
    part: str  # its part: loss:nan, grad:posinf, update:neginf...
    origin_ranks: tuple[int, ...] = ()  # the ranks at the earliest stage (spec section 11)
    origin: str = ONE_RANK  # ONE_RANK, SOME_RANKS or ALL_RANKS (records.ORIGINS)
    parts: tuple[tuple[int, str], ...] = ()  # (rank, part) of every rank non-finite there


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank's share of the records."""

    rank: int
    records: int
    first_step: int | None
    last_step: int | None
    holds: int
    skips: int
    nonfinite: int
    first_nonfinite: str | None  # "STEP PART"
    warnings: int  # warning occurrences the lines carry


@dataclass(frozen=True, slots=True)
class ScaleSummary:
    first: float
    last: float
    min: float
    max: float
    backoffs: Occurrences
    longest_backoff_streak: Streak | None


@dataclass(frozen=True, slots=True)
class HeadroomTrend:
    """Gradient headroom over the last window of one rank (the one with the least)."""

    rank: int
    dtype: str
    points: int
    first_step: int
    last_step: int
    first_bits: float
    last_bits: float
    min_bits: float
    slope_bits_per_step: float | None  # least squares; None with one point
    steps_to_zero: float | None  # at that slope, when falling

    @property
    def direction(self) -> str:
        slope = self.slope_bits_per_step
        if slope is None or abs(slope) * max(1, self.last_step - self.first_step) < 1.0:
            return "steady"  # less than a bit over the window
        return "falling" if slope < 0 else "rising"


@dataclass(frozen=True, slots=True)
class ValueRange:
    """A recorded value over the records: the first, the last, the least, the most."""

    first: float
    last: float
    min: float
    max: float


@dataclass(frozen=True, slots=True)
class ComputeHeadroom:
    """Headroom of the reduced-precision compute to its own dtype's max, in
    bits: the least of the model's output and the sampled activations, at the
    last record that had one and at its least."""

    dtype: str
    where: str  # output, act/<module> or probe/<name>
    step: int
    rank: int
    bits: float  # 0 when non-finite
    nonfinite: bool  # the values held a NaN or infinity at that step
    min_bits: float  # the least over finite values (non-finite only while none was)
    min_step: int
    min_where: str
    min_dtype: str
    min_nonfinite: bool


@dataclass(frozen=True, slots=True)
class ActivationSample:
    """The last record with sampled activations: its step, rank and extremes."""

    step: int
    rank: int
    activations: ActivationStats


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """Something a live watcher says as it happens.

    kind: warning, hold, nonfinite, bad_line, incomplete, following, rotated,
    truncated, missing.
    """

    kind: str
    message: str
    step: int | None = None
    line: int | None = None
    code: str | None = None
    source: Source | None = None


@dataclass(frozen=True, slots=True)
class WatchSummary:
    path: str
    window: int
    since: int | None
    lines: int
    records: int  # valid records at or after --since
    before_since: int  # valid records before --since, read and set aside
    bad_lines: int
    bad_examples: tuple[BadLine, ...]
    incomplete: IncompleteLine | None
    run_ids: tuple[str, ...]
    ranks: tuple[int, ...]
    world_size: int | None
    first_step: int | None
    last_step: int | None
    first_time: float | None
    last_time: float | None
    step_regressions: int  # a rank's step lower than its previous one (a resume)
    holds: Occurrences
    skips: Occurrences
    longest_skip_streak: Streak | None
    scaler_overflows: Occurrences
    scale: ScaleSummary | None
    nonfinite: Occurrences
    first_nonfinite: NonFiniteStep | None
    warnings: tuple[WarningTally, ...]  # by first step
    headroom: HeadroomTrend | None
    bundles: tuple[str, ...]
    last: TelemetryRecord | None
    series: tuple[SeriesBucket, ...]
    rotations: int
    truncations: int
    learning_rate: ValueRange | None = None  # the first parameter group's lr
    compute_headroom: ComputeHeadroom | None = None
    activations_sampled: ActivationSample | None = None
    files: tuple[str, ...] = ()  # the files of a job read together (none: one file)
    rank_rows: tuple[RankRow, ...] = ()  # per rank, in rank order

    @property
    def first_warning_step(self) -> int | None:
        return min((w.first_step for w in self.warnings), default=None)

    @property
    def status(self) -> str:
        """ALARM (a hold or a non-finite step), WARNINGS (warnings or bad lines),
        OK, or EMPTY (no record)."""
        if self.holds.count or self.nonfinite.count:
            return "ALARM"
        if not (self.records or self.before_since):
            return "EMPTY"  # nothing parseable, whatever else the file holds
        return "WARNINGS" if self.warnings or self.bad_lines else "OK"

    def exit_code(self, *, fail_on_warnings: bool = False) -> Exit:
        status = self.status
        if status == "ALARM":
            return Exit.HOLD
        if status == "EMPTY":
            return Exit.REJECTED
        if status == "WARNINGS" and fail_on_warnings:
            return Exit.WARNINGS
        return Exit.CONTINUE


_RECENT_STEPS = 256  # steps whose ranks a _Seen remembers, to count a step once


class _Seen:
    """Occurrences being counted, once per step: another rank's record of a
    step counted lately is not counted again (the same rank's, a resume, is)."""

    __slots__ = ("count", "last", "recent", "steps")

    def __init__(self) -> None:
        self.count = 0
        self.steps: list[int] = []
        self.last: int | None = None
        self.recent: dict[int, set[int]] = {}

    def add(self, step: int, rank: int = 0) -> None:
        ranks = self.recent.get(step)
        if ranks is not None and rank not in ranks:
            ranks.add(rank)
            return
        self.recent[step] = {rank}
        if len(self.recent) > _RECENT_STEPS:
            del self.recent[next(iter(self.recent))]
        self.count += 1
        self.last = step
        if len(self.steps) < STEPS_KEPT:
            self.steps.append(step)

    def frozen(self) -> Occurrences:
        return Occurrences(self.count, tuple(self.steps), self.last)


class _Run:
    """A streak being counted; ``best`` is the longest so far."""

    __slots__ = ("first", "length")

    def __init__(self) -> None:
        self.length = 0
        self.first = 0

    def extend(self, on: bool, step: int, rank: int, best: Streak | None) -> Streak | None:
        if not on:
            self.length = 0
            return best
        if self.length == 0:
            self.first = step
        self.length += 1
        if best is None or self.length > best.length:
            return Streak(self.length, self.first, step, rank)
        return best


class _Tally:
    __slots__ = ("code", "count", "first", "last", "message", "source")

    def __init__(self, code: str, step: int, message: str, source: Source) -> None:
        self.code = code
        self.count = 0
        self.first = step
        self.last = step
        self.message = message[:MESSAGE_KEPT]
        self.source: Source = source

    def frozen(self) -> WarningTally:
        return WarningTally(self.code, self.count, self.first, self.last, self.message, self.source)


class _Rank:
    """What one rank's previous records leave for the next one."""

    __slots__ = (
        "backoffs",
        "divergence",
        "dtype",
        "falling",
        "first_nonfinite",
        "first_step",
        "held",
        "nonfinite",
        "records",
        "scale",
        "skipped",
        "skips",
        "step",
        "trend",
        "warnings",
    )  # fmt: skip

    def __init__(self, window: int) -> None:
        self.records = 0
        self.first_step: int | None = None
        self.held = self.skipped = self.nonfinite = self.warnings = 0
        self.first_nonfinite: str | None = None
        self.divergence = {signal: Divergence(DEFAULT_LIMITS[signal]) for signal in SIGNALS}
        self.step: int | None = None
        self.scale: float | None = None
        self.skips = _Run()
        self.backoffs = _Run()
        self.trend = SlidingTrend(window)
        self.dtype = ""
        self.falling = False


_OVERFLOW_RANK = -1  # ranks beyond MAX_RANKS share this state
# The stage (records.STAGE_ORDER) of each part a record can have non-finite.
_PART_STAGES = {"loss": "loss", "grad": "backward", "update": "optimizer"}

_RANK, _WORLD, _STEP, _SCALE = (attrgetter(n) for n in ("rank", "world_size", "step", "scale"))
_RUN_ID, _BUNDLE, _LOSS, _GRAD = (attrgetter(n) for n in ("run_id", "bundle", "loss", "grad"))
_HEADROOM, _MAX_ABS = attrgetter("headroom_bits"), attrgetter("max_abs")
# What a headroom that is a lower bound was taken from (grad_headroom_from).
_BOUNDS = {"tensor_norm": "largest per-tensor L2 norm", "total_norm": "total gradient norm"}
_NORM, _WEIGHT_NORM, _OUTPUT = (attrgetter(n) for n in ("norm", "weight_norm", "output"))


_LR = attrgetter("lr")


def _extreme_bits(stats: ActivationStats | CommonOutput) -> float | None:
    """An output or activations extreme's headroom, given or derived."""
    bits = stats.headroom_bits
    return bits if bits is not None else headroom_bits(stats.max_abs, stats.dtype)


def _output_plain(output: CommonOutput) -> bool:
    """An output extreme with at least 1 bit of headroom: nothing to warn about."""
    bits = output.headroom_bits
    if bits is None:
        bits = headroom_bits(output.max_abs, output.dtype)
    return bits is None or bits >= 1.0


def _span_seen(kept: list[float] | None, value: float) -> list[float]:
    """A series' [first, last, min, max] with ``value`` seen next (updated in place)."""
    if kept is None:
        return [value, value, value, value]
    kept[1] = value
    if value < kept[2]:
        kept[2] = value
    elif value > kept[3]:
        kept[3] = value
    return kept


def _never_falls(scales: list[float | None], known: bool) -> bool:
    """No loss-scale backoff within ``scales``: all None, or all known and not
    decreasing, with some scale known before (the run's first against the
    rank's last is _plain_start's)."""
    if scales.count(None) == len(scales):
        return True
    if None in scales or not known:
        return False
    return all(map(ge, islice(scales, 1, None), scales))  # type: ignore[arg-type]


class _Columns:
    """A run of uneventful lines, column by column (built once, by map in C)."""

    __slots__ = ("bits", "grads", "scales", "signals", "steps", "world")

    def __init__(self, lines: list[CommonLine], world: int) -> None:
        self.world = world
        self.steps: list[int] = list(map(_STEP, lines))
        self.scales: list[float | None] = list(map(_SCALE, lines))
        self.grads = list(map(_GRAD, lines))
        self.bits: list[float | None] = list(map(_HEADROOM, self.grads))
        # The divergence detectors' series, in SIGNALS' order.
        self.signals: tuple[list[float | None], ...] = (
            list(map(_LOSS, lines)),
            list(map(_NORM, self.grads)),
            list(map(_WEIGHT_NORM, lines)),
        )

    def steps_rise(self) -> bool:
        steps = self.steps
        return all(map(lt, steps, islice(steps, 1, None)))


class Summariser:
    """Feed records in file order; ask for the summary at any time."""

    def __init__(
        self,
        path: str = "",
        *,
        since: int | None = None,
        window: int = DEFAULT_WINDOW,
        files: tuple[str, ...] = (),
    ) -> None:
        if window < TREND_MIN_POINTS:
            raise ValueError(f"the window must hold at least {TREND_MIN_POINTS} records")
        self.path = path
        self.files = files  # a job's files read together, when more than one
        self.since = since
        self.window = window
        self.records = 0
        self.before_since = 0
        self.bad_lines = 0
        self.bad_examples: list[BadLine] = []
        self.incomplete: IncompleteLine | None = None
        self.rotations = 0
        self.truncations = 0
        self._run_ids: dict[str, None] = {}
        self._ranks: dict[int, _Rank] = {}
        self._world_size: int | None = None
        self._first: TelemetryRecord | None = None
        self._last: TelemetryRecord | None = None
        self._last_raw: bytes | None = None  # the last record's line, when add_line counted it
        self._regressions = 0
        self._holds, self._skips, self._overflows = _Seen(), _Seen(), _Seen()
        self._backoffs, self._nonfinite = _Seen(), _Seen()
        self._skip_best: Streak | None = None
        self._backoff_best: Streak | None = None
        self._scale: list[float] | None = None  # first, last, min, max
        self._first_nonfinite_step: int | None = None
        self._first_parts: dict[int, str] = {}  # rank: part, at the first non-finite step
        self._tallies: dict[str, _Tally] = {}
        self._bundles: dict[str, None] = {}
        self._series = Downsampler()
        self._lr: list[float] | None = None  # first, last, min, max
        self._compute: ComputeHeadroom | None = None
        self._activations: ActivationSample | None = None

    # ------------------------------------------------------------ feeding

    def add(self, record: TelemetryRecord) -> list[WatchEvent]:
        """Count one record; returns what a live watcher should say about it."""
        step = record.step
        if self.since is not None and step < self.since:
            self.before_since += 1
            return []
        self.records += 1
        state = self._rank(record)
        events: list[WatchEvent] = []
        self._scaler(record, state)
        part = record.nonfinite_part()
        if part is not None:
            self._record_nonfinite(record, part, state, events)
        state.records += 1
        state.warnings += len(record.warnings)
        if record.held:
            self._holds.add(step, record.rank)
            state.held += 1
            where = f"; bundle {record.bundle}" if record.bundle else ""
            message = f"the sentinel held the update (rank {record.rank}){where}"
            events.append(WatchEvent("hold", message, step=step))
        if record.bundle is not None and len(self._bundles) < MAX_RUN_IDS:
            self._bundles[record.bundle] = None
        for warning in record.warnings:
            self._warn(warning.code, step, warning.message, "telemetry", events)
        bits = self._derived_warnings(record, state, events)
        self._divergence(record, state, events)
        grad, lr = record.grad, record.lr
        if lr is not None:
            self._lr_seen(lr)
        if record.activations is not None:
            self._activations = ActivationSample(step, record.rank, record.activations)
        self._series.add(
            step,
            record.loss,
            grad.max_abs,
            bits,
            record.scale,
            record.skipped,
            record.held,
            part is not None,
            grad.norm,
            lr,
            self._compute_seen(record),
        )
        state.step = step
        self._last, self._last_raw = record, None
        return events

    def add_line(self, line: CommonLine, raw: bytes) -> bool:
        """Count an uneventful line (``COMMON_LINE`` decoded it from ``raw``; the
        rank bound :func:`common_line` adds is checked here) quietly, as
        :meth:`add` would count its record, without building one; False, with
        nothing counted, for a line :meth:`add` must see: a rank not seen before
        or past the rank bound, a headroom warning, or rank >= world_size."""
        step, rank, grad = line.step, line.rank, line.grad
        if self.since is not None and step < self.since:
            if rank >= line.world_size:
                return False
            self.before_since += 1
            return True
        state = self._ranks.get(rank)
        headroom = grad.headroom_bits
        bits = headroom if headroom is not None else headroom_bits(grad.max_abs, grad.dtype)
        if state is None or headroom_code(bits) is not None or rank >= line.world_size:
            return False
        signals = (line.loss, grad.norm, line.weight_norm)
        detectors = state.divergence.values()
        if not all(d.cannot_warn([v]) for d, v in zip(detectors, signals, strict=True)):
            return False
        if line.output is not None and not _output_plain(line.output):
            return False
        for detector, value in zip(detectors, signals, strict=True):
            detector.add(step, value)
        self.records += 1
        state.records += 1
        if line.run_id not in self._run_ids and len(self._run_ids) < MAX_RUN_IDS:
            self._run_ids[line.run_id] = None
        if line.world_size > self._world_size:  # type: ignore[operator]  # set by add(), first
            self._world_size = line.world_size
        if state.step is not None and step < state.step:
            self._regressions += 1
        if state.skips.length:  # not skipped: the streak ends
            self._skip_best = state.skips.extend(False, step, rank, self._skip_best)
        scale, bundle = line.scale, line.bundle
        if scale is not None:
            self._scale_seen(state, scale, step, rank)
        if bundle is not None and len(self._bundles) < MAX_RUN_IDS:
            self._bundles[bundle] = None
        if bits is not None:
            self._trend(state, step, bits, grad.dtype or "unknown dtype", None)
        lr, output = line.lr, line.output
        if lr is not None:
            self._lr_seen(lr)
        compute = None
        if output is not None and (compute := _extreme_bits(output)) is not None:
            self._compute_point(step, rank, compute, "output", output.dtype or "unknown dtype")
        self._series.add(
            step, line.loss, grad.max_abs, bits, scale, grad_norm=grad.norm, lr=lr,
            compute_headroom=compute,
        )  # fmt: skip
        state.step = step
        self._last, self._last_raw = None, raw
        return True

    def add_lines(self, lines: list[CommonLine], last_raw: bytes) -> bool:
        """Count a run of uneventful lines (``last_raw`` is the last one's text)
        at once, as :meth:`add_line` would one by one; False, with nothing
        counted, unless the run is plain: one rank already seen, whose steps
        rise past its last and whose loss scale never falls, headroom of at
        least 1 bit that provably cannot trip HEADROOM_FALLING, no bundle."""
        state = self._plain_start(lines)
        run = None if state is None else self._plain_run(lines, state)
        if state is None or run is None:
            return False
        self.records += len(lines)
        state.records += len(lines)
        for detector, values in zip(state.divergence.values(), run.signals, strict=True):
            detector.extend(run.steps, values)
        for run_id in dict.fromkeys(map(_RUN_ID, lines)):
            if run_id not in self._run_ids and len(self._run_ids) < MAX_RUN_IDS:
                self._run_ids[run_id] = None
        if run.world > self._world_size:  # type: ignore[operator]  # set by add(), first
            self._world_size = run.world
        scales, bits = run.scales, run.bits
        if scales[-1] is not None:  # then all are (_plain_run), and one was before
            known = cast("list[float]", scales)
            kept = self._scale
            assert kept is not None
            kept[1] = state.scale = known[-1]
            kept[2] = min(kept[2], min(known))
            kept[3] = max(kept[3], max(known))
        if bits[-1] is not None:  # then all are
            state.dtype = lines[-1].grad.dtype or "unknown dtype"
            state.trend.extend(run.steps, cast("list[float]", bits))
            state.falling = False
        losses, max_abs = list(map(_LOSS, lines)), list(map(_MAX_ABS, run.grads))
        lrs = list(map(_LR, lines))
        for lr in lrs:
            if lr is not None:
                self._lr_seen(lr)
        compute = self._compute_run(lines, run.steps)
        self._series.extend(run.steps, losses, max_abs, bits, scales, run.signals[1], lrs, compute)
        state.step = run.steps[-1]
        self._last, self._last_raw = None, last_raw
        return True

    def _plain_start(self, lines: list[CommonLine]) -> _Rank | None:
        """For add_lines: the rank's state when the first line leaves nothing to
        say (no streak ends, no backoff, no regression, not before --since)."""
        first = lines[0]
        state = self._ranks.get(first.rank)
        if state is None or state.skips.length or state.backoffs.length or len(lines) < 2:
            return None
        step, scale = first.step, first.scale
        if (
            (state.step is not None and step <= state.step)
            or (self.since is not None and step < self.since)
            or (scale is not None and state.scale is not None and scale < state.scale)
        ):
            return None
        return state

    def _plain_run(self, lines: list[CommonLine], state: _Rank) -> _Columns | None:
        """For add_lines: the run's columns when every line is plain, or None."""
        rank = lines[0].rank
        ranks, worlds = list(map(_RANK, lines)), list(map(_WORLD, lines))
        bundles = list(map(_BUNDLE, lines))
        if (
            ranks.count(rank) != len(ranks)
            or min(worlds) <= rank
            or bundles.count(None) != len(bundles)
        ):
            return None
        run = _Columns(lines, max(worlds))
        if not _never_falls(run.scales, self._scale is not None) or not run.steps_rise():
            return None
        detectors = state.divergence.values()
        if not all(d.cannot_warn(v) for d, v in zip(detectors, run.signals, strict=True)):
            return None  # some line may warn: add_line says which
        outputs = [o for o in map(_OUTPUT, lines) if o is not None]
        if not all(map(_output_plain, outputs)):
            return None
        bits = run.bits
        if None in bits:
            # Unknown headroom (no trend) only with no magnitude to derive it from.
            known = list(map(_MAX_ABS, run.grads))
            plain = bits.count(None) == len(bits) == known.count(None)
            return run if plain else None
        least: float = min(bits)  # type: ignore[type-var, assignment]
        if least < 1.0:
            return None
        steepest = state.trend.steepest(run.steps, bits, TREND_MIN_POINTS)  # type: ignore[arg-type]
        # The trend might warn on some line when it could be that steep: add_line says where.
        return run if steepest * self.window < least else None

    def add_bad(self, bad: BadLine) -> WatchEvent:
        self.bad_lines += 1
        if len(self.bad_examples) < BAD_LINES_KEPT:
            self.bad_examples.append(bad)
        return WatchEvent("bad_line", f"{bad.kind}: {bad.reason}", line=bad.line, code=bad.kind)

    def add_incomplete(self, incomplete: IncompleteLine | None) -> None:
        """The file ends inside this line (or, with None, no longer does)."""
        self.incomplete = incomplete

    def notice(self, kind: str, message: str) -> WatchEvent:
        """A follower's notice: rotated, truncated, missing or following."""
        if kind == "rotated":
            self.rotations += 1
        elif kind == "truncated":
            self.truncations += 1
        return WatchEvent(kind, message)

    # ------------------------------------------------------------ the parts

    def _rank(self, record: TelemetryRecord) -> _Rank:
        if self._first is None:
            self._first = record
        if record.run_id not in self._run_ids and len(self._run_ids) < MAX_RUN_IDS:
            self._run_ids[record.run_id] = None
        if self._world_size is None or record.world_size > self._world_size:
            self._world_size = record.world_size
        state = self._ranks.get(record.rank)
        if state is None:
            key = record.rank if len(self._ranks) < MAX_RANKS else _OVERFLOW_RANK
            state = self._ranks.setdefault(key, _Rank(self.window))
            if state.first_step is None:
                state.first_step = record.step
        if state.step is not None and record.step < state.step:
            self._regressions += 1
        return state

    def _scaler(self, record: TelemetryRecord, state: _Rank) -> None:
        step, rank, scale, skipped = record.step, record.rank, record.scale, record.skipped
        if skipped:
            self._skips.add(step, rank)
            state.skipped += 1
            if record.found_inf is True:
                self._overflows.add(step, rank)
        if skipped or state.skips.length:  # a streak to extend or to end
            self._skip_best = state.skips.extend(skipped, step, rank, self._skip_best)
        if scale is not None:
            self._scale_seen(state, scale, step, rank)

    def _scale_seen(self, state: _Rank, scale: float, step: int, rank: int) -> None:
        backoff = state.scale is not None and scale < state.scale
        if backoff:
            self._backoffs.add(step, rank)
        if backoff or state.backoffs.length:
            self._backoff_best = state.backoffs.extend(backoff, step, rank, self._backoff_best)
        state.scale = scale
        self._scale = _span_seen(self._scale, scale)

    def _lr_seen(self, lr: float) -> None:
        self._lr = _span_seen(self._lr, lr)

    def _compute_seen(self, record: TelemetryRecord) -> float | None:
        """The record's compute headroom (the least of its output and sampled
        activations) into the summary; returns it."""
        least: tuple[float, str, str | None, bool] | None = None
        for stats, name in ((record.output, "output"), (record.activations, "activations")):
            if stats is None:
                continue
            bits, where, nonfinite = _extreme_bits(stats), stats.where or name, False
            if stats.nonfinite:  # it overflowed (or went NaN): no headroom left
                bits, where, nonfinite = 0.0, stats.nonfinite[0], True
            if bits is not None and (least is None or bits < least[0]):
                least = (bits, where, stats.dtype, nonfinite)
        if least is None:
            return None
        bits, where, dtype, nonfinite = least
        if dtype is None:  # a non-finite output has no finite value to name its dtype
            dtype = "unknown dtype" if self._compute is None else self._compute.dtype
        self._compute_point(record.step, record.rank, bits, where, dtype, nonfinite)
        return bits

    def _compute_run(self, lines: list[CommonLine], steps: list[int]) -> list[float | None] | None:
        """For add_lines: each line's output headroom into the summary (None
        when no line has an output)."""
        outputs = list(map(_OUTPUT, lines))
        if outputs.count(None) == len(outputs):
            return None
        found: list[float | None] = []
        for line, step, output in zip(lines, steps, outputs, strict=True):
            bits = None if output is None else _extreme_bits(output)
            if output is not None and bits is not None:
                self._compute_point(
                    step, line.rank, bits, "output", output.dtype or "unknown dtype"
                )
            found.append(bits)
        return found

    def _compute_point(
        self, step: int, rank: int, bits: float, where: str, dtype: str, nonfinite: bool = False
    ) -> None:
        """A compute headroom; the least is kept over finite values (a
        non-finite one only until a finite one is seen), so the approach to
        the max stays on screen after the overflow."""
        kept = self._compute
        if kept is None or (not nonfinite and (kept.min_nonfinite or bits < kept.min_bits)):
            least = (bits, step, where, dtype, nonfinite)
        else:
            least = (
                kept.min_bits,
                kept.min_step,
                kept.min_where,
                kept.min_dtype,
                kept.min_nonfinite,
            )
        self._compute = ComputeHeadroom(dtype, where, step, rank, bits, nonfinite, *least)

    def _record_nonfinite(
        self, record: TelemetryRecord, part: str, state: _Rank, events: list[WatchEvent]
    ) -> None:
        step, rank = record.step, record.rank
        self._nonfinite.add(step, rank)
        state.nonfinite += 1
        if state.first_nonfinite is None:
            state.first_nonfinite = f"{step} {part}"
        first = self._first_nonfinite_step
        if first is None or step < first:  # a job's files may be read out of step order
            self._first_nonfinite_step, self._first_parts = step, {rank: part}
        elif step == first:
            self._first_parts.setdefault(rank, part)
        what, kind = part.split(":")
        message = f"non-finite {what} ({kind}) on rank {record.rank}"
        events.append(WatchEvent("nonfinite", message, step=record.step, code=part))

    def _origin(self) -> NonFiniteStep | None:
        """The first non-finite step and its origin: the ranks whose part is at
        the earliest stage there (loss, then gradients, then the update), as an
        incident set names its origin ranks."""
        step, parts = self._first_nonfinite_step, self._first_parts
        if step is None:
            return None
        stages = {
            rank: STAGE_ORDER.index(_PART_STAGES[p.split(":")[0]]) for rank, p in parts.items()
        }
        earliest = min(stages.values())
        ranks = tuple(sorted(rank for rank, index in stages.items() if index == earliest))
        origin = origin_of(ranks, self._world_size)
        return NonFiniteStep(
            step, ranks[0], parts[ranks[0]], ranks, origin, tuple(sorted(parts.items()))
        )

    def _warn(
        self, code: str, step: int, message: str, source: Source, events: list[WatchEvent] | None
    ) -> None:
        tally = self._tallies.get(code)
        if tally is None:
            if len(self._tallies) >= MAX_CODES:
                code = "OTHER_CODES"
                message = f"(more than {MAX_CODES} distinct codes) {message}"
            tally = self._tallies.setdefault(code, _Tally(code, step, message, source))
        # A follower is told a warning at its onset, and again only after a step
        # without it: a trend warned every step would drown the stream.
        onset = tally.count == 0 or step > tally.last + 1
        tally.count += 1
        tally.last = step
        if events is not None and onset:
            events.append(WatchEvent("warning", message, step=step, code=code, source=source))

    def _derived_warnings(
        self, record: TelemetryRecord, state: _Rank, events: list[WatchEvent]
    ) -> float | None:
        """Headroom warnings the line does not carry itself; returns the headroom."""
        grad = record.grad
        bits = grad.headroom_bits
        if bits is None:
            bits = headroom_bits(grad.max_abs, grad.dtype)
            if bits is None:
                return None
        step = record.step
        dtype = grad.dtype or "unknown dtype"
        code = headroom_code(bits)
        if code is not None and all(w.code != code for w in record.warnings):
            # A line may give the headroom without the magnitude it came from.
            what = (
                "gradient headroom"
                if grad.max_abs is None
                else f"gradient max abs {grad.max_abs:.6g}"
            )
            message = f"{what} is {bits:.2f} bits below the {dtype} max"
            bound = _BOUNDS.get(record.grad_headroom_from or "")
            if bound is not None:
                message += f" (at least: bounded by the {bound})"
            self._warn(code, step, message, "watch", events)
        self._trend(state, step, bits, dtype, events)
        return bits

    def _divergence(self, record: TelemetryRecord, state: _Rank, events: list[WatchEvent]) -> None:
        """The sentinel's divergence rule on this rank's series, and the model
        output's headroom, where the line does not carry the warning itself."""
        step, carried = record.step, {w.code for w in record.warnings}
        values = (record.loss, record.grad.norm, record.weight_norm)
        for (signal, detector), value in zip(state.divergence.items(), values, strict=True):
            rise = detector.add(step, value)
            code, name = SIGNALS[signal]
            if rise is not None and code not in carried:
                self._warn(code, step, rise.describe(name), "watch", events)
        output = record.output
        bits = None if output is None else output.headroom_bits
        if output is not None and bits is None:
            bits = headroom_bits(output.max_abs, output.dtype)
        warning = headroom_code(bits) if output is not None else None
        if output is not None and warning is not None and warning not in carried:
            message = (
                f"model output max abs {output.max_abs:.6g} is {bits:.2f} bits below"
                f" the {output.dtype} max"
            )
            self._warn(warning, step, message, "watch", events)

    def _trend(
        self, state: _Rank, step: int, bits: float, dtype: str, events: list[WatchEvent] | None
    ) -> None:
        """The headroom into its rank's trend; HEADROOM_FALLING when it warns."""
        state.dtype = dtype
        trend = state.trend
        slope = trend.add(step, bits)
        # Falling: the line reaches 0 bits within the window, having dropped
        # TREND_MIN_DROP_BITS over it, seen through at least TREND_MIN_POINTS.
        if (
            slope is None or slope >= 0 or len(trend) < TREND_MIN_POINTS
            or -slope * trend.span() < TREND_MIN_DROP_BITS or bits / -slope > self.window
        ):  # fmt: skip
            state.falling = False
            return
        message = (
            f"gradient headroom {bits:.1f} bits ({dtype}), falling {-slope:.2f} bits/step:"
            f" the dtype's max in about {bits / -slope:.0f} steps at this rate"
        )
        self._warn(
            "HEADROOM_FALLING", step, message, "watch", events if not state.falling else None
        )
        state.falling = True

    # ------------------------------------------------------------ freezing

    def _headroom(self) -> HeadroomTrend | None:
        """The trend of the rank whose last headroom is least."""
        candidates = [(s.trend.ys[-1], r, s) for r, s in self._ranks.items() if s.trend.ys]
        if not candidates:
            return None
        _, rank, state = min(candidates, key=lambda c: (c[0], c[1]))
        trend = state.trend
        values = list(trend.ys)
        slope = trend.slope()
        last = values[-1]
        to_zero = last / -slope if slope is not None and slope < 0 else None
        return HeadroomTrend(
            rank, state.dtype, len(values), trend.first_step(), trend.last_step(),
            values[0], last, min(values), slope, to_zero,
        )  # fmt: skip

    def _scale_summary(self) -> ScaleSummary | None:
        if self._scale is None:
            return None
        first, last, low, high = self._scale
        return ScaleSummary(first, last, low, high, self._backoffs.frozen(), self._backoff_best)

    def summary(self, lines: int = 0) -> WatchSummary:
        """The summary so far; ``lines`` is how many lines the reader has read."""
        first, last = self._first, self._last
        if self._last_raw is not None:
            last = parse_record(orjson.loads(self._last_raw))
        tallies = sorted(self._tallies.values(), key=lambda t: (t.first, t.code))
        return WatchSummary(
            path=self.path,
            window=self.window,
            since=self.since,
            lines=lines,
            records=self.records,
            before_since=self.before_since,
            bad_lines=self.bad_lines,
            bad_examples=tuple(self.bad_examples),
            incomplete=self.incomplete,
            run_ids=tuple(self._run_ids),
            ranks=tuple(sorted(r for r in self._ranks if r != _OVERFLOW_RANK)),
            world_size=self._world_size,
            first_step=None if first is None else first.step,
            last_step=None if last is None else last.step,
            first_time=None if first is None else first.time,
            last_time=None if last is None else last.time,
            step_regressions=self._regressions,
            holds=self._holds.frozen(),
            skips=self._skips.frozen(),
            longest_skip_streak=self._skip_best,
            scaler_overflows=self._overflows.frozen(),
            scale=self._scale_summary(),
            nonfinite=self._nonfinite.frozen(),
            first_nonfinite=self._origin(),
            warnings=tuple(t.frozen() for t in tallies),
            headroom=self._headroom(),
            bundles=tuple(self._bundles),
            last=last,
            series=self._series.buckets(),
            rotations=self.rotations,
            truncations=self.truncations,
            learning_rate=None if self._lr is None else ValueRange(*self._lr),
            compute_headroom=self._compute,
            activations_sampled=self._activations,
            files=self.files,
            rank_rows=self._rank_rows(),
        )

    def _rank_rows(self) -> tuple[RankRow, ...]:
        return tuple(
            RankRow(
                rank,
                state.records,
                state.first_step,
                state.step,
                state.held,
                state.skipped,
                state.nonfinite,
                state.first_nonfinite,
                state.warnings,
            )
            for rank, state in sorted(self._ranks.items())
            if rank != _OVERFLOW_RANK
        )
