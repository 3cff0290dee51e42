"""The records nanrunbook reasons about. All frozen: evidence is read, never edited."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain
from typing import Any, Literal, Protocol, TypeVar

__all__ = [
    "ALL_RANKS",
    "NO_ORIGIN",
    "ONE_RANK",
    "ORIGINS",
    "SOME_RANKS",
    "Binding",
    "Counts",
    "Decision",
    "EarlyWarning",
    "Extremes",
    "Headroom",
    "LastKnownGood",
    "Manifest",
    "Scaler",
    "StageFinding",
    "StageRecord",
    "TensorEntry",
    "TensorFinding",
    "TensorHeadroom",
    "element_count",
    "element_counts",
    "frozen_records",
    "nonfinite_count",
    "origin_of",
]


# How many of the world a non-finite value began on (spec section 11): the one
# home of the names an incident set's verdict and watch's job summary give it.
ONE_RANK, SOME_RANKS, ALL_RANKS, NO_ORIGIN = "ONE_RANK", "SOME_RANKS", "ALL_RANKS", "NONE"
ORIGINS = (ONE_RANK, SOME_RANKS, ALL_RANKS, NO_ORIGIN)


def origin_of(ranks: Sequence[int], world_size: int | None) -> str:
    """How many of the world the origin ranks (distinct, below ``world_size``)
    are (spec section 11): ONE_RANK, ALL_RANKS, SOME_RANKS, or NONE for none.
    An incident set and watch's telemetry of a job name their origin by it."""
    if not ranks:
        return NO_ORIGIN
    if len(ranks) == 1:
        return ONE_RANK
    if world_size is not None and world_size > 1 and len(ranks) == world_size:
        return ALL_RANKS
    return SOME_RANKS


def element_count(shape: Iterable[int], limit: int) -> int | None:
    """The product of the dims (1 for a scalar), or None once it passes ``limit``.

    Python ints never overflow, but a long shape of huge dims would make one huge
    product slowly; every caller has a bound past which the count is refused.
    """
    dims = tuple(shape)
    if 0 in dims:
        return 0
    count = 1
    for dim in dims:
        count *= dim
        if count > limit:
            return None
    return count


def element_counts(
    shapes: Sequence[Any], limit: int, *, dim_limit: int | None = None
) -> list[int] | None:
    """The element count of every shape, when each is a list of integers >= 0 (each
    at most ``dim_limit``, if given) whose product is at most ``limit``; else None.
    A whole column of shapes at once, in C where it can be."""
    if set(map(type, shapes)) != {list}:
        return None
    dims: list[Any] = list(chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0):
        return None
    if dims and dim_limit is not None and max(dims) > dim_limit:
        return None
    if max(map(len, shapes)) <= 4:  # short products are cheap whatever the dims
        counts = list(map(math.prod, shapes))
        return counts if max(counts) <= limit else None
    guarded: list[int] = []
    for shape in shapes:  # a long product of large dims is slow: stop at the limit
        count = element_count(shape, limit)
        if count is None:
            return None
        guarded.append(count)
    return guarded


Status = Literal["OBSERVED", "NOT_RUN"]
CountsSource = Literal["recounted", "declared"]


class _ByClass(Protocol):
    @property
    def nan(self) -> int: ...
    @property
    def posinf(self) -> int: ...
    @property
    def neginf(self) -> int: ...


def nonfinite_count(counts: _ByClass) -> int:
    """The non-finite elements of any counts by class (NaN, +inf, -inf): the
    one place the three are summed."""
    return counts.nan + counts.posinf + counts.neginf


