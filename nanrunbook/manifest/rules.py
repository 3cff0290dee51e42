"""The rules of contract training-incident-v1 that relate fields and records.

Each function returns the violations it finds and never raises, so one check
reports everything at once. The same stage-sequence rules serve the manifest
parser and the decision, which revalidates the records it is handed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import Protocol

from nanrunbook.codes import RULE_CODES as CODES
from nanrunbook.contract import SCALE_RANGE, STAGE_ORDER, Caps, is_contract_scale
from nanrunbook.dtypes import DTYPES
from nanrunbook.errors import Violation, quote
from nanrunbook.manifest.fields import is_integer
from nanrunbook.records import Counts, Scaler, StageRecord, TensorEntry

__all__ = [
    "CODES",
    "caps_violations",
    "counts_violations",
    "found_inf_violations",
    "records_violations",
    "scaled_gradients_violations",
    "scaler_violations",
    "sequence_violations",
    "stage_set_violations",
    "stage_violations",
]


class StageLike(Protocol):
    """What the sequence rules need: a manifest record or a checked finding."""

    @property
    def stage(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def counts(self) -> Counts | None: ...


def _nonfinite(stage: StageLike) -> bool:
    return stage.status == "OBSERVED" and stage.counts is not None and stage.counts.nonfinite > 0


def counts_violations(counts: Counts, path: str) -> list[Violation]:
    values = (counts.elements, counts.finite, counts.nan, counts.posinf, counts.neginf)
    if not all(is_integer(v) and v >= 0 for v in values):
        return [Violation("COUNTS_NOT_RECONCILED", path, "every count is an integer >= 0")]
    if counts.finite + counts.nonfinite != counts.elements:
        return [
            Violation(
                "COUNTS_NOT_RECONCILED",
                path,
                f"finite + nan + posinf + neginf = "
                f"{counts.finite + counts.nonfinite}, "
                f"elements = {counts.elements}",
            )
        ]
    return []


def sequence_violations(stages: Sequence[StageLike], path: str) -> list[Violation]:
    """Stage order and OBSERVED/NOT_RUN transitions."""
    if len(stages) != len(STAGE_ORDER):
        return [Violation("STAGES_NOT_FIVE", path, f"expected 5 stages, got {len(stages)}")]
    found: list[Violation] = []
    for index, (stage, expected) in enumerate(zip(stages, STAGE_ORDER, strict=True)):
        if stage.stage != expected:
            found.append(
                Violation(
                    "STAGE_ORDER",
                    f"{path}[{index}].stage",
                    f"position {index} must be {expected!r}, found {quote(stage.stage)}",
                )
            )
    if found:
        return found
    if stages[0].status != "OBSERVED":
        found.append(
            Violation(
                "TRANSITION_INPUT_NOT_OBSERVED", f"{path}[0].status", "input must be OBSERVED"
            )
        )
    seen_nonfinite = False
    seen_not_run = False
    for index, stage in enumerate(stages):
        where = f"{path}[{index}].status"
        if stage.status == "NOT_RUN":
            if not seen_nonfinite and index > 0:
                found.append(
                    Violation(
                        "TRANSITION_NOT_RUN_WITHOUT_NONFINITE",
                        where,
                        f"{stage.stage} is NOT_RUN but no earlier OBSERVED stage is non-finite",
                    )
                )
            seen_not_run = True
        elif seen_not_run:
            found.append(
                Violation(
                    "TRANSITION_OBSERVED_AFTER_NOT_RUN",
                    where,
                    f"{stage.stage} is {quote(stage.status)} after a NOT_RUN stage",
                )
            )
        seen_nonfinite = seen_nonfinite or _nonfinite(stage)
    return found


def stage_violations(record: StageRecord, path: str) -> list[Violation]:
    """Rules within one OBSERVED record: counts, resolution coverage, finite_max_abs."""
    if record.status != "OBSERVED" or record.counts is None:
        return []
    counts = record.counts
    found = counts_violations(counts, f"{path}.counts")
    by_dtype = elements_by_dtype(record.tensors)
    expected = sum(by_dtype.values())
    if counts.elements != expected:
        if record.resolution == "summary" and counts.elements < expected:
            found.append(
                Violation(
                    "SUMMARY_SUB_RESOLUTION",
                    f"{path}.counts.elements",
                    f"the summary covers {counts.elements} of {expected} elements: a summary "
                    "must cover every element of its tensor set",
                )
            )
        else:
            found.append(
                Violation(
                    "COUNTS_ELEMENTS_MISMATCH",
                    f"{path}.counts.elements",
                    f"declared {counts.elements}, the tensor shapes hold {expected}",
                )
            )
    elif not found:
        found.extend(_impossible_counts(counts, by_dtype, f"{path}.counts"))
    found.extend(_finite_max_abs_violations(record, by_dtype, f"{path}.finite_max_abs"))
    return found


_DTYPE = attrgetter("dtype")


def _names(stage: StageRecord) -> Iterable[str]:
    return map(_NAME, stage.tensors)


_NAME = attrgetter("name")
_SHAPE = attrgetter("shape")


def _elements(tensors: Iterable[TensorEntry]) -> Iterator[int]:
    """Each entry's element count (TensorEntry.elements, without a call per entry)."""
    return map(math.prod, map(_SHAPE, tensors))


