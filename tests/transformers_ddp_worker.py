"""One rank of a 2-process DDP Trainer run under torchrun (gloo, CPU), for
tests/test_adapter_transformers.py: rank 1's shard turns corrupt after 20
records; writes what the rank ended with to ``<out>/result-<rank>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers_support import EmbeddingRecords, make_trainer, sentinel_facts, trainer_bits

from nanrunbook.capture.torch import SentinelHold


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    records = EmbeddingRecords(corrupt_after=20 if rank == 1 else None)
    trainer, watch = make_trainer(
        out,
        sentinel=sentinel_facts("ddp"),
        dataset=records,
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,  # the first micro-batch under DDP's no_sync
        ddp_backend="gloo",
        ddp_timeout=60,  # a rank left waiting fails instead of hanging
    )
    result: dict[str, object] = {"distributed": trainer.accelerator.distributed_type.value}
    try:
        trainer.train()
        result["held"] = None
    except SentinelHold as hold:
        result.update(
            held=hold.step,
            stage=hold.stage,
            reason=hold.reason,
            origin=list(hold.origin_ranks or ()),
            bundle=str(hold.bundle),
            global_step=trainer.state.global_step,
            untouched=trainer_bits(trainer) == watch.before[hold.step],
        )
    (out / f"result-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
