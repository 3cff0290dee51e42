"""Exit codes: every command's answer to a script, in one place.

0/1/3 are the spec's verdicts (section 10); 5 is only ever returned when the
caller asked to fail on warnings, so it cannot be mistaken for a HOLD.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import IntEnum

__all__ = ["Exit", "most_severe"]


class Exit(IntEnum):
    """What a nanrunbook process exits with."""

    CONTINUE = 0  # CONTINUE_BOUNDED_DIAGNOSTICS; for diff, an attributable comparison
    HOLD = 1  # HOLD; for diff, a comparison that cannot be attributed
    USAGE = 2  # bad option, missing or empty argument
    REJECTED = 3  # the evidence cannot be judged: unreadable, malformed, against the contract
    INTERNAL = 4  # a defect of nanrunbook
    WARNINGS = 5  # no HOLD, but warnings, and --fail-on-warnings was given
    INTERRUPTED = 130  # Ctrl-C


_SEVERITY = (Exit.REJECTED, Exit.HOLD, Exit.WARNINGS, Exit.CONTINUE)


def most_severe(codes: Iterable[int]) -> int:
    """The answer for several verdicts at once: rejected (3), then HOLD (1), then
    warnings (5, only when asked to fail on them), then CONTINUE (0). Empty: CONTINUE."""
    given = set(codes)
    return next((code for code in _SEVERITY if code in given), Exit.CONTINUE)
