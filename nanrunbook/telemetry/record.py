"""One telemetry line: the frozen record, its JSON document, the strict parser,
and the fast path's decoder for the uneventful line (watch counts most lines
with it, building no record).

The line format is ``nanrunbook-telemetry/1``: one JSON object per line, appended
once per training step (and per rank), with these fields in this order::

    {"format": "nanrunbook-telemetry/1", "run_id": str, "rank": int,
     "world_size": int, "step": int, "time": float (unix seconds),
     "loss": float | null (null when non-finite),
     "loss_class": "finite" | "nan" | "posinf" | "neginf",
     "grad": {"nan": int, "posinf": int, "neginf": int, "max_abs": float | null,
              "dtype": str | null, "headroom_bits": float | null, "norm": float | null},
     "update": {"nan": int, "posinf": int, "neginf": int, "max_abs": float | null}
               | null,
     "scale": float | null, "found_inf": bool | null, "skipped": bool,
     "held": bool, "warnings": [{"code": str, "message": str}], "bundle": str | null,
     "activations": {"max_abs": ..., "where": ..., "dtype": ..., "headroom_bits": ...,
                     "nonfinite": [str]} | null,
     "lr": float | null,
     "grad_headroom_from": "max_abs" | "tensor_norm" | "total_norm" | null,
     "weight_norm": float | null,
     "output": {"max_abs": float | null, "where": str | null, "dtype": str | null,
                "headroom_bits": float | null, "nonfinite": [str]} | null,
     "reproduced": "REPRODUCED" | "NOT_REPRODUCED" | null}

The sentinel appends ``activations`` (the extremes of a sampled step's module
outputs, same keys as ``output``; null on the steps between samples), ``lr``
(the first parameter group's learning rate) and ``grad_headroom_from``: ``"max_abs"`` when grad.headroom_bits is exact
(from the measured max abs), ``"tensor_norm"`` when it is a lower bound from the
largest per-tensor L2 norm, ``"total_norm"`` when a lower bound from the total
norm clipping computed (|g_i| <= ||g||), null when there is no headroom (or the
writer is older). ``weight_norm`` (the updated parameters' L2 norm) and
``output`` (the model's reduced-precision output extreme, every step) were
appended after it for the early warnings; a line without them reads as null.
``reproduced`` (on a held step, or one skipped under ``transient="rerun"``:
whether its replay on copies came out as the live step did) was appended last.

Fields may be added only at the end; a reader ignores keys it does not know, so a
newer writer's lines still read. A warning code is an upper-case identifier
(``[A-Z][A-Z0-9_]*``, at most 64 characters); codes this version does not know
are still warnings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec
import orjson

from nanrunbook.contract import NEAR_MAX_BITS
from nanrunbook.dtypes import DTYPES
from nanrunbook.records import EarlyWarning, nonfinite_count

__all__ = [
    "COMMON_LINE",
    "HEADROOM_CODES",
    "HEADROOM_SOURCES",
    "LOSS_CLASSES",
    "TELEMETRY_FORMAT",
    "ActivationStats",
    "CommonLine",
    "GradientStats",
    "HeadroomSource",
    "LossClass",
    "TelemetryLineError",
    "TelemetryRecord",
    "TelemetryWarning",
    "UpdateStats",
    "common_line",
    "headroom_bits",
    "headroom_code",
    "loss_fields",
    "parse_record",
    "record_document",
    "record_line",
]

# Each vocabulary once, as the type the record and the fast path's decoder use
# and the tuple a check reads.
TelemetryFormat = Literal["nanrunbook-telemetry/1"]
LossClass = Literal["finite", "nan", "posinf", "neginf"]
HeadroomSource = Literal["max_abs", "tensor_norm", "total_norm"]  # grad_headroom_from's values
TELEMETRY_FORMAT: str = get_args(TelemetryFormat)[0]
LOSS_CLASSES: tuple[LossClass, ...] = get_args(LossClass)
HEADROOM_SOURCES: tuple[HeadroomSource, ...] = get_args(HeadroomSource)
_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


# A line's warning is the one warning record, where its line's step says where.
TelemetryWarning = EarlyWarning


# The three classes below have no __slots__: the parser's common path fills an
# instance's __dict__ in one assignment, measured 2.5x faster than a frozen
# dataclass's __init__ (one object.__setattr__ per field) on a million lines.
@dataclass(frozen=True)
class GradientStats:
    """The gradients of one step, after unscaling, before clipping and the step."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    max_abs: float | None = None  # largest finite magnitude; None when there is none
    dtype: str | None = None  # None when the writer does not know it
    # log2(dtype max / max_abs); None when undefined; a lower bound when max_abs
    # was not measured (grad_headroom_from says from what)
    headroom_bits: float | None = None
    norm: float | None = None  # L2 norm, when the check computed or was handed it

    @property
    def nonfinite(self) -> int:
        return nonfinite_count(self)


