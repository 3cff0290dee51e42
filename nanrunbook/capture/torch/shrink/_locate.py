"""Where a replayed step first goes non-finite: observers attached to a model copy.

Two observers, each in one of three roles: a *survey* finds the first
operation that makes a non-finite value from finite inputs; a *watch* follows
one known operation through a replay of a smaller batch (did it still go
non-finite, and in which rows); a *capture* keeps what the fixture needs of it
(its state, exact inputs, autocast and incoming gradients).

* :class:`ModuleObserver` hooks every module: forward (pre and post), full
  backward (pre and post) and the module's own parameters' gradients; and it
  hears named probes (``probe("attn.weights", x)``) in execution order.
* :class:`FunctionObserver` is a ``TorchFunctionMode``: every torch function the
  code calls directly (not the ones inside it), and the autograd nodes they
  create, so a NaN made by functional code between modules, or by the loss, is
  located at its function.

Both raise :class:`~nanrunbook.capture.torch.shrink._failing_step.Stop` to end a watched
replay early. Needs torch; imported only by the shrink.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from nanrunbook.capture.torch._copies import clone_batch, flatten
from nanrunbook.capture.torch.replay import listening
from nanrunbook.capture.torch.shrink._failing_step import Stop
from nanrunbook.capture.torch.shrink._finiteness import (
    all_finite,
    autocast_state,
    inputs_facts,
    named_facts,
    nonfinite_rows,
    requires_grad_flags,
    tensor_finite,
)
from nanrunbook.capture.torch.shrink._results import OpKey, TensorFacts

__all__ = ["CapturedCall", "Found", "FunctionObserver", "ModuleObserver", "function_name"]


_IN_PLACE_OPERATORS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or")
) | {"__ixor__", "__ilshift__", "__irshift__"}


def _grad_fns(value: Any) -> set[int]:
    """The autograd nodes behind the tensors of ``value``, by id."""
    return {id(t.grad_fn) for _, t in flatten(value, "") if t.grad_fn is not None}


def _in_place(name: str) -> bool:
    last = name.rpartition(".")[2]
    return (last.endswith("_") and not last.endswith("__")) or last in _IN_PLACE_OPERATORS


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
class CapturedCall:
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


class ModuleObserver:
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
        self._kept: dict[int, CapturedCall] = {}
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
        self._state_ok: dict[int, bool] = {}  # id of a parameter or buffer -> finite
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

    def captured_call(self, call: int | None = None) -> CapturedCall | None:
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
        """The module's parameters and buffers finite; each tensor checked once
        (enclosing modules share them), as they were when first seen."""
        for tensor in module.state_dict(keep_vars=True).values():
            if id(tensor) not in self._state_ok:
                self._state_ok[id(tensor)] = tensor_finite(tensor)
            if not self._state_ok[id(tensor)]:
                return False
        return True

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
                self._kept[call] = CapturedCall(
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
                    inputs_facts((args, kwargs)),
                    named_facts("output", output),
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
                () if inputs is None else inputs_facts(inputs),
                named_facts("value", value),
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
            () if inputs is None else inputs_facts(inputs),
            named_facts("grad", grads),
            named_facts("grad_output", grad_output),
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


class FunctionObserver(TorchFunctionMode):
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
        self.captured: CapturedCall | None = None
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
            self.captured = CapturedCall(
                key,
                function=func,
                args=clone_batch(args),
                kwargs=clone_batch(kwargs),
                requires_grad=requires_grad_flags((args, kwargs)),
                autocast=autocast,
                rng_state=torch.get_rng_state(),
            )
        earlier = _grad_fns((args, kwargs)) if self.watch_nodes else set()
        out = func(*args, **kwargs)
        if self.captured is not None and self.captured.key == key:
            self.captured.output = clone_batch(out)
        if not self.watch_nodes:  # a backward survey: a forward inf later masked is no answer
            self._judge_forward(key, out, finite_in, inputs, autocast)
        if self.watch_nodes and finite_in:
            self._watch_nodes(key, out, inputs, earlier)
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
                key=key,
                type_name=key.function,
                leaf=True,
                made_here=finite_in,
                inputs=inputs_facts(inputs),
                outputs=named_facts("output", out),
                grad_outputs=(),
                rows=rows,
                autocast=autocast,
            )

    def _watch_nodes(self, key: OpKey, out: Any, inputs: Any, earlier: set[int]) -> None:
        """Hooks on every autograd node the call made (a function such as
        cross_entropy under autocast makes several: the cast back to fp16 can
        be the one that overflows), found from its outputs back to the nodes
        that were there before it."""
        outputs = [t.grad_fn for _, t in flatten(out, "") if t.grad_fn is not None]
        made: dict[int, Any] = {}
        queue = list(outputs)
        while queue:
            node = queue.pop()
            if node is None or id(node) in made or id(node) in earlier:
                continue
            if type(node).__name__ == "AccumulateGrad":  # a leaf's: never made by a call
                continue
            made[id(node)] = node
            queue.extend(parent for parent, _ in node.next_functions)
        ends = {id(node) for node in outputs}
        for node in made.values():
            hook = self._node_hook(key, inputs, id(node) in ends)
            self._node_hooks.append(node.register_hook(hook))

    def _node_hook(self, key: OpKey, inputs: Any, end: bool) -> Callable[[Any, Any], None]:
        backward_key = replace(key, backward=True)

        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if end and self.captured is not None and self.captured.key == key:
                self.captured.grad_output = clone_batch(grad_outputs)
            if not all_finite(grad_outputs) or all_finite(grad_inputs):
                return
            rows = nonfinite_rows(grad_inputs, self.batch_size)
            if self.target is not None:
                self.reproduced, self.rows = True, rows
            elif self.backward is None:
                self.backward = Found(
                    key=backward_key,
                    type_name=key.function,
                    leaf=True,
                    made_here=True,
                    inputs=inputs_facts(inputs),
                    outputs=named_facts("grad_input", grad_inputs),
                    grad_outputs=named_facts("grad_output", grad_outputs),
                    rows=rows,
                    autocast=None,
                )

        return hook
