"""Peak bytes that torch's allocator handed out while a function ran, from the
profiler's allocation events (each carries the allocator's running total), so
that memory can be measured on the CPU too, where torch keeps no peak counter.

Used by the memory tests and ``make bench-sentinel``; the profiler's overhead
makes it a measuring tool, never something a training step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Peak", "peak_allocated"]


@dataclass(frozen=True)
class Peak:
    """``device``: the highest net bytes allocated on the measured device (the
    allocations made before the call and freed during it count negative);
    ``host``: the share of that moment held in the buffers named host."""

    device: int
    host: int
    result: Any


def peak_allocated(
    run: Callable[[], Any],
    *,
    prepare: Callable[[], Any] | None = None,
    device: str = "cpu",
    host: Callable[[], Iterable[tuple[int, int]]] = tuple,
) -> Peak:
    """Run ``prepare`` then ``run`` under the profiler and return the peak net
    allocation on ``device`` while ``run`` ran, over the level at its start.
    What ``run`` frees counts only when the profiler saw it allocated, so the
    state it may free is made in ``prepare``. ``host()`` names the data pointers
    and sizes of buffers that count as host memory (on the CPU the host and the device are
    one memory): their bytes are taken out of the device figure, reported apart."""
    from torch._C._profiler import _EventType
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    marker = "nanrunbook.measured"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if prepare is not None:
            prepare()
        with record_function(marker):
            result = run()
    host_buffers = set(host())
    events: list[tuple[int, int, int]] = []
    window = (0, 0)
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.name == marker:
            window = (node.start_time_ns, node.end_time_ns)
        elif node.tag == _EventType.Allocation and node.extra_fields.device.type == device:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
    events.sort(key=lambda event: event[0])
    total = held = 0
    base: tuple[int, int] | None = None
    best_device = best_host = 0
    live_host: set[int] = set()  # a freed buffer's address may be reused by the device
    for when, size, pointer in events:
        is_host = pointer in live_host or (size > 0 and (pointer, size) in host_buffers)
        if is_host:
            (live_host.add if size > 0 else live_host.discard)(pointer)
        if when > window[0] and base is None:
            base = (total, held)
        total += size
        held += size if is_host else 0
        if base is not None and when <= window[1]:
            device_now = (total - held) - (base[0] - base[1])
            if device_now > best_device:
                best_device, best_host = device_now, held - base[1]
    return Peak(best_device, best_host, result)