@dataclass(frozen=True)
class UpdateStats:
    """What the optimizer step changed (new minus old parameters)."""

    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    max_abs: float | None = None  # measured on sampled steps and with the snapshot

    @property
    def nonfinite(self) -> int:
        return nonfinite_count(self)


@dataclass(frozen=True)
class ActivationStats:
    """The extremes of reduced-precision outputs at one step: the largest finite
    magnitude, whose it is (``act/<module>``, ``probe/<name>``, or ``output``
    for the model's output), its dtype and headroom, and the outputs that held a
    NaN or infinity, in order. Both ``activations`` (sampled steps, every
    chosen module) and ``output`` (every step, the model's output) are one."""

    max_abs: float | None
    where: str | None
    dtype: str | None
    headroom_bits: float | None
    nonfinite: tuple[str, ...] = ()


@dataclass(frozen=True)
class TelemetryRecord:
    """One step of one rank, as the sentinel saw it: the one record of the line,
    built by the sentinel, written by :func:`record_line` and read back by
    :func:`parse_record` whole. Field order is the line's key order (after
    ``format``)."""

    run_id: str
    rank: int
    world_size: int
    step: int
    time: float
    loss: float | None
    loss_class: str
    grad: GradientStats
    update: UpdateStats | None
    scale: float | None
    found_inf: bool | None
    skipped: bool
    held: bool
    warnings: tuple[TelemetryWarning, ...]
    bundle: str | None
    # Appended to the fixed shape, in the line's order. activations and lr are
    # keyword-only, so a record built positionally (grad_headroom_from 16th)
    # still builds as before they were read.
    activations: ActivationStats | None = field(default=None, kw_only=True)
    lr: float | None = field(default=None, kw_only=True)
    grad_headroom_from: str | None = None  # one of HEADROOM_SOURCES
    weight_norm: float | None = None
    output: ActivationStats | None = None
    reproduced: str | None = None  # one of REPRODUCTIONS, on a held or re-run step

    @property
    def overflow_absorbed(self) -> bool:
        """A dynamic loss scaler found inf, skipped the update and will back off:
        its designed probing, not an incident, as long as the unscaled loss is
        finite and nothing non-finite reached the parameters."""
        return (
            self.found_inf is True
            and self.skipped
            and self.loss_class == "finite"
            and (self.update is None or self.update.nonfinite == 0)
        )

    def nonfinite_part(self) -> str | None:
        """What was non-finite at this step and not absorbed by the loss scaler,
        as ``loss:nan``, ``grad:posinf`` or ``update:neginf`` (the first found in
        that order), or None."""
        if self.loss_class != "finite":
            return f"loss:{self.loss_class}"
        if self.grad.nonfinite and not self.overflow_absorbed:
            return f"grad:{_first_kind(self.grad.nan, self.grad.posinf)}"
        if self.update is not None and self.update.nonfinite:
            return f"update:{_first_kind(self.update.nan, self.update.posinf)}"
        return None


def _first_kind(nan: int, posinf: int) -> str:
    return "nan" if nan else "posinf" if posinf else "neginf"


# ------------------------------------------------------------------ writing


def loss_fields(loss: float) -> tuple[float | None, str]:
    """``loss`` and ``loss_class`` for a loss value (strict JSON has no NaN)."""
    if math.isnan(loss):
        return None, "nan"
    if math.isinf(loss):
        return None, "posinf" if loss > 0 else "neginf"
    return float(loss), "finite"


def headroom_bits(max_abs: float | None, dtype: str | None) -> float | None:
    """Bits between a finite largest magnitude and ``dtype``'s largest finite value:
    0 when saturated, below 1 when within a factor of two. None when either is
    unknown or ``max_abs`` is zero (no magnitude, no headroom to speak of)."""
    known = DTYPES.get(dtype) if dtype is not None else None
    if max_abs is None or known is None or known.max_finite is None:
        return None
    if not (max_abs > 0 and math.isfinite(max_abs)):
        return None
    return max(0.0, math.log2(known.max_finite / max_abs))


