"""A recovery point's manifest and its verification, torch-free.

A recovery point is a state directory (``capture/_state_manifest.py``) whose
manifest header says the step, the run, the torch version, the world size and
the parts saved together: the five recovery parts of the bundle contract
(model, optimizer, scheduler, scaler, data_position) and the random states.
Verifying one hashes every file and reads JSON only: it never unpickles, and
``nanrunbook verify-recovery`` runs it without torch. Saving and loading are
``capture/torch/recovery/``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nanrunbook import strictjson
from nanrunbook.access import file_where
from nanrunbook.capture._state_manifest import (
    FORMATS,
    MANIFEST_NAME,
    RANKS_KEY,
    StateDirManifest,
    StateDirRejected,
    read_document,
    verify_state_dir_reading,
)
from nanrunbook.codes import RECOVERY_CODES as CODES
from nanrunbook.errors import EvidenceRejected, Violation, quote
from nanrunbook.manifest.fields import IDENTIFIER
from nanrunbook.manifest.parse import RECOVERY_PARTS

_Read = TypeVar("_Read")

__all__ = [
    "CODES",
    "DOCUMENT_PARTS",
    "FORMAT",
    "PARTS",
    "RNG_STREAMS",
    "RecoveryPoint",
    "RecoveryRecord",
    "RecoveryVerification",
    "StepTrend",
    "latest_recovery_point",
    "record_document",
    "verification_document",
    "verified_manifest",
    "verified_reading",
    "verify_recovery_point",
]

VERIFICATION_FORMAT = "nanrunbook-recovery-verification/1"

FORMAT = FORMATS["recovery_point"]
PARTS = (*RECOVERY_PARTS, "rng")  # what a point holds: the contract's five and the RNG
# The parts kept as JSON documents (``<part>.json``); model and optimizer are DCP state.
DOCUMENT_PARTS = ("scheduler", "scaler", "data_position", "rng")
RNG_STREAMS = ("torch_cpu", "numpy", "python")  # always taken; CUDA devices when present


@dataclass(frozen=True)
class RecoveryVerification:
    """What ``verify-recovery`` found: ``verified`` when no violation."""

    path: str
    violations: tuple[Violation, ...]
    point_id: str | None = None
    run_id: str | None = None
    step: int | None = None
    torch_version: str | None = None
    world_size: int | None = None
    parts: Mapping[str, str] | None = None  # part -> its kind ("dcp", "state_dict", ...)
    files: int = 0
    total_bytes: int = 0

    @property
    def verified(self) -> bool:
        return not self.violations

    def point(self) -> RecoveryPoint:
        """The verified point (ValueError when it is not verified)."""
        if not self.verified or self.point_id is None or self.run_id is None or self.step is None:
            raise ValueError(f"{self.path} is not a verified recovery point")
        return RecoveryPoint(
            self.path,
            self.point_id,
            self.run_id,
            self.step,
            (self.parts or {}).get("data_position", "cursor"),
        )

    def rejected(self) -> StateDirRejected:
        return StateDirRejected(self.violations)


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _header_violations(header: Mapping[str, Any]) -> list[Violation]:
    wrong: list[str] = []
    if not _is_count(header.get("step"), 0):
        wrong.append("step (an integer >= 0)")
    for key in ("run_id", "point_id"):
        value = header.get(key)
        if not (isinstance(value, str) and IDENTIFIER.fullmatch(value)):
            wrong.append(f"{key} (an identifier)")
    if not isinstance(header.get("torch_version"), str):
        wrong.append("torch_version (a string)")
    if not _is_count(header.get("world_size"), 1):
        wrong.append("world_size (an integer >= 1)")
    if not isinstance(header.get("parts"), dict):
        wrong.append("parts (an object)")
    return [
        Violation("RECOVERY_HEADER_INVALID", "manifest.json", f"header.{what} is missing or wrong")
        for what in wrong
    ]


def _part_violations(
    root: Path, header: Mapping[str, Any], listed: Mapping[str, Any], failed: set[str]
) -> list[Violation]:
    step = header["step"]
    parts: Mapping[str, Any] = header["parts"]
    violations: list[Violation] = []
    for part in PARTS:
        entry = parts.get(part)
        where = f"header.parts.{part}"
        if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
            violations.append(Violation("RECOVERY_PART_MISSING", where, f"no {part} in the point"))
            continue
        files = entry.get("files")
        if not (isinstance(files, list) and files and all(f in listed for f in files)):
            message = f"{part}'s files are not all listed in the manifest"
            violations.append(Violation("RECOVERY_PART_MISSING", where, message))
            continue
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            message = f"{part}'s file {quote(absent[0])} is missing"
            violations.append(Violation("RECOVERY_PART_MISSING", where, message))
            continue
        if entry.get("step") != step:
            message = f"{part} saved at step {quote(entry.get('step'))}, the point is step {step}"
            violations.append(Violation("RECOVERY_STEP_MISMATCH", where, message))
        if part in DOCUMENT_PARTS:  # one document, or one per rank of a point every rank wrote
            for name in files:
                if file_where(name) not in failed:
                    violations.extend(_document_violations(root, part, name, step))
    return violations


def _ranks_violations(header: Mapping[str, Any]) -> list[Violation]:
    """A point every rank wrote lists as many ranks' files as its world size."""
    ranks = header.get(RANKS_KEY)
    if ranks is None or not isinstance(ranks, dict) or len(ranks) == header["world_size"]:
        return []  # not every rank's, or its listing already refused (STATE_RANKS_INVALID)
    message = f"the files of {len(ranks)} rank(s) listed, the world size is {header['world_size']}"
    return [Violation("RECOVERY_HEADER_INVALID", f"header.{RANKS_KEY}", message)]


