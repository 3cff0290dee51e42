"""What each replay change means (torch-free records): the one home that
:mod:`nanrunbook.capture.mechanisms` (the public names) and the torch side that
applies a change (``capture/torch/replay/_mechanisms.py``) both import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHANGE_FIELD",
    "Change",
    "LearningRate",
    "LossScale",
    "OtherBatch",
    "Reduction",
    "WithoutAutocast",
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
class LearningRate:
    """Every parameter group's learning rate times ``factor``: the ``optimizer``
    item. Applied to a resumed run (``prove_recovery``); a single-step replay
    does not take it yet."""

    factor: float
    item = "optimizer"


Change = WithoutAutocast | LossScale | Reduction | OtherBatch | LearningRate
