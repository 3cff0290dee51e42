"""The sentinel's telemetry: the early warnings behind its line, and the writer
that never ends a run.

Framework-free: the torch sentinel builds each step's
:class:`~nanrunbook.telemetry.record.TelemetryRecord` (the one record of the
``nanrunbook-telemetry/1`` line, documented in ``nanrunbook-sentinel(7)``) from
device values it read once per step, and :class:`TelemetryFile` writes it
through :class:`~nanrunbook.telemetry.sinks.JsonlSink`; a JAX sentinel would do
the same.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

# The line (its one record, serialiser and writer) and the headroom arithmetic
# have one home, beside the reader.
from nanrunbook.telemetry._early import (
    DEFAULT_LIMITS,
    SIGNALS,
    Divergence,
    DivergenceLimits,
    float32_norm_overflow,
)
from nanrunbook.telemetry.record import (
    TELEMETRY_FORMAT,
    HeadroomSource,
    LossClass,
    TelemetryLineError,
    TelemetryRecord,
    TelemetryWarning,
    headroom_bits,
)
from nanrunbook.telemetry.sinks import JsonlSink
from nanrunbook.warning_codes import WARNING_CODES

__all__ = [
    "TELEMETRY_FORMAT",
    "EarlyWarnings",
    "HeadroomSource",
    "LostLines",
    "TelemetryFile",
    "Thresholds",
    "alert",
    "divergence_alerts",
    "finite_or_none",
    "headroom_bits",
    "loss_class",
    "magnitude_alerts",
    "mean_loss",
    "norm_overflow_alerts",
]

log = logging.getLogger("nanrunbook.sentinel")


def finite_or_none(value: float | None) -> float | None:
    """A number for the line: JSON has no NaN or infinity, so such a value is
    recorded as unknown (null), which the record's serialiser requires."""
    return value if value is not None and math.isfinite(value) else None


def alert(code: str, message: str) -> TelemetryWarning:
    """A warning the sentinel puts in its line: a stable code (registered in
    ``nanrunbook.warning_codes``; a reader accepts any, the writer only these)
    and a one-line message with the values behind it."""
    if code not in WARNING_CODES:
        raise ValueError(f"unknown warning code {code!r}")
    return TelemetryWarning(code, message)


