"""docs/method.md §2 runner: D1 / D2 / D3 decompositions of every head's logit map, scored
honestly (r, R², within-row r; with and without the sink keys) beside a random-init twin.

Which k̄ (docs/method.md §2 — it decides what a D3 score means; both kinds by default):

* ``"global"`` — one ``k̄`` per layer and kv-group from a reference pass
  (:func:`reference_key_means`) over windows of DOCUMENTS DISJOINT from the analysed ones
  (:func:`posgen_tl.io.corpus.reference_windows`; sink positions excluded). A good fit means the
  head has one text-independent positional kernel.
* ``"per_sequence"`` — each analysed sequence's own mean key (sink excluded,
  :func:`posgen_tl.maths.decompose.sequence_key_mean`), computed inside the same capture pass.
  Random-init keys carry a large per-sequence constant, so this fits the random twin too.

One streaming pass (:func:`posgen_tl.hooks.stream.stream_qk`) then scores, for each (batch,
layer), each k̄ kind and all heads at once, the model's logits ``W = s·rot_q·rot_k`` against

* D1 / D2 — the least-squares additive fits of :func:`posgen_tl.maths.decompose.fit_additive`
  (same ridge and refinement), refitted on each mask (sink kept / sink excluded);
* D3 — ``f + g`` of :func:`posgen_tl.maths.decompose.d3_split` (``k̄`` expanded to query heads),

and checks the D3 bound ``|W − f − g| ≤ bound`` in float64 on ``bound_rows`` evenly
spaced query rows (same numbers as :func:`posgen_tl.maths.decompose.d3_split` /
:func:`posgen_tl.maths.decompose.d3_bound`, computed with real matmuls and only on ``j ≤ i``; a
theorem, so the reported fraction must be 1 — up to a float64 rounding allowance of
``1e-10·(|W| + |f| + |g|)``). It holding is an algebraic identity (a check of the code),
not a finding about the model.

Speed (the issue asks ≤ 2× a forward pass): nothing of size ``n²`` per map is done in
float64 except on the bound rows. Scores are computed from per-row moments ``Σx, Σy, Σx²,
Σy², Σxy`` (float32 row sums, float64 combination; maps are first shifted by a per-map
constant, the masked mean of the bound rows, so the moments do not cancel).
The additive fits never materialise their fitted maps: their least squares is solved through the
band mask's structure (:mod:`posgen_tl.maths.additive`: O(n) per map, no ``[3n, 3n]`` operator), and the moments of
``mean + a[i−j] + b[i] + c[j]`` come from prefix sums, one matrix-vector product with the
map (``Σ_j x_ij c_j``), one with its diagonal view (``Σ_d x[i,i−d] a_d``) and an FFT
convolution (``Σ_j a_{i−j} c_j``). ``f + g`` is one float32 matmul of width ``2·d_head``.
Tests check every number against the reference functions of :mod:`posgen_tl.maths.decompose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from einops import rearrange
from torch import Tensor

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import QKCapture, probe_hooks
from posgen_tl.hooks.edits import feature_means, reference_key_means  # noqa: F401 (the name stays importable here)
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.sampling import Windows, resolve_windows
from posgen_tl.maths.decompose import d3_bound_rows, kbar_batched, sequence_key_mean
from posgen_tl.maths.groups import layer_group
from posgen_tl.maths.moments import Geometry, Target, all_fit_moments, d3_moments, geometry, scores, streamed_moments
from posgen_tl.maths.rope import angles, expand_kv, rotate, to_bands
from posgen_tl.report.text import fmt

__all__ = [
    "ESTIMATORS",
    "Config",
    "reference_key_means",
    "K_MEAN_KINDS",
    "decompose_model",
    "decompose_with_twin",
    "summarize_decomposition",
]

ESTIMATORS = ("D1", "D2", "D3")
K_MEAN_KINDS = ("global", "per_sequence")
#: sequences longer than this are scored a block of query rows at a time (:func:`streamed_moments`), by default
STREAM_ABOVE, STREAM_BLOCK = 2048, 256
SCORE_COLUMNS = ("r", "r2", "r_within", "d3_err_mean", "d3_bound_mean", "d3_bound_holds")
COLUMNS = ["model", "twin", "k_mean", "layer", "layer_group", "kind", "head", "doc", "seq", "estimator",
           "sink_excluded", *SCORE_COLUMNS]
_BOUND_RTOL = 1e-10  # float64 rounding allowance in the bound check (relative to |W|+|f|+|g|)


# ----------------------------------------------------------------------------- tokens, k̄




# ----------------------------------------------------------------------------- W and D3 pieces


def _q2(c: QKCapture) -> Tensor:
    """``[s·R_i q_i | s·Λq_i]`` grouped by kv-head, ``[b, kv, (g i), 2·d_head]`` float32 (``Λ = a²`` on rotary dims)."""
    rope, kv = c.rope, c.k.shape[-2]
    lam = torch.ones(c.q.shape[-1], device=c.q.device)
    lam[: rope.rotary_dim] = rope.attention_scaling**2
    return rearrange(torch.cat([c.rot_q, c.q * lam], dim=-1) * rope.score_scale,
                     "b i (kv g) d -> b kv (g i) d", kv=kv).contiguous()


_GROUPED = "b kv (g i) j -> (b kv g) i j"


def _map_buffer(cache: dict | None, c: QKCapture) -> Tensor | None:
    """The run's one map-sized float32 scratch ``[b, kv, (g i), j]`` (W, then each ``f + g``), kept in
    ``cache`` and reused across layers and batches: a fresh map per product costs page faults and,
    with glibc, heap growth with the number of batches. ``None`` without a cache."""
    if cache is None:
        return None
    b, n, kv = c.k.shape[:3]
    shape = (b, kv, c.q.shape[2] // kv * n, n)
    buf = cache.get("map")
    if buf is None or tuple(buf.shape) != shape or buf.device != c.q.device:
        cache.pop("map", None)
        buf = cache["map"] = torch.empty(shape, dtype=torch.float32, device=c.q.device)
    return buf


def _w_map(c: QKCapture, q2: Tensor, cache: dict | None = None) -> Tensor:
    """``W = s·R_i q_i · R_j k_j`` (= ``c.logits()``), float32 ``[(batch head_index), query_pos, key_pos]``
    (written into the run's map buffer when ``cache`` is given)."""
    d = c.q.shape[-1]
    w = torch.matmul(q2[..., :d], rearrange(c.rot_k, "b j kv d -> b kv d j"), out=_map_buffer(cache, c))
    return rearrange(w, _GROUPED, i=c.q.shape[1])


def _k_y(c: QKCapture, k_mean: Tensor) -> Tensor:
    """``[R_j k̄ | k_j − k̄]`` float32 ``[b, kv, 2·d_head, key_pos]``: the key side of :func:`_y_map`."""
    b, n, kv = c.k.shape[:3]
    kbar = kbar_batched(k_mean.to(c.k.device, torch.float32), b, kv)  # b kv d
    rot_kbar = rotate(kbar[:, None].expand(b, n, *kbar.shape[1:]), c.positions, c.rope)
    return rearrange(torch.cat([rot_kbar, c.k - kbar[:, None]], dim=-1), "b j kv d -> b kv d j")


def _y_map(c: QKCapture, q2: Tensor, k_mean: Tensor, cache: dict | None = None) -> Tensor:
    """``f + g`` of :func:`d3_split` as ONE matmul of width ``2·d_head``: ``q2 · [R_j k̄ | k_j − k̄]``.

    ``k_mean``: ``[kv_head, d_head]`` (global) or ``[batch, kv_head, d_head]`` (per sequence).
    Returns float32 ``[(batch head_index), query_pos, key_pos]``, grouped by kv-head (no repeat); written
    into the run's map buffer when ``cache`` is given (W must be consumed by then).
    """
    return rearrange(torch.matmul(q2, _k_y(c, k_mean), out=_map_buffer(cache, c)), _GROUPED, i=c.k.shape[1])


def _row_maps(c: QKCapture, q2: Tensor, k_mean: Tensor | None = None) -> Any:
    """``(r0, r1) ↦`` query rows ``r0 … r1 − 1`` of W (``k_mean`` None, :func:`_w_map`) or of ``f + g``
    (:func:`_y_map`), float32 ``[(batch head_index), r1 − r0, key_pos]``: the maps a row block at a time."""
    b, n, kv = c.k.shape[:3]
    d = c.q.shape[-1]
    q5 = q2.view(b, kv, c.q.shape[2] // kv, n, 2 * d)
    keys = rearrange(c.rot_k, "b j kv d -> b kv d j") if k_mean is None else _k_y(c, k_mean)
    q5 = q5[..., :d] if k_mean is None else q5

    def rows(r0: int, r1: int) -> Tensor:
        part = q5[:, :, :, r0:r1].reshape(b, kv, -1, q5.shape[-1])
        return rearrange(part @ keys, _GROUPED, i=r1 - r0)

    return rows


def _bound_check(c: QKCapture, k_mean: Tensor, rows: Tensor, geoms: dict[int, Geometry]) -> dict[int, dict[str, Tensor]]:
    """D3 check on query ``rows``: mean |W − f − g|, mean bound (as :func:`d3_bound`) and
    fraction of entries within the bound, over the masked entries of ``rows`` per mask.

    ``k_mean``: ``[kv_head, d_head]`` or ``[batch, kv_head, d_head]``. ``W, f, g`` in float64
    as in :func:`d3_split` (float32 angles, float64 phasors), via real matmuls on ``(Re, Im)``
    band coordinates; the bound (float64) only on ``j ≤ i`` (:func:`posgen_tl.maths.decompose.d3_bound_rows`).
    Each ``[batch, head_index]``, flattened to ``[(batch head_index)]``.
    """
    rope, h, r = c.rope, c.n_heads, c.rope.rotary_dim
    q, k = c.q.double(), expand_kv(c.k, h).double()
    kb = kbar_batched(k_mean.to(q.device).double(), q.shape[0], h)  # b h d
    zq, zk, zb = (to_bands(x, r, rope.layout) for x in (q, k, kb))
    zb = zb[:, None]  # b 1 h m
    phi = angles(c.positions.to(q.device), rope).double()  # b pos m
    e = torch.polar(torch.ones_like(phi), phi)[:, :, None, :]

    def re(z: Tensor) -> Tensor:  # Re(x·conj(y)) = [xr, xi]·[yr, yi]
        return rearrange(torch.view_as_real(z), "b p h m two -> b h p (m two)")

    a2, s = rope.attention_scaling**2, rope.score_scale
    qr, qb = re((zq * e)[:, rows]), re(zq[:, rows])
    w = a2 * qr @ re(zk * e).transpose(-1, -2)
    f = a2 * qr @ re(zb * e).transpose(-1, -2)
    g = a2 * qb @ re(zk - zb).transpose(-1, -2)
    if q.shape[-1] > r:
        qp, kp = rearrange(q[:, rows, :, r:], "b i h d -> b h i d"), rearrange(k[..., r:], "b j h d -> b h d j")
        kbp = kb[..., r:]  # b h dp
        w = w + qp @ kp
        f = f + torch.einsum("bhid,bhd->bhi", qp, kbp)[..., None]
        g = g + qp @ (kp - kbp[..., None])
    w, f, g = s * w, s * f, s * g
    err = (w - f - g).abs()
    bound = d3_bound_rows(zq[:, rows].abs(), c.k, k_mean, phi, rows, rope).reshape(err.shape) * (s * a2)
    holds = err <= bound + _BOUND_RTOL * (w.abs() + f.abs() + g.abs())
    out = {}
    for sk, geo in geoms.items():
        m = geo.mask[rows].double()
        cnt = m.sum()

        def mean(x: Tensor) -> Tensor:  # masked mean over (rows, keys): one matmul, no temporary
            return (x.reshape(x.shape[0] * x.shape[1], -1) @ m.reshape(-1)) / cnt  # noqa: B023

        out[sk] = {"d3_err_mean": mean(err), "d3_bound_mean": mean(bound), "d3_bound_holds": mean(holds.double()),
                   "mu": mean(w)}
    return out


# ----------------------------------------------------------------------------- runner


def k_mean_kinds(k_mean: Any) -> tuple[list[str], dict[int, Tensor] | Tensor | None]:
    """``(kinds, given)``: the k̄ kinds to score and a given k̄ (dict per layer or one tensor) if any."""
    if isinstance(k_mean, (dict, Tensor)):
        return ["given"], k_mean
    kinds = [k_mean] if isinstance(k_mean, str) else list(k_mean)
    bad = [k for k in kinds if k not in K_MEAN_KINDS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"k_mean must be 'global', 'per_sequence', a sequence of them, a tensor or a "
                         f"{{layer: tensor}} dict; got {k_mean!r}")
    return kinds, None


def score_windows(model, windows: Windows, kinds, k_means, layers, *, sink, batch_size, bound_rows, twin_label, model_label,
         progress, extra_hooks, row_block: int = 0):
    spec, _ = probe_hooks(model)
    tokens = windows.tokens
    n = tokens.shape[1]
    rows = torch.linspace(0, n - 1, min(bound_rows, n)).round().long().unique()
    sinks = [0, sink] if sink else [0]
    docs = windows.doc_ids.cpu().numpy()
    frames: list[dict[str, np.ndarray]] = []
    cache: dict = {}  # map-sized scratch buffers, freed when the run ends

    def kbar_of(kind: str, c: QKCapture) -> Tensor:
        if kind == "per_sequence":
            return sequence_key_mean(c.k, sink)
        km = k_means if isinstance(k_means, Tensor) else k_means[c.layer]
        return km

    def emit(c, moments, bnd, est_kind: dict[str, str]) -> None:
        b, h = c.q.shape[0], c.n_heads
        seq = np.arange(b) + c.seq_offset
        for (s, est), m in sorted(moments.items()):
            sc = {k: v.cpu().numpy() for k, v in scores(m, geoms_of(c)[s]).items()}
            for key in ("d3_err_mean", "d3_bound_mean", "d3_bound_holds"):
                sc[key] = bnd[s][key].cpu().numpy() if est == "D3" else np.full(b * h, np.nan)
            sc["head"] = np.tile(np.arange(h), b)
            sc["seq"] = np.repeat(seq, h)
            sc["doc"] = np.repeat(docs[seq], h)
            sc.update(layer=c.layer, kind=c.rope.kind, estimator=est, sink_excluded=bool(s), k_mean=est_kind[est])
            frames.append(sc)

    def geoms_of(c: QKCapture) -> dict[int, Geometry]:
        return {s: geometry(n, s, c.rope.sliding_window, c.q.device) for s in sinks}

    block = row_block or (STREAM_BLOCK if n > STREAM_ABOVE else 0)

    def on_layer(c: QKCapture) -> None:
        geoms = geoms_of(c)
        r = rows.to(c.q.device)
        q2 = _q2(c)
        if 0 < block < n:  # long sequences: the maps a row block at a time (memory O(block · n) per head)
            bnds = {kind: _bound_check(c, kbar_of(kind, c), r, geoms) for kind in kinds}
            fit_m, d3 = streamed_moments(_row_maps(c, q2), {k: _row_maps(c, q2, kbar_of(k, c)) for k in kinds}, n=n,
                                         nm=c.q.shape[0] * c.n_heads, mu=bnds[kinds[0]][0]["mu"].float(), geoms=geoms,
                                         sinks=sinks, block=block, device=c.q.device)
            emit(c, fit_m, bnds[kinds[0]], {"D1": "none", "D2": "none"})
            for kind in kinds:
                emit(c, {(s, "D3"): m for s, m in d3[kind].items()}, bnds[kind], {"D3": kind})
            return
        w = _w_map(c, q2, cache)
        t = None
        for kind in kinds:
            kbar = kbar_of(kind, c)
            bnd = _bound_check(c, kbar, r, geoms)
            if t is None:  # the target (and its D1/D2 fits) do not depend on k̄
                t = Target(w, geoms[0], bnd[0]["mu"].float(), cache)
                del w
                emit(c, all_fit_moments(t, geoms), bnd, {"D1": "none", "D2": "none"})
            y = _y_map(c, q2, kbar, cache)  # the buffer W was in (copied into the target by now)
            moments = {(s, "D3"): m for s, m in d3_moments(t, y, geoms[0], sinks).items()}
            del y
            emit(c, moments, bnd, {"D3": kind})

    stream_qk(model, tokens, on_layer, layers, batch_size=batch_size, extra_hooks=extra_hooks,
              progress=f"decompose[{twin_label}]" if progress else False)
    df = pd.concat([pd.DataFrame(f) for f in frames], ignore_index=True)
    df["model"] = model_label or spec.model_name
    df["twin"] = twin_label
    df["layer_group"] = [layer_group(int(x), spec.n_layers) for x in df["layer"]]
    df = df[COLUMNS].sort_values(["layer", "estimator", "k_mean", "sink_excluded", "seq", "head"], kind="stable")
    return df.reset_index(drop=True)


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the decomposition (docs/method.md §2): every door — :func:`run`, ``posgen-tl study
    decomposition``, the report — builds this dataclass."""

    NAME: ClassVar[str] = "decomposition"
    n_ref: int = base.n_ref_option()
    layers: Any = base.layers_option("analysed")
    k_mean: tuple[str, ...] = base.option(K_MEAN_KINDS, "k̄ kinds scored by D3: global (from the reference "
                                          "documents) and/or per_sequence (each sequence's own mean key)", "names")
    sink: int = base.option(1, "first key positions treated as attention sinks (excluded from k̄ and in the "
                               "sink_excluded rows)", "count")
    batch_size: int = base.batch_option(4)
    bound_rows: int = base.option(32, "query rows on which the D3 bound is checked (float64)", "int")
    row_block: int = base.option(0, f"query rows per block of the logit maps: 0 = whole maps up to {STREAM_ABOVE} "
                                    f"tokens, blocks of {STREAM_BLOCK} beyond (memory O(block · n) per head instead "
                                    "of O(n²))", "count")


def decompose_model(
    model: Any,
    corpus: CorpusLike | Windows = None,
    cfg: Config | None = None,
    *,
    reference: Windows | Tensor | None = None,
    k_mean: str | Sequence[str] | Tensor | dict[int, Tensor] | None = None,
    twin_label: str = "trained",
    model_label: str | None = None,
    progress: bool = True,
    extra_hooks: Sequence = (),
    **options: Any,
) -> pd.DataFrame:
    """D1/D2/D3 scores of every head's logit map, one row per (layer, head, sequence,
    estimator, k̄ kind, sink_excluded).

    ``cfg`` (:class:`Config`, default ``Config()``) with ``options`` applied (``n_seq=16``…) sets the
    sizes. Windows: :func:`posgen_tl.io.sampling.resolve_windows` — corpus text is sampled (analysed
    windows + ``n_ref`` reference windows of OTHER documents); :class:`Windows` and token tensors are
    analysed as given (a tensor's rows each their own document; a reference only if passed).
    ``k_mean`` (default ``cfg.k_mean``): ``"global"`` (per layer and kv-group from the reference
    windows, :func:`reference_key_means`, first ``sink`` positions excluded — needs a reference),
    ``"per_sequence"`` (each sequence's own mean key, sink excluded, from the same capture pass), a
    sequence of both (scored in ONE pass), or a given k̄ — a ``[kv_head, d_head]`` tensor (all layers)
    or ``{layer: [kv_head, d_head]}`` — labelled ``"given"``. ``sink_excluded=True`` rows rescore with
    keys ``j < sink`` removed (only when ``sink > 0``). ``extra_hooks`` are attached to both passes.

    Returns a tidy DataFrame with :data:`COLUMNS`: ``model, twin, k_mean ('global' |
    'per_sequence' | 'given' on D3 rows, 'none' on D1/D2 rows, which do not use k̄), layer,
    layer_group, kind, head, doc, seq, estimator ('D1'|'D2'|'D3'), sink_excluded, r, r2,
    r_within`` and, on D3 rows, ``d3_err_mean, d3_bound_mean`` (mean ``|W − f − g|`` and mean
    bound over the masked entries of ``bound_rows`` evenly spaced query rows, float64) and
    ``d3_bound_holds`` (fraction within the bound; 1.0 is an algebraic identity, a check of
    the code, not a finding); NaN elsewhere. ``df.attrs["reference_docs"]`` /
    ``["analysed_docs"]`` name the documents used.

    Raises:
        ValueError: a global k̄ is asked for but there is no reference (pass ``reference=``), or the
            reference shares documents with the analysed windows.
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the decomposition")
    kinds, given = k_mean_kinds(cfg.k_mean if k_mean is None else k_mean)
    windows, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=cfg.seq_len,
                                   n_ref=cfg.n_ref if "global" in kinds else 0, seed=cfg.seed)
    layers = base.resolve_layers(cfg.layers, probe_hooks(model)[0].n_layers)
    if "global" in kinds:
        if ref is None:
            raise ValueError("k_mean='global' needs reference windows from OTHER documents: pass reference= "
                             "(a token tensor or Windows), or k_mean='per_sequence'")
        given = reference_key_means(model, ref, layers, sink=cfg.sink, batch_size=cfg.batch_size, progress=progress,
                                    extra_hooks=extra_hooks)
    df = score_windows(model, windows, kinds, given, layers, sink=cfg.sink, batch_size=cfg.batch_size,
              bound_rows=cfg.bound_rows, twin_label=twin_label, model_label=model_label, progress=progress,
              extra_hooks=extra_hooks, row_block=cfg.row_block)
    df.attrs["analysed_docs"] = sorted({windows.doc_names[i] for i in windows.doc_ids.tolist()})
    df.attrs["reference_docs"] = [] if ref is None else sorted({ref.doc_names[i] for i in ref.doc_ids.tolist()})
    return df


def decompose_with_twin(model: Any, corpus: CorpusLike | Windows = None, cfg: Config | None = None, *,
                        twin: Any = None, reference: Windows | Tensor | None = None, progress: bool = True,
                        **options: Any) -> pd.DataFrame:
    """:func:`decompose_model` for ``model`` (twin ``'trained'``) and ``random_twin(model, cfg.seed)``
    (twin ``'random'``) on the SAME windows (and the same reference windows, each model computing its
    own global ``k̄``); both frames concatenated, ``model`` label shared. ``twin``: an already-built
    random twin to reuse (built here if None)."""
    from posgen_tl.io.models import random_twin  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    needs_ref = "global" in k_mean_kinds(cfg.k_mean)[0]
    windows, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=cfg.seq_len,
                                   n_ref=cfg.n_ref if needs_ref else 0, seed=cfg.seed)
    label = probe_hooks(model)[0].model_name
    trained = decompose_model(model, windows, cfg, reference=ref, model_label=label, progress=progress)
    twin = random_twin(model, cfg.seed) if twin is None else twin
    random = decompose_model(twin, windows, cfg, reference=ref, twin_label="random", model_label=label,
                             progress=progress)
    out = pd.concat([trained, random], ignore_index=True)
    out.attrs = dict(trained.attrs)
    return out


def summarize_decomposition(
    df: pd.DataFrame,
    by: Sequence[str] = ("model", "twin", "k_mean", "estimator", "sink_excluded", "layer_group"),
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


# ----------------------------------------------------------------------------- report / study


NAME = "decomposition"
ABOUT = "D1/D2/D3 decompositions, trained beside the random twin (docs/method.md §2)"
NEEDS: tuple[str, ...] = ()


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``rows`` (:func:`decompose_model` rows of the trained model and its twin), ``summary``
            (:func:`summarize_decomposition`), and one head's maps for the figure — ``head_maps``, ``head_a``,
            ``head_scores`` (:meth:`~posgen_tl.experiments.head_maps.HeadDecomposition.to_tables`).
        config: the Config's options. meta: model, how the windows were taken (``note``), sizes, the analysed and
            reference documents.
    """


    def head(self) -> Any:
        """The :class:`~posgen_tl.experiments.head_maps.HeadDecomposition` the figure shows (None if not kept)."""
        from posgen_tl.experiments.head_maps import HeadDecomposition  # noqa: PLC0415

        t = self.tables
        return HeadDecomposition.from_tables(t["head_maps"], t["head_a"], t["head_scores"]) if "head_maps" in t else None


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"rows": "decomposition.csv", "summary": "decomposition_summary.csv", "head_maps": "decomposition_head_maps.csv",
         "head_a": "decomposition_head_a.csv", "head_scores": "decomposition_head_scores.csv"}
LEGACY_META = "windows.json"


def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, twin: Any = None, progress: bool = True,
        **options: Any) -> Result:
    """Decompose every head of the trained model and — unless ``cfg.twin`` is false or ``twin`` is ``False`` — of
    its random twin (``twin``: a model or a callable giving one; ``None`` builds it) on the same windows, and one
    head's maps (the middle analysed layer, head 0, first window, global k̄) for the figure. Returns the
    :class:`Result`."""
    from posgen_tl.experiments.head_maps import decompose_head  # noqa: PLC0415
    from posgen_tl.io.sampling import sample_or_chunks  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    windows, ref, note = sample_or_chunks(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq,
                                          seq_len=cfg.seq_len, n_ref=cfg.n_ref, seed=cfg.seed)
    if cfg.twin and twin is not False:
        df = decompose_with_twin(model, windows, cfg, twin=base.twin_of(model, twin, cfg.seed), reference=ref,
                                 progress=progress)
    else:
        df = decompose_model(model, windows, cfg, reference=ref, progress=progress)
    layers = sorted(df["layer"].unique())
    toks = windows.tokens
    head = decompose_head(model, toks[:1, : min(128, toks.shape[1])], int(layers[len(layers) // 2]), 0,
                          k_mean="global", reference=ref.tokens)
    ht = head.to_tables()
    meta = {"model": probe_hooks(model)[0].model_name, "note": note, "n_seq": len(windows), "n_ref": len(ref),
            "analysed_docs": df.attrs.get("analysed_docs", []), "reference_docs": df.attrs.get("reference_docs", [])}
    tables = {"rows": df, "summary": summarize_decomposition(df), "head_maps": ht["maps"], "head_a": ht["a"],
              "head_scores": ht["scores"]}
    return Result(tables, cfg.as_dict(), meta)


def _d3_means(df: pd.DataFrame) -> dict:
    """Mean r / within-row r per (estimator, k̄ kind, twin), sink-excluded rows."""
    sub = df[df["sink_excluded"].astype(bool)] if df["sink_excluded"].astype(bool).any() else df
    out: dict = {}
    for (est, km, twin), g in sub.groupby(["estimator", "k_mean", "twin"]):
        out.setdefault((est, km), {})[twin] = (float(g["r"].mean()), float(g["r_within"].mean()), float(g["r2"].mean()))
    return out


def _verdict(means: dict) -> str:
    nan3 = (float("nan"),) * 3
    g_t, g_r = means.get(("D3", "global"), {}).get("trained", nan3), means.get(("D3", "global"), {}).get("random", nan3)
    p_t, p_r = (means.get(("D3", "per_sequence"), {}).get("trained", nan3),
                means.get(("D3", "per_sequence"), {}).get("random", nan3))
    if p_r[1] >= p_t[1] - 0.1:
        v1 = (f"With each sequence's OWN mean key, D3 fits the random twin nearly as well (within-row r {fmt(p_r[1])} vs "
              f"{fmt(p_t[1])} trained): a good D3 fit is not by itself learned.")
    else:
        v1 = f"With each sequence's own mean key, D3 within-row r: {fmt(p_t[1])} trained vs {fmt(p_r[1])} random."
    if g_t[1] - g_r[1] > 0.2:
        v2 = (f" With ONE global k̄ from other documents the trained model keeps {fmt(g_t[1])} while the twin falls to "
              f"{fmt(g_r[1])}: what training adds is a key offset that is the same for all texts (stability across texts).")
    else:
        v2 = f" With one global k̄ from other documents: {fmt(g_t[1])} trained vs {fmt(g_r[1])} random."
    return v1 + v2


def render(result: Result) -> Any:
    """The report section (and the study's markdown): verdict, per-group table, figures, headline."""
    from posgen_tl.plot.decomposition import plot_head_maps, plot_r_by_layer  # noqa: PLC0415
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    title = "2 · Attention logits = positional + semantic? (docs/method.md §2)"
    if result.skipped:
        return skipped_section(title, result.skipped, "decomposition", result.meta.get("hint"))
    summ, df, note = result.tables["summary"], result.tables["rows"], result.meta["note"]
    figures = [(figure_to_png(plot_r_by_layer(df)), "Per-layer mean r and within-row r per estimator and k̄ kind, "
                "trained (solid) vs random twin (dashed)")]
    head = result.head()
    if head is not None:
        figures.append((figure_to_png(plot_head_maps(head)), "One head: logits W, positional f, semantic g, remainder "
                        "W−f−g (global k̄ from the reference windows)"))
    means = _d3_means(df)
    nan3 = (float("nan"),) * 3
    res: dict[str, Any] = {}
    lines = []
    for (est, km), v in sorted(means.items()):
        t, r = v.get("trained", nan3), v.get("random", nan3)
        key = est if km in ("none", "global") else f"{est}_{km}"
        res[key] = {"k_mean": km, "r_trained": t[0], "r_random": r[0], "r_within_trained": t[1], "r_within_random": r[1]}
        label = est if km == "none" else f"{est} (k̄ {km})"
        lines.append(f"{label}: r {fmt(t[0])} trained vs {fmt(r[0])} random; within-row r {fmt(t[1])} vs {fmt(r[1])}")
    held = df.loc[df["estimator"] == "D3", "d3_bound_holds"].min() if "d3_bound_holds" in df else float("nan")
    res["bound_holds_min"] = held
    d1_t, d1_r = means.get(("D1", "none"), {}).get("trained", nan3), means.get(("D1", "none"), {}).get("random", nan3)
    return Section(
        title,
        verdict=_verdict(means),
        paragraphs=[note] + lines + [
            f"D1 (free additive fit) within-row r: {fmt(d1_t[1])} trained vs {fmt(d1_r[1])} random — a high additive-fit r "
            "alone is no evidence of a learned mechanism.",
            f"D3 bound |W−f−g| ≤ s·Σ‖q‖‖k−k̄‖·2|sin(Δθ/2)| held on a fraction {fmt(held, 4)} of the sampled entries. "
            "This is an algebraic identity (|e^{iφ} − 1| = 2|sin(φ/2)|): it checks the code, it is not a finding about the model.",
            "Paper (Llama, mid layers): r = 0.959 for its additive approximation; compare the trained r above, and note how much "
            "of it the random twin already reaches with a per-sequence k̄."],
        tables=[("Mean ± std over heads × sequences, first key (sink) excluded — both k̄ kinds, trained beside its random twin",
                 _compact(summ))],
        figures=figures,
        findings=_findings(df),
        results=res,
    )


def _compact(summ: pd.DataFrame) -> pd.DataFrame:
    """Layer group × estimator × k̄ rows; r, within-row r and R² as 'mean ± std', trained | random columns."""
    d = summ
    if "sink_excluded" in d and d["sink_excluded"].astype(bool).any():
        d = d[d["sink_excluded"].astype(bool)]
    if "k_mean" not in d:
        d = d.assign(k_mean="global")
    rows = []
    order = {"early": 0, "middle": 1, "late": 2, "all": 3}
    groups = d.groupby(["layer_group", "estimator", "k_mean"])
    for (grp, est, km), g in sorted(groups, key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2])):
        row = {"layers": grp, "estimator": est, "k̄": "—" if km == "none" else km}
        for twin in ("trained", "random"):
            t = g[g["twin"] == twin]
            for m in ("r", "r_within", "r2"):
                row[f"{m} {twin}"] = (f"{t[f'{m}_mean'].iloc[0]:.3f} ± {t[f'{m}_std'].iloc[0]:.3f}" if len(t) else "–")
        rows.append(row)
    return pd.DataFrame(rows)


def _findings(df: pd.DataFrame) -> list:
    """D3 within-row r, trained − random twin, paired per sequence (mean over layers × heads; sink
    excluded; global k̄ rows), clustered by document."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.stats.inference import paired_finding  # noqa: PLC0415

    d3 = df[(df["estimator"] == "D3") & df["sink_excluded"].astype(bool)]
    if "k_mean" in d3.columns and (d3["k_mean"] == "global").any():
        d3 = d3[d3["k_mean"] == "global"]
    per = d3.groupby(["twin", "seq"])["r_within"].mean().unstack("twin")
    if not {"trained", "random"} <= set(per.columns):
        return [Finding("decomposition", "not testable", note="no random twin in this run")]
    per = per.dropna()
    d = (per["trained"] - per["random"]).to_numpy(float)
    docs = d3.groupby("seq")["doc"].first().loc[per.index].to_numpy()
    mean, ci, p, kind = paired_finding(d, docs)
    word = ("trained beyond twin" if mean > 0 else "twin beyond trained") if p < 0.05 else "no evidence"
    return [Finding("decomposition", word, mean, "D3 within-row r, trained − twin", ci, p, len(d), p_kind=kind,
                    unit="sequences")]
