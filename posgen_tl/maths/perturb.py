"""Position-tolerance perturbations (docs/method.md §4), as pure functions.

T1 (transposition) :func:`adjacent_swap_permutation` + :func:`apply_permutation`; T2 (index
perturbation) :func:`position_ids_for_permutation`; T3 (distance cap) :func:`capped_scores`;
read-out :func:`nll_from_logits`, :func:`span_mean`. Statistics (bootstrap, slopes, tests) live
in :mod:`posgen_tl.stats.inference`.

Permutation convention: ``new_sequence = old_sequence[perm]`` (``perm[n]`` is the OLD index of
the token at NEW index ``n``); the token at old index ``t`` sits at new index ``perm_inv[t]``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.maths.rope import LayerRope, expand_kv, rotate, scores_from_rotated

__all__ = [
    "adjacent_swap_permutation", "word_units", "apply_permutation", "inverse_permutation",
    "position_ids_for_permutation", "swap_seed", "nll_from_logits", "row_nll", "span_mean", "capped_scores",
    "gap_position_ids",
]  # fmt: skip

_WORD_START_CHARS = ("Ġ", "▁", "Ċ", "\n")


# ----------------------------------------------------------------------------- T1 / T2


def _runs(units: Tensor) -> list[tuple[int, int]]:
    """Maximal runs ``[s, e)`` of equal consecutive values of a 1-D tensor."""
    change = (units[1:] != units[:-1]).nonzero().flatten() + 1
    bounds = [0, *change.tolist(), units.shape[0]]
    return list(zip(bounds[:-1], bounds[1:]))


def _sample_disjoint_pairs(n_items: int, k: int, gen: torch.Generator) -> list[int]:
    """Uniformly random set of ``k`` disjoint adjacent pairs ``(i, i+1)`` among ``n_items``.

    Bijection: a configuration is a line of ``k`` dominoes and ``n_items − 2k`` singletons,
    i.e. ``n_items − k`` objects of which ``k`` are dominoes — choose those uniformly.
    Returns the sorted left indices ``i``.
    """
    if k == 0:
        return []
    n_obj = n_items - k
    chosen = set(torch.randperm(n_obj, generator=gen)[:k].tolist())
    lefts, item = [], 0
    for obj in range(n_obj):
        if obj in chosen:
            lefts.append(item)
            item += 2
        else:
            item += 1
    return lefts


def adjacent_swap_permutation(
    n_pos: int, frac: float, *, start: int = 0, stop: int | None = None, seed: int = 0,
    units: Int[Tensor, "pos"] | None = None,
) -> Int[Tensor, "pos"]:  # fmt: skip
    """T1: swap a fraction of adjacent token (or word) pairs inside the window ``[start, stop)``.

    Definition. Let the window hold ``L`` items (tokens, or words when ``units`` is given).
    There are ``L − 1`` adjacent pairs. The number of swaps is
    ``k = min(round(frac · (L − 1)), L // 2)``; the ``k`` swapped pairs are pairwise
    DISJOINT (no item is moved twice, so the swaps commute and each item moves by exactly
    one slot) and drawn uniformly among all sets of ``k`` disjoint adjacent pairs, with a
    ``torch.Generator`` seeded by ``seed`` (deterministic per seed). Hence ``2k`` items move:
    the moved fraction of the window is ``2k / L ≈ 2·frac`` for small ``frac``. Above
    ``frac ≈ 0.5`` the count saturates at ``L // 2`` (a warning is issued). ``frac = 0``
    gives the identity. Positions outside the window (e.g. BOS at 0, the target span at the
    end) never move.

    Word level (``units`` given: one word id per token of the whole sequence, e.g. from
    :func:`word_units`): words are the maximal runs of equal ``units`` values, cut at the
    window edges (a word straddling ``start``/``stop`` contributes only its in-window part).
    A swap exchanges two adjacent whole token groups; each word keeps its tokens contiguous
    and in order.

    Returns:
        ``perm``, ``Int[Tensor, "pos"]`` (int64, length ``n_pos``) with
        ``new_sequence = old_sequence[perm]``.

    Raises:
        ValueError: ``frac`` outside ``[0, 1]``, an empty or out-of-range window, or
            ``units`` of the wrong length.
    """
    if not (0.0 <= frac <= 1.0) or math.isnan(frac):
        raise ValueError(f"frac must be in [0, 1], got {frac}")
    stop = n_pos if stop is None else stop
    if not (0 <= start < stop <= n_pos):
        raise ValueError(f"empty or out-of-range swap window [{start}, {stop}) for n_pos={n_pos}")
    if units is not None:
        units = torch.as_tensor(units).flatten()
        if units.shape[0] != n_pos:
            raise ValueError(f"units has {units.shape[0]} entries, expected n_pos={n_pos}")
        groups = [(start + s, start + e) for s, e in _runs(units[start:stop].cpu())]
    else:
        groups = [(t, t + 1) for t in range(start, stop)]
    n_items = len(groups)
    k = round(frac * (n_items - 1)) if n_items > 1 else 0
    if k > n_items // 2:
        msg = f"frac={frac}: {k} disjoint adjacent swaps do not fit in {n_items} items"
        warnings.warn(f"{msg}; using {n_items // 2}", stacklevel=2)
        k = n_items // 2
    gen = torch.Generator().manual_seed(int(seed))
    order = list(range(n_items))
    for i in _sample_disjoint_pairs(n_items, k, gen):
        order[i], order[i + 1] = order[i + 1], order[i]
    perm = torch.arange(n_pos)
    if units is None:
        perm[start:stop] = start + torch.tensor(order, dtype=torch.long)
    else:
        perm[start:stop] = torch.cat([torch.arange(*groups[g]) for g in order])
    return perm


def word_units(tokens_text: list[str], *, special_tokens: Iterable[str] = ()) -> Int[Tensor, "pos"]:
    """Word id per token, from the tokens' strings (as the tokenizer spells them).

    A new word starts at token 0 and at every token whose first character is whitespace
    (``str.isspace``), ``'Ġ'`` (GPT-2/BPE space), ``'▁'`` (SentencePiece space), ``'Ċ'``
    (GPT-2 newline byte) or ``'\\n'``. Any token in ``special_tokens`` (e.g. ``"<s>"``,
    ``"<bos>"``) is a word on its own, and the token after it starts a new word. Empty
    strings continue the current word. Punctuation does not start a word.

    Returns:
        ``Int[Tensor, "pos"]`` (int64), nondecreasing, starting at 0.
    """
    special = set(special_tokens)
    ids, cur, prev_special = [], -1, False
    for i, tok in enumerate(tokens_text):
        spaced = len(tok) > 0 and (tok[0].isspace() or tok[0] in _WORD_START_CHARS)
        cur += int(i == 0 or prev_special or tok in special or spaced)
        ids.append(cur)
        prev_special = tok in special
    return torch.tensor(ids, dtype=torch.long)


def apply_permutation(
    tokens: Int[Tensor, "*batch pos"], perm: Int[Tensor, "pos"]
) -> Int[Tensor, "*batch pos"]:
    """Reorder the last axis: returns ``tokens[..., perm]`` (same shape)."""
    return tokens[..., perm.to(tokens.device)]


def inverse_permutation(perm: Int[Tensor, "pos"]) -> Int[Tensor, "pos"]:
    """``perm_inv`` with ``perm_inv[perm[n]] = n``: the new index of the token at old index t."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype)
    return inv


def position_ids_for_permutation(perm: Int[Tensor, "pos"]) -> Int[Tensor, "pos"]:
    """T2 position ids: tokens stay in place, token ``t`` gets position ``perm_inv[t]``.

    Under T1 the token at old index ``t`` sits at new index ``perm_inv[t]``; T2 keeps the
    original token order and gives it that position id instead (``position_ids[t] =
    perm_inv[t]``). With RoPE the attention logits depend on positions only through the
    rotations, so for the SAME pre-rotation q/k per token

        scores_T2 = scores_T1[perm_inv][:, perm_inv]        (before masking)

    where ``scores_T1`` is computed on the permuted tokens with positions ``arange`` and
    ``scores_T2`` on the original tokens with positions ``perm_inv``. The two differ only in
    the causal mask: the model masks by SEQUENCE index (original order under T2, permuted
    order under T1), so for a swapped pair the earlier token sees the later one under
    exactly one of T1/T2. Queries after the window (the target span) see the same keys
    under both; in layer 0 their logits match exactly, deeper layers inherit the mask
    difference through the context's residual stream.

    Returns:
        ``Int[Tensor, "pos"]`` position ids (same dtype as ``perm``).
    """
    return inverse_permutation(perm)


# ----------------------------------------------------------------------------- read-out


def swap_seed(base_seed: int, doc: int, start: int, seed: int) -> int:
    """Generator seed of one sequence's swaps (docs/method.md §4: independent per (sequence, seed)).

    A hash (:class:`numpy.random.SeedSequence`) of (base seed, the sequence's document id, its
    window start, the seed index): the same sequence gets the same swaps under every condition
    and in T1 and T2 (pairing); different sequences get different swaps. Returns a 63-bit int.
    """
    ss = np.random.SeedSequence([int(base_seed) % 2**32, int(doc) % 2**32, int(start) % 2**32, int(seed) % 2**32])
    return int(ss.generate_state(1, dtype=np.uint64)[0]) >> 1


def nll_from_logits(
    logits: Float[Tensor, "batch pos d_vocab"], tokens: Int[Tensor, "batch pos"], *,
    max_chunk_bytes: int = 256 * 2**20,
) -> Float[Tensor, "batch pos_minus_1"]:  # fmt: skip
    """Next-token NLL: ``nll[b, t] = −log softmax(logits[b, t])[tokens[b, t + 1]]``.

    The log-softmax is computed in float32 (float64 if the input is float64) even for
    bf16/fp16 logits, over chunks of positions so that at most ``max_chunk_bytes`` of
    up-cast logits exist at once (a 262k vocabulary does not blow memory).

    Returns:
        ``Float[Tensor, "batch pos-1"]`` in float32 (float64 for float64 input).
    """
    b, n, v = logits.shape
    if tokens.shape != (b, n):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} != logits' {(b, n)}")
    return row_nll(logits[:, : n - 1], tokens[:, 1:], max_chunk_bytes=max_chunk_bytes)


