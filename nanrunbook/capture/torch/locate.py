"""Where a replayed step first goes non-finite: probes attached to a model copy.

Two probes, each in one of three roles: a *survey* finds the first operation
that makes a non-finite value from finite inputs; a *watch* follows one known
operation through a replay of a smaller batch (did it still go non-finite, and
in which rows); a *capture* keeps what the fixture needs of it (its state,
exact inputs, autocast and incoming gradients).

* :class:`ModuleProbe` hooks every module: forward (pre and post), full
  backward (pre and post) and the module's own parameters' gradients.
* :class:`FunctionProbe` is a ``TorchFunctionMode``: every torch function the
  code calls directly (not the ones inside it), and the autograd nodes they
  create, so a NaN made by functional code between modules, or by the loss, is
  located at its function.

Needs torch; imported only by the shrink.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanrunbook.capture.findings import OpKey, ShrinkError, TensorFacts
from nanrunbook.capture.torch.binding import cuda_devices
from nanrunbook.capture.torch.copies import clone_batch, copy_scaler, flatten
from nanrunbook.capture.torch.recording import _listening as listening
from nanrunbook.capture.torch.replay import RngState

__all__ = [
    "Captured",
    "Found",
    "FunctionProbe",
    "ModuleProbe",
    "Stop",
    "all_finite",
    "autocast_state",
    "facts",
    "nonfinite_rows",
    "replay",
    "requires_grad_flags",
    "resolved",
    "select_examples",
]


class Stop(BaseException):
    """Raised from a hook once the watched operation has run: the rest of the
    replay cannot change the answer. A BaseException, so that a loss function's
    ``except Exception`` does not swallow it."""


# --------------------------------------------------------------------- tensors


def _as_checkable(tensor: Any) -> Any:
    """A tensor whose dtype torch's isfinite/isnan support (fp8 widened exactly)."""
    t = tensor.detach()
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj()).float()
    if t.is_floating_point() and t.element_size() == 1:
        return t.float()
    return t


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _leaves(value: Any) -> Iterator[Any]:
    """Tensors and Python floats of a nested value, in order."""
    if isinstance(value, torch.Tensor | float):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)


def all_finite(value: Any) -> bool:
    """True when every floating element (and Python float) of ``value`` is finite."""
    for leaf in _leaves(value):
        if isinstance(leaf, float):
            if not math.isfinite(leaf):
                return False
        elif (
            _floating(leaf) and leaf.numel() and not bool(torch.isfinite(_as_checkable(leaf)).all())
        ):
            return False
    return True


def nonfinite_rows(value: Any, size: int) -> frozenset[int] | None:
    """Indices along dimension 0 holding a non-finite element, over the floating
    tensors of ``value`` whose first dimension is ``size``; None when none has it."""
    rows: set[int] | None = None
    for _, tensor in flatten(value, ""):
        if not _floating(tensor) or tensor.dim() == 0 or tensor.shape[0] != size:
            continue
        bad = ~torch.isfinite(_as_checkable(tensor)).reshape(size, -1).all(dim=1)
        rows = (rows or set()) | {int(i) for i in torch.nonzero(bad).flatten().tolist()}
    return None if rows is None else frozenset(rows)


def facts(name: str, tensor: Any) -> TensorFacts:
    """Counts by kind and finite extremes of one tensor (non-floating: all finite)."""
    shape = tuple(int(d) for d in tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    n = tensor.numel()
    if not _floating(tensor) or n == 0:
        values = tensor.detach().double() if n and not tensor.is_complex() else None
        low = float(values.min()) if values is not None else None
        high = float(values.max()) if values is not None else None
        top = float(values.abs().max()) if values is not None else None
        return TensorFacts(name, dtype, shape, n, 0, 0, 0, low, high, top)
    t = _as_checkable(tensor).double()
    nan, pos, neg = int(t.isnan().sum()), int(t.isposinf().sum()), int(t.isneginf().sum())
    finite = t[torch.isfinite(t)]
    if finite.numel() == 0:
        return TensorFacts(name, dtype, shape, n, nan, pos, neg, None, None, None)
    return TensorFacts(
        name,
        dtype,
        shape,
        n,
        nan,
        pos,
        neg,
        float(finite.min()),
        float(finite.max()),
        float(finite.abs().max()),
    )


def _named_facts(prefix: str, value: Any) -> tuple[TensorFacts, ...]:
    return tuple(facts(f"{prefix}/{name}" if name else prefix, t) for name, t in flatten(value, ""))


def _inputs_facts(inputs: tuple[Any, Any]) -> tuple[TensorFacts, ...]:
    args, kwargs = inputs
    return _named_facts("args", args) + _named_facts("kwargs", kwargs)


_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or")
) | {"__ixor__", "__ilshift__", "__irshift__"}


