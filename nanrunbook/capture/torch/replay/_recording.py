"""What the forward shows: leaf-module outputs and named probes, in execution order.

``probe("attn.scores", x)`` marks a tensor made by functional code (attention's
``exp``/``sum``, masked pooling) that no module boundary shows. It returns ``x``
unchanged and costs one global lookup while nothing listens; a sentinel's
sampled step records its extremes, and a replay captures its bytes into the
forward stage between the module outputs around it.

Hooks are removed when the ``with`` block ends, whatever ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from nanrunbook.capture.torch._convert import safetensors_dtype, tensor_to_raw
from nanrunbook.capture.torch._copies import flatten
from nanrunbook.capture.torch.replay._binding import add_weight

__all__ = ["ExtremesSampler", "ForwardCapture", "OutputExtremes", "leaf", "listening", "probe"]

T = TypeVar("T")
Sink = Callable[[str, Any], None]
_SINK: Sink | None = None  # who listens to probe(); None: probes cost nothing


def probe(name: str, value: T) -> T:
    """Return ``value`` unchanged; while a sentinel samples or replays a step, its
    tensors are observed under ``name`` at this point of the forward."""
    sink = _SINK
    if sink is not None:
        sink(name, value)
    return value


@contextmanager
def listening(sink: Sink) -> Iterator[None]:
    global _SINK
    previous, _SINK = _SINK, sink
    try:
        yield
    finally:
        _SINK = previous


def leaf(path: str, module: Any) -> bool:
    """The default choice of modules: those without children."""
    return next(iter(module.children()), None) is None


class _Observer:
    """Forward hooks on the chosen modules and the probe sink, feeding ``observe``
    with (name, tensor, description) in execution order."""

    def __init__(self, model: Any, choose: Callable[[str, Any], bool], prefix: str) -> None:
        self._model, self._choose, self._prefix = model, choose, prefix
        self._calls: dict[str, int] = {}

    def observe(self, name: str, tensor: Any, description: str) -> None:
        raise NotImplementedError

    def _name(self, kind: str, key: str) -> str:
        calls = self._calls[f"{kind}/{key}"] = self._calls.get(f"{kind}/{key}", 0) + 1
        return f"{kind}/{self._prefix}{key}" + (f"@call{calls}" if calls > 1 else "")

    def _module_hook(self, path: str) -> Callable[[Any, Any, Any], None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            base = self._name("act", path or "(root)")
            description = f"{path or '(root)'} output ({type(module).__name__})"
            for suffix, tensor in flatten(output, ""):
                self.observe(f"{base}/{suffix}" if suffix else base, tensor, description)

        return hook

    def _probe(self, name: str, value: Any) -> None:
        base = self._name("probe", name)
        for suffix, tensor in flatten(value, ""):
            self.observe(f"{base}/{suffix}" if suffix else base, tensor, f"probe({name!r})")

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handles = []
        try:
            for path, module in self._model.named_modules():
                if self._choose(path, module):
                    handles.append(module.register_forward_hook(self._module_hook(path)))
            with listening(self._probe):
                yield
        finally:
            for handle in handles:
                handle.remove()


class ForwardCapture(_Observer):
    """Captures outputs as host bytes (an in-place op later in the forward must not
    alter them), for the forward stage of a bundle."""

    def __init__(self, model: Any, choose: Callable[[str, Any], bool], prefix: str = "") -> None:
        super().__init__(model, choose, prefix)
        self.captured: list[tuple[str, Any, str]] = []
        self.weights: dict[str, int] = {}  # floating elements per dtype

    def observe(self, name: str, tensor: Any, description: str) -> None:
        self.captured.append((name, tensor_to_raw(tensor), description))
        add_weight(self.weights, tensor)


class ExtremesSampler(_Observer):
    """Each floating output's largest magnitude, kept on its device (no host sync):
    non-finite when the tensor holds a NaN or infinity."""

    def __init__(self, model: Any, choose: Callable[[str, Any], bool]) -> None:
        super().__init__(model, choose, "")
        self.names: list[str] = []
        self.dtypes: list[str] = []
        self.values: list[Any] = []

    def observe(self, name: str, tensor: Any, description: str) -> None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return
        dtype = safetensors_dtype(tensor.dtype)
        if dtype is None:
            return
        with torch.no_grad():
            self.values.append(tensor.detach().abs().amax().float())
        self.names.append(name)
        self.dtypes.append(dtype)


_REDUCED = (torch.float16, torch.bfloat16)


class OutputExtremes:
    """Every step, the largest magnitude of the model's floating outputs in a
    reduced precision (float16, bfloat16: autocast's), kept on the device for
    the step's one read: one ``amax`` per output, a hook on the root module
    only, so activations creeping to the dtype's max are seen between sampled
    steps. Outputs in float32 cost a dtype check."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.dtypes: list[str] = []
        self.values: list[Any] = []

    def _hook(self, module: Any, inputs: Any, output: Any) -> None:
        for _, tensor in flatten(output, ""):
            if isinstance(tensor, torch.Tensor) and tensor.dtype in _REDUCED and tensor.numel():
                with torch.no_grad():
                    self.values.append(tensor.detach().abs().amax().float())
                self.dtypes.append(str(safetensors_dtype(tensor.dtype)))

    @contextmanager
    def hooked(self) -> Iterator[None]:
        handle = self._model.register_forward_hook(self._hook)
        try:
            yield
        finally:
            handle.remove()
