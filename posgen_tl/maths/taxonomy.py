"""Head taxonomy (docs/method.md §6): positional vs symbolic heads, band-level logits, frequency use.

Region permutation. The tokens of a context region ``R = [r0, r1)`` are permuted (many
independent random permutations per prompt, :func:`region_permutations`); query rows
``i ≥ r1`` keep their token and position. For each such row the ROW-CENTRED PRE-SOFTMAX
logits over ``R`` (``x`` before, ``y`` after the permutation) are correlated two ways:

* positional = corr(x_j, y_j): the logit stays with the POSITION ``j``;
* symbolic   = corr(x_j, y_{π⁻¹(j)}): the logit follows the TOKEN that sat at ``j``
  (the token at old region index ``j`` sits at new index ``π⁻¹(j)``).

Both use the same two vectors (the symbolic one reorders ``y``), so they are directly
comparable. Softmax ignores row constants, hence the centring. Rows whose logits over
``R`` are (near) constant are EXCLUDED (never scored as agreeing): within-row std below
``min_std`` (the runner uses ``1e-3 ×`` the layer's median within-row std, floored at
``1e-6``), before or after the permutation. Rows are weighted by their clean attention
mass on ``R``. Null: the same correlation with ``y`` re-aligned by an INDEPENDENT random
permutation σ (one per permutation unit, shared by all rows and heads of that unit). For
centred rows its mean is exactly 0 and its variance is known in closed form (Gram
identity, :func:`null_variance`), so every score carries its null's standard deviation
and 95 % quantile; a Monte-Carlo null score (one σ per unit) is reported too.

Band view. A RoPE band (plane) ``m`` is a 2-D attention head of its own: its logit
``s·Re(z_q conj z_k)`` depends on position through one frequency ``θ_m`` (band 0 fastest).
:func:`band_logits` splits the logit map into per-band terms (plus the unrotated
pass-through dims, :func:`pass_logits`), so every score here can be computed per band too.

Permutation convention (as in :mod:`posgen_tl.maths.perturb`): ``new = old[perm]``; the token at
old index ``j`` sits at new index ``perm_inv[j]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
import torch
from einops import einsum, rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from posgen_tl.maths.precision import full_precision_products
from posgen_tl.maths.rope import LayerRope, angles, band_parts, expand_kv, to_bands

__all__ = [
    "region_permutations",
    "row_spread_threshold",
    "region_logit_scores",
    "null_variance",
    "LogitScoreSums",
    "taxonomy_label",
    "LABELS",
    "band_logits",
    "pass_logits",
    "band_patterns",
    "positional_share",
    "positional_shares",
    "frequency_centroid",
    "frequency_usage_frame",
]

#: every label :func:`taxonomy_label` can give
LABELS = ("positional", "symbolic", "both", "neither", "undefined")


# ----------------------------------------------------------------------------- region permutation


def region_permutations(
    n_region: int, n_perm: int, *, block: int = 1, generator: torch.Generator | None = None
) -> Int[Tensor, "n_perm n_region"]:
    """``n_perm`` independent random permutations of a region of ``n_region`` tokens.

    ``block = 1`` (default) permutes single tokens; ``block > 1`` cuts the region into
    consecutive blocks of ``block`` tokens (the last may be shorter) and permutes the blocks,
    each keeping its internal order (word-sized chunks keep more local context, at the cost
    of fewer independent units). Identity draws are re-drawn (a permutation that moves
    nothing scores nothing).

    Returns:
        ``Int[Tensor, "n_perm n_region"]`` (int64), each row ``perm`` with
        ``new_region = old_region[perm]``.

    Raises:
        ValueError: ``n_region < 2``, ``n_perm < 1``, ``block < 1`` or fewer than 2 blocks.
    """
    if n_region < 2 or n_perm < 1 or block < 1:
        raise ValueError(f"need n_region >= 2, n_perm >= 1, block >= 1; got {n_region}, {n_perm}, {block}")
    starts = list(range(0, n_region, block))
    if len(starts) < 2:
        raise ValueError(f"block={block} leaves fewer than 2 blocks in a region of {n_region} tokens")
    pieces = [torch.arange(s, min(s + block, n_region)) for s in starts]
    out = []
    while len(out) < n_perm:
        order = torch.randperm(len(pieces), generator=generator)
        if torch.equal(order, torch.arange(len(pieces))):
            continue
        out.append(torch.cat([pieces[int(b)] for b in order]))
    return torch.stack(out).long()


def row_spread_threshold(
    logits: Float[Tensor, "... query_pos key_pos"], *, rel: float = 1e-3, atol: float = 1e-6
) -> float:
    """Exclusion threshold for near-constant rows: ``max(rel · median within-row std, atol)``.

    ``logits`` are the rows of one layer over the region (all heads, rows, prompts passed in
    count); the std is the population std over the last axis.

    Returns:
        the threshold (a float, in logit units).

    Raises:
        ValueError: negative ``rel`` or ``atol``.
    """
    if rel < 0 or atol < 0:
        raise ValueError(f"rel and atol must be >= 0, got {rel}, {atol}")
    sd = logits.double().std(-1, correction=0)
    sd = sd[torch.isfinite(sd)]
    typical = float(sd.median()) if sd.numel() else 0.0
    return max(rel * typical, atol)


def _centre_unit(x: Tensor, min_std: float) -> tuple[Tensor, Tensor]:
    """Row-centred, unit-norm rows and the mask of rows whose population std ≥ ``min_std`` (and finite: a row whose
    centring overflows or holds NaN is excluded, so every returned row is finite)."""
    xc = x - x.mean(-1, keepdim=True)
    norm = xc.norm(dim=-1, keepdim=True)
    keep = ((norm[..., 0] / math.sqrt(x.shape[-1])) >= min_std) & torch.isfinite(norm[..., 0])
    return torch.where(keep[..., None], xc / norm.clamp_min(torch.finfo(x.dtype).tiny), 0.0), keep


def null_variance(
    x_hat: Float[Tensor, "... query_pos key_pos"],
    y_hat: Float[Tensor, "... query_pos key_pos"],
    weights: Float[Tensor, "... query_pos"],
) -> Float[Tensor, ...]:
    """Exact permutation variance of ``Σ_a w_a · x̂_a·ŷ_a[σ]`` over a uniform random σ.

    For row-centred vectors, ``Cov_σ(x·y[σ], u·v[σ]) = (x·u)(y·v)/(n−1)`` (n = key count)
    and the mean is 0, so the weighted sum over rows sharing one σ has variance
    ``wᵀ (X̂X̂ᵀ ∘ ŶŶᵀ) w / (n−1)``. Rows of ``x_hat``/``y_hat`` must be centred and finite; an
    excluded row has weight 0 (its values then add nothing).

    Computed in the inputs' precision (float32 or wider), returned as float64.

    Returns:
        ``Float[Tensor, "..."]``: the variance (float64), leading dims of the inputs.
    """
    n = x_hat.shape[-1]
    if n < 2:
        raise ValueError(f"need at least 2 keys for a permutation null, got {n}")
    dt = torch.promote_types(x_hat.dtype, torch.float32)
    x = x_hat.to(dt)
    y, w = y_hat.to(dt), weights.to(dt)
    gram = (x @ x.transpose(-1, -2)) * (y @ y.transpose(-1, -2))
    return (gram @ w[..., None])[..., 0].mul(w).sum(-1).double() / (n - 1)


@dataclass
class LogitScoreSums:
    """Mergeable sums behind the positional/symbolic scores (one entry per head, or head × band).

    All fields have the same shape (the leading dims of the logits, e.g. ``[head_index]``
    or ``[head_index, band]``), float64. Add two with ``+``; :meth:`finalize` gives the scores.

    Attributes:
        pos, sym, null: ``Σ w·r`` of the positional, symbolic and Monte-Carlo null correlations.
        null_var: ``Σ`` over permutation units of the exact null variance of ``Σ w·r``.
        weight: ``Σ w`` over scored rows (attention mass on the region).
        n_used / n_excluded: row counts (one row = one query row under one permutation).
    """

    pos: Tensor
    sym: Tensor
    null: Tensor
    null_var: Tensor
    weight: Tensor
    n_used: Tensor
    n_excluded: Tensor

    def __add__(self, other: LogitScoreSums) -> LogitScoreSums:
        return LogitScoreSums(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def finalize(self, quantile: float = 0.95) -> dict[str, Tensor]:
        """Scores from the sums.

        Returns:
            dict of float64 tensors (shape of the fields): ``positional``, ``symbolic``
            (weighted mean row correlations), ``null_mc`` (the same with an independent
            permutation), ``null_sd`` (exact null sd of the weighted mean), ``null_q``
            (its ``quantile`` under a normal approximation; the null mean is exactly 0),
            ``n_used``, ``n_excluded``, ``weight``. Scores are NaN where no row was used.
        """
        if not 0.5 < quantile < 1:
            raise ValueError(f"quantile must lie in (0.5, 1), got {quantile}")
        w = self.weight
        ok = w > 0
        nan = torch.full_like(w, float("nan"))

        def mean(s: Tensor) -> Tensor:
            return torch.where(ok, s / w.clamp_min(1e-300), nan)

        sd = torch.where(ok, self.null_var.clamp_min(0).sqrt() / w.clamp_min(1e-300), nan)
        z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(quantile, dtype=torch.float64)))
        return dict(positional=mean(self.pos), symbolic=mean(self.sym), null_mc=mean(self.null), null_sd=sd,
                    null_q=z * sd, n_used=self.n_used, n_excluded=self.n_excluded, weight=w)


#: the most keys for which :func:`_unpermuted` uses the 0/1 product (O(n²) per row against the gathers' O(n))
PRODUCT_MAX_KEYS = 256


def _rows_permuted(x: Tensor, perm: Tensor, null_perm: Tensor) -> Tensor:
    """``x[..., perm[p]]`` and ``x[..., null_perm[p]]`` for every ``p``, as ``[..., query_pos, 2, n_perm, key_pos]``
    (``x`` finite). On a CPU in full precision, up to :data:`PRODUCT_MAX_KEYS` keys, all of them come from one product
    with a 0/1 matrix — the same values (each entry is one value times 1 plus zeros; a zero's sign may change) and
    several times faster there than gathers along the last axis; otherwise (a GPU may round float32 products to TF32,
    long rows) by one gather."""
    n_p, n = perm.shape
    idx = torch.cat([perm, null_perm]).reshape(-1).to(x.device)  # [2·n_perm·n]
    if x.device.type != "cpu" or n > PRODUCT_MAX_KEYS or not full_precision_products(x.dtype):
        out = x.index_select(-1, idx)
    else:
        out = x @ torch.eye(n, dtype=x.dtype)[:, idx]
    return out.view(*x.shape[:-1], 2, n_p, n)


def check_permutations(*perms: Tensor, names: str) -> None:
    """Raise ValueError (naming ``names``) unless every row of every ``[n_perm, n]`` tensor is a permutation of
    ``0..n−1``."""
    for p in perms:
        ar = torch.arange(p.shape[-1], device=p.device)
        if not torch.equal(p.sort(-1).values, ar.expand_as(p)):
            raise ValueError(f"every row of {names} must be a permutation of 0..n_region-1")


def region_logit_scores(
    w_orig: Float[Tensor, "... query_pos key_pos"],
    w_perm: Float[Tensor, "n_perm ... query_pos key_pos"],
    perm: Int[Tensor, "n_perm key_pos"],
    weights: Float[Tensor, "... query_pos"],
    *,
    min_std: float,
    null_perm: Int[Tensor, "n_perm key_pos"] | None = None,
    generator: torch.Generator | None = None,
) -> LogitScoreSums:
    """Positional/symbolic sums of one prompt under ``n_perm`` permutations of the region.

    ``w_orig``: clean pre-softmax logits of the query rows over the region (region order);
    ``w_perm[p]``: the same rows' logits over the region POSITIONS after the region was
    permuted by ``perm[p]`` (``new_region = old_region[perm[p]]``). Query rows must be
    unmoved by the permutation (rows after the region). Leading dims ``...`` are e.g.
    ``head_index`` or ``head_index band``. ``weights``: each row's clean attention mass on
    the region (any non-negative weight).

    Per row and permutation, with ``x``, ``y`` the centred, unit-norm rows:
    positional ``r = x·y``, symbolic ``r = x·y[π⁻¹]``, null ``r = x·y[σ⁻¹]`` (σ =
    ``null_perm[p]``, an independent permutation; drawn from ``generator`` if None). A row
    whose within-row std (population) is below ``min_std`` before or after is excluded.

    Every permutation is scored at once: the temporaries are about three times ``w_perm`` (plus the clean rows
    reordered by each ``perm`` and ``null_perm``, twice ``w_perm``).

    Returns:
        :class:`LogitScoreSums` with fields of shape ``...`` (float64).

    Raises:
        ValueError: mismatched shapes, a region of < 3 keys, or a row of ``perm`` that is
            not a permutation.
    """
    n_p, n_k = perm.shape
    if w_perm.shape != (n_p, *w_orig.shape):
        raise ValueError(f"w_perm must be [n_perm, *w_orig.shape] = [{n_p}, {tuple(w_orig.shape)}], "
                         f"got {tuple(w_perm.shape)}")
    if w_orig.shape[-1] != n_k or weights.shape != w_orig.shape[:-1]:
        raise ValueError(f"region of {n_k} keys (perm) vs logits {tuple(w_orig.shape)}, weights {tuple(weights.shape)}")
    if n_k < 3:
        raise ValueError(f"the region needs at least 3 keys, got {n_k}")
    check_permutations(perm, names="perm")
    if null_perm is None:
        null_perm = torch.stack([torch.randperm(n_k, generator=generator) for _ in range(n_p)])
    if null_perm.shape != perm.shape:
        raise ValueError(f"null_perm must have the shape of perm {tuple(perm.shape)}, got {tuple(null_perm.shape)}")
    dt = torch.promote_types(w_orig.dtype, torch.float32)  # float32 inputs are scored in float32, sums in float64
    x, keep_x = _centre_unit(w_orig.to(dt), min_std)  # [..., q, k]
    y, keep_y = _centre_unit(w_perm.to(dt), min_std)  # [P, ..., q, k]: every permutation at once
    keep = keep_x & keep_y  # [P, ..., q]
    wk = torch.where(keep, weights.to(dt).clamp_min(0), 0.0)  # an excluded row weighs 0: its (finite) zeros add nothing
    yt, wt = y.movedim(0, -2), wk.movedim(0, -1)  # views [..., q, P, k] and [..., q, P]
    # positional x·y, then symbolic x·y[π⁻¹] = x[π]·y and null x[σ]·y: the clean rows reordered, not the permuted ones
    r_pos = (x.unsqueeze(-2) * yt).sum(-1)  # [..., q, P]
    r_perm = (_rows_permuted(x, perm, null_perm) * yt.unsqueeze(-3)).sum(-1)  # [..., q, 2, P]
    pos = (wt * r_pos).sum(-2).double().sum(-1)
    sym, null = (wt.unsqueeze(-2) * r_perm).sum(-3).double().sum(-1).unbind(-1)
    # the null variance wᵀ(XXᵀ ∘ YYᵀ)w = ‖Xᵀ diag(w) Y‖²_F: one [k, k] product per permutation, no Gram matrices
    m = (x * wk.unsqueeze(-1)).transpose(-1, -2) @ y  # [P, ..., k, k]
    null_var = m.square().sum((-1, -2)).double().sum(0) / (n_k - 1)
    n_used = keep.sum((0, -1)).double()
    weight = wt.sum(-2).double().sum(-1)  # summed as the scores are: a perfect correlation scores 1 to the last bit
    return LogitScoreSums(pos, sym, null, null_var, weight, n_used, keep.shape[-1] * n_p - n_used)


def taxonomy_label(
    pos: Float[Tensor, "*batch"] | np.ndarray,
    sym: Float[Tensor, "*batch"] | np.ndarray,
    null_q: Float[Tensor, "*batch"] | np.ndarray,
    *,
    min_score: float = 0.2,
) -> np.ndarray:
    """Class per head (or band) from its scores AND their null.

    An axis is present when its score exceeds the null quantile ``null_q`` AND
    ``min_score`` (a significant but tiny correlation is not a mechanism). Present on
    both axes → ``'both'``; one → ``'positional'`` / ``'symbolic'``; none → ``'neither'``;
    ``'undefined'`` where a score or the null is NaN (no row was scored, e.g. constant
    logits). A head with no usable rows is therefore never ``'both'``.

    Returns:
        numpy array of ``str`` (object dtype), broadcast shape of the inputs.
    """
    def arr(v):
        return v.detach().cpu().double().numpy() if isinstance(v, Tensor) else np.asarray(v, float)

    p, s, q = np.broadcast_arrays(arr(pos), arr(sym), arr(null_q))
    if min_score < 0:
        raise ValueError(f"min_score must be >= 0, got {min_score}")
    with np.errstate(invalid="ignore"):
        has_p = (p > q) & (p >= min_score)
        has_s = (s > q) & (s >= min_score)
    out = np.full(p.shape, "neither", dtype=object)
    out[has_p & has_s] = "both"
    out[has_p & ~has_s] = "positional"
    out[~has_p & has_s] = "symbolic"
    out[np.isnan(p) | np.isnan(s) | np.isnan(q)] = "undefined"
    return out


# ----------------------------------------------------------------------------- band view


def _expand(rot_q: Tensor, rot_k: Tensor) -> Tensor:
    return expand_kv(rot_k, rot_q.shape[-2]) if rot_k.shape[-2] != rot_q.shape[-2] else rot_k


def band_logits(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos head_index d_head"],
    rope: LayerRope,
    *,
    out: Tensor | None = None,
) -> Float[Tensor, "batch head_index band query_pos key_pos"]:
    """Per-band logit terms ``s · Re(z_q^(m) conj z_k^(m)) = s·(x_q·x_k + y_q·y_k)`` on band m.

    ``rot_q``/``rot_k`` are POST-rotation (``hook_rot_q``/``hook_rot_k``; fewer kv heads are
    expanded). Summing over ``band`` and adding :func:`pass_logits` gives the full unmasked
    logits ``scores_from_rotated``. No mask. Memory ``batch·heads·bands·N²``. ``out``: a tensor of the result's
    shape and dtype (a view may be strided, e.g. a slice of a larger buffer) that the terms are written into.

    Each entry is ``(x_q·x_k + y_q·y_k)·s`` rounded product by product, as two broadcast products and a sum compute
    it (no matrix product: a band's term is one product per part).

    Returns:
        ``Float[Tensor, "batch head_index band query_pos key_pos"]`` in float32 or wider
        (bf16/fp16 inputs are up-cast); ``out`` where given.
    """
    dtype = torch.promote_types(rot_q.dtype, torch.float32)
    rot_q, rot_k = rot_q.to(dtype), _expand(rot_q, rot_k).to(dtype)
    qa, qb = (rearrange(x, "b i h m -> b h m i 1") for x in band_parts(rot_q, rope.rotary_dim, rope.layout))
    ka, kb = (rearrange(x, "b j h m -> b h m 1 j") for x in band_parts(rot_k, rope.rotary_dim, rope.layout))
    w = torch.mul(qa, ka, out=out) if out is not None else qa * ka
    w.add_(qb * kb)
    return w.mul_(rope.score_scale)


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


def _within_row_ss(x: Tensor, keep: Tensor, cnt: Tensor) -> Tensor:
    """``Σ_rows Σ_{visible j} (x[i, j] − mean_visible x[i, ·])²`` in float64 over the last two axes (``keep``: the
    visible entries, ``cnt``: their number per row, at least 1); masked entries may hold anything, ``-inf`` included."""
    x = torch.where(keep, x.double(), 0.0)
    mu = x.sum(-1, keepdim=True) / cnt
    return torch.where(keep, x - mu, 0.0).pow(2).sum((-1, -2))


def _share(vf: Tensor, vg: Tensor) -> Tensor:
    tot = vf + vg
    return torch.where(tot > 0, vf / tot.clamp_min(1e-300), torch.full_like(tot, float("nan")))


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
    return _share(_within_row_ss(f, keep, cnt), _within_row_ss(g, keep, cnt))


def positional_shares(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    k_means: Float[Tensor, "kind kv_head d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "kind batch head_index"]:
    """:func:`positional_share` of D3's ``f`` and ``g`` (:func:`posgen_tl.maths.decompose.d3_terms`, ``Δ0 = 0``) for
    several key means ``k̄`` at once (e.g. a global one and the prompt's own), from PRE-rotation ``q``/``k`` (fewer kv
    heads are expanded), without D3's complex maps.

    Only within-row variances are needed, and a row constant has none: ``g = s·(a²·q_rot·(k − k̄)_rot +
    q_pass·(k − k̄)_pass)`` differs from the unrotated logits ``s·(a²·q_rot·k_rot + q_pass·k_pass)`` by a constant per
    row, so ``V(g)`` is the same for every ``k̄`` and computed once; ``f``'s pass-through part is a row constant too,
    leaving ``s·a²·Re Σ_m (z_q e^{iφ_i})_m conj(z_k̄ e^{iφ_j})_m`` — two real float64 products where ``d3_terms`` takes
    two complex ones per ``k̄``. Equal to ``positional_share`` of ``d3_terms``' maps within float64 rounding (test).

    Returns:
        ``Float[Tensor, "kind batch head_index"]`` (float64): ``V(f)/(V(f)+V(g))`` per key mean; NaN where both are 0.
    """
    r = rope.rotary_dim
    if q.shape[-1] < r:
        raise ValueError(f"d_head={q.shape[-1]} is smaller than rotary_dim={r}")
    qd = q.double()
    kd = _expand(q, k).double()
    km = _expand(q, k_means.to(q.device)).double()  # [kind, head, d]
    s, a2 = rope.score_scale, rope.attention_scaling**2
    g = einsum(torch.cat([a2 * qd[..., :r], qd[..., r:]], -1), kd, "b i h d, b j h d -> b h i j") * s
    phi = angles(positions.to(q.device), rope).double()  # float32 angles as the model computes them
    e = torch.polar(torch.ones_like(phi), phi)[:, :, None, :]  # [b, pos, 1, band]
    zq = torch.view_as_real(to_bands(qd, r, rope.layout) * e).flatten(-2)  # [b, i, h, 2·band]: (re, im) pairs
    zk = torch.view_as_real(to_bands(km, r, rope.layout)[:, None, None] * e[None]).flatten(-2)  # [kind, b, j, h, ·]
    f = einsum(zq, zk, "b i h m, kind b j h m -> kind b h i j") * (s * a2)
    keep = mask.to(q.device)
    cnt = keep.double().sum(-1, keepdim=True).clamp_min(1)
    return _share(_within_row_ss(f, keep, cnt), _within_row_ss(g, keep, cnt))


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
    """Tidy frame of band energy shares (docs/method.md §3 frequency usage), one row per (head, band).

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
    cen = frequency_centroid(e).cpu().numpy()
    head = np.repeat(np.arange(n_h), n_b)
    return pd.DataFrame(
        dict(
            model=model,
            twin=twin,
            layer=int(layer),
            which=which,
            head=head,
            band=np.tile(np.arange(n_b), n_h),
            energy_share=e.cpu().numpy().ravel(),
            centroid=cen[head],
        )
    )
