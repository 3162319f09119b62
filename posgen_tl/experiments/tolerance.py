"""Position-tolerance machinery (docs/method.md §4): target-span NLL, T1/T2 curves, T3, as tidy DataFrames.

T1 swaps adjacent tokens in the context, T2 applies the same swaps to position ids only, T3
reads NLL by position with/without an LM-Infinite distance cap. ``p`` counts swapped disjoint
adjacent PAIRS, so ≈ 2p of the context tokens move; the swaps are drawn independently per
(sequence, seed) (:func:`posgen_tl.maths.perturb.swap_seed`).

The studies with verdicts — the causal test of §5 with its controls and the T1/T2 study with
its TOST — live in :mod:`posgen_tl.experiments.causal` and decide verdicts only through
:mod:`posgen_tl.stats.inference`. The summaries here are descriptive (mean, percentile bootstrap CI).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import check_tokens, probe_hooks
from posgen_tl.hooks.positions import StopForward, distance_cap_hooks, final_residual_hook
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, sample_windows
from posgen_tl.maths.perturb import (
    adjacent_swap_permutation,
    nll_from_logits,
    position_ids_for_permutation,
    swap_seed,
    word_units,
)
from posgen_tl.report.text import md_table
from posgen_tl.stats.inference import bootstrap_ci

__all__ = [
    "Config",
    "SwapOptions",
    "T12Result",
    "t1_t2_study",
    "curve_rows",
    "perturbed_inputs",
    "sequence_perms",
    "windows_fingerprint",
    "nll_on_target",
    "transposition_curve",
    "length_curve",
    "length_summary",
]

DEFAULT_FRACS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
Hooks = Sequence[tuple[str, Callable]]


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SwapOptions(base.Config):
    """The swap design shared by the T1/T2 study and the causal test (one declaration for both)."""

    n_seq: int = base.option(12, "analysed sequences (windows of distinct documents first; at least 4)", "int",
                             quick=4, full=64)
    target_len: int = base.option(0, "tokens at the end whose NLL is measured (never perturbed); 0 = min(64, "
                                     "seq_len / 4)", "count")
    fracs: tuple[float, ...] = base.option((0.0, 0.1, 0.2), "swap fractions p (fraction of disjoint adjacent "
                                           "pairs swapped; must include 0)", "floats", quick=(0.0, 0.2),
                                           full=(0.0, 0.02, 0.05, 0.1, 0.2))
    seeds: tuple[int, ...] = base.option((0,), "swap seeds, averaged inside each sequence", "ints")

    def target(self) -> int:
        """The target length in tokens (``target_len``, or ``min(64, seq_len // 4)`` when it is 0)."""
        return self.target_len or min(64, self.seq_len // 4)


@dataclass(frozen=True)
class Config(SwapOptions):
    """Options of the T1/T2 tolerance study (docs/method.md §4)."""

    NAME: ClassVar[str] = "tolerance"
    twin_seeds: tuple[int, ...] = base.option((0,), "swap seeds for the random twin's T1/T2 curves", "ints")
    batch_size: int = base.batch_option(8)
    t12_margin: float = base.option(0.01, "TOST margin of the T1 − T2 AUC (nats × p) for 'alike', declared before the "
                                          "run (about a quarter of SmolLM2's T1 AUC over p ≤ 0.2 in the first landing)",
                                    "float")


# ----------------------------------------------------------------------------- NLL


def _target_nll(model, batch, target_len, pos, hooks, resid=None, start_at_layer=None) -> Tensor:
    n = batch.shape[1]
    store: dict = {}
    fin = final_residual_hook(model, store, n - target_len - 1, n - 1)
    kw = {} if pos is None else {"position_ids": pos}
    inp = batch
    if resid is not None:
        inp, kw["start_at_layer"] = resid, start_at_layer
    with model.hooks(fwd_hooks=list(hooks) + ([fin] if fin else [])):
        try:
            logits = model(inp, **kw)
        except StopForward:
            logits = model.unembed(store["resid"])
    if fin is None:
        logits = logits[:, n - target_len - 1 : n - 1]
    return nll_from_logits(torch.cat([logits, logits[:, :1]], 1), batch[:, n - target_len - 1 :]).mean(-1)


@torch.no_grad()
def nll_on_target(
    model: Any, tokens: Int[Tensor, "batch pos"], *, target_len: int,
    position_ids: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    fwd_hooks: Hooks = (), batch_size: int = 4,
    resid_at: tuple[int, Float[Tensor, "batch pos d_model"]] | None = None,
) -> Float[Tensor, "batch"]:  # fmt: skip
    """Mean next-token NLL of the last ``target_len`` tokens of each sequence (float32, CPU).

    Only the span's logits are computed (final residual captured, then unembedded), so a
    262k vocabulary costs ``target_len`` rows per sequence. ``fwd_hooks`` are attached.
    ``resid_at=(L, resid)``: resume from the residual entering block ``L`` (from
    ``model(tokens, stop_at_layer=L)``) via TransformerLens' ``start_at_layer``; ``tokens``
    still give the targets. (In TransformerLens 4.3 the bridge still executes blocks
    0..L−1 internally and discards them: exact, but no faster.)

    Returns:
        ``[batch]`` float32 mean NLL over the target span.
    """
    tokens = check_tokens(model, tokens, probe_hooks(model)[0])
    if not 0 < target_len < tokens.shape[1]:
        raise ValueError(f"target_len={target_len} must be in (0, {tokens.shape[1]})")
    out = []
    for s in range(0, tokens.shape[0], batch_size):
        batch = tokens[s : s + batch_size]
        pos = None
        if position_ids is not None:
            p = position_ids.to(batch.device)
            pos = p.expand(batch.shape[0], -1) if p.ndim == 1 else p[s : s + batch.shape[0]]
        resid = None if resid_at is None else resid_at[1][s : s + batch_size]
        layer = None if resid_at is None else resid_at[0]
        out.append(_target_nll(model, batch, target_len, pos, fwd_hooks, resid, layer).float().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------- T1 / T2


def _perms(model, tokens, frac, seed, start, stop, word_level, keys) -> Int[Tensor, "batch pos"]:
    """One permutation per row, seeded by ``swap_seed(0, *keys[row], seed)`` (independent per
    (sequence, seed); the same for T1 and T2 and for every hook set)."""
    n = tokens.shape[1]
    out = []
    for row, (doc, st) in zip(tokens.cpu(), keys):
        units = word_units(model.tokenizer.convert_ids_to_tokens(row.tolist())) if word_level else None
        out.append(adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=swap_seed(0, doc, st, seed),
                                             units=units))
    return torch.stack(out)


def transposition_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, fracs: Sequence[float] = DEFAULT_FRACS,
    seeds: Sequence[int] = (0, 1), target_len: int = 64, word_level: bool = False,
    fwd_hooks: Hooks = (), modes: Sequence[str] = ("T1",), batch_size: int = 4, start: int = 1,
    clean: Tensor | None = None, progress: bool = True, doc_ids: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
) -> pd.DataFrame:  # fmt: skip
    """T1 (tokens swapped) and/or T2 (same swaps as position ids) curves, one row per
    (mode, sequence, frac, seed): ``seq``, ``doc``, ``clean_nll``, ``nll``, ``delta`` (= nll − clean_nll).

    Swaps only in ``[start, N − target_len)`` (token 0 never moves); each sequence's swaps are
    seeded by (its ``doc_ids`` entry, its ``starts`` entry, seed) — default: the row index as
    document, start 0 — so sequences get independent swaps. ``p = 0`` reuses the clean pass
    (delta exactly 0). ``clean`` may pass precomputed clean NLLs.
    """
    n = tokens.shape[1]
    if clean is None:
        clean = nll_on_target(model, tokens, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
    docs = list(range(tokens.shape[0])) if doc_ids is None else [int(d) for d in doc_ids]
    sts = [0] * tokens.shape[0] if starts is None else [int(x) for x in starts]
    if len(docs) != tokens.shape[0] or len(sts) != tokens.shape[0]:
        raise ValueError(f"doc_ids/starts need one entry per sequence ({tokens.shape[0]})")
    rows = []
    jobs = [(m, f, s) for m in modes for f in fracs for s in seeds]
    for mode, frac, seed in tqdm(jobs, desc="T1/T2", disable=not progress, leave=False):
        if mode not in ("T1", "T2"):
            raise ValueError(f"mode must be 'T1' or 'T2', got {mode!r}")
        if frac == 0:
            nll = clean
        else:
            perm = _perms(model, tokens, frac, seed, start, n - target_len, word_level, list(zip(docs, sts)))
            if mode == "T1":
                toks = torch.gather(tokens, 1, perm.to(tokens.device))
                nll = nll_on_target(model, toks, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
            else:
                pid = torch.stack([position_ids_for_permutation(p) for p in perm])
                nll = nll_on_target(model, tokens, target_len=target_len, position_ids=pid,
                                    fwd_hooks=fwd_hooks, batch_size=batch_size)
        for i in range(tokens.shape[0]):
            rows.append(dict(mode=mode, seq=i, doc=docs[i], frac=float(frac), seed=int(seed), clean_nll=float(clean[i]),
                             nll=float(nll[i]), delta=float(nll[i] - clean[i])))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- T3


@torch.no_grad()
def length_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, cap: int | None = None, bucket: int = 64,
    batch_size: int = 1, fwd_hooks: Hooks = (),
) -> pd.DataFrame:  # fmt: skip
    """T3: mean NLL per position bucket, one row per (sequence, bucket): ``cap`` (None or
    int), ``bucket_start``, ``nll``. With ``cap`` the attention logits are recomputed with
    distance ``min(i − j, cap)`` (:func:`posgen_tl.hooks.positions.distance_cap_hooks`)."""
    tokens = check_tokens(model, tokens, probe_hooks(model)[0])
    hooks = list(fwd_hooks) + (distance_cap_hooks(model, cap) if cap is not None else [])
    rows = []
    for s in range(0, tokens.shape[0], batch_size):
        batch = tokens[s : s + batch_size]
        with model.hooks(fwd_hooks=hooks):
            nll = nll_from_logits(model(batch), batch).float().cpu()  # predicts tokens 1..N-1
        for i in range(batch.shape[0]):
            for b0 in range(0, nll.shape[1], bucket):
                rows.append(dict(cap=cap, seq=s + i, bucket_start=b0 + 1, nll=float(nll[i, b0 : b0 + bucket].mean())))
    return pd.DataFrame(rows)


def length_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Mean NLL per (cap, bucket) with bootstrap CI over sequences."""
    rows = []
    for (cap, b0), g in df.assign(cap=df["cap"].fillna(-1)).groupby(["cap", "bucket_start"]):
        m, lo, hi = bootstrap_ci(g.sort_values("seq")["nll"].to_numpy())
        rows.append(dict(cap=None if cap == -1 else int(cap), bucket_start=b0, value=m, ci_low=lo, ci_high=hi, n_seq=len(g)))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- swaps of windows


def sequence_perms(
    windows: Windows, frac: float, seed: int, *, start: int, stop: int, base_seed: int = 0
) -> Int[Tensor, "batch pos"]:
    """One adjacent-swap permutation per window (``new = old[perm]``), drawn independently per
    (sequence, seed) with :func:`swap_seed`: ``round(frac·(L−1))`` disjoint adjacent pairs of
    the window ``[start, stop)`` swap, so ≈ ``2·frac`` of its tokens move. ``frac = 0`` gives the
    identity. Returns ``[batch, pos]`` int64."""
    n = windows.tokens.shape[1]
    rows = [
        adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=swap_seed(base_seed, d, s, seed))
        for d, s in zip(windows.doc_ids.tolist(), windows.starts.tolist())
    ]
    return torch.stack(rows)


def perturbed_inputs(
    windows: Windows, frac: float, seed: int, mode: str, *, target_len: int, base_seed: int = 0
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"] | None]:
    """``(tokens, position_ids)`` for T1 (tokens permuted, ids natural: ``None``) or T2 (tokens
    natural, ids permuted); swaps in ``[1, N − target_len)`` (token 0 and the target never move)."""
    if mode not in ("T1", "T2"):
        raise ValueError(f"mode must be 'T1' or 'T2', got {mode!r}")
    toks = windows.tokens
    n = toks.shape[1]
    if frac == 0:
        return toks, None
    perm = sequence_perms(windows, frac, seed, start=1, stop=n - target_len, base_seed=base_seed).to(toks.device)
    if mode == "T1":
        return torch.gather(toks, 1, perm), None
    return toks, torch.stack([position_ids_for_permutation(p) for p in perm]).to(toks.device)

def curve_rows(
    model: Any, windows: Windows, clean: Float[Tensor, "batch"], *, fracs: Sequence[float], seeds: Sequence[int],
    mode: str, target_len: int, base_seed: int = 0, fwd_hooks: Sequence = (),
) -> list[dict]:  # fmt: skip
    """The tolerance curve of one batch: one pass per (frac > 0, seed) of :func:`perturbed_inputs`
    (``frac = 0`` reuses ``clean``), with ``fwd_hooks`` attached. Returns one dict per (frac, seed,
    sequence): ``seq`` (position in ``windows``), ``frac, seed, clean_nll, nll, delta``."""
    bs = windows.tokens.shape[0]
    rows = []
    for frac in fracs:
        for seed in seeds:
            if frac == 0:
                nll = clean
            else:
                toks, pid = perturbed_inputs(windows, frac, seed, mode, target_len=target_len, base_seed=base_seed)
                nll = nll_on_target(model, toks, target_len=target_len, position_ids=pid, fwd_hooks=list(fwd_hooks),
                                    batch_size=bs)
            for i in range(bs):
                rows.append(dict(seq=i, frac=float(frac), seed=int(seed), clean_nll=float(clean[i]),
                                 nll=float(nll[i]), delta=float(nll[i] - clean[i])))
    return rows

@torch.no_grad()
def windows_fingerprint(w: Windows) -> str:
    """SHA-1 of the windows' token ids (a run's record of exactly which tokens it analysed)."""
    import hashlib  # noqa: PLC0415

    return hashlib.sha1(w.tokens.cpu().to(torch.int64).numpy().tobytes()).hexdigest()

# ----------------------------------------------------------------------------- T1 / T2


@dataclass
class T12Result:
    """Output of :func:`t1_t2_study`.

    Attributes:
        rows: per (twin, mode, sequence, frac, seed): ``twin, mode, seq, doc, doc_name, frac, seed,
            clean_nll, nll, delta``.
        units: per document (:func:`posgen_tl.stats.curves.document_units`, ``condition`` = the mode):
            ΔNLL per fraction, AUC (primary), slope (secondary).
        summary: per twin and mode, the document-level summary of those (95 % bootstrap, t-interval).
        contrasts: per twin, T1 − T2 per fraction (Holm over the fractions), AUC and slope, with
            sign-flip p over documents.
        equivalence: per twin, TOST of the T1 − T2 AUC within the margin declared in the config.
        config: sizes, fractions, seeds, margin (and where it was declared), equivariance note, commit.
    """

    rows: pd.DataFrame
    units: pd.DataFrame
    summary: pd.DataFrame
    contrasts: pd.DataFrame
    equivalence: pd.DataFrame
    config: dict = field(default_factory=dict)


@torch.no_grad()
def t1_t2_study(
    model: Any, corpus: CorpusLike = None, cfg: Config | None = None, *, twin: Any = True,
    windows: Windows | None = None, progress: bool = True, **options: Any,
) -> T12Result:  # fmt: skip
    """T1/T2 tolerance curves (docs/method.md §4) of the trained model and its random twin.

    ``cfg`` (:class:`Config`, with ``options`` applied) sets the sizes, fractions and seeds. Same
    windows and the same per-(sequence, seed) swaps for T1 and T2 and for the twin. Per document:
    ΔNLL per fraction, AUC (primary) and slope (:mod:`posgen_tl.stats.curves`); T1 − T2 contrasts
    with sign-flip p over documents; "alike" only through TOST of the T1 − T2 AUC within
    ``cfg.t12_margin`` (declared before the run, :func:`posgen_tl.stats.verdicts.equivalence`). Read
    with the equivariance note: T1 − T2 is the causal-order effect.

    Args:
        twin: ``True`` (build :func:`posgen_tl.io.models.random_twin` with ``cfg.seed``), a prebuilt
            twin, or ``False``/``None``. ``windows``: analysed windows (default: sampled by ``cfg``).

    Returns:
        :class:`T12Result`.
    """
    from posgen_tl import stats  # noqa: PLC0415
    from posgen_tl.io.models import random_twin  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    seq_len, seed, batch_size, fracs, seeds = cfg.seq_len, cfg.seed, cfg.batch_size, cfg.fracs, cfg.seeds
    target_len, twin_seeds = cfg.target(), cfg.twin_seeds
    t_start, commit = time.time(), git_commit(short=True)
    ana = windows if windows is not None else sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=seq_len,
                                                             seed=seed)[0]
    models = [("trained", model, tuple(seeds))]
    if twin is True:
        twin = random_twin(model, seed)
    if twin is not None and twin is not False:
        models.append(("random", twin, tuple(twin_seeds or seeds)))
    n = len(ana)
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
    info = ana.frame()
    frames, times = [], {}
    for name, m, sds in models:
        t0 = time.time()
        jobs = [(b, mode) for b in batches for mode in ("T1", "T2")]
        bar = tqdm(total=len(jobs), desc=f"T1/T2 {name}", disable=not progress)
        for b in batches:
            w = ana.subset(b)
            clean = nll_on_target(m, w.tokens, target_len=target_len, batch_size=len(b))
            for mode in ("T1", "T2"):
                df = pd.DataFrame(curve_rows(m, w, clean, fracs=fracs, seeds=sds, mode=mode, target_len=target_len,
                                             base_seed=seed))
                df["seq"] = [b[i] for i in df["seq"]]
                frames.append(df.assign(twin=name, mode=mode))
                bar.update(1)
        bar.close()
        times[f"{name}_s"] = time.time() - t0
    rows = pd.concat(frames, ignore_index=True).merge(info[["seq", "doc", "doc_name"]], on="seq", how="left")
    rows = rows[["twin", "mode", "seq", "doc", "doc_name", "frac", "seed", "clean_nll", "nll", "delta"]]
    units = stats.document_units(rows.rename(columns={"mode": "condition"}), by=("twin", "condition"))
    summary = stats.unit_summary(units, by=("twin", "condition"))
    contrasts = stats.tolerance_contrasts(units, keys=("twin",), pairs=[("T1", "T2")])
    eq = []
    for t_name, g in units[units["estimator"] == "auc"].groupby("twin", sort=False):
        w = g.pivot(index="doc", columns="condition", values="value")
        e = stats.equivalence((w["T1"] - w["T2"]).to_numpy(), doc=w.index.to_numpy(), margin=cfg.t12_margin,
                              margin_source="declared in the tolerance Config (t12_margin) before the run",
                              what="T1 − T2 AUC (nats × p)")
        eq.append(e.assign(twin=t_name, t1_auc=float(w["T1"].mean()), t2_auc=float(w["T2"].mean())))
    margin_rule = f"±{cfg.t12_margin:g} nats × p on the T1 − T2 AUC, declared in the config before the run"
    config = dict(n_seq=n, n_docs=ana.n_docs, seq_len=int(ana.tokens.shape[1]), target_len=target_len,
                  fracs=list(map(float, fracs)), seeds=list(map(int, seeds)),
                  twin_seeds=[list(s) for nm, _, s in models if nm == "random"], margin=cfg.t12_margin,
                  margin_rule=margin_rule,
                  note=stats.EQUIVARIANCE_NOTE, commit=commit, seed=seed, windows_sha1=windows_fingerprint(ana),
                  wall_s={**times, "total_s": time.time() - t_start})  # fmt: skip
    return T12Result(rows, units, summary, contrasts, pd.concat(eq, ignore_index=True), config)

# ----------------------------------------------------------------------------- T1 / T2 outputs


def t12_markdown(result: T12Result, title: str = "T1 / T2") -> str:
    """Markdown: AUC, slope and ΔNLL per p (trained and twin), the T1 − T2 contrasts, the TOST table
    and the equivariance note."""
    c = result.config
    s, k = result.summary, result.contrasts
    cols = ["twin", "condition", "estimator", "frac", "estimate", "ci_low", "ci_high", "ci_level", "n_docs", "n_seqs"]
    lines = [f"## {title}", "",
             f"{c['n_seq']} sequences from {c['n_docs']} documents × {c['seq_len']} tokens, target {c['target_len']}; "
             f"p ∈ {c['fracs']} = fraction of disjoint adjacent pairs swapped (≈ 2p of the context tokens move), "
             f"independent per (sequence, seed); seeds {c['seeds']} (twin {c['twin_seeds']}). Intervals: 95 % document "
             "bootstrap.", "",
             md_table(s, cols), "",
             md_table(k, ["twin", "contrast", "estimator", "frac", "estimate", "ci_low", "ci_high", "p", "p_kind", "p_holm"]),
             "", f"T1 − T2 AUC, TOST equivalence at {c['margin_rule']}:", "",
             md_table(result.equivalence, ["twin", "t1_auc", "t2_auc", "estimate", "ci_low", "ci_high", "ci_level", "p",
                                           "verdict", "n_docs"]), "",
             "> " + c["note"], "",
             "Wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in c["wall_s"].items()) + f"; commit {c['commit']}.", ""]  # fmt: skip
    return "\n".join(lines)


def write_t12_outputs(result: T12Result, out_dir: str | Path, tag: str = "t12") -> dict[str, Path]:
    """Write ``{tag}_rows.csv``, ``{tag}_summary.csv``, ``{tag}_contrasts.csv``, ``{tag}_tost.csv``,
    ``{tag}_config.json`` and ``{tag}.md``; returns the paths."""
    import json  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {n: out / f"{tag}_{n}.csv" for n in ("rows", "summary", "contrasts", "tost")}
    paths.update(config=out / f"{tag}_config.json", md=out / f"{tag}.md")
    result.rows.to_csv(paths["rows"], index=False)
    result.summary.to_csv(paths["summary"], index=False)
    result.contrasts.to_csv(paths["contrasts"], index=False)
    result.equivalence.to_csv(paths["tost"], index=False)
    paths["config"].write_text(json.dumps(result.config, indent=1, default=str))
    paths["md"].write_text(t12_markdown(result, f"T1 / T2 ({tag})"))
    return paths


# ----------------------------------------------------------------------------- report / study


NAME = "tolerance"
ABOUT = "T1/T2 position tolerance of the trained model beside its random twin, with TOST (docs/method.md §4)"
NEEDS: tuple[str, ...] = ()


def compute(ctx: Any, cfg: Config) -> None:
    """T1/T2 curves (trained + twin, TOST); writes the rows, the summary, the TOST table and a figure,
    and hands the result to a causal test of the same run (``ctx.shared["t12"]``)."""
    from posgen_tl.plot.tolerance import plot_tolerance_curves  # noqa: PLC0415

    windows = base.or_skip(ctx, "tolerance_meta.json", "tolerance study", sample_windows, ctx.model, cfg.corpus,
                           n_seq=cfg.n_seq, seq_len=cfg.seq_len, seed=cfg.seed)
    if windows is None:
        return
    ana, _ = windows
    t12 = t1_t2_study(ctx.model, cfg.corpus, cfg, twin=ctx.twin() if cfg.twin else None, windows=ana)
    ctx.shared["t12"] = t12
    ctx.work.save_df("tolerance_curves.csv", t12.rows)
    ctx.work.save_df("tolerance_summary.csv", t12.summary)
    ctx.work.save_df("t1_t2_contrasts.csv", t12.contrasts)
    ctx.work.save_df("t1_t2_tost.csv", t12.equivalence)
    ctx.work.save_fig("fig_tolerance.png", plot_tolerance_curves(t12.summary, hue="twin", title=ctx.model_name))
    ctx.work.save_json("tolerance_meta.json", {"n_seq": len(ana), "n_docs": ana.n_docs, "target_len": cfg.target(),
                                               "fracs": cfg.fracs, "seeds": cfg.seeds, **{k: t12.config[k] for k in (
                                                   "margin_rule", "note")}})


def render(ctx: Any, cfg: Config) -> Any:
    """The report section: T1/T2 ΔNLL per fraction, AUC and slope beside the twin, T1 − T2 contrasts,
    the TOST of T1 − T2 at the declared margin, the figure."""
    from posgen_tl.report.html import Section, skipped_section  # noqa: PLC0415

    meta = ctx.work.load_json("tolerance_meta.json")
    title = "4 · Position tolerance: T1 / T2 (docs/method.md §4)"
    if "skipped" in meta:
        return skipped_section(title, meta["skipped"], "tolerance", meta.get("hint"))
    summ = ctx.work.load_df("tolerance_summary.csv")
    con = ctx.work.load_df("t1_t2_contrasts.csv")
    tost = ctx.work.load_df("t1_t2_tost.csv")
    tr = tost[tost["twin"] == "trained"].iloc[0]
    expl = meta["n_docs"] < 32
    cols = ["twin", "condition", "estimator", "frac", "units", "estimate", "ci_low", "ci_high", "ci_level", "t_low",
            "t_high", "n_docs", "n_seqs"]
    ccols = ["twin", "contrast", "estimator", "frac", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind", "p_holm",
             "holm_scope", "n_docs"]
    return Section(
        title + (" — EXPLORATORY (fewer than 32 documents)" if expl else ""),
        verdict=(f"Trained model: T1 AUC {tr['t1_auc']:.3g} vs T2 AUC {tr['t2_auc']:.3g} nats × p; T1 − T2 "
                 f"{tr['verdict']} (TOST p = {tr['p']:.3g}, 90 % interval [{tr['ci_low']:.3g}, {tr['ci_high']:.3g}])."),
        paragraphs=[f"{meta['n_seq']} sequences from {meta['n_docs']} documents (one window per document first), target "
                    f"span {meta['target_len']} tokens, p ∈ {list(meta['fracs'])} = fraction of disjoint adjacent pairs "
                    f"swapped (≈ 2p of the context tokens move), independent per (sequence, seed), seeds "
                    f"{list(meta['seeds'])}. The AUC (area under ΔNLL over p from p = 0) is the primary summary; the "
                    "slope is secondary.", f"TOST margin: {meta['margin_rule']}.", meta["note"]],
        tables=[("T1 / T2 per fraction, AUC and slope (document means; 95 % document bootstrap and t-interval), trained "
                 "vs random twin", summ[[c for c in cols if c in summ]]),
                ("T1 − T2 on the same documents (sign-flip p; Holm over the fractions)", con[[c for c in ccols if c in con]]),
                ("T1 − T2 AUC: TOST equivalence at the declared margin", tost)],
        figures=[(ctx.work.path("fig_tolerance.png").read_bytes(), "ΔNLL vs swap fraction: T1 and T2, trained vs random "
                  "twin (document means, 95 % bootstrap)")],
        findings=_findings(ctx.work.load_df("tolerance_curves.csv")),
        results={"exploratory": expl, "t1_t2": tost.to_dict("records")},
    )


def _findings(curves: pd.DataFrame) -> list:
    """T1 tolerance of the trained model: its AUC (nats × p) per document, sign-flip p over documents."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.stats import curves as sc  # noqa: PLC0415
    from posgen_tl.stats.inference import paired_finding  # noqa: PLC0415

    t1 = curves[(curves["mode"] == "T1") & (curves["twin"] == "trained")].rename(columns={"mode": "condition"})
    u = sc.document_units(t1, by=("condition",))
    a = u[u["estimator"] == "auc"]
    mean, ci, p = paired_finding(a["value"].to_numpy(float), a["doc"].to_numpy())
    word = ("NLL rises with swaps" if mean > 0 else "NLL falls with swaps") if p < 0.05 else "no evidence"
    return [Finding("tolerance", word, mean, "T1 AUC of ΔNLL over p (nats × p)", ci, p, int(a["doc"].nunique()))]