def _document_violations(root: Path, part: str, name: str, step: int) -> list[Violation]:
    """A document part's own step, and the RNG's streams (read as JSON only)."""
    where = name
    try:
        document = read_document(root, name.removesuffix(".json"))
    except StateDirRejected as error:
        return list(error.violations)
    if not isinstance(document, dict):
        return [Violation("RECOVERY_PART_MISSING", where, f"{name} is not a JSON object")]
    violations: list[Violation] = []
    if document.get("step") != step:
        message = f"{name} says step {quote(document.get('step'))}, the point is step {step}"
        violations.append(Violation("RECOVERY_STEP_MISMATCH", where, message))
    if part == "rng":
        streams = document.get("streams")
        missing = [s for s in RNG_STREAMS if not isinstance(streams, dict) or s not in streams]
        if missing:
            message = f"no {', '.join(missing)} random state"
            violations.append(Violation("RECOVERY_RNG_MISSING", where, message))
    return violations


def verify_recovery_point(path: Path | str, *, progress: Any = None) -> RecoveryVerification:
    """Re-read every file of the point, recompute every digest and check the
    manifest: all parts present and saved at one step, DCP's metadata present
    (and naming only DCP's records), the RNG present. Every violation; never
    unpickles; never raises on a bad point (only on a bug)."""
    return verified_manifest(path, progress=progress)[0]


def verified_manifest(
    path: Path | str, *, progress: Any = None
) -> tuple[RecoveryVerification, StateDirManifest | None]:
    """:func:`verify_recovery_point` and the manifest it verified (for a loader
    that reads the point next without hashing it again)."""
    verification, manifest, _ = verified_reading(path, progress=progress)
    return verification, manifest


def verified_reading(
    path: Path | str,
    *,
    read: Callable[[StateDirManifest], _Read] | None = None,
    progress: Any = None,
    metadata_unpickled: bool = False,
) -> tuple[RecoveryVerification, StateDirManifest | None, _Read | None]:
    """:func:`verified_manifest`, with ``read(manifest)`` run while the point's
    data files are hashed (``verify_state_dir_reading``, ``metadata_unpickled``
    as there); its result only when the point verified."""
    root = Path(path)
    manifest, found, result = verify_state_dir_reading(
        root,
        kind_format=FORMAT,
        read=read,
        progress=progress,
        metadata_unpickled=metadata_unpickled,
    )
    violations = list(found)
    if manifest is None:
        return RecoveryVerification(str(root), tuple(violations)), None, None
    header = manifest.header
    header_violations = _header_violations(header)
    violations.extend(header_violations)
    if not header_violations:
        failed = {violation.where for violation in found}  # their contents are not read
        violations.extend(_part_violations(root, header, manifest.files, failed))
        violations.extend(_ranks_violations(header))
    parts = header.get("parts") if isinstance(header.get("parts"), dict) else {}
    verification = RecoveryVerification(
        path=str(root),
        violations=tuple(violations),
        point_id=_text(header.get("point_id")),
        run_id=_text(header.get("run_id")),
        step=header.get("step") if _is_count(header.get("step"), 0) else None,
        torch_version=_text(header.get("torch_version")),
        world_size=header.get("world_size") if _is_count(header.get("world_size"), 1) else None,
        parts={
            str(name): str(entry.get("kind"))
            for name, entry in (parts or {}).items()
            if isinstance(entry, dict)
        },
        files=len(manifest.files),
        total_bytes=manifest.total_bytes,
    )
    return verification, manifest, result if verification.verified else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class RecoveryPoint:
    """A recovery point the tool wrote and verified: where, which, at what step,
    and what its data position is."""

    path: str
    point_id: str
    run_id: str
    step: int
    data_kind: str  # "state_dict" (a loader's or sampler's) or "cursor"

    @property
    def last_known_good(self) -> dict[str, Any]:
        """The bundle's last_known_good record for this point (the contract's form)."""
        return {
            "checkpoint_id": self.point_id,
            "step": self.step,
            "verified_together": list(RECOVERY_PARTS),
        }


