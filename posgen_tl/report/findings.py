"""The headline of each stage, as a :class:`~posgen_tl.report.html.Finding` for the summary box.

Each function reads the tables a stage (or a study) wrote and returns ``list[Finding]``;
nothing here runs a model. p-values and intervals come from :mod:`posgen_tl.stats.inference` (exact
sign-flip test, bootstrap over sequences — documents where a ``doc`` column exists), causal
verdicts from :func:`posgen_tl.stats.inference.verdict_table` (the only place "depends" is decided).

A new stage either sets ``Section.findings`` in its render function, or adds one line to
:data:`DERIVE` (``stage name → function(ctx) -> list[Finding]``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pandas as pd

from posgen_tl.report.html import Finding, Section, sig3

__all__ = ["stage_findings", "DERIVE", "decomposition_findings", "pattern_findings", "tolerance_findings",
           "causal_findings", "heads_findings", "length_findings", "sufficiency_findings", "rank_correlation"]

ALPHA = 0.05


def _clusters(df: pd.DataFrame, seqs: np.ndarray) -> np.ndarray | None:
    """Document id per sequence when the rows carry one, else None (each sequence its own unit)."""
    if "doc" not in df.columns:
        return None
    return df.groupby("seq")["doc"].first().loc[seqs].to_numpy()


def _paired(d: np.ndarray, clusters: np.ndarray | None) -> tuple[float, tuple[float, float], float]:
    from posgen_tl.stats.inference import bootstrap_ci, sign_flip_test  # noqa: PLC0415

    mean, lo, hi = bootstrap_ci(d, clusters=clusters)
    return mean, (lo, hi), sign_flip_test(d, clusters=clusters)


def rank_correlation(x: np.ndarray, y: np.ndarray) -> tuple[float, tuple[float, float], float, int]:
    """Spearman ρ across units with a Fisher-z 95 % interval (se = √(1.06/(n−3))) and its p-value."""
    from scipy.stats import spearmanr  # noqa: PLC0415

    ok = np.isfinite(x) & np.isfinite(y)
    n = int(ok.sum())
    if n < 4:
        return float("nan"), (float("nan"), float("nan")), float("nan"), n
    res = spearmanr(x[ok], y[ok])
    rho = float(res.statistic)
    z, se = math.atanh(max(min(rho, 0.999999), -0.999999)), math.sqrt(1.06 / (n - 3))
    return rho, (math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)), float(res.pvalue), n


def _word(p: float, yes: str) -> str:
    return yes if p == p and p < ALPHA else "no evidence"


def decomposition_findings(ctx: Any) -> list[Finding]:
    """D3 within-row r, trained − random twin, paired per sequence (mean over layers × heads;
    sink excluded; global k̄ rows where the frame has a ``k_mean`` column)."""
    df = ctx.work.load_df("decomposition.csv")
    d3 = df[(df["estimator"] == "D3") & df["sink_excluded"].astype(bool)]
    if "k_mean" in d3.columns and (d3["k_mean"] == "global").any():
        d3 = d3[d3["k_mean"] == "global"]
    per = d3.groupby(["twin", "seq"])["r_within"].mean().unstack("twin")
    if not {"trained", "random"} <= set(per.columns):
        return [Finding("decomposition", "not testable", note="no random twin in this run")]
    per = per.dropna()
    d = (per["trained"] - per["random"]).to_numpy(float)
    mean, ci, p = _paired(d, _clusters(d3, per.index.to_numpy()))
    return [Finding("decomposition", _word(p, "trained beyond twin" if mean > 0 else "twin beyond trained"),
                    mean, "D3 within-row r, trained − twin", ci, p, len(d))]


def pattern_findings(ctx: Any) -> list[Finding]:
    """Spearman ρ of the rotation-aware pattern score (predicted relative D3 error, global k̄) with D3
    within-row r across TRAINED heads (METHOD §3: within the trained model, never pooled with the twin)."""
    m = ctx.work.load_df("pattern_vs_d3.csv")
    t = m[m["twin"] == "trained"]
    if "k_mean" in t:
        t = t[t["k_mean"] == "global"]
    rho, ci, p, n = rank_correlation(t["pred_d3_err_global"].to_numpy(float), t["r_within"].to_numpy(float))
    return [Finding("pattern", _word(p, "related"), rho, "Spearman ρ(pred. D3 error, D3 r) over heads", ci, p, n,
                    exploratory=ctx.cfg.n_seq < 32, note="n = heads; sequences per head: " + str(ctx.cfg.n_seq))]


def tolerance_findings(ctx: Any) -> list[Finding]:
    """T1 tolerance slope of the trained model (ΔNLL per unit swap fraction), per sequence."""
    from posgen_tl.stats.inference import per_sequence_slopes  # noqa: PLC0415

    c = ctx.work.load_df("tolerance_curves.csv")
    t1 = c[(c["mode"] == "T1") & (c.get("twin", "trained") == "trained")]
    s = per_sequence_slopes(t1, "delta")
    mean, ci, p = _paired(s.to_numpy(float), _clusters(t1, s.index.to_numpy()))
    return [Finding("tolerance", _word(p, "NLL rises with swaps" if mean > 0 else "NLL falls with swaps"),
                    mean, "T1 slope dΔNLL/dp", ci, p, len(s))]


def causal_findings(ctx: Any) -> list[Finding]:
    """The PRIMARY contrast of the causal table (its first row unless one is marked primary),
    judged by :func:`posgen_tl.stats.inference.verdict_table` over the whole family of the table."""
    from posgen_tl.stats.inference import contrast_from_rows, verdict_table  # noqa: PLC0415

    table = ctx.work.load_df("causal_table.csv")
    if not {"p_holm", "verdict", "mean_diff"} <= set(table.columns):  # a table without §8 statistics
        rows = ctx.work.load_df("causal_rows.csv")
        doc = None if "doc" in rows.columns else {s: s for s in rows["seq"].unique()}
        try:
            contrasts = [contrast_from_rows(rows, r.intervention, r.control, primary=(i == 0), doc=doc,
                                            name=f"{r.intervention} vs {r.control}")
                         for i, r in enumerate(table.itertuples(index=False))]
            table = verdict_table(contrasts)
        except ValueError as e:
            n = int(rows["seq"].nunique())
            return [Finding("causal", "not testable", n=n, note=str(e))]
    prim = table[table["primary"].astype(bool)] if "primary" in table.columns else table
    r = (prim if len(prim) else table).iloc[0]
    from posgen_tl.experiments.causal import causal_reading  # noqa: PLC0415

    reading = causal_reading(table.assign(contrast=[f"{a} vs {b}" for a, b in zip(table["intervention"],
                                                                                     table["control"])]))
    note = f"{r['intervention']} vs {r['control']}; Holm p"
    if reading and str(r["verdict"]).startswith("depends"):
        note += f"; CAUTION: {r['intervention']} vs none is not significant — the control carries the difference"
    return [Finding("causal", str(r["verdict"]).replace(" (exploratory)", ""), float(r["mean_diff"]),
                    "slope(intervention) − slope(control)", (float(r["boot_lo"]), float(r["boot_hi"])),
                    float(r["p_holm"]), int(r["n_seq"]), note=note)]


def heads_findings(ctx: Any) -> list[Finding]:
    """D3 positional share of positional vs symbolic heads (trained model): the difference of the
    class medians and the Mann–Whitney p of :func:`posgen_tl.experiments.taxonomy.share_by_class`
    (``heads_link.csv``); heads are the unit (descriptive, they are not independent)."""
    link = ctx.work.load_df("heads_link.csv")
    t = link[link["twin"] == "trained"]
    if t.empty:
        return [Finding("heads", "not testable", note="no trained-model row in heads_link.csv")]
    r = t.iloc[0]
    n = int(r["n_a"]) + int(r["n_b"])
    eff = float(r["median_a"]) - float(r["median_b"])
    p = float(r["p"])
    return [Finding("heads", _word(p, "shares differ"), eff, f"median share {r['class_a']} − {r['class_b']}", None,
                    p, n, exploratory=ctx.cfg.n_seq < 32,
                    note=f"n = heads ({int(r['n_a'])} {r['class_a']}, {int(r['n_b'])} {r['class_b']}); Mann–Whitney")]


def _skipped_finding(ctx: Any, meta_file: str, question: str) -> list[Finding] | None:
    meta = ctx.work.load_json(meta_file)
    if "skipped" in meta:
        return [Finding(question, "not testable", note=str(meta["skipped"]))]
    return None


def _summary_row(summ: pd.DataFrame, what: str, **match: Any) -> pd.Series:
    g = summ
    for k, v in match.items():
        g = g[g[k] == v]
    if g.empty:
        raise ValueError(f"no {what} row with {match} in the summary table")
    return g.iloc[0]


def _p_of(r: pd.Series) -> float:
    p = r.get("p_holm", float("nan"))
    return float(p) if p == p else float(r.get("p", float("nan")))


def length_findings(ctx: Any) -> list[Finding]:
    """Gap probe (METHOD §7): vanilla suffix NLL at the LARGEST gap minus at G = 0 (paired per
    sequence, document-bootstrap CI, Holm-adjusted sign-flip p of the stage's table); the note
    gives the disentangled − vanilla change at that gap. Verdict: "degrades" (p < .05, NLL up),
    "improves" (p < .05, NLL down) or "no evidence"."""
    skip = _skipped_finding(ctx, "length_gap_meta.json", "length")
    if skip is not None:
        return skip
    if ctx.work.load_json("length_gap_meta.json").get("gap", True) is False:
        return [Finding("length", "not run", note="gap probe not run (study parameter gap=false)")]
    summ = ctx.work.load_df("length_gap_summary.csv")
    d = summ[(summ["estimator"] == "d_vs_gap0") & (summ["condition"] == "vanilla")]
    if d.empty:
        return [Finding("length", "not testable", note="no gap beyond 0 in this run")]
    r = d.sort_values("gap").iloc[-1]
    p = _p_of(r)
    note = f"G = {r['gap_frac']:g}·n_ctx vs G = 0"
    dis = summ[(summ["estimator"] == "d_vs_vanilla") & (summ["condition"] == "disentangled") & (summ["gap"] == r["gap"])]
    if len(dis):
        q = dis.iloc[0]
        note += (f"; disentangled − vanilla there {sig3(float(q['value']))} [{sig3(float(q['ci_low']))}, "
                 f"{sig3(float(q['ci_high']))}], p = {sig3(_p_of(q))}")
    word = ("degrades" if r["value"] > 0 else "improves") if p == p and p < ALPHA else "no evidence"
    return [Finding("length", word, float(r["value"]), "vanilla suffix ΔNLL (nats)",
                    (float(r["ci_low"]), float(r["ci_high"])), p, int(r["n_seq"]), note=note)]


def sufficiency_findings(ctx: Any) -> list[Finding]:
    """Substitution W ← f + g_Δ0 in ALL layers (METHOD §5, pre-declared group "all"): ΔNLL vs the
    unmodified model (document-bootstrap CI, Holm p of the stage's table); the note compares it with
    the D1 control of the same group. Verdict: "costs NLL" when p < .05 and ΔNLL > 0, else "no
    evidence of a cost" (never "sufficient": that would need an equivalence margin)."""
    skip = _skipped_finding(ctx, "sufficiency_meta.json", "sufficiency")
    if skip is not None:
        return skip
    summ = ctx.work.load_df("sufficiency_summary.csv")
    r = _summary_row(summ, "d3 ΔNLL", source="d3", group="all", estimator="dnll")
    p = _p_of(r)
    note = "layers: all; global k̄"
    ctrl = summ[(summ["source"] == "d1") & (summ["group"] == "all") & (summ["estimator"] == "dnll")]
    if len(ctrl):
        note += f"; D1 control ΔNLL {sig3(float(ctrl.iloc[0]['value']))}"
    word = "costs NLL" if p == p and p < ALPHA and r["value"] > 0 else "no evidence of a cost"
    return [Finding("sufficiency", word, float(r["value"]), "ΔNLL of f + g substitution (nats)",
                    (float(r["ci_low"]), float(r["ci_high"])), p, int(r["n_seq"]), note=note)]


def _each(ctx: Any, *parts: tuple[str, Callable[[Any], list[Finding]]]) -> list[Finding]:
    """Several headlines of one stage, each failing alone (e.g. a study run with ``t12=false``
    has a causal table but no tolerance curves): a missing table gives "not run" for that part."""
    out: list[Finding] = []
    for q, fn in parts:
        try:
            out += fn(ctx)
        except FileNotFoundError:
            out.append(Finding(q, "not run", note="this run skipped that part (study parameters)"))
    return out


#: stage name → headline function; a stage that sets ``Section.findings`` itself needs no entry
DERIVE: dict[str, Callable[[Any], list[Finding]]] = {
    "decomposition": decomposition_findings,
    "pattern": pattern_findings,
    "tolerance": lambda ctx: _each(ctx, ("tolerance", tolerance_findings), ("causal", causal_findings)),
    "heads": heads_findings,
    "length": length_findings,
    "sufficiency": sufficiency_findings,
}


def stage_findings(name: str, ctx: Any, section: Section) -> list[Finding]:
    """The findings of stage ``name``: those its Section carries, else :data:`DERIVE`'s. A stage
    whose tables lack what the headline needs gives a "not testable" line naming the problem."""
    if section.findings:
        return list(section.findings)
    fn = DERIVE.get(name)
    if fn is None:
        return []
    try:
        return fn(ctx)
    except (KeyError, ValueError, FileNotFoundError) as e:
        q = {"tolerance": "tolerance"}.get(name, name)
        from posgen_tl.report.html import QUESTIONS  # noqa: PLC0415

        return [Finding(q, "not testable", note=f"{type(e).__name__}: {e}")] if q in QUESTIONS else []
