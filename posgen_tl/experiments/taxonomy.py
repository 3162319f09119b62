"""Head taxonomy runner (METHOD.md §6): positional vs symbolic heads, per band, tied to D3.

Layout per prompt (``n`` tokens): a context region ``R = [r0, r1)`` of ``region_len``
tokens ends ``n_query`` tokens before the end; the query rows are ``[r1, n)``. The tokens
of ``R`` are permuted by ``n_perm`` independent random permutations (seeded per prompt,
:func:`posgen_tl.maths.taxonomy.region_permutations`; single tokens by default — the positional and
symbolic alignments then share only ~1 of ``region_len`` entries, the cleanest
separation; ``block > 1`` permutes word-sized chunks instead). The clean prompt and its
permutations run in ONE forward batch, so one streamed capture holds them all and memory
stays one layer of one batch.

For each layer and head (and each RoPE band taken alone as a 2-D head, via
:func:`posgen_tl.maths.taxonomy.band_logits`) the EXACT pre-softmax logits ``s·rot_q·rot_k`` of the
query rows over ``R`` are compared before/after each permutation by
:func:`posgen_tl.maths.taxonomy.region_logit_scores`: row-centred correlation at the same positions
(positional) and following the moved tokens (symbolic), rows weighted by their clean
attention mass on ``R`` (softmax over the causal mask, sliding window included), near-
constant rows excluded (within-row std below ``rel_tol ×`` the layer's median within-row
std of this prompt, floor ``1e-6``; the SAME threshold serves the band rows, so a band
whose logits hardly vary compared with its head's is excluded, not scored), and a null from an independent permutation (exact
null sd, 95 % quantile). On sliding-window layers only rows that see ALL of ``R`` are
scored (``i − r0 < window``); a layer where no row does gives NaN scores ('undefined').

Labels (:func:`posgen_tl.maths.taxonomy.taxonomy_label`): an axis is present when its score exceeds
the null quantile and ``min_score``; positional / symbolic / both / neither / undefined.

Per head also: frequency usage (energy share of pre-rotation q and k per band,
:class:`posgen_tl.maths.band_stats.BandStats`, and :func:`frequency_centroid`; 0 = fastest band),
and the D3 **positional share** ``V(f)/(V(f)+V(g))`` of the clean prompts' within-row logit
variance (:func:`posgen_tl.maths.decompose.d3_split`) with a GLOBAL ``k̄`` per kv-head from
reference windows of documents disjoint from the analysed ones (sink excluded); the same
share with each prompt's own mean key is reported beside it (``positional_share_seq``).
:func:`share_by_class` tests whether positional heads carry more positional share than
symbolic heads (Mann–Whitney U).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from scipy.stats import mannwhitneyu, spearmanr
from torch import Tensor

from posgen_tl.experiments.decomposition import layer_group
from posgen_tl.hooks.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.io.corpus import CorpusError, Windows, reference_windows
from posgen_tl.maths.decompose import causal_mask as fit_mask
from posgen_tl.maths.decompose import d3_split
from posgen_tl.maths.band_stats import BandStats
from posgen_tl.maths.taxonomy import (
    LABELS,
    LogitScoreSums,
    band_logits,
    causal_mask,
    frequency_centroid,
    pass_logits,
    positional_share,
    region_logit_scores,
    region_permutations,
    row_spread_threshold,
    taxonomy_label,
)
from posgen_tl.io.models import random_twin
from posgen_tl.maths.rope import kv_head_index, scores_from_rotated

__all__ = [
    "region_layout",
    "taxonomy_windows",
    "head_taxonomy",
    "head_table",
    "head_taxonomy_with_twin",
    "label_counts",
    "share_by_class",
    "taxonomy_agreement",
    "HEAD_COLUMNS",
]

HEAD_COLUMNS = [
    "model", "twin", "layer", "kind", "head", "positional", "symbolic", "null_mc", "null_sd", "null_q", "label",
    "positional_std", "symbolic_std", "n_rows_used", "n_rows_excluded", "region_mass", "n_prompts", "n_docs",
    "q_centroid", "k_centroid", "positional_share", "positional_share_std", "positional_share_seq",
]


def region_layout(n_pos: int, region_len: int, n_query: int, sink: int = 1) -> tuple[int, int]:
    """Region ``R = [r0, r1)`` with ``r1 = n_pos − n_query`` and ``r0 = r1 − region_len``.

    Returns:
        ``(r0, r1)``; the query rows are ``[r1, n_pos)``.

    Raises:
        ValueError: if the region would overlap the sink or be shorter than 3 tokens, or no query row is left.
    """
    r1 = n_pos - n_query
    r0 = r1 - region_len
    if region_len < 3 or n_query < 1 or r0 < sink:
        raise ValueError(
            f"region_len={region_len}, n_query={n_query} do not fit n_pos={n_pos} after sink={sink} "
            "(need region_len >= 3, n_query >= 1, n_pos - n_query - region_len >= sink)"
        )
    return r0, r1


def taxonomy_windows(
    model: Any, corpus: Any = None, *, n_prompts: int = 16, seq_len: int = 256, n_ref: int = 4, seed: int = 0
) -> tuple[Windows, Windows]:
    """``(analysed, reference)``: ``n_prompts`` windows from DISTINCT documents, and ``n_ref``
    reference windows (for the global ``k̄``) from a disjoint document set
    (:func:`posgen_tl.io.corpus.reference_windows`, one window per document).

    Raises:
        CorpusError: fewer than ``n_prompts`` analysed documents hold ``seq_len`` tokens.
    """
    pool, ref = reference_windows(model, corpus, seq_len=seq_len, n_seq=n_ref, seed=seed, max_per_doc=1)
    if len(pool) < n_prompts:
        raise CorpusError(f"only {len(pool)} analysed documents hold {seq_len} tokens; {n_prompts} prompts asked for")
    return pool.subset(range(n_prompts)), ref


def _as_tokens(x: Windows | Tensor) -> tuple[Tensor, int]:
    if isinstance(x, Windows):
        return x.tokens.long(), x.n_docs
    if isinstance(x, Tensor):
        return x.long(), -1
    raise TypeError(f"expected a token tensor or Windows, got {type(x).__name__}")


class _LayerAcc:
    """Per-layer accumulators: score sums, per-prompt scores, band statistics, D3 shares."""

    def __init__(self, n_prompts: int, n_heads: int, n_bands: int) -> None:
        self.sums: LogitScoreSums | None = None
        self.pos = np.full((n_prompts, n_heads, 1 + n_bands), np.nan)
        self.sym = np.full((n_prompts, n_heads, 1 + n_bands), np.nan)
        self.share = np.full((n_prompts, n_heads), np.nan)
        self.share_seq = np.full((n_prompts, n_heads), np.nan)
        self.q_stats: BandStats | None = None
        self.k_stats: BandStats | None = None


def _score_prompt(
    c: QKCapture, j: int, perms: Tensor, nulls: Tensor, r0: int, r1: int, sink: int, k_mean: Tensor,
    rel_tol: float, acc: _LayerAcc, prompt: int,
) -> None:
    """Scores of prompt ``j`` of this batch (sequences ``j·(K+1)`` clean, then its K permutations)."""
    rope = c.rope
    n_k = perms.shape[0] + 1
    sl = slice(j * n_k, (j + 1) * n_k)
    n = c.rot_q.shape[1]
    rows = torch.arange(r1, n)
    if rope.sliding_window is not None:
        rows = rows[rows - r0 < rope.sliding_window]  # only rows that see ALL of R
    clean_q, clean_k = c.q[sl][:1], c.k[sl][:1]
    if acc.q_stats is None:
        acc.q_stats = BandStats(c.q.shape[-2], c.q.shape[-1], rope.rotary_dim, rope.layout)
        acc.k_stats = BandStats(c.k.shape[-2], c.k.shape[-1], rope.rotary_dim, rope.layout)
    keep = c.positions[sl][:1] >= sink
    acc.q_stats.update(clean_q, keep)
    acc.k_stats.update(clean_k, keep)
    fmask = fit_mask(n, sink=sink, sliding_window=rope.sliding_window)
    d3 = d3_split(clean_q, clean_k, k_mean, c.positions[sl][:1], rope)
    acc.share[prompt] = positional_share(d3.f, d3.g, fmask)[0].cpu().numpy()
    k_seq = clean_k[0, sink:].double().mean(0).float()  # this prompt's own mean key (sink excluded)
    d3s = d3_split(clean_q, clean_k, k_seq, c.positions[sl][:1], rope)
    acc.share_seq[prompt] = positional_share(d3s.f, d3s.g, fmask)[0].cpu().numpy()
    if rows.numel() == 0:
        return
    rq = c.rot_q[sl][:, rows]  # [K+1, n_q, H, d]
    rk = c.rot_k_expanded()[sl]  # [K+1, n, H, d]
    # clean attention mass on R: softmax over every visible key of the row
    full_clean = scores_from_rotated(rq[:1], rk[:1], rope.score_scale)[0]  # [H, n_q, n]
    vis = causal_mask(n, sliding_window=rope.sliding_window, device=full_clean.device)[rows]
    attn = torch.softmax(full_clean.double().masked_fill(~vis, float("-inf")), -1)
    mass = attn[..., r0:r1].sum(-1)  # [H, n_q]
    bl = band_logits(rq, rk[:, r0:r1], rope)  # [K+1, H, band, n_q, L]
    full = bl.sum(2) + pass_logits(rq, rk[:, r0:r1], rope)
    w = torch.cat([full[:, :, None], bl], 2)  # [K+1, H, 1+band, n_q, L]
    min_std = row_spread_threshold(full[0], rel=rel_tol)
    weights = mass[:, None, :].expand(-1, w.shape[2], -1)
    sums = region_logit_scores(w[0], w[1:], perms, weights, min_std=min_std, null_perm=nulls)
    acc.sums = sums if acc.sums is None else acc.sums + sums
    one = sums.finalize()
    acc.pos[prompt] = one["positional"].cpu().numpy()
    acc.sym[prompt] = one["symbolic"].cpu().numpy()


def _nanstd(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        n = np.isfinite(x).sum(0)
        return np.where(n > 1, np.nanstd(x, 0, ddof=1), np.nan)


def _nanmean(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(x, 0)


def head_taxonomy(
    model: Any,
    tokens: Windows | Tensor | Any = None,
    reference: Windows | Tensor | None = None,
    *,
    layers: Sequence[int] | None = None,
    n_prompts: int = 16,
    seq_len: int = 256,
    n_ref: int = 4,
    n_perm: int = 8,
    region_len: int = 64,
    n_query: int = 64,
    block: int = 1,
    sink: int = 1,
    seed: int = 0,
    rel_tol: float = 1e-3,
    min_score: float = 0.2,
    quantile: float = 0.95,
    batch_size: int = 1,
    model_label: str | None = None,
    twin_label: str = "trained",
    progress: bool = True,
) -> pd.DataFrame:
    """Positional/symbolic scores per head and per band with their null, labels, frequency usage
    and the D3 positional share (global ``k̄``).

    ``tokens``: analysed windows (:class:`Windows` or a ``[batch, pos]`` tensor, all rows used)
    and ``reference``: the windows for the global ``k̄`` (disjoint documents). If ``tokens`` is
    anything else (a text corpus, ``None`` = default prose), both come from
    :func:`taxonomy_windows` (``n_prompts`` distinct documents, ``n_ref`` reference ones).
    Region/rows from :func:`region_layout`; ``n_perm`` permutations per prompt, drawn with
    seed ``(seed, prompt index)``; ``batch_size`` prompts (each with its permutations) per forward.

    Returns:
        Tidy DataFrame, one row per ``(layer, head, band)``, ``band = −1`` for the full head:
        ``model, twin, layer, kind, head, band, theta, positional, symbolic, null_mc, null_sd,
        null_q, label, positional_std, symbolic_std`` (std over prompts), ``n_rows_used,
        n_rows_excluded`` (query rows × permutations), ``region_mass`` (mean clean attention
        mass on ``R`` of the used rows), ``n_prompts, n_docs, q_energy_share, k_energy_share``
        (band rows), ``q_centroid, k_centroid, positional_share, positional_share_std``
        (global k̄), ``positional_share_seq`` (each prompt's own mean key, sink excluded: the
        random twin's keys carry a large per-sequence constant, METHOD §2) (full-head rows;
        NaN on band rows), and the settings ``n_perm, region_len, n_query,
        block, min_score, rel_tol``.

    Raises:
        ValueError: a reference set is missing for a token tensor, or the layout does not fit.
    """
    if n_perm < 1:
        raise ValueError(f"n_perm must be >= 1, got {n_perm}")
    if isinstance(tokens, (Windows, Tensor)):
        if reference is None:
            raise ValueError("a token tensor/Windows needs `reference` windows from other documents (global k̄)")
    else:
        tokens, reference = taxonomy_windows(model, tokens, n_prompts=n_prompts, seq_len=seq_len, n_ref=n_ref,
                                             seed=seed)
    toks, n_docs = _as_tokens(tokens)
    ref, _ = _as_tokens(reference)
    spec, _ = probe_hooks(model)
    n_p, n = toks.shape
    layers = list(range(spec.n_layers)) if layers is None else sorted({int(x) % spec.n_layers for x in layers})
    r0, r1 = region_layout(n, region_len, n_query, sink)

    # pass 1: global k̄ per layer and kv-head from the reference windows (sink excluded)
    from posgen_tl.experiments.decomposition import reference_key_means  # noqa: PLC0415

    k_means = {l: m.float() for l, m in reference_key_means(model, ref, layers, sink=sink, batch_size=4,
                                                             progress=progress).items()}
    # pass 2: clean + permuted prompts, interleaved per prompt
    perms, nulls, seqs = [], [], []
    for p in range(n_p):
        g = torch.Generator().manual_seed(1_000_003 * int(seed) + p)
        pm = region_permutations(region_len, n_perm, block=block, generator=g)
        perms.append(pm)
        nulls.append(torch.stack([torch.randperm(region_len, generator=g) for _ in range(n_perm)]))
        seqs.append(toks[p])
        for k in range(n_perm):
            t = toks[p].clone()
            t[r0:r1] = toks[p, r0:r1][pm[k]]
            seqs.append(t)
    paired = torch.stack(seqs)
    accs = {l: _LayerAcc(n_p, spec.n_heads, spec.layer(l).n_bands) for l in layers}
    per = n_perm + 1

    def on_batch(c: QKCapture) -> None:
        first = c.seq_offset // per
        for j in range(c.rot_q.shape[0] // per):
            p = first + j
            _score_prompt(c, j, perms[p], nulls[p], r0, r1, sink, k_means[c.layer], rel_tol, accs[c.layer], p)

    stream_qk(model, paired, on_batch, layers, batch_size=per * batch_size,
              progress="taxonomy" if progress else False)

    label = model_label or str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    frames = []
    for l in layers:
        rope, acc = spec.layer(l), accs[l]
        n_h, n_b = spec.n_heads, rope.n_bands
        if acc.sums is None:
            nan = torch.full((n_h, 1 + n_b), float("nan"), dtype=torch.float64)
            zero = torch.zeros_like(nan)
            res = dict(positional=nan, symbolic=nan, null_mc=nan, null_sd=nan, null_q=nan, n_used=zero,
                       n_excluded=zero, weight=zero)
        else:
            res = acc.sums.finalize(quantile)
        res = {k: v.cpu().numpy() for k, v in res.items()}
        q_e = acc.q_stats.energy_share().cpu().double()
        k_e = acc.k_stats.energy_share().cpu().double()[kv_head_index(n_h, acc.k_stats.n_heads)]  # → query heads
        q_c, k_c = frequency_centroid(q_e).numpy(), frequency_centroid(k_e).numpy()
        sh, sh_sd = _nanmean(acc.share), _nanstd(acc.share)
        head = np.repeat(np.arange(n_h), 1 + n_b)
        band = np.tile(np.arange(-1, n_b), n_h)
        is_full = band < 0
        bi = np.clip(band, 0, None)
        nan = np.full(head.shape, np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            mass = np.where(res["n_used"] > 0, res["weight"] / res["n_used"], np.nan)
        frames.append(pd.DataFrame(dict(
            model=label, twin=twin_label, layer=l, kind=rope.kind, head=head, band=band,
            theta=np.where(is_full, np.nan, rope.theta.cpu().numpy()[bi]),
            positional=res["positional"].ravel(), symbolic=res["symbolic"].ravel(),
            null_mc=res["null_mc"].ravel(), null_sd=res["null_sd"].ravel(), null_q=res["null_q"].ravel(),
            label=taxonomy_label(res["positional"].ravel(), res["symbolic"].ravel(), res["null_q"].ravel(),
                                 min_score=min_score),
            positional_std=_nanstd(acc.pos).ravel(), symbolic_std=_nanstd(acc.sym).ravel(),
            n_rows_used=res["n_used"].ravel().astype(int), n_rows_excluded=res["n_excluded"].ravel().astype(int),
            region_mass=mass.ravel(), n_prompts=n_p, n_docs=n_docs,
            q_energy_share=np.where(is_full, nan, q_e.numpy()[head, bi]),
            k_energy_share=np.where(is_full, nan, k_e.numpy()[head, bi]),
            q_centroid=np.where(is_full, q_c[head], nan), k_centroid=np.where(is_full, k_c[head], nan),
            positional_share=np.where(is_full, sh[head], nan),
            positional_share_std=np.where(is_full, sh_sd[head], nan),
            positional_share_seq=np.where(is_full, _nanmean(acc.share_seq)[head], nan),
            n_perm=n_perm, region_len=region_len, n_query=n_query, block=block, min_score=min_score,
            rel_tol=rel_tol,
        )))
    return pd.concat(frames, ignore_index=True)


def head_table(model_or_df: Any, tokens: Any = None, reference: Any = None, **kw: Any) -> pd.DataFrame:
    """One row per ``(model, twin, layer, head)``: the full-head rows of :func:`head_taxonomy`.

    Pass a frame from :func:`head_taxonomy` / :func:`head_taxonomy_with_twin`, or a model
    (then ``head_taxonomy(model, tokens, reference, **kw)`` is run first).

    Returns:
        DataFrame with columns :data:`HEAD_COLUMNS`.
    """
    df = model_or_df if isinstance(model_or_df, pd.DataFrame) else head_taxonomy(model_or_df, tokens, reference, **kw)
    return df[df["band"] == -1][HEAD_COLUMNS].reset_index(drop=True)


def head_taxonomy_with_twin(model: Any, tokens: Any = None, reference: Any = None, seed: int = 0, *,
                            twin: Any = None, **kw: Any) -> pd.DataFrame:
    """:func:`head_taxonomy` of the trained model and of ``random_twin(model, seed)`` on the
    SAME windows, reference and permutations (``twin`` column ``'trained'`` / ``'random'``),
    concatenated. ``twin``: an already-built ``random_twin(model, seed)`` to reuse."""
    if not isinstance(tokens, (Windows, Tensor)):
        tokens, reference = taxonomy_windows(model, tokens, n_prompts=kw.pop("n_prompts", 16),
                                             seq_len=kw.pop("seq_len", 256), n_ref=kw.pop("n_ref", 4), seed=seed)
    label = kw.pop("model_label", None) or str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    trained = head_taxonomy(model, tokens, reference, seed=seed, model_label=label, twin_label="trained", **kw)
    twin = random_twin(model, seed) if twin is None else twin
    rand = head_taxonomy(twin, tokens, reference, seed=seed, model_label=label, twin_label="random", **kw)
    return pd.concat([trained, rand], ignore_index=True)


def _heads(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["band"] == -1] if "band" in df else df


def label_counts(df: pd.DataFrame, *, by_band: bool = False) -> pd.DataFrame:
    """Label counts per ``(model, twin)`` (heads), or per ``(model, twin, band)`` if ``by_band``.

    Returns:
        tidy DataFrame ``model, twin, [band,] label, n`` with every label of
        :data:`posgen_tl.maths.taxonomy.LABELS` present (zeros included).
    """
    sub = df[df["band"] >= 0] if by_band else _heads(df)
    keys = ["model", "twin"] + (["band"] if by_band else [])
    tab = sub.groupby(keys + ["label"]).size().unstack("label", fill_value=0)
    tab = tab.reindex(columns=list(LABELS), fill_value=0)
    return tab.stack().rename("n").reset_index()


def share_by_class(head_df: pd.DataFrame, a: str = "positional", b: str = "symbolic") -> pd.DataFrame:
    """Does the D3 positional share differ between heads labelled ``a`` and ``b``? Per twin.

    Two-sided Mann–Whitney U test of ``positional_share`` between the two classes (heads are
    the unit; heads of one model are not independent, so read p as descriptive).

    Returns:
        DataFrame ``model, twin, class_a, class_b, n_a, n_b, median_a, median_b, U, p``
        (``U``/``p`` NaN when a class has fewer than 2 heads).
    """
    df = _heads(head_df)
    rows = []
    for (model, twin), g in df.groupby(["model", "twin"], sort=False):
        xa = g.loc[g["label"] == a, "positional_share"].dropna().to_numpy(float)
        xb = g.loc[g["label"] == b, "positional_share"].dropna().to_numpy(float)
        u, p = (np.nan, np.nan)
        if len(xa) >= 2 and len(xb) >= 2:
            res = mannwhitneyu(xa, xb, alternative="two-sided")
            u, p = float(res.statistic), float(res.pvalue)
        rows.append(dict(model=model, twin=twin, class_a=a, class_b=b, n_a=len(xa), n_b=len(xb),
                         median_a=float(np.median(xa)) if len(xa) else np.nan,
                         median_b=float(np.median(xb)) if len(xb) else np.nan, U=u, p=p))
    return pd.DataFrame(rows)


def taxonomy_agreement(head_df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Spearman rank correlation of ``positional − symbolic`` with ``positional_share``, per twin.

    Uses full-head rows (``band == −1`` if a band column is present) with both finite.

    Returns:
        ``{twin: {"rho": ρ, "p": p-value, "n": number of heads}}`` (NaN ρ/p below 3 heads).
    """
    df = _heads(head_df)
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


