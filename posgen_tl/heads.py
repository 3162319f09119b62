"""Head taxonomy (METHOD.md §6): positional vs symbolic heads, band-level logits, frequency use.

Block swap. The context blocks ``A = [a0, a1)`` and ``B = [b0, b1)`` trade places (each keeps
its internal order; tokens between them shift when the lengths differ). A query row
``i ≥ b1`` then sees the SAME tokens at DIFFERENT positions. Comparing its attention over
the moved region before and after the swap tells whether the head's attention stays with
the positions (positional head) or follows the tokens (symbolic head) — the metric of
seed 003 in cosine form.

Band view. A RoPE band (plane) ``m`` is a 2-D attention head of its own: its logit
``s·Re(z_q conj z_k)`` depends on position through one frequency ``θ_m`` (band 0 fastest).
:func:`band_logits` splits the logit map into per-band terms (plus the unrotated
pass-through dims, :func:`pass_logits`), so every score here can be computed per band too.

Permutation convention (as in :mod:`posgen_tl.perturb`): ``new = old[perm]``; the token at
old index ``j`` sits at new index ``perm_inv[j]``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from einops import einsum
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .rope import LayerRope, causal_mask, expand_kv, to_bands

__all__ = [
    "block_swap_permutation",
    "positional_symbolic_scores",
    "taxonomy_label",
    "band_logits",
    "pass_logits",
    "band_patterns",
    "positional_share",
    "frequency_centroid",
    "frequency_usage_frame",
]


# ----------------------------------------------------------------------------- block swap


def block_swap_permutation(
    n_pos: int, block_a: tuple[int, int], block_b: tuple[int, int]
) -> Int[Tensor, "pos"]:
    """Permutation that swaps block ``A = [a0, a1)`` with block ``B = [b0, b1)``.

    New order: ``old[:a0] + old[B] + old[a1:b0] + old[A] + old[b1:]``; each block keeps its
    internal order, tokens between the blocks shift by ``len(B) − len(A)``, everything
    outside ``[a0, b1)`` is fixed.

    Returns:
        ``perm``, ``Int[Tensor, "pos"]`` (int64) with ``new_sequence = old_sequence[perm]``.

    Raises:
        ValueError: unless ``0 ≤ a0 < a1 ≤ b0 < b1 ≤ n_pos``.
    """
    a0, a1 = block_a
    b0, b1 = block_b
    if not (0 <= a0 < a1 <= b0 < b1 <= n_pos):
        raise ValueError(
            f"blocks must satisfy 0 <= a0 < a1 <= b0 < b1 <= n_pos; got A={block_a}, "
            f"B={block_b}, n_pos={n_pos}"
        )
    ar = torch.arange
    return torch.cat([ar(0, a0), ar(b0, b1), ar(a1, b0), ar(a0, a1), ar(b1, n_pos)]).long()


def _row_cosine(u: Tensor, v: Tensor, eps: float) -> Tensor:
    num = (u * v).sum(-1)
    den = u.norm(dim=-1) * v.norm(dim=-1)
    return torch.where(den > eps * eps, num / den.clamp_min(eps * eps), torch.zeros_like(num))


def positional_symbolic_scores(
    pattern_orig: Float[Tensor, "*batch head_index query_pos key_pos"],
    pattern_swap: Float[Tensor, "*batch head_index query_pos key_pos"],
    perm: Int[Tensor, "pos"],
    query_rows: Int[Tensor, "n_q"],
    key_cols: Int[Tensor, "n_k"],
    *,
    eps: float = 1e-8,
) -> tuple[Float[Tensor, "*batch head_index"], Float[Tensor, "*batch head_index"]]:
    """Positional and symbolic scores of each head under a context permutation.

    For each query row ``i`` (must be a fixed point of ``perm``: same token, same position
    before and after, e.g. rows ``≥ b1`` of a block swap) let
    ``u = pattern_orig[..., i, key_cols]`` (the original attention over the moved region):

    * positional = cos(u, ``pattern_swap[..., i, key_cols]``)  — attention stays with
      the POSITIONS;
    * symbolic   = cos(u, ``pattern_swap[..., i, perm_inv[key_cols]]``) — attention follows
      the TOKENS (the token at old index ``j`` is at new index ``perm_inv[j]``).

    Scores are averaged over query rows, per head (and per any leading dim, e.g. a band
    axis ``[batch, head_index, band, q, k]`` from :func:`band_patterns`). Rows where
    ``‖u‖ ≤ eps`` (the head does not look at the region) are ignored; a row whose swapped
    vector is ~0 scores 0. If every row is ignored the result is NaN. Works for patterns
    (post-softmax) as for any non-negative row map; with signed inputs cosines can be < 0.

    Returns:
        ``(positional, symbolic)``, each ``Float[Tensor, "*batch head_index"]``.

    Raises:
        ValueError: a query row that ``perm`` moves, or mismatched shapes.
    """
    if pattern_orig.shape != pattern_swap.shape:
        raise ValueError(
            f"pattern shapes differ: {tuple(pattern_orig.shape)} vs {tuple(pattern_swap.shape)}"
        )
    dev = pattern_orig.device
    perm = perm.to(dev)
    query_rows = torch.as_tensor(query_rows, device=dev).long()
    key_cols = torch.as_tensor(key_cols, device=dev).long()
    if perm.shape[0] != pattern_orig.shape[-1]:
        raise ValueError(f"perm has {perm.shape[0]} entries; patterns have {pattern_orig.shape[-1]}")
    if not torch.equal(perm[query_rows], query_rows):
        moved = query_rows[perm[query_rows] != query_rows].tolist()
        raise ValueError(f"query rows {moved} are moved by perm; use unmoved rows (e.g. >= b1)")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], device=dev, dtype=perm.dtype)

    u = pattern_orig[..., query_rows, :][..., key_cols].double()
    rows_swap = pattern_swap[..., query_rows, :].double()
    v_pos = rows_swap[..., key_cols]
    v_sym = rows_swap[..., inv[key_cols]]
    valid = u.norm(dim=-1) > eps  # *batch head n_q
    w = valid.double()
    n_valid = w.sum(-1)

    def mean_rows(c: Tensor) -> Tensor:
        out = (c * w).sum(-1) / n_valid.clamp_min(1)
        return torch.where(n_valid > 0, out, torch.full_like(out, float("nan")))

    pos = mean_rows(_row_cosine(u, v_pos, eps))
    sym = mean_rows(_row_cosine(u, v_sym, eps))
    out = torch.promote_types(pattern_orig.dtype, torch.float32)
    return pos.to(out), sym.to(out)


def taxonomy_label(
    pos: Float[Tensor, "*batch"] | np.ndarray,
    sym: Float[Tensor, "*batch"] | np.ndarray,
    margin: float = 0.1,
) -> np.ndarray:
    """Class per head: ``'positional'`` if ``pos − sym > margin``, ``'symbolic'`` if
    ``sym − pos > margin``, else ``'mixed'``; ``'undefined'`` where either score is NaN.

    Returns:
        numpy array of ``str`` (object dtype) with the broadcast shape of ``pos``/``sym``.
    """
    p = pos.detach().cpu().double().numpy() if isinstance(pos, Tensor) else np.asarray(pos, float)
    s = sym.detach().cpu().double().numpy() if isinstance(sym, Tensor) else np.asarray(sym, float)
    diff = p - s
    out = np.full(diff.shape, "mixed", dtype=object)
    out[diff > margin] = "positional"
    out[diff < -margin] = "symbolic"
    out[np.isnan(diff)] = "undefined"
    return out


# ----------------------------------------------------------------------------- band view


def _expand(rot_q: Tensor, rot_k: Tensor) -> Tensor:
    return expand_kv(rot_k, rot_q.shape[-2]) if rot_k.shape[-2] != rot_q.shape[-2] else rot_k


def band_logits(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos head_index d_head"],
    rope: LayerRope,
) -> Float[Tensor, "batch head_index band query_pos key_pos"]:
    """Per-band logit terms ``s · Re(z_q^(m) conj z_k^(m)) = s·(x_q·x_k + y_q·y_k)`` on band m.

    ``rot_q``/``rot_k`` are POST-rotation (``hook_rot_q``/``hook_rot_k``; fewer kv heads are
    expanded). Summing over ``band`` and adding :func:`pass_logits` gives the full unmasked
    logits ``scores_from_rotated``. No mask. Memory ``batch·heads·bands·N²``.

    Returns:
        ``Float[Tensor, "batch head_index band query_pos key_pos"]`` in float32 or wider
        (bf16/fp16 inputs are up-cast).
    """
    dtype = torch.promote_types(rot_q.dtype, torch.float32)
    rot_q, rot_k = rot_q.to(dtype), _expand(rot_q, rot_k).to(dtype)
    zq = to_bands(rot_q, rope.rotary_dim, rope.layout)
    zk = to_bands(rot_k, rope.rotary_dim, rope.layout)
    pat = (
        "batch query_pos head_index band, batch key_pos head_index band"
        " -> batch head_index band query_pos key_pos"
    )
    w = einsum(zq.real, zk.real, pat) + einsum(zq.imag, zk.imag, pat)
    return w * rope.score_scale


def pass_logits(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos head_index d_head"],
    rope: LayerRope,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """Logit term of the unrotated dims ``≥ rotary_dim``: ``s · q[r:]·k[r:]`` (zeros if none).

    Returns:
        ``Float[Tensor, "batch head_index query_pos key_pos"]`` (float32 or wider).
    """
    dtype = torch.promote_types(rot_q.dtype, torch.float32)
    rot_q, rot_k = rot_q.to(dtype), _expand(rot_q, rot_k).to(dtype)
    r = rope.rotary_dim
    b, n, h, _ = rot_q.shape
    if rot_q.shape[-1] == r:
        return rot_q.new_zeros(b, h, n, rot_k.shape[1])
    pat = (
        "batch query_pos head_index d_head, batch key_pos head_index d_head"
        " -> batch head_index query_pos key_pos"
    )
    return einsum(rot_q[..., r:], rot_k[..., r:], pat) * rope.score_scale


def band_patterns(
    band_logits: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "*batch query_pos key_pos"]:
    """Softmax over keys of each band's logits taken alone (a band as a 2-D head).

    ``mask`` is ``True`` where the key is visible (e.g. :func:`causal_mask`); masked entries
    are 0, and a fully masked row is all 0. Computed in float32 or wider.

    Returns:
        same shape as ``band_logits`` (e.g. ``[batch, head_index, band, query_pos, key_pos]``).
    """
    dtype = torch.promote_types(band_logits.dtype, torch.float32)
    mask = mask.to(band_logits.device)
    x = band_logits.to(dtype).masked_fill(~mask, float("-inf"))
    p = torch.softmax(x, dim=-1)
    return torch.nan_to_num(p, nan=0.0).masked_fill(~mask, 0.0)


def positional_share(
    f: Float[Tensor, "*batch head_index query_pos key_pos"],
    g: Float[Tensor, "*batch head_index query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "*batch head_index"]:
    """Share of within-row variance carried by ``f`` (positional term) vs ``g`` (semantic).

    ``V(x) = Σ_rows Σ_{visible j} (x[i, j] − mean_visible x[i, ·])²`` (pooled within-row sum
    of squares; row constants are removed since softmax ignores them). Returns
    ``V(f) / (V(f) + V(g))`` ∈ [0, 1]; NaN if both are 0. ``mask`` True = visible (causal
    entries). Computed in float64.

    Returns:
        ``Float[Tensor, "*batch head_index"]`` (float64).
    """
    keep = mask.to(f.device)
    cnt = keep.double().sum(-1, keepdim=True).clamp_min(1)

    def within(x: Tensor) -> Tensor:
        x = torch.where(keep, x.double(), 0.0)  # masked entries may hold -inf
        mu = x.sum(-1, keepdim=True) / cnt
        return torch.where(keep, x - mu, 0.0).pow(2).sum((-1, -2))

    vf, vg = within(f), within(g)
    tot = vf + vg
    return torch.where(tot > 0, vf / tot.clamp_min(1e-300), torch.full_like(tot, float("nan")))


# ----------------------------------------------------------------------------- frequency use


def frequency_centroid(
    energy_share: Float[Tensor, "head_index band"],
) -> Float[Tensor, "head_index"]:
    """Energy-weighted mean band index per head: ``Σ_m m·e_m / Σ_m e_m`` (0 = fastest band).

    Returns:
        ``Float[Tensor, "head_index"]`` (float64; NaN for an all-zero row).
    """
    e = energy_share.double()
    idx = torch.arange(e.shape[-1], dtype=torch.float64, device=e.device)
    tot = e.sum(-1)
    cen = (e * idx).sum(-1) / tot.clamp_min(1e-300)
    return torch.where(tot > 0, cen, torch.full_like(tot, float("nan")))


def frequency_usage_frame(
    energy_share: Float[Tensor, "head_index band"],
    *,
    layer: int,
    which: str,
    model: str = "",
    twin: str = "trained",
) -> pd.DataFrame:
    """Tidy frame of band energy shares (METHOD §3 frequency usage), one row per (head, band).

    ``which`` says what the energy is of (e.g. ``"q"`` / ``"k"``); ``twin`` is
    ``"trained"`` or the random-init twin's label.

    Returns:
        DataFrame with columns ``model, twin, layer, which, head, band, energy_share,
        centroid`` (``centroid`` = :func:`frequency_centroid` of the head, repeated).
    """
    e = energy_share.detach().cpu().double()
    if e.ndim != 2:
        raise ValueError(f"energy_share must be [head_index, band], got {tuple(e.shape)}")
    n_h, n_b = e.shape
    cen = frequency_centroid(e).numpy()
    head = np.repeat(np.arange(n_h), n_b)
    return pd.DataFrame(
        dict(
            model=model,
            twin=twin,
            layer=int(layer),
            which=which,
            head=head,
            band=np.tile(np.arange(n_b), n_h),
            energy_share=e.numpy().ravel(),
            centroid=cen[head],
        )
    )
