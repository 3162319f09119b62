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

from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.analysis._moments import _all_fit_moments, _d3_moments, _geometry, _Geometry, _scores, _Target
from posgen_tl.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.corpus import CorpusLike, corpus_tokens
from posgen_tl.interventions import feature_means
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
    excluded): :func:`posgen_tl.interventions.feature_means` in float64.
    Returns ``{layer: Float[Tensor, "kv_head d_head"]}`` float64."""
    return feature_means(model, tokens, layers, sink=sink, target="k", batch_size=batch_size,
                         progress="k̄ reference" if progress else False, extra_hooks=extra_hooks, dtype=torch.float64)


# ----------------------------------------------------------------------------- W and D3 pieces


def _maps(c: QKCapture, k_mean: Tensor) -> tuple[Tensor, Tensor]:
    """``(W, f + g)`` float32 ``[(batch head_index), query_pos, key_pos]``, grouped by kv-head (no repeat).

    ``W = s·R_i q_i · R_j k_j`` (= ``c.logits()``); ``f + g`` of :func:`d3_split` as ONE matmul of
    width ``2·d_head``: ``[s·R_i q_i | s·Λq_i] · [R_j k̄ | k_j − k̄]``, ``Λ = a²`` on rotary dims, 1 on pass dims.
    """
    rope, kv = c.rope, c.k.shape[-2]
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


def decompose_with_twin(model: Any, corpus: CorpusLike = None, *, seed: int = 0, twin: Any = None, **kw: Any) -> pd.DataFrame:
    """:func:`decompose_model` for ``model`` (twin ``'trained'``) and ``random_twin(model, seed)``
    (twin ``'random'``) on the SAME token sequences (and the same reference sequences, each
    model computing its own ``k̄``); both frames concatenated, ``model`` label shared.
    ``twin``: an already-built ``random_twin(model, seed)`` to reuse (built here if None)."""
    from posgen_tl.models import random_twin  # noqa: PLC0415

    kw = dict(kw)
    kw.pop("twin_label", None)
    kw.pop("k_means", None)
    tokens, ref = split_tokens(model, corpus, n_seq=kw.pop("n_seq", 16), seq_len=kw.pop("seq_len", 512),
                               n_ref=kw.get("n_ref", 8))
    both = torch.cat([tokens, ref])
    label = kw.pop("model_label", None) or probe_hooks(model)[0].model_name
    trained = decompose_model(model, both, twin_label="trained", model_label=label, n_seq=len(tokens), **kw)
    twin = random_twin(model, seed) if twin is None else twin
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