def row_nll(
    logits: Float[Tensor, "batch row d_vocab"], targets: Int[Tensor, "batch row"], *,
    max_chunk_bytes: int = 256 * 2**20,
) -> Float[Tensor, "batch row"]:  # fmt: skip
    """``nll[b, r] = −log softmax(logits[b, r])[targets[b, r]]``: each row scored against its own target (nothing
    shifted) — :func:`nll_from_logits` is this with ``targets = tokens[:, 1:]`` on all rows but the last. Float32 at
    least, ``max_chunk_bytes`` of up-cast logits at a time.

    Returns:
        ``Float[Tensor, "batch row"]`` in float32 (float64 for float64 input)."""
    b, n, v = logits.shape
    if targets.shape != (b, n):
        raise ValueError(f"targets shape {tuple(targets.shape)} != the logits' rows {(b, n)}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    per_pos = max(1, b * v * torch.empty((), dtype=dtype).element_size())
    chunk = max(1, max_chunk_bytes // per_pos)
    targets = targets.to(logits.device)
    out = []
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        lp = logits[:, s:e].to(dtype)
        lse = torch.logsumexp(lp, dim=-1)
        picked = lp.gather(-1, targets[:, s:e, None]).squeeze(-1)
        out.append(lse - picked)
    if not out:
        return torch.empty(b, 0, dtype=dtype, device=logits.device)
    return torch.cat(out, dim=1)


def span_mean(
    nll: Float[Tensor, "batch pos_minus_1"], start: int, stop: int | None = None, *,
    coords: Literal["tokens", "nll"] = "tokens",
) -> Float[Tensor, "batch"]:  # fmt: skip
    """Mean NLL over a span, per sequence.

    ``coords="tokens"`` (default): ``[start, stop)`` are positions of the PREDICTED tokens in
    the token sequence (e.g. the target span ``[N − 64, N)``); token ``t`` is predicted by
    ``nll[:, t − 1]``, so this averages ``nll[:, start − 1 : stop − 1]`` (``start ≥ 1``;
    ``stop=None`` means the end). ``coords="nll"``: ``[start, stop)`` index ``nll`` directly.

    Returns:
        ``Float[Tensor, "batch"]``.
    """
    n = nll.shape[-1]
    if coords == "tokens":
        stop = n + 1 if stop is None else stop
        lo, hi = start - 1, stop - 1
    elif coords == "nll":
        lo, hi = start, n if stop is None else stop
    else:
        raise ValueError(f"coords must be 'tokens' or 'nll', got {coords!r}")
    if not (0 <= lo < hi <= n):
        raise ValueError(f"span [{start}, {stop}) ({coords} coords) is empty or outside nll[{n}]")
    return nll[..., lo:hi].mean(dim=-1)


# ----------------------------------------------------------------------------- T3


def capped_scores(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    rope: LayerRope,
    cap: int,
    positions: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """T3: causal attention logits with the relative distance capped (LM-Infinite style).

    ``q``, ``k`` are PRE-rotation (``hook_q``/``hook_k``; ``k`` with fewer kv heads is
    expanded to query heads). With ``p`` = ``positions`` (default ``arange``) and
    ``d = min(p_i − p_j, cap)`` for a key index ``j ≤ i``:

        W[i, j] = s · a² · q_iᵀ R_{−d} k_j   (+ s · q_i·k_j on the pass-through dims)

    In the band picture ``W = s·a²·Re Σ_m q_m e^{i·d·θ_m} conj(k_m)``. Computed with two
    matmuls: entries with ``p_i − p_j ≤ cap`` use the ordinary rotation (q at ``p_i``, k at
    ``p_j``; bit-identical to the uncapped model logits), entries beyond use q rotated by
    ``cap`` and k by 0; ``torch.where`` selects per entry. Work ``O(N² · d_head)``.
    Keys ``j > i`` (sequence index) are ``-inf``; so are keys outside ``rope.sliding_window``
    (``i − j ≥ window``) when the layer has one. The dtype of ``q`` is kept.

    Returns:
        ``Float[Tensor, "batch head_index query_pos key_pos"]``.
    """
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    b, n = q.shape[0], q.shape[1]
    k = expand_kv(k, q.shape[-2])
    if positions is None:
        positions = torch.arange(n, device=q.device)
    positions = torch.as_tensor(positions, device=q.device)
    if positions.ndim == 1:
        positions = positions.expand(b, n)
    s = rope.score_scale
    near = scores_from_rotated(rotate(q, positions, rope), rotate(k, positions, rope), s)
    q_cap = rotate(q, torch.full_like(positions, cap), rope)
    far = scores_from_rotated(q_cap, rotate(k, torch.zeros_like(positions), rope), s)
    dist = positions[:, None, :, None] - positions[:, None, None, :]  # b 1 q k
    w = torch.where(dist <= cap, near, far)
    idx = torch.arange(n, device=q.device)
    rel = idx[:, None] - idx[None, :]
    masked = rel < 0
    if rope.sliding_window is not None:
        masked = masked | (rel >= rope.sliding_window)
    return w.masked_fill(masked, float("-inf"))


# ----------------------------------------------------------------------------- gap probe (§7)


def gap_position_ids(prefix_len: int, suffix_len: int, gap: int, *, offset: int = 0) -> Int[Tensor, "pos"]:
    """Position ids of a prefix ‖ suffix sequence whose suffix is moved ``gap`` positions away.

    Prefix ids ``offset .. offset + |P| − 1``; suffix ids ``offset + |P| + gap .. offset + |P| + gap + |S| − 1``.
    With RoPE the logit of query ``i`` and key ``j`` depends on the ids only through
    ``p_i − p_j``: distances inside the prefix and inside the suffix are unchanged, every
    prefix→suffix distance grows by exactly ``gap``. ``offset`` shifts ALL ids and therefore
    changes no distance (the model is invariant to it up to float rounding of the angles).

    Returns:
        ``Int[Tensor, "pos"]`` int64 of length ``prefix_len + suffix_len``.

    Raises:
        ValueError: negative ``gap``/``offset``, or an empty prefix/suffix.
    """
    for name, v in (("gap", gap), ("offset", offset)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    if prefix_len < 1 or suffix_len < 1:
        raise ValueError(f"prefix_len and suffix_len must be >= 1, got {prefix_len}, {suffix_len}")
    ids = torch.arange(prefix_len + suffix_len, dtype=torch.long) + int(offset)
    ids[prefix_len:] += int(gap)
    return ids
