"""METHOD.md §2 runner: D1 / D2 / D3 decompositions of every head's logit map, scored
honestly (r, R², within-row r; with and without the sink keys) beside a random-init twin.

Flow: a reference pass (:func:`reference_key_means`) gives ``k̄`` per layer and kv-group
from sequences DISJOINT from the analysed ones (sink positions excluded); one streaming
pass (:func:`posgen_tl.capture.stream_qk`) then scores, for each (batch, layer) and all
heads at once, the model's logits ``W = s·rot_q·rot_k`` against

* D1 / D2 — the least-squares additive fits of :func:`posgen_tl.decompose.fit_additive`
  (same ridge and refinement), refitted on each mask (sink kept / sink excluded);
* D3 — ``f + g`` of :func:`posgen_tl.decompose.d3_split` (``k̄`` expanded to query heads),

and checks the D3 bound ``|W − f − g| ≤ bound`` in float64 on ``bound_rows`` evenly
spaced query rows (same numbers as :func:`posgen_tl.decompose.d3_split` /
:func:`posgen_tl.decompose.d3_bound`, computed with real matmuls and only on ``j ≤ i``; a
theorem, so the reported fraction must be 1 — up to a float64 rounding allowance of
``1e-10·(|W| + |f| + |g|)``).

Speed (the issue asks ≤ 2× a forward pass): nothing of size ``n²`` per map is done in
float64 except on the bound rows. Scores are computed from per-row moments ``Σx, Σy, Σx²,
Σy², Σxy`` (float32 row sums, float64 combination; maps are first shifted by a per-map
constant, the masked mean of the bound rows, so the moments do not cancel).
The additive fits never materialise their fitted maps: the whole ridge + iterated-Tikhonov
solve of ``fit_additive`` is one cached linear operator ``P`` per mask, and the moments of
``mean + a[i−j] + b[i] + c[j]`` come from prefix sums, one matrix-vector product with the
map (``Σ_j x_ij c_j``), one with its diagonal view (``Σ_d x[i,i−d] a_d``) and an FFT
convolution (``Σ_j a_{i−j} c_j``). ``f + g`` is one float32 matmul of width ``2·d_head``.
Tests check every number against the reference functions of :mod:`posgen_tl.decompose`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.corpus import CorpusLike, corpus_tokens
from posgen_tl.decompose import normal_system, causal_mask
from posgen_tl.features import BandStats
from posgen_tl.rope import angles, expand_kv, rotate, to_bands

__all__ = [
    "ESTIMATORS",
    "split_tokens",
    "reference_key_means",
    "decompose_model",
    "decompose_with_twin",
    "summarize_decomposition",
    "layer_group",
]

ESTIMATORS = ("D1", "D2", "D3")
SCORE_COLUMNS = ("r", "r2", "r_within", "d3_err_mean", "d3_bound_mean", "d3_bound_holds")
_RIDGE, _REFINE = 1e-6, 3  # fit_additive's defaults
_BOUND_RTOL = 1e-10  # float64 rounding allowance in the bound check (relative to |W|+|f|+|g|)


def layer_group(layer: int, n_layers: int) -> str:
    """``"early"`` / ``"middle"`` / ``"late"``: thirds of the model's layers."""
    third = 3 * layer // max(n_layers, 1)
    return ("early", "middle", "late")[min(third, 2)]


# ----------------------------------------------------------------------------- tokens, k̄


