"""The training-loop sentinel: :class:`Sentinel` checks every step's loss,
gradients and update, holds the update on a non-finite value, captures the step's
bundle by a replay (``capture.torch.replay``) and raises ``SentinelHold``.

Its parts are private modules: the checks (``_checks``), a step's record
(``_steps``), the decision object it is given each step to (``_decide``), the pre-step snapshot (``_snapshot``),
the intercepted optimizer and clip calls (``_intercept``), the ranks' agreement
(``_ranks``), the held step's bundle (``_capture``) and FSDP2 (``_fsdp``).

Besides the loop's names, the evidence of a sharded step: the replay of a
sharded capsule (``capture.torch.sharded_replay``, above this package) runs
the held step again and writes each rank's bundle as the sentinel wrote the
live step's, with the same functions and records.
"""

from nanrunbook.capture.torch.sentinel._capture import StepObjects
from nanrunbook.capture.torch.sentinel._fsdp import (
    OwnGradients,
    is_fully_sharded,
    replicated,
    sharded_evidence,
)
from nanrunbook.capture.torch.sentinel._sentinel import Policy, Sentinel
from nanrunbook.capture.torch.sentinel._snapshot import Buffers
from nanrunbook.capture.torch.sentinel._steps import ClipCall, StepRecord

# Policy and Sentinel are the loop's; the others, the evidence of a sharded
# step, are the sharded capsule's replay's (capture.torch.sharded_replay).
__all__ = [
    "Buffers",
    "ClipCall",
    "OwnGradients",
    "Policy",
    "Sentinel",
    "StepObjects",
    "StepRecord",
    "is_fully_sharded",
    "replicated",
    "sharded_evidence",
]
