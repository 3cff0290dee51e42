"""Where a held step's evidence goes, and the exception that reports a hold.

One step of one run is one incident directory, ``<root>/<run_id>/<step>/``: the
bundle itself for a single process, or an incident set (spec section 11) of
``rank-NNNNN/`` bundles, one per rank, when the job has several. A run that
holds at the same step again (after a restart) gets ``<step>.1/``,
``<step>.2/``... so no evidence is ever overwritten.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanrunbook.verdict.report import Report

__all__ = ["SentinelHold", "incident_attempt", "incident_bundle_path", "rank_member"]


def rank_member(rank: int) -> str:
    """The set member directory of a rank: ``rank-00003``."""
    return f"rank-{rank:05d}"


def incident_bundle_path(
    root: str | os.PathLike[str],
    run_id: str,
    step: int,
    rank: int | None = None,
    attempt: int | None = None,
) -> Path:
    """The bundle path for ``step``: ``<root>/<run_id>/<step>`` for one process,
    ``<root>/<run_id>/<step>/rank-NNNNN`` for ``rank`` of several; ``<step>.N``
    for ``attempt`` N (default: the first unused, :func:`incident_attempt`)."""
    if attempt is None:
        attempt = incident_attempt(root, run_id, step, rank)
    name = str(step) if attempt == 0 else f"{step}.{attempt}"
    path = Path(root) / run_id / name
    return path if rank is None else path / rank_member(rank)


def incident_attempt(
    root: str | os.PathLike[str], run_id: str, step: int, rank: int | None = None
) -> int:
    """The first attempt whose bundle path for ``step`` (and ``rank``) is unused.
    The ranks of a job agree on the largest of theirs, so that they write into
    one step directory."""
    attempt = 0
    while True:
        path = incident_bundle_path(root, run_id, step, rank, attempt)
        if not path.exists() and not path.is_symlink():
            return attempt
        attempt += 1


class SentinelHold(RuntimeError):
    """The sentinel held a training step: the update was not applied (or was rolled
    back), the evidence was captured, and the run must not continue unattended.

    ``step``: the held step. ``reason``: what the sentinel saw. ``stage``: the
    check's earliest non-finite stage, or the sentinel's own when no bundle was
    judged. ``bundle``: the bundle path, or None when none could be written
    (``capture_error`` says why). ``report``: the check's verdict on it.
    ``contaminated``: the real state already holds a non-finite update (no
    snapshot to roll back): restart from ``last_known_good``. ``origin_ranks``
    (several ranks): the ranks whose own values went non-finite at the earliest
    stage, as the incident set's verdict names them (empty if no bundle held).
    """

    def __init__(
        self,
        *,
        step: int,
        reason: str,
        stage: str | None,
        bundle: Path | None,
        report: Report | None,
        last_known_good: Mapping[str, Any],
        contaminated: bool = False,
        capture_error: str | None = None,
        origin_ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.step = step
        self.reason = reason
        self.stage = stage
        self.bundle = bundle
        self.report = report
        self.last_known_good = dict(last_known_good)
        self.contaminated = contaminated
        self.capture_error = capture_error
        self.origin_ranks = origin_ranks
        super().__init__(self._message())

    @property
    def decision(self) -> str | None:
        """The check's decision on the bundle (HOLD or CONTINUE_BOUNDED_DIAGNOSTICS)."""
        return None if self.report is None else self.report.decision.decision

    def _message(self) -> str:
        lkg = self.last_known_good
        parts = [f"step {self.step} held: {self.reason}"]
        if self.report is not None:
            where = self.report.decision.earliest_nonfinite_stage or "no stage (none non-finite)"
            parts.append(f"check: {self.report.decision.decision} at {where}")
        if self.bundle is not None:
            parts.append(f"bundle {self.bundle}")
        elif self.capture_error:
            parts.append(f"no bundle ({self.capture_error})")
        if self.origin_ranks is not None:
            parts.append(f"origin ranks {','.join(map(str, self.origin_ranks)) or 'none'}")
        if self.contaminated:
            parts.append("the real state is contaminated by a non-finite update")
        parts.append(
            f"last known-good checkpoint {lkg.get('checkpoint_id')} (step {lkg.get('step')})"
        )
        return "; ".join(parts)
