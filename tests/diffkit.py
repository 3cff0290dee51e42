"""Test helpers for diff: small real bundles written by BundleWriter, one binding
item or one tensor changed at a time."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

from nanrunbook.capture import BundleWriter
from nanrunbook.records import Counts

STAGES = ("input", "forward", "loss", "backward", "optimizer")

BINDING: dict[str, dict[str, Any]] = {
    "model": {"id": "model-tiny", "parameters": 24},
    "checkpoint": {"id": "ckpt-100"},
    "data": {"id": "data-v1"},
    "batch": {"id": "batch-101", "size": 4},
    "loader_cursor": {"id": "cursor-101"},
    "objective": {"id": "xent", "reduction": "mean"},
    "optimizer": {"id": "adamw", "lr": 0.001},
    "scheduler": {"id": "constant"},
    "scaler": {"id": "no-scaling", "mode": "none", "scale": 1},
    "random_state": {"id": "seed-0"},
    "environment": {"id": "env-cpu"},
    "topology": {"id": "single", "world_size": 1, "rank": 0},
    "precision": {"id": "fp32", "param_dtype": "F32", "compute_dtype": "F32"},
}

DYNAMIC_SCALER = {
    "id": "gradscaler",
    "mode": "dynamic",
    "scale": 65536,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "found_inf": False,
    "step_skipped": False,
    "scale_after": 65536,
}


def finite_tensors() -> dict[str, list[tuple[str, Any]]]:
    """Five stages of small finite tensors, distinct per name."""
    rng = np.random.default_rng(7)
    return {
        "input": [
            ("batch/x", rng.standard_normal((4, 3)).astype("<f4")),
            ("batch/y", np.arange(4)),
        ],
        "forward": [
            ("act/l0", rng.standard_normal((4, 8)).astype("<f4")),
            ("act/l1", rng.standard_normal((4, 2)).astype("<f4")),
        ],
        "loss": [("loss", np.array(0.5, dtype="<f4"))],
        "backward": [("grad/w", rng.standard_normal((3, 8)).astype("<f4"))],
        "optimizer": [("update/w", rng.standard_normal((3, 8)).astype("<f4"))],
    }


def with_value(
    tensors: dict[str, list[tuple[str, Any]]], name: str, index: tuple[int, ...], value: float
) -> dict[str, list[tuple[str, Any]]]:
    """A copy of ``tensors`` with one element of one tensor set to ``value``."""
    changed = copy.deepcopy(tensors)
    for entries in changed.values():
        for tensor_name, array in entries:
            if tensor_name == name:
                array[index] = value
                return changed
    raise KeyError(name)


def write_bundle(
    target: Path,
    tensors: dict[str, list[tuple[str, Any]]] | None = None,
    *,
    binding: dict[str, dict[str, Any]] | None = None,
    changes: dict[str, dict[str, Any]] | None = None,
    step: int = 101,
    run_id: str = "run-diff",
    summaries: tuple[str, ...] = (),
) -> Path:
    """A bundle: ``tensors`` per stage (stages left out are NOT_RUN), ``changes``
    merged into binding items, ``summaries`` stages recorded by counts only."""
    items = copy.deepcopy(binding or BINDING)
    for item, fields in (changes or {}).items():
        items[item] = {**items[item], **fields}
    writer = BundleWriter(
        run_id=run_id,
        step=step,
        incident_owner="ml-oncall",
        binding=items,
        last_known_good={
            "checkpoint_id": "ckpt-100",
            "step": 100,
            "verified_together": ["model", "optimizer", "scheduler", "scaler", "data_position"],
        },
    )
    stages = finite_tensors() if tensors is None else tensors
    for stage in STAGES:
        if stage not in stages:
            continue
        entries = [(name, value, f"probe of {name}") for name, value in stages[stage]]
        if stage in summaries:
            writer.summarize(
                stage,
                [(n, _dtype(v), tuple(np.shape(v)), p) for n, v, p in entries],
                _counts(entries),
                owner="oncall",
                probe_source=f"summary of {stage}",
            )
        else:
            writer.observe(stage, entries, owner="oncall", probe_source=f"capture of {stage}")
    writer.not_run_rest(owner="oncall", reason="an earlier stage went non-finite")
    return writer.write(target)


def _dtype(value: Any) -> str:
    return {"float32": "F32", "int64": "I64", "float16": "F16"}[np.asarray(value).dtype.name]


def _counts(entries: list[tuple[str, Any, str]]) -> Counts:
    values = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for _, v, _ in entries])
    return Counts(
        elements=int(values.size),
        finite=int(np.isfinite(values).sum()),
        nan=int(np.isnan(values).sum()),
        posinf=int(np.isposinf(values).sum()),
        neginf=int(np.isneginf(values).sum()),
    )
