"""Decompositions of an attention-logit map (docs/method.md §2) and their scores.

* D1 / D2 — additive least-squares fits ``W[i,j] ≈ mean + a[i−j] + b[i] + c[j]`` (D1) or
  without ``b`` (D2) over the masked (causal) entries: :func:`fit_additive`.
* D3 — the constructive split ``W = f + g + (W − f − g)`` with the head's mean
  pre-rotation key ``k̄``: :func:`d3_split`, and the per-entry bound on the remainder:
  :func:`d3_bound`. Both take a reference offset ``delta0`` (docs/method.md §2): the semantic term
  becomes ``g_Δ0 = s·q_iᵀ R_{−Δ0}(k_j − k̄)`` (the form LM-Infinite's "disentangled"
  approximation uses for far keys); ``delta0 = 0`` is D3. :func:`d3_logits` returns
  ``f + g_Δ0`` alone. ``k̄`` may be one per head (a global mean key) or one per sequence
  and head (:func:`sequence_key_mean`).
* Scores over masked entries: :func:`pearson_r`, :func:`r_squared`, :func:`within_row_r`,
  :func:`score_maps`.

Everything is a pure tensor function. All fits and scores are computed in float64 and
returned as float64, whatever the input dtype.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from posgen_tl.maths.additive import band_of_mask
from posgen_tl.maths.additive import solve as additive_solve
from posgen_tl.maths.rope import LayerRope, angles, causal_mask, expand_kv, to_bands

__all__ = [
    "ESTIMATORS",
    "causal_mask",
    "AdditiveFit",
    "fit_additive",
    "normal_system",
    "D3Split",
    "D3_TERMS",
    "d3_terms",
    "d3_split",
    "d3_bound",
    "d3_bound_rows",
    "band_bound_rows",
    "d3_logits",
    "sequence_key_mean",
    "pearson_r",
    "r_squared",
    "within_row_r",
    "score_maps",
]

ESTIMATORS = ("D1", "D2", "D3")


# ----------------------------------------------------------------------------- D1 / D2


@dataclass
class AdditiveFit:
    """Result of :func:`fit_additive` (all float64).

    Attributes:
        a: ``[*batch, delta]`` distance term ``a[d]``, ``d = i − j = 0..n_pos−1``.
        b: ``[*batch, query_pos]`` query-row term, ``None`` for D2.
        c: ``[*batch, key_pos]`` key-column term.
        mean: ``[*batch]`` masked mean of ``W`` subtracted before fitting.
        fitted: ``[*batch, query_pos, key_pos]`` ``mean + a[i−j] + b[i] + c[j]``, 0 off-mask.
    """

    a: Float[Tensor, "*batch delta"]
    b: Float[Tensor, "*batch query_pos"] | None
    c: Float[Tensor, "*batch key_pos"]
    mean: Float[Tensor, "*batch"]
    fitted: Float[Tensor, "*batch query_pos key_pos"]


_FACTOR_CACHE: OrderedDict[tuple, tuple[Tensor, Tensor]] = OrderedDict()
_FACTOR_CACHE_SIZE = 8


def _delta_index(n: int, device) -> Tensor:
    """``[n, n]`` long tensor of ``i − j`` clamped at 0 (only read on the lower triangle)."""
    i = torch.arange(n, device=device)
    return (i[:, None] - i[None, :]).clamp(min=0)


def _diag_sums(x: Float[Tensor, "batch query_pos key_pos"]) -> Float[Tensor, "batch delta"]:
    """``out[..., d] = Σ_i x[..., i, i−d]`` for ``d = 0..n−1`` (lower-triangular diagonals).

    Skew trick, O(n²): flip columns, pad each row with ``n`` zeros, flatten, drop the last
    ``n`` entries and re-read with row width ``2n−1``; column ``d + n − 1`` then holds
    ``x[i, i−d]`` for every row ``i``.
    """
    n = x.shape[-1]
    padded = torch.nn.functional.pad(x.flip(-1), (0, n))
    flat = rearrange(padded, "b q k -> b (q k)")[:, : n * (2 * n - 1)]
    skew = rearrange(flat, "b (q w) -> b q w", w=2 * n - 1)
    return skew.sum(-2)[:, n - 1 :]


def normal_system(mask: Tensor, three_axis: bool, ridge: float) -> tuple[Tensor, Tensor]:
    """``(XᵀX, cholesky(XᵀX + λI))`` for the additive design on ``mask`` (cached, float64).

    Parameter order ``[a_0..a_{n−1}, (b_0..b_{n−1},) c_0..c_{n−1}]``; ``XᵀX`` holds counts
    (diagonal / row / column counts) and 0/1 cross terms, built from the mask alone.
    ``λ = ridge · mean(diag XᵀX)``.
    """
    n = mask.shape[-1]
    mb = mask.to(torch.bool).contiguous()
    digest = hashlib.sha1(mb.cpu().numpy().tobytes()).hexdigest()
    key = (n, digest, bool(three_axis), float(ridge), str(mask.device))
    if key in _FACTOR_CACHE:
        _FACTOR_CACHE.move_to_end(key)
        return _FACTOR_CACHE[key]

    m = mb.double()
    dev = m.device
    i = torch.arange(n, device=dev)
    # A_q[d, i] = mask[i, i−d]   (cross term a_d with b_i)
    col = i[None, :] - i[:, None]  # [d, i] -> i − d
    a_q = torch.where(col >= 0, m[i[None, :].expand(n, n), col.clamp(min=0)], 0.0)
    # A_k[d, j] = mask[j+d, j]   (cross term a_d with c_j)
    row = i[None, :] + i[:, None]  # [d, j] -> j + d
    a_k = torch.where(row < n, m[row.clamp(max=n - 1), i[None, :].expand(n, n)], 0.0)
    diag_a = a_q.sum(-1).diag()
    blocks = (
        [[diag_a, a_q, a_k], [a_q.T, m.sum(-1).diag(), m], [a_k.T, m.T, m.sum(-2).diag()]]
        if three_axis
        else [[diag_a, a_k], [a_k.T, m.sum(-2).diag()]]
    )
    xtx = torch.cat([torch.cat(r, dim=-1) for r in blocks], dim=-2)
    lam = ridge * xtx.diagonal().mean()
    factor = torch.linalg.cholesky(xtx + lam * torch.eye(xtx.shape[0], dtype=xtx.dtype, device=dev))

    _FACTOR_CACHE[key] = (xtx, factor)
    while len(_FACTOR_CACHE) > _FACTOR_CACHE_SIZE:
        _FACTOR_CACHE.popitem(last=False)
    return xtx, factor


def fit_additive(
    W: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
    three_axis: bool = True,
    ridge: float = 1e-6,
    refine: int = 3,
    dense: bool | None = None,
) -> AdditiveFit:
    """Least-squares additive fit of every map in ``W`` over the ``mask`` entries.

    D1 (``three_axis=True``): ``W[i,j] ≈ mean + a[i−j] + b[i] + c[j]``; D2: without ``b``.
    ``mask`` must be lower-triangular (``j <= i``). Off-mask entries of ``W`` are ignored
    (they may hold ``-inf``/NaN). The normal equations ``(XᵀX + λI) β = Xᵀ(W − mean)`` are
    built from the mask only, Cholesky-factored once (LRU-cached) and solved for the whole
    batch; ``Xᵀ(W − mean)`` is diagonal / row / column sums, O(n²) per map. The ridge
    ``λ = ridge·mean(diag XᵀX)`` pins the non-identifiable directions (constant shifts
    between axes and the linear trend ``t·(i−j) − t·i + t·j``) and zeroes parameters of
    deltas/rows/columns no masked entry uses; ``refine`` steps of iterated Tikhonov
    (``β ← β + (XᵀX + λI)⁻¹(Xᵀy − XᵀXβ)``) then remove the ridge's shrinkage bias on the
    identifiable part, so ``fitted`` converges to the plain least-squares fit.
    A band mask (causal, first keys excluded, a window of ≥ 2 keys: every mask the package scores) is solved
    through its structure instead (:mod:`posgen_tl.maths.additive`, O(n) per map after the O(n²) sums): the
    minimum-norm least-squares parameters, to which the ridge solve converges (``ridge``/``refine`` unused);
    ``dense=True`` forces the dense solve.

    Returns an :class:`AdditiveFit` with float64 tensors: ``a [*batch, delta]``,
    ``b [*batch, query_pos]`` (``None`` for D2), ``c [*batch, key_pos]``, ``mean [*batch]``,
    ``fitted [*batch, query_pos, key_pos]`` (0 off-mask).
    """
    n = W.shape[-1]
    if W.shape[-2:] != (n, n) or tuple(mask.shape) != (n, n):
        raise ValueError(f"W {tuple(W.shape)} and mask {tuple(mask.shape)} must be [.., n, n]")
    mask = mask.to(device=W.device, dtype=torch.bool)
    if torch.triu(mask, diagonal=1).any():
        raise ValueError("mask has entries with j > i; additive fits need a causal mask")
    count = mask.sum()
    if count == 0:
        raise ValueError("mask has no True entry")
    batch_shape = W.shape[:-2]
    w = rearrange(W.double(), "... q k -> (...) q k")
    mf = mask.double()
    w = torch.where(mask, w, 0.0)
    mean = w.sum((-1, -2)) / count
    wc = (w - mean[:, None, None]) * mf

    rhs_parts = [_diag_sums(wc)] + ([wc.sum(-1)] if three_axis else []) + [wc.sum(-2)]
    rhs = rearrange(torch.cat(rhs_parts, dim=-1), "b p -> p b")
    bd = band_of_mask(mask) if dense is not True else None
    if bd is not None and bd.structured:
        beta = additive_solve(bd, rearrange(rhs, "p b -> b p"), three_axis)
    else:
        xtx, factor = normal_system(mask, three_axis, ridge)
        beta = torch.cholesky_solve(rhs, factor)
        for _ in range(refine):
            beta = beta + torch.cholesky_solve(rhs - xtx @ beta, factor)
        beta = rearrange(beta, "p b -> b p")
    a, rest = beta[:, :n], beta[:, n:]
    b, c = (rest[:, :n], rest[:, n:]) if three_axis else (None, rest)

    delta = _delta_index(n, W.device)
    fitted = mean[:, None, None] + a[:, delta] + c[:, None, :]
    if b is not None:
        fitted = fitted + b[:, :, None]
    fitted = fitted * mf

    def unflat(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape(*batch_shape, *x.shape[1:])

    return AdditiveFit(
        a=unflat(a), b=unflat(b), c=unflat(c), mean=mean.reshape(batch_shape), fitted=unflat(fitted)
    )


# ----------------------------------------------------------------------------- D3


@dataclass
class D3Split:
    """Result of :func:`d3_split` (float64, no mask applied), each ``[batch, head_index, query_pos, key_pos]``.

    Attributes:
        W: ``s·a²·q_iᵀR_{j−i}k_j`` on rotated dims ``+ s·q_pass·k_pass`` (the logits).
        f: positional term ``s·a²·q_iᵀR_{j−i}k̄ + s·q_pass·k̄_pass`` (q_i and i−j only).
        g: semantic term ``s·a²·q_rotᵀR_{−Δ0}(k_j−k̄)_rot + s·q_pass·(k_j−k̄)_pass``
            (no dependence on i−j; ``R_0 = I`` for the default ``Δ0 = 0``).
        delta0: the reference offset ``Δ0`` used for ``g``.

    ``W − f − g = s·a²·q_iᵀ(R_{j−i} − R_{−Δ0})(k_j − k̄)`` on the rotated dims only.
    """

    W: Float[Tensor, "batch head_index query_pos key_pos"]
    f: Float[Tensor, "batch head_index query_pos key_pos"]
    g: Float[Tensor, "batch head_index query_pos key_pos"]
    delta0: float = 0


def sequence_key_mean(
    k: Float[Tensor, "batch pos kv_head d_head"], sink: int = 0
) -> Float[Tensor, "batch kv_head d_head"]:
    """Each sequence's own mean pre-rotation key over positions ``>= sink`` (the
    ``per_sequence`` k̄ of docs/method.md §2), float64 ``[batch, kv_head, d_head]``."""
    if not 0 <= sink < k.shape[1]:
        raise ValueError(f"sink={sink} must be in [0, {k.shape[1] - 1}] for {k.shape[1]} positions")
    return k[:, sink:].double().mean(1)


def kbar_batched(k_mean: Tensor, batch: int, n_heads: int) -> Tensor:
    """``k̄`` as ``[batch, head_index, d_head]`` from ``[head, d]`` or ``[batch, head, d]`` (kv heads expanded)."""
    if k_mean.ndim == 2:
        k_mean = k_mean[None].expand(batch, *k_mean.shape)
    elif k_mean.ndim != 3 or k_mean.shape[0] != batch:
        raise ValueError(
            f"k_mean has shape {tuple(k_mean.shape)}; expected [head, d_head] or [batch={batch}, head, d_head]"
        )
    if k_mean.shape[1] != n_heads:
        k_mean = expand_kv(k_mean[:, None], n_heads)[:, 0]
    return k_mean


def _d3_inputs(q: Tensor, k: Tensor, k_mean: Tensor, positions: Tensor, rope: LayerRope, delta0: float = 0):
    """float64 q, k, k̄ ``[batch, head, d]`` (k and k̄ expanded to query heads), their bands,
    the angles ``φ [batch pos band]`` and the reference angle ``ψ0 = Δ0·θ [band]``."""
    n_heads = q.shape[-2]
    if k.shape[-2] != n_heads:
        k = expand_kv(k, n_heads)
    if q.shape[-1] < rope.rotary_dim:
        raise ValueError(f"d_head={q.shape[-1]} is smaller than rotary_dim={rope.rotary_dim}")
    k_mean = kbar_batched(k_mean.to(q.device), q.shape[0], n_heads)
    q, k, k_mean = q.double(), k.double(), k_mean.double()
    r = rope.rotary_dim
    zq, zk, zkbar = (to_bands(x, r, rope.layout) for x in (q, k, k_mean))
    # float32 angles exactly as the model computes them, then float64 phasors
    phi = angles(positions.to(q.device), rope).double()  # batch pos band
    psi0 = angles(torch.tensor([delta0], dtype=torch.float64, device=q.device), rope).double()[0]
    return q, k, k_mean, zq, zk, zkbar, phi, psi0


#: the maps :func:`d3_terms` can compute: the logits and the two terms
D3_TERMS = ("W", "f", "g")


def d3_terms(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    k_mean: Float[Tensor, "head_index d_head"] | Float[Tensor, "batch head_index d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
    delta0: float = 0,
    *,
    terms: Sequence[str] = D3_TERMS,
) -> dict[str, Float[Tensor, "batch head_index query_pos key_pos"]]:
    """The maps of :func:`d3_split` named in ``terms`` (from ``W``, ``f``, ``g``), and only those: a caller that
    needs one term does not pay for the other two (each is one batched complex product over the bands).

    The same inputs and arithmetic as :func:`d3_split`, so each map equals :func:`d3_split`'s bit for bit.

    Returns:
        ``{term: float64 [batch, head_index, query_pos, key_pos]}`` in the order of ``terms``.

    Raises:
        ValueError: an unknown or repeated term, none, or one string instead of a sequence of names.
    """
    if isinstance(terms, str) or not terms or len(set(terms)) < len(terms) or any(t not in D3_TERMS for t in terms):
        raise ValueError(f"terms={tuple(terms)!r}: one or more distinct names of {', '.join(D3_TERMS)}")
    q, k, k_mean, zq, zk, zkbar, phi, psi0 = _d3_inputs(q, k, k_mean, positions, rope, delta0)
    r, s, a2 = rope.rotary_dim, rope.score_scale, rope.attention_scaling**2
    e = torch.polar(torch.ones_like(phi), phi)[:, :, None, :]  # batch pos 1 band
    zq_rot = zq * e if "W" in terms or "f" in terms else zq

    def band_dot(x: Tensor, y: Tensor) -> Tensor:
        # Re Σ_m x_m conj(y_m): [b i h m], [b j h m] -> [b h i j]
        return torch.einsum("bihm,bjhm->bhij", x, y.conj()).real

    qp, kp, kbp = q[..., r:], k[..., r:], k_mean[..., r:]
    out: dict[str, Tensor] = {}
    for t in terms:
        if t == "W":
            m = a2 * band_dot(zq_rot, zk * e)
            if q.shape[-1] > r:
                m = m + torch.einsum("bihd,bjhd->bhij", qp, kp)
        elif t == "f":
            m = a2 * band_dot(zq_rot, zkbar[:, None] * e)  # k̄ rotated to every key position
            if q.shape[-1] > r:
                m = m + torch.einsum("bihd,bhd->bhi", qp, kbp)[..., None]
        else:
            # q_iᵀR_{−Δ0}x = Re Σ_m zq_m e^{iψ0_m} conj(x_m)
            zq_ref = zq * torch.polar(torch.ones_like(psi0), psi0) if delta0 else zq
            m = a2 * band_dot(zq_ref, zk - zkbar[:, None])
            if q.shape[-1] > r:
                m = m + torch.einsum("bihd,bjhd->bhij", qp, kp - kbp[:, None])
        out[t] = s * m
    return out


def d3_split(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    k_mean: Float[Tensor, "head_index d_head"] | Float[Tensor, "batch head_index d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
    delta0: float = 0,
) -> D3Split:
    """D3 split of the logits from PRE-rotation ``q``, ``k`` and the mean key ``k_mean``.

    ``k`` (and ``k_mean``) may hold kv-heads; they are expanded to query heads. ``k_mean`` is
    one k̄ per head ``[head, d_head]`` (global) or one per sequence ``[batch, head, d_head]``.
    ``delta0``: reference offset Δ0 of the semantic term ``g_Δ0 = s·q_iᵀR_{−Δ0}(k_j − k̄)``
    (0 = plain D3; the angle is ``Δ0·θ_m`` computed like the model's, float32). Computed in
    the complex band picture with batched matmuls, O(N²·bands) per head (:func:`d3_terms` computes
    a subset of the maps). Returns a :class:`D3Split` of float64 ``[batch, head_index, query_pos, key_pos]`` maps.
    """
    return D3Split(**d3_terms(q, k, k_mean, positions, rope, delta0), delta0=delta0)


def d3_logits(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    k_mean: Float[Tensor, "head_index d_head"] | Float[Tensor, "batch head_index d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
    delta0: float = 0,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """The D3 approximation of the logits, ``f + g_Δ0`` of :func:`d3_split` (all entries, no mask).

    ``f = s·q_iᵀR_{j−i}k̄`` (positional), ``g_Δ0 = s·q_iᵀR_{−Δ0}(k_j − k̄)`` (semantic at the
    reference offset Δ0). Substituting it for the model's scores is docs/method.md §5's sufficiency
    test (LM-Infinite's "disentangled" approximation with Δ0 = their cap). Returns float64
    ``[batch, head_index, query_pos, key_pos]``.
    """
    t = d3_terms(q, k, k_mean, positions, rope, delta0, terms=("f", "g"))
    return t["f"] + t["g"]


def d3_bound(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos head_index d_head"],
    k_mean: Float[Tensor, "head_index d_head"] | Float[Tensor, "batch head_index d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
    rows: Int[Tensor, "n_rows"] | None = None,
    max_chunk_bytes: int = 64 * 2**20,
    delta0: float = 0,
) -> Float[Tensor, "batch head_index n_rows key_pos"]:
    """Per-entry bound on ``|W − f − g_Δ0|`` of :func:`d3_split` (same ``delta0``).

    ``s·a²·Σ_m ‖q_i^(m)‖·‖k_j^(m) − k̄^(m)‖·2|sin((φ_{i,m} − φ_{j,m} − Δ0·θ_m)/2)|`` with the
    actual angles ``φ = angles(positions, rope)`` (valid for any position ids). It follows
    from ``|e^{ia} − e^{ib}| = 2|sin((a − b)/2)|`` alone, so it holding is a check of the
    code, not a finding about a model. ``rows`` selects query positions (``None`` = all).
    Chunked over rows so each temporary stays under ``max_chunk_bytes`` (peak ≈ 3×).
    Returns float64 ``[batch, head_index, n_rows, key_pos]``.
    """
    q, k, k_mean, zq, zk, zkbar, phi, psi0 = _d3_inputs(q, k, k_mean, positions, rope, delta0)
    if rows is None:
        rows = torch.arange(q.shape[1], device=q.device)
    rows = rows.to(q.device)
    qn = zq.abs()[:, rows]  # b i h m
    kn = (zk - zkbar[:, None]).abs()  # b j h m
    n_b, n_k, n_h, n_m = kn.shape
    per_row = max(1, n_b * n_k * n_h * n_m * 8)
    chunk = max(1, max_chunk_bytes // per_row)
    scale = rope.score_scale * rope.attention_scaling**2
    out = []
    for start in range(0, len(rows), chunk):
        sl = slice(start, start + chunk)
        dphi = phi[:, rows[sl], None, :] - phi[:, None, :, :] - psi0  # b i j m
        sin = 2 * (dphi / 2).sin().abs()
        weighted = kn[:, None] * sin[:, :, :, None, :]  # b i j h m
        out.append(torch.einsum("bihm,bijhm->bhij", qn[:, sl], weighted))
    if not out:
        return torch.zeros(n_b, n_h, 0, n_k, dtype=torch.float64, device=q.device)
    return scale * torch.cat(out, dim=-2)


# ----------------------------------------------------------------------------- scores


def _masked_pair(x: Tensor, y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float64 ``x``, ``y`` broadcast together with off-mask entries zeroed, and the float mask."""
    mask = mask.to(device=x.device, dtype=torch.bool)
    x = torch.where(mask, x.double(), 0.0)
    y = torch.where(mask, y.to(x.device).double(), 0.0)
    x, y = torch.broadcast_tensors(x, y)
    return x, y, mask.double()


def _centre(x: Tensor, mf: Tensor, n: Tensor) -> Tensor:
    return (x - (x.sum((-1, -2)) / n)[..., None, None]) * mf


def _degenerate(ss: Tensor, ref: Tensor, n: Tensor) -> Tensor:
    """True where a centred sum of squares is zero up to float64 rounding of ``ref``'s values."""
    return ss <= n * (1e-12 * ref.abs().amax((-1, -2))) ** 2


def _corr(xc: Tensor, yc: Tensor, x_ref: Tensor, y_ref: Tensor, n: Tensor) -> Tensor:
    """Correlation of centred (off-mask zero) maps; NaN where a side is degenerate."""
    sxx, syy = (xc * xc).sum((-1, -2)), (yc * yc).sum((-1, -2))
    r = (xc * yc).sum((-1, -2)) / (sxx * syy).sqrt()
    bad = _degenerate(sxx, x_ref, n) | _degenerate(syy, y_ref, n) | (n < 2)
    return torch.where(bad, torch.nan, r)


def pearson_r(
    x: Float[Tensor, "*batch query_pos key_pos"],
    y: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "*batch"]:
    """Pearson correlation of ``x`` and ``y`` over the masked entries, float64 ``[*batch]``.

    NaN where either side is constant over the mask (zero variance up to float64 rounding,
    i.e. spread < 1e-12 of its largest magnitude) or the mask has fewer than 2 entries —
    never a made-up number.
    """
    x, y, mf = _masked_pair(x, y, mask)
    n = mf.sum()
    return _corr(_centre(x, mf, n), _centre(y, mf, n), x, y, n)


def r_squared(
    target: Float[Tensor, "*batch query_pos key_pos"],
    approx: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "*batch"]:
    """``1 − SS_res/SS_tot`` of ``approx`` for ``target`` over the masked entries, float64 ``[*batch]``.

    Can be negative (worse than the mean). NaN where ``target`` is constant over the mask.
    """
    t, p, mf = _masked_pair(target, approx, mask)
    n = mf.sum()
    tc = _centre(t, mf, n)
    ss_tot = (tc * tc).sum((-1, -2))
    ss_res = ((t - p) ** 2).sum((-1, -2))
    return torch.where(_degenerate(ss_tot, t, n) | (n < 1), torch.nan, 1 - ss_res / ss_tot)


def within_row_r(
    x: Float[Tensor, "*batch query_pos key_pos"],
    y: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> Float[Tensor, "*batch"]:
    """Pearson r after removing each row's masked mean from ``x`` and ``y``, float64 ``[*batch]``.

    Softmax ignores row constants, so this is the score that matters for attention. Rows
    with fewer than 2 masked entries are dropped. NaN when either side does not vary within
    rows (judged against its raw magnitude, so pure row constants give NaN, not noise).
    """
    mask = mask.to(device=x.device, dtype=torch.bool)
    mask = mask & (mask.sum(-1, keepdim=True) >= 2)
    x, y, mf = _masked_pair(x, y, mask)
    cnt = mf.sum(-1, keepdim=True).clamp(min=1)
    xr = (x - x.sum(-1, keepdim=True) / cnt) * mf
    yr = (y - y.sum(-1, keepdim=True) / cnt) * mf
    n = mf.sum()
    # row-centred maps have zero masked mean already; centre again only against rounding
    return _corr(_centre(xr, mf, n), _centre(yr, mf, n), x, y, n)


def score_maps(
    target: Float[Tensor, "*batch query_pos key_pos"],
    approx: Float[Tensor, "*batch query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
) -> dict[str, Float[Tensor, "*batch"]]:
    """``{"r": pearson_r, "r2": r_squared, "r_within": within_row_r}`` of ``approx`` vs ``target``."""
    return {
        "r": pearson_r(target, approx, mask),
        "r2": r_squared(target, approx, mask),
        "r_within": within_row_r(target, approx, mask),
    }


def d3_bound_rows(qn: Tensor, k: Tensor, k_mean: Tensor, phi: Tensor, rows: Tensor, rope: LayerRope, chunk: int = 8, *,
                  rows_list: Sequence[int] | None = None, shared: bool | None = None) -> Tensor:
    """``Σ_m |q_im|·|k_jm − k̄_m|·2|sin((φ_im − φ_jm)/2)|`` on query ``rows``, causal part ``j ≤ i`` (0 elsewhere).

    ``qn``: float64 ``[b, rows, head_index, band]`` (``|q|`` per band); ``k``: ``[b, key_pos, kv_head, d_head]``;
    ``k_mean``: ``[kv_head, d_head]`` or ``[b, kv_head, d_head]``; ``phi``: float64 ``[b, pos, band]``.
    The key side is built once per kv-group (GQA: no repeat per query head) and the rows are
    batched ``chunk`` at a time (one masked ``sin`` table per chunk, shared by all sequences when
    their positions are). ``rows_list`` (``rows`` as a host list) and ``shared`` (whether every sequence has the same
    positions), where the caller knows them, spare a read from the device. Returns float64 ``[(b head_index), rows,
    key_pos]``.
    """
    b, n, kv = k.shape[:3]
    kb = kbar_batched(k_mean.to(k.device).double(), b, kv)  # b kv d
    zk, zb = to_bands(k.double(), rope.rotary_dim, rope.layout), to_bands(kb, rope.rotary_dim, rope.layout)
    return band_bound_rows(qn, (zk - zb[:, None]).abs(), phi, rows, chunk, rows_list=rows_list, shared=shared)


def band_bound_rows(qn: Tensor, kn: Tensor, phi: Tensor, rows: Tensor, chunk: int = 8, *,
                    rows_list: Sequence[int] | None = None, shared: bool | None = None,
                    tables: dict | None = None) -> Tensor:
    """:func:`d3_bound_rows` from the band magnitudes: ``Σ_m qn[b, i, h, m]·kn[b, j, kv(h), m]·2|sin((φ_im − φ_jm)/2)|``
    on query ``rows``, ``j ≤ i`` (0 elsewhere). ``qn``: ``[b, rows, head_index, band]``; ``kn``: ``[b, key_pos,
    kv_head, band]`` (``|k_j − k̄|`` per band), both float64 or both float32 (the products then in float32); ``phi``:
    float64 ``[b, pos, band]`` — the phase differences and their sines are formed in float64 whatever the products'
    dtype (the difference of two float32 angles is exact there; in float32 it would round by up to an ulp of the
    angle, ~1e-3 rad at 16 k positions). ``tables``: a dict that keeps each chunk's sin table (in ``kn``'s dtype) for
    the next calls with the same ``phi`` and ``rows`` (the caller's to key), per (chunk, sequences of ``phi`` used,
    dtype). Returns ``[(b head_index), rows, key_pos]`` in ``kn``'s dtype."""
    b, n, kv = kn.shape[:3]
    g = qn.shape[2] // kv
    dt = kn.dtype
    # band-major layouts: each step is a product [g, band] × [band, keys] per (sequence, kv-group, row) — an output
    # of g rows and many keys, 5× faster on the CPU than [keys, band] × [band, g] (a product only g columns wide)
    kn = rearrange(kn, "b j kv m -> b kv 1 m j").contiguous()  # (one small copy: the products read it per row)
    qg = rearrange(qn.to(dt), "b r (kv g) m -> b kv r g m", kv=kv)
    if shared is None:
        shared = bool((phi == phi[:1]).all())  # same positions in every sequence (the default)
    ph = phi[:1] if shared else phi
    pht = ph.transpose(1, 2)  # b' m pos
    out = torch.zeros(b, kv, g, len(rows), n, dtype=dt, device=kn.device)
    rows_l = list(rows_list) if rows_list is not None else rows.tolist()
    m, rc_max = kn.shape[-2], min(chunk, len(rows_l))
    kept = None if tables is None else tables.setdefault((chunk, ph.shape[0], n, dt), [])
    reuse = bool(kept)
    # flat scratches sized for the longest chunk, every chunk's tables written into their leading part in place:
    # no temporary per operation, and no heap growth from tables of a new size at every chunk (Gemma3, 1 × 8 192
    # tokens: the resident memory climbed 3.3 → 3.9 GB within one layer's bound check when they were fresh)
    sin_buf = None if reuse else torch.empty(ph.shape[0] * rc_max * n * m, dtype=torch.float64, device=kn.device)
    t_buf = torch.empty(b * kv * rc_max * n * m, dtype=dt, device=kn.device)
    for ci, s in enumerate(range(0, len(rows_l), chunk)):
        r = slice(s, s + chunk)
        rc, jn = len(rows_l[r]), max(rows_l[r]) + 1  # keys j > max row are 0 for the whole chunk
        if reuse:
            sin = kept[ci]
        else:
            assert sin_buf is not None
            sin = sin_buf[: ph.shape[0] * rc * m * jn].view(ph.shape[0], rc, m, jn)  # b' r m j
            torch.sub(ph[:, rows[r], :, None], pht[:, None, :, :jn], out=sin)  # φ_i − φ_j, then 2|sin(·/2)| on j ≤ i
            sin.div_(2).sin_().abs_().mul_(2).mul_(
                (torch.arange(jn, device=kn.device) <= rows[r, None].to(kn.device))[:, None, :])
            if dt != torch.float64 or kept is not None:
                sin = sin.to(dt, copy=True)  # (kept: a copy, the scratch is the next chunk's)
            if kept is not None:
                kept.append(sin)
        t = t_buf[: b * kv * rc * m * jn].view(b, kv, rc, m, jn)
        torch.mul(kn[..., :jn], sin[:, None], out=t)  # (contiguous: no copy in the view below)
        prod = torch.bmm(qg[:, :, r].reshape(b * kv * rc, g, m), t.view(b * kv * rc, m, jn))  # (b kv r) g j
        out[:, :, :, r, :jn] = prod.view(b, kv, rc, g, jn).transpose(2, 3)
    return out.view(b * kv * g, len(rows), n)
