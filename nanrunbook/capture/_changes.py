"""What each replay change means (torch-free records): the one home that
:mod:`nanrunbook.capture.mechanisms` (the public names) and the torch side that
applies a change (``capture/torch/replay/_mechanisms.py``) both import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHANGE_FIELD",
    "MECHANISMS",
    "AdamEps",
    "AutocastDtype",
    "BatchExamples",
    "Change",
    "ChangeRefused",
    "ClipMaxNorm",
    "Deterministic",
    "LearningRate",
    "LossScale",
    "OtherBatch",
    "Reduction",
    "WithoutAutocast",
    "change_text",
    "parse_change",
    "valid_changes",
]

CHANGE_FIELD = "replay_change"  # the binding detail that records the change


@dataclass(frozen=True, slots=True)
class WithoutAutocast:
    """Float32 (the parameters' dtype) instead of autocast: the ``precision`` item."""

    item = "precision"


@dataclass(frozen=True, slots=True)
class LossScale:
    """Another loss scale for the step's GradScaler: the ``scaler`` item."""

    scale: float
    item = "scaler"


@dataclass(frozen=True, slots=True)
class Reduction:
    """Another reduction for the loss functions: the ``objective`` item."""

    to: str = "sum"
    item = "objective"


@dataclass(frozen=True, slots=True)
class OtherBatch:
    """Another batch: the ``batch`` item."""

    batch: Any
    item = "batch"


@dataclass(frozen=True, slots=True)
class AutocastDtype:
    """Autocast in another dtype (``bfloat16``, ``float16``): the ``precision`` item."""

    dtype: str
    item = "precision"


@dataclass(frozen=True, slots=True)
class LearningRate:
    """Another learning rate, the ``optimizer`` item: every param group's rate
    times ``factor`` (``--change lr_factor=``), or ``rates``, pairs of a param
    group's index (None: every group) and its new rate (``--change lr=``). A
    capsule replay and a resumed run (``prove``) take either form."""

    factor: float | None = None
    rates: tuple[tuple[int | None, float], ...] = ()
    item = "optimizer"

    def rate(self, group: int, current: float) -> float | None:
        """Param group ``group``'s new rate (its rate now ``current``), or None
        when the change leaves it alone."""
        if self.factor is not None:
            return current * self.factor
        found = [rate for index, rate in self.rates if index is None or index == group]
        return found[-1] if found else None


@dataclass(frozen=True, slots=True)
class AdamEps:
    """Another ``eps`` for every param group of an optimizer that has one (Adam,
    AdamW...): the ``optimizer`` item."""

    eps: float
    item = "optimizer"


@dataclass(frozen=True, slots=True)
class ClipMaxNorm:
    """Gradient clipping at another max norm (None: no clipping; a step that did
    not clip is clipped by the L2 norm of every parameter): the ``optimizer`` item."""

    max_norm: float | None
    item = "optimizer"


@dataclass(frozen=True, slots=True)
class BatchExamples:
    """The step's examples, numbered across its micro-batches in order, with
    ``drop`` left out and each ``(i, j)`` of ``replace`` given example j's
    values in place of example i's (j in the same micro-batch): the ``batch`` item."""

    drop: tuple[int, ...] = ()
    replace: tuple[tuple[int, int], ...] = ()
    item = "batch"


@dataclass(frozen=True, slots=True)
class Deterministic:
    """Deterministic algorithms on (``torch.use_deterministic_algorithms``): the
    ``environment`` item."""

    item = "environment"


Change = (
    WithoutAutocast
    | LossScale
    | Reduction
    | OtherBatch
    | AutocastDtype
    | LearningRate
    | AdamEps
    | ClipMaxNorm
    | BatchExamples
    | Deterministic
)

# The command line's MECHANISM=VALUE forms, in the order they are listed.
MECHANISMS: dict[str, str] = {
    "precision": "fp32 (no autocast), bf16 or fp16 (autocast in that dtype)",
    "loss_scale": "a power of two in [2^-24, 2^24] (the GradScaler's scale)",
    "lr": "RATE for every param group, or GROUP:RATE[,GROUP:RATE...]",
    "lr_factor": "F, every param group's rate times F (F > 0, not 1)",
    "eps": "Adam's eps for every param group",
    "clip": "the max norm of gradient clipping, or none",
    "reduction": "mean or sum",
    "batch": "drop:I[,J...] or replace:I=J[,K=L...] (examples across the micro-batches)",
    "deterministic": "on",
}

_PRECISIONS = {
    "fp32": None, "float32": None, "none": None,
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16",
}  # fmt: skip


class ChangeRefused(ValueError):
    """A ``MECHANISM=VALUE`` that names no mechanism or no valid value; its
    message lists the valid forms."""


def valid_changes() -> str:
    """The valid forms, one clause each."""
    return "; ".join(f"{name}={what}" for name, what in MECHANISMS.items())


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ChangeRefused(f"{what}: {text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ChangeRefused(f"{what}: {text!r} is not a finite number")
    return value


def _index(text: str, what: str) -> int:
    if not text.strip().isdigit():
        raise ChangeRefused(f"{what}: {text!r} is not an index (0, 1, ...)")
    return int(text)


def _batch(value: str) -> BatchExamples:
    how, _, listed = value.partition(":")
    items = [part for part in listed.split(",") if part]
    if how == "drop" and items:
        return BatchExamples(drop=tuple(_index(i, "batch=drop") for i in items))
    if how == "replace" and items and all("=" in i for i in items):
        pairs = [i.split("=", 1) for i in items]
        return BatchExamples(
            replace=tuple(
                (_index(a, "batch=replace"), _index(b, "batch=replace")) for a, b in pairs
            )
        )
    raise ChangeRefused(f"batch={value}: valid forms are {MECHANISMS['batch']}")


def _learning_rate(value: str) -> LearningRate:
    if ":" not in value:
        return LearningRate(rates=((None, _number(value, "lr")),))
    rates: list[tuple[int | None, float]] = []
    for part in value.split(","):
        group, _, rate = part.partition(":")
        rates.append((_index(group, "lr group"), _number(rate, "lr")))
    return LearningRate(rates=tuple(rates))


def parse_change(text: str) -> Change:
    """One ``MECHANISM=VALUE`` of ``nanrunbook replay`` or ``prove --change``; ChangeRefused
    (its message naming the valid forms) for anything else."""
    name, equals, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not equals or name not in MECHANISMS:
        raise ChangeRefused(f"unknown mechanism {text!r}: valid are {valid_changes()}")
    if name == "precision":
        if value.lower() not in _PRECISIONS:
            raise ChangeRefused(f"precision={value}: valid are {MECHANISMS['precision']}")
        dtype = _PRECISIONS[value.lower()]
        return WithoutAutocast() if dtype is None else AutocastDtype(dtype)
    if name == "loss_scale":
        return LossScale(_number(value, "loss_scale"))
    if name == "lr":
        return _learning_rate(value)
    if name == "lr_factor":
        factor = _number(value, "lr_factor")
        if not factor > 0 or factor == 1:
            raise ChangeRefused(f"lr_factor={value}: valid is {MECHANISMS['lr_factor']}")
        return LearningRate(factor=factor)
    if name == "eps":
        return AdamEps(_number(value, "eps"))
    if name == "clip":
        return ClipMaxNorm(None if value.lower() == "none" else _number(value, "clip"))
    if name == "reduction":
        if value not in ("mean", "sum"):
            raise ChangeRefused(f"reduction={value}: valid are {MECHANISMS['reduction']}")
        return Reduction(value)
    if name == "batch":
        return _batch(value)
    if value.lower() not in ("on", "true", "1"):
        raise ChangeRefused(f"deterministic={value}: valid is {MECHANISMS['deterministic']}")
    return Deterministic()


def change_text(change: Change) -> str:
    """The ``MECHANISM=VALUE`` that :func:`parse_change` reads as ``change``
    (another batch, given as data, has none: ``batch=other``)."""
    if isinstance(change, WithoutAutocast):
        return "precision=fp32"
    if isinstance(change, AutocastDtype):
        return f"precision={change.dtype}"
    if isinstance(change, LossScale):
        return f"loss_scale={change.scale:g}"
    if isinstance(change, LearningRate):
        if change.factor is not None:
            return f"lr_factor={change.factor:g}"
        rates = [f"{rate:g}" if g is None else f"{g}:{rate:g}" for g, rate in change.rates]
        return f"lr={','.join(rates)}"
    if isinstance(change, AdamEps):
        return f"eps={change.eps:g}"
    if isinstance(change, ClipMaxNorm):
        return f"clip={'none' if change.max_norm is None else format(change.max_norm, 'g')}"
    if isinstance(change, Reduction):
        return f"reduction={change.to}"
    if isinstance(change, BatchExamples):
        if change.drop:
            return f"batch=drop:{','.join(map(str, change.drop))}"
        return f"batch=replace:{','.join(f'{i}={j}' for i, j in change.replace)}"
    if isinstance(change, OtherBatch):
        return "batch=other"
    return "deterministic=on"
