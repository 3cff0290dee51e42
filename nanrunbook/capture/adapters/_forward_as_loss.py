"""A framework's forward as the sentinel's ``compute_loss``.

Lightning and Accelerate divide the loss for gradient accumulation themselves
(``loss / k``, after the forward). The sentinel must see, and a replay must
backward, the loss as backpropagated; the framework must keep getting its own
undivided output. :class:`ForwardAsLoss` returns the divided loss to the
sentinel and keeps the output the forward made for the framework to take: the
framework's own division of the same tensor by the same number is the same
value, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ForwardAsLoss"]


class ForwardAsLoss:
    """``compute_loss(model, batch)`` for the sentinel: ``run(model, batch)`` is
    the framework's forward, ``loss_of(output)`` its loss, ``divisor()`` the
    framework's accumulation divisor (read at each call)."""

    def __init__(
        self,
        run: Callable[[Any, Any], Any],
        loss_of: Callable[[Any], Any],
        divisor: Callable[[], int],
    ) -> None:
        self.run, self.loss_of, self.divisor = run, loss_of, divisor
        self._output: Any = None

    def __call__(self, model: Any, batch: Any) -> Any:
        output = self.run(model, batch)
        self._output = output  # a replay overwrites it too; only the live call's is taken
        return self.loss_of(output) / self.divisor()

    def take(self) -> Any:
        """The output of the last forward, for the framework (then forgotten)."""
        output, self._output = self._output, None
        return output
