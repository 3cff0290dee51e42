"""Copies of real training state taken before a step, restored in place on a hold.

:class:`Buffers` (every step, cheap for most models): the model's buffers as
they were before the forward, so that a held step leaves BatchNorm's running
statistics (and any other buffer the forward writes) as they were.

:class:`StateSnapshot` (opt-in): parameters, optimizer state and hyperparameters,
scheduler and GradScaler state, taken just before each update, so that a
non-finite update found after ``step()`` is rolled back. It costs one copy of
the parameters and of the optimizer state in memory (3x the parameters for
Adam) and that much copying per step.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch

__all__ = ["Buffers", "StateSnapshot"]


class Buffers:
    """A model's buffers, copied now; :meth:`restore` writes them back in place."""

    def __init__(self, model: Any) -> None:
        self._pairs = [(b, b.detach().clone()) for b in model.buffers()]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self._pairs:
                live.copy_(saved)


def _restore_scaler(scaler: Any, scale: Any, tracker: Any) -> None:
    with torch.no_grad():
        if scale is not None:
            scaler._scale.copy_(scale)
        if tracker is not None:
            scaler._growth_tracker.copy_(tracker)
    reset_scaler_step(scaler)


def reset_scaler_step(scaler: Any) -> None:
    """Forget a GradScaler's per-step bookkeeping (unscale_ done, found_inf), as
    ``update()`` does, without changing its scale or growth tracker."""
    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


class StateSnapshot:
    """Parameters, optimizer, scheduler and scaler state, copied into buffers that
    are allocated once and reused (no host synchronisation)."""

    def __init__(self, optimizer: Any, scheduler: Any, scaler: Any) -> None:
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self._params = [torch.empty_like(p) for p in self.params]
        self._state: list[dict[str, Any]] = [{} for _ in self.params]
        self._groups: list[dict[str, Any]] = []
        self._scheduler: dict[str, Any] | None = None
        self._scale: Any = None
        self._tracker: Any = None
        self.taken = False

    @property
    def nbytes(self) -> int:
        tensors = [*self._params, *(v for s in self._state for v in s.values())]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def take(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._params, [p.detach() for p in self.params])
            for index, param in enumerate(self.params):
                self._state[index] = self._copy_state(
                    self._state[index], self.optimizer.state.get(param, {})
                )
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

    @staticmethod
    def _copy_state(saved: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in live.items():
            out[key] = (
                _clone_into(saved.get(key), value)
                if isinstance(value, torch.Tensor)
                else copy.deepcopy(value)
            )
        return out

    def restore(self) -> None:
        """Write the snapshot back in place: the same tensor objects, their bits."""
        if not self.taken:
            raise RuntimeError("no snapshot was taken")
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self._params)
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
                    live[key] = value.clone() if isinstance(value, torch.Tensor) else value
            self.optimizer.state[param] = live
        for group, saved_group in zip(self.optimizer.param_groups, self._groups, strict=True):
            group.update(copy.deepcopy(saved_group))
        if self.scheduler is not None and self._scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self._scheduler))
        if self.scaler is not None and self.scaler.is_enabled():
            _restore_scaler(self.scaler, self._scale, self._tracker)


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
