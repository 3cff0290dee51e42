"""Bundles another tool would write from the spec alone get the spec's answer.

The producer here shares no code with nanrunbook: the reference safetensors
writer (which reorders tensors and adds __metadata__), manifests from the
standard json module in different styles, digests and the content id computed
from the spec's recipe with hashlib and rfc8785.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rfc8785
from safetensors.numpy import save_file

from nanrunbook import EvidenceRejected, check_bundle


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def counts(arrays: list[np.ndarray]) -> dict[str, int]:
    flat = np.concatenate([a.astype("float64").ravel() for a in arrays])
    return {
        "elements": int(flat.size),
        "finite": int(np.isfinite(flat).sum()),
        "nan": int(np.isnan(flat).sum()),
        "posinf": int((flat == np.inf).sum()),
        "neginf": int((flat == -np.inf).sum()),
    }


def max_abs(arrays: list[np.ndarray]) -> float | None:
    flat = np.concatenate([a.astype("float64").ravel() for a in arrays])
    finite = flat[np.isfinite(flat)]
    return float(np.abs(finite).max()) if finite.size else None


STAGE_NAMES = ("input", "forward", "loss", "backward", "optimizer")


def producer_bundle(
    folder: Path,
    stages: dict[str, dict[str, np.ndarray]],
    *,
    file_spelling: str = "t.safetensors",
    scaler: dict[str, Any] | None = None,
    dumps: Any = json.dumps,
) -> Path:
    folder.mkdir()
    all_arrays = {name: arr for arrays in stages.values() for name, arr in arrays.items()}
    save_file(all_arrays, str(folder / "t.safetensors"), metadata={"producer": "other-tool"})
    records = []
    for stage in STAGE_NAMES:
        record: dict[str, Any] = {
            "stage": stage,
            "owner": "team-" + stage,
            "telemetry_id": f"telemetry/{stage}",
            "tensor_set": {"id": f"set:{stage}", "probe_source": f"{stage} hook \u2014 unicode ok"},
        }
        if stage == "backward":
            record["gradients"] = "unscaled"
        arrays = stages.get(stage)
        if arrays is None:
            record.update(status="NOT_RUN", reason="stopped after a non-finite stage")
        else:
            values = list(arrays.values())
            record.update(
                status="OBSERVED",
                resolution="complete",
                tensors=[
                    {
                        "probe": "p",
                        "sha256": sha(arr),
                        "shape": list(arr.shape),
                        "dtype": {"float32": "F32", "float16": "F16", "int64": "I64"}[
                            arr.dtype.name
                        ],
                        "file": file_spelling,
                        "name": name,
                    }
                    for name, arr in arrays.items()
                ],
                counts=counts(values),
                finite_max_abs=max_abs([v for v in values if v.dtype.kind == "f"]),
            )
        records.append(record)
    manifest: dict[str, Any] = {
        "stages": records,
        "last_known_good": {
            "verified_together": ["data_position", "scaler", "scheduler", "optimizer", "model"],
            "step": 0,
            "checkpoint_id": "ckpt-0",
        },
        "binding": {
            name: {"id": f"{name}-1"}
            for name in (
                "model",
                "checkpoint",
                "data",
                "batch",
                "loader_cursor",
                "optimizer",
                "scheduler",
                "random_state",
                "environment",
            )
        },
        "incident_owner": "oncall@example",
        "run": {"step": 7, "run_id": "r1"},
        "evidence_id": "r1/7",
        "contract_version": "training-incident-v1",
        "format": "nanrunbook-bundle/1",
    }
    manifest["binding"].update(
        objective={"id": "obj", "reduction": "sum", "label_smoothing": 0.1},
        scaler=scaler or {"id": "s", "mode": "none", "scale": 1.0},
        topology={"id": "ddp", "world_size": 4, "rank": 3, "backend": "gloo"},
        precision={"id": "p", "param_dtype": "F32", "compute_dtype": "F16"},
    )
    digest = hashlib.sha256(rfc8785.dumps(manifest)).hexdigest()
    manifest["evidence_content_id"] = "training-incident-evidence@sha256:" + digest
    (folder / "manifest.json").write_text(dumps(manifest))
    return folder


def finite_stages() -> dict[str, dict[str, np.ndarray]]:
    return {
        "input": {
            "x": np.arange(12, dtype="float32").reshape(3, 4),
            "y": np.arange(3, dtype="int64"),
        },
        "forward": {"h": np.linspace(-1, 1, 8, dtype="float32")},
        "loss": {"loss": np.array(0.5, dtype="float32")},
        "backward": {"g.w": np.full((2, 2), 0.25, dtype="float16")},
        "optimizer": {"opt.m": np.zeros(5, dtype="float32")},
    }


@pytest.mark.parametrize(
    "dumps",
    [
        json.dumps,
        lambda m: json.dumps(m, indent=4, ensure_ascii=False),
        lambda m: json.dumps(m, separators=(",", ":"), sort_keys=True),
    ],
    ids=["default", "pretty-unicode", "compact-sorted"],
)
def test_continue_from_another_producer(tmp_path: Path, dumps: Any) -> None:
    report = check_bundle(producer_bundle(tmp_path / "b", finite_stages(), dumps=dumps))
    assert report.decision.decision == "CONTINUE_BOUNDED_DIAGNOSTICS"
    assert report.exit_code == 0


def test_hold_from_another_producer(tmp_path: Path) -> None:
    stages = finite_stages()
    forward = np.linspace(-1, 1, 8, dtype="float32")
    forward[5] = np.nan
    stages["forward"] = {"h0": np.ones(3, dtype="float32"), "h": forward}
    del stages["loss"], stages["backward"], stages["optimizer"]
    bundle = producer_bundle(tmp_path / "b", stages)
    report = check_bundle(bundle)
    assert report.decision.decision == "HOLD"
    assert report.decision.earliest_nonfinite_stage == "forward"
    assert report.decision.first_nonfinite_tensor == "h"
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert report.manifest.evidence_content_id == manifest["evidence_content_id"]


def test_two_spellings_of_one_file_are_one_file(tmp_path: Path) -> None:
    bundle = producer_bundle(tmp_path / "b", finite_stages(), file_spelling="./t.safetensors")
    assert check_bundle(bundle).exit_code == 0


def test_dynamic_scaler_skip_from_another_producer(tmp_path: Path) -> None:
    stages = finite_stages()
    stages["backward"] = {"g.w": np.array([[1.0, np.inf], [0.5, -np.inf]], dtype="float16")}
    del stages["optimizer"]
    scaler = {
        "id": "amp",
        "mode": "dynamic",
        "scale": 6.5536e4,
        "growth_factor": 2,
        "backoff_factor": 0.5,
        "found_inf": True,
        "step_skipped": True,
        "scale_after": 32768,
    }
    report = check_bundle(producer_bundle(tmp_path / "b", stages, scaler=scaler))
    assert report.decision.earliest_nonfinite_stage == "backward"
    assert report.stages[3].counts is not None
    assert (report.stages[3].counts.posinf, report.stages[3].counts.neginf) == (1, 1)


def test_a_wrong_content_id_from_another_producer_is_rejected(tmp_path: Path) -> None:
    bundle = producer_bundle(tmp_path / "b", finite_stages())
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["incident_owner"] = "changed-after-sealing"
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EvidenceRejected) as info:
        check_bundle(bundle)
    assert info.value.codes == ("EVIDENCE_CONTENT_ID_MISMATCH",)
