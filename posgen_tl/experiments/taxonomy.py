"""Head taxonomy runner (docs/method.md §6): positional vs symbolic heads, per band, tied to D3.

Layout per prompt (``n`` tokens): a context region ``R = [r0, r1)`` of ``region_len``
tokens ends ``n_query`` tokens before the end; the query rows are ``[r1, n)``. The tokens
of ``R`` are permuted by ``n_perm`` independent random permutations (seeded per prompt,
:func:`posgen_tl.maths.taxonomy.region_permutations`; single tokens by default — the positional and
symbolic alignments then share only ~1 of ``region_len`` entries, the cleanest
separation; ``block > 1`` permutes word-sized chunks instead). The clean prompt and its
permutations run in ONE forward batch, so one streamed capture holds them all and memory
stays one layer of one batch.

For each layer and head (and each RoPE band taken alone as a 2-D head) the EXACT pre-softmax logits
``s·rot_q·rot_k`` of the query rows over ``R`` are compared before/after each permutation by
:func:`posgen_tl.maths.taxonomy.region_logit_scores` — a band's from its 2 × 2 key moments, without its maps
(:func:`posgen_tl.maths.band_scores.band_region_scores`, equal to scoring the maps of
:func:`posgen_tl.maths.taxonomy.band_logits`): row-centred correlation at the same positions
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
variance (D3's terms, :func:`posgen_tl.maths.decompose.d3_terms`; both kinds of ``k̄`` at once by
:func:`posgen_tl.maths.taxonomy.positional_shares`) with a GLOBAL ``k̄`` per kv-head from
reference windows of documents disjoint from the analysed ones (sink excluded); the same
share with each prompt's own mean key is reported beside it (``positional_share_seq``).
:func:`share_by_class` tests whether positional heads carry more positional share than
symbolic heads (Mann–Whitney U).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from posgen_tl.engine.swaps import windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.capture import QKCapture, probe_hooks
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.io.models import random_twin
from posgen_tl.io.sampling import Windows, sample_windows
from posgen_tl.maths.band_scores import band_region_scores
from posgen_tl.maths.band_stats import BandStats
from posgen_tl.maths.decompose import causal_mask as fit_mask
from posgen_tl.maths.rope import causal_mask, kv_head_index, scores_from_rotated
from posgen_tl.maths.taxonomy import (
    LABELS,
    LogitScoreSums,
    frequency_centroid,
    positional_shares,
    region_logit_scores,
    region_permutations,
    row_spread_threshold,
    taxonomy_label,
)
from posgen_tl.stats.taxonomy_tables import (  # noqa: F401 (the names stay importable here)
    agreement_table,
    label_counts,
    labels_by_layer_group,
    share_by_class,
    taxonomy_agreement,
)

__all__ = [
    "region_layout",
    "Config",
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
    k_seq = clean_k[0, sink:].double().mean(0).float()  # this prompt's own mean key (sink excluded)
    shares = positional_shares(clean_q, clean_k, torch.stack([k_mean.to(k_seq.device), k_seq]), c.positions[sl][:1],
                               rope, fmask)[:, 0].cpu().numpy()  # [kind, head]: the global k̄, then the prompt's own
    acc.share[prompt], acc.share_seq[prompt] = shares
    if rows.numel() == 0:
        return
    rq = c.rot_q[sl][:, rows]  # [K+1, n_q, H, d]
    rk = c.rot_k_expanded()[sl]  # [K+1, n, H, d]
    # clean attention mass on R: softmax over every visible key of the row
    full_clean = scores_from_rotated(rq[:1], rk[:1], rope.score_scale)[0]  # [H, n_q, n]
    vis = causal_mask(n, sliding_window=rope.sliding_window, device=full_clean.device)[rows]
    attn = torch.softmax(full_clean.double().masked_fill(~vis, float("-inf")), -1)
    mass = attn[..., r0:r1].sum(-1)  # [H, n_q]
    dt = torch.promote_types(rq.dtype, torch.float32)
    full = scores_from_rotated(rq.to(dt), rk[:, r0:r1].to(dt), rope.score_scale)  # [K+1, H, n_q, L]: the head's logits
    min_std = row_spread_threshold(full[0], rel=rel_tol)
    head = region_logit_scores(full[0], full[1:], perms, mass, min_std=min_std, null_perm=nulls)  # [H]
    bands = band_region_scores(rq, rk[:, r0:r1], rope, perms, nulls, mass, min_std=min_std)  # [H, band], no maps
    sums = LogitScoreSums(*(torch.cat([getattr(head, f.name)[:, None], getattr(bands, f.name)], -1)
                            for f in fields(LogitScoreSums)))  # [H, 1 + band]: the full head at band −1
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


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the head taxonomy (docs/method.md §6); ``n_seq`` is the number of prompts."""

    NAME: ClassVar[str] = "taxonomy"
    n_seq: int = base.option(8, "prompts (windows of distinct documents)", "int", quick=2, full=32)
    n_ref: int = base.n_ref_option()
    layers: Any = base.layers_option("classified")
    n_perm: int = base.option(4, "region permutations per prompt", "int", full=8)
    region_len: int = base.option(0, "tokens of the permuted region; 0 = max(4, min(64, seq_len / 4))", "count")
    n_query: int = base.option(0, "query rows after the region; 0 = the region length", "count")
    block: int = base.option(1, "permute blocks of this many tokens (1 = single tokens)", "int")
    sink: int = base.option(1, "first positions excluded (attention sinks)", "count")
    min_score: float = base.option(0.2, "a score must also exceed this to count", "float")
    quantile: float = base.option(0.95, "quantile of the permutation null a score must exceed", "float")
    rel_tol: float = base.option(1e-3, "rows whose logit spread is below this fraction of the head's are excluded", "float")
    batch_size: int = base.batch_option(1, "prompts (each with its permutations)")

    def region(self) -> tuple[int, int]:
        """``(region_len, n_query)`` with the automatic defaults resolved."""
        span = max(4, min(64, self.seq_len // 4))
        region = self.region_len or span
        return region, self.n_query or span


def head_taxonomy(
    model: Any,
    tokens: Windows | Tensor | Any = None,
    reference: Windows | Tensor | None = None,
    cfg: Config | None = None,
    *,
    model_label: str | None = None,
    twin_label: str = "trained",
    progress: bool = True,
    **options: Any,
) -> pd.DataFrame:
    """Positional/symbolic scores per head and per band with their null, labels, frequency usage
    and the D3 positional share (global ``k̄``).

    ``tokens``: analysed windows (:class:`Windows` or a ``[batch, pos]`` tensor, all rows used)
    and ``reference``: the windows for the global ``k̄`` (disjoint documents). If ``tokens`` is
    anything else (a text corpus, ``None`` = default prose), both come from
    :func:`posgen_tl.io.sampling.sample_windows` (``cfg.n_seq`` prompts, ``cfg.n_ref`` reference windows).
    ``cfg`` (:class:`Config`, with ``options`` applied): region/rows from :func:`region_layout`;
    ``n_perm`` permutations per prompt, drawn with seed ``(seed, prompt index)``; ``batch_size``
    prompts (each with its permutations) per forward.

    Returns:
        Tidy DataFrame, one row per ``(layer, head, band)``, ``band = −1`` for the full head:
        ``model, twin, layer, kind, head, band, theta, positional, symbolic, null_mc, null_sd,
        null_q, label, positional_std, symbolic_std`` (std over prompts), ``n_rows_used,
        n_rows_excluded`` (query rows × permutations), ``region_mass`` (mean clean attention
        mass on ``R`` of the used rows), ``n_prompts, n_docs, q_energy_share, k_energy_share``
        (band rows), ``q_centroid, k_centroid, positional_share, positional_share_std``
        (global k̄), ``positional_share_seq`` (each prompt's own mean key, sink excluded: the
        random twin's keys carry a large per-sequence constant, docs/method.md §2) (full-head rows;
        NaN on band rows), and the settings ``n_perm, region_len, n_query,
        block, min_score, rel_tol``.

    Raises:
        ValueError: a reference set is missing for a token tensor, or the layout does not fit.
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the head taxonomy")
    n_perm, block, sink, seed, rel_tol = cfg.n_perm, cfg.block, cfg.sink, cfg.seed, cfg.rel_tol
    batch_size = cfg.batch_size
    region_len, n_query = cfg.region()
    if isinstance(tokens, (Windows, Tensor)):
        if reference is None:
            raise ValueError("a token tensor/Windows needs `reference` windows from other documents (global k̄)")
    else:
        tokens, reference = sample_windows(model, cfg.corpus if tokens is None else tokens, n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref,
                                           seed=seed)
    toks, n_docs = _as_tokens(tokens)
    ref, _ = _as_tokens(reference)
    spec, _ = probe_hooks(model)
    n_p, n = toks.shape
    layers = base.resolve_layers(cfg.layers, spec.n_layers)
    r0, r1 = region_layout(n, region_len, n_query, sink)

    # pass 1: global k̄ per layer and kv-head from the reference windows (sink excluded)
    from posgen_tl.hooks.edits import reference_key_means  # noqa: PLC0415

    k_means = {l: m.float() for l, m in reference_key_means(model, ref, layers, sink=sink, batch_size=4,  # noqa: E741
                                                             progress=progress).items()}
    # pass 2: clean + permuted prompts, interleaved per prompt
    paired, perms, nulls = _permuted_prompts(toks, r0, r1, n_perm, block, seed)
    accs = {l: _LayerAcc(n_p, spec.n_heads, spec.layer(l).n_bands) for l in layers}  # noqa: E741
    per = n_perm + 1

    def on_batch(c: QKCapture) -> None:
        first = c.seq_offset // per
        for j in range(c.rot_q.shape[0] // per):
            p = first + j
            _score_prompt(c, j, perms[p], nulls[p], r0, r1, sink, k_means[c.layer], rel_tol, accs[c.layer], p)

    stream_qk(model, paired, on_batch, layers, batch_size=per * batch_size,
              progress="taxonomy" if progress else False)

    label = model_label or str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    frames = [_layer_frame(accs[l], spec.layer(l), l, cfg, label=label, twin_label=twin_label, n_prompts=n_p,
                           n_docs=n_docs) for l in layers]  # noqa: E741
    return pd.concat(frames, ignore_index=True)


def _permuted_prompts(toks: Tensor, r0: int, r1: int, n_perm: int, block: int,
                      seed: int) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """Every prompt followed by its ``n_perm`` region-permuted copies (``[n_prompts·(n_perm+1), pos]``),
    with the permutations and the independent null permutations of each prompt (seed ``(seed, prompt)``)."""
    region_len = r1 - r0
    perms, nulls, seqs = [], [], []
    for p in range(toks.shape[0]):
        g = torch.Generator().manual_seed(1_000_003 * int(seed) + p)
        pm = region_permutations(region_len, n_perm, block=block, generator=g)
        perms.append(pm)
        nulls.append(torch.stack([torch.randperm(region_len, generator=g) for _ in range(n_perm)]))
        seqs.append(toks[p])
        for k in range(n_perm):
            t = toks[p].clone()
            t[r0:r1] = toks[p, r0:r1][pm[k]]
            seqs.append(t)
    return torch.stack(seqs), perms, nulls


def _layer_frame(acc: _LayerAcc, rope: Any, layer: int, cfg: Config, *, label: str, twin_label: str,
                 n_prompts: int, n_docs: int) -> pd.DataFrame:
    """The rows of one layer (full heads at ``band = −1``, then every band) from its accumulators."""
    region_len, n_query = cfg.region()
    n_h, n_b = acc.pos.shape[1], rope.n_bands
    if acc.sums is None:
        nan = torch.full((n_h, 1 + n_b), float("nan"), dtype=torch.float64)
        zero = torch.zeros_like(nan)
        res = dict(positional=nan, symbolic=nan, null_mc=nan, null_sd=nan, null_q=nan, n_used=zero,
                   n_excluded=zero, weight=zero)
    else:
        res = acc.sums.finalize(cfg.quantile)
    res = {k: v.cpu().numpy() for k, v in res.items()}
    q_e = acc.q_stats.energy_share().cpu().double()
    k_e = acc.k_stats.energy_share().cpu().double()[kv_head_index(n_h, acc.k_stats.n_heads)]  # → query heads
    q_c, k_c = frequency_centroid(q_e).cpu().numpy(), frequency_centroid(k_e).cpu().numpy()
    sh, sh_sd = _nanmean(acc.share), _nanstd(acc.share)
    head = np.repeat(np.arange(n_h), 1 + n_b)
    band = np.tile(np.arange(-1, n_b), n_h)
    is_full = band < 0
    bi = np.clip(band, 0, None)
    nan = np.full(head.shape, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        mass = np.where(res["n_used"] > 0, res["weight"] / res["n_used"], np.nan)
    return pd.DataFrame(dict(
        model=label, twin=twin_label, layer=layer, kind=rope.kind, head=head, band=band,
        theta=np.where(is_full, np.nan, rope.theta.cpu().numpy()[bi]),
        positional=res["positional"].ravel(), symbolic=res["symbolic"].ravel(),
        null_mc=res["null_mc"].ravel(), null_sd=res["null_sd"].ravel(), null_q=res["null_q"].ravel(),
        label=taxonomy_label(res["positional"].ravel(), res["symbolic"].ravel(), res["null_q"].ravel(),
                             min_score=cfg.min_score),
        positional_std=_nanstd(acc.pos).ravel(), symbolic_std=_nanstd(acc.sym).ravel(),
        n_rows_used=res["n_used"].ravel().astype(int), n_rows_excluded=res["n_excluded"].ravel().astype(int),
        region_mass=mass.ravel(), n_prompts=n_prompts, n_docs=n_docs,
        q_energy_share=np.where(is_full, nan, q_e.cpu().numpy()[head, bi]),
        k_energy_share=np.where(is_full, nan, k_e.cpu().numpy()[head, bi]),
        q_centroid=np.where(is_full, q_c[head], nan), k_centroid=np.where(is_full, k_c[head], nan),
        positional_share=np.where(is_full, sh[head], nan),
        positional_share_std=np.where(is_full, sh_sd[head], nan),
        positional_share_seq=np.where(is_full, _nanmean(acc.share_seq)[head], nan),
        n_perm=cfg.n_perm, region_len=region_len, n_query=n_query, block=cfg.block, min_score=cfg.min_score,
        rel_tol=cfg.rel_tol,
    ))


def head_table(model_or_df: Any, tokens: Any = None, reference: Any = None, **kw: Any) -> pd.DataFrame:
    """One row per ``(model, twin, layer, head)``: the full-head rows of :func:`head_taxonomy`.

    Pass a frame from :func:`head_taxonomy` / :func:`head_taxonomy_with_twin`, or a model
    (then ``head_taxonomy(model, tokens, reference, **kw)`` is run first).

    Returns:
        DataFrame with columns :data:`HEAD_COLUMNS`.
    """
    df = model_or_df if isinstance(model_or_df, pd.DataFrame) else head_taxonomy(model_or_df, tokens, reference, **kw)
    return df[df["band"] == -1][HEAD_COLUMNS].reset_index(drop=True)


def head_taxonomy_with_twin(model: Any, tokens: Any = None, reference: Any = None, cfg: Config | None = None, *,
                            twin: Any = None, progress: bool = True, **options: Any) -> pd.DataFrame:
    """:func:`head_taxonomy` of the trained model and of ``random_twin(model, cfg.seed)`` on the
    SAME windows, reference and permutations (``twin`` column ``'trained'`` / ``'random'``),
    concatenated. ``twin``: an already-built random twin to reuse."""
    cfg = base.config_of(Config, cfg, options)
    if not isinstance(tokens, (Windows, Tensor)):
        tokens, reference = sample_windows(model, cfg.corpus if tokens is None else tokens, n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref,
                                           seed=cfg.seed)
    label = str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    trained = head_taxonomy(model, tokens, reference, cfg, model_label=label, twin_label="trained", progress=progress)
    twin = random_twin(model, cfg.seed) if twin is None else twin
    rand = head_taxonomy(twin, tokens, reference, cfg, model_label=label, twin_label="random", progress=progress)
    return pd.concat([trained, rand], ignore_index=True)


# ----------------------------------------------------------------------------- report / study


NAME = "taxonomy"
ABOUT = "positional vs symbolic head taxonomy, trained beside the random twin (docs/method.md §6)"
NEEDS: tuple[str, ...] = ()


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``heads`` (:func:`head_table`: one row per twin × layer × head), ``bands`` (the band rows of
            :func:`head_taxonomy`: each RoPE band as a 2-D head), ``link`` (:func:`share_by_class`: D3 positional
            share of positional vs symbolic heads) and ``band_counts`` (:func:`label_counts` per band).
        config: the Config's options. meta: model, the windows' source, the region layout, prompts, documents,
            layers, ``min_score``.
    """


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"heads": "heads.csv", "bands": "heads_bands.csv", "link": "heads_link.csv",
         "band_counts": "heads_band_counts.csv"}
LEGACY_META = "heads_meta.json"


@base.shares_heap
def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, twin: Any = None, progress: bool = True,
        checkpoint: str | Path | None = None, **options: Any) -> Result:
    """Classify every head (and every band as a 2-D head) of the trained model and — unless ``cfg.twin`` is false
    or ``twin`` is ``False`` — of its random twin (``twin``: a model or a callable giving one; ``None`` builds it) on
    the same prompts. ``checkpoint``: a folder that keeps each model's finished rows, so a rerun of the same design
    after an interruption computes only the missing model. Returns the :class:`Result`."""
    from posgen_tl.io.sampling import sample_or_chunks  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    tokens, ref, source = sample_or_chunks(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq,
                                           seq_len=cfg.seq_len, n_ref=cfg.n_ref, seed=cfg.seed)
    spec = probe_hooks(model)[0]
    models = [("trained", model)]
    if cfg.twin and twin is not False:
        models.append(("random", base.twin_of(model, twin, cfg.seed)))
    label = str(getattr(getattr(model, "cfg", None), "model_name", "model")) if len(models) > 1 else spec.model_name
    parts = [base.kept_tables(
        base.model_pieces(checkpoint, name, NAME, cfg, m, tokens, reference=windows_fingerprint(ref)), name, ("rows",),
        lambda m=m, name=name: {"rows": head_taxonomy(m, tokens, ref, cfg, model_label=label, twin_label=name,
                                                      progress=progress)})["rows"] for name, m in models]
    df = pd.concat(parts, ignore_index=True)
    region, n_query = cfg.region()
    meta = {"model": spec.model_name, "source": source, "region_len": region, "n_query": n_query, "n_perm": cfg.n_perm,
            "block": cfg.block, "n_prompts": len(tokens), "n_docs": int(df["n_docs"].iloc[0]),
            "n_layers": spec.n_layers, "min_score": float(df["min_score"].iloc[0])}
    tables = {"heads": head_table(df), "bands": df[df["band"] >= 0].reset_index(drop=True), "link": share_by_class(df),
              "band_counts": label_counts(df, by_band=True)}
    return Result(tables, cfg.as_dict(), meta)


