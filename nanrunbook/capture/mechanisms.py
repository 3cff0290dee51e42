"""Replays of a failing step with exactly one mechanism changed, on purpose.

The runbook's second comparison changes one mechanism at a time under the same
replay contract. :func:`replay_changed` takes the arguments of
:func:`nanrunbook.capture.torch.replay_step` and one declared change, replays
the step with it (on copies: the real run is untouched), and records the change
in the binding item it concerns (a ``replay_change`` detail), so
``nanrunbook diff`` of the plain replay and this one names that item::

    replay_step(model, opt, batch, loss_fn, scaler=scaler, rng_state=rng, target="base", **ids)
    replay_changed(WithoutAutocast(), model, opt, batch, loss_fn, scaler=scaler,
                   rng_state=rng, target="fp32", **ids)
    nanrunbook.diff_bundles("base", "fp32").outcome   # "FIXED" when fp32 cures it

The changes:

* :class:`WithoutAutocast` -- float32 instead of autocast (``precision``):
  every enabled ``torch.autocast`` region ``compute_loss`` enters runs
  disabled, on this thread only.
* :class:`LossScale` -- another loss scale for the GradScaler (``scaler``).
* :class:`Reduction` -- another reduction (``sum`` instead of ``mean``) for
  every loss function of ``torch.nn.functional`` that ``compute_loss`` calls
  with the binding's reduction (``objective``).
* :class:`OtherBatch` -- another batch (``batch``).
* :class:`LearningRate` -- every group's learning rate times a factor
  (``optimizer``), for a resumed run (``prove_recovery``); ``replay_changed``
  refuses it; a capsule replay takes it, or per-group rates.

Replays of an incident capsule (``Capsule.replay``, ``nanrunbook replay --change``)
take these and more, each named on the command line by :func:`parse_change`
(``MECHANISMS`` lists the forms):

* :class:`AutocastDtype` -- autocast in another dtype (``precision``).
* :class:`AdamEps` -- another ``eps`` (``optimizer``).
* :class:`ClipMaxNorm` -- clipping at another max norm, or none (``optimizer``).
* :class:`BatchExamples` -- examples of the step dropped or replaced (``batch``).
* :class:`Deterministic` -- deterministic algorithms on (``environment``).

A change that changes nothing (no autocast region entered, no loss function
with that reduction called, the same scale or batch) raises ValueError rather
than record a change that did not happen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanrunbook.capture._changes import (
    MECHANISMS,
    AdamEps,
    AutocastDtype,
    BatchExamples,
    Change,
    ChangeRefused,
    ClipMaxNorm,
    Deterministic,
    LearningRate,
    LossScale,
    OtherBatch,
    Reduction,
    WithoutAutocast,
    parse_change,
    valid_changes,
)

if TYPE_CHECKING:
    from nanrunbook.capture.torch.replay import autocast_off, replay_changed

__all__ = [
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
    "autocast_off",
    "parse_change",
    "replay_changed",
    "valid_changes",
]

# What a change means lives in capture/_changes.py, torch-free; applying one to a
# replay needs torch and lives in capture/torch/replay/ (its face), imported on
# first use.
_APPLIED = ("autocast_off", "replay_changed")


def __getattr__(name: str) -> Any:
    if name in _APPLIED:
        from nanrunbook.capture.torch import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
