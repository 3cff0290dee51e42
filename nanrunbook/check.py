"""``check_bundle``: the whole check, from a directory to a verdict.

Order matters: the manifest is parsed and judged, caps included, before a byte
of tensor data is read, so hostile declarations cost nothing to refuse.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from nanrunbook.access import read_manifest_bytes
from nanrunbook.contract import Caps, contract_content_id
from nanrunbook.errors import EvidenceRejected, Violation
from nanrunbook.manifest.content_id import evidence_content_id
from nanrunbook.manifest.parse import parse_manifest
from nanrunbook.manifest.rules import scaler_stage_violations
from nanrunbook.strictjson import load_manifest_bytes
from nanrunbook.tensors.verify import Progress, verify_bundle
from nanrunbook.verdict.decision import decide
from nanrunbook.verdict.precision import WarningThresholds, early_warnings
from nanrunbook.verdict.report import Report
from nanrunbook.verdict.runbook import checklist

__all__ = ["check_bundle"]


def check_bundle(
    path: str | os.PathLike[str],
    *,
    caps: Caps | None = None,
    progress: Progress | None = None,
    thresholds: WarningThresholds | None = None,
) -> Report:
    """Check the evidence bundle at ``path``.

    Returns a :class:`~nanrunbook.verdict.report.Report` (HOLD or CONTINUE) or raises
    :class:`~nanrunbook.errors.EvidenceRejected` listing every violation found.
    Never writes. ``progress``, if given, is called with each tensor's byte count
    as it is read. ``thresholds`` sets when the report's early warnings fire
    (default :class:`~nanrunbook.verdict.precision.WarningThresholds`); warnings never
    change the decision or the exit code.
    """
    caps = caps or Caps()
    bundle = Path(path)
    tree = load_manifest_bytes(read_manifest_bytes(bundle))
    manifest, violations = parse_manifest(tree, caps)
    declared_id = tree.get("evidence_content_id")
    recomputed = evidence_content_id(tree)
    malformed = any(v.code == "EVIDENCE_CONTENT_ID_INVALID" for v in violations)
    if isinstance(declared_id, str) and declared_id != recomputed and not malformed:
        violations.append(
            Violation(
                "EVIDENCE_CONTENT_ID_MISMATCH",
                "$.evidence_content_id",
                f"the manifest's content recomputes to {recomputed}",
            )
        )
    if manifest is None:
        raise EvidenceRejected(violations)

    # A stale content id still lets the data be checked: report both at once.
    findings, file_violations = verify_bundle(bundle, manifest, progress)
    violations.extend(file_violations)
    # found_inf agreed with the declared counts (else the manifest was rejected
    # above); where the recount differs from them, say what it means for the scaler.
    violations.extend(
        v
        for v in scaler_stage_violations(manifest.binding.scaler, findings, "$", gradients=None)
        if v.code == "SCALER_FOUND_INF_MISMATCH"
    )
    if violations:
        raise EvidenceRejected(violations)

    decision = decide(findings)
    report = Report(
        bundle=str(bundle),
        contract_content_id=contract_content_id(caps),
        manifest=manifest,
        stages=findings,
        decision=decision,
        checklist=checklist(decision.earliest_nonfinite_stage),
    )
    return replace(report, warnings=early_warnings(report, thresholds))
