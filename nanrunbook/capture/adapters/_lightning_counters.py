"""The counters of a Lightning fit loop, set aside at a step's first batch and
put back on a hold.

Lightning counts a step's progress as it goes: the batch started, the gradients
zeroed, the optimizer step made ready (before ``optimizer.step()`` is called).
A hold raises inside that call, so those counts would tell a step that never
happened. The loops and their progress records are plain objects whose
counters are ints and bools in their ``__dict__``; this module finds them once,
from the fit loop down, and copies those fields (a few microseconds a step).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoopCounters"]

_COUNTER_TYPES = (int, bool)


def _from_loops(value: Any) -> bool:
    """A loop or a progress record (Lightning keeps both in its ``loops`` package);
    not the data fetcher, whose counts follow its iterator (the batch was drawn)."""
    module = type(value).__module__
    return ".loops" in module and "fetchers" not in module and hasattr(value, "__dict__")


class LoopCounters:
    """Every int and bool field of the fit loop, its child loops and their
    progress records, as found from ``fit_loop``."""

    def __init__(self, fit_loop: Any) -> None:
        self._objects: list[Any] = []
        seen: set[int] = set()
        pending = [fit_loop]
        while pending:
            value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            self._objects.append(value)
            pending += [v for v in vars(value).values() if _from_loops(v)]
        self._saved: list[dict[str, Any]] = []

    def save(self) -> None:
        self._saved = [
            {k: v for k, v in vars(o).items() if type(v) in _COUNTER_TYPES} for o in self._objects
        ]

    def restore(self) -> None:
        for value, saved in zip(self._objects, self._saved, strict=True):
            vars(value).update(saved)
