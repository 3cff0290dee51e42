"""The training-loop sentinel: :class:`Sentinel` checks every step's loss,
gradients and update, holds the update on a non-finite value, captures the step's
bundle by a replay (``capture.torch.replay``) and raises ``SentinelHold``.

Its parts are private modules: the checks (``_checks``), a step's record
(``_steps``), the decision object it is given each step to (``_decide``), the pre-step snapshot (``_snapshot``),
the intercepted optimizer and clip calls (``_intercept``), the ranks' agreement
(``_ranks``) and the held step's bundle (``_capture``).
"""

from nanrunbook.capture.torch.sentinel._sentinel import Policy, Sentinel

__all__ = ["Policy", "Sentinel"]
