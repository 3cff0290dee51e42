"""Room for a replay on a full device: the real gradients and optimizer state set
aside on the host while the replay runs on copies, and put back bit for bit.

The default replay keeps the real state where it is and copies the model, the
optimizer state and the gradients beside it (about 9x the parameter bytes for
bf16 parameters under Adam, with the replay's own gradients and update). The
``offload`` path first copies each storage of the real gradients and optimizer
state to host memory (pinned where CUDA is there) and frees it on its device
by resizing the storage to zero bytes (the tensor objects, their shapes and
every view stay as they are), builds the copy's optimizer state from those host
bytes, keeps the parameters before the update on the host, and after the replay
gives each storage its bytes back. The copies then stand in the room the real
state left: the replay takes about one more parameter copy on the device than
the training step had, with the forward's activations and the optimizer's
temporaries (0.62x the parameter bytes measured for a stack of linear layers
under float32 AdamW, where the default path takes 5.5x), the rest on the host.

``auto`` takes the offload path when the device's free memory (what the driver
reports free plus what torch's caching allocator holds unused) is less than
the default path needs, with a margin; on the CPU the default path is taken
(host and device are one memory there).
"""

from __future__ import annotations

import copy
import gc
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

ReplayMemory = Literal["auto", "device", "offload"]
REPLAY_MEMORY = ("auto", "device", "offload")

# What the default path may take of the device's free memory: the rest is room
# for the forward's activations and the allocator's fragmentation.
_MARGIN = 0.8


def host_buffer(nbytes: int, pinned: bool) -> Any:
    """``nbytes`` of host memory as a uint8 tensor, pinned when asked (a device
    copy from pinned memory is a DMA, without a staging copy)."""
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def _state_tensors(optimizer: Any) -> Iterator[Any]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def default_path_bytes(model: Any, optimizer: Any) -> int:
    """What the default replay adds on the device: the model copied, the optimizer
    state copied, the copy's gradients, the parameters before the update and
    the update in float32."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    model_bytes = sum(_nbytes(t) for t in model.state_dict().values())
    state = sum(_nbytes(t) for t in _state_tensors(optimizer))
    grads = sum(_nbytes(p) for p in params)
    updates = sum(p.numel() * 4 for p in params)
    return int(model_bytes + state + grads + grads + updates)


def _device_free(device: Any) -> int | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def choose_path(model: Any, optimizer: Any, asked: ReplayMemory) -> Literal["device", "offload"]:
    """``asked``, or for ``auto`` the path the device's free memory allows."""
    if asked != "auto":
        return asked
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        return "device"
    free = _device_free(params[0].device)
    if free is None:
        return "device"
    return "device" if default_path_bytes(model, optimizer) <= _MARGIN * free else "offload"


@dataclass
class _Stored:
    storage: Any  # the live UntypedStorage, resized to 0 while set aside
    host: Any  # its bytes on the host
    nbytes: int


def _storage_key(tensor: Any) -> int:
    # The storage's own address: the same object before and after a resize.
    return int(tensor.untyped_storage()._cdata)


@dataclass
class SetAside:
    """The real gradients' and optimizer state's storages, each once, on the host."""

    pinned: bool = False
    stored: dict[int, _Stored] = field(default_factory=dict)

    def put_away(self, tensors: list[Any]) -> None:
        for tensor in tensors:
            storage, key = tensor.untyped_storage(), _storage_key(tensor)
            if key in self.stored or storage.nbytes() == 0 or not storage.resizable():
                continue  # one torch cannot resize (numpy viewed it, on the CPU) stays
            host = host_buffer(storage.nbytes(), self.pinned)
            host.untyped_storage().copy_(storage)
            self.stored[key] = _Stored(storage, host, storage.nbytes())
            storage.resize_(0)

    def read(self, tensor: Any) -> Any:
        """A fresh copy of ``tensor`` on its device, from its host bytes when it was
        set aside."""
        item = self.stored.get(_storage_key(tensor))
        if item is None:
            return tensor.detach().clone()
        view = torch.empty(0, dtype=tensor.dtype, device="cpu")
        view.set_(
            item.host.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        made = torch.empty_strided(
            tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device
        )
        return made.copy_(view)

    def put_back(self) -> None:
        """Every storage given its bytes again, as they were (blocking copies)."""
        for item in self.stored.values():
            item.storage.resize_(item.nbytes)
            item.storage.copy_(item.host.untyped_storage())
        self.stored.clear()


@dataclass
class Room:
    """The path a replay takes, and what it set aside to take it."""

    path: Literal["device", "offload"]
    aside: SetAside | None = None

    def optimizer_state(self, optimizer: Any) -> dict[str, Any] | None:
        """On the offload path, the optimizer's state_dict with fresh tensors on
        their devices, filled from the host bytes (the live ones hold none now);
        None on the default path (the state_dict is deep-copied)."""
        aside = self.aside
        if aside is None:
            return None

        def fresh(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return aside.read(value)
            if isinstance(value, dict):
                return {k: fresh(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return type(value)(fresh(v) for v in value)
            return copy.deepcopy(value)

        made: dict[str, Any] = fresh(optimizer.state_dict())
        return made

    def keep(self, tensor: Any) -> Any:
        """A copy of ``tensor`` to compare with later: on its device by default, on
        the host on the offload path."""
        if self.aside is None:
            return tensor.detach().clone()
        kept = host_buffer(_nbytes(tensor), self.aside.pinned).view(tensor.dtype)
        return kept.view(tensor.shape).copy_(tensor.detach())


@contextmanager
def room_for_replay(model: Any, optimizer: Any, asked: ReplayMemory) -> Iterator[Room]:
    """The path for a replay of ``model`` and ``optimizer``; on the offload path
    the real gradients and optimizer state are on the host until the block
    ends, however it ends, and then back on their devices bit for bit."""
    path = choose_path(model, optimizer, asked)
    if path == "device":
        yield Room("device")
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    aside = SetAside(pinned=torch.cuda.is_available())
    try:
        aside.put_away([p.grad for p in params if p.grad is not None])
        aside.put_away(list(_state_tensors(optimizer)))
        yield Room("offload", aside)
    except BaseException as error:
        # The traceback's frames hold the replay's copies: free them before the
        # real state takes its room back.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        gc.collect()
        aside.put_back()
