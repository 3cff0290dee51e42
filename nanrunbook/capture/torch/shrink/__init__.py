"""Shrink a failing step by replays on copies: :func:`shrink_step` finds the first
operation that went non-finite (``_locate``), a smallest batch for it (``_ddmin``)
and optionally writes a regression fixture (``_fixture``, its test from
``_fixture_template``); :class:`FailingStep` is the step as the loop ran it
(``_failing_step``), :class:`ShrinkOnHold` the sentinel's hook. The results are
``_results``' records. Replays of the whole step go through
``capture.torch.replay``'s names.
"""

from nanrunbook.capture.torch.shrink._failing_step import FailingStep
from nanrunbook.capture.torch.shrink._results import Shrink, ShrinkError
from nanrunbook.capture.torch.shrink._shrink import ShrinkOnHold, shrink_step

__all__ = ["FailingStep", "Shrink", "ShrinkError", "ShrinkOnHold", "shrink_step"]