def elements_by_dtype(tensors: Sequence[TensorEntry]) -> dict[str, int]:
    """How many elements the entries hold, per dtype: one pass serves every sum."""
    dtypes = list(map(_DTYPE, tensors))
    counts = list(_elements(tensors))
    if len(set(dtypes)) == 1:  # the common stage: one dtype
        return {dtypes[0]: sum(counts)}
    totals: dict[str, int] = {}
    for dtype, count in zip(dtypes, counts, strict=True):
        totals[dtype] = totals.get(dtype, 0) + count
    return totals


def _impossible_counts(counts: Counts, by_dtype: Mapping[str, int], path: str) -> list[Violation]:
    """Non-finite counts that no data of the stage's dtypes could give (an integer has
    no NaN, F8_E4M3 no infinity): a summary is only declared, so this is its check."""
    can_nan = sum(n for dtype, n in by_dtype.items() if DTYPES[dtype].has_nonfinite)
    can_inf = sum(n for dtype, n in by_dtype.items() if DTYPES[dtype].has_infinity)
    if counts.nonfinite > can_nan:
        return [
            Violation(
                "COUNTS_NOT_RECONCILED",
                path,
                f"{counts.nonfinite} non-finite elements declared, but only {can_nan} elements "
                "are of a dtype that has a NaN or infinity encoding",
            )
        ]
    if counts.posinf + counts.neginf > can_inf:
        return [
            Violation(
                "COUNTS_NOT_RECONCILED",
                path,
                f"{counts.posinf + counts.neginf} infinite elements declared, but only {can_inf} "
                "elements are of a dtype that has an infinity",
            )
        ]
    return []


def _finite_max_abs_violations(
    record: StageRecord, by_dtype: Mapping[str, int], path: str
) -> list[Violation]:
    if not record.finite_max_abs_declared or record.counts is None:
        return []
    value = record.finite_max_abs
    floating = {dtype: n for dtype, n in by_dtype.items() if DTYPES[dtype].floating}
    float_elements = sum(floating.values())
    always_finite = sum(n for dtype, n in floating.items() if not DTYPES[dtype].has_nonfinite)
    other_elements = sum(by_dtype.values()) - float_elements
    # Bounds on how many finite elements are floating, from the declared counts alone.
    least = max(always_finite, record.counts.finite - other_elements)
    most = min(record.counts.finite, float_elements)
    if value is None:
        if least > 0:
            return [
                Violation(
                    "FINITE_MAX_ABS_NULL_MISMATCH",
                    path,
                    "null, but the stage has finite floating elements",
                )
            ]
        return []
    if most < 1:
        return [
            Violation(
                "FINITE_MAX_ABS_NULL_MISMATCH",
                path,
                "must be null: the stage has no finite element of a floating dtype",
            )
        ]
    if value < 0:
        return [Violation("FINITE_MAX_ABS_INVALID", path, "a magnitude is >= 0")]
    ceiling = max(DTYPES[dtype].max_finite or 0.0 for dtype in floating)
    if value > ceiling:
        return [
            Violation(
                "FINITE_MAX_ABS_EXCESSIVE",
                path,
                f"{value!r} is above {ceiling!r}, the largest finite value of the stage's dtypes",
            )
        ]
    return []


