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
    run: Callable[[], Any], *, device: str = "cpu", host: Callable[[], Iterable[int]] = tuple
) -> Peak:
    """Run ``run`` under the profiler and return its peak net allocation on
    ``device``. ``host()`` names the data pointers of buffers that count as host
    memory (on the CPU the host and the device are one memory): their bytes are
    taken out of the device figure and reported apart."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = run()
    host_pointers = set(host())
    events: list[tuple[int, int, bool]] = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr in host_pointers))
    events.sort(key=lambda event: event[0])
    total = held = best_device = best_host = 0
    for _, size, is_host in events:
        total += size
        held += size if is_host else 0
        if total - held > best_device:
            best_device, best_host = total - held, held
    return Peak(best_device, best_host, result)
