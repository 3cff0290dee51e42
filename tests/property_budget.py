"""How many examples a slow property test draws: a few hundred in the default run
(``make test``), the long run's count under ``HYPOTHESIS_PROFILE=fuzz`` (``make fuzz``)."""

from __future__ import annotations

import os

FUZZ = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"


def examples(default: int, fuzz: int) -> int:
    """``default`` examples in the default run, ``fuzz`` in the fuzz profile's."""
    return fuzz if FUZZ else default
