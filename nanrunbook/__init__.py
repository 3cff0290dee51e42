"""nanrunbook: check NaN-incident evidence bundles and answer HOLD or CONTINUE.

The library API the CLI is built on::

    import nanrunbook
    try:
        report = nanrunbook.check_bundle("bundle/")
    except nanrunbook.EvidenceRejected as error:
        for violation in error.violations: ...
    else:
        report.decision.decision  # "HOLD" or "CONTINUE_BOUNDED_DIAGNOSTICS"

    incident = nanrunbook.check_incident_set("incident/run-7/1842/")  # one bundle per rank
    incident.decision, incident.origin, incident.origin_ranks  # "HOLD", "ONE_RANK", (3,)

Names are imported on first use, so ``nanrunbook --help`` loads no numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nanrunbook._version import __version__

if TYPE_CHECKING:
    from nanrunbook.check import check_bundle
    from nanrunbook.check_set import check_incident_set, is_incident_set
    from nanrunbook.contract import Caps, contract_content_id, contract_document
    from nanrunbook.diff import (
        Comparison,
        ComparisonRejected,
        diff_bundles,
        diff_document,
    )
    from nanrunbook.errors import EvidenceRejected, Violation
    from nanrunbook.verdict.decision import decide
    from nanrunbook.verdict.incident_set import IncidentSet, set_document
    from nanrunbook.verdict.merge import merge_reports
    from nanrunbook.verdict.precision import WarningThresholds, headroom
    from nanrunbook.verdict.report import Report, report_document

_LAZY = {
    "check_bundle": ".check",
    "check_incident_set": ".check_set",
    "is_incident_set": ".check_set",
    "IncidentSet": ".verdict.incident_set",
    "set_document": ".verdict.incident_set",
    "merge_reports": ".verdict.merge",
    "Caps": ".contract",
    "contract_content_id": ".contract",
    "contract_document": ".contract",
    "decide": ".verdict.decision",
    "Comparison": ".diff",
    "ComparisonRejected": ".diff",
    "diff_bundles": ".diff",
    "diff_document": ".diff",
    "EvidenceRejected": ".errors",
    "Violation": ".errors",
    "Report": ".verdict.report",
    "report_document": ".verdict.report",
    "WarningThresholds": ".verdict.precision",
    "headroom": ".verdict.precision",
}

__all__ = [
    "Caps",
    "Comparison",
    "ComparisonRejected",
    "EvidenceRejected",
    "IncidentSet",
    "Report",
    "Violation",
    "WarningThresholds",
    "__version__",
    "check_bundle",
    "check_incident_set",
    "contract_content_id",
    "contract_document",
    "decide",
    "diff_bundles",
    "diff_document",
    "headroom",
    "is_incident_set",
    "merge_reports",
    "report_document",
    "set_document",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nanrunbook' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