# The warnings a headroom earns, at none and below NEAR_MAX_BITS.
HEADROOM_CODES = ("AT_DTYPE_MAX", "NEAR_DTYPE_MAX")


def headroom_code(bits: float | None) -> str | None:
    """The warning a headroom earns: AT_DTYPE_MAX at none, NEAR_DTYPE_MAX below
    the contract's NEAR_MAX_BITS, else None (and None for an unknown headroom)."""
    at_max, near_max = HEADROOM_CODES
    if bits is None:
        return None
    if bits <= 0:
        return at_max
    return near_max if bits < NEAR_MAX_BITS else None


def record_document(record: TelemetryRecord) -> dict[str, Any]:
    """The record as its JSON object, fields in the format's order."""
    grad = record.grad
    update = record.update
    output, activations = record.output, record.activations
    return {
        "format": TELEMETRY_FORMAT,
        "run_id": record.run_id,
        "rank": record.rank,
        "world_size": record.world_size,
        "step": record.step,
        "time": record.time,
        "loss": record.loss,
        "loss_class": record.loss_class,
        "grad": {
            "nan": grad.nan,
            "posinf": grad.posinf,
            "neginf": grad.neginf,
            "max_abs": grad.max_abs,
            "dtype": grad.dtype,
            "headroom_bits": grad.headroom_bits,
            "norm": grad.norm,
        },
        "update": None
        if update is None
        else {
            "nan": update.nan,
            "posinf": update.posinf,
            "neginf": update.neginf,
            "max_abs": update.max_abs,
        },
        "scale": record.scale,
        "found_inf": record.found_inf,
        "skipped": record.skipped,
        "held": record.held,
        "warnings": [{"code": w.code, "message": w.message} for w in record.warnings],
        "bundle": record.bundle,
        "activations": None if activations is None else _extremes_document(activations),
        "lr": record.lr,
        "grad_headroom_from": record.grad_headroom_from,
        "weight_norm": record.weight_norm,
        "output": None if output is None else _extremes_document(output),
        "reproduced": record.reproduced,
    }


def _extremes_document(stats: ActivationStats) -> dict[str, Any]:
    return {
        "max_abs": stats.max_abs,
        "where": stats.where,
        "dtype": stats.dtype,
        "headroom_bits": stats.headroom_bits,
        "nonfinite": list(stats.nonfinite),
    }


def record_line(record: TelemetryRecord) -> bytes:
    """The record as one line, newline included; refuses (TelemetryLineError) a
    record the reader would reject, such as a NaN where a number must be finite
    (orjson would silently write it as null)."""
    _check_finite_numbers(record)
    line = orjson.dumps(record_document(record))
    parse_record(orjson.loads(line))
    return line + b"\n"


def _check_finite_numbers(record: TelemetryRecord) -> None:
    update = record.update
    numbers = {
        "time": record.time,
        "loss": record.loss,
        "grad.max_abs": record.grad.max_abs,
        "grad.headroom_bits": record.grad.headroom_bits,
        "grad.norm": record.grad.norm,
        "update.max_abs": None if update is None else update.max_abs,
        "scale": record.scale,
        "lr": record.lr,
        "weight_norm": record.weight_norm,
    }
    for name, stats in (("activations", record.activations), ("output", record.output)):
        if stats is not None:
            numbers[f"{name}.max_abs"] = stats.max_abs
            numbers[f"{name}.headroom_bits"] = stats.headroom_bits
    for name, value in numbers.items():
        if value is not None and not math.isfinite(value):
            raise TelemetryLineError("INVALID_FIELD", f"{name} is {value}: not finite")


# ------------------------------------------------------------------ reading