def _in_place(name: str) -> bool:
    last = name.rpartition(".")[2]
    return (last.endswith("_") and not last.endswith("__")) or last in _IN_PLACE_OPERATORS


def autocast_state(value: Any) -> tuple[str, str] | None:
    """(device type, dtype) of the autocast in force for the tensors of ``value``."""
    devices = [t.device.type for _, t in flatten(value, "")] or ["cpu"]
    device = devices[0]
    try:
        if torch.is_autocast_enabled(device):
            return device, str(torch.get_autocast_dtype(device)).removeprefix("torch.")
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return None


def requires_grad_flags(value: Any) -> list[bool]:
    """Whether each tensor of ``value``, in order, requires grad."""
    return [bool(t.requires_grad) for _, t in flatten(value, "")]


# --------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Found:
    """An operation that went non-finite in a replay, with what it saw there."""

    key: OpKey
    type_name: str
    leaf: bool
    made_here: bool
    inputs: tuple[TensorFacts, ...]
    outputs: tuple[TensorFacts, ...]
    grad_outputs: tuple[TensorFacts, ...]
    rows: frozenset[int] | None
    autocast: tuple[str, str] | None


@dataclass
class Captured:
    """What a fixture needs of one operation call, copied when it ran: the
    module's state (its state_dict, cloned; the module itself is rebuilt from
    the caller's model, without the probe's hooks) or the torch function, its
    exact inputs, the autocast and RNG state in force, its outputs, and the
    gradients it received (backward)."""

    key: OpKey
    function: Any = None  # the torch function, for a function operation
    state: dict[str, Any] | None = None  # the module's state_dict, for a module
    args: Any = None
    kwargs: Any = None
    requires_grad: list[bool] = field(default_factory=list)
    autocast: tuple[str, str] | None = None
    rng_state: Any = None
    output: Any = None
    grad_output: Any = None


# --------------------------------------------------------------------- modules


@dataclass
class _Frame:
    """One module call in progress (call 0: the code outside every module)."""

    path: str
    call: int
    finite_in: bool | None  # None: not judged
    autocast: tuple[str, str] | None
    clean: bool = True  # everything seen inside it so far was finite
    probes: dict[str, int] = field(default_factory=dict)


