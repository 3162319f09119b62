"""Layers stacked on the head axis: on a GPU an analysis that runs the same small operations on every layer pays a
kernel launch per operation whatever its size, so layers that share shapes, positions and rope are processed together
as ONE capture whose heads are the layers' heads (:func:`stack_captures`), a few at a time (:func:`stack_size`;
:class:`Stacker` is the per-layer callback that gathers them; ``stream_qk(stack=…)`` hands an analysis such stacks,
each checked once). On the CPU one layer at a time is as fast and keeps
memory one layer's. Used by the decomposition's scoring and the feature statistics (whose accumulators of a stack are cut back per
layer by :func:`posgen_tl.maths.pattern_frames.split_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from posgen_tl.hooks.capture import QKCapture, model_device, probe_hooks
from posgen_tl.hooks.memory import free_bytes

__all__ = ["CPU_BLOCK_BYTES", "MIN_BLOCK", "STACK_ENTRIES", "Stacker", "cache_rows", "stack_captures", "stack_size"]

#: on a GPU, the largest stack of layers processed together: its largest float32 buffer (the decomposition keeps several
#: map-sized ones: W, the target's padded copy, ``f + g``; its factors about three of their largest) holds at most
#: this many entries (4 GiB), and 1/32 of free memory — on an 80 GB card the latter binds (≈ 2.3 GiB); on an H200
#: SmolLM2's maps at 4 × 2 048 tokens, one sequence per batch, stack 28 layers (2³⁰ / (9 heads · 2 048²); 7 with four
#: sequences in a batch): a GPU peak of 13.8 GiB above its start at 6524d49, about 3.5 of those maps
STACK_ENTRIES = 2**30

#: on the CPU an analysis that builds logit maps builds them a block of query rows at a time, each block's float32 maps
#: within this many bytes: they stay in the processor's cache through the block's several passes (SmolLM2, 4 × 512
#: tokens, 2 threads, one layer: the decomposition's moments 36 ms in blocks of 64–128 rows against 55 ms for the whole
#: maps; the feature statistics' logit spread 12 ms against 28 ms from block-Gram sums)
CPU_BLOCK_BYTES = 6 * 2**20
MIN_BLOCK = 32


def cache_rows(maps: int, n: int) -> int:
    """Query rows per block of ``maps`` float32 logit maps of ``n`` keys on the CPU: as many as keep a block within
    :data:`CPU_BLOCK_BYTES` (at least :data:`MIN_BLOCK`), evened out over the ``n`` rows (no short last block)."""
    want = max(MIN_BLOCK, CPU_BLOCK_BYTES // max(1, 4 * maps * n))
    n_blocks = -(-n // want)
    return -(-n // n_blocks)


def stack_size(model: Any, per_head: int, n_layers: int) -> int:
    """How many layers an analysis processes at once (stacked on the head axis, :func:`stack_captures`): 1 on the
    CPU (a layer is computed as fast alone; memory stays one layer's), else as many of ``n_layers`` as keep a
    stack's largest float32 buffer — ``per_head`` entries per head, e.g. ``batch·n²`` for a logit map — within
    :data:`STACK_ENTRIES` entries and 1/32 of the device's free memory: on a GPU the time of small per-layer
    operations is kernel launches, the same for one layer or thirty."""
    dev = model_device(model)
    if dev.type == "cpu":
        return 1
    per_layer = max(1, per_head * probe_hooks(model)[0].n_heads)
    budget = STACK_ENTRIES
    free = free_bytes(dev) if dev.type == "cuda" else None
    if free is not None:
        budget = min(budget, free // (4 * 32))
    return max(1, min(n_layers, budget // per_layer))


def _stack_key(c: QKCapture) -> tuple:
    """What layers stacked together must share: shapes, the positions and the rope — the same objects (a model's
    :class:`~posgen_tl.maths.rope.RopeSpec` gives layers with equal ropes one object; a rope made per forward, as
    dynamic NTK's, is never stacked)."""
    return tuple(c.q.shape), tuple(c.k.shape), id(c.positions), id(c.rope)


def stack_captures(cs: Sequence[QKCapture]) -> QKCapture:
    """Layers ``cs`` (same batch, shapes and rope: :func:`_stack_key`) as ONE capture whose heads are the layers'
    heads in order: ``q``/``rot_q`` ``[batch, pos, layers·heads, d_head]``, ``k``/``rot_k`` ``[batch, pos,
    layers·kv_heads, d_head]`` — query head ``L·H + h`` reads kv-head ``L·G + h // (H/G)``, the grouping every
    scoring function already uses. ``layer`` is the first layer's, ``layers`` names them all; no scores (W is
    recomputed)."""
    c0 = cs[0]

    def cat(name: str) -> Tensor:
        return torch.cat([getattr(c, name) for c in cs], dim=2)

    return QKCapture(layer=c0.layer, q=cat("q"), k=cat("k"), rot_q=cat("rot_q"), rot_k=cat("rot_k"),
                     positions=c0.positions, rope=c0.rope, rot_source=c0.rot_source, batch_index=c0.batch_index,
                     seq_offset=c0.seq_offset, layers=tuple(c.layer for c in cs))


class Stacker:
    """The per-layer callback that gathers layers into stacks: hands ``score`` ONE capture per stack (the layers
    stacked by :func:`stack_captures`, or the layer itself when alone), ``group`` layers at a time — a stack closes
    early at a change of shape, positions or rope (:func:`_stack_key`) and at ``last_layer``. ``check(capture,
    parts)``, if given, runs on each stack before ``score`` sees it (:func:`posgen_tl.hooks.stream.stream_qk` checks
    a stack once instead of each layer)."""

    def __init__(self, score: Any, group: int, last_layer: int, check: Any = None) -> None:
        self.score, self.group, self.last, self.check = score, max(1, group), last_layer, check
        self.pending = list[QKCapture]()

    def __call__(self, c: QKCapture) -> None:
        if self.pending and _stack_key(self.pending[0]) != _stack_key(c):
            self.flush()
        self.pending.append(c)
        if len(self.pending) >= self.group or c.layer == self.last:
            self.flush()

    def flush(self) -> None:
        """Check and score the layers gathered so far (none: nothing)."""
        cs, self.pending = self.pending, []
        if not cs:
            return
        c = stack_captures(cs) if len(cs) > 1 else cs[0]
        if self.check is not None:
            self.check(c, cs)
        self.score(c)
