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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import torch
from tqdm.auto import tqdm

from posgen_tl.engine.swaps import (  # the engine's names stay importable from here
    DEFAULT_FRACS,
    SwapOptions,
    curve_rows,
    length_curve,
    length_summary,
    nll_on_target,
    perturbed_inputs,
    sequence_perms,
    transposition_curve,
    windows_fingerprint,
)
from posgen_tl.experiments import base
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, sample_windows

__all__ = [
    "Config",
    "DEFAULT_FRACS",
    "SwapOptions",
    "Result",
    "run",
    "render",
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


@dataclass(frozen=True)
class Config(SwapOptions):
    """Options of the T1/T2 tolerance study (docs/method.md §4)."""

    NAME: ClassVar[str] = "tolerance"
    twin_seeds: tuple[int, ...] = base.option((0,), "swap seeds for the random twin's T1/T2 curves", "ints")
    batch_size: int = base.batch_option(8, auto=True)
    t12_margin: float = base.option(0.01, "TOST margin of the T1 − T2 AUC (nats × p) for 'alike', declared before the "
                                          "run (about a quarter of SmolLM2's T1 AUC over p ≤ 0.2 in the first landing)",
                                    "float")




# ----------------------------------------------------------------------------- T1 / T2


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``curves`` (per twin × mode × sequence × fraction × seed: ``twin, mode, seq, doc, doc_name, frac,
            seed, clean_nll, nll, delta``); ``units`` (per document, :func:`posgen_tl.stats.curves.document_units`,
            ``condition`` = the mode: ΔNLL per fraction, AUC (primary), slope (secondary)); ``summary`` (per twin
            and mode, the document-level summary of those: 95 % bootstrap, t-interval); ``contrasts`` (per twin,
            T1 − T2 per fraction with Holm over the fractions, AUC and slope, sign-flip p over documents);
            ``tost`` (per twin, TOST of the T1 − T2 AUC within the declared margin).
        config: the Config's options. meta: model, sizes, fractions, seeds, the margin and where it was declared,
            the equivariance note, commit, wall times.

    Each table is an attribute too (``result.summary``); ``result.rows`` is ``curves`` and ``result.equivalence``
    is ``tost``.
    """

    ALIASES: ClassVar[dict[str, str]] = {"rows": "curves", "equivalence": "tost"}






#: the tables' files in a study folder (the names published runs already carry)
FILES = {"curves": "tolerance_curves.csv", "units": "tolerance_units.csv", "summary": "tolerance_summary.csv",
         "contrasts": "t1_t2_contrasts.csv", "tost": "t1_t2_tost.csv"}
LEGACY_META = "tolerance_meta.json"


@base.shares_heap
@torch.no_grad()
def run(
    model: Any, cfg: Config | None = None, *, corpus: CorpusLike = None, twin: Any = None,
    windows: Windows | None = None, checkpoint: str | Path | None = None, progress: bool = True, **options: Any,
) -> Result:  # fmt: skip
    """T1/T2 tolerance curves (docs/method.md §4) of the trained model and its random twin.

    ``cfg`` (:class:`Config`, with ``options`` applied) sets the sizes, fractions and seeds. Same
    windows and the same per-(sequence, seed) swaps for T1 and T2 and for the twin. Per document:
    ΔNLL per fraction, AUC (primary) and slope (:mod:`posgen_tl.stats.curves`); T1 − T2 contrasts
    with sign-flip p over documents; "alike" only through TOST of the T1 − T2 AUC within
    ``cfg.t12_margin`` (declared before the run, :func:`posgen_tl.stats.verdicts.equivalence`). Read
    with the equivariance note: T1 − T2 is the causal-order effect.

    Args:
        twin: the random-init twin (a model, or a callable that gives one); ``None``/``True`` builds
            :func:`posgen_tl.io.models.random_twin` with ``cfg.seed``; none runs when ``twin`` is ``False`` or
            ``cfg.twin`` is false.
        windows: analysed windows (default: sampled by ``cfg`` from ``corpus``, default ``cfg.corpus``).
        checkpoint: a folder that keeps each finished batch (per model); a rerun of the same design continues
            where an interrupted one stopped (another design's folder is refused: ValueError).

    Returns:
        :class:`Result` (tables ``curves``, ``units``, ``summary``, ``contrasts``, ``tost``).
    """
    from posgen_tl import stats  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    seq_len, seed, fracs, seeds = cfg.seq_len, cfg.seed, cfg.fracs, cfg.seeds
    target_len, twin_seeds = cfg.target(), cfg.twin_seeds
    t_start, commit = time.time(), git_commit(short=True)
    ana = windows if windows is not None else sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=seq_len,
                                                             seed=seed)[0]
    models = [("trained", model, tuple(seeds))]
    if cfg.twin and twin is not False:
        models.append(("random", base.twin_of(model, twin, seed), tuple(twin_seeds or seeds)))
    n = len(ana)
    batch_size = base.auto_batch(cfg, model, int(ana.tokens.shape[1]), n)
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
    auto_size: dict[str, Any] = {"batch": batch_size} if cfg.batch_size == 0 else {}  # kept batches: their size
    info = ana.frame()
    frames, times = [], {}
    ck = base.pieces(checkpoint, NAME, cfg, model, ana, twin=[base.model_digest(m) for nm, m, _ in models
                                                               if nm == "random"] if checkpoint is not None else None,
                     **auto_size)

    def batch_rows(m: Any, b: list[int], sds: tuple[int, ...], name: str) -> pd.DataFrame:
        w = ana.subset(b)
        clean = nll_on_target(m, w.tokens, target_len=target_len, batch_size=len(b))
        out = []
        for mode in ("T1", "T2"):
            df = pd.DataFrame(curve_rows(m, w, clean, fracs=fracs, seeds=sds, mode=mode, target_len=target_len,
                                         base_seed=seed))
            df["seq"] = [b[i] for i in df["seq"]]
            out.append(df.assign(twin=name, mode=mode))
        return pd.concat(out, ignore_index=True)

    for name, m, sds in models:
        t0 = time.time()
        for i, b in enumerate(tqdm(batches, desc=f"T1/T2 {name}", disable=not progress)):
            frames.append(ck.rows(f"{name}_{i:06d}", lambda m=m, b=b, sds=sds, name=name: batch_rows(m, b, sds, name)))
        times[f"{name}_s"] = time.time() - t0
    rows = pd.concat(frames, ignore_index=True).merge(info[["seq", "doc", "doc_name"]], on="seq", how="left")
    rows = rows[["twin", "mode", "seq", "doc", "doc_name", "frac", "seed", "clean_nll", "nll", "delta"]]
    order = rows["twin"].map({nm: i for i, (nm, _, _) in enumerate(models)})  # an order that batches do not change
    rows = rows.assign(_m=order).sort_values(["_m", "mode", "frac", "seed", "seq"], kind="stable", ignore_index=True)
    rows = rows.drop(columns="_m")
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
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415

    meta = dict(model=probe_hooks(model)[0].model_name, n_seq=n, n_docs=ana.n_docs, seq_len=int(ana.tokens.shape[1]),
                target_len=target_len,
                  fracs=list(map(float, fracs)), seeds=list(map(int, seeds)),
                  twin_seeds=[list(s) for nm, _, s in models if nm == "random"], margin=cfg.t12_margin,
                  margin_rule=margin_rule,
                  note=stats.EQUIVARIANCE_NOTE, commit=commit, seed=seed, windows_sha1=windows_fingerprint(ana),
                  wall_s={**times, "total_s": time.time() - t_start})  # fmt: skip
    tables = dict(curves=rows, units=units, summary=summary, contrasts=contrasts, tost=pd.concat(eq, ignore_index=True))
    return Result(tables, cfg.as_dict(), meta)


def t1_t2_study(model: Any, corpus: CorpusLike = None, cfg: Config | None = None, **kw: Any) -> Result:
    """:func:`run` with the corpus as the second argument (the library's earlier name, kept as an alias)."""
    return run(model, cfg, corpus=corpus, **kw)

# ----------------------------------------------------------------------------- report / study


NAME = "tolerance"
ABOUT = "T1/T2 position tolerance of the trained model beside its random twin, with TOST (docs/method.md §4)"
NEEDS: tuple[str, ...] = ()


def render(result: Result) -> Any:
    """The report section: T1/T2 ΔNLL per fraction, AUC and slope beside the twin, T1 − T2 contrasts,
    the TOST of T1 − T2 at the declared margin, the figure."""
    from posgen_tl.plot.tolerance import plot_tolerance_curves  # noqa: PLC0415
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    meta, t = result.meta, result.tables
    title = "4 · Position tolerance: T1 / T2 (docs/method.md §4)"
    if result.skipped:
        return skipped_section(title, result.skipped, "tolerance", meta.get("hint"))
    summ, con, tost = t["summary"], t["contrasts"], t["tost"]
    tr = tost[tost["twin"] == "trained"].iloc[0]
    expl = meta["n_docs"] < 32
    cols = ["twin", "condition", "estimator", "frac", "units", "estimate", "ci_low", "ci_high", "ci_level", "t_low",
            "t_high", "n_docs", "n_seqs"]
    ccols = ["twin", "contrast", "estimator", "frac", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind", "p_holm",
             "holm_scope", "n_docs"]
    fig = plot_tolerance_curves(summ, hue="twin", title=meta.get("model", ""))
    return Section(
        title + (" — EXPLORATORY (fewer than 32 documents)" if expl else ""),
        verdict=(f"Trained model: T1 AUC {tr['t1_auc']:.3g} vs T2 AUC {tr['t2_auc']:.3g} nats × p; T1 − T2 "
                 f"{tr['verdict']} (TOST p = {tr['p']:.3g}, 90 % interval [{tr['ci_low']:.3g}, {tr['ci_high']:.3g}])."
                 + _margin_sentence(tost, float(meta.get("margin", result.config.get("t12_margin", 0.01))))),
        paragraphs=[f"{meta['n_seq']} sequences from {meta['n_docs']} documents (one window per document first), target "
                    f"span {meta['target_len']} tokens, p ∈ {list(meta['fracs'])} = fraction of disjoint adjacent pairs "
                    f"swapped (≈ 2p of the context tokens move), independent per (sequence, seed), seeds "
                    f"{list(meta['seeds'])}. The AUC (area under ΔNLL over p from p = 0) is the primary summary; the "
                    "slope is secondary.", f"TOST margin: {meta['margin_rule']}.", meta["note"]],
        tables=[("T1 / T2 per fraction, AUC and slope (document means; 95 % document bootstrap and t-interval), trained "
                 "vs random twin", summ[[c for c in cols if c in summ]]),
                ("T1 − T2 on the same documents (sign-flip p; Holm over the fractions)", con[[c for c in ccols if c in con]]),
                ("T1 − T2 AUC: TOST equivalence at the declared margin", tost)],
        figures=[(figure_to_png(fig), "ΔNLL vs swap fraction: T1 and T2, trained vs random twin (document means, 95 % "
                  "bootstrap)")],
        findings=_findings(t["curves"], t.get("contrasts")),
        results={"exploratory": expl, "t1_t2": tost.to_dict("records")},
    )


def _margin_sentence(tost: pd.DataFrame, margin: float) -> str:
    """The equivalence margin against the quantity it bounds: as a share of the trained model's T1 AUC, and — where
    the random twin's T1 AUC is far below it — that the twin's "equivalent" cannot say anything."""
    out = ""
    tr = tost[tost["twin"] == "trained"]
    if len(tr) and abs(float(tr.iloc[0]["t1_auc"])) > 0:
        out += (f" The margin ±{margin:g} nats × p is {margin / abs(float(tr.iloc[0]['t1_auc'])):.0%} of the trained "
                "model's T1 AUC.")
    rn = tost[tost["twin"] == "random"]
    if len(rn):
        a = abs(float(rn.iloc[0]["t1_auc"]))
        if a == 0 or margin > 5 * a:
            times = "∞" if a == 0 else f"{margin / a:.0f}"
            out += (f" The random twin's T1 AUC is {a:.2g}: the margin is {times}× that, so the twin's equivalence "
                    "verdict says nothing about it.")
    return out


def _findings(curves: pd.DataFrame, contrasts: pd.DataFrame | None = None) -> list:
    """T1 tolerance of the trained model: its AUC (nats × p) per document, sign-flip p over documents; and, where the
    contrasts table has it, the trained model's T1 − T2 AUC (the causal-order effect, docs/method.md §4) with its
    own sign-flip p."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.report.text import p_label  # noqa: PLC0415
    from posgen_tl.stats import curves as sc  # noqa: PLC0415
    from posgen_tl.stats.inference import paired_finding  # noqa: PLC0415

    t1 = curves[(curves["mode"] == "T1") & (curves["twin"] == "trained")].rename(columns={"mode": "condition"})
    u = sc.document_units(t1, by=("condition",))
    a = u[u["estimator"] == "auc"]
    mean, ci, p, kind = paired_finding(a["value"].to_numpy(float), a["doc"].to_numpy())
    word = ("NLL rises with swaps" if mean > 0 else "NLL falls with swaps") if p < 0.05 else "no evidence"
    out = [Finding("tolerance", word, mean, "T1 AUC of ΔNLL over p (nats × p)", ci, p, int(a["doc"].nunique()),
                   p_kind=kind)]
    if contrasts is not None and len(contrasts):
        c = contrasts[(contrasts["twin"] == "trained") & (contrasts["estimator"] == "auc")]
        if len(c):
            r = c.iloc[0]
            p12 = float(r["p"])
            word = (("T1 costs more than T2" if r["estimate"] > 0 else "T2 costs more than T1") if p12 < 0.05
                    else "no evidence of a difference")
            out.append(Finding("tolerance", word, float(r["estimate"]),
                               "T1 − T2 AUC: what the causal order adds (nats × p)",
                               (float(r["ci_low"]), float(r["ci_high"])), p12, int(r["n_docs"]), p_kind=p_label(r)))
    return out