class TelemetryLineError(ValueError):
    """A line that is not a ``nanrunbook-telemetry/1`` record. ``kind`` is one of
    NOT_JSON, NOT_AN_OBJECT, FOREIGN_FORMAT, INVALID_FIELD, TOO_LONG."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def _invalid(name: str, what: str) -> TelemetryLineError:
    return TelemetryLineError("INVALID_FIELD", f"{name}: {what}")


def _int(document: dict[str, Any], name: str, low: int = 0, where: str = "") -> int:
    value = document.get(name)
    if type(value) is not int or value < low:
        raise _invalid(where + name, f"expected an integer >= {low}")
    return value


def _number(
    document: dict[str, Any], name: str, *, nullable: bool = True, where: str = ""
) -> float | None:
    value: Any = document.get(name)
    kind = type(value)
    if kind is float:
        return float(value)
    if kind is int:
        return float(value)
    if value is None and nullable and name in document:
        return None
    raise _invalid(where + name, "expected a number" + (" or null" if nullable else ""))


def _time(document: dict[str, Any]) -> float:
    value = _number(document, "time", nullable=False)
    assert value is not None  # not nullable
    return value


def _flag(document: dict[str, Any], name: str) -> bool:
    value: Any = document.get(name)
    if type(value) is not bool:
        raise _invalid(name, "expected true or false")
    return bool(value)


def _maybe_flag(document: dict[str, Any], name: str) -> bool | None:
    if name in document and document[name] is None:
        return None
    return _flag(document, name)


def _counts(document: Any, name: str) -> tuple[int, int, int, float | None]:
    if type(document) is not dict:
        raise _invalid(name, "expected an object")
    where = name + "."
    return (
        _int(document, "nan", where=where),
        _int(document, "posinf", where=where),
        _int(document, "neginf", where=where),
        _number(document, "max_abs", where=where),
    )


def _gradient(document: Any) -> GradientStats:
    nan, posinf, neginf, max_abs = _counts(document, "grad")
    dtype = document.get("dtype")
    if (dtype is not None or "dtype" not in document) and (
        type(dtype) is not str or not 0 < len(dtype) <= 32
    ):
        raise _invalid("grad.dtype", "expected a dtype name or null")
    headroom = _number(document, "headroom_bits", where="grad.")
    norm = _number(document, "norm", where="grad.")
    return GradientStats(nan, posinf, neginf, max_abs, dtype, headroom, norm)


def _warnings(value: Any) -> tuple[TelemetryWarning, ...]:
    if type(value) is not list:
        raise _invalid("warnings", "expected a list")
    if not value:
        return ()
    found = []
    for item in value:
        code = item.get("code") if type(item) is dict else None
        message = item.get("message") if type(item) is dict else None
        if type(code) is not str or not _CODE.fullmatch(code) or type(message) is not str:
            raise _invalid("warnings", "expected {code: UPPER_CASE_CODE, message: text} objects")
        found.append(TelemetryWarning(code, message))
    return tuple(found)


def _loss(document: dict[str, Any]) -> tuple[float | None, str]:
    loss_class: Any = document.get("loss_class")
    if loss_class not in LOSS_CLASSES:
        raise _invalid("loss_class", "expected finite, nan, posinf or neginf")
    loss = _number(document, "loss")
    if (loss is None) != (loss_class != "finite"):
        raise _invalid(
            "loss", f"{'null' if loss is None else 'a number'} with loss_class {loss_class}"
        )
    return loss, str(loss_class)


def parse_record(document: Any) -> TelemetryRecord:
    """A decoded line as a record; TelemetryLineError says why it is not one."""
    if type(document) is not dict:
        raise TelemetryLineError("NOT_AN_OBJECT", "the line is JSON but not an object")
    if document.get("format") != TELEMETRY_FORMAT:
        found = document.get("format")
        shown = repr(found)[:40] if found is not None else "no format field"
        raise TelemetryLineError("FOREIGN_FORMAT", f"not {TELEMETRY_FORMAT} ({shown})")
    return _common_record(document) or _checked_record(document)


def _common_record(d: dict[str, Any]) -> TelemetryRecord | None:
    """The shape nearly every line has (a finite loss, floats written as floats, no
    warning), accepted in one pass of plain comparisons; None sends the line to
    :func:`_checked_record`, which accepts a superset and names what is wrong. A
    test holds the two to agreeing wherever this one answers."""
    try:
        g, u = d["grad"], d["update"]
        run_id, rank, world, step, when = (
            d["run_id"],
            d["rank"],
            d["world_size"],
            d["step"],
            d["time"],
        )
        loss, scale, found_inf, skipped, held = (
            d["loss"],
            d["scale"],
            d["found_inf"],
            d["skipped"],
            d["held"],
        )
        bundle, warnings, loss_class = d["bundle"], d["warnings"], d["loss_class"]
        headroom_from, lr = d.get("grad_headroom_from"), d.get("lr")
        if (
            d.get("weight_norm") is not None
            or d.get("output") is not None
            or d.get("activations") is not None
            or d.get("reproduced") is not None
        ):
            return None  # the appended objects and norms: read by _checked_record
        nan, posinf, neginf, max_abs = g["nan"], g["posinf"], g["neginf"], g["max_abs"]
        dtype, headroom, norm = g["dtype"], g["headroom_bits"], g["norm"]
    except (KeyError, TypeError):
        return None
    int_, float_, none = int, float, None
    if (
        type(rank) is not int_ or type(world) is not int_ or not 0 <= rank < world
        or type(step) is not int_ or step < 0
        or type(nan) is not int_ or type(posinf) is not int_ or type(neginf) is not int_
        or nan < 0 or posinf < 0 or neginf < 0
        or (max_abs is not none and type(max_abs) is not float_)
        or (headroom is not none and type(headroom) is not float_)
        or (norm is not none and type(norm) is not float_)
        or (scale is not none and type(scale) is not float_)
        or type(when) is not float_ or type(loss) is not float_ or loss_class != "finite"
        or (found_inf is not none and type(found_inf) is not bool)
        or type(skipped) is not bool or type(held) is not bool
        or warnings != [] or type(run_id) is not str or not 0 < len(run_id) <= 256
        or (dtype is not none and (type(dtype) is not str or not 0 < len(dtype) <= 32))
        or (bundle is not none and type(bundle) is not str)
        or (headroom_from is not none and headroom_from not in HEADROOM_SOURCES)
        or (lr is not none and type(lr) is not float_)
    ):  # fmt: skip
        return None
    update = None if u is None else _common_update(u)
    if update is False:
        return None
    grad = _filled(GradientStats, {
        "nan": nan, "posinf": posinf, "neginf": neginf, "max_abs": max_abs, "dtype": dtype,
        "headroom_bits": headroom, "norm": norm,
    })  # fmt: skip
    return _filled(TelemetryRecord, {
        "run_id": run_id, "rank": rank, "world_size": world, "step": step, "time": when,
        "loss": loss, "loss_class": "finite", "grad": grad, "update": update, "scale": scale,
        "found_inf": found_inf, "skipped": skipped, "held": held, "warnings": (), "bundle": bundle,
        "activations": None, "lr": lr, "grad_headroom_from": headroom_from,
        "weight_norm": None, "output": None, "reproduced": None,
    })  # fmt: skip


_T = TypeVar("_T")
_new = object.__new__
_set = object.__setattr__


def _filled(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of a frozen dataclass whose fields are exactly ``fields``
    (every field, validated by the caller), without its __init__."""
    instance = _new(cls)
    _set(instance, "__dict__", fields)
    return instance