def stage_set_violations(stages: Sequence[StageRecord], path: str, caps: Caps) -> list[Violation]:
    """Order, transitions, unique identities and caps across the five records."""
    found = sequence_violations(stages, path)
    found.extend(records_violations(dict(enumerate(stages)), path, caps))
    return found


def records_violations(stages: Mapping[int, StageRecord], path: str, caps: Caps) -> list[Violation]:
    """Unique identities and caps across the stage records, by their index in the
    manifest's array: all five, or those read when another has violations of its
    own (order and transitions need all five; identities and caps do not)."""
    found = list(_unique(stages, path))
    found.extend(caps_violations(stages, path, caps))
    return found


def _unique(stages: Mapping[int, StageRecord], path: str) -> Iterable[Violation]:
    telemetry: set[str] = set()
    tensor_sets: set[str] = set()
    names: set[str] = set()
    every_name = list(chain.from_iterable(map(_names, stages.values())))
    repeats = len(set(every_name)) < len(every_name)  # else no entry to look for
    for index, stage in stages.items():
        where = f"{path}[{index}]"
        if stage.telemetry_id in telemetry:
            yield Violation(
                "TELEMETRY_ID_DUPLICATE",
                f"{where}.telemetry_id",
                "already used by an earlier stage",
            )
        telemetry.add(stage.telemetry_id)
        if stage.tensor_set_id in tensor_sets:
            yield Violation(
                "TENSOR_SET_ID_DUPLICATE",
                f"{where}.tensor_set.id",
                "already used by an earlier stage",
            )
        tensor_sets.add(stage.tensor_set_id)
        for position, tensor in enumerate(stage.tensors if repeats else ()):
            if tensor.name in names:
                yield Violation(
                    "TENSOR_NAME_DUPLICATE",
                    f"{where}.tensors[{position}].name",
                    f"{quote(tensor.name)} names an earlier entry too",
                )
            names.add(tensor.name)


def caps_violations(stages: Mapping[int, StageRecord], path: str, caps: Caps) -> list[Violation]:
    found: list[Violation] = []
    total = 0
    for index, stage in stages.items():
        where = f"{path}[{index}]"
        if len(stage.tensors) > caps.max_stage_tensors:
            found.append(
                Violation(
                    "CAP_STAGE_TENSORS",
                    f"{where}.tensors",
                    f"{len(stage.tensors)} tensors, cap {caps.max_stage_tensors}",
                )
            )
        elements = max(
            sum(_elements(stage.tensors)),
            stage.counts.elements if stage.counts is not None else 0,
        )
        if elements > caps.max_stage_elements:
            found.append(
                Violation(
                    "CAP_STAGE_ELEMENTS",
                    where,
                    f"{elements} elements, cap {caps.max_stage_elements}",
                )
            )
        total += elements
    if total > caps.max_bundle_elements:
        found.append(
            Violation(
                "CAP_BUNDLE_ELEMENTS", path, f"{total} elements, cap {caps.max_bundle_elements}"
            )
        )
    return found


