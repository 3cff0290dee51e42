"""How a replay differs from the live step it repeats, said in its bundle: the
sentinel's replay in the held process and a capsule's replay after it say it
the same way, so that the two bundles can be one bundle bit for bit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanrunbook.capture.torch.replay import COMPILED_LIVE, EAGER_REPLAY, Replayed, mark_eager

__all__ = ["annotate_replay"]


def _finite(nonfinite: bool) -> str:
    return "non-finite" if nonfinite else "finite"


def _differences(live: Mapping[str, Any], writer: Any) -> list[tuple[str, str]]:
    """(stage, note) where the replay's loss or gradients are finite and the live
    step's were not, or the reverse: evidence that the replay is not the step.
    ``live``: ``loss_nonfinite`` (None: no loss read) and ``backward_nonfinite``."""
    found: list[tuple[str, str]] = []
    replayed = writer.nonfinite("loss")
    loss = live.get("loss_nonfinite")
    if loss is not None and replayed is not None and bool(loss) != replayed:
        found.append(
            (
                "loss",
                f"the live step's loss was {_finite(bool(loss))}, the replay's is"
                f" {_finite(replayed)}",
            )
        )
    replayed = writer.nonfinite("backward")
    grads = bool(live.get("backward_nonfinite"))
    if replayed is not None and grads != replayed:
        found.append(
            (
                "backward",
                f"the live step's gradients were {_finite(grads)},"
                f" the replay's are {_finite(replayed)}",
            )
        )
    return found


def annotate_replay(replayed: Replayed, live: Mapping[str, Any], compiled: bool) -> list[str]:
    """Mark the eager replay of a compiled model and the differences from the
    live step in the stages' probe sources; the notes for the hold's reason."""
    notes: list[str] = []
    writer = replayed.writer
    if compiled:
        mark_eager(writer)
        notes.append(EAGER_REPLAY)
        replayed.inexact.append(COMPILED_LIVE)
    for stage, note in _differences(live, writer):
        writer.annotate(stage, f"replay differs from the live step: {note}")
        notes.append(f"replay differs from the live step: {note}")
    return notes
