"""Replays of one training step on copies: :func:`replay_step` (the five boundaries
of a step, as a bundle), :func:`probe` (a tensor named between modules), the step's
recipe (micro-batches, RNG state, autocast regions, loss scaling, clipping) and the
binding the bundle records.

The sentinel (``capture.torch.sentinel``) and shrink (``capture.torch.shrink``)
replay through the names below, never through this package's private modules;
so do a resumed run's changes (``capture.torch.recovery``) and the torch-free
``capture.mechanisms``, which loads ``replay_changed`` and ``autocast_off``
from here on first use.
"""

from nanrunbook.capture.torch.replay._binding import (
    add_weight,
    batch_binding,
    cuda_devices,
    heaviest,
    model_binding,
    model_item,
    scheduler_binding,
    topology_binding,
)
from nanrunbook.capture.torch.replay._mechanisms import (
    RecipeChange,
    autocast_as,
    autocast_off,
    changed_examples,
    changed_optimizer_values,
    changed_recipe,
    changed_reduction,
    replay_changed,
)
from nanrunbook.capture.torch.replay._recording import (
    ExtremesSampler,
    ForwardCapture,
    OutputExtremes,
    leaf,
    listening,
    probe,
)
from nanrunbook.capture.torch.replay._replay_step import (
    COMPILED_LIVE,
    EAGER_REPLAY,
    REQUIRED_BINDING,
    Autocast,
    Clipping,
    MicroBatch,
    Replayed,
    RngState,
    Scaling,
    StepRecipe,
    bind,
    mark_eager,
    replay_recipe,
    replay_step,
    rng_state_for,
)

__all__ = [
    "COMPILED_LIVE",
    "EAGER_REPLAY",
    "REQUIRED_BINDING",
    "Autocast",
    "Clipping",
    "ExtremesSampler",
    "ForwardCapture",
    "MicroBatch",
    "OutputExtremes",
    "RecipeChange",
    "Replayed",
    "RngState",
    "Scaling",
    "StepRecipe",
    "add_weight",
    "autocast_as",
    "autocast_off",
    "batch_binding",
    "bind",
    "changed_examples",
    "changed_optimizer_values",
    "changed_recipe",
    "changed_reduction",
    "cuda_devices",
    "heaviest",
    "leaf",
    "listening",
    "mark_eager",
    "model_binding",
    "model_item",
    "probe",
    "replay_changed",
    "replay_recipe",
    "replay_step",
    "rng_state_for",
    "scheduler_binding",
    "topology_binding",
]
