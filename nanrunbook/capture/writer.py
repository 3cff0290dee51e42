"""BundleWriter: evidence bundles from training code, sealed and written atomically.

Counts, digests and magnitudes come from the same engine ``check`` uses, and
``write`` runs the check itself on the finished bundle before it is moved into
place: the writer refuses exactly what the check would reject, with the same
violation codes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_directory, write_synced
from ..content_id import EVIDENCE_ID_KEY, evidence_content_id
from ..contract import BUNDLE_FORMAT, CONTRACT_VERSION, Caps
from ..counting import tally_bytes
from ..dtypes import DTYPES
from ..model import STAGE_ORDER, Counts
from ..tensorwriter import RawTensor, safetensors_chunks

__all__ = ["NUMPY_DTYPES", "BundleWriter", "RawTensor", "as_raw"]

RECOVERY_PARTS = ("model", "optimizer", "scheduler", "scaler", "data_position")
TENSOR_FILE = "tensors.safetensors"

# numpy dtype names (ml_dtypes names included) -> safetensors dtype names.
NUMPY_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "bfloat16": "BF16",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e8m0fnu": "F8_E8M0",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


def as_raw(value: Any) -> RawTensor:
    """A numpy array, a torch tensor (any device) or a RawTensor, as raw bytes."""
    if isinstance(value, RawTensor):
        return value
    if type(value).__module__.split(".")[0] == "torch":
        from .torch import tensor_to_raw

        return tensor_to_raw(value)
    import numpy as np

    array = np.asarray(value)
    name = NUMPY_DTYPES.get(array.dtype.name)
    if name is None:
        raise TypeError(f"no safetensors dtype for numpy dtype {array.dtype.name!r}")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    data = np.ascontiguousarray(array).tobytes()
    return RawTensor(name, tuple(int(d) for d in array.shape), data)


@dataclass(frozen=True, slots=True)
class _Captured:
    name: str
    tensor: RawTensor
    probe: str
    sha256: str
    counts: Counts
    finite_max_abs: float | None


class BundleWriter:
    """Collects the five stages of one failing step and writes a sealed bundle.

    Record stages in contract order with :meth:`observe`, :meth:`summarize` or
    :meth:`not_run`; :meth:`not_run_rest` marks every stage not yet recorded as
    NOT_RUN. Tensors are kept in memory until :meth:`write`.
    """

    def __init__(
        self,
        *,
        run_id: str,
        step: int,
        incident_owner: str,
        binding: Mapping[str, Mapping[str, Any]],
        last_known_good: Mapping[str, Any],
        evidence_id: str | None = None,
    ) -> None:
        self.run_id = run_id
        self.step = step
        self.incident_owner = incident_owner
        self.binding = {name: dict(fields) for name, fields in binding.items()}
        lkg = dict(last_known_good)
        lkg.setdefault("verified_together", list(RECOVERY_PARTS))
        self.last_known_good = lkg
        self.evidence_id = evidence_id or f"{run_id}.step-{step}"
        self._stages: list[dict[str, Any]] = []
        self._tensors: list[_Captured] = []

    @property
    def recorded(self) -> tuple[str, ...]:
        return tuple(str(s["stage"]) for s in self._stages)

    def _base(
        self,
        stage: str,
        status: str,
        owner: str,
        probe_source: str,
        telemetry_id: str | None,
        tensor_set_id: str | None,
        gradients: str | None,
    ) -> dict[str, Any]:
        if stage not in STAGE_ORDER:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGE_ORDER)}")
        if stage in self.recorded:
            raise ValueError(f"stage {stage!r} is already recorded")
        record: dict[str, Any] = {
            "stage": stage,
            "status": status,
            "owner": owner,
            "telemetry_id": telemetry_id or f"tel-{self.step}-{stage}",
            "tensor_set": {
                "id": tensor_set_id or f"ts-{self.step}-{stage}",
                "probe_source": probe_source,
            },
        }
        if stage == "backward":
            record["gradients"] = gradients or "unscaled"
        elif gradients is not None:
            raise ValueError("only the backward stage has gradients")
        return record

    def observe(
        self,
        stage: str,
        tensors: Iterable[tuple[str, Any, str]],
        *,
        owner: str,
        probe_source: str,
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> Counts:
        """Record an OBSERVED stage with complete data: ``(name, tensor, probe)`` in
        capture order. Returns the stage's counts."""
        record = self._base(
            stage, "OBSERVED", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        captured: list[_Captured] = []
        for name, value, probe in tensors:
            raw = as_raw(value)
            tally = tally_bytes(raw.dtype, raw.data)
            counts = Counts(tally.elements, tally.finite, tally.nan, tally.posinf, tally.neginf)
            captured.append(
                _Captured(
                    name, raw, probe, hashlib.sha256(raw.data).hexdigest(), counts, tally.max_abs
                )
            )
        total = Counts(
            elements=sum(c.counts.elements for c in captured),
            finite=sum(c.counts.finite for c in captured),
            nan=sum(c.counts.nan for c in captured),
            posinf=sum(c.counts.posinf for c in captured),
            neginf=sum(c.counts.neginf for c in captured),
        )
        maxima = [
            c.finite_max_abs
            for c in captured
            if c.finite_max_abs is not None and DTYPES[c.tensor.dtype].floating
        ]
        record.update(
            resolution="complete",
            tensors=[
                {
                    "name": c.name,
                    "file": TENSOR_FILE,
                    "dtype": c.tensor.dtype,
                    "shape": list(c.tensor.shape),
                    "sha256": c.sha256,
                    "probe": c.probe,
                }
                for c in captured
            ],
            counts=_counts_document(total),
            finite_max_abs=max(maxima) if maxima else None,
        )
        self._stages.append(record)
        self._tensors.extend(captured)
        return total

    def summarize(
        self,
        stage: str,
        entries: Iterable[tuple[str, str, tuple[int, ...], str]],
        counts: Counts,
        *,
        owner: str,
        probe_source: str,
        finite_max_abs: float | None = None,
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> None:
        """Record an OBSERVED stage by declared counts only: ``(name, dtype, shape,
        probe)`` entries. The counts must cover every element (no samples)."""
        record = self._base(
            stage, "OBSERVED", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        record.update(
            resolution="summary",
            tensors=[
                {"name": name, "dtype": dtype, "shape": list(shape), "probe": probe}
                for name, dtype, shape, probe in entries
            ],
            counts=_counts_document(counts),
        )
        if finite_max_abs is not None:
            record["finite_max_abs"] = finite_max_abs
        self._stages.append(record)

    def not_run(
        self,
        stage: str,
        *,
        owner: str,
        reason: str,
        probe_source: str = "not captured: the stage did not run",
        telemetry_id: str | None = None,
        tensor_set_id: str | None = None,
        gradients: str | None = None,
    ) -> None:
        record = self._base(
            stage, "NOT_RUN", owner, probe_source, telemetry_id, tensor_set_id, gradients
        )
        record["reason"] = reason
        self._stages.append(record)

    def not_run_rest(self, *, owner: str, reason: str) -> None:
        """Mark every stage not recorded yet as NOT_RUN, in contract order."""
        for stage in STAGE_ORDER:
            if stage not in self.recorded:
                self.not_run(stage, owner=owner, reason=reason)

    def manifest(self) -> dict[str, Any]:
        """The sealed manifest: everything recorded, with its evidence content id."""
        order = {stage: i for i, stage in enumerate(STAGE_ORDER)}
        document: dict[str, Any] = {
            "format": BUNDLE_FORMAT,
            "contract_version": CONTRACT_VERSION,
            "evidence_id": self.evidence_id,
            "run": {"run_id": self.run_id, "step": self.step},
            "incident_owner": self.incident_owner,
            "binding": self.binding,
            "last_known_good": self.last_known_good,
            "stages": sorted(self._stages, key=lambda s: order[s["stage"]]),
        }
        document[EVIDENCE_ID_KEY] = evidence_content_id(document)
        return document

    def write(
        self, target: str | Path, *, overwrite: bool = False, caps: Caps | None = None
    ) -> Path:
        """Write the bundle to ``target`` atomically and return its path.

        Raises EvidenceRejected (nothing is written) when the check would reject
        the bundle, and FileExistsError when ``target`` exists and ``overwrite``
        is false.
        """
        import orjson

        from ..check import check_bundle

        target = Path(target)
        manifest = self.manifest()
        with atomic_directory(target, overwrite=overwrite) as temp:
            if self._tensors:
                write_synced(
                    temp / TENSOR_FILE,
                    safetensors_chunks([(c.name, c.tensor) for c in self._tensors]),
                )
            write_synced(
                temp / "manifest.json", [orjson.dumps(manifest, option=orjson.OPT_INDENT_2)]
            )
            check_bundle(temp, caps=caps)  # raises EvidenceRejected; the temp is removed
        return target


def _counts_document(counts: Counts) -> dict[str, int]:
    return {
        "elements": counts.elements,
        "finite": counts.finite,
        "nan": counts.nan,
        "posinf": counts.posinf,
        "neginf": counts.neginf,
    }
