"""The replay of a capsule every rank of an FSDP2 job wrote, run by a job of
its world size (``nanrunbook replay`` under ``torchrun``): every rank loads its
shards, runs the held step again and writes its bundle, as the sentinel wrote
the live step's, and says whether it reproduced its incident member.

Above both the capsule (what it reads) and the sentinel (whose evidence of a
sharded step it writes), so that neither imports it.
"""

from nanrunbook.capture.torch.sharded_replay._replay import (
    RankReplay,
    ShardedCapsule,
    ShardedReplay,
    launched_world,
    open_capsule,
    replay_sharded,
    sharded_document,
)

__all__ = [
    "RankReplay",
    "ShardedCapsule",
    "ShardedReplay",
    "launched_world",
    "open_capsule",
    "replay_sharded",
    "sharded_document",
]