def split_tokens(
    model: Any, corpus: CorpusLike = None, *, n_seq: int = 16, seq_len: int = 512, n_ref: int = 8
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "n_ref pos"]]:
    """``(analysed [n_seq, seq_len], reference [n_ref, seq_len])``, disjoint sequences.

    Text corpora: ``corpus_tokens(..., n_seq=n_seq + n_ref)``, the analysed sequences first,
    the reference ones after them. A token tensor: its LAST ``n_ref`` rows are the
    reference, the first ``min(n_seq, rows − n_ref)`` rows are analysed.
    """
    if n_ref < 1:
        raise ValueError(f"n_ref must be at least 1 (k̄ needs reference tokens), got {n_ref}")
    if isinstance(corpus, Tensor):
        t = corpus if corpus.ndim == 2 else corpus[None]
        if t.shape[0] <= n_ref:
            raise ValueError(f"a token tensor of {t.shape[0]} rows cannot give {n_ref} reference rows and ≥1 analysed")
        return t[: t.shape[0] - n_ref][:n_seq], t[t.shape[0] - n_ref :]
    toks = corpus_tokens(model, corpus, seq_len=seq_len, n_seq=n_seq + n_ref)
    return toks[:n_seq], toks[n_seq:]


def reference_key_means(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    layers: Sequence[int] | None = None,
    *,
    sink: int = 1,
    batch_size: int = 4,
    progress: bool = True,
    extra_hooks: Sequence = (),
) -> dict[int, Float[Tensor, "kv_head d_head"]]:
    """Mean PRE-rotation key ``k̄`` per layer and kv-group over ``tokens`` (positions ``< sink``
    excluded), streamed with :class:`posgen_tl.features.BandStats`. Returns ``{layer: [kv_head, d_head]}`` float64."""
    stats: dict[int, BandStats] = {}

    def acc(c: QKCapture) -> None:
        if c.layer not in stats:
            stats[c.layer] = BandStats(c.k.shape[-2], c.k.shape[-1], c.rope.rotary_dim, c.rope.layout)
        keep = torch.ones(c.k.shape[:2], dtype=torch.bool, device=c.k.device)
        keep[:, :sink] = False
        stats[c.layer].update(c.k, keep)

    stream_qk(model, tokens, acc, layers, batch_size=batch_size, extra_hooks=extra_hooks,
              progress="k̄ reference" if progress else False)
    return {layer: s.mean() for layer, s in stats.items()}


# ----------------------------------------------------------------------------- masks and fit operators


@dataclass
class _Geometry:
    """One scoring mask (``j ∈ [max(sink, i−w+1), i]``) and everything derived from it."""

    n: int
    sink: int
    window: int | None
    mask: Tensor  # bool [i j]
    cnt: Tensor  # float64 [i] entries per row
    dmask: Tensor  # float64 [i d]: (i, i−d) in mask
    maskd: Tensor  # float64 [i j]
    ncol: Tensor  # float64 [j]
    ndiag: Tensor  # float64 [d]
    amask: Tensor  # float64 [d]: distances in use
    ops: dict  # three_axis -> P [p, p] float64


_GEOMS: dict[tuple, _Geometry] = {}


def _geometry(n: int, sink: int, window: int | None, device: torch.device | str = "cpu") -> _Geometry:
    """Mask ``j ∈ [max(sink, i−w+1), i]`` with its counts and fit operators (LRU-cached, on ``device``)."""
    key = (n, sink, window, str(device))
    if key in _GEOMS:
        return _GEOMS[key]
    mask = causal_mask(n, sink, window)
    md = mask.double()
    i = torch.arange(n)
    d_idx = (i[:, None] - i[None, :])  # [i, d] -> j = i − d
    dmask = torch.where(d_idx >= 0, md[i[:, None].expand(n, n), d_idx.clamp(min=0)], 0.0)
    ops = {}
    for three in (True, False):
        xtx, factor = normal_system(mask, three, _RIDGE)
        m_inv = torch.cholesky_inverse(factor)
        e = torch.eye(m_inv.shape[0], dtype=m_inv.dtype) - m_inv @ xtx
        p = m_inv
        for _ in range(_REFINE):  # β_{t+1} = β_t + M(r − Aβ_t)  ⇒  β = Σ_t E^t M r
            p = m_inv + e @ p
        ops[three] = p
    g = _Geometry(n, sink, window, mask, md.sum(-1), dmask, md, md.sum(-2), dmask.sum(-2), (dmask.sum(-2) > 0).double(), ops)
    for name in ("mask", "cnt", "dmask", "maskd", "ncol", "ndiag", "amask"):
        setattr(g, name, getattr(g, name).to(device))
    g.ops = {k: v.to(device) for k, v in ops.items()}
    if len(_GEOMS) >= 6:
        _GEOMS.pop(next(iter(_GEOMS)))
    _GEOMS[key] = g
    return g


