"""The host heap during a streamed pass on the CPU (glibc only; elsewhere every function is a no-op).

A forward pass on the CPU allocates and frees its ``[batch, heads, n, n]`` score maps and other large activations
once per layer. glibc serves blocks above its ``mmap`` threshold (at most 32 MiB by default) with fresh ``mmap``
pages and unmaps them on ``free``, so every such tensor is page-faulted in again, zero-filled by the kernel, at every
layer: measured on SmolLM2 at 4 × 512 tokens, 2 threads, a plain forward took 4.08 s with glibc's defaults and 3.36 s
with large blocks kept in the heap. :func:`large_blocks_kept` does that for the duration of a pass (and puts glibc's
own settings back after it); :class:`BatchTrim` returns what the pass freed to the system after a batch once the
process's resident memory has grown past its first batch's by a margin, so resident memory does not grow with the
number of batches — and a batch whose memory is reused is not page-faulted in again (each trim hands the next batch's
working set back to the kernel, which zero-fills it again on first touch: SmolLM2 at 8 × 512 tokens, a decomposition
took 395 000 page faults with a trim after every batch and 270 000 with this rule, `benchmarks/bench_steps.py`).
:func:`passes_share_heap` extends both to a run of many passes (an experiment): the passes keep the heap between them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["BatchTrim", "large_blocks_kept", "passes_share_heap", "release_freed_memory", "resident_bytes"]

_LIBC: Any = None
_DEPTH = [0]  # nested passes: only the outermost sets and restores
_BETWEEN: list[BatchTrim | None] = [None]  # inside :func:`passes_share_heap`: the BatchTrim a pass asks at its end
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
#: glibc's own upper values of its dynamic thresholds on 64-bit systems (what a process that freed a tensor of 32 MiB
#: or more runs with): restored after a pass
GLIBC_MMAP_MAX, GLIBC_TRIM_MAX = 32 * 2**20, 64 * 2**20
#: during a pass: blocks up to 64 MiB from the heap (a SmolLM2 layer's scores of 4 × 512 tokens are 36 MiB), never
#: trimmed by ``free`` (the pass trims once per batch). Not more: a heap that keeps bigger blocks fragments — one
#: sufficiency pass of 4 × 2048 tokens peaked 2 264 MiB above its start with 1 GiB, 1 013 MiB with 64 MiB, 1 051 without
KEEP_MMAP, KEEP_TRIM = 64 * 2**20, 2**31 - 1
#: :class:`BatchTrim` trims once the resident memory at a batch's end exceeds the first batch's by this fraction of it,
#: and by at least :data:`TRIM_MIN_GROWTH` bytes
TRIM_GROWTH, TRIM_MIN_GROWTH = 0.25, 128 * 2**20


def _libc() -> Any:
    """glibc (``malloc_trim`` and ``mallopt``), or ``False`` where there is none (macOS, Windows, musl)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes  # noqa: PLC0415

            lib = ctypes.CDLL("libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else False
        except OSError:
            _LIBC = False
    return _LIBC


def release_freed_memory() -> bool:
    """Return freed heap pages to the operating system (glibc's ``malloc_trim(0)``); ``True`` if it ran.

    Called by :class:`BatchTrim` after a batch on the CPU. glibc keeps freed blocks in its heap
    (below its ``mmap`` threshold, and all of them during :func:`large_blocks_kept`), and the holes between
    long-lived small objects are not reused by later requests of other sizes, so a streaming run's resident memory
    otherwise grows with the number of batches (measured: 625 → 1 317 MiB from 4 to 32 sequences of 512 tokens).
    A no-op (``False``) where there is no glibc."""
    lib = _libc()
    if lib is False:
        return False
    lib.malloc_trim(0)
    return True


def resident_bytes() -> int | None:
    """The process's resident memory in bytes (Linux ``/proc/self/statm``), or ``None`` where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class BatchTrim:
    """Called after each batch of a streamed pass (:func:`posgen_tl.hooks.stream.stream_qk`): returns the freed heap to
    the system (:func:`release_freed_memory`) when the resident memory at this batch's end exceeds the first batch's end
    by more than ``TRIM_GROWTH`` of it (at least :data:`TRIM_MIN_GROWTH`), else leaves it for the next batch to reuse.
    A batch needs its working set during the batch either way; between batches the resident memory stays within the
    first batch's level plus the margin, whatever the number of batches, and the peak rises by what the kept heap's
    holes cost (SmolLM2, 32 × 512 tokens, a decomposition: 659 → 734 MiB above its start). Where the resident memory
    cannot be read, every batch trims. Returns (each call) whether it trimmed.

    ``growth`` / ``min_growth``: the margin (:data:`TRIM_GROWTH`, :data:`TRIM_MIN_GROWTH` by default). A chunked pass
    over one long sequence asks after each LAYER with ``growth=0`` (:func:`posgen_tl.hooks.stream.stream_qk`): a layer's
    scoring there takes seconds, beside which a trim costs little, and a layer's freed tables (of other sizes at every
    layer) are not left in the heap for the rest of the pass."""

    def __init__(self, growth: float = TRIM_GROWTH, min_growth: int = TRIM_MIN_GROWTH) -> None:
        self.first: int | None = None
        self.growth, self.min_growth = growth, min_growth

    def __call__(self) -> bool:
        rss = resident_bytes()
        if rss is None:
            return release_freed_memory()
        if self.first is None:
            self.first = rss
            return False
        if rss <= self.first + max(self.min_growth, self.growth * self.first):
            return False
        return release_freed_memory()


@contextlib.contextmanager
def large_blocks_kept() -> Iterator[bool]:
    """For the duration of the block, glibc serves blocks up to 64 MiB from its heap and ``free`` does not trim it —
    a freed score map is reused by the next layer's instead of being unmapped and page-faulted in again (the caller
    trims once per batch with :func:`release_freed_memory`). Yields whether glibc took the settings; afterwards the
    thresholds are glibc's own dynamic maxima again (32 MiB, 64 MiB) and the freed heap is returned to the system."""
    with _kept(between=None) as ok:
        yield ok