def labels_by_layer_group(head_df: pd.DataFrame, n_layers: int | None = None) -> pd.DataFrame:
    """Head label counts per twin and layer third (early / middle / late of ``n_layers`` as
    :func:`posgen_tl.experiments.decomposition.layer_group`, default
    the largest layer + 1).

    Returns:
        tidy-wide DataFrame ``twin, group`` plus one count column per label of
        :data:`posgen_tl.maths.taxonomy.LABELS` (zeros included), groups in layer order.
    """
    df = _heads(head_df)
    n = int(n_layers if n_layers is not None else df["layer"].max() + 1)
    groups = [layer_group(int(x), n) for x in df["layer"]]  # the decomposition tables' thirds
    h = df.assign(group=pd.Categorical(groups, ["early", "middle", "late"], ordered=True))
    tab = h.groupby(["twin", "group"], sort=False, observed=True)["label"].value_counts().unstack(fill_value=0)
    tab = tab.reindex(columns=list(LABELS), fill_value=0).reset_index()
    order = {t: i for i, t in enumerate(dict.fromkeys(df["twin"]))}
    return tab.sort_values(["twin", "group"], key=lambda c: c.map(order) if c.name == "twin" else c).reset_index(drop=True)


def agreement_table(head_df: pd.DataFrame) -> pd.DataFrame:
    """:func:`taxonomy_agreement` as a tidy table ``twin, n_heads, spearman, p``."""
    return pd.DataFrame([{"twin": t, "n_heads": a["n"], "spearman": a["rho"], "p": a["p"]}
                         for t, a in taxonomy_agreement(head_df).items()])
