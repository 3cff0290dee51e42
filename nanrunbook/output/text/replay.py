"""A capsule's replay (``replay``) and a sharded capsule's, every rank together
(``replay`` under torchrun), in text.

Each line is wrapped to the console's width, a path longer than a line folded
as the other answers fold it; each comparison is ``diff``'s own text. The
replay records import torch: they are imported here only to type the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanrunbook.output.text._blocks import show
from nanrunbook.output.text.diff import render_diff

if TYPE_CHECKING:
    from nanrunbook.capture.torch.capsule import CapsuleReplay
    from nanrunbook.capture.torch.sharded_replay import ShardedReplay

__all__ = ["render_replay", "render_sharded_replay"]


def _line(console: Any, text: str) -> None:
    from rich.text import Text

    show(console, Text(text))


def render_replay(console: Any, result: CapsuleReplay) -> None:
    capsule = result.capsule
    _line(console, f"capsule {capsule.path}: verified; run {capsule.run_id}, step {capsule.step}")
    held = capsule.reproduced
    if held is not None:
        _line(console, f"held process: {held.line()}")
    _line(console, f"replay as recorded: {result.bundle}")
    if result.reproduction is None:
        _line(console, "no incident bundle beside the capsule: the reproduction is not compared")
    else:
        _line(console, f"against the incident bundle {result.incident}:")
        render_diff(console, result.reproduction)
    for changed in result.changes:
        show(console)
        _line(console, f"--change {changed.change}: {changed.bundle}")
        _line(console, "against the replay as recorded:")
        render_diff(console, changed.comparison)


def render_sharded_replay(console: Any, result: ShardedReplay) -> None:
    capsule = result.capsule
    _line(
        console,
        f"capsule {capsule.path}: verified; run {capsule.run_id}, step {capsule.step},"
        f" written by {capsule.world_size} ranks under FSDP2",
    )
    incident_set = result.out / capsule.run_id / str(capsule.step)
    _line(console, f"replay as recorded, every rank together: {incident_set}")
    for rank in result.ranks:
        why = f" ({rank.not_reproduced} differs)" if rank.not_reproduced else ""
        where = f" at {rank.stage}" if rank.stage else ""
        _line(
            console,
            f"rank {rank.rank}: {rank.verdict}{why} its incident bundle {rank.incident}:"
            f" {rank.decision}{where}",
        )
    _line(console, f"every rank: {result.verdict}")