@dataclass(frozen=True, slots=True)
class Counts:
    """Element counts by class, as the manifest's ``counts`` object holds them."""

    elements: int
    finite: int
    nan: int
    posinf: int
    neginf: int

    @property
    def nonfinite(self) -> int:
        return nonfinite_count(self)

    def as_dict(self) -> dict[str, int]:
        """The manifest's ``counts`` object."""
        return {
            "elements": self.elements,
            "finite": self.finite,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
        }


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A manifest tensor entry; ``file`` and ``sha256`` are None in a summary."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    probe: str
    file: str | None
    sha256: str | None

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One stage exactly as the manifest declares it."""

    stage: str
    status: str
    owner: str
    telemetry_id: str
    tensor_set_id: str
    probe_source: str
    resolution: str | None
    gradients: str | None
    tensors: tuple[TensorEntry, ...]
    counts: Counts | None
    finite_max_abs: float | None
    finite_max_abs_declared: bool  # the key is present (its value may be null)
    reason: str | None


@dataclass(frozen=True, slots=True)
class Scaler:
    """Loss-scale evidence; the dynamic-only fields are None in other modes."""

    mode: str
    scale: float
    growth_factor: float | None = None
    backoff_factor: float | None = None
    found_inf: bool | None = None
    step_skipped: bool | None = None
    scale_after: float | None = None


@dataclass(frozen=True, slots=True)
class Binding:
    """What the failing step is bound to: each binding item's id and fields, and
    the facts the check reads from them."""

    ids: Mapping[str, str]  # binding item -> its id
    details: Mapping[str, Mapping[str, object]]  # binding item -> every field as given
    world_size: int
    rank: int
    param_dtype: str
    compute_dtype: str
    reduction: str
    scaler: Scaler


@dataclass(frozen=True, slots=True)
class LastKnownGood:
    """The last state known to be good: the checkpoint the incident rolls back to."""

    checkpoint_id: str
    step: int
    verified_together: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A bundle's manifest as parsed: every field the check reads, no raw JSON."""

    format: str
    contract_version: str
    evidence_id: str
    evidence_content_id: str
    run_id: str
    step: int
    incident_owner: str
    binding: Binding
    last_known_good: LastKnownGood
    stages: tuple[StageRecord, ...]


@dataclass(frozen=True, slots=True)
class Extremes:
    """The exact extremes of one floating tensor's finite values, read from its bits.

    For C64 the values are the real and imaginary parts of its finite elements
    (two per element). ``min``/``max`` are signed (``-0.0`` when the only values are
    negative zeros); they, ``max_abs`` and ``min_nonzero_abs`` are None when there
    is no finite value (or, for ``min_nonzero_abs``, no non-zero one).
    """

    values: int  # finite values these extremes cover
    min: float | None
    max: float | None
    min_nonzero_abs: float | None  # smallest non-zero magnitude
    zeros: int  # values equal to +0 or -0
    subnormals: int  # non-zero values below the dtype's smallest normal magnitude

    @property
    def max_abs(self) -> float | None:
        if self.min is None or self.max is None:
            return None
        return max(abs(self.min), abs(self.max))


@dataclass(frozen=True, slots=True)
class TensorFinding:
    """A tensor after the check: recounted counts, or None for a summary entry."""

    entry: TensorEntry
    counts: Counts | None
    finite_max_abs: float | None  # the recount's; ``extremes.max_abs`` when extremes are set
    # Finite extremes of a recounted floating tensor; None for a summary entry, an
    # integer or BOOL tensor, or a tensor whose file was not read.
    extremes: Extremes | None = None


@dataclass(frozen=True, slots=True)
class StageFinding:
    """A stage after the check: the counts the decision rests on and where they came from."""

    record: StageRecord
    counts: Counts | None  # None when NOT_RUN
    counts_source: CountsSource | None
    finite_max_abs: float | None
    tensors: tuple[TensorFinding, ...]

    @property
    def stage(self) -> str:
        return self.record.stage

    @property
    def status(self) -> str:
        return self.record.status

    @property
    def first_nonfinite_tensor(self) -> str | None:
        """Capture-order first tensor with a non-finite element; None when unknown or none."""
        for tensor in self.tensors:
            if tensor.counts is not None and tensor.counts.nonfinite:
                return tensor.entry.name
        return None


@dataclass(frozen=True, slots=True)
class Decision:
    """HOLD or CONTINUE, where the symptom showed first, and the action: never a cause."""

    decision: str
    earliest_nonfinite_stage: str | None
    first_nonfinite_tensor: str | None
    action: str
    root_cause_claim: str