def _common_update(u: Any) -> UpdateStats | bool:
    try:
        nan, posinf, neginf, max_abs = u["nan"], u["posinf"], u["neginf"], u["max_abs"]
    except (KeyError, TypeError):
        return False
    if (
        type(nan) is not int or type(posinf) is not int or type(neginf) is not int
        or nan < 0 or posinf < 0 or neginf < 0
        or (max_abs is not None and type(max_abs) is not float)
    ):  # fmt: skip
        return False
    return _filled(
        UpdateStats, {"nan": nan, "posinf": posinf, "neginf": neginf, "max_abs": max_abs}
    )


# ------------------------------------------------------------ the fast path

# The uneventful line (a finite loss, all counts 0, no warning, neither skipped
# nor held, no field this version does not know) as msgspec types: decoding a
# line into them checks it in C, about 0.7x the time orjson takes only to
# decode it (measured), where checking orjson's dict in Python costs as much
# again as the decoding. Anything else fails to decode and goes to
# parse_record. Unknown fields are refused, not skipped: msgspec skips an
# unknown value without checking what orjson checks (UTF-8, numbers in range),
# and every value it does check it checks as orjson does (a property test holds
# the two parsers together). gc=False: they hold no container, so no cycle, and
# a million of them otherwise keep the cyclic collector busy (a fifth of watch's
# time, measured).
_Zero = Literal[0]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]


