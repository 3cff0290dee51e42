"""Builders for small valid bundles, shared by tests that need a fresh one."""

from __future__ import annotations

import numpy as np

from nanrunbook.capture import BundleWriter

# The five parts a recovery point verifies together, stated as every caller must.
RECOVERY = ["model", "optimizer", "scheduler", "scaler", "data_position"]

OWNER = "training-oncall"


def binding() -> dict[str, dict[str, object]]:
    return {
        "model": {"id": "model-test"},
        "checkpoint": {"id": "ckpt-9"},
        "data": {"id": "data-test"},
        "batch": {"id": "batch-10"},
        "loader_cursor": {"id": "cursor-10"},
        "objective": {"id": "objective", "reduction": "mean"},
        "optimizer": {"id": "sgd"},
        "scheduler": {"id": "constant"},
        "scaler": {"id": "no-scaler", "mode": "none", "scale": 1},
        "random_state": {"id": "seed-0"},
        "environment": {"id": "env-test"},
        "topology": {"id": "single", "world_size": 1, "rank": 0},
        "precision": {"id": "fp32", "param_dtype": "F32", "compute_dtype": "F32"},
    }


def finite_writer(probe: str = "probe") -> BundleWriter:
    """Five OBSERVED stages, every element finite."""
    writer = BundleWriter(
        run_id="run-test",
        step=10,
        incident_owner="ml-oncall",
        binding=binding(),
        last_known_good={"checkpoint_id": "ckpt-9", "step": 9, "verified_together": RECOVERY},
    )
    for index, stage in enumerate(("input", "forward", "loss", "backward", "optimizer")):
        writer.observe(
            stage,
            [(f"{stage}/t", np.arange(4, dtype="float32") + index, probe)],
            owner=OWNER,
            probe_source=probe,
        )
    return writer
