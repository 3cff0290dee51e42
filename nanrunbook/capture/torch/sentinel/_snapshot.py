"""Copies of real training state taken before a step, restored in place on a hold.

:class:`Buffers` (every step, cheap for most models): the model's buffers as
they were before the forward, so that a held step leaves BatchNorm's running
statistics (and any other buffer the forward writes) as they were.

:class:`StateSnapshot` (opt-in): parameters, optimizer state and hyperparameters,
scheduler and GradScaler state, taken just before each update, so that a
non-finite update found after ``step()`` is rolled back. It costs one copy of
the parameters and of the optimizer state in memory (3x the parameters for
Adam) and that much copying per step: on the device by default, or on the host
(``where="host"``: pinned memory where CUDA is there, the copies made on a side
stream that the update then waits for on the device, without a host sync; on
the CPU it is the same memory either way).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch

__all__ = ["SNAPSHOT_PLACES", "Buffers", "SnapshotPlace", "StateSnapshot"]

SnapshotPlace = Literal["device", "host"]
SNAPSHOT_PLACES = ("device", "host")


class Buffers:
    """A model's buffers, copied now; :meth:`restore` writes them back in place."""

    def __init__(self, model: Any) -> None:
        self._pairs = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self._pairs:
                live.copy_(saved)


def _restore_scaler(scaler: Any, optimizer: Any, scale: Any, tracker: Any) -> None:
    with torch.no_grad():
        if scale is not None:
            scaler._scale.copy_(scale)
        if tracker is not None:
            scaler._growth_tracker.copy_(tracker)
    reset_scaler_step(scaler, optimizer)


def reset_scaler_step(scaler: Any, optimizer: Any = None) -> None:
    """Forget a GradScaler's per-step bookkeeping (unscale_ done, found_inf)
    without changing its scale or growth tracker: for ``optimizer`` only, or for
    every optimizer, as ``update()`` does. A scaler shared by several optimizers
    keeps the others' bookkeeping: wiping an optimizer that was already unscaled
    would have ``scaler.step`` unscale its gradients a second time."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    if optimizer is None:
        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    else:
        scaler._per_optimizer_states[id(optimizer)] = _refresh_per_optimizer_state()


class StateSnapshot:
    """Parameters, optimizer, scheduler and scaler state, copied into buffers that
    are allocated once and reused (no host synchronisation)."""

    def __init__(
        self, optimizer: Any, scheduler: Any, scaler: Any, where: SnapshotPlace = "device"
    ) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.where = where
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        from nanrunbook.capture.torch._shards import local

        # The tensors whose bits are copied: FSDP2's DTensor parameters by their
        # local shards (no foreach copy takes DTensors), any other the parameter.
        self._values = [local(p) for p in self.params]
        on_cuda = where == "host" and any(p.device.type == "cuda" for p in self.params)
        self._pinned = on_cuda
        self._stream: Any = torch.cuda.Stream() if on_cuda else None  # type: ignore[no-untyped-call]
        self._params = [self._buffer_like(p) for p in self._values]
        self._state: list[dict[str, Any]] = [{} for _ in self.params]
        self._devices: dict[tuple[str, int], Any] = {}  # (key, id of param) -> its device
        self._groups: list[dict[str, Any]] = []
        self._scheduler: dict[str, Any] | None = None
        self._scale: Any = None
        self._tracker: Any = None
        self.taken = False

    @property
    def nbytes(self) -> int:
        tensors = [*self._params, *(v for s in self._state for v in s.values())]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def _buffer_like(self, tensor: Any) -> Any:
        if self.where == "device":
            return torch.empty_like(tensor)
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)

    def _copy_into(self, buffer: Any, value: Any) -> Any:
        """``value`` copied into ``buffer`` when it fits, else into a new one."""
        if value is None:
            return None
        fits = (
            isinstance(buffer, torch.Tensor)
            and buffer.shape == value.shape
            and buffer.dtype == value.dtype
            and (self.where == "host" or buffer.device == value.device)
        )
        if not fits:
            buffer = self._buffer_like(value)
        with torch.no_grad():
            buffer.copy_(value.detach(), non_blocking=self._pinned)
        return buffer

    def _side(self) -> AbstractContextManager[Any]:
        if self._stream is None:
            return nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream())  # the values are made
        return torch.cuda.stream(self._stream)

    def take(self) -> None:
        with torch.no_grad(), self._side():
            if self.where == "device":
                torch._foreach_copy_(self._params, [p.detach() for p in self._values])
            else:
                for buffer, param in zip(self._params, self._values, strict=True):
                    buffer.copy_(param.detach(), non_blocking=self._pinned)
            for index, param in enumerate(self.params):
                live = self.optimizer.state.get(param, {})
                self._state[index] = self._copy_state(self._state[index], live)
                for key, value in live.items():
                    if isinstance(value, torch.Tensor):
                        self._devices[key, id(param)] = value.device
        if self._stream is not None:
            # The update writes what is being copied: it waits for the copies on
            # the device (no host sync).
            torch.cuda.current_stream().wait_stream(self._stream)
        self._groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        if self.scheduler is not None:
            self._scheduler = copy.deepcopy(self.scheduler.state_dict())
        if self.scaler is not None and self.scaler.is_enabled():
            self._scale = _clone_into(self._scale, self.scaler._scale)
            self._tracker = _clone_into(self._tracker, self.scaler._growth_tracker)
        self.taken = True

    def _copy_state(self, saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in live.items():
            out[key] = (
                self._copy_into(saved.get(key), value)
                if isinstance(value, torch.Tensor)
                else copy.deepcopy(value)
            )
        return out

    def restore(self) -> None:
        """Write the snapshot back in place: the same tensor objects, their bits."""
        if not self.taken:
            raise RuntimeError("no snapshot was taken")
        if self._stream is not None:
            self._stream.synchronize()  # a hold: the copies must have landed
        with torch.no_grad():
            if self.where == "device":
                torch._foreach_copy_([p.data for p in self._values], self._params)
            else:
                for param, buffer in zip(self._values, self._params, strict=True):
                    param.data.copy_(buffer)
        for param, saved in zip(self.params, self._state, strict=True):
            live = self.optimizer.state.get(param, {})
            for key in [k for k in live if k not in saved]:
                del live[key]
            if not saved:
                self.optimizer.state.pop(param, None)
                continue
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and isinstance(live.get(key), torch.Tensor):
                    with torch.no_grad():
                        live[key].copy_(value)
                else:
                    live[key] = (
                        value.to(self._devices[key, id(param)], copy=True)
                        if isinstance(value, torch.Tensor)
                        else value
                    )
            self.optimizer.state[param] = live
        for group, saved_group in zip(self.optimizer.param_groups, self._groups, strict=True):
            group.update(copy.deepcopy(saved_group))
        if self.scheduler is not None and self._scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self._scheduler))
        if self.scaler is not None and self.scaler.is_enabled():
            _restore_scaler(self.scaler, self.optimizer, self._scale, self._tracker)


def _clone_into(buffer: Any, value: Any) -> Any:
    """``value`` copied into ``buffer`` when shapes and dtypes match, else a clone."""
    if value is None:
        return None
    if (
        isinstance(buffer, torch.Tensor)
        and buffer.shape == value.shape
        and buffer.dtype == value.dtype
        and buffer.device == value.device
    ):
        with torch.no_grad():
            buffer.copy_(value)
        return buffer
    return value.detach().clone()