# ----------------------------------------------------------------------------- moments → scores


@dataclass
class _Moments:
    """Per-map, per-row masked sums (float64 ``[maps, query_pos]``) of target x and approx y."""

    sx: Tensor
    sy: Tensor
    sxx: Tensor
    syy: Tensor
    sxy: Tensor
    xmax: Tensor  # [maps] magnitude of x (for the degeneracy test)
    ymax: Tensor


def _scores(m: _Moments, g: _Geometry) -> dict[str, Tensor]:
    """r, R², within-row r from moments, with :mod:`posgen_tl.decompose`'s NaN rules."""
    n = g.cnt.sum()
    sx, sy = m.sx.sum(-1), m.sy.sum(-1)
    vx = m.sxx.sum(-1) - sx * sx / n
    vy = m.syy.sum(-1) - sy * sy / n
    cov = m.sxy.sum(-1) - sx * sy / n

    def degen(ss: Tensor, ref: Tensor, cnt: Tensor) -> Tensor:
        return ss <= cnt * (1e-12 * ref) ** 2

    r = torch.where(degen(vx, m.xmax, n) | degen(vy, m.ymax, n) | (n < 2), torch.nan, cov / (vx * vy).sqrt())
    ssres = m.sxx.sum(-1) - 2 * m.sxy.sum(-1) + m.syy.sum(-1)
    r2 = torch.where(degen(vx, m.xmax, n), torch.nan, 1 - ssres / vx)
    ok = (g.cnt >= 2).double()
    c = g.cnt.clamp(min=1)
    wx = ((m.sxx - m.sx**2 / c) * ok).sum(-1)
    wy = ((m.syy - m.sy**2 / c) * ok).sum(-1)
    wxy = ((m.sxy - m.sx * m.sy / c) * ok).sum(-1)
    nw = (g.cnt * ok).sum()
    rw = torch.where(degen(wx, m.xmax, nw) | degen(wy, m.ymax, nw) | (nw < 2), torch.nan, wxy / (wx * wy).sqrt())
    return {"r": r, "r2": r2, "r_within": rw}


def _rowdot(x: Tensor, y: Tensor, cache: dict | None = None) -> Tensor:
    """``Σ_j x[..., i, j]·y[..., i, j]`` → float64 ``[maps, query_pos]`` (float32 products and sums).

    The product goes to a scratch buffer kept in ``cache`` (a fresh map-sized temporary per
    call costs more in page faults than the arithmetic)."""
    tmp = None if cache is None else cache.get("tmp")
    if tmp is None or tmp.shape != x.shape or tmp.device != x.device:
        tmp = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if cache is not None:
            cache["tmp"] = tmp
    return torch.mul(x, y, out=tmp).sum(-1).double()


def _mask_(x: Tensor, g: _Geometry) -> Tensor:
    """Zero the off-mask entries of ``x [maps, i, j]`` in place (``g.sink`` must be 0)."""
    x.tril_()
    if g.window is not None:
        x.triu_(-(g.window - 1))
    return x


def _absmax(x: Tensor) -> Tensor:
    """``max |x|`` over the last two axes, float64 ``[maps]`` (no temporary the size of x)."""
    return torch.maximum(x.amin((-1, -2)).abs(), x.amax((-1, -2)).abs()).double()


