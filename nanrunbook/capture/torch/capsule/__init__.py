"""The incident capsule: everything needed to run a held step again, bit for bit,
after its process is gone (issue 27).

At a hold the sentinel writes it as the ``capsule/`` directory of the step's
bundle (:func:`write_held_capsule`): the pre-step state through
torch.distributed.checkpoint, the step's micro-batches and random states, its
recipe and the incident's facts, and a SHA-256 manifest written last, the
whole appearing atomically. :class:`Capsule` opens, verifies and loads one
into the objects the user's entry builds; :class:`LoadedStep` replays it,
as recorded or with one mechanism changed (``nanrunbook replay``). A capsule
every rank of an FSDP2 job wrote is replayed by a job of its world size
(``capture.torch.sharded_replay``, ``nanrunbook replay`` under ``torchrun``);
the sentinel writes that one at an FSDP2 hold, every rank together
(:func:`write_sharded_capsule`, given each rank's :class:`BindingFacts`).
The sentinel uses this package through the names below; nothing here
imports the sentinel.
"""

from __future__ import annotations

import logging
from pathlib import Path

from nanrunbook.capture.incident import CAPSULE_DIRECTORY
from nanrunbook.capture.torch.capsule._capsule import Capsule, LoadedStep, identity_violation
from nanrunbook.capture.torch.capsule._contents import (
    CapsuleRefused,
    decode_micro_batches,
    generator_count,
    micro_batch_template,
)
from nanrunbook.capture.torch.capsule._live import annotate_replay
from nanrunbook.capture.torch.capsule._session import (
    CapsuleReplay,
    ChangedReplay,
    replay_capsule,
    replay_document,
    replay_head,
)
from nanrunbook.capture.torch.capsule._sharded import BindingFacts, write_sharded_capsule
from nanrunbook.capture.torch.capsule._write import CAPSULE_FORMAT, HeldStep, write_capsule

__all__ = [
    "CAPSULE_FORMAT",
    "BindingFacts",
    "Capsule",
    "CapsuleRefused",
    "CapsuleReplay",
    "ChangedReplay",
    "HeldStep",
    "LoadedStep",
    "annotate_replay",
    "decode_micro_batches",
    "generator_count",
    "identity_violation",
    "micro_batch_template",
    "replay_capsule",
    "replay_document",
    "replay_head",
    "write_capsule",
    "write_held_capsule",
    "write_sharded_capsule",
]

log = logging.getLogger("nanrunbook.sentinel")


def write_held_capsule(bundle: Path, held: HeldStep) -> tuple[Path | None, str | None]:
    """Write ``held``'s capsule into its bundle's ``capsule/`` directory. Never
    raises: the hold stands without a capsule, and the reason is returned."""
    target = Path(bundle) / CAPSULE_DIRECTORY
    try:
        write_capsule(target, held)
    except CapsuleRefused as error:
        log.error("step %d: no capsule: %s", held.step, error)
        return None, f"not recordable exactly: {error}"
    except Exception as error:  # a full disk, a state DCP cannot save: the hold stands
        log.exception("step %d: the capsule could not be written", held.step)
        return None, f"{type(error).__name__}: {error}"
    log.error("step %d: capsule %s (replay it with: nanrunbook replay)", held.step, target)
    return target, None
