"""How many sequences one whole forward can take before its attention maps outgrow the memory that is free.

A whole forward of ``b`` sequences of ``n`` tokens builds, in its attention, score maps of ``b · heads · n²``
entries, and TransformerLens keeps about :data:`MAPS_PER_FORWARD` of them alive at once (the scores, the masked
scores, the pattern): measured on SmolLM2 on the CPU, a forward's peak resident memory grew by 0.45 GiB at 1 × 2 048
tokens and 0.83 GiB at 2 × 2 048 for maps of 0.14 / 0.28 GiB (3.2× and 3.0×). At 8 192 tokens one sequence's maps
are 2.25 GiB, about 7 GiB in flight; nine stacked copies (an activation-patching forward that patches the heads of a
layer side by side, :func:`posgen_tl.patching.patch_sweep`) would need 63 GiB. :func:`sequences_per_forward` says how
many sequences fit in a share of the free memory, so that a pass that chooses its own batch (the replicas of a
patching forward) stays within it; a batch the user chose is left as chosen — unless even the whole free memory
could not hold its maps: then :func:`check_forward_fits` refuses it by name on the CPU, where the system's
out-of-memory killer would otherwise end the process (a notebook's kernel) without a word.
"""

from __future__ import annotations

from typing import Any

import torch

from posgen_tl.hooks.capture import model_device, probe_hooks

__all__ = ["FREE_SHARE", "MAPS_PER_FORWARD", "SUBSTITUTION_MAPS", "attention_bytes", "batch_that_fits",
           "check_forward_fits", "free_bytes", "logit_row_bytes", "sequences_per_forward", "sequences_within"]

#: float32 score-map-sized tensors alive at once in one layer's attention of a TransformerLens forward (measured
#: 3.0–3.2; 3.5 leaves a margin)
MAPS_PER_FORWARD = 3.5
#: score-map-sized float32 tensors per sequence that a logit substitution adds to a forward's own (the substituted
#: term's map, the logits it is written into, their masked copy and a temporary: counted from the code of
#: :func:`posgen_tl.hooks.logits.sufficiency_hooks`, an estimate rather than a measurement)
SUBSTITUTION_MAPS = 4
#: the share of the free memory a forward's attention maps may take (the rest: weights' working copies, activations,
#: the caller's tables, other processes' growth)
FREE_SHARE = 0.5


def free_bytes(device: torch.device | str) -> int | None:
    """The memory free for new tensors on ``device`` in bytes: a CUDA device's free memory
    (``torch.cuda.mem_get_info``), on the CPU Linux's ``MemAvailable`` (``/proc/meminfo``); ``None`` where it cannot
    be read (another system, another device kind)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def attention_bytes(n_heads: int, n: int, n_seq: int = 1, rows: int | None = None) -> int:
    """The bytes one layer's attention of a whole forward of ``n_seq`` sequences of ``n`` tokens keeps in flight:
    :data:`MAPS_PER_FORWARD` float32 maps of ``n_seq · n_heads · n²`` entries (``rows``: a forward run that many
    query positions at a time through the model's cache, ``n_seq · n_heads · rows · n``)."""
    return int(MAPS_PER_FORWARD * 4 * n_seq * n_heads * (n if rows is None else min(rows, n)) * n)


def logit_row_bytes(model: Any, rows: int) -> int:
    """The bytes per sequence of ``rows`` target rows of float32 logits over the model's vocabulary (``cfg.d_vocab``,
    0 where it has none), counted twice: the logits and their log-softmax, which a metric holds at once. A 262 144-token
    vocabulary makes them the larger part of a short forward's memory."""
    return 2 * 4 * max(0, int(rows)) * _vocab(model)


def sequences_within(model: Any, rows: int, n_seq: int, budget: int) -> int:
    """How many sequences of ``rows`` float32 logit rows over the model's vocabulary fit in ``budget`` bytes at once
    (at least one); all ``n_seq`` where the model has no ``cfg.d_vocab``."""
    vocab = _vocab(model)
    return max(1, budget // max(1, 4 * rows * vocab)) if vocab else n_seq


def _vocab(model: Any) -> int:
    """The model's vocabulary size (``cfg.d_vocab``; 0 where it has none)."""
    return int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 0)


def sequences_per_forward(model: Any, n: int, *, free: int | None = None, rows: int | None = None,
                          extra: int = 0) -> int | None:
    """How many sequences of ``n`` tokens one whole forward of ``model`` can take with its attention maps
    (:func:`attention_bytes`) within :data:`FREE_SHARE` of the free memory (``free`` bytes, default
    :func:`free_bytes` of the model's device); at least 1 (one sequence is the least a forward runs). ``None`` where
    the free memory cannot be read. ``rows``: as in :func:`attention_bytes`; ``extra``: bytes each sequence needs
    besides (its logits)."""
    if free is None:
        free = free_bytes(model_device(model))
    if free is None:
        return None
    per_seq = attention_bytes(probe_hooks(model)[0].n_heads, n, rows=rows) + max(0, int(extra))
    return max(1, int(FREE_SHARE * free) // per_seq)


def batch_that_fits(model: Any, n: int, n_seq: int, *, extra_maps: float = 0, extra: int = 0, unknown: int = 8,
                    free: int | None = None) -> int:
    """An automatic batch (an experiment's ``batch_size=0``): all ``n_seq`` sequences of ``n`` tokens in one forward
    where their attention maps (:func:`attention_bytes`), with ``extra_maps`` more maps and ``extra`` more bytes per
    sequence that the caller builds (a logit substitution's maps, the target's logits), fit :data:`FREE_SHARE` of the
    free memory (:func:`sequences_per_forward`), fewer where not (at least one); ``min(n_seq, unknown)`` where the free
    memory cannot be read (``free``: bytes, default :func:`free_bytes`)."""
    heads = probe_hooks(model)[0].n_heads
    fit = sequences_per_forward(model, n, free=free, extra=int(extra_maps * 4 * heads * n * n) + int(extra))
    return max(1, min(n_seq, unknown if fit is None else fit))


def check_forward_fits(model: Any, n: int, n_seq: int, what: str, *, free: int | None = None) -> None:
    """Raise MemoryError, naming the sizes, when a whole forward of ``n_seq`` sequences of ``n`` tokens on the CPU
    would keep more attention maps in flight (:func:`attention_bytes`) than the free memory (``free`` bytes, default
    :func:`free_bytes`) holds. Nothing on other devices (a GPU raises its own out-of-memory error, and its free memory
    does not count what torch's allocator holds for reuse) or where the free memory cannot be read."""
    if model_device(model).type != "cpu":
        return
    free = free_bytes("cpu") if free is None else free
    need = attention_bytes(probe_hooks(model)[0].n_heads, n, n_seq)
    if free is not None and need > free:
        gib = 2**30
        raise MemoryError(f"{what}: one whole forward of {n_seq} × {n} tokens keeps about {need / gib:.1f} GiB of "
                          f"attention maps in flight, and {free / gib:.1f} GiB of memory are free — run fewer "
                          "sequences per forward (batch_size, replicas) or shorter texts, or a chunked forward "
                          "(chunk=, where the pass offers one; see docs/limits.md)")
