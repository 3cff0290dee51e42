"""What a shrink found: the first bad operation, its tensors' extremes, the smallest batch.

Plain records (no torch), so a report can be printed, compared and written as
JSON by code that never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from nanrunbook.records import nonfinite_count

__all__ = ["OpKey", "Operation", "Shrink", "ShrinkError", "StepIsFinite", "TensorFacts"]


class ShrinkError(ValueError):
    """The step cannot be shrunk: the message says why, in one line."""


class StepIsFinite(ShrinkError):
    """The replayed step is finite through its gradients: nothing to shrink."""


@dataclass(frozen=True, slots=True)
class OpKey:
    """Which operation of a replay, stable across replays of the same code.

    ``kind`` is ``module`` (a module call: ``path`` and its forward ``call``
    number from 1, or for a backward operation the module's ``call``-th backward
    firing), ``function`` (a torch function called directly by the code of the
    module call ``path``/``call``; ``call`` 0 is code outside every module, such
    as the loss in ``compute_loss``), its ``occurrence``-th call of ``function``
    there, or ``probe`` (the named probe ``function``, its ``occurrence``-th
    call in that code: it marks the operation just before it).
    """

    kind: str
    path: str
    call: int
    function: str = ""
    occurrence: int = 0
    backward: bool = False

    def describe(self) -> str:
        if self.kind == "module":
            text = f"module '{self.path or '(root)'}'"
            if self.call > 1:
                text += f" (backward pass {self.call})" if self.backward else f" (call {self.call})"
        else:
            where = "compute_loss" if self.call == 0 else f"module '{self.path or '(root)'}'"
            where += f" (call {self.call})" if self.call > 1 else ""
            nth = f" (#{self.occurrence})" if self.occurrence > 1 else ""
            name = f"probe '{self.function}'" if self.kind == "probe" else self.function
            text = f"{name}{nth} in {where}"
        return f"backward of {text}" if self.backward else text


@dataclass(frozen=True, slots=True)
class TensorFacts:
    """One tensor's dtype, shape, non-finite counts and finite extremes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    elements: int
    nan: int
    posinf: int
    neginf: int
    finite_min: float | None
    finite_max: float | None
    finite_max_abs: float | None

    @property
    def nonfinite(self) -> int:
        return nonfinite_count(self)

    def describe(self) -> str:
        shape = "x".join(str(d) for d in self.shape) or "scalar"
        text = f"{self.name} {self.dtype}[{shape}]"
        if self.finite_min is not None:
            text += (
                f" finite min {_num(self.finite_min)} max {_num(self.finite_max)}"
                f" max|x| {_num(self.finite_max_abs)}"
            )
        if self.nonfinite:
            text += f" nan {self.nan} +inf {self.posinf} -inf {self.neginf}"
        return text


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:.6g}"


@dataclass(frozen=True, slots=True)
class Operation:
    """The first operation that went non-finite, and what it saw.

    ``stage`` is the earliest non-finite stage as the check names it. For
    ``forward``, ``loss`` and ``backward`` the operation made the non-finite
    value from finite inputs (and finite parameters); for ``input`` the batch
    itself held it and the operation is its first consumer, which passed it on
    (``made_here`` false). ``inputs`` are its inputs; ``outputs`` its outputs
    (forward) or the gradients it produced (backward), and ``grad_outputs`` the
    finite gradients it received (backward only). ``autocast`` is
    ``device:dtype`` when it ran under autocast. For a named probe, ``made_by``
    is the torch function before it that made the value (the fixture's program),
    when one did.
    """

    stage: str
    key: OpKey
    type_name: str
    made_here: bool
    inputs: tuple[TensorFacts, ...]
    outputs: tuple[TensorFacts, ...]
    grad_outputs: tuple[TensorFacts, ...] = ()
    autocast: str | None = None
    made_by: OpKey | None = None

    def describe(self) -> str:
        if self.key.kind == "probe":
            made = f", made by {self.made_by.function}" if self.made_by else ""
            return f"{self.key.describe()}{made}"
        if self.key.kind == "function":
            return self.key.describe()
        return f"{self.key.describe()} ({self.type_name})"


@dataclass(frozen=True, slots=True)
class Shrink:
    """A shrink's answer: the operation, the smallest batch found, and the cost.

    ``examples`` are indices into the original batch (dimension 0); ``minimal``
    is true when no single example of them can be removed and the same
    operation still goes non-finite. ``interaction`` says, in one line, why the
    examples may not trigger it on their own (batch statistics, a set that
    fails only together, no smaller batch failing), or is None. ``replays``
    counts every replay the search ran (the survey included); ``trials`` the
    subsets delta debugging tried (for an input stage they are decided on the
    data, without a replay). ``nonfinite_rows`` are the rows of the operation's
    result that went non-finite in the whole batch, when it has the batch as
    its first dimension. ``fixture`` is the directory written, if any.
    """

    operation: Operation
    batch_size: int
    examples: tuple[int, ...]
    minimal: bool
    interaction: str | None
    replays: int
    trials: int
    nonfinite_rows: tuple[int, ...] | None
    notes: tuple[str, ...] = ()
    fixture: str | None = None

    def lines(self) -> list[str]:
        """The answer for a terminal or a log, one fact a line."""
        op = self.operation
        made = "made it from finite inputs" if op.made_here else "passed on a non-finite input"
        out = [
            f"stage: {op.stage}",
            f"first bad operation: {op.describe()}: {made}",
        ]
        if op.autocast:
            out.append(f"autocast: {op.autocast}")
        out += [f"  input {f.describe()}" for f in op.inputs]
        out += [f"  grad_output {f.describe()}" for f in op.grad_outputs]
        label = "gradient" if op.key.backward else "output"
        out += [f"  {label} {f.describe()}" for f in op.outputs]
        shown = ", ".join(str(i) for i in self.examples)
        quality = "1-minimal" if self.minimal else "not proven minimal"
        out.append(
            f"smallest batch: {len(self.examples)} of {self.batch_size} examples [{shown}] ({quality})"
        )
        if self.nonfinite_rows is not None:
            out.append(f"rows non-finite at the operation: {list(self.nonfinite_rows)}")
        out.append(f"interaction: {self.interaction or 'none detected'}")
        out.append(f"replays: {self.replays} (delta-debugging trials: {self.trials})")
        out += [f"note: {note}" for note in self.notes]
        if self.fixture:
            out.append(f"fixture: {self.fixture}")
        return out

    def document(self) -> dict[str, Any]:
        """The answer as JSON data (no NaN: absent extremes are null)."""
        data = asdict(self)
        return _finite_json(data)  # type: ignore[no-any-return]


def _finite_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
