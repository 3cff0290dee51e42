"""A shrink kept as a regression fixture: the operation, its exact inputs, a test.

:func:`write_fixture` replays the shrunk examples once more, capturing the
first bad operation's state, inputs (exact bits), autocast and RNG state, and
writes atomically a directory::

    fixture.json          what it is: the operation, stage, precision, loss
                          scale, reduction, optimizer, examples, digests
    program.pt2           the operation as a torch.export program with its weights
    module.pt             the module by class path (pickled) for the current-code test
    weights.safetensors   that module's state, raw bits
    inputs.safetensors    the operation's exact inputs (and incoming gradients)
    bundle/               the shrunk step's evidence bundle: check says HOLD
    README.md             how to run it, and the one line to flip once fixed
    test_<name>.py        the generated pytest file

Needs torch.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib
import logging
import math
import re
import sys
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch

from nanrunbook._version import __version__
from nanrunbook.capture.atomic import atomic_directory, write_synced
from nanrunbook.capture.torch._convert import tensor_to_raw
from nanrunbook.capture.torch._copies import clone_batch, flatten
from nanrunbook.capture.torch.shrink._failing_step import (
    FailingStep,
    replay_examples,
    resolved,
    select_examples,
)
from nanrunbook.capture.torch.shrink._finiteness import all_finite, requires_grad_flags
from nanrunbook.capture.torch.shrink._fixture_template import TEST_SOURCE
from nanrunbook.capture.torch.shrink._locate import CapturedCall, FunctionObserver, ModuleObserver
from nanrunbook.capture.torch.shrink._results import OpKey, Shrink
from nanrunbook.contract import STAGE_ORDER
from nanrunbook.tensors.safetensors_write import RawTensor, safetensors_chunks

__all__ = ["FIXTURE_FORMAT", "FixtureError", "write_fixture"]

FIXTURE_FORMAT = "nanrunbook-shrink-fixture/1"
INPUTS_FILE = "inputs.safetensors"
FROZEN_FILE = "program.pt2"
MODULE_FILE = "module.pt"
WEIGHTS_FILE = "weights.safetensors"
BUNDLE_DIR = "bundle"


class FixtureError(ValueError):
    """The fixture cannot be written: the message says why, in one line."""


# ------------------------------------------------------------------ capture


class _ModelCalls:
    """The model's own calls in a replay: their outputs, cloned, in call order."""

    def __init__(self, model: Any) -> None:
        self.outputs: list[Any] = []
        self.requires_grad: list[list[bool]] = []
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        self.outputs.append(clone_batch(output))
        self.requires_grad.append(requires_grad_flags(output))

    def context(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def remove(self) -> None:
        self._handle.remove()


@dataclass(frozen=True, slots=True)
class _Captures:
    op: CapturedCall
    module: CapturedCall | None  # the module whose code called the function operation
    model: _ModelCalls | None  # for an operation in compute_loss: the model's outputs
    model_calls_before: int | None  # how many model calls had returned when it ran


def _observers(key: OpKey, size: int, passing_on: bool, model: Any) -> list[Any]:
    common: dict[str, Any] = {"batch_size": size, "capture": True, "backward": key.backward}
    if key.kind == "module":
        return [ModuleObserver(model, target=key, passing_on=passing_on, **common)]
    within = (key.path, key.call)
    observers: list[Any] = [
        FunctionObserver(
            model, within=within, target=key, passing_on=passing_on, stop=False, **common
        )
    ]
    if key.call:  # the module whose code called it: the current-code program
        enclosing = OpKey("module", key.path, key.call)
        observers.append(ModuleObserver(model, target=enclosing, stop=False, **common))
    else:
        observers.append(_ModelCalls(model))
    return observers


def _capture(step: FailingStep, result: Shrink) -> _Captures:
    """One replay of the shrunk examples: the operation's call and, for a
    function, the module call whose code called it or, in compute_loss, the
    model's outputs (for the current-code test). A named probe is pinned by
    the function that made its value."""
    key = result.operation.made_by or result.operation.key
    if key.kind == "probe":
        raise FixtureError(
            f"{result.operation.describe()}: no torch function before it made the value,"
            " so there is no operation to pin"
        )
    passing_on = result.operation.stage == "input"
    observers: list[Any] = []

    def attach(model: Any) -> list[Any]:
        observers.extend(_observers(key, len(result.examples), passing_on, model))
        return observers

    replay_examples(step, result.examples, attach, backward=key.backward)
    first = observers[0]
    if not first.reproduced:
        raise FixtureError(
            f"{result.operation.describe()} did not go non-finite again on examples "
            f"{list(result.examples)}: the replay is not deterministic here"
        )
    op = first.captured_call() if key.kind == "module" else first.captured
    if op is None:
        raise FixtureError(f"{result.operation.describe()} ran but was not captured")
    op.key = key  # the operation's key (a function's capture holds its forward key)
    if key.kind == "module":
        return _Captures(op, None, None, None)
    if key.call:
        return _Captures(op, observers[1].captured_call(key.call), None, None)
    return _Captures(op, None, observers[1], first.model_calls_before)


# ------------------------------------------------------------------ arguments


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where a tensor goes back into an argument structure."""

    index: int


def _structure(value: Any, tensors: list[Any]) -> Any:
    """``value`` with each tensor replaced by a _Slot (tensors appended, in order)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, Mapping):
        return {k: _structure(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_structure(v, tensors) for v in value)
    return value


def _fill(structure: Any, tensors: tuple[Any, ...]) -> Any:
    if isinstance(structure, _Slot):
        return tensors[structure.index]
    if isinstance(structure, Mapping):
        return {k: _fill(v, tensors) for k, v in structure.items()}
    if isinstance(structure, list | tuple):
        return type(structure)(_fill(v, tensors) for v in structure)
    return structure


def _spec(structure: Any, names: list[str], grads: list[bool]) -> Any:
    """An argument structure as fixture.json holds it (see the generated test's build)."""
    if isinstance(structure, _Slot):
        return {"tensor": {"name": names[structure.index], "requires_grad": grads[structure.index]}}
    if isinstance(structure, Mapping):
        if not all(isinstance(k, str) for k in structure):
            raise FixtureError("a dict argument with non-string keys cannot be pinned")
        return {"dict": [[k, _spec(v, names, grads)] for k, v in structure.items()]}
    if isinstance(structure, list | tuple):
        kind = "list" if isinstance(structure, list) else "tuple"
        return {kind: [_spec(v, names, grads) for v in structure]}
    if isinstance(structure, float) and not math.isfinite(structure):
        return {"float": repr(structure)}
    if structure is None or isinstance(structure, bool | int | float | str):
        return {"value": structure}
    if isinstance(structure, torch.dtype):
        return {"dtype": str(structure).removeprefix("torch.")}
    if isinstance(structure, torch.device):
        return {"device": str(structure)}
    if isinstance(structure, slice):
        return {"slice": [structure.start, structure.stop, structure.step]}
    if structure is Ellipsis:
        return {"ellipsis": None}
    raise FixtureError(f"an argument of type {type(structure).__name__} cannot be pinned")


class _Tensors:
    """The tensors of inputs.safetensors, named (or numbered, with drop_names)."""

    def __init__(self, drop_names: bool) -> None:
        self.drop_names = drop_names
        self.raw: dict[str, RawTensor] = {}

    def add(self, name: str, tensor: Any) -> str:
        if self.drop_names:
            name = f"t{len(self.raw)}"
        self.raw[name] = tensor_to_raw(tensor)
        return name

    def digests(self) -> dict[str, str]:
        return {name: hashlib.sha256(raw.data).hexdigest() for name, raw in self.raw.items()}


def _call_document(label: str, call: CapturedCall, store: _Tensors) -> tuple[dict[str, Any], Any]:
    """One call's inputs into ``store``; returns its fixture.json entry and its
    argument structure (for export)."""
    leaves: list[Any] = []
    structure = _structure((call.args, call.kwargs), leaves)
    names = [store.add(f"{label}/input/{i}", t) for i, t in enumerate(leaves)]
    grads = list(call.requires_grad) + [False] * (len(leaves) - len(call.requires_grad))
    args, kwargs = structure
    entry: dict[str, Any] = {
        "args": _spec(args, names, grads),
        "kwargs": _spec(kwargs, names, grads),
        "rng_state": store.add(f"{label}/rng_state", call.rng_state),
        "autocast": None
        if call.autocast is None
        else {"device_type": call.autocast[0], "dtype": call.autocast[1]},
    }
    if call.grad_output is not None:
        given = (
            call.grad_output if isinstance(call.grad_output, tuple | list) else (call.grad_output,)
        )
        entry["grad_output"] = [
            None if g is None else store.add(f"{label}/grad_output/{i}", g)
            for i, g in enumerate(given)
        ]
    return entry, structure


# ------------------------------------------------------------------ programs


class _Call(torch.nn.Module):
    """The operation as a module of its flat input tensors, for torch.export."""

    def __init__(self, target: Any, structure: Any) -> None:
        super().__init__()
        if isinstance(target, torch.nn.Module):
            self.target = target
        else:
            self.function = target
        self.structure = structure

    def forward(self, *tensors: Any) -> Any:
        args, kwargs = _fill(self.structure, tensors)
        call = self.target if hasattr(self, "target") else self.function
        return call(*args, **kwargs)


def _autocast(call: CapturedCall) -> AbstractContextManager[Any]:
    if call.autocast is None:
        return nullcontext()
    device, dtype = call.autocast
    return torch.autocast(device, dtype=getattr(torch, dtype))


def _module(step: FailingStep, call: CapturedCall) -> Any:
    """The module of ``call``, copied from the caller's model (without the observers'
    hooks) and loaded with the state it had when the call ran."""
    module = copy.deepcopy(step.model.get_submodule(call.key.path))
    module.load_state_dict(call.state or {})
    return module


def _export(path: Path, target: Any, call: CapturedCall, structure: Any) -> str | None:
    """Save the operation as a torch.export program; None, or the reason it failed."""
    leaves: list[Any] = []
    _structure((call.args, call.kwargs), leaves)
    inputs = tuple(t.detach() for t in leaves)
    torch_log = logging.getLogger("torch")
    level = torch_log.level
    torch_log.setLevel(logging.CRITICAL)  # a failed trace logs the graph it got: the note says it
    try:
        with _autocast(call), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(_Call(target, structure), inputs)
        torch.export.save(program, path)
    except Exception as error:  # export raises many types; any of them means "fall back"
        path.unlink(missing_ok=True)
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return f"torch.export could not trace it ({type(error).__name__}: {first})"
    finally:
        torch_log.setLevel(level)
    return None


def _importable(obj: Any) -> str | None:
    """None when ``obj`` (a class or function) can be imported by its path in
    another process, else why not."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "?")
    where = f"{module}.{qualname}"
    if not module or module == "__main__" or "<" in qualname:
        return f"{where} cannot be imported by another process: move it to a module"
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return f"{where} cannot be imported"
    return None if found is obj else f"{where} names another object"


def _script_of(obj: Any) -> tuple[str | None, str | None]:
    """For a function defined in the running training script (``__main__``, the
    usual case): the script's path, or why the generated test cannot import it
    (its top level must only define things, its work under a main guard)."""
    if getattr(obj, "__module__", None) != "__main__" or "<" in obj.__qualname__:
        return None, None
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not Path(path).is_file():
        return None, "it lives in __main__ without a script file: move it to a module"
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError) as error:
        return None, f"its script {path} cannot be read ({type(error).__name__})"
    for statement in tree.body:
        if not _defines_only(statement):
            return None, (
                f"its script {path} runs code when imported (line {statement.lineno}):"
                ' put that under `if __name__ == "__main__":` or move compute_loss to a module'
            )
    return str(Path(path).resolve()), None


_DEFINING = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
    ast.Pass,
)


def _defines_only(statement: ast.stmt) -> bool:
    """A top-level statement that only defines (imports, functions, classes,
    assignments, a docstring) or is the script's main guard."""
    if isinstance(statement, ast.If):
        test = statement.test
        return (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name)
            and test.left.id == "__name__"
            and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value == "__main__"
        )
    if isinstance(statement, ast.Try):
        return all(_defines_only(s) for s in statement.body) and all(
            _defines_only(s) for handler in statement.handlers for s in handler.body
        )
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant)
    return isinstance(statement, _DEFINING)


