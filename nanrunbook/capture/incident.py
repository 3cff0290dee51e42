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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from nanrunbook.verdict.report import Report

__all__ = [
    "CAPSULE_DIRECTORY",
    "Reproduction",
    "SentinelHold",
    "StepSight",
    "incident_attempt",
    "incident_bundle_path",
    "rank_member",
]

# A held step's capsule is this subdirectory of its bundle (spec section 1: the
# bundle contract ignores what its manifest does not name).
CAPSULE_DIRECTORY = "capsule"


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


Counted = tuple[int, int, int]  # NaN, +inf, -inf


@dataclass(frozen=True)
class StepSight:
    """What one run of a step saw at the boundaries the sentinel checks:
    ``stage`` the first of loss, backward, optimizer that went non-finite (None:
    none did); ``loss_bits`` each micro-batch loss's stored bytes, hex;
    ``loss`` and ``gradients`` the NaN, +inf, -inf counts (``gradients`` None
    when not counted, as when backward was not run)."""

    stage: str | None
    loss_bits: tuple[str, ...]
    loss: Counted
    gradients: Counted | None

    def document(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "loss_bits": list(self.loss_bits),
            "loss": list(self.loss),
            "gradients": None if self.gradients is None else list(self.gradients),
        }


def _counted(counts: Counted) -> str:
    return f"{counts[0]} NaN, {counts[1]} +inf, {counts[2]} -inf"


@dataclass(frozen=True)
class Reproduction:
    """Did the held step come back when it was run again, from the same state and
    random state, on copies? ``verdict`` REPRODUCED or NOT_REPRODUCED (a transient
    fault or a nondeterministic kernel, not the data or the recipe);
    ``differed`` what the live step and the replay did not share, one phrase
    each; where it ran (``rank`` None for one process, ``host``, ``device`` and
    the CUDA device's ``device_uuid``); ``policy`` what the sentinel did with it
    (``hold``, or ``rerun``: it held only because the re-run failed again, or
    skipped the step because it did not)."""

    verdict: Literal["REPRODUCED", "NOT_REPRODUCED"]
    differed: tuple[str, ...]
    live: StepSight
    replay: StepSight
    host: str
    device: str
    rank: int | None = None
    device_uuid: str | None = None
    policy: str = "hold"

    @classmethod
    def compare(cls, live: StepSight, replay: StepSight, **where: Any) -> Reproduction:
        differed: list[str] = []
        if live.stage != replay.stage:
            differed.append(
                f"first non-finite boundary: live {live.stage or 'none'},"
                f" replay {replay.stage or 'none'}"
            )
        if live.loss != replay.loss:
            differed.append(f"loss: live {_counted(live.loss)}, replay {_counted(replay.loss)}")
        for index, (a, b) in enumerate(zip(live.loss_bits, replay.loss_bits, strict=False)):
            if a != b:
                differed.append(f"loss bits of micro-batch {index}: live {a}, replay {b}")
        counted = live.gradients is not None and replay.gradients is not None
        if counted and live.gradients != replay.gradients:
            assert live.gradients is not None and replay.gradients is not None
            differed.append(
                f"gradients: live {_counted(live.gradients)}, replay {_counted(replay.gradients)}"
            )
        verdict: Literal["REPRODUCED", "NOT_REPRODUCED"] = (
            "NOT_REPRODUCED" if differed else "REPRODUCED"
        )
        return cls(verdict, tuple(differed), live, replay, **where)

    @property
    def reproduced(self) -> bool:
        return self.verdict == "REPRODUCED"

    def line(self) -> str:
        """One line of an incident's report: ``NOT_REPRODUCED on rank 5, host h12,
        device cuda:3 (GPU-...): first non-finite boundary: live loss, replay none``."""
        where = [f"rank {self.rank}"] if self.rank is not None else []
        where += [f"host {self.host}", f"device {self.device}"]
        if self.device_uuid:
            where.append(self.device_uuid)
        text = f"{self.verdict} on {', '.join(where)}"
        return f"{text}: {'; '.join(self.differed)}" if self.differed else text

    def document(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "differed": list(self.differed),
            "live": self.live.document(),
            "replay": self.replay.document(),
            "rank": self.rank,
            "host": self.host,
            "device": self.device,
            "device_uuid": self.device_uuid,
            "policy": self.policy,
        }


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
    ``reproduced``: whether the replay on copies came out as the live step did
    (:class:`Reproduction`; None when no replay was made). ``capsule``: the
    held step's capsule directory, to replay it after this process is gone
    (``nanrunbook replay``), or None (``capsule_error`` says why).
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
        reproduced: Reproduction | None = None,
        capsule: Path | None = None,
        capsule_error: str | None = None,
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
        self.reproduced = reproduced
        self.capsule = capsule
        self.capsule_error = capsule_error
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
        if self.reproduced is not None:
            parts.append(self.reproduced.line())
        if self.capsule is not None:
            parts.append(f"capsule {self.capsule}")
        elif self.capsule_error:
            parts.append(f"no capsule ({self.capsule_error})")
        if self.origin_ranks is not None:
            parts.append(f"origin ranks {','.join(map(str, self.origin_ranks)) or 'none'}")
        if self.contaminated:
            parts.append("the real state is contaminated by a non-finite update")
        parts.append(
            f"last known-good checkpoint {lkg.get('checkpoint_id')} (step {lkg.get('step')})"
        )
        return "; ".join(parts)