class _Target:
    """The shifted, masked logit maps of one (batch, layer) and their sink-kept row sums.

    ``x = (W − μ)·mask₀`` (``μ`` a per-map shift, the masked mean of the bound rows; any
    constant works, it only keeps the moments from cancelling) lives in the right half of a
    zero-padded ``[maps, n, 2n]`` buffer so that ``view[m, i, e] = x[m, i, i − (n−1−e)]`` is a
    strided VIEW (no copy). The buffer is kept in ``cache`` and reused across the layers of
    one run (its left half stays zero).
    """

    def __init__(self, W: Float[Tensor, "maps query_pos key_pos"], g0: _Geometry, mu: Tensor, cache: dict) -> None:
        nm, n = W.shape[0], W.shape[-1]
        buf = cache.get("buf")
        if buf is None or buf.shape != (nm, n, 2 * n) or buf.device != W.device:
            buf = cache["buf"] = W.new_zeros(nm, n, 2 * n)
        x = buf[..., n:]
        x.copy_(W)
        _mask_(x.sub_(mu[:, None, None]), g0)
        self.mu, self.x, self.n, self.cache = mu, x, n, cache
        self.view = buf.as_strided((nm, n, n), (2 * n * n, 2 * n + 1, 1), 1)  # e = n−1−d
        self.sx = x.sum(-1).double()
        self.sxx = _rowdot(x, x, cache)
        self.col = x.sum(-2).double()
        self.diag = self.view.sum(-2).double().flip(-1)  # [maps, d]
        self.xmax = _absmax(x) + mu.double().abs()

    def sink_cols(self, sink: int) -> Tensor:
        return self.x[..., :sink]

    def moments_x(self, sink: int) -> tuple[Tensor, Tensor]:
        """Row sums ``Σx``, ``Σx²`` over the mask with the first ``sink`` keys excluded."""
        if sink == 0:
            return self.sx, self.sxx
        s = self.sink_cols(sink).double()
        return self.sx - s.sum(-1), self.sxx - (s * s).sum(-1)