def scaler_violations(scaler: Scaler, path: str) -> list[Violation]:
    """The scaler record on its own: the scale, the factors, the dynamic transition."""
    scale = scaler.scale
    if scaler.mode == "none":
        if scale == 1:
            return []
        return [Violation("SCALER_SCALE_NOT_ONE", f"{path}.scale", "mode none requires scale 1")]
    found: list[Violation] = []
    if not is_contract_scale(scale):
        message = f"{scale!r} is not {SCALE_RANGE}"
        found.append(Violation("SCALER_SCALE_UNSAFE", f"{path}.scale", message))
    if scaler.mode != "dynamic":
        return found
    assert scaler.growth_factor is not None and scaler.backoff_factor is not None
    if not scaler.growth_factor > 1:
        found.append(Violation("SCALER_FACTOR_INVALID", f"{path}.growth_factor", "must be > 1"))
    if not 0 < scaler.backoff_factor < 1:
        found.append(
            Violation("SCALER_FACTOR_INVALID", f"{path}.backoff_factor", "must be in (0, 1)")
        )
    found.extend(_transition_violations(scaler, path))
    return found


def _transition_violations(scaler: Scaler, path: str) -> list[Violation]:
    """found_inf, step_skipped and scale_after against one another (mode dynamic)."""
    scale, growth, backoff = scaler.scale, scaler.growth_factor, scaler.backoff_factor
    assert growth is not None and backoff is not None
    found: list[Violation] = []
    if scaler.step_skipped != scaler.found_inf:
        message = (
            "found_inf means the optimizer step was skipped"
            if scaler.found_inf
            else "no inf found, so the step was not skipped"
        )
        found.append(Violation("SCALER_TRANSITION_INVALID", f"{path}.step_skipped", message))
    if scaler.found_inf:
        allowed = [scale * backoff]
        rule, formula = "found_inf means scale_after =", "scale * backoff_factor"
        shown = f"{formula} = {allowed[0]!r}"
    else:
        allowed = [scale, scale * growth]
        rule, formula = "with no inf found scale_after is", "scale or scale * growth_factor"
        shown = f"{allowed[0]!r} or {allowed[1]!r}"
    if scaler.scale_after in allowed:
        return found
    if is_contract_scale(scale):
        message = f"{rule} {shown}"
    else:  # values computed from an unsafe scale would read as advice: state the rule only
        message = f"{rule} {formula}, but scale {scale!r} is itself not {SCALE_RANGE}"
    found.append(Violation("SCALER_TRANSITION_INVALID", f"{path}.scale_after", message))
    return found


def scaled_gradients_violations(
    scaler: Scaler, gradients: str | None, path: str
) -> list[Violation]:
    """Scaled gradients need a scaler that scales."""
    if gradients != "scaled" or scaler.mode != "none":
        return []
    return [
        Violation(
            "GRADIENTS_SCALED_WITHOUT_SCALER",
            f"{path}.stages[{STAGE_ORDER.index('backward')}].gradients",
            "scaled gradients need scaler mode static or dynamic",
        )
    ]


def found_inf_violations(scaler: Scaler, stages: Sequence[StageLike], path: str) -> list[Violation]:
    """The dynamic scaler's found_inf against whether the backward stage has a
    non-finite element: on the declared counts when the manifest is read, on the
    recounted ones after the data is read, and again in the decision."""
    backward = next((s for s in stages if s.stage == "backward"), None)
    if scaler.mode != "dynamic" or backward is None or backward.status != "OBSERVED":
        return []
    nonfinite = _nonfinite(backward)
    if scaler.found_inf == nonfinite:
        return []
    captured = "have a non-finite element" if nonfinite else "are all finite"
    return [
        Violation(
            "SCALER_FOUND_INF_MISMATCH",
            f"{path}.binding.scaler.found_inf",
            f"found_inf is {str(scaler.found_inf).lower()} but the captured gradients {captured};"
            " the probe saw other values than the scaler did, or the manifest was edited",
        )
    ]
