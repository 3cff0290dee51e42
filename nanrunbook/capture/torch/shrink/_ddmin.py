"""Delta debugging (ddmin) over a batch's examples: a smallest subset that still fails.

Pure search, no torch: ``fails(subset)`` is a replay on copies (see
:mod:`nanrunbook.capture.torch.shrink`). The search splits in two first, so one bad
example among ``n`` takes at most ``2 * ceil(log2(n))`` trials; results are
cached, so no subset is replayed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Minimised", "ddmin"]


@dataclass(frozen=True, slots=True)
class Minimised:
    """The subset found, how many trials it took, and whether it is 1-minimal
    (no single example can be removed) or the trial budget ran out first."""

    examples: tuple[int, ...]
    trials: int
    one_minimal: bool
    hint_used: bool


class _Budget(Exception):
    """The trial budget is spent: stop where the search is."""


class _Trials:
    def __init__(self, fails: Callable[[tuple[int, ...]], bool], budget: int | None) -> None:
        self._fails = fails
        self._budget = budget
        self._seen: dict[tuple[int, ...], bool] = {}

    @property
    def count(self) -> int:
        return len(self._seen)

    def __call__(self, subset: Sequence[int]) -> bool:
        key = tuple(subset)
        if key not in self._seen:
            if self._budget is not None and len(self._seen) >= self._budget:
                raise _Budget
            self._seen[key] = bool(self._fails(key))
        return self._seen[key]


def _split(items: tuple[int, ...], parts: int) -> list[tuple[int, ...]]:
    """``items`` in ``parts`` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _reduce(current: tuple[int, ...], parts: int, fails: _Trials) -> tuple[tuple[int, ...], int]:
    """One ddmin round: a failing chunk, else a failing complement, else finer parts.
    Returns the new subset and granularity; the same subset back means 1-minimal."""
    chunks = _split(current, parts)
    for chunk in chunks:
        if fails(chunk):
            return chunk, 2
    if parts > 2:  # with two parts each complement is the other chunk, already tried
        for chunk in chunks:
            removed = set(chunk)
            complement = tuple(i for i in current if i not in removed)
            if fails(complement):
                return complement, max(parts - 1, 2)
    if parts < len(current):
        return current, min(2 * parts, len(current))
    return current, 0


def ddmin(
    size: int,
    fails: Callable[[tuple[int, ...]], bool],
    *,
    hint: Sequence[int] | None = None,
    max_trials: int | None = None,
) -> Minimised:
    """A 1-minimal subset of ``range(size)`` on which ``fails`` is true.

    The whole batch is taken to fail (the caller has seen it) and the empty one
    is never tried. ``hint``, a proper subset believed to fail (the rows of the
    operation's output that went non-finite), is tried first and the search
    continues from it when it fails too. With ``max_trials`` the search stops
    when that many subsets have been tried and returns the smallest failing
    subset so far (``one_minimal`` false).
    """
    if size < 1:
        raise ValueError("a batch needs at least one example")
    trials = _Trials(fails, max_trials)
    current = tuple(range(size))
    hint_used = False
    try:
        if hint is not None:
            start = tuple(sorted(set(hint)))
            if 0 < len(start) < size and all(0 <= i < size for i in start) and trials(start):
                current, hint_used = start, True
        parts = 2
        while len(current) > 1:
            current, parts = _reduce(current, parts, trials)
            if parts == 0:
                break
    except _Budget:
        return Minimised(current, trials.count, False, hint_used)
    return Minimised(current, trials.count, True, hint_used)