def _current(temp: Path, module: Any, label: str) -> tuple[dict[str, Any] | None, str | None]:
    """The module pickled by class path with its state beside it in raw bits, for
    the test that runs the code as it is now."""
    reason = _importable(type(module))
    if reason is not None:
        return None, reason
    try:
        torch.save(module, temp / MODULE_FILE)
    except Exception as error:  # pickling user objects can fail in many ways
        (temp / MODULE_FILE).unlink(missing_ok=True)
        return None, f"the module cannot be pickled ({type(error).__name__}: {error})"
    state = {name: tensor_to_raw(t) for name, t in module.state_dict().items()}
    write_synced(temp / WEIGHTS_FILE, safetensors_chunks(list(state.items())))
    cls = type(module)
    return {
        "kind": "module",
        "file": MODULE_FILE,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "weights": WEIGHTS_FILE,
        "state_sha256": {n: hashlib.sha256(r.data).hexdigest() for n, r in state.items()},
        "call": label,
    }, None


def _loss_current(
    step: FailingStep,
    captures: _Captures,
    batch: Any,
    store: _Tensors,
    calls: dict[str, Any],
) -> tuple[dict[str, Any] | None, str | None]:
    """For an operation in compute_loss: the loop's compute_loss, imported by its
    path, called on the shrunk batch with a stand-in model that returns the
    model's recorded outputs (so the test runs the loss code as it is now)."""
    model = captures.model
    if model is None or captures.model_calls_before is None:
        return None, "the model's outputs were not recorded"
    if captures.model_calls_before < len(model.outputs):
        return None, (
            "the operation runs in compute_loss before the model does: the current-code test"
            " would need the whole model; the frozen program reproduces it"
        )
    script, reason = _script_of(step.compute_loss)
    if script is None:
        reason = reason or _importable(step.compute_loss)
    if reason is not None:
        return None, f"compute_loss: {reason}"
    scale = _scale(step)
    if not _stand_in_reproduces(step, batch, model.outputs, captures.op.key.backward, scale):
        return None, "compute_loss with the model's recorded outputs does not reproduce it"
    leaves: list[Any] = []
    structure = _structure((batch, model.outputs), leaves)
    names = [store.add(f"loss/input/{i}", t) for i, t in enumerate(leaves)]
    flags = requires_grad_flags(batch) + [f for call in model.requires_grad for f in call]
    calls["loss"] = {
        "batch": _spec(structure[0], names, flags),
        "outputs": [_spec(o, names, flags) for o in structure[1]],
        "rng_state": store.add("loss/rng_state", step.rng_state.cpu),
        "loss_scale": scale,
        "autocast": [
            {"device_type": r.device_type, "dtype": str(r.dtype).removeprefix("torch.")}
            for r in step.autocast
        ],
    }
    fn = step.compute_loss
    function = f"{fn.__module__}:{fn.__qualname__}"
    return {"kind": "compute_loss", "function": function, "script": script}, None


