"""Two bundles of one step compared: which mechanism changed, what it did, where the runs part.

The runbook's replay half is three comparisons: *reproduce without an update*
(no mechanism differs: the same decision and earliest stage?), *change one
mechanism* (exactly one binding item differs: what did it do to the decision?)
and *prove recovery* (one change, HOLD -> CONTINUE). :func:`diff_bundles`
answers them mechanically from two bundles, each checked in full first.

Mechanisms are the binding items (spec section 4). An item differs when its
``id`` or any field differs, except the scaler's outcome fields (``found_inf``,
``step_skipped``, ``scale_after``): those are results of the step, not
mechanisms. Numbers compare by value (``1`` and ``1.0`` are one number), a
boolean is never a number. Run id, step and evidence ids are identities, not
mechanisms: they are reported, never counted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanrunbook._version import __version__
from nanrunbook.check import check_bundle
from nanrunbook.contract import CONTINUE, CONTRACT_VERSION, HOLD, STAGE_ORDER, Caps
from nanrunbook.errors import EvidenceRejected, Violation
from nanrunbook.exits import Exit
from nanrunbook.manifest.parse import BINDING_ITEMS
from nanrunbook.records import Binding, Counts, StageFinding, TensorEntry
from nanrunbook.tensors.compare import ElementDelta, StoredTensor, TensorPair, compare_tensors
from nanrunbook.tensors.verify import Progress
from nanrunbook.verdict.report import Report

__all__ = [
    "BROKE",
    "CONFOUNDED",
    "DIFF_FORMAT",
    "FIXED",
    "MOVED",
    "NOT_REPRODUCED",
    "ONE_MECHANISM_CHANGED",
    "REPRODUCED",
    "RESULT_FIELDS",
    "UNCHANGED",
    "Comparison",
    "ComparisonRejected",
    "MechanismChange",
    "StageDiff",
    "TensorDiff",
    "diff_bundles",
    "diff_document",
    "diff_rejection_document",
]

DIFF_FORMAT = "nanrunbook-diff/1"

REPRODUCED = "REPRODUCED"
NOT_REPRODUCED = "NOT_REPRODUCED"
ONE_MECHANISM_CHANGED = "ONE_MECHANISM_CHANGED"
CONFOUNDED = "CONFOUNDED"
FIXED = "FIXED"  # HOLD -> CONTINUE
BROKE = "BROKE"  # CONTINUE -> HOLD
MOVED = "MOVED"  # both HOLD, at another earliest stage
UNCHANGED = "UNCHANGED"

# Binding fields that record what the step did, not how it was run.
RESULT_FIELDS: Mapping[str, tuple[str, ...]] = {
    "scaler": ("found_inf", "step_skipped", "scale_after"),
    # Whether the tool verified the last known-good state or the loop stated it:
    # provenance of the evidence, not a mechanism of the step.
    "checkpoint": ("last_known_good_recovery",),
}
SIDES = ("base", "other")


@dataclass(frozen=True, slots=True)
class MechanismChange:
    """A binding item that differs: the fields that differ, and both items whole."""

    item: str
    fields: tuple[str, ...]  # "id" first when it differs, then base order, then other-only
    base: Mapping[str, object]
    other: Mapping[str, object]


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """A tensor present in both bundles (matched by name), compared."""

    name: str
    base_stage: str
    other_stage: str
    base: TensorEntry
    other: TensorEntry
    # identical | differing | dtype_differs | shape_differs | not_compared (a summary side)
    status: str
    delta: ElementDelta | None  # element figures, for "differing" only

    @property
    def differs(self) -> bool:
        return self.status in ("differing", "dtype_differs", "shape_differs")


@dataclass(frozen=True, slots=True)
class OneSided:
    """A tensor only one bundle holds."""

    name: str
    stage: str


@dataclass(frozen=True, slots=True)
class StageDiff:
    """One stage side by side: both findings, and its tensors compared."""

    stage: str
    base: StageFinding
    other: StageFinding
    identical: int
    differing: int  # dtype or shape differences included
    not_compared: int
    base_only: int
    other_only: int


@dataclass(frozen=True, slots=True)
class Comparison:
    """What :func:`diff_bundles` answers for two accepted bundles."""

    base: Report
    other: Report
    changes: tuple[MechanismChange, ...]
    verdict: str
    outcome: str | None  # FIXED/BROKE/MOVED/UNCHANGED with exactly one change, else None
    not_reproduced: str | None  # NOT_REPRODUCED: "decision" or "earliest_nonfinite_stage"
    tensors: tuple[TensorDiff, ...]  # common tensors, in the base's capture order
    base_only: tuple[OneSided, ...]
    other_only: tuple[OneSided, ...]
    stages: tuple[StageDiff, ...]
    diff_format: str = DIFF_FORMAT
    same_bundle: bool = False  # BASE and OTHER name one directory: nothing was compared

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(change.item for change in self.changes)

    @property
    def first_divergence(self) -> TensorDiff | None:
        """The first common tensor, in capture order, that is not bit-identical."""
        return next((t for t in self.tensors if t.differs), None)

    @property
    def attributable(self) -> bool:
        return self.verdict in (REPRODUCED, ONE_MECHANISM_CHANGED)

    @property
    def recovered(self) -> bool:
        """Recovery proven: exactly one mechanism changed, and it turned HOLD into CONTINUE."""
        return self.verdict == ONE_MECHANISM_CHANGED and self.outcome == FIXED

    @property
    def same_run(self) -> bool:
        return self.base.manifest.run_id == self.other.manifest.run_id

    @property
    def same_step(self) -> bool:
        return self.base.manifest.step == self.other.manifest.step

    @property
    def same_evidence(self) -> bool:
        """Both sides have one evidence content id: one bundle twice, a copy, or a
        replay that came out bit for bit (a deterministic one does: the bundle holds
        nothing that tells a copy from it)."""
        return self.base.manifest.evidence_content_id == self.other.manifest.evidence_content_id

    def exit_code(self, *, require_fixed: bool = False) -> int:
        """0 when attributable (with ``require_fixed``: only when recovery is proven), else
        1; 2, a usage error, when BASE and OTHER are one directory: the call compared
        a bundle with itself, the caller's mistake and not the evidence's (3 would say
        a bundle was rejected)."""
        if self.same_bundle:
            return Exit.USAGE
        ok = self.recovered if require_fixed else self.attributable
        return Exit.CONTINUE if ok else Exit.HOLD


class ComparisonRejected(EvidenceRejected):
    """One bundle or both cannot be judged: no comparison is made. Every violation's
    ``where`` starts with its side (``base/`` or ``other/``)."""

    def __init__(self, violations: Sequence[Violation], bundles: Mapping[str, str]) -> None:
        super().__init__(violations)
        self.bundles = dict(bundles)

    @property
    def sides(self) -> tuple[str, ...]:
        """The rejected sides, base first."""
        return tuple(s for s in SIDES if any(v.where.startswith(f"{s}/") for v in self.violations))


def _sided(side: str, error: EvidenceRejected) -> list[Violation]:
    return [Violation(v.code, f"{side}/{v.where}", v.message) for v in error.violations]


# ----------------------------------------------------------------- the diff


def diff_bundles(
    base: str | os.PathLike[str],
    other: str | os.PathLike[str],
    *,
    caps: Caps | None = None,
    progress: Progress | None = None,
    workers: int | None = None,
) -> Comparison:
    """Check both bundles, then compare them: mechanisms, verdict, where they part.

    Raises :class:`ComparisonRejected` (an EvidenceRejected) listing the
    violations of every rejected side. Never writes. Tensors whose digests match
    are not read again; differing ones are compared element by element in
    bounded chunks (see :mod:`nanrunbook.tensors.compare`).
    """
    bundles = {"base": str(base), "other": str(other)}
    reports: dict[str, Report] = {}
    violations: list[Violation] = []
    for side in SIDES:
        try:
            reports[side] = check_bundle(bundles[side], caps=caps, progress=progress)
        except EvidenceRejected as error:
            violations += _sided(side, error)
    if violations:
        raise ComparisonRejected(violations, bundles)
    a, b = reports["base"], reports["other"]
    changes = mechanism_changes(a.manifest.binding, b.manifest.binding)
    verdict, outcome, not_reproduced = _verdict(changes, a, b)
    try:
        tensors, base_only, other_only = _tensors(a, b, workers)
    except EvidenceRejected as error:  # a file changed after its check
        raise ComparisonRejected(error.violations, bundles) from None
    return Comparison(
        base=a,
        other=b,
        changes=changes,
        verdict=verdict,
        outcome=outcome,
        not_reproduced=not_reproduced,
        tensors=tensors,
        base_only=base_only,
        other_only=other_only,
        stages=_stages(a, b, tensors, base_only, other_only),
        same_bundle=_same_directory(base, other),
    )


def _same_directory(base: str | os.PathLike[str], other: str | os.PathLike[str]) -> bool:
    """One directory under two spellings (``x``, ``./x/``, a symbolic link) or one."""
    try:
        return os.path.samefile(base, other)
    except OSError:  # gone since its check: then not provably the same
        return False


_ABSENT = ("absent",)


def _value_key(value: object) -> tuple[object, ...]:
    """A binding value as compared: numbers by value, booleans apart from numbers."""
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    return ("string", value)


def mechanism_changes(base: Binding, other: Binding) -> tuple[MechanismChange, ...]:
    """The binding items that differ, in spec order, result fields left out."""
    changes = []
    for item in BINDING_ITEMS:
        a, b = base.details.get(item, {}), other.details.get(item, {})
        ignored = RESULT_FIELDS.get(item, ())
        keys = [k for k in (*a, *(k for k in b if k not in a)) if k not in ignored]
        differ = [
            k
            for k in keys
            if (_value_key(a[k]) if k in a else _ABSENT)
            != (_value_key(b[k]) if k in b else _ABSENT)
        ]
        if differ:
            ordered = (["id"] if "id" in differ else []) + [k for k in differ if k != "id"]
            changes.append(MechanismChange(item, tuple(ordered), dict(a), dict(b)))
    return tuple(changes)


def _verdict(
    changes: Sequence[MechanismChange], base: Report, other: Report
) -> tuple[str, str | None, str | None]:
    """(verdict, outcome, why not reproduced)."""
    a, b = base.decision, other.decision
    same_decision = a.decision == b.decision
    same_stage = a.earliest_nonfinite_stage == b.earliest_nonfinite_stage
    if not changes:
        if same_decision and same_stage:
            return REPRODUCED, None, None
        why = "decision" if not same_decision else "earliest_nonfinite_stage"
        return NOT_REPRODUCED, None, why
    if len(changes) > 1:
        return CONFOUNDED, None, None
    if a.decision == HOLD and b.decision == CONTINUE:
        outcome = FIXED
    elif a.decision == CONTINUE and b.decision == HOLD:
        outcome = BROKE
    elif not same_stage:
        outcome = MOVED
    else:
        outcome = UNCHANGED
    return ONE_MECHANISM_CHANGED, outcome, None


# ----------------------------------------------------------- the tensors


@dataclass(frozen=True, slots=True)
class _Located:
    stage: str
    path: str  # JSON path of the entry
    entry: TensorEntry


def _located(report: Report) -> dict[str, _Located]:
    """Every tensor entry of the report by name (names are unique), in capture order."""
    found: dict[str, _Located] = {}
    for s_index, stage in enumerate(report.manifest.stages):
        for t_index, entry in enumerate(stage.tensors):
            found[entry.name] = _Located(
                stage.stage, f"$.stages[{s_index}].tensors[{t_index}]", entry
            )
    return found


def _stored(report: Report, side: str, at: _Located) -> StoredTensor:
    entry = at.entry
    assert entry.file is not None and entry.sha256 is not None
    return StoredTensor(
        bundle=Path(report.bundle),
        file=entry.file,
        name=entry.name,
        dtype=entry.dtype,
        shape=entry.shape,
        sha256=entry.sha256,
        side=side,
        path=at.path,
    )


def _status(a: TensorEntry, b: TensorEntry) -> str | None:
    """The status that needs no data read, or None when elements must be compared."""
    if a.dtype != b.dtype:
        return "dtype_differs"
    if a.shape != b.shape:
        return "shape_differs"
    if a.sha256 is None or b.sha256 is None:
        return "not_compared"
    return "identical" if a.sha256 == b.sha256 else None


def _tensors(
    base: Report, other: Report, workers: int | None
) -> tuple[tuple[TensorDiff, ...], tuple[OneSided, ...], tuple[OneSided, ...]]:
    ours, theirs = _located(base), _located(other)
    common = [name for name in ours if name in theirs]
    pairs = [
        TensorPair(_stored(base, "base", ours[n]), _stored(other, "other", theirs[n]))
        for n in common
        if _status(ours[n].entry, theirs[n].entry) is None
    ]
    deltas = dict(
        zip(
            (pair.base.name for pair in pairs),
            compare_tensors(pairs, workers=workers),
            strict=True,
        )
    )
    diffs = []
    for name in common:
        a, b = ours[name], theirs[name]
        status = _status(a.entry, b.entry) or "differing"
        diffs.append(TensorDiff(name, a.stage, b.stage, a.entry, b.entry, status, deltas.get(name)))
    base_only = tuple(OneSided(n, at.stage) for n, at in ours.items() if n not in theirs)
    other_only = tuple(OneSided(n, at.stage) for n, at in theirs.items() if n not in ours)
    return tuple(diffs), base_only, other_only


def _stages(
    base: Report,
    other: Report,
    tensors: Sequence[TensorDiff],
    base_only: Sequence[OneSided],
    other_only: Sequence[OneSided],
) -> tuple[StageDiff, ...]:
    found = []
    for index, stage in enumerate(STAGE_ORDER):
        mine = [t for t in tensors if t.base_stage == stage]
        found.append(
            StageDiff(
                stage=stage,
                base=base.stages[index],
                other=other.stages[index],
                identical=sum(t.status == "identical" for t in mine),
                differing=sum(t.differs for t in mine),
                not_compared=sum(t.status == "not_compared" for t in mine),
                base_only=sum(t.stage == stage for t in base_only),
                other_only=sum(t.stage == stage for t in other_only),
            )
        )
    return tuple(found)


# ------------------------------------------------------------ JSON documents


def _number(value: float | int | None) -> float | int | str | None:
    """A figure for JSON, which has no infinity: an F64 overflow shows as "inf"."""
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    return value


def _counts(counts: Counts | None) -> dict[str, int] | None:
    return None if counts is None else counts.as_dict()


def _side(report: Report) -> dict[str, Any]:
    manifest, decision = report.manifest, report.decision
    return {
        "bundle": report.bundle,
        "run": {"run_id": manifest.run_id, "step": manifest.step},
        "evidence_id": manifest.evidence_id,
        "evidence_content_id": manifest.evidence_content_id,
        "contract_content_id": report.contract_content_id,
        "decision": decision.decision,
        "earliest_nonfinite_stage": decision.earliest_nonfinite_stage,
        "first_nonfinite_tensor": decision.first_nonfinite_tensor,
    }


def _entry(entry: TensorEntry, stage: str) -> dict[str, Any]:
    return {
        "stage": stage,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "sha256": entry.sha256,
    }


def tensor_document(tensor: TensorDiff) -> dict[str, Any]:
    delta = tensor.delta
    return {
        "name": tensor.name,
        "status": tensor.status,
        "base": _entry(tensor.base, tensor.base_stage),
        "other": _entry(tensor.other, tensor.other_stage),
        "elements": delta.elements if delta else None,
        "differing": delta.differing if delta else None,
        "max_abs_diff": _number(delta.max_abs_diff) if delta else None,
        "max_rel_diff": delta.max_rel_diff if delta else None,
        "nan_appeared": delta.nan_appeared if delta else None,
        "nan_disappeared": delta.nan_disappeared if delta else None,
        "inf_appeared": delta.inf_appeared if delta else None,
        "inf_disappeared": delta.inf_disappeared if delta else None,
    }


def _stage(stage: StageDiff) -> dict[str, Any]:
    def side(finding: StageFinding) -> dict[str, Any]:
        return {
            "status": finding.status,
            "counts_source": finding.counts_source,
            "counts": _counts(finding.counts),
        }

    return {
        "stage": stage.stage,
        "base": side(stage.base),
        "other": side(stage.other),
        "tensors": {
            "identical": stage.identical,
            "differing": stage.differing,
            "not_compared": stage.not_compared,
            "base_only": stage.base_only,
            "other_only": stage.other_only,
        },
    }


def diff_document(comparison: Comparison) -> dict[str, Any]:
    """The whole comparison as JSON (``diff --format json``)."""
    first = comparison.first_divergence
    return {
        "diff_format": comparison.diff_format,
        "tool": {"name": "nanrunbook", "version": __version__},
        "contract_version": CONTRACT_VERSION,
        "verdict": comparison.verdict,
        "outcome": comparison.outcome,
        "not_reproduced": comparison.not_reproduced,
        "attributable": comparison.attributable,
        "recovered": comparison.recovered,
        "changed": list(comparison.changed),
        "changes": [
            {
                "item": c.item,
                "fields": list(c.fields),
                "base": dict(c.base),
                "other": dict(c.other),
            }
            for c in comparison.changes
        ],
        "same_run": comparison.same_run,
        "same_step": comparison.same_step,
        "same_evidence": comparison.same_evidence,
        "same_bundle": comparison.same_bundle,
        "base": _side(comparison.base),
        "other": _side(comparison.other),
        "first_divergence": None if first is None else tensor_document(first),
        "first_divergence_stage": None if first is None else first.base_stage,
        "stages": [_stage(s) for s in comparison.stages],
        "tensors": [tensor_document(t) for t in comparison.tensors],
        "base_only": [{"name": t.name, "stage": t.stage} for t in comparison.base_only],
        "other_only": [{"name": t.name, "stage": t.stage} for t in comparison.other_only],
    }


def diff_rejection_document(error: ComparisonRejected) -> dict[str, Any]:
    return {
        "diff_format": DIFF_FORMAT,
        "tool": {"name": "nanrunbook", "version": __version__},
        "contract_version": CONTRACT_VERSION,
        "verdict": "REJECTED",
        "rejected": list(error.sides),
        "bundles": dict(error.bundles),
        "exit_code": error.exit_code,
        "violations": [
            {
                "side": v.where.split("/", 1)[0],
                "code": v.code,
                "where": v.where,
                "message": v.message,
            }
            for v in error.violations
        ],
    }