@contextlib.contextmanager
def passes_share_heap() -> Iterator[bool]:
    """For a run of many passes on the CPU (an experiment's ``run``: hundreds of forwards at a report's sizes): large
    blocks kept in the heap for the whole run (:func:`large_blocks_kept`), and a pass inside it does not hand its heap
    back to the system at its end — the next pass reuses it instead of page-faulting and zero-filling the same memory
    again (SmolLM2, the report's causal stage: 3.8 million page faults, 12 s of system time) — unless the resident
    memory has grown past the first pass's end by :class:`BatchTrim`'s margin (25 %, at least 128 MiB). One trim at the
    run's end. Yields whether glibc took the settings; a no-op where there is no glibc. Nested in a pass or another
    run, it is that pass or run's."""
    with _kept(between=BatchTrim()) as ok:
        yield ok


@contextlib.contextmanager
def _kept(between: BatchTrim | None) -> Iterator[bool]:
    """The settings for the outermost context; ``between``: what each nested context asks at its end (``None``:
    nothing — it leaves the heap to the outermost)."""
    lib = _libc()
    outer = _DEPTH[0] == 0
    ok = lib is not False and (not outer or bool(lib.mallopt(M_MMAP_THRESHOLD, KEEP_MMAP))
                               and bool(lib.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM)))
    _DEPTH[0] += 1
    if outer:
        _BETWEEN[0] = between
    try:
        yield ok
    finally:
        _DEPTH[0] -= 1
        if outer:
            _BETWEEN[0] = None
            if lib is not False:
                lib.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)
                lib.mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_MAX)
                lib.malloc_trim(0)
        elif _BETWEEN[0] is not None:  # a pass's end inside a run: trims only past the margin
            _BETWEEN[0]()
