"""Replays of one training step on copies: :func:`replay_step` (the five boundaries
of a step, as a bundle), :func:`probe` (a tensor named between modules), the step's
recipe (micro-batches, RNG state, autocast regions, loss scaling, clipping) and the
binding the bundle records.

The sentinel (``capture.torch.sentinel``) and shrink (``capture.torch.shrink``)
replay through the names below, never through this package's private modules.
"""

from nanrunbook.capture.torch.replay._binding import (
    add_weight,
    cuda_devices,
    heaviest,
    model_binding,
    scheduler_binding,
)
from nanrunbook.capture.torch.replay._recording import ExtremesSampler, leaf, listening, probe
from nanrunbook.capture.torch.replay._replay_step import (
    REQUIRED_BINDING,
    Autocast,
    Clipping,
    MicroBatch,
    RngState,
    Scaling,
    StepRecipe,
    bind,
    replay_recipe,
    replay_step,
)

__all__ = [
    "REQUIRED_BINDING",
    "Autocast",
    "Clipping",
    "ExtremesSampler",
    "MicroBatch",
    "RngState",
    "Scaling",
    "StepRecipe",
    "add_weight",
    "bind",
    "cuda_devices",
    "heaviest",
    "leaf",
    "listening",
    "model_binding",
    "probe",
    "replay_recipe",
    "replay_step",
    "scheduler_binding",
]