class TelemetryFile:
    """The sentinel's telemetry file: each record written through a
    :class:`JsonlSink` (opened at the first line, its directory created), so a
    reader tailing the file sees complete lines.

    Telemetry never ends a healthy run: a line that cannot be written (a full
    disk, a vanished mount, a record the serialiser refuses) is counted, not
    raised, and the failure is logged once per gap; a write that stopped
    part-way is cut back off the file (by the sink). The first line written
    again carries a TELEMETRY_LINES_LOST warning naming how many lines were lost
    and between which steps (:attr:`lost` until then)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._sink: JsonlSink | None = None
        self.lost: LostLines | None = None  # the current gap, until a line is written

    def append(self, record: TelemetryRecord) -> None:
        gap = self.lost
        if gap is not None:
            record = replace(record, warnings=(*record.warnings, gap.alert()))
        try:
            if self._sink is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._sink = JsonlSink(self.path)
            self._sink.emit(record)
        except (OSError, TelemetryLineError) as error:
            if gap is None:
                log.warning(
                    "telemetry: cannot write %s (%s): training goes on; lost lines are"
                    " counted and recorded in the next line written",
                    self.path,
                    error,
                )
                gap = LostLines(0, record.step, record.step, str(error))
            self.lost = LostLines(gap.lines + 1, gap.first_step, record.step, gap.error)
            return
        if gap is not None:
            log.warning("telemetry: writing %s again; %s", self.path, gap.alert().message)
            self.lost = None

    def close(self) -> None:
        if self.lost is not None:
            log.warning("telemetry: %s, never written: %s", self.path, self.lost.alert().message)
        if self._sink is not None:
            self._sink.close()
            self._sink = None


@dataclass(frozen=True)
class LostLines:
    """Telemetry lines that could not be written: how many, the steps of the
    first and last, and the error of the first."""

    lines: int
    first_step: int
    last_step: int
    error: str

    def alert(self) -> TelemetryWarning:
        return alert(
            "TELEMETRY_LINES_LOST",
            f"{self.lines} telemetry line(s) could not be written, steps {self.first_step}"
            f" to {self.last_step} ({self.error})",
        )


@dataclass(frozen=True)
class Thresholds:
    """When the sentinel warns and when it holds.

    ``sample_every``: activation extremes (and exact gradient and update
    magnitudes) every N steps, 0 for never. ``spike_*``: GRAD_NORM_SPIKE when
    the gradient norm exceeds ``spike_ratio`` times the median of the last
    ``spike_window`` finite norms, once ``spike_history`` of them are known.
    ``backoff_warn``/``backoff_hold``: consecutive GradScaler skips that warn
    and that hold. ``scale_floor``: hold when the dynamic scale would fall below
    it. ``skip_warn``/``skip_hold``: consecutive skipped updates that warn and,
    under the ``skip`` policy, that hold.

    From the first few steps (``nanrunbook.telemetry._early``): LOSS_DIVERGENCE,
    GRAD_NORM_DIVERGENCE and WEIGHT_NORM_GROWTH when the signal is ``*_ratio``
    times its running minimum and ``divergence_mads`` scaled MADs above its
    median, after ``loss_min_steps`` (the loss) or ``divergence_min_steps``
    (the norms) values, unless the rise is no higher than a cycle the signal
    has already come back from (a periodic loss). ``watch_output_bits``: under
    reduced-precision autocast the model's output extreme is read every step
    (NEAR_DTYPE_MAX below 1 bit of headroom, AT_DTYPE_MAX at 0); below this
    many bits the next steps sample every chosen module until it is back.
    """

    sample_every: int = 100
    spike_ratio: float = 10.0
    spike_window: int = 100
    spike_history: int = 20
    backoff_warn: int = 3
    backoff_hold: int = 10
    scale_floor: float = 1.0
    skip_warn: int = 3
    skip_hold: int = 10
    loss_ratio: float = DEFAULT_LIMITS["loss"].ratio
    grad_norm_ratio: float = DEFAULT_LIMITS["grad_norm"].ratio
    weight_norm_ratio: float = DEFAULT_LIMITS["weight_norm"].ratio
    loss_min_steps: int = DEFAULT_LIMITS["loss"].min_steps
    divergence_mads: float = DEFAULT_LIMITS["loss"].mads
    divergence_min_steps: int = DEFAULT_LIMITS["grad_norm"].min_steps
    watch_output_bits: float = 2.0

    def __post_init__(self) -> None:
        counts = ("sample_every", "spike_window", "spike_history")
        positive = ("backoff_warn", "backoff_hold", "skip_warn", "skip_hold")
        for name in (*counts, *positive):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name in positive):
                raise ValueError(f"{name} must be an integer >= {int(name in positive)}")
        if not self.spike_ratio > 1 or not math.isfinite(self.spike_ratio):
            raise ValueError("spike_ratio must be a finite number > 1")
        if not self.scale_floor > 0 or not math.isfinite(self.scale_floor):
            raise ValueError("scale_floor must be a finite number > 0")
        self.divergence_limits()  # the limits check the divergence fields
        if not self.watch_output_bits >= 0 or not math.isfinite(self.watch_output_bits):
            raise ValueError("watch_output_bits must be a finite number >= 0")

    def divergence_limits(self) -> dict[str, DivergenceLimits]:
        """Per signal (loss, grad_norm, weight_norm), the limits of its detector."""
        ratios = {
            "loss": self.loss_ratio,
            "grad_norm": self.grad_norm_ratio,
            "weight_norm": self.weight_norm_ratio,
        }
        return {
            signal: DivergenceLimits(
                ratio,
                self.divergence_mads,
                self.loss_min_steps if signal == "loss" else self.divergence_min_steps,
            )
            for signal, ratio in ratios.items()
        }


@dataclass
class EarlyWarnings:
    """The state behind the sentinel's warnings: the recent gradient norms, the
    current streaks of scaler backoffs and skipped updates, and the divergence
    detectors of the loss, gradient norm and weight norm."""

    thresholds: Thresholds
    norms: deque[float] = field(default_factory=deque)
    backoffs: int = 0
    skips: int = 0
    divergence: dict[str, Divergence] = field(default_factory=dict)

    def __post_init__(self) -> None:
        limits = self.thresholds.divergence_limits()
        self.divergence = {signal: Divergence(limit) for signal, limit in limits.items()}

    def gradient_norm(self, norm: float | None) -> list[TelemetryWarning]:
        """A robust running statistic, not a frozen early maximum: the median of
        a sliding window, which one outlier does not move."""
        if norm is None or not math.isfinite(norm):
            return []
        t = self.thresholds
        alerts = []
        if len(self.norms) >= t.spike_history:
            median = statistics.median(self.norms)
            if median > 0 and norm > t.spike_ratio * median:
                alerts.append(
                    alert(
                        "GRAD_NORM_SPIKE",
                        f"gradient norm {norm:.4g} is {norm / median:.3g}x the median"
                        f" {median:.4g} of the last {len(self.norms)} steps",
                    )
                )
        self.norms.append(norm)
        while len(self.norms) > t.spike_window:
            self.norms.popleft()
        return alerts

    def scaler(self, found_inf: bool, scale: float, scale_after: float) -> list[TelemetryWarning]:
        self.backoffs = self.backoffs + 1 if found_inf else 0
        alerts = []
        if self.backoffs >= self.thresholds.backoff_warn:
            alerts.append(
                alert(
                    "LOSS_SCALE_BACKOFF_STREAK",
                    f"the loss scale backed off {self.backoffs} steps in a row"
                    f" ({scale:g} -> {scale_after:g})",
                )
            )
        if scale_after < self.thresholds.scale_floor:
            alerts.append(
                alert(
                    "LOSS_SCALE_BELOW_FLOOR",
                    f"the loss scale {scale_after:g} is below the floor"
                    f" {self.thresholds.scale_floor:g}",
                )
            )
        return alerts

    def skipped(self, skipped: bool) -> list[TelemetryWarning]:
        self.skips = self.skips + 1 if skipped else 0
        if self.skips < self.thresholds.skip_warn:
            return []
        return [
            alert(
                "SKIPPED_UPDATE_STREAK",
                f"{self.skips} consecutive steps were skipped without an update",
            )
        ]


# ----------------------------------------------- divergence from the first steps


def divergence_alerts(
    early: EarlyWarnings, signal: str, step: int, value: float | None
) -> list[TelemetryWarning]:
    """Feed ``value`` (the step's loss, gradient norm or weight norm) to its
    detector; the warning, when it rises too far."""
    rise = early.divergence[signal].add(step, value)
    if rise is None:
        return []
    code, name = SIGNALS[signal]
    return [alert(code, rise.describe(name))]


def norm_overflow_alerts(max_abs: float | None) -> list[TelemetryWarning]:
    """GRAD_NORM_OVERFLOW: finite gradients whose float32 norm overflowed."""
    return [alert("GRAD_NORM_OVERFLOW", float32_norm_overflow(max_abs))]


def magnitude_alerts(
    what: str, values: Iterable[tuple[float | None, str | None]]
) -> list[TelemetryWarning]:
    """AT_DTYPE_MAX / NEAR_DTYPE_MAX (as the check's report uses them) for the
    worst of ``values``: (finite max abs, dtype) pairs."""
    known = [
        (bits, max_abs, dtype)
        for max_abs, dtype in values
        if max_abs is not None
        and dtype is not None
        and (bits := headroom_bits(max_abs, dtype)) is not None
    ]
    if not known:
        return []
    bits, max_abs, dtype = min(known)
    if bits <= 0:
        return [alert("AT_DTYPE_MAX", f"{what}: {max_abs:.6g} is {dtype}'s largest finite value")]
    if bits < 1:
        return [
            alert(
                "NEAR_DTYPE_MAX",
                f"{what}: finite max abs {max_abs:.6g} is {bits:.2f} bits below {dtype}'s"
                " largest finite value",
            )
        ]
    return []


def loss_class(values: Iterable[float]) -> LossClass:
    """The worst class among a step's loss values: nan, then posinf, then neginf."""
    seen = set()
    for value in values:
        if math.isnan(value):
            seen.add("nan")
        elif value == math.inf:
            seen.add("posinf")
        elif value == -math.inf:
            seen.add("neginf")
    names: tuple[LossClass, ...] = ("nan", "posinf", "neginf")
    for name in names:
        if name in seen:
            return name
    return "finite"


def mean_loss(values: list[float]) -> float | None:
    """The mean of a step's micro-batch losses; None unless every one is finite."""
    if not values or not all(math.isfinite(v) for v in values):
        return None
    return math.fsum(values) / len(values)