def latest_recovery_point(directory: Path | str) -> RecoveryVerification | None:
    """The verified point of the highest step among ``directory``'s entries (a
    point that fails verification, a half-written one, a temporary a killed
    writer left: never); None when there is none. Newest first: only points
    newer than the one returned are fully read."""
    candidates: list[tuple[int, str, Path]] = []
    for entry in Path(directory).iterdir():
        if not entry.is_dir() or entry.is_symlink():
            continue
        try:
            header = strictjson.load_manifest_bytes((entry / MANIFEST_NAME).read_bytes()).get(
                "header"
            )
        except (OSError, EvidenceRejected):
            continue  # no manifest: not a point (a killed writer's temporary, say)
        step = header.get("step") if isinstance(header, dict) else None
        if isinstance(step, int) and _is_count(step, 0):
            candidates.append((step, entry.name, entry))
    for _, _, entry in sorted(candidates, reverse=True):
        verification = verify_recovery_point(entry)
        if verification.verified:
            return verification
    return None


def verification_document(verification: RecoveryVerification) -> dict[str, Any]:
    """``verify-recovery --format json``: what was verified and every violation."""
    return {
        "verification_format": VERIFICATION_FORMAT,
        "path": verification.path,
        "verified": verification.verified,
        "point_id": verification.point_id,
        "run_id": verification.run_id,
        "step": verification.step,
        "torch_version": verification.torch_version,
        "world_size": verification.world_size,
        "parts": dict(verification.parts or {}),
        "files": verification.files,
        "bytes": verification.total_bytes,
        "violations": [
            {"code": v.code, "where": v.where, "message": v.message}
            for v in verification.violations
        ],
    }


RECORD_FORMAT = "nanrunbook-recovery-record/1"


@dataclass(frozen=True)
class StepTrend:
    """Median loss and gradient norm over some steps (None: no finite value)."""

    steps: int
    loss: float | None
    grad_norm: float | None


@dataclass(frozen=True)
class RecoveryRecord:
    """What ``prove_recovery`` ran and found: proven, or why not. Reopening the
    run stays a person's decision: ``reopen_decided_by`` (the incident's owner)."""

    point: str
    point_id: str
    point_step: int
    run_id: str
    incident: str
    incident_step: int
    incident_owner: str
    change: str | None
    steps_run: tuple[int, ...]
    held_at: int | None
    warnings: tuple[tuple[int, str], ...]  # (step, code), from the incident step on
    before: StepTrend  # the resumed run's own steps before the incident
    after: StepTrend  # the incident step and the ones after it
    digests_match: bool  # the state after resume is the point's, bit for bit (its digests)
    new_bundle: str | None
    new_decision: str | None
    diff_verdict: str | None
    diff_outcome: str | None
    changed_items: tuple[str, ...]
    reasons: tuple[str, ...]  # why not proven (empty when proven)
    max_warnings: int = 0

    @property
    def proven(self) -> bool:
        return not self.reasons

    @property
    def reopen_decided_by(self) -> str:
        return self.incident_owner


def record_document(record: RecoveryRecord) -> dict[str, Any]:
    """The recovery record as JSON (``recovery.json``, ``prove --format json``)."""

    def trend(value: StepTrend) -> dict[str, Any]:
        return {"steps": value.steps, "loss": value.loss, "grad_norm": value.grad_norm}

    return {
        "record_format": RECORD_FORMAT,
        "proven": record.proven,
        "reasons": list(record.reasons),
        "point": {"path": record.point, "id": record.point_id, "step": record.point_step},
        "run_id": record.run_id,
        "incident": {
            "bundle": record.incident,
            "step": record.incident_step,
            "owner": record.incident_owner,
        },
        "change": record.change,
        "steps_run": list(record.steps_run),
        "held_at": record.held_at,
        "warnings": [{"step": step, "code": code} for step, code in record.warnings],
        "max_warnings": record.max_warnings,
        "trend": {"before": trend(record.before), "after": trend(record.after)},
        "digests_match": record.digests_match,
        "new_bundle": record.new_bundle,
        "new_decision": record.new_decision,
        "diff": {
            "verdict": record.diff_verdict,
            "outcome": record.diff_outcome,
            "changed_items": list(record.changed_items),
        },
        "reopen": {
            "decided_by": record.reopen_decided_by,
            "note": "reopening the run is a person's decision; this record is its evidence",
        },
    }
