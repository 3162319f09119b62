"""Memory a call holds, from the CPU profiler's allocations and frees (tests that check a memory budget)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, int]:
    """``(peak, largest)``: the most bytes of CPU tensors ``fn()`` holds at once above its start (the profiler's
    allocations and frees, in order), and its largest single allocation."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = largest = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
        largest = max(largest, e.self_cpu_memory_usage)
    return peak, largest
