"""Builders for incident sets: one small real bundle per rank, written by the
capture writer (so each is a bundle ``check`` accepts), then edited as a case needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from bundlekit import load, save
from fixtures_support import OWNER, RECOVERY, binding

from nanrunbook.capture import BundleWriter

STAGES = ("input", "forward", "loss", "backward", "optimizer")


def rank_bundle(
    target: Path,
    *,
    rank: int,
    world_size: int,
    hold: str | None = None,
    run_id: str = "run-ranks",
    step: int = 10,
    saturate: bool = False,
) -> Path:
    """Write rank ``rank``'s bundle to ``target``: every stage finite, or, with
    ``hold``, a NaN at that stage (in its second tensor) and the later stages NOT_RUN.
    ``saturate`` puts F32's largest finite value in the forward stage (a warning)."""
    items = binding()
    items["topology"] = {"id": f"ddp-{world_size}", "world_size": world_size, "rank": rank}
    writer = BundleWriter(
        run_id=run_id,
        step=step,
        incident_owner="ml-oncall",
        binding=items,
        last_known_good={
            "checkpoint_id": "ckpt-9",
            "step": step - 1,
            "verified_together": RECOVERY,
        },
    )
    for index, stage in enumerate(STAGES):
        values = np.arange(4, dtype="float32") + index + rank
        if stage == hold:
            values[2] = np.nan
        if saturate and stage == "forward":
            values[0] = np.finfo(np.float32).max
        extra: dict[str, Any] = {"gradients": "unscaled"} if stage == "backward" else {}
        writer.observe(
            stage,
            [(f"{stage}/a", np.ones(3, dtype="float32"), "a"), (f"{stage}/b", values, "b")],
            owner=OWNER,
            probe_source=f"{stage} probe",
            **extra,
        )
        if stage == hold:
            writer.not_run_rest(owner=OWNER, reason=f"held at {stage}")
            break
    target.parent.mkdir(parents=True, exist_ok=True)
    writer.write(target)
    return target


def make_set(
    root: Path,
    world_size: int,
    *,
    holds: dict[int, str] | None = None,
    ranks: list[int] | None = None,
    name: str = "rank-{rank:05d}",
    **kwargs: Any,
) -> Path:
    """An incident set in ``root``: one member per rank of ``ranks`` (default all)."""
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size) if ranks is None else ranks:
        hold = (holds or {}).get(rank)
        rank_bundle(
            root / name.format(rank=rank), rank=rank, world_size=world_size, hold=hold, **kwargs
        )
    return root


def edit(bundle: Path, change: Any, *, reseal: bool = True) -> None:
    """Apply ``change(manifest)`` to a member's manifest and reseal its content id."""
    manifest = load(bundle)
    change(manifest)
    save(bundle, manifest, reseal=reseal)


def reject_data(bundle: Path) -> None:
    """Flip a byte of tensor data: the member is rejected (DIGEST_MISMATCH and a
    recount mismatch) after its topology was read."""
    path = bundle / "tensors.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))


def break_json(bundle: Path) -> None:
    """Make the manifest invalid JSON: rejected before its topology can be read."""
    (bundle / "manifest.json").write_bytes(b'{"format": ')
