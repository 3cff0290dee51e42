"""The report: a frozen record of one verdict, and its JSON document.

``report_format`` versions the JSON document so scripts can rely on its shape;
any incompatible change bumps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanrunbook._version import __version__
from nanrunbook.contract import CONTRACT_VERSION, HOLD
from nanrunbook.errors import EvidenceRejected
from nanrunbook.exits import Exit
from nanrunbook.manifest.declared import NOTHING_DECLARED, Declared
from nanrunbook.records import (
    Counts,
    Decision,
    EarlyWarning,
    Extremes,
    Headroom,
    Manifest,
    Scaler,
    StageFinding,
    TensorFinding,
    TensorHeadroom,
)
from nanrunbook.verdict.precision import headroom
from nanrunbook.verdict.runbook import Section
from nanrunbook.verdict.wording import reported_magnitude

__all__ = [
    "REPORT_FORMAT",
    "SET_MEMBER_ALONE",
    "CheckedAlone",
    "Report",
    "path_text",
    "rejection_document",
    "report_document",
]

REPORT_FORMAT = "nanrunbook-report/1"


SET_MEMBER_ALONE = "SET_MEMBER_ALONE"


@dataclass(frozen=True, slots=True)
class CheckedAlone:
    """A bundle whose topology says rank ``rank`` of ``world_size`` > 1, checked on
    its own: one member of an incident set, whose verdict is ``set_path``'s (the
    directory holding it). Marked by the warning SET_MEMBER_ALONE."""

    rank: int
    world_size: int
    set_path: str
    warning: str = SET_MEMBER_ALONE


@dataclass(frozen=True, slots=True)
class Report:
    """What ``check_bundle`` answers for evidence it accepted."""

    bundle: str
    contract_content_id: str
    manifest: Manifest
    stages: tuple[StageFinding, ...]
    decision: Decision
    checklist: tuple[Section, ...]
    # Early warnings about the tensors' values (nanrunbook.verdict.precision); they
    # never change the decision or the exit code.
    warnings: tuple[EarlyWarning, ...] = ()
    contract_version: str = CONTRACT_VERSION
    report_format: str = REPORT_FORMAT
    # Set by the caller that checked this bundle alone (check_path), never by the
    # check of its set: its own verdict is unchanged.
    alone: CheckedAlone | None = None

    @property
    def warned(self) -> bool:
        """Whether any warning stands: an early warning, or SET_MEMBER_ALONE."""
        return bool(self.warnings) or self.alone is not None

    @property
    def exit_code(self) -> int:
        return Exit.HOLD if self.decision.decision == HOLD else Exit.CONTINUE

    def exit_code_for(self, *, fail_on_warnings: bool = False) -> int:
        """The process's exit code: the verdict's, except that a CONTINUE with
        warnings is WARNINGS (5) when the caller asked to fail on them. A HOLD
        stays HOLD: 5 never hides one."""
        if fail_on_warnings and self.exit_code == Exit.CONTINUE and self.warned:
            return Exit.WARNINGS
        return self.exit_code

    @property
    def scaler(self) -> Scaler:
        return self.manifest.binding.scaler

    def reported_magnitude(self, stage: StageFinding, stored: float | None) -> float | None:
        """A stored magnitude as reported: scaled gradients are divided by the scale."""
        return reported_magnitude(stage, stored, self.scaler)


def _counts(counts: Counts | None) -> dict[str, int] | None:
    return None if counts is None else counts.as_dict()


def _extremes(extremes: Extremes | None) -> dict[str, Any] | None:
    if extremes is None:
        return None
    return {
        "values": extremes.values,
        "min": extremes.min,
        "max": extremes.max,
        "max_abs": extremes.max_abs,
        "min_nonzero_abs": extremes.min_nonzero_abs,
        "zeros": extremes.zeros,
        "subnormals": extremes.subnormals,
    }


def _room(room: Headroom | None) -> dict[str, Any] | None:
    if room is None:
        return None
    return {
        "dtype": room.dtype,
        "max_finite": room.max_finite,
        "bits": room.bits,
        "exp_limit": room.exp_limit,
        "square_limit": room.square_limit,
        "reciprocal_limit": room.reciprocal_limit,
        "exp_overflows": room.exp_overflows,
        "square_overflows": room.square_overflows,
        "reciprocal_overflows": room.reciprocal_overflows,
        "sum_can_overflow": room.sum_can_overflow,
    }


def _headroom(room: TensorHeadroom | None) -> dict[str, Any] | None:
    return None if room is None else {"own": _room(room.own), "compute": _room(room.compute)}


def _tensor(
    report: Report, stage: StageFinding, tensor: TensorFinding, room: TensorHeadroom | None
) -> dict[str, Any]:
    entry = tensor.entry
    return {
        "name": entry.name,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "file": entry.file,
        "sha256": entry.sha256,
        "probe": entry.probe,
        "counts": _counts(tensor.counts),
        "finite_max_abs": report.reported_magnitude(stage, tensor.finite_max_abs),
        "extremes": _extremes(tensor.extremes),
        "headroom": _headroom(room),
    }


def _stage(
    report: Report, stage: StageFinding, rooms: dict[tuple[str, int], TensorHeadroom]
) -> dict[str, Any]:
    record = stage.record
    return {
        "stage": record.stage,
        "status": record.status,
        "owner": record.owner,
        "telemetry_id": record.telemetry_id,
        "tensor_set": {"id": record.tensor_set_id, "probe_source": record.probe_source},
        "resolution": record.resolution,
        "gradients": record.gradients,
        "reason": record.reason,
        "counts_source": stage.counts_source,
        "counts": _counts(stage.counts),
        "finite_max_abs": report.reported_magnitude(stage, stage.finite_max_abs),
        "finite_max_abs_stored": stage.finite_max_abs,
        "first_nonfinite_tensor": (
            stage.first_nonfinite_tensor if stage.counts_source == "recounted" else None
        ),
        "tensors": [
            _tensor(report, stage, t, rooms.get((stage.stage, index)))
            for index, t in enumerate(stage.tensors)
        ],
    }


def scaler_document(scaler: Scaler) -> dict[str, Any]:
    document: dict[str, Any] = {"mode": scaler.mode, "scale": scaler.scale}
    if scaler.mode == "dynamic":
        document.update(
            growth_factor=scaler.growth_factor,
            backoff_factor=scaler.backoff_factor,
            found_inf=scaler.found_inf,
            step_skipped=scaler.step_skipped,
            scale_after=scaler.scale_after,
        )
    return document


def report_document(report: Report) -> dict[str, Any]:
    manifest = report.manifest
    decision = report.decision
    rooms = {(room.stage, room.index): room for room in headroom(report)}
    return {
        "report_format": report.report_format,
        "tool": {"name": "nanrunbook", "version": __version__},
        "contract_version": report.contract_version,
        "contract_content_id": report.contract_content_id,
        "bundle": path_text(report.bundle),
        "run": {"run_id": manifest.run_id, "step": manifest.step},
        "evidence_id": manifest.evidence_id,
        "evidence_content_id": manifest.evidence_content_id,
        "incident_owner": manifest.incident_owner,
        "decision": decision.decision,
        "earliest_nonfinite_stage": decision.earliest_nonfinite_stage,
        "first_nonfinite_tensor": decision.first_nonfinite_tensor,
        "action": decision.action,
        "root_cause_claim": decision.root_cause_claim,
        "exit_code": report.exit_code,
        "stages": [_stage(report, s, rooms) for s in report.stages],
        "scaler": scaler_document(report.scaler),
        "last_known_good": {
            "checkpoint_id": manifest.last_known_good.checkpoint_id,
            "step": manifest.last_known_good.step,
            "verified_together": list(manifest.last_known_good.verified_together),
        },
        "binding": {name: dict(fields) for name, fields in manifest.binding.details.items()},
        "checklist": checklist_document(report.checklist),
        "warnings": [
            {
                "code": w.code,
                "stage": w.stage,
                "tensor": w.tensor,
                "index": w.index,
                "message": w.message,
            }
            for w in report.warnings
        ],
        "set_member": None if report.alone is None else set_member_document(report.alone),
    }


def set_member_document(alone: CheckedAlone) -> dict[str, Any]:
    return {
        "rank": alone.rank,
        "world_size": alone.world_size,
        "set_path": path_text(alone.set_path),
        "warning": alone.warning,
    }


def checklist_document(sections: tuple[Section, ...]) -> list[dict[str, Any]]:
    return [
        {
            "id": section.id,
            "title": section.title,
            "steps": [{"id": s.id, "title": s.title, "detail": s.detail} for s in section.steps],
        }
        for section in sections
    ]


def rejection_document(
    error: EvidenceRejected,
    bundle: str,
    contract_content_id: str,
    declared: Declared = NOTHING_DECLARED,
) -> dict[str, Any]:
    """A rejection; ``declared`` holds what the rejected manifest validly declares
    about its place in a job (null where nothing), so that ``merge`` can place a
    rejected rank in its incident set."""
    return {
        "report_format": REPORT_FORMAT,
        "tool": {"name": "nanrunbook", "version": __version__},
        "contract_version": CONTRACT_VERSION,
        "contract_content_id": contract_content_id,
        "bundle": path_text(bundle),
        "decision": "REJECTED",
        "exit_code": error.exit_code,
        "violations": [
            {"code": v.code, "where": v.where, "message": v.message} for v in error.violations
        ],
        "declared": declared.as_dict(),
    }


def path_text(path: str) -> str:
    """A path as JSON carries it: as given when it is printable UTF-8; otherwise
    (a control or bidi character, a file name that is not UTF-8, which Python keeps
    as lone surrogates) with every character outside ASCII or printable escaped."""
    if path.isprintable():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            return path
    return ascii(path)[1:-1]