class CommonGradient(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    nan: _Zero
    posinf: _Zero
    neginf: _Zero
    max_abs: float | None
    dtype: _Name | None
    headroom_bits: float | None
    norm: float | None


class CommonUpdate(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    nan: _Zero
    posinf: _Zero
    neginf: _Zero
    max_abs: float | None


class CommonOutput(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    max_abs: float | None
    where: Literal["output"] | None
    dtype: _Name | None
    headroom_bits: float | None
    nonfinite: tuple[()]


class CommonLine(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """An uneventful line, decoded by :data:`COMMON_LINE` (rank < world_size is
    still to be checked: msgspec does not relate two fields)."""

    format: TelemetryFormat
    run_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    rank: _Count
    world_size: _Count
    step: _Count
    time: float
    loss: float
    loss_class: Literal["finite"]
    grad: CommonGradient
    update: CommonUpdate | None
    scale: float | None
    found_inf: bool | None
    skipped: Literal[False]
    held: Literal[False]
    warnings: tuple[()]
    bundle: str | None
    # Fields the sentinel appends (nanrunbook.capture): sampled activations make
    # a line eventful enough for the full parse.
    activations: None = None
    lr: float | None = None
    grad_headroom_from: HeadroomSource | None = None
    weight_norm: float | None = None
    output: CommonOutput | None = None
    reproduced: None = None  # set only on a held or re-run line, never uneventful


COMMON_LINE = msgspec.json.Decoder(CommonLine)


def common_line(raw: bytes) -> CommonLine | None:
    """The line decoded the fast way when it is an uneventful record, else None
    (:func:`parse_record` then judges it). Where this answers, parse_record
    accepts the line with the same values."""
    try:
        line = COMMON_LINE.decode(raw)
    except msgspec.DecodeError:  # ValidationError included
        return None
    return line if line.rank < line.world_size else None


def _checked_record(document: dict[str, Any]) -> TelemetryRecord:
    run_id = document.get("run_id")
    if type(run_id) is not str or not 0 < len(run_id) <= 256:
        raise _invalid("run_id", "expected a non-empty string")
    rank = _int(document, "rank")
    world_size = _int(document, "world_size", 1)
    if rank >= world_size:
        raise _invalid("rank", f"{rank} is not below world_size {world_size}")
    loss, loss_class = _loss(document)
    update = document.get("update")
    if update is not None or "update" not in document:
        update = UpdateStats(*_counts(update, "update"))
    bundle = document.get("bundle")
    if bundle is not None and type(bundle) is not str:
        raise _invalid("bundle", "expected a path or null")
    headroom_from = document.get("grad_headroom_from")
    if headroom_from is not None and headroom_from not in HEADROOM_SOURCES:
        raise _invalid(
            "grad_headroom_from", f"expected one of {', '.join(HEADROOM_SOURCES)} or null"
        )
    return TelemetryRecord(
        run_id,
        rank,
        world_size,
        _int(document, "step"),
        _time(document),
        loss,
        loss_class,
        _gradient(document.get("grad")),
        update,
        _number(document, "scale"),
        _maybe_flag(document, "found_inf"),
        _flag(document, "skipped"),
        _flag(document, "held"),
        _warnings(document.get("warnings")),
        bundle,
        headroom_from,
        _number(document, "weight_norm") if "weight_norm" in document else None,
        _extremes(document.get("output"), "output"),
        _reproduced(document.get("reproduced")),
        activations=_extremes(document.get("activations"), "activations"),
        lr=_number(document, "lr") if "lr" in document else None,
    )


REPRODUCTIONS = ("REPRODUCED", "NOT_REPRODUCED")


def _reproduced(value: Any) -> str | None:
    if value is not None and value not in REPRODUCTIONS:
        raise _invalid("reproduced", f"expected {' or '.join(REPRODUCTIONS)} or null")
    return value  # type: ignore[no-any-return]


def _extremes(document: Any, name: str) -> ActivationStats | None:
    """The appended ``activations`` or ``output`` object (null or absent: None)."""
    if document is None:
        return None
    if type(document) is not dict:
        raise _invalid(name, "expected an object or null")
    where = document.get("where")
    if where is not None and type(where) is not str:
        raise _invalid(f"{name}.where", "expected a name or null")
    dtype = document.get("dtype")
    if dtype is not None and (type(dtype) is not str or not 0 < len(dtype) <= 32):
        raise _invalid(f"{name}.dtype", "expected a dtype name or null")
    nonfinite = document.get("nonfinite", [])
    if type(nonfinite) is not list or not all(type(n) is str for n in nonfinite):
        raise _invalid(f"{name}.nonfinite", "expected a list of names")
    prefix = name + "."
    max_abs = _number(document, "max_abs", where=prefix) if "max_abs" in document else None
    bits = _number(document, "headroom_bits", where=prefix) if "headroom_bits" in document else None
    return ActivationStats(max_abs, where, dtype, bits, tuple(nonfinite))