@dataclass(frozen=True, slots=True)
class Headroom:
    """One tensor's finite values against one floating dtype's largest finite value.

    Facts, not accusations: the tool does not know the next operation. The limits
    are the dtype's; the flags say whether this tensor's values pass them.
    """

    dtype: str
    max_finite: float  # the dtype's largest finite value
    # log2(max_finite / max_abs): 0 at the maximum, below 0 beyond it; None when no
    # finite value is non-zero.
    bits: float | None
    exp_limit: float  # ln(max_finite): exp() of a larger value overflows
    square_limit: float  # sqrt(max_finite): the square of a larger magnitude overflows
    reciprocal_limit: float  # 1 / max_finite: the reciprocal of a smaller magnitude overflows
    exp_overflows: bool  # the largest value is above exp_limit
    square_overflows: bool  # max_abs is above square_limit
    reciprocal_overflows: bool  # the smallest non-zero magnitude is below reciprocal_limit
    sum_can_overflow: bool  # finite elements x max_abs is above max_finite


@dataclass(frozen=True, slots=True)
class TensorHeadroom:
    """A recounted floating tensor's headroom to its own dtype and, for a stage
    computed in the binding's ``precision.compute_dtype`` (input, forward, loss),
    to that dtype."""

    stage: str
    index: int  # the tensor's index within its stage (capture order)
    tensor: str  # its name: untrusted, quote it when printing
    dtype: str
    counts: Counts
    extremes: Extremes
    own: Headroom
    compute: Headroom | None


@dataclass(frozen=True, slots=True)
class EarlyWarning:
    """A warning; never changes the decision or exit code. The one record of
    both: a check's about a bundle tensor's values (where: its ``stage``,
    ``tensor`` and ``index``), and the sentinel's in a telemetry line
    (``nanrunbook.telemetry.TelemetryWarning``; where: the line's step, so the
    three are None).

    ``code`` is one of :data:`nanrunbook.warning_codes.WARNING_CODES` (a
    telemetry reader accepts any). ``message`` is one line that does not repeat
    the tensor's name, which is untrusted (``index`` is safe in key=value output).
    """

    code: str
    message: str
    stage: str | None = None
    tensor: str | None = None
    index: int | None = None


# ------------------------------------------------------------- many at once

_Record = TypeVar("_Record")
_BUILDERS: dict[type[Any], type[Any]] = {}


def frozen_records(
    cls: type[_Record], first: Sequence[Any], *columns: Iterable[Any]
) -> list[_Record]:
    """``list(map(cls, first, *columns))`` for a frozen slots dataclass, some four
    times faster for many rows: one record per row, the columns holding every
    field in field order.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (about 1.5 us a record, most of the cost of reading a header of thousands of
    tensors). A plain class with the same slots sets them at C speed, and its
    instance can then take ``cls`` as its class, the two layouts being one: the
    records are ``cls``'s in every respect (tests/test_screened_reader.py). Below
    a few hundred rows, making that class (once) would cost more than it saves.
    """
    if len(first) < _FEW_RECORDS:
        return list(map(cls, first, *columns))
    builder = _BUILDERS.get(cls) or _builder(cls)
    records = list(map(builder, first, *columns))
    for record in records:
        record.__class__ = cls
    return records


_FEW_RECORDS = 256


def _builder(cls: type[Any]) -> type[Any]:
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a frozen slots dataclass")
    if hasattr(cls, "__post_init__"):  # the builder would skip it
        raise TypeError(f"{cls.__name__} checks its fields in __post_init__")
    names = [f.name for f in fields(cls)]
    slots = cls.__dict__["__slots__"]
    # The same slots in the same order, or the class could not be changed.
    assert tuple(names) == tuple(slots)
    # One generated __init__, not make_dataclass's six methods (a millisecond per
    # class, most of it compiling methods a builder never calls). The names are
    # the dataclass's own fields: identifiers.
    assignments = "".join(f"\n    self.{name} = {name}" for name in names) or "\n    pass"
    namespace: dict[str, Any] = {}
    exec(f"def __init__(self, {', '.join(names)}):{assignments}", namespace)
    builder = type(
        f"_{cls.__name__}Builder", (), {"__slots__": slots, "__init__": namespace["__init__"]}
    )
    _BUILDERS[cls] = builder
    return builder