def _scale(step: FailingStep) -> float:
    if step.scaler is not None and step.scaler.is_enabled():
        return float(step.scaler.get_scale())
    return 1.0 if step.loss_scale is None else float(step.loss_scale)


class _StandIn(torch.nn.Module):
    """A model that returns recorded outputs, one per call, in order."""

    def __init__(self, outputs: list[Any]) -> None:
        super().__init__()
        self._outputs = iter(outputs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return next(self._outputs)


def _stand_in_reproduces(
    step: FailingStep, batch: Any, outputs: list[Any], backward: bool, scale: float
) -> bool:
    """What the generated test will do, done here first: compute_loss on the
    stand-in model gives a non-finite loss (or, backward, non-finite gradients
    of the model's outputs)."""
    outputs = clone_batch(outputs)
    leaves = [t for _, t in flatten(outputs, "") if t.is_floating_point()]
    for leaf in leaves:
        leaf.requires_grad_(backward)
    try:
        with torch.random.fork_rng(), step.rng_state.kept(), ExitStack() as around:
            step.rng_state.restore()
            for region in step.autocast:
                around.enter_context(torch.autocast(region.device_type, dtype=region.dtype))
            loss = step.compute_loss(_StandIn(outputs), clone_batch(batch))
            if not backward:
                return not all_finite(loss)
            grads = torch.autograd.grad(loss * scale, leaves, allow_unused=True)
    except Exception:  # a compute_loss that needs more of the model than its call
        return False
    return not all_finite([g for g in grads if g is not None])


def _programs(
    temp: Path,
    step: FailingStep,
    captures: _Captures,
    batch: Any,
    store: _Tensors,
    calls: dict[str, Any],
    structure: Any,
) -> dict[str, Any]:
    op = captures.op
    frozen_target = _module(step, op) if op.key.kind == "module" else op.function
    frozen_note = _export(temp / FROZEN_FILE, frozen_target, op, structure)
    if op.key.kind == "module":
        current, current_note = _current(temp, _module(step, op), "op")
    elif captures.module is not None:
        current, current_note = _current(temp, _module(step, captures.module), "module")
    else:
        current, current_note = _loss_current(step, captures, batch, store, calls)
    if frozen_note and current is None:
        raise FixtureError(f"no program reproduces it: {frozen_note}; and {current_note}")
    if frozen_note and current is not None:
        where = current.get("class") or current.get("function")
        frozen_note += f"; falling back to {where} by class path and its state (test_current_code)"
    return {
        "frozen": None if frozen_note else FROZEN_FILE,
        "frozen_note": frozen_note,
        "current": current,
        "current_note": current_note,
    }


# ------------------------------------------------------------------ facts


def _bundle(path: Path, step: FailingStep, batch: Any, identity: Mapping[str, Any]) -> Any:
    """The shrunk step's bundle, replayed as the loop ran it (the same RNG state,
    autocast regions and loss scaling), written, checked: the check's decision."""
    from nanrunbook.capture.torch.replay import (
        Autocast,
        MicroBatch,
        Scaling,
        StepRecipe,
        bind,
        replay_recipe,
    )

    if step.scaler is not None and step.scaler.is_enabled():
        scaling = Scaling("dynamic", scaler=step.scaler)
    elif step.loss_scale is not None:
        scaling = Scaling("static", scale=step.loss_scale)
    else:
        scaling = Scaling()
    regions = tuple(
        Autocast(r.device_type, r.dtype, getattr(r, "cache_enabled", True)) for r in step.autocast
    )
    recipe = StepRecipe(
        compute_loss=step.compute_loss,
        micro_batches=(MicroBatch(batch, step.rng_state, regions),),
        scaling=scaling,
    )
    owner = dict.fromkeys(STAGE_ORDER, identity["incident_owner"])
    owner.update(identity.get("owners") or {})
    names = ("run_id", "step", "incident_owner", "last_known_good")
    replayed = replay_recipe(
        step.model, step.optimizer, recipe, owner, **{k: identity[k] for k in names}
    )
    bind(replayed, step.model, step.optimizer, identity["binding"])
    return replayed.writer.write_checked(path).decision


def _check_identity(identity: Mapping[str, Any]) -> None:
    """Refuse, before any replay, bundle arguments the bundle cannot be made from."""
    from nanrunbook.capture.torch.replay import REQUIRED_BINDING

    needed = ("run_id", "step", "incident_owner", "last_known_good", "binding")
    missing = [k for k in needed if k not in identity]
    missing += [k for k in REQUIRED_BINDING if k not in identity.get("binding", {})]
    if missing:
        raise FixtureError(f"the fixture's bundle needs {', '.join(missing)} in bundle=")


def _json_safe(value: Any) -> Any:
    """Optimizer hyperparameters as JSON: numbers, strings, booleans and lists of them."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _json_safe(value.item())
    return repr(value)


def _loop_facts(
    step: FailingStep, identity: Mapping[str, Any], given: Mapping[str, Any]
) -> dict[str, Any]:
    """The precision, loss-scale, reduction and optimizer facts the runbook names;
    ``given`` adds what only the loop knows (clipping, accumulation, order)."""
    scaler = step.scaler
    if scaler is not None and scaler.is_enabled():
        scale: dict[str, Any] = {
            "mode": "dynamic",
            "scale": scaler.get_scale(),
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
        }
    elif step.loss_scale is not None:
        scale = {"mode": "static", "scale": step.loss_scale}
    else:
        scale = {"mode": "none", "scale": 1}
    objective = dict(identity.get("binding", {}).get("objective", {}))
    optimizer = step.optimizer
    groups = [
        {k: _json_safe(v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in step.model.parameters()})
    return {
        "param_dtypes": dtypes,
        "loss_scale": scale,
        "reduction": objective.get("reduction"),
        "optimizer": {"class": type(optimizer).__qualname__, "param_groups": groups},
        "loop": {str(k): _json_safe(v) for k, v in given.items()},
    }


def _operation_document(result: Shrink) -> dict[str, Any]:
    op = result.operation
    key = op.key
    return {
        "describe": op.describe(),
        "stage": op.stage,
        "kind": key.kind,
        "path": key.path,
        "call": key.call,
        "function": key.function,
        "occurrence": key.occurrence,
        "backward": key.backward,
        "type": op.type_name,
        "made_here": op.made_here,
        "autocast": op.autocast,
        "made_by": op.made_by.describe() if op.made_by else None,
    }


def _test_name(result: Shrink, identity: Mapping[str, Any]) -> str:
    run = f"{identity.get('run_id', 'run')}_step{identity.get('step', '')}"
    what = result.operation.key.function or result.operation.key.path or "root"
    slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{run}_{what}").strip("_").lower()
    return f"test_nonfinite_{slug[:60]}.py"


_README = """\
# Non-finite operation fixture: {describe}

Written by `nanrunbook` {version} (shrink) from run `{run}`, step {step}.

- stage: **{stage}** (`nanrunbook check bundle/` answers HOLD there)
- operation: {describe}{made}
- precision: {autocast}; loss scale: {scale}; reduction: {reduction}
- smallest batch: {count} of {size} examples {examples} ({replays} replays)
{interaction}{notes}
## Run it

    pytest {directory}/

Today it **reproduces**: every test passes because the operation still goes
non-finite on its pinned inputs (their digests are verified first).

Once the fix is in, `test_current_code` fails ("the current code gives finite
values"): flip the one line `FIXED = False` to `FIXED = True` in
`{test}` and it passes: **fixed**. {frozen}

## Files

| file | what |
|---|---|
{files}"""

# The files a fixture may hold, in the README's order; it lists those written.
_FILES = (
    ("fixture.json", "the facts above, input and file digests"),
    (INPUTS_FILE, "the operation's exact inputs, raw bits (bf16/fp8 kept)"),
    (FROZEN_FILE, "the operation and its weights, frozen by torch.export"),
    (MODULE_FILE, "the module by class path"),
    (WEIGHTS_FILE, "the module's state"),
    (BUNDLE_DIR, "the shrunk step's evidence bundle"),
)


def _readme(document: dict[str, Any], test: str, directory: str, temp: Path) -> str:
    op, shrunk, facts = document["operation"], document["shrink"], document["facts"]
    rows = [(name, what) for name, what in _FILES if (temp / name).exists()]
    frozen = (
        "`test_frozen_program_reproduces` keeps\nreproducing the incident as it was"
        f" (`{FROZEN_FILE}`, a torch.export program)."
        if (temp / FROZEN_FILE).exists()
        else f"No program is frozen ({document['program']['frozen_note']})."
    )
    rows.append((test, "the test"))
    shown = {BUNDLE_DIR: f"{BUNDLE_DIR}/"}
    files = "".join(f"| `{shown.get(name, name)}` | {what} |\n" for name, what in rows)
    notes = "".join(f"- note: {n}\n" for n in document["notes"])
    interaction = f"- interaction: {shrunk['interaction']}\n" if shrunk["interaction"] else ""
    return _README.format(
        describe=op["describe"],
        version=__version__,
        run=document["run"]["run_id"],
        step=document["run"]["step"],
        stage=op["stage"],
        made="" if op["made_here"] else " (it passed on a non-finite input)",
        autocast=f"autocast {op['autocast']}" if op["autocast"] else "no autocast",
        scale=facts["loss_scale"]["mode"],
        reduction=facts["reduction"] or "unknown",
        count=len(shrunk["examples"]),
        size=shrunk["batch_size"],
        examples=shrunk["examples"],
        replays=shrunk["replays"],
        interaction=interaction,
        notes=notes,
        test=test,
        directory=directory,
        files=files,
        frozen=frozen,
    )


# ------------------------------------------------------------------ the call


def write_fixture(
    target: str | Path,
    step: FailingStep,
    result: Shrink,
    *,
    bundle: Mapping[str, Any],
    drop_names: bool = False,
    facts: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the fixture of a shrink to ``target``, atomically, and return it.

    ``bundle`` gives :func:`~nanrunbook.capture.torch.replay_step`'s identity
    arguments (run_id, step, incident_owner, last_known_good, binding, and
    optionally owners) for the shrunk step's bundle. ``drop_names`` stores the
    input tensors as ``t0``, ``t1``... instead of descriptive names. ``facts``
    adds what only the loop knows (gradient clipping, accumulation). Raises
    FixtureError when the operation cannot be captured or pinned, and
    FileExistsError when ``target`` exists and ``overwrite`` is false.
    """
    target = Path(target)
    _check_identity(bundle)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    step = resolved(step)
    captures = _capture(step, result)
    if step.select is not None:
        batch = step.select(step.batch, result.examples)
    else:
        batch = select_examples(step.batch, result.examples, result.batch_size)
    store = _Tensors(drop_names)
    calls: dict[str, Any] = {}
    calls["op"], structure = _call_document("op", captures.op, store)
    if captures.module is not None:
        calls["module"], _ = _call_document("module", captures.module, store)
    with atomic_directory(target, overwrite=overwrite) as temp:
        programs = _programs(temp, step, captures, batch, store, calls, structure)
        write_synced(temp / INPUTS_FILE, safetensors_chunks(list(store.raw.items())))
        decision = _bundle(temp / BUNDLE_DIR, step, batch, bundle)
        document = {
            "format": FIXTURE_FORMAT,
            "written_by": f"nanrunbook {__version__}",
            "run": {"run_id": bundle.get("run_id"), "step": bundle.get("step")},
            "operation": _operation_document(result),
            "shrink": result.document(),
            "facts": _loop_facts(step, bundle, facts or {}),
            "program": programs,
            "inputs": {"file": INPUTS_FILE, "sha256": store.digests(), **calls},
            "files": {
                name: hashlib.sha256((temp / name).read_bytes()).hexdigest()
                for name in (FROZEN_FILE, MODULE_FILE, WEIGHTS_FILE)
                if (temp / name).exists()
            },
            "bundle": {
                "path": BUNDLE_DIR,
                "decision": decision.decision,
                "stage": decision.earliest_nonfinite_stage,
            },
            "notes": _notes(result, programs, decision),
        }
        _write_texts(temp, document, result, _test_name(result, bundle), target.name)
    return target


def _notes(result: Shrink, programs: Mapping[str, Any], decision: Any) -> list[str]:
    """The shrink's notes, then why a program is missing, then a bundle that
    does not answer as the incident did."""
    notes = list(result.notes)
    notes += [n for n in (programs["frozen_note"], programs["current_note"]) if n]
    stage = result.operation.stage
    if (decision.decision, decision.earliest_nonfinite_stage) != ("HOLD", stage):
        notes.append(
            f"the shrunk step's bundle answers {decision.decision} at"
            f" {decision.earliest_nonfinite_stage}, not HOLD at {stage}"
        )
    return notes


def _write_texts(
    temp: Path, document: dict[str, Any], result: Shrink, test: str, directory: str
) -> None:
    text = orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    write_synced(temp / "fixture.json", [text])
    write_synced(temp / "README.md", [_readme(document, test, directory, temp).encode()])
    source = TEST_SOURCE.replace("__DESCRIPTION__", result.operation.describe())
    write_synced(temp / test, [source.replace("__DIRECTORY__", directory).encode()])