def _fit_solve(t: _Target, g: _Geometry, three_axis: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mean, a, b, c)`` of ``fit_additive(x, g.mask, three_axis)`` (float64; ``b = 0`` for D2)."""
    n, s = t.n, g.sink
    sx, _ = t.moments_x(s)
    diag, col = t.diag.clone(), t.col.clone()
    if s:
        cols = t.sink_cols(s).double()
        for c in range(s):  # entry (i, c) sits on diagonal d = i − c
            diag[:, : n - c] -= cols[:, c:, c]
        col[:, :s] = 0.0
    mean = sx.sum(-1) / g.cnt.sum()
    parts = [diag - mean[:, None] * g.ndiag] + ([sx - mean[:, None] * g.cnt] if three_axis else [])
    rhs = torch.cat(parts + [col - mean[:, None] * g.ncol], dim=-1)
    beta = rhs @ g.ops[three_axis].T
    a, c_ = beta[:, :n], beta[:, -n:]
    b = beta[:, n : 2 * n] if three_axis else torch.zeros_like(a)
    return mean, a, b, c_


def _fit_moments(t: _Target, g: _Geometry, fit: tuple, xc: Tensor, xa: Tensor) -> _Moments:
    """Moments of x and of the fitted map ``mean + a[i−j] + b[i] + c[j]`` on mask ``g``.

    ``xc = Σ_j x_ij c_j`` and ``xa = Σ_d x[i, i−d] a_d`` over the sink-KEPT mask (``[maps, i]``).
    """
    n, s, dev = t.n, g.sink, t.x.device
    mean, a, b, c_ = fit
    sx, sxx = t.moments_x(s)
    mi = mean[:, None] + b
    a1, a2 = a @ g.dmask.T, (a * a) @ g.dmask.T
    c1, c2 = c_ @ g.maskd.T, (c_ * c_) @ g.maskd.T
    am = a * g.amask
    cm = c_ * (torch.arange(n, device=dev) >= s).double()
    conv = torch.fft.irfft(torch.fft.rfft(am, 2 * n) * torch.fft.rfft(cm, 2 * n), 2 * n)[:, :n]
    sy = g.cnt * mi + a1 + c1
    syy = g.cnt * mi * mi + a2 + c2 + 2 * mi * (a1 + c1) + 2 * conv
    if s:
        cols = t.sink_cols(s).double()
        xc = xc - (cols * c_[:, None, :s]).sum(-1)
        ii, cc = torch.arange(n, device=dev)[:, None], torch.arange(s, device=dev)[None, :]
        a_ic = a[:, (ii - cc).clamp(min=0)] * (ii >= cc)  # [maps, i, c]: a_{i−c}
        xa = xa - (cols * a_ic).sum(-1)
    sxy = mi * sx + xc + xa
    ymax = mean.abs() + b.abs().amax(-1) + a.abs().amax(-1) + c_.abs().amax(-1)
    return _Moments(sx, sy, sxx, syy, sxy, t.xmax, ymax)


def _all_fit_moments(t: _Target, geoms: dict[int, _Geometry]) -> dict[tuple[int, str], _Moments]:
    """D1 and D2 on every mask; the two map-sized products for all fits in one pass each."""
    fits = {(s, est): _fit_solve(t, g, est == "D1") for s, g in geoms.items() for est in ("D1", "D2")}
    keys = list(fits)
    cs = torch.stack([fits[k][3] for k in keys], -1).float()  # [maps, j, fits]
    as_ = torch.stack([fits[k][1].flip(-1) for k in keys], -1).float()
    xc, xa = torch.bmm(t.x, cs).double(), torch.bmm(t.view, as_).double()
    return {k: _fit_moments(t, geoms[k[0]], fits[k], xc[..., i], xa[..., i]) for i, k in enumerate(keys)}


def _d3_moments(t: _Target, y: Tensor, g0: _Geometry, sinks: Sequence[int]) -> dict[int, _Moments]:
    """Moments of x and the D3 approximation ``y = f + g`` (float32 ``[maps, i, j]``, modified in place)."""
    _mask_(y.sub_(t.mu[:, None, None]), g0)
    sy, syy, sxy = y.sum(-1).double(), _rowdot(y, y, t.cache), _rowdot(t.x, y, t.cache)
    ymax = _absmax(y) + t.mu.double().abs()
    out = {}
    for s in sinks:
        sx, sxx = t.moments_x(s)
        if s:
            yc, xc = y[..., :s].double(), t.sink_cols(s).double()
            out[s] = _Moments(sx, sy - yc.sum(-1), sxx, syy - (yc * yc).sum(-1), sxy - (xc * yc).sum(-1), t.xmax, ymax)
        else:
            out[s] = _Moments(sx, sy, sxx, syy, sxy, t.xmax, ymax)
    return out


# ----------------------------------------------------------------------------- W and D3 pieces


def _maps(c: QKCapture, k_mean: Tensor) -> tuple[Tensor, Tensor]:
    """``(W, f + g)`` float32 ``[(batch head_index), query_pos, key_pos]``, grouped by kv-head (no repeat).

    ``W = s·R_i q_i · R_j k_j`` (= ``c.logits()``); ``f + g`` of :func:`d3_split` as ONE matmul of
    width ``2·d_head``: ``[s·R_i q_i | s·Λq_i] · [R_j k̄ | k_j − k̄]``, ``Λ = a²`` on rotary dims, 1 on pass dims.
    """
    rope, h, kv = c.rope, c.n_heads, c.k.shape[-2]
    kbar = k_mean.to(c.k.device, torch.float32)
    b, n = c.k.shape[:2]
    rot_kbar = rotate(kbar[None, None].expand(b, n, *kbar.shape), c.positions, rope)
    lam = torch.ones(c.q.shape[-1], device=c.q.device)
    lam[: rope.rotary_dim] = rope.attention_scaling**2
    q2 = rearrange(torch.cat([c.rot_q, c.q * lam], dim=-1) * rope.score_scale,
                   "b i (kv g) d -> b kv (g i) d", kv=kv).contiguous()
    k_w = rearrange(c.rot_k, "b j kv d -> b kv d j")
    k_y = rearrange(torch.cat([rot_kbar, c.k - kbar], dim=-1), "b j kv d -> b kv d j")
    d = c.q.shape[-1]
    w = torch.matmul(q2[..., :d], k_w)
    y = torch.matmul(q2, k_y)
    shape = "b kv (g i) j -> (b kv g) i j"
    return rearrange(w, shape, i=n), rearrange(y, shape, i=n)


def _bound_check(c: QKCapture, k_mean: Tensor, rows: Tensor, geoms: dict[int, _Geometry]) -> dict[int, dict[str, Tensor]]:
    """D3 check on query ``rows``: mean |W − f − g|, mean bound (as :func:`d3_bound`) and
    fraction of entries within the bound, over the masked entries of ``rows`` per mask.

    ``W, f, g`` in float64 as in :func:`d3_split` (float32 angles, float64 phasors), via real
    matmuls on ``(Re, Im)`` band coordinates; the bound (float64) only on ``j ≤ i``, with the
    ``2|sin((φ_i − φ_j)/2)|`` table computed once when all sequences share positions.
    Each ``[batch, head_index]``, flattened to ``[(batch head_index)]``.
    """
    rope, h, r = c.rope, c.n_heads, c.rope.rotary_dim
    q, k = c.q.double(), expand_kv(c.k, h).double()
    kb = expand_kv(k_mean.to(q.device), h).double()
    zq, zk, zb = (to_bands(x, r, rope.layout) for x in (q, k, kb))
    phi = angles(c.positions.to(q.device), rope).double()  # b pos m
    e = torch.polar(torch.ones_like(phi), phi)[:, :, None, :]

    def re(z: Tensor) -> Tensor:  # Re(x·conj(y)) = [xr, xi]·[yr, yi]
        return rearrange(torch.view_as_real(z), "b p h m two -> b h p (m two)")

    a2, s, n = rope.attention_scaling**2, rope.score_scale, q.shape[1]
    qr, qb = re((zq * e)[:, rows]), re(zq[:, rows])
    w = a2 * qr @ re(zk * e).transpose(-1, -2)
    f = a2 * qr @ re(zb * e).transpose(-1, -2)
    g = a2 * qb @ re(zk - zb).transpose(-1, -2)
    if q.shape[-1] > r:
        qp, kp = rearrange(q[:, rows, :, r:], "b i h d -> b h i d"), rearrange(k[..., r:], "b j h d -> b h d j")
        kbp = kb[:, r:]
        w = w + qp @ kp
        f = f + torch.einsum("bhid,hd->bhi", qp, kbp)[..., None]
        g = g + qp @ (kp - kbp[None, :, :, None])
    w, f, g = s * w, s * f, s * g
    err = (w - f - g).abs()
    qn = rearrange(zq[:, rows].abs(), "b i h m -> (b h) i m")
    kn = rearrange((zk - zb).abs(), "b j h m -> (b h) j m")
    bound = torch.zeros_like(err).reshape(-1, len(rows), n)
    shared = bool((phi == phi[:1]).all())  # same positions in every sequence (the default)
    for bi in range(1 if shared else phi.shape[0]):
        sl = slice(None) if shared else slice(bi * h, (bi + 1) * h)
        sin = 2 * ((phi[bi, rows, None, :] - phi[bi, None, :, :]) / 2).sin().abs()  # i j m
        for k, i in enumerate(rows.tolist()):  # causal part j ≤ i only
            bound[sl, k, : i + 1] = ((kn[sl, : i + 1] * sin[k, : i + 1]) @ qn[sl, k, :, None])[..., 0]
    bound = bound.reshape(err.shape) * (s * a2)
    holds = err <= bound + _BOUND_RTOL * (w.abs() + f.abs() + g.abs())
    out = {}
    for sk, geo in geoms.items():
        m = geo.mask[rows].double()
        cnt = m.sum()
        out[sk] = {
            "d3_err_mean": ((err * m).sum((-1, -2)) / cnt).reshape(-1),
            "d3_bound_mean": ((bound * m).sum((-1, -2)) / cnt).reshape(-1),
            "d3_bound_holds": ((holds.double() * m).sum((-1, -2)) / cnt).reshape(-1),
            "mu": ((w * m).sum((-1, -2)) / cnt).reshape(-1),
        }
    return out


# ----------------------------------------------------------------------------- runner


def _run(model, tokens, k_means, layers, *, sink, batch_size, bound_rows, twin_label, model_label, progress, extra_hooks):
    spec, _ = probe_hooks(model)
    n = tokens.shape[1]
    rows = torch.linspace(0, n - 1, min(bound_rows, n)).round().long().unique()
    sinks = [0, sink] if sink else [0]
    frames: list[dict[str, np.ndarray]] = []
    cache: dict = {}  # map-sized scratch buffers, freed when the run ends

    def on_layer(c: QKCapture) -> None:
        lr, kbar = c.rope, k_means[c.layer]
        geoms = {s: _geometry(n, s, lr.sliding_window, c.q.device) for s in sinks}
        b, h = c.q.shape[0], c.n_heads
        bnd = _bound_check(c, kbar, rows.to(c.q.device), geoms)
        w, y = _maps(c, kbar)
        t = _Target(w, geoms[0], bnd[0]["mu"].float(), cache)
        del w
        moments = {(s, "D3"): m for s, m in _d3_moments(t, y, geoms[0], sinks).items()}
        del y
        moments.update(_all_fit_moments(t, geoms))
        for (s, est), m in sorted(moments.items()):
            sc = {k: v.cpu().numpy() for k, v in _scores(m, geoms[s]).items()}
            for key in ("d3_err_mean", "d3_bound_mean", "d3_bound_holds"):
                sc[key] = bnd[s][key].cpu().numpy() if est == "D3" else np.full(b * h, np.nan)
            sc["head"] = np.tile(np.arange(h), b)
            sc["seq"] = np.repeat(np.arange(b) + c.seq_offset, h)
            sc.update(layer=c.layer, kind=lr.kind, estimator=est, sink_excluded=bool(s))
            frames.append(sc)

    stream_qk(model, tokens, on_layer, layers, batch_size=batch_size, extra_hooks=extra_hooks,
              progress=f"decompose[{twin_label}]" if progress else False)
    df = pd.concat([pd.DataFrame(f) for f in frames], ignore_index=True)
    df["model"] = model_label or spec.model_name
    df["twin"] = twin_label
    df["layer_group"] = [layer_group(int(x), spec.n_layers) for x in df["layer"]]
    cols = ["model", "twin", "layer", "layer_group", "kind", "head", "seq", "estimator", "sink_excluded", *SCORE_COLUMNS]
    df = df[cols].sort_values(["layer", "estimator", "sink_excluded", "seq", "head"], kind="stable")
    return df.reset_index(drop=True)


def decompose_model(
    model: Any,
    corpus: CorpusLike = None,
    *,
    layers: Sequence[int] | None = None,
    n_seq: int = 16,
    seq_len: int = 512,
    sink: int = 1,
    n_ref: int = 8,
    batch_size: int = 4,
    bound_rows: int = 32,
    twin_label: str = "trained",
    model_label: str | None = None,
    progress: bool = True,
    k_means: dict[int, Tensor] | None = None,
    extra_hooks: Sequence = (),
) -> pd.DataFrame:
    """D1/D2/D3 scores of every head's logit map, one row per (layer, head, sequence,
    estimator, sink_excluded).

    Tokens: :func:`split_tokens` (analysed sequences + ``n_ref`` disjoint reference ones;
    a token tensor's last ``n_ref`` rows are the reference). ``k̄`` per layer and kv-group
    comes from the reference sequences (:func:`reference_key_means`, first ``sink``
    positions excluded) unless ``k_means`` ``{layer: [kv_head, d_head]}`` is given.
    ``sink_excluded=True`` rows refit and rescore with keys ``j < sink`` removed (only
    produced when ``sink > 0``); SmolLM2 has no BOS, but its first token is still a sink.
    ``extra_hooks`` are attached to both passes (e.g. interventions on ``hook_k``).

    Returns a tidy DataFrame with columns ``model, twin, layer, layer_group, kind, head,
    seq, estimator ('D1'|'D2'|'D3'), sink_excluded, r, r2, r_within`` and, on D3 rows,
    ``d3_err_mean, d3_bound_mean`` (mean ``|W − f − g|`` and mean bound over the masked
    entries of ``bound_rows`` evenly spaced query rows, float64) and ``d3_bound_holds``
    (fraction of those entries within the bound; 1.0 unless there is a bug); NaN elsewhere.
    """
    tokens, ref = split_tokens(model, corpus, n_seq=n_seq, seq_len=seq_len, n_ref=n_ref)
    if k_means is None:
        k_means = reference_key_means(model, ref, layers, sink=sink, batch_size=batch_size,
                                      progress=progress, extra_hooks=extra_hooks)
    return _run(model, tokens, k_means, layers, sink=sink, batch_size=batch_size, bound_rows=bound_rows,
                twin_label=twin_label, model_label=model_label, progress=progress, extra_hooks=extra_hooks)


def decompose_with_twin(model: Any, corpus: CorpusLike = None, *, seed: int = 0, **kw: Any) -> pd.DataFrame:
    """:func:`decompose_model` for ``model`` (twin ``'trained'``) and ``random_twin(model, seed)``
    (twin ``'random'``) on the SAME token sequences (and the same reference sequences, each
    model computing its own ``k̄``); both frames concatenated, ``model`` label shared."""
    from posgen_tl.models import random_twin  # noqa: PLC0415

    kw = dict(kw)
    kw.pop("twin_label", None)
    kw.pop("k_means", None)
    tokens, ref = split_tokens(model, corpus, n_seq=kw.pop("n_seq", 16), seq_len=kw.pop("seq_len", 512),
                               n_ref=kw.get("n_ref", 8))
    both = torch.cat([tokens, ref])
    label = kw.pop("model_label", None) or probe_hooks(model)[0].model_name
    trained = decompose_model(model, both, twin_label="trained", model_label=label, n_seq=len(tokens), **kw)
    twin = random_twin(model, seed)
    random = decompose_model(twin, both, twin_label="random", model_label=label, n_seq=len(tokens), **kw)
    return pd.concat([trained, random], ignore_index=True)


def summarize_decomposition(
    df: pd.DataFrame,
    by: Sequence[str] = ("model", "twin", "estimator", "sink_excluded", "layer_group"),
    values: Sequence[str] = ("r", "r2", "r_within"),
) -> pd.DataFrame:
    """Mean ± std (spread over heads × sequences × layers in the group) of ``values``; also
    ``n`` rows and, for D3, the mean error / bound and the minimum bound-holds fraction.

    Returns one row per ``by`` group with columns ``<value>_mean``, ``<value>_std``, ``n``,
    ``d3_err_mean``, ``d3_bound_mean``, ``d3_bound_holds_min``.
    """
    g = df.groupby(list(by), sort=True, dropna=False)
    out = g[list(values)].agg(["mean", "std"])
    out.columns = [f"{v}_{s}" for v, s in out.columns]
    out["n"] = g.size()
    out["d3_err_mean"] = g["d3_err_mean"].mean()
    out["d3_bound_mean"] = g["d3_bound_mean"].mean()
    out["d3_bound_holds_min"] = g["d3_bound_holds"].min()
    if "layer_group" in by:
        order = {"early": 0, "middle": 1, "late": 2}
        out = out.reset_index().sort_values(list(by), key=lambda s: s.map(order) if s.name == "layer_group" else s)
        return out.reset_index(drop=True)
    return out.reset_index()
