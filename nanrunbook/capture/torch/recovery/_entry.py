"""How ``nanrunbook prove`` builds the run it resumes, and reads ``--change``.

``--entry module:function`` names a function called with no argument that
builds the run's objects afresh (their state is then the recovery point's) and
returns a mapping (or an object with these attributes): ``model``,
``optimizer``, ``compute_loss(model, batch)``, ``loader`` (an iterable of
batches; with ``state_dict()``/``load_state_dict()`` its position is restored,
torchdata's StatefulDataLoader), and optionally ``scheduler``, ``scaler``,
``generators`` (the loop's own torch.Generators) and ``sentinel`` (more
keyword arguments for the Sentinel: ``thresholds``, ``snapshot``...).

``--change MECHANISM=VALUE``: ``lr-factor=0.5`` (every group's learning rate
times 0.5), ``loss-scale=1024`` (the GradScaler's scale), ``autocast=off``
(float32 instead of autocast). The change records are
``capture/mechanisms.py``'s (their one home); this module only parses.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nanrunbook.capture._changes import Change, LearningRate, LossScale, WithoutAutocast

__all__ = ["EntryError", "TrainingRun", "load_entry", "parse_change"]


class EntryError(ValueError):
    """An ``--entry`` or ``--change`` that cannot be used (a usage error, exit 2)."""


@dataclass(frozen=True)
class TrainingRun:
    """The objects an entry builds."""

    model: Any
    optimizer: Any
    compute_loss: Callable[[Any, Any], Any]
    loader: Iterable[Any]
    scheduler: Any = None
    scaler: Any = None
    generators: tuple[Any, ...] = ()
    sentinel: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, built: Any) -> TrainingRun:
        def get(key: str, default: Any = None) -> Any:
            if isinstance(built, Mapping):
                return built.get(key, default)
            return getattr(built, key, default)

        missing = [k for k in ("model", "optimizer", "compute_loss", "loader") if get(k) is None]
        if missing:
            raise EntryError(f"the entry's run lacks {', '.join(missing)}")
        if not callable(get("compute_loss")):
            raise EntryError("the entry's compute_loss is not callable")
        return cls(
            model=get("model"),
            optimizer=get("optimizer"),
            compute_loss=get("compute_loss"),
            loader=get("loader"),
            scheduler=get("scheduler"),
            scaler=get("scaler"),
            generators=tuple(get("generators", ()) or ()),
            sentinel=dict(get("sentinel", {}) or {}),
        )


def load_entry(entry: str) -> Callable[[], TrainingRun]:
    """``module:function`` as a builder of the run; the working directory is
    importable, as ``python -m`` makes it."""
    module_name, _, function_name = entry.partition(":")
    if not module_name or not function_name:
        raise EntryError(f"--entry {entry!r} is not module:function")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise EntryError(f"--entry: cannot import {module_name!r}: {error}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise EntryError(f"--entry: {module_name!r} has no function {function_name!r}")

    def build() -> TrainingRun:
        try:
            built = function()
        except Exception as error:  # the run's own code: its failure is the entry's
            raise EntryError(f"--entry {entry} raised {type(error).__name__}: {error}") from None
        return TrainingRun.of(built)

    return build


def parse_change(text: str) -> Change:
    """One ``MECHANISM=VALUE`` as its change record."""
    name, sep, value = text.partition("=")
    if not sep or not value:
        raise EntryError(f"--change {text!r} is not MECHANISM=VALUE")
    if name == "lr-factor":
        factor = _number(text, value)
        if not (factor > 0 and math.isfinite(factor)) or factor == 1:
            raise EntryError(f"--change {text!r}: a factor > 0 other than 1")
        return LearningRate(factor)
    if name == "loss-scale":
        return LossScale(_number(text, value))
    if name == "autocast" and value == "off":
        return WithoutAutocast()
    raise EntryError(f"--change {text!r}: the mechanisms are lr-factor=, loss-scale=, autocast=off")


def _number(text: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise EntryError(f"--change {text!r}: {value!r} is not a number") from None