def render(result: Result) -> Any:
    """The report section: label counts beside the twin, scores, the link to D3's positional share, figures."""
    from posgen_tl.plot.taxonomy import (  # noqa: PLC0415
        plot_frequency_usage,
        plot_label_counts,
        plot_positional_symbolic_plane,
        plot_taxonomy_vs_share,
    )
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    title = "7 · Head taxonomy: positional vs symbolic heads (docs/method.md §6)"
    if result.skipped:
        return skipped_section(title, result.skipped, "taxonomy", result.meta.get("hint"))
    t, meta = result.tables, result.meta
    heads, link = t["heads"].assign(band=-1), t["link"]
    both = pd.concat([heads, t["bands"]], ignore_index=True) if "bands" in t else heads
    counts = label_counts(heads).pivot(index="twin", columns="label", values="n")
    counts = counts[[c for c in LABELS if c in counts]].astype(int).reset_index()
    scores = heads.groupby("twin", sort=False).agg(
        positional=("positional", "mean"), symbolic=("symbolic", "mean"), null_q=("null_q", "mean"),
        null_mc=("null_mc", "mean"), rows_used=("n_rows_used", "sum"), rows_excluded=("n_rows_excluded", "sum"),
        k_centroid=("k_centroid", "mean"), positional_share=("positional_share", "mean")).reset_index()
    by_class = heads.groupby(["twin", "label"], sort=False).agg(
        n=("head", "size"), positional_share=("positional_share", "median"),
        k_centroid=("k_centroid", "median"), region_mass=("region_mass", "median")).reset_index()
    tr = counts[counts["twin"] == "random"]
    both_twin = int(tr["both"].iloc[0]) if len(tr) and "both" in tr else 0
    band_counts = (t["band_counts"].groupby(["twin", "label"], sort=False)["n"].sum()
                   .unstack(fill_value=0).reindex(columns=list(LABELS), fill_value=0).reset_index())
    return Section(
        title,
        verdict=("Label counts (trained vs random twin): " + "; ".join(
            f"{r['twin']}: " + ", ".join(f"{k} {int(r[k])}" for k in counts.columns if k != "twin")
            for _, r in counts.iterrows()) + f". Random-twin heads on 'both': {both_twin}."),
        paragraphs=[
            f"{meta['source']}. In every prompt the tokens of a {meta['region_len']}-token region are permuted "
            f"{meta['n_perm']} times (independent random permutations); for the {meta['n_query']} query rows after it, "
            "the row-centred pre-softmax logits over the region are correlated before/after at the same positions "
            "(positional) and following the moved tokens (symbolic). Rows with near-constant logits are excluded; rows "
            "are weighted by their attention mass on the region; the null is the same correlation under an "
            "independent permutation (mean 0, exact sd). An axis counts when its score exceeds the null's 95 % "
            f"quantile and {meta['min_score']}.",
            "Link to D3: positional share = V(f)/(V(f)+V(g)) of the within-row logit variance, global k̄ from the "
            "reference windows; Mann–Whitney U between positional and symbolic heads (heads of one model are not "
            "independent units: read p as descriptive)."],
        tables=[("Head labels", counts), ("Mean scores and row counts", scores),
                ("Per label: medians of D3 positional share, key frequency centroid (band, 0 = fastest), attention "
                 "mass on the region", by_class),
                ("D3 positional share, positional vs symbolic heads", link)],
        details=[("Head labels by layer third", labels_by_layer_group(heads, meta.get("n_layers"))),
                 ("Band labels: each RoPE band alone as a 2-D head, counts over layer × head × band", band_counts),
                 ("Spearman ρ of (positional − symbolic) with the D3 positional share, across heads", agreement_table(heads))],
        figures=[(figure_to_png(plot_positional_symbolic_plane(heads)), "Positional vs symbolic score per head, "
                  "coloured by label, trained vs twin"),
                 (figure_to_png(plot_label_counts(both)), "Labels of each RoPE band taken alone as a 2-D head, trained "
                  "vs twin"),
                 (figure_to_png(plot_frequency_usage(both)), "RoPE frequency usage: key energy share per (layer, head) "
                  "× band (log scale), trained vs twin"),
                 (figure_to_png(plot_taxonomy_vs_share(heads, link)), "D3 positional share by head label, trained vs "
                  "twin")],
        findings=_findings(link, exploratory=int(meta.get("n_prompts", result.config.get("n_seq", 0))) < 32),
        results={"counts": counts.to_dict("records"), "link": link.to_dict("records"), "meta": meta},
    )


def _findings(link: pd.DataFrame, *, exploratory: bool) -> list:
    """D3 positional share of positional vs symbolic heads (trained model): the difference of the class
    medians and the Mann–Whitney p of :func:`share_by_class`; heads are the unit — descriptive."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415

    t = link[link["twin"] == "trained"]
    if t.empty:
        return [Finding("taxonomy", "not testable", note="no trained-model row in heads_link.csv")]
    r = t.iloc[0]
    n = int(r["n_a"]) + int(r["n_b"])
    p = float(r["p"])
    word = "shares differ" if p == p and p < 0.05 else "no evidence"
    return [Finding("taxonomy", word, float(r["median_a"]) - float(r["median_b"]),
                    f"median share {r['class_a']} − {r['class_b']}", None, p, n, exploratory=exploratory,
                    note=f"n = heads ({int(r['n_a'])} {r['class_a']}, {int(r['n_b'])} {r['class_b']}); Mann–Whitney, "
                         "descriptive", p_kind="Mann–Whitney U with heads as units (descriptive: heads of one model are "
                                               "not independent)", unit="heads")]
