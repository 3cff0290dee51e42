"""Shrink a failing step: the first bad operation, then the smallest batch.

The runbook's *shrink the graph while preserving the triggering values*, for
PyTorch, by replays on copies (the caller's model, optimizer, scaler, batch
and RNG state are never touched):

1. A survey replay finds the earliest non-finite stage, as ``check`` names it,
   and the first operation that made the non-finite value from finite inputs:
   a module (forward hooks; for backward, the first module whose input or
   parameter gradients go non-finite while its output gradients are finite),
   refined to the torch function that did it when the module is not a leaf or
   no module did (the loss term, code between modules).
2. Delta debugging over the batch dimension finds a smallest subset of the
   examples on which that same operation still goes non-finite, trying first
   the rows where its result went non-finite.
3. Optionally, a fixture (:mod:`nanrunbook.capture.torch.shrink._fixture`).

Needs torch (``nanrunbook[torch]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanrunbook.capture.torch.replay import rng_state_for
from nanrunbook.capture.torch.shrink._ddmin import Minimised, ddmin
from nanrunbook.capture.torch.shrink._failing_step import FailingStep, replay_examples, resolved
from nanrunbook.capture.torch.shrink._finiteness import all_finite, nonfinite_rows
from nanrunbook.capture.torch.shrink._locate import Found, FunctionObserver, ModuleObserver
from nanrunbook.capture.torch.shrink._results import (
    Operation,
    OpKey,
    Shrink,
    ShrinkError,
    StepIsFinite,
)

__all__ = ["FailingStep", "ShrinkError", "ShrinkOnHold", "StepIsFinite", "shrink", "shrink_step"]

# The logger keeps its name from before shrink became a package.
log = logging.getLogger("nanrunbook.capture.torch.shrink")

DEFAULT_MAX_REPLAYS = 48


# ------------------------------------------------------------------ the survey


@dataclass(frozen=True, slots=True)
class _Located:
    stage: str
    found: Found
    replays: int
    notes: tuple[str, ...]
    mixing: tuple[str, ...]  # batch-statistics modules that ran before the operation
    made_by: OpKey | None = None  # for a named probe: the function that made its value


def _uses_batch_statistics(module: Any) -> bool:
    norm = torch.nn.modules.batchnorm._BatchNorm
    return isinstance(module, norm) and (module.training or module.running_mean is None)


def _stage(batch_bad: bool, survey: ModuleObserver, ran: Any) -> str | None:
    if batch_bad:
        return "input"
    if survey.forward_nonfinite:
        return "forward"
    if ran.loss_finite is False:
        return "loss"
    if ran.grads_finite is False:
        return "backward"
    return None


def _locate(step: FailingStep, size: int, expected: str | None) -> _Located:
    """The survey replay, then (when the module found is not a leaf, or none
    is) a function-level one inside it or in ``compute_loss``."""
    batch_bad = not all_finite(step.batch)
    observers: list[ModuleObserver] = []

    def attach(model: Any) -> list[Any]:
        observers.append(ModuleObserver(model, batch_size=size, passing_on=batch_bad))
        return observers

    ran = replay_examples(step, None, attach, backward=True)
    survey = observers[0]
    stage = _stage(batch_bad, survey, ran)
    if stage is None:
        raise StepIsFinite(
            "the replayed step is finite through its gradients: nothing to shrink "
            "(an optimizer-stage HOLD is outside the shrink; a different RNG state "
            "changes dropout: pass the one taken before the forward)"
        )
    notes: tuple[str, ...] = ()
    if expected == "loss" and stage == "forward":
        # The bundle's forward stage holds the modules its capture chose; here it is
        # every leaf module and probe, so the value can show up one stage earlier.
        notes = ("the bundle answered loss; a module it did not capture is already non-finite",)
    elif expected is not None and expected != stage:
        raise ShrinkError(f"the replay goes non-finite at {stage}, not at {expected}")
    backward = stage == "backward"
    module = survey.backward if backward else survey.forward
    names = dict(step.model.named_modules())
    mixing = tuple(
        p or "(root)" for p in dict.fromkeys(survey.completed) if _uses_batch_statistics(names[p])
    )
    if module is not None and module.key.kind == "probe":
        located = _made_by(step, size, stage, module, batch_bad, mixing)
    elif module is not None and module.leaf:
        located = _Located(stage, module, 1, (), mixing)
    else:
        located = _refine(step, size, stage, module, survey, batch_bad, mixing)
    return replace(located, notes=notes + located.notes)


def _function_survey(
    step: FailingStep,
    size: int,
    within: tuple[str, int | None],
    batch_bad: bool,
    backward: bool,
) -> FunctionObserver:
    observers: list[FunctionObserver] = []

    def attach(model: Any) -> list[Any]:
        observers.append(
            FunctionObserver(
                model, batch_size=size, within=within, passing_on=batch_bad, backward=backward
            )
        )
        return observers

    replay_examples(step, None, attach, backward=backward)
    return observers[0]


def _made_by(
    step: FailingStep,
    size: int,
    stage: str,
    found: Found,
    batch_bad: bool,
    mixing: tuple[str, ...],
) -> _Located:
    """A named probe is the answer; the torch function before it that made its
    value, in the same code, is what the fixture pins."""
    made = _function_survey(step, size, (found.key.path, found.key.call), batch_bad, False).forward
    if made is None:
        note = "no torch function called directly before the probe made its value"
        return _Located(stage, found, 2, (note,), mixing)
    # the probe's operation saw what the function that made its value saw
    found = replace(found, inputs=made.inputs, autocast=made.autocast or found.autocast)
    return _Located(stage, found, 2, (), mixing, made.key)


def _refine(
    step: FailingStep,
    size: int,
    stage: str,
    module: Found | None,
    survey: ModuleObserver,
    batch_bad: bool,
    mixing: tuple[str, ...],
) -> _Located:
    backward = stage == "backward"
    if module is None:
        within: tuple[str, int | None] = ("", 0)
    else:
        within = (module.key.path, None if backward else module.key.call)
    functions = _function_survey(step, size, within, batch_bad, backward)
    function = functions.backward if backward else functions.forward
    if function is not None:
        return _Located(stage, function, 2, (), mixing)
    if module is not None:
        note = "no torch function called directly in it made the value: the module is the answer"
        return _Located(stage, module, 2, (note,), mixing)
    where = survey.first_bad_grad_output if backward else None
    seen = f"; first seen in the output gradient of module '{where}'" if where else ""
    raise ShrinkError(
        f"no operation made the {stage} non-finite from finite inputs and parameters{seen}"
        " (are the parameters already non-finite?)"
    )


# ------------------------------------------------------------------ the search


def _trial(step: FailingStep, key: OpKey, examples: tuple[int, ...], passing_on: bool) -> Any:
    """One replay of ``examples``, watching the operation ``key``."""
    observers: list[Any] = []
    size = len(examples)

    def attach(model: Any) -> list[Any]:
        if key.kind in ("module", "probe"):
            observer: Any = ModuleObserver(
                model, batch_size=size, target=key, passing_on=passing_on, backward=key.backward
            )
        else:
            observer = FunctionObserver(
                model,
                batch_size=size,
                within=(key.path, key.call),
                target=key,
                passing_on=passing_on,
                backward=key.backward,
            )
        observers.append(observer)
        return observers

    replay_examples(step, examples, attach, backward=key.backward)
    return observers[0]


def _interaction(
    minimised: Minimised,
    size: int,
    mixing: tuple[str, ...],
    full_rows: frozenset[int] | None,
    subset_rows: frozenset[int] | None,
) -> str | None:
    if mixing:
        return (
            f"the examples interact through batch statistics ({', '.join(mixing)}): "
            "a subset changes them, so the smallest batch may not be the examples that trigger it"
        )
    count = len(minimised.examples)
    if count == size and size > 1:
        return "no smaller batch makes it go non-finite: the examples act together, or every one is needed"
    if count > 1 and minimised.one_minimal:
        return f"these {count} examples make it go non-finite only together: they interact"
    if full_rows is not None and subset_rows is not None:
        expected = {minimised.examples.index(i) for i in full_rows if i in minimised.examples}
        if set(subset_rows) != expected:
            return "the operation's non-finite rows differ with and without the rest of the batch"
    return None


@dataclass(frozen=True, slots=True)
class _Searched:
    minimised: Minimised
    rows: frozenset[int] | None  # non-finite rows at the operation in the subset's replay
    replays: int
    notes: tuple[str, ...]


def _search(
    step: FailingStep, size: int, located: _Located, max_trials: int, hint: bool
) -> _Searched:
    """Delta debugging over the examples. A trial that raises (batch norm on one
    example, a loss that needs two) counts as not reproducing, with a note."""
    key = located.found.key
    if located.stage == "input":
        bad = nonfinite_rows(step.batch, size) or frozenset()

        def data_fails(examples: tuple[int, ...]) -> bool:
            return bool(bad.intersection(examples))

        found = ddmin(size, data_fails, hint=sorted(bad) if hint else None, max_trials=max_trials)
        return _Searched(found, None, 0, ())
    rows: dict[tuple[int, ...], frozenset[int] | None] = {}
    errors: list[str] = []

    def fails(examples: tuple[int, ...]) -> bool:
        try:
            watch = _trial(step, key, examples, passing_on=False)
        except Exception as error:  # the loop's own code failed on this subset
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            return False
        rows[examples] = watch.rows
        return bool(watch.reproduced)

    start = located.found.rows
    found = ddmin(
        size, fails, hint=sorted(start) if hint and start else None, max_trials=max_trials
    )
    notes: tuple[str, ...] = ()
    if errors:
        notes = (
            f"{len(errors)} trial(s) raised and counted as not reproducing (first: {errors[0]})",
        )
    return _Searched(found, rows.get(found.examples), found.trials, notes)


# ------------------------------------------------------------------ the calls


def _operation(located: _Located) -> Operation:
    found = located.found
    autocast = f"{found.autocast[0]}:{found.autocast[1]}" if found.autocast else None
    return Operation(
        stage=located.stage,
        key=found.key,
        type_name=found.type_name,
        made_here=found.made_here,
        inputs=found.inputs,
        outputs=found.outputs,
        grad_outputs=found.grad_outputs,
        autocast=autocast,
        made_by=located.made_by,
    )


def shrink(
    step: FailingStep,
    *,
    stage: str | None = None,
    max_replays: int = DEFAULT_MAX_REPLAYS,
    hint: bool = True,
    fixture: str | Path | None = None,
    bundle: Mapping[str, Any] | None = None,
    drop_names: bool = False,
    overwrite: bool = False,
) -> Shrink:
    """Locate the first bad operation of ``step`` and a smallest batch for it.

    ``stage``, when known (the sentinel's or the bundle's verdict), must be
    the stage the replay goes non-finite at, else ShrinkError. At most
    ``max_replays`` replays are run (the survey included); when the budget
    runs out the subset found so far is returned, not proven minimal.
    ``hint`` false starts delta debugging from plain halves instead of the
    rows where the operation went non-finite.

    With ``fixture`` a directory is written there (see
    :func:`nanrunbook.capture.torch.shrink._fixture.write_fixture`); ``bundle`` then gives
    :func:`~nanrunbook.capture.torch.replay_step`'s identity arguments (run_id,
    step, incident_owner, last_known_good, binding, and optionally owners) for
    its bundle. Raises ShrinkError with a one-line reason when there is no
    operation to find.
    """
    if max_replays < 2:
        raise ShrinkError("max_replays must be at least 2: a survey and one trial")
    step = resolved(step)
    size = step.batch_size or 0
    located = _locate(step, size, stage)
    searched = _search(step, size, located, max(max_replays - located.replays, 1), hint)
    minimised = searched.minimised
    notes = list(located.notes) + list(searched.notes)
    if not minimised.one_minimal:
        notes.append(f"the replay budget ({max_replays}) ran out before the subset was minimal")
    result = Shrink(
        operation=_operation(located),
        batch_size=size,
        examples=minimised.examples,
        minimal=minimised.one_minimal,
        interaction=_interaction(
            minimised, size, located.mixing, located.found.rows, searched.rows
        ),
        replays=located.replays + searched.replays,
        trials=minimised.trials,
        nonfinite_rows=None if located.found.rows is None else tuple(sorted(located.found.rows)),
        notes=tuple(notes),
    )
    if fixture is None:
        return result
    if bundle is None:
        raise ShrinkError("a fixture needs bundle= (replay_step's run_id, step, owners, binding)")
    from nanrunbook.capture.torch.shrink._fixture import write_fixture

    path = write_fixture(
        fixture, step, result, bundle=bundle, drop_names=drop_names, overwrite=overwrite
    )
    return replace(result, fixture=str(path))


def shrink_step(
    model: Any,
    optimizer: Any,
    batch: Any,
    compute_loss: Callable[[Any, Any], Any],
    *,
    scaler: Any = None,
    loss_scale: float | None = None,
    rng_state: Any = None,
    seed: int | None = None,
    select: Callable[[Any, tuple[int, ...]], Any] | None = None,
    batch_size: int | None = None,
    stage: str | None = None,
    max_replays: int = DEFAULT_MAX_REPLAYS,
    hint: bool = True,
    fixture: str | Path | None = None,
    bundle: Mapping[str, Any] | None = None,
    drop_names: bool = False,
    overwrite: bool = False,
) -> Shrink:
    """One call: :func:`shrink` of the step the loop just ran.

    ``compute_loss(model, batch)`` is the loop's forward, autocast included
    (every replay runs it on a clone of ``batch``, which is the batch as given:
    a loop whose compute_loss changes its batch in place passes a clone taken
    before its own forward);
    ``scaler``/``loss_scale`` scale the loss before backward as the loop did;
    ``rng_state`` is ``torch.get_rng_state()`` taken before the forward, or
    ``seed`` the seed the step ran from, as :func:`replay_step` takes them (by
    default the current state; both: ShrinkError). The other options are
    :func:`shrink`'s.
    """
    try:
        state = rng_state_for(seed, rng_state)
    except ValueError as error:
        raise ShrinkError(str(error)) from None
    step = FailingStep(
        model, optimizer, batch, compute_loss, scaler, loss_scale, state, select, batch_size
    )
    return shrink(
        step,
        stage=stage,
        max_replays=max_replays,
        hint=hint,
        fixture=fixture,
        bundle=bundle,
        drop_names=drop_names,
        overwrite=overwrite,
    )


@dataclass(frozen=True, slots=True)
class ShrinkOnHold:
    """What a training-loop sentinel calls on a hold, when the loop opted in
    (the shrink costs replays: at most ``max_replays`` steps' worth).

    Called as ``hook(steps, stage=..., fixture=..., bundle=...)`` with the held
    step (a FailingStep, or one per micro-batch, tried in order: the first that
    goes non-finite on its own is shrunk), the stage the check answered, the
    directory to write the fixture to (beside the bundle, never inside it) and
    replay_step's identity arguments for the fixture's bundle. Returns the
    Shrink, or None after logging why there is none: a shrink never turns a
    hold into a crash.
    """

    max_replays: int = 24
    drop_names: bool = False

    def __call__(
        self,
        steps: FailingStep | Sequence[FailingStep],
        *,
        stage: str,
        fixture: str | Path,
        bundle: Mapping[str, Any],
    ) -> Shrink | None:
        for step in [steps] if isinstance(steps, FailingStep) else steps:
            try:
                result = shrink(
                    step,
                    stage=stage,
                    max_replays=self.max_replays,
                    fixture=fixture,
                    bundle=bundle,
                    drop_names=self.drop_names,
                )
            except StepIsFinite:
                continue
            except Exception as error:  # the hold stands whatever the shrink hits
                log.warning("shrink: no result for the %s hold: %s", stage, error)
                return None
            for line in result.lines():
                log.info("shrink: %s", line)
            return result
        log.warning(
            "shrink: no result for the %s hold: no step goes non-finite replayed alone", stage
        )
        return None
