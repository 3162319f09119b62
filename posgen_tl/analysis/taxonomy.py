"""Head taxonomy runner (METHOD.md §6): positional vs symbolic heads, per band, tied to D3.

For each prompt, two adjacent context blocks ``A = [a0, a0+L)`` and ``B = [a0+L, a0+2L)``
trade places (:func:`posgen_tl.heads.block_swap_permutation`). The original and swapped
prompts run in the SAME forward batch (interleaved ``orig0, swap0, orig1, swap1, …``), so
one streamed capture holds both members of every pair and the scores are computed inside
the forward: memory stays one layer of one batch. For query rows ``i ≥ b1`` (fixed by the
swap) the attention pattern — softmax of the recomputed logits ``s·rot_q·rot_k`` over the
causal mask, sliding window included — is compared before/after the swap over the moved
region (:func:`posgen_tl.heads.positional_symbolic_scores`): ``positional`` = attention
stays with the positions, ``symbolic`` = attention follows the tokens. The same is done for
every RoPE band taken alone as a 2-D head (:func:`band_logits` → :func:`band_patterns`).

Per head we also report frequency usage (energy share of pre-rotation q and k per band,
:class:`posgen_tl.features.BandStats`, and its :func:`frequency_centroid`; 0 = fastest
band) and the **positional share** ``V(f)/(V(f)+V(g))`` of the D3 split
(:func:`posgen_tl.decompose.d3_split` with ``k̄`` from the same prompts, sink excluded):
how much of the head's within-row logit variance is carried by the positional term ``f``.
A first streamed pass collects the BandStats (hence ``k̄``); the second, paired pass
computes the scores and the D3 split.

Caveats. A uniform row over the moved region scores 1 on both axes (label 'mixed'): near-
uniform heads (e.g. a random-init twin) sit on the diagonal. On a sliding-window layer
whose window is shorter than the distance to the moved tokens, the swap can push tokens out
of sight: such rows favour 'positional' by construction (rows that see nothing of the
region are skipped; a head that sees none gives NaN).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy.stats import spearmanr
from torch import Tensor

from posgen_tl.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.corpus import corpus_tokens
from posgen_tl.decompose import causal_mask as fit_mask
from posgen_tl.decompose import d3_split
from posgen_tl.features import BandStats
from posgen_tl.heads import (
    band_logits,
    band_patterns,
    block_swap_permutation,
    causal_mask,
    frequency_centroid,
    pass_logits,
    positional_share,
    positional_symbolic_scores,
    taxonomy_label,
)
from posgen_tl.models import random_twin

__all__ = [
    "block_layout",
    "head_taxonomy",
    "head_table",
    "head_taxonomy_with_twin",
    "taxonomy_agreement",
    "HEAD_COLUMNS",
]

HEAD_COLUMNS = [
    "model", "twin", "layer", "kind", "head", "positional", "symbolic", "positional_std",
    "symbolic_std", "label", "n_prompts", "q_centroid", "k_centroid", "positional_share",
    "positional_share_std",
]


def block_layout(n_pos: int, block_len: int, sink: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """Blocks ``A = [a0, a0+L)``, ``B = [a0+L, a0+2L)`` with ``a0 = max(sink, n_pos//2 − L)``.

    The swapped region ends at ``b1 = a0 + 2L``, leaving the query rows ``[b1, n_pos)``.

    Raises:
        ValueError: if no query row is left after the blocks.
    """
    a0 = max(sink, n_pos // 2 - block_len)
    b1 = a0 + 2 * block_len
    if block_len < 1 or b1 >= n_pos:
        raise ValueError(f"block_len={block_len} leaves no query row after the blocks (n_pos={n_pos}, sink={sink})")
    return (a0, a0 + block_len), (a0 + block_len, b1)


def _square_view(
    rows: Float[Tensor, "*batch n_q key_pos"], region: slice
) -> Float[Tensor, "*batch m m"]:
    """Embed ``rows[..., region]`` in a square map so the moved region and the query rows
    share one index space: indices ``[0, L)`` = region keys, ``[L, L+n_q)`` = query rows."""
    part = rows[..., region]
    n_q, n_l = part.shape[-2], part.shape[-1]
    out = part.new_zeros(*part.shape[:-2], n_l + n_q, n_l + n_q)
    out[..., n_l:, :n_l] = part
    return out


class _Acc:
    """Per-layer per-prompt result arrays (small: prompts × heads × (1 + bands))."""

    def __init__(self, n_prompts: int, n_heads: int, n_bands: int) -> None:
        shape = (n_prompts, n_heads, 1 + n_bands)
        self.pos = np.full(shape, np.nan)
        self.sym = np.full(shape, np.nan)
        self.share = np.full((n_prompts, n_heads), np.nan)


def _tokens(model: Any, corpus: Any, n_prompts: int, seq_len: int) -> Int[Tensor, "batch pos"]:
    if isinstance(corpus, Tensor):
        return corpus[:n_prompts].long()
    return corpus_tokens(model, corpus, seq_len=seq_len, n_seq=n_prompts)


def _stats_pass(model, tokens, layers, sink, batch_size, progress) -> dict[int, tuple[BandStats, BandStats]]:
    """Pass 1: BandStats of pre-rotation q and k per layer (positions ``≥ sink``)."""
    stats: dict[int, tuple[BandStats, BandStats]] = {}

    def on_cap(c: QKCapture) -> None:
        r = c.rope
        if c.layer not in stats:
            stats[c.layer] = (
                BandStats(c.q.shape[-2], c.q.shape[-1], r.rotary_dim, r.layout),
                BandStats(c.k.shape[-2], c.k.shape[-1], r.rotary_dim, r.layout),
            )
        keep = c.positions >= sink
        stats[c.layer][0].update(c.q, keep)
        stats[c.layer][1].update(c.k, keep)

    stream_qk(model, tokens, on_cap, layers, batch_size=batch_size,
              progress="taxonomy stats" if progress else False)
    return stats


def _pair_scores(c: QKCapture, perm: Tensor, a0: int, b1: int, sink: int, k_mean: Tensor, acc: _Acc) -> None:
    """Scores of one paired batch (even rows original, odd rows swapped) for one layer."""
    rope = c.rope
    n = c.rot_q.shape[1]
    rows = torch.arange(b1, n)
    n_l = b1 - a0
    mask = causal_mask(n, sliding_window=rope.sliding_window)[rows]  # softmax mask of the query rows
    perm_sq = torch.cat([perm[a0:b1] - a0, torch.arange(n_l, n_l + len(rows))])
    q_sq, k_sq = torch.arange(n_l, n_l + len(rows)), torch.arange(n_l)
    rq, rk = c.rot_q[:, b1:], c.rot_k_expanded()
    p0 = c.seq_offset // 2
    n_b = c.rot_q.shape[0] // 2
    for h in range(c.n_heads):
        hq, hk = rq[:, :, h : h + 1], rk[:, :, h : h + 1]
        bl = band_logits(hq, hk, rope)[:, 0]  # [2b, band, n_q, n]
        full = bl.sum(1) + pass_logits(hq, hk, rope)[:, 0]  # [2b, n_q, n]
        pats = torch.cat([band_patterns(full, mask)[:, None], band_patterns(bl, mask)], 1)
        sq = _square_view(pats, slice(a0, b1))  # [2b, 1+band, m, m]
        pos, sym = positional_symbolic_scores(sq[0::2], sq[1::2], perm_sq, q_sq, k_sq)
        acc.pos[p0 : p0 + n_b, h] = pos.double().cpu().numpy()
        acc.sym[p0 : p0 + n_b, h] = sym.double().cpu().numpy()
    orig = slice(0, None, 2)
    d3 = d3_split(c.q[orig], c.k[orig], k_mean, c.positions[orig], rope)
    share = positional_share(d3.f, d3.g, fit_mask(n, sink=sink, sliding_window=rope.sliding_window))
    acc.share[p0 : p0 + n_b] = share.cpu().numpy()


def _mean_std(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        n = np.isfinite(x).sum(0)
        return np.nanmean(x, 0), np.where(n > 1, np.nanstd(x, 0, ddof=1), np.nan), n


def head_taxonomy(
    model: Any,
    corpus: Any = None,
    *,
    layers: Sequence[int] | None = None,
    n_prompts: int = 8,
    seq_len: int = 256,
    block_len: int = 32,
    sink: int = 1,
    batch_size: int = 4,
    model_label: str | None = None,
    twin_label: str = "trained",
    margin: float = 0.1,
    progress: bool = True,
) -> pd.DataFrame:
    """Positional/symbolic scores per head and per band, frequency usage and D3 positional share.

    ``corpus`` is a token tensor ``[batch, pos]`` (its first ``n_prompts`` rows are used) or
    anything :func:`posgen_tl.corpus.corpus_tokens` takes (``None`` = default prose).
    Blocks from :func:`block_layout`; ``batch_size`` prompts (= ``2·batch_size`` sequences
    with their swaps) per forward. Scores are averaged over prompts (std over prompts).

    Returns:
        Tidy DataFrame, one row per ``(layer, head, band)`` with ``band = −1`` for the full
        head: ``model, twin, layer, kind, head, band, theta, positional, symbolic,
        positional_std, symbolic_std, label, n_prompts, q_energy_share, k_energy_share,
        q_centroid, k_centroid, positional_share, positional_share_std``. Band rows carry
        ``theta`` (rad/position) and the q/k energy shares of that band (k of the head's
        kv group); the full-head row carries centroids and positional share (NaN elsewhere).
    """
    spec, _ = probe_hooks(model)
    tokens = _tokens(model, corpus, n_prompts, seq_len)
    n_p, n = tokens.shape
    layers = list(range(spec.n_layers)) if layers is None else sorted({int(x) % spec.n_layers for x in layers})
    (a0, a1), (b0, b1) = block_layout(n, block_len, sink)
    perm = block_swap_permutation(n, (a0, a1), (b0, b1))
    stats = _stats_pass(model, tokens, layers, sink, batch_size, progress)

    paired = torch.stack([tokens, tokens[:, perm]], 1).reshape(2 * n_p, n)
    accs = {l: _Acc(n_p, spec.n_heads, spec.layer(l).n_bands) for l in layers}
    k_means = {l: stats[l][1].mean().float() for l in layers}

    def on_pair(c: QKCapture) -> None:
        _pair_scores(c, perm, a0, b1, sink, k_means[c.layer], accs[c.layer])

    stream_qk(model, paired, on_pair, layers, batch_size=2 * batch_size,
              progress="taxonomy pairs" if progress else False)

    label = model_label or str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    frames = []
    for l in layers:
        rope, acc = spec.layer(l), accs[l]
        q_st, k_st = stats[l]
        group = spec.n_heads // k_st.n_heads
        q_e = q_st.energy_share().cpu().double()
        k_e = k_st.energy_share().cpu().double().repeat_interleave(group, 0)  # → query heads
        q_c, k_c = frequency_centroid(q_e).numpy(), frequency_centroid(k_e).numpy()
        pos, pos_sd, cnt = _mean_std(acc.pos)
        sym, sym_sd, _ = _mean_std(acc.sym)
        sh, sh_sd, _ = _mean_std(acc.share)
        n_h, n_b1 = pos.shape
        head = np.repeat(np.arange(n_h), n_b1)
        band = np.tile(np.arange(-1, n_b1 - 1), n_h)
        is_full = band < 0
        bi = np.clip(band, 0, None)
        theta = rope.theta.cpu().numpy()
        nan = np.full(head.shape, np.nan)
        frames.append(pd.DataFrame(dict(
            model=label, twin=twin_label, layer=l, kind=rope.kind, head=head, band=band,
            theta=np.where(is_full, np.nan, theta[bi]),
            positional=pos.ravel(), symbolic=sym.ravel(),
            positional_std=pos_sd.ravel(), symbolic_std=sym_sd.ravel(),
            label=taxonomy_label(pos.ravel(), sym.ravel(), margin), n_prompts=cnt.ravel(),
            q_energy_share=np.where(is_full, nan, q_e.numpy()[head, bi]),
            k_energy_share=np.where(is_full, nan, k_e.numpy()[head, bi]),
            q_centroid=np.where(is_full, q_c[head], nan), k_centroid=np.where(is_full, k_c[head], nan),
            positional_share=np.where(is_full, sh[head], nan),
            positional_share_std=np.where(is_full, sh_sd[head], nan),
        )))
    return pd.concat(frames, ignore_index=True)


def head_table(model_or_df: Any, corpus: Any = None, **kw: Any) -> pd.DataFrame:
    """One row per ``(model, twin, layer, head)``: the full-head rows of :func:`head_taxonomy`.

    Pass a frame from :func:`head_taxonomy` / :func:`head_taxonomy_with_twin`, or a model
    (then ``head_taxonomy(model, corpus, **kw)`` is run first).

    Returns:
        DataFrame with columns :data:`HEAD_COLUMNS`.
    """
    df = model_or_df if isinstance(model_or_df, pd.DataFrame) else head_taxonomy(model_or_df, corpus, **kw)
    return df[df["band"] == -1][HEAD_COLUMNS].reset_index(drop=True)


def head_taxonomy_with_twin(model: Any, corpus: Any = None, seed: int = 0, *, twin: Any = None,
                            **kw: Any) -> pd.DataFrame:
    """:func:`head_taxonomy` of the trained model and of ``random_twin(model, seed)`` on the
    SAME tokens (``twin`` = ``'trained'`` / ``'random'``), concatenated (same columns).
    ``twin``: an already-built ``random_twin(model, seed)`` to reuse (built here if None)."""
    n_prompts, seq_len = kw.pop("n_prompts", 8), kw.pop("seq_len", 256)
    tokens = _tokens(model, corpus, n_prompts, seq_len)
    label = kw.pop("model_label", None) or str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    trained = head_taxonomy(model, tokens, n_prompts=n_prompts, model_label=label, twin_label="trained", **kw)
    twin = random_twin(model, seed) if twin is None else twin
    rand = head_taxonomy(twin, tokens, n_prompts=n_prompts, model_label=label, twin_label="random", **kw)
    return pd.concat([trained, rand], ignore_index=True)


def taxonomy_agreement(head_df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Spearman rank correlation of ``positional − symbolic`` with ``positional_share``, per twin.

    Uses full-head rows (``band == −1`` if a band column is present) with both finite.

    Returns:
        ``{twin: {"rho": ρ, "p": p-value, "n": number of heads}}`` (NaN ρ/p below 3 heads).
    """
    df = head_df[head_df["band"] == -1] if "band" in head_df else head_df
    out: dict[str, dict[str, float]] = {}
    for twin, g in df.groupby("twin", sort=False):
        x = (g["positional"] - g["symbolic"]).to_numpy(float)
        y = g["positional_share"].to_numpy(float)
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.sum() < 3:
            out[str(twin)] = {"rho": float("nan"), "p": float("nan"), "n": int(ok.sum())}
            continue
        res = spearmanr(x[ok], y[ok])
        out[str(twin)] = {"rho": float(res.statistic), "p": float(res.pvalue), "n": int(ok.sum())}
    return out