class ModuleProbe:
    """Hooks on every module of a model copy, and the named-probe sink; removed
    by :meth:`remove`, the sink listening only inside :meth:`context`.

    ``target`` None surveys: :attr:`forward` is the first module call whose
    output is non-finite while its inputs and its parameters and buffers are
    finite, or the first named probe whose value is non-finite while everything
    its module call saw before it was finite (with ``passing_on``, for an input
    stage: the first non-finite output or value at all);
    :attr:`forward_nonfinite` says whether a leaf module's output or a probe's
    value was (the forward stage); :attr:`backward` is the first module, in
    backward order, whose input gradients or own parameters' gradients go
    non-finite while its output gradients are finite. With a ``target`` only
    that call or probe is judged: :attr:`reproduced` and :attr:`rows`; a
    forward target stops the replay (raises :class:`Stop`) once it has run,
    unless ``stop`` is false. ``capture`` keeps the target module's state,
    inputs and incoming gradients; for a backward target every forward call of
    the module is kept and :meth:`captured_call` picks the one whose backward
    it was (backward runs a module's calls in reverse order).
    """

    def __init__(
        self,
        model: Any,
        *,
        batch_size: int,
        target: OpKey | None = None,
        passing_on: bool = False,
        capture: bool = False,
        backward: bool = True,
        stop: bool = True,
    ) -> None:
        self.batch_size = batch_size
        self.target = target
        self.passing_on = passing_on
        self._stop = stop
        self.forward: Found | None = None
        self.backward: Found | None = None
        self.forward_nonfinite = False
        self.reproduced = False
        self.rows: frozenset[int] | None = None
        self.first_bad_grad_output: str | None = None
        self._capture = capture and target is not None
        self._kept: dict[int, Captured] = {}
        self._grad_outputs: dict[int, Any] = {}
        self._inputs: dict[tuple[str, int], tuple[Any, Any]] = {}  # survey: for backward facts
        self._calls: dict[str, int] = {}
        self._fires: dict[str, int] = {}
        watches_probes = target is None or target.kind == "probe"
        top = not passing_on if watches_probes else None
        self._frames: list[_Frame] = [_Frame("", 0, top, None)]
        self._listen = watches_probes
        self.completed: list[str] = []  # module paths in the order their forward ended
        self._grad_out: dict[str, tuple[int, bool, Any]] = {}
        self._state_ok: dict[str, bool] = {}
        self._handles: list[Any] = []
        self._leaves = {p for p, m in model.named_modules() if next(m.children(), None) is None}
        for path, module in model.named_modules():
            if target is None or (target.kind == "module" and target.path == path):
                self._attach(path, module, backward)
            elif target.kind == "probe":  # module calls say which call a probe is in
                self._attach(path, module, False)

    def _attach(self, path: str, module: Any, backward: bool) -> None:
        self._handles.append(
            module.register_forward_pre_hook(self._pre(path), with_kwargs=True, prepend=True)
        )
        self._handles.append(module.register_forward_hook(self._post(path), with_kwargs=True))
        if backward:
            self._handles.append(module.register_full_backward_pre_hook(self._bpre(path)))
            self._handles.append(module.register_full_backward_hook(self._bpost(path)))
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad:
                    what = type(module).__qualname__
                    self._handles.append(param.register_hook(self._grad(path, name, what)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def context(self) -> AbstractContextManager[Any]:
        """Where named probes are heard: around the forward."""
        return listening(self._on_probe) if self._listen else nullcontext()

    def calls(self, path: str) -> int:
        """How many times the module at ``path`` ran forward in this replay."""
        return self._calls.get(path, 0)

    def captured_call(self, call: int | None = None) -> Captured | None:
        """The kept forward call ``call`` of the target's module (by default the
        target's; for a backward target, the call its backward firing undid),
        with the gradients its backward received."""
        t = self.target
        if not self._capture or t is None or not self._kept:
            return None
        calls = len(self._kept)
        if call is None:
            call = (calls - t.call + 1) if t.backward else t.call
        kept = self._kept.get(call)
        if kept is not None and self._grad_outputs:
            kept.grad_output = self._grad_outputs.get(calls - call + 1)
        return kept

    def _judges(self, path: str, call: int, backward: bool) -> bool:
        t = self.target
        if t is None:
            return (self.backward if backward else self.forward) is None
        return t.backward == backward and t.path == path and t.call == call  # a probe's call too

    def _state_finite(self, path: str, module: Any) -> bool:
        if path not in self._state_ok:
            self._state_ok[path] = all_finite(list(module.state_dict(keep_vars=True).values()))
        return self._state_ok[path]

    # forward -------------------------------------------------------------

    def _pre(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            call = self._calls[path] = self._calls.get(path, 0) + 1
            finite_in = None
            if self._judges(path, call, False):
                finite_in = all_finite((args, kwargs)) and self._state_finite(path, module)
            autocast = autocast_state((args, kwargs))
            if self.target is None:
                self._inputs[(path, call)] = (args, kwargs)
            t = self.target
            if self._capture and t is not None and (t.backward or t.call == call):
                self._kept[call] = Captured(
                    OpKey("module", path, call),
                    state={k: v.detach().clone() for k, v in module.state_dict().items()},
                    args=clone_batch(args),
                    kwargs=clone_batch(kwargs),
                    requires_grad=requires_grad_flags((args, kwargs)),
                    autocast=autocast,
                    rng_state=torch.get_rng_state(),
                )
            self._frames.append(_Frame(path, call, finite_in, autocast))

        return hook

    def _post(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            frame = self._frames.pop()
            call, finite_in, autocast = frame.call, frame.finite_in, frame.autocast
            if self.target is None and self.forward is None:
                self.completed.append(path)
            if call in self._kept:
                self._kept[call].output = clone_batch(output)
            out_ok = True
            if finite_in is not None or (path in self._leaves and not self.forward_nonfinite):
                out_ok = all_finite(output)
            if path in self._leaves and not out_ok:
                self.forward_nonfinite = True
            parent = self._frames[-1]
            parent.clean = parent.clean and out_ok and finite_in is not False
            if finite_in is None or (self.target is not None and self.target.kind != "module"):
                return
            bad = not out_ok and (finite_in or self.passing_on)
            if self.target is not None:
                self.reproduced, self.rows = bad, nonfinite_rows(output, self.batch_size)
                if self._stop:
                    raise Stop
                return
            if bad and self.forward is None:  # an enclosing call judged at its start
                self.forward = Found(
                    OpKey("module", path, call),
                    type(module).__qualname__,
                    path in self._leaves,
                    finite_in,
                    _inputs_facts((args, kwargs)),
                    _named_facts("output", output),
                    (),
                    nonfinite_rows(output, self.batch_size),
                    autocast,
                )

        return hook

    def _on_probe(self, name: str, value: Any) -> None:
        frame = self._frames[-1]
        count = frame.probes[name] = frame.probes.get(name, 0) + 1
        key = OpKey("probe", frame.path, frame.call, name, count)
        if self.target is not None and self.target != key:
            return
        ok = all_finite(value)
        made = bool(frame.finite_in and frame.clean)
        bad = not ok and (made or self.passing_on)
        if self.target is not None:
            self.reproduced, self.rows = bad, nonfinite_rows(value, self.batch_size)
            if self._stop:
                raise Stop
            return
        self.forward_nonfinite = self.forward_nonfinite or not ok
        frame.clean = frame.clean and ok
        if bad and self.forward is None:
            inputs = self._inputs.get((frame.path, frame.call))
            self.forward = Found(
                key,
                "probe",
                True,
                made,
                () if inputs is None else _inputs_facts(inputs),
                _named_facts("value", value),
                (),
                nonfinite_rows(value, self.batch_size),
                autocast_state(value),
            )

    # backward ------------------------------------------------------------

    def _bpre(self, path: str) -> Callable[..., None]:
        def hook(module: Any, grad_output: Any) -> None:
            fire = self._fires[path] = self._fires.get(path, 0) + 1
            ok = all_finite(grad_output)
            if not ok and self.first_bad_grad_output is None:
                self.first_bad_grad_output = path or "(root)"
            self._grad_out[path] = (fire, ok, grad_output)
            if self._capture:
                self._grad_outputs[fire] = clone_batch(grad_output)

        return hook

    def _bpost(self, path: str) -> Callable[..., None]:
        def hook(module: Any, grad_input: Any, grad_output: Any) -> None:
            fire, ok, _ = self._grad_out[path]
            if ok and self._judges(path, fire, True) and not all_finite(grad_input):
                self._backward_found(path, type(module).__qualname__, fire, grad_input)

        return hook

    def _grad(self, path: str, name: str, what: str) -> Callable[[Any], None]:
        def hook(grad: Any) -> None:
            fire, ok, _ = self._grad_out.get(path, (0, False, None))
            if ok and self._judges(path, fire, True) and not all_finite(grad):
                self._backward_found(path, what, fire, {name: grad})

        return hook

    def _backward_found(self, path: str, what: str, fire: int, grads: Any) -> None:
        rows = nonfinite_rows(grads, self.batch_size)
        if self.target is not None:
            self.reproduced = True
            self.rows = rows if self.rows is None else self.rows | (rows or frozenset())
            return
        if self.backward is not None:
            return
        _, _, grad_output = self._grad_out[path]
        inputs = self._inputs.get((path, self.calls(path) - fire + 1))
        self.backward = Found(
            OpKey("module", path, fire, backward=True),
            what,
            path in self._leaves,
            True,
            () if inputs is None else _inputs_facts(inputs),
            _named_facts("grad", grads),
            _named_facts("grad_output", grad_output),
            rows,
            None,
        )


# ------------------------------------------------------------------- functions


def function_name(func: Any) -> str | None:
    """A torch function's importable dotted name, or None for attribute access
    and other calls that are not arithmetic."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if not isinstance(qualname, str) or qualname.endswith(("__get__", "__set__")):
        return None
    head, _, rest = qualname.partition(".")
    if head == "_VariableFunctionsClass":
        return f"torch.{rest}"
    if head in ("TensorBase", "Tensor"):
        return f"torch.Tensor.{rest}"
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}" if module else None


class _CallStack:
    """Which module call the code is in: forward pre/post hooks on every module."""

    def __init__(self, model: Any) -> None:
        self.stack: list[tuple[str, int]] = [("", 0)]
        self.model_calls_done = 0  # calls of the model itself that have returned
        self._calls: dict[str, int] = {}
        self._handles = []
        for path, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._push(path), prepend=True))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))

    def _push(self, path: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            call = self._calls[path] = self._calls.get(path, 0) + 1
            self.stack.append((path, call))

        return hook

    def _pop(self, module: Any, args: Any, output: Any) -> None:
        path, _ = self.stack.pop()
        if path == "" and len(self.stack) == 1:
            self.model_calls_done += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class FunctionProbe(TorchFunctionMode):
    """Every torch function called directly by the code of one context.

    ``within`` restricts the probe to the code of one module (``(path, call)``;
    call None: every call of it) or, as ``("", 0)``, to code outside every
    module (``compute_loss``). As a survey, :attr:`forward` is the first call
    there whose result is non-finite while its arguments are finite (any result,
    with ``passing_on``), and :attr:`backward` the first autograd node, in
    backward order, made by such a call that turns finite incoming gradients
    into non-finite outgoing ones. With a ``target`` only that call is judged,
    and a forward target stops the replay once it has run unless ``stop`` is
    false. Use as a context manager around the replay; :meth:`remove` drops
    the hooks.
    """

    def __init__(
        self,
        model: Any,
        *,
        batch_size: int,
        within: tuple[str, int | None],
        target: OpKey | None = None,
        passing_on: bool = False,
        capture: bool = False,
        backward: bool = True,
        stop: bool = True,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.within = within
        self._stop = stop
        self.model_calls_before: int | None = None  # capture: model calls done before it
        self.target = target
        self.passing_on = passing_on
        self.watch_nodes = backward and (target is None or target.backward)
        self.forward: Found | None = None
        self.backward: Found | None = None
        self.reproduced = False
        self.rows: frozenset[int] | None = None
        self.captured: Captured | None = None
        self._capture = capture and target is not None
        self._counts: dict[tuple[str, int, str], int] = {}
        self._calls = _CallStack(model)
        self._node_hooks: list[Any] = []

    def context(self) -> AbstractContextManager[Any]:
        """The mode itself: torch functions are seen only inside it (the forward)."""
        return self

    def remove(self) -> None:
        self._calls.remove()
        for handle in self._node_hooks:
            handle.remove()
        self._node_hooks.clear()

    def _here(self) -> tuple[str, int] | None:
        path, call = self._calls.stack[-1]
        want_path, want_call = self.within
        if want_call == 0:
            return (path, call) if call == 0 else None
        if call == 0 or path != want_path or want_call not in (None, call):
            return None
        return path, call

    def _judges(self, key: OpKey) -> bool:
        if self.target is None:
            return self.forward is None and self.backward is None
        return replace(self.target, backward=False) == key

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        here = self._here()
        name = function_name(func) if here is not None else None
        if here is None or name is None:
            return func(*args, **kwargs)
        count = self._counts[(*here, name)] = self._counts.get((*here, name), 0) + 1
        key = OpKey("function", here[0], here[1], name, count)
        if not self._judges(key):
            return func(*args, **kwargs)
        finite_in = all_finite((args, kwargs))
        # An in-place function rewrites its arguments: keep them as they came in.
        inputs = clone_batch((args, kwargs)) if _in_place(name) else (args, kwargs)
        autocast = autocast_state((args, kwargs))
        if self._capture:
            self.model_calls_before = self._calls.model_calls_done
            self.captured = Captured(
                key,
                function=func,
                args=clone_batch(args),
                kwargs=clone_batch(kwargs),
                requires_grad=requires_grad_flags((args, kwargs)),
                autocast=autocast,
                rng_state=torch.get_rng_state(),
            )
        out = func(*args, **kwargs)
        if self.captured is not None and self.captured.key == key:
            self.captured.output = clone_batch(out)
        if self.target is None or not self.target.backward:
            self._judge_forward(key, out, finite_in, inputs, autocast)
        if self.watch_nodes and finite_in:
            self._watch_nodes(key, out, inputs)
        return out

    def _judge_forward(
        self, key: OpKey, out: Any, finite_in: bool, inputs: Any, autocast: Any
    ) -> None:
        bad = not all_finite(out) and (finite_in or self.passing_on)
        rows = nonfinite_rows(out, self.batch_size)
        if self.target is not None:
            self.reproduced, self.rows = bad, rows
            if self._stop:
                raise Stop
            return
        if bad and self.forward is None:
            self.forward = Found(
                key, key.function, True, finite_in, _inputs_facts(inputs),
                _named_facts("output", out), (), rows, autocast,
            )  # fmt: skip

    def _watch_nodes(self, key: OpKey, out: Any, inputs: Any) -> None:
        nodes = {id(t.grad_fn): t.grad_fn for _, t in flatten(out, "") if t.grad_fn is not None}
        for node in nodes.values():
            self._node_hooks.append(node.register_hook(self._node_hook(key, inputs)))

    def _node_hook(self, key: OpKey, inputs: Any) -> Callable[[Any, Any], None]:
        backward_key = replace(key, backward=True)

        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if self.captured is not None and self.captured.key == key:
                self.captured.grad_output = clone_batch(grad_outputs)
            if not all_finite(grad_outputs) or all_finite(grad_inputs):
                return
            rows = nonfinite_rows(grad_inputs, self.batch_size)
            if self.target is not None:
                self.reproduced, self.rows = True, rows
            elif self.backward is None:
                self.backward = Found(
                    backward_key, key.function, True, True, _inputs_facts(inputs),
                    _named_facts("grad_input", grad_inputs),
                    _named_facts("grad_output", grad_outputs), rows, None,
                )  # fmt: skip

        return hook


# ---------------------------------------------------------------------- replay


@dataclass(frozen=True)
class FailingStep:
    """The failing step as the loop ran it, which every replay starts from.

    ``compute_loss(model, batch)`` is the loop's forward and loss; ``autocast``
    the autocast regions the loop opened around it (each with ``device_type``,
    ``dtype`` and optionally ``cache_enabled``, as the sentinel's ``Autocast``;
    none when compute_loss opens its own).
    ``scaler`` (a ``torch.amp.GradScaler``) or ``loss_scale`` (a static scale)
    scales the loss before backward as the loop did. ``rng_state`` is
    ``torch.get_rng_state()`` (or the sentinel's ``RngState``) taken before the
    forward: every replay starts from it. ``select(batch, examples)`` returns the batch restricted to the
    given indices; by default every tensor whose first dimension is the batch
    size is indexed along it. ``batch_size`` defaults to the first dimension of
    the batch's first tensor.
    """

    model: Any
    optimizer: Any
    batch: Any
    compute_loss: Callable[[Any, Any], Any]
    scaler: Any = None
    loss_scale: float | None = None
    rng_state: Any = None
    select: Callable[[Any, tuple[int, ...]], Any] | None = None
    batch_size: int | None = None
    autocast: tuple[Any, ...] = ()

    @classmethod
    def of_micro_batch(cls, objects: Any, micro: Any) -> FailingStep:
        """The step as a sentinel holds it: its step objects (model, optimizer,
        scaler, loss_scale, compute_loss) and one micro-batch (batch, rng,
        autocast)."""
        return cls(
            objects.model,
            objects.optimizer,
            micro.batch,
            objects.compute_loss,
            scaler=objects.scaler,
            loss_scale=objects.loss_scale,
            rng_state=micro.rng,
            autocast=tuple(micro.autocast),
        )


def _autocast(region: Any) -> AbstractContextManager[Any]:
    cache = getattr(region, "cache_enabled", None)
    return torch.autocast(region.device_type, dtype=region.dtype, cache_enabled=cache)


def resolved(step: FailingStep) -> FailingStep:
    """``step`` with its batch size and RNG state filled in (the current state when
    none was given: every later replay starts from the same one)."""
    size = step.batch_size
    if size is None:
        tensors = [t for _, t in flatten(step.batch, "")]
        if not tensors or tensors[0].dim() == 0:
            raise ShrinkError("the batch's first tensor has no batch dimension: pass batch_size")
        size = int(tensors[0].shape[0])
    if size < 1:
        raise ShrinkError("batch_size must be at least 1")
    state = step.rng_state
    if state is None:
        state = RngState.now()
    elif not isinstance(state, RngState):
        state = RngState(state)  # a torch.get_rng_state() tensor
    return replace(step, batch_size=size, rng_state=state)


def select_examples(batch: Any, examples: tuple[int, ...], size: int) -> Any:
    """``batch`` with every tensor whose first dimension is ``size`` indexed by
    ``examples``; other tensors and values as they are, containers rebuilt."""
    index = torch.tensor(examples, dtype=torch.long)
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == size:
            return batch.index_select(0, index.to(batch.device))
        return batch
    if isinstance(batch, Mapping):
        items = {k: select_examples(v, examples, size) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(select_examples(v, examples, size) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(select_examples(v, examples, size) for v in batch)
    return batch


def _prepared_copy(model: Any) -> Any:
    """A deep copy to replay on. In-place activations are switched off on the
    copy: same values, and full backward hooks refuse a module output that the
    next module rewrites in place."""
    replica = copy.deepcopy(model)
    for module in replica.modules():
        if getattr(module, "inplace", None) is True:
            module.inplace = False
    for param in replica.parameters():
        param.grad = None
    return replica


@dataclass(frozen=True, slots=True)
class Ran:
    """How far a replay went: the loss and gradients' finiteness (None: not
    reached), and whether a probe stopped it early."""

    loss_finite: bool | None
    grads_finite: bool | None
    stopped: bool


def _scaled(step: FailingStep, loss: Any) -> Any:
    if step.scaler is not None and step.scaler.is_enabled():
        return copy_scaler(step.scaler).scale(loss)
    return loss if step.loss_scale is None else loss * step.loss_scale


def replay(
    step: FailingStep,
    examples: tuple[int, ...] | None,
    probes: Callable[[Any], list[Any]],
    *,
    backward: bool,
) -> Ran:
    """One replay on a fresh copy of the model and a clone of the batch (or of
    the given examples), from the step's RNG state; the caller's model, batch
    and RNG are left as they were. ``probes(copy)`` attaches the probes
    (each probe's ``context()`` is entered around the forward only: function
    modes, the named-probe sink) and every one is removed afterwards,
    exceptions included. Backward runs, scaled as
    the loop scaled it, when asked and the loss is finite."""
    model = _prepared_copy(step.model)
    size = step.batch_size or 0
    if examples is None:
        batch = clone_batch(step.batch)
    elif step.select is not None:
        batch = clone_batch(step.select(step.batch, examples))
    else:
        batch = clone_batch(select_examples(step.batch, examples, size))
    attached = probes(model)
    loss_finite = grads_finite = None
    with torch.random.fork_rng(devices=cuda_devices()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ff]ull backward hook.*")
        step.rng_state.restore()
        try:
            with ExitStack() as around:
                for region in step.autocast:
                    around.enter_context(_autocast(region))
                for probe in attached:
                    around.enter_context(probe.context())
                loss = step.compute_loss(model, batch)
            loss_finite = all_finite(loss)
            if backward and loss_finite:
                _scaled(step, loss).backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                grads_finite = all_finite(grads)
        except Stop:
            return Ran(loss_finite, grads_finite, True)
        finally:
            for probe in attached:
                probe.remove()
    return Ran(loss_finite, grads_finite, False)
