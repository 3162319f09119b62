"""The report's stages: each computes into the work folder, and renders a Section from it.

Every stage shows the trained model beside its random-init twin or beside controls.
Sizes come from the :class:`~posgen_tl.report.run.ReportConfig` (``--quick`` shrinks them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .context import layers_for as _layers
from .html import Section

__all__ = ["STAGES"]


def _png(ctx, name: str) -> bytes:
    return ctx.work.path(name).read_bytes()


def _fmt(x: float, d: int = 3) -> str:
    return "nan" if x is None or x != x else f"{x:.{d}f}"


# ----------------------------------------------------------------------------- exactness


def exactness_compute(ctx) -> None:
    from ..exactness import exactness_table  # noqa: PLC0415

    tokens = ctx.tokens(n_seq=2, seq_len=min(64, ctx.cfg.seq_len))
    ctx.work.save_df("exactness.csv", exactness_table(ctx.model, tokens, progress=True))


def exactness_render(ctx) -> tuple[Section, dict]:
    df = ctx.work.load_df("exactness.csv")
    ok = bool(df["passed"].all())
    res = {"passed": ok, "max_rot_err": float(np.nanmax(df[["rot_q_max_err", "rot_k_max_err"]].to_numpy()))
           if df["rot_q_max_err"].notna().any() else None,
           "max_score_rel_err": float(df["score_rel_err"].max())}
    table = ("Per layer", df[["layer", "kind", "rot_source", "rot_q_max_err", "rot_k_max_err", "scores_kind",
                              "score_max_err", "score_rel_err", "passed"]])
    failed = df.loc[~df["passed"].astype(bool), "layer"].tolist()
    sec = Section(
        "1 · Exactness of captured q/k",
        verdict=(f"PASS on all {len(df)} layers: our RoPE on the pre-rotation q/k reproduces hook_rot_q/k, and s·rot_q·rot_k "
                 f"reproduces hook_attn_scores (max relative score error {res['max_score_rel_err']:.3g})." if ok else
                 f"FAIL on layers {failed}: the captured q/k do not reproduce the model's scores; every later number is suspect."),
        paragraphs=[] if ok else ["Every later number is computed from these captured tensors; a failure here makes them meaningless."],
        tables=[] if ok else [table],
        details=[table] if ok else [],
    )
    return sec, res


# ----------------------------------------------------------------------------- decomposition


def _n_ref(ctx) -> int:
    return 2 if ctx.cfg.quick else 4


def decomposition_compute(ctx) -> None:
    from ..analysis.decomposition import decompose_with_twin, summarize_decomposition  # noqa: PLC0415
    from ..analysis.head import decompose_head  # noqa: PLC0415
    from ..plot.decomposition import plot_head_maps, plot_r_by_layer  # noqa: PLC0415

    n_ref = _n_ref(ctx)
    toks = ctx.tokens(n_seq=ctx.cfg.n_seq + n_ref)
    df = decompose_with_twin(ctx.model, toks, seed=ctx.cfg.seed, twin=ctx.twin(), layers=_layers(ctx), n_seq=ctx.cfg.n_seq,
                             seq_len=ctx.cfg.seq_len, n_ref=n_ref, batch_size=4)
    ctx.work.save_df("decomposition.csv", df)
    ctx.work.save_df("decomposition_summary.csv", summarize_decomposition(df))
    ctx.work.save_fig("fig_decomposition_r.png", plot_r_by_layer(df))
    layer = int(sorted(df["layer"].unique())[len(df["layer"].unique()) // 2])
    head = decompose_head(ctx.model, toks[:1, : min(128, toks.shape[1])], layer, 0, k_mean="global",
                          reference=toks[ctx.cfg.n_seq :])
    ctx.work.save_fig("fig_decomposition_maps.png", plot_head_maps(head))


def decomposition_render(ctx) -> tuple[Section, dict]:
    summ = ctx.work.load_df("decomposition_summary.csv")
    df = ctx.work.load_df("decomposition.csv")
    sub = df[df["sink_excluded"].astype(bool)] if df["sink_excluded"].astype(bool).any() else df
    means = sub.groupby(["estimator", "twin"])[["r", "r_within"]].mean().unstack("twin")
    res: dict[str, Any] = {}
    lines = []
    for est in ("D1", "D2", "D3"):
        if est not in means.index:
            continue
        t_r, t_w = means.loc[est, ("r", "trained")], means.loc[est, ("r_within", "trained")]
        r_r = means.loc[est, ("r", "random")] if ("r", "random") in means.columns else float("nan")
        r_w = means.loc[est, ("r_within", "random")] if ("r_within", "random") in means.columns else float("nan")
        res[est] = {"r_trained": t_r, "r_random": r_r, "r_within_trained": t_w, "r_within_random": r_w}
        lines.append(f"{est}: r {_fmt(t_r)} trained vs {_fmt(r_r)} random; within-row r {_fmt(t_w)} vs {_fmt(r_w)}")
    gap = {e: v["r_within_trained"] - v["r_within_random"] for e, v in res.items()}
    best = max(gap, key=lambda e: gap[e]) if gap else None
    held = df.loc[df["estimator"] == "D3", "d3_bound_holds"].min() if "d3_bound_holds" in df else float("nan")
    res["bound_holds_min"] = held
    sec = Section(
        "2 · Attention logits = positional + semantic? (METHOD §2)",
        verdict=(f"Estimator that separates trained from random most (within-row r gap): {best} "
                 f"(+{gap[best]:.3f}). " if best else "") + "A high r alone is not evidence: the random twin is shown beside.",
        paragraphs=lines + [f"D3 bound |W−f−g| ≤ s·Σ‖q‖‖k−k̄‖·2|sin(Δθ/2)| held on a fraction {_fmt(held, 4)} of the sampled entries (must be 1).",
                            "Paper (Llama, mid layers): r = 0.959 for its additive approximation; compare the trained r above, "
                            "and note how much of it the random twin already reaches."],
        tables=[("Mean ± std over heads × sequences, first key (sink) excluded — trained beside its random twin",
                 _compact_decomposition(summ))],
        figures=[(_png(ctx, "fig_decomposition_r.png"), "Per-layer mean r and within-row r, trained (solid) vs random twin (dashed)"),
                 (_png(ctx, "fig_decomposition_maps.png"), "One head: logits W, positional f, semantic g, remainder W−f−g (global k̄ from the disjoint reference sequences)")],
    )
    return sec, res


def _compact_decomposition(summ: pd.DataFrame) -> pd.DataFrame:
    """Layer group × estimator rows; r and within-row r as 'mean ± std', trained | random columns."""
    d = summ
    if "sink_excluded" in d and d["sink_excluded"].astype(bool).any():
        d = d[d["sink_excluded"].astype(bool)]
    rows = []
    order = {"early": 0, "middle": 1, "late": 2, "all": 3}
    for (grp, est), g in sorted(d.groupby(["layer_group", "estimator"]), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        row = {"layers": grp, "estimator": est}
        for twin in ("trained", "random"):
            t = g[g["twin"] == twin]
            for m in ("r", "r_within", "r2"):
                row[f"{m} {twin}"] = (f"{t[f'{m}_mean'].iloc[0]:.3f} ± {t[f'{m}_std'].iloc[0]:.3f}" if len(t) else "–")
        rows.append(row)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- feature pattern


def pattern_compute(ctx) -> None:
    from ..analysis.pattern import feature_pattern_with_twin, link_to_decomposition  # noqa: PLC0415
    from ..plot.pattern import plot_band_heatmaps, plot_pattern_vs_d3  # noqa: PLC0415

    n = ctx.cfg.n_seq * (1 if ctx.cfg.quick else 2)
    tw = feature_pattern_with_twin(ctx.model, ctx.tokens(n_seq=n), seed=ctx.cfg.seed, twin=ctx.twin(), layers=_layers(ctx),
                                   n_seq=n, seq_len=ctx.cfg.seq_len, batch_size=4)
    bands = tw.bands
    mean_bands = bands.groupby(["model", "twin", "layer", "which", "band"], as_index=False)[
        ["energy_share", "offset_ratio", "phase_concentration"]].mean()
    ctx.work.save_df("pattern_heads.csv", tw.heads)
    ctx.work.save_df("pattern_bands_mean.csv", mean_bands)
    ctx.work.save_fig("fig_pattern_k_offset.png", plot_band_heatmaps(bands, which="k", stat="offset_ratio"))
    ctx.work.save_fig("fig_pattern_k_energy.png", plot_band_heatmaps(bands, which="k", stat="energy_share"))
    dec = ctx.work.load_df("decomposition.csv")
    merged, summary = link_to_decomposition(tw.heads, dec, on=("twin", "layer", "head"))
    ctx.work.save_df("pattern_vs_d3.csv", merged)
    ctx.work.save_json("pattern_vs_d3.json", summary)
    ctx.work.save_fig("fig_pattern_vs_d3.png", plot_pattern_vs_d3(merged))


def pattern_render(ctx) -> tuple[Section, dict]:
    heads = ctx.work.load_df("pattern_heads.csv")
    summary = ctx.work.load_json("pattern_vs_d3.json")
    tab = heads.groupby("twin")[["pattern_score", "fast_key_offset", "key_energy_centroid"]].agg(["mean", "std"])
    tab.columns = [f"{a} {b}" for a, b in tab.columns]
    tab = tab.reset_index()
    corr = pd.DataFrame([{"twin": t, **v} for t, v in summary.items()])
    tr = summary.get("trained", {})
    sec = Section(
        "3 · The feature pattern in the RoPE planes (METHOD §3)",
        verdict=(f"Across trained heads, pattern score vs D3 within-row r: Spearman "
                 f"{_fmt(tr.get('spearman_pattern_r_within', float('nan')))} (n={tr.get('n_heads')}); "
                 f"random twin: {_fmt(summary.get('random', {}).get('spearman_pattern_r_within', float('nan')))}."),
        paragraphs=["offset ratio ρ = ‖E k^(m)‖²/E‖k^(m)‖² per band (1 = the band carries the same vector for every token); "
                    "pattern score = 1 − Σ_m q_rms·k_res_rms·w_m / Σ_m q_rms·k_rms·w_m, with w_m the mean of 2|sin(Δθ_m/2)| over distances."],
        tables=[("Per-head pattern statistics, trained vs random twin", tab),
                ("Pattern ↔ decomposition across heads", corr)],
        figures=[(_png(ctx, "fig_pattern_k_offset.png"), "Key offset ratio ρ, band × layer (mean over kv heads), trained vs twin, same colour scale"),
                 (_png(ctx, "fig_pattern_k_energy.png"), "Key band energy share (RoPE frequency usage), trained vs twin"),
                 (_png(ctx, "fig_pattern_vs_d3.png"), "Pattern score vs D3 within-row r per head")],
    )
    return sec, {"heads": tab.to_dict("records"), "link": summary}


# ----------------------------------------------------------------------------- tolerance


def _intervention_set(spec, quick: bool):
    from ..interventions import Intervention  # noqa: PLC0415

    nb = spec.layer(0).n_bands
    q = max(1, nb // 4)
    fast, slow = list(range(q)), list(range(nb - q, nb))
    n = spec.n_layers
    layers = list(range(n // 3, (2 * n) // 3)) if not quick else list(range(n // 3, n // 3 + 2))
    destroy_fast = Intervention("destroy", bands=fast, layers=layers, label=f"destroy fast-band key offset 0–{q - 1}")
    enforce_fast = Intervention("enforce", bands=fast, layers=layers, label=f"enforce fast bands 0–{q - 1}")
    destroy_slow = Intervention("destroy", bands=slow, layers=layers, label=f"destroy slow bands {nb - q}–{nb - 1} (control)")
    control = Intervention("random_bands", bands=fast, layers=layers, base="destroy", seed=1,
                           label="random-band control of 'destroy fast' (damage-matched)")
    return layers, destroy_fast, enforce_fast, destroy_slow, control


def tolerance_compute(ctx) -> None:
    from ..interventions import key_means  # noqa: PLC0415
    from ..analysis import tolerance as tol  # noqa: PLC0415
    from ..capture import probe_hooks  # noqa: PLC0415
    from ..plot.tolerance import plot_tolerance_curves  # noqa: PLC0415

    cfg = ctx.cfg
    toks = ctx.tokens()
    target = min(64, cfg.seq_len // 4)
    fracs = (0.0, 0.1, 0.2) if cfg.quick else (0.0, 0.05, 0.1, 0.2)
    seeds = (0,) if cfg.quick else (0, 1)
    curves = [tol.transposition_curve(ctx.model, toks, fracs=fracs, seeds=seeds, target_len=target,
                                      modes=("T1", "T2")).assign(twin="trained")]
    if cfg.twin:
        curves.append(tol.transposition_curve(ctx.twin(), toks, fracs=fracs, seeds=seeds[:1], target_len=target,
                                              modes=("T1", "T2")).assign(twin="random"))
    curves = pd.concat(curves, ignore_index=True)
    ctx.work.save_df("tolerance_curves.csv", curves)
    summ = pd.concat([tol.curve_summary(g, by=("mode",)).assign(twin=t) for t, g in curves.groupby("twin")])
    ctx.work.save_df("tolerance_summary.csv", summ)
    ctx.work.save_df("tolerance_t1_vs_t2.csv", tol.t1_vs_t2(curves[curves["twin"] == "trained"]))
    ctx.work.save_fig("fig_tolerance.png", plot_tolerance_curves(summ, hue="twin", title=ctx.model_name))

    spec = probe_hooks(ctx.model)[0]
    layers, destroy_fast, enforce_fast, destroy_slow, control = _intervention_set(spec, cfg.quick)
    km = key_means(ctx.model, toks[:, : toks.shape[1] - target])
    base = tol.nll_on_target(ctx.model, toks, target_len=target)
    # METHOD §5: half strength keeps the model usable (full strength approaches the floor effect)
    destroy_fast = destroy_fast.with_alpha(0.5)
    dmg = tol.clean_damage(ctx.model, toks, destroy_fast, k_means=km, target_len=target, base=base)
    alpha, _ = tol.matched_alpha(ctx.model, toks, control, dmg, k_means=km, target_len=target, base=base,
                                 max_iter=2 if cfg.quick else 6)
    control = control.with_alpha(alpha)
    ivs = [destroy_fast, control] if cfg.quick else [destroy_fast, control, enforce_fast, destroy_slow]
    rows = tol.tolerance_rows(ctx.model, toks, ivs, k_means=km, fracs=fracs, seeds=seeds, target_len=target, base=base)
    ctx.work.save_df("causal_rows.csv", rows)
    summary = tol.summarize_tolerance(rows)
    ctx.work.save_df("causal_summary.csv", summary)
    table = tol.causal_table(rows, {destroy_fast.label: control.label})
    ctx.work.save_df("causal_table.csv", table)
    ctx.work.save_json("causal_meta.json", {"layers": layers, "target_len": target, "fracs": fracs, "seeds": seeds,
                                            "control_alpha": alpha, "n_seq": int(toks.shape[0]),
                                            "intervention_alpha": destroy_fast.alpha})


def tolerance_render(ctx) -> tuple[Section, dict]:
    summ = ctx.work.load_df("tolerance_summary.csv")
    t12 = ctx.work.load_df("tolerance_t1_vs_t2.csv")
    causal = ctx.work.load_df("causal_table.csv")
    csum = ctx.work.load_df("causal_summary.csv")
    meta = ctx.work.load_json("causal_meta.json")
    slope_alike = bool(t12.loc[t12["estimator"] == "slope", "alike"].iloc[0]) if len(t12) else False
    verdicts = "; ".join(f"{r.intervention} vs {r.control}: {r.verdict}" for r in causal.itertuples())
    cols = [c for c in ["intervention", "clean_nll", "damage", "damage_lo", "damage_hi", "slope", "slope_lo", "slope_hi",
                        "dnll@0.05", "dnll@0.1", "dnll@0.2", "dslope", "dslope_lo", "dslope_hi"] if c in csum.columns]
    sec = Section(
        "4 · Position tolerance and the causal test (METHOD §4–§5)",
        verdict=f"T1 (tokens swapped) vs T2 (position ids only): slopes {'alike (paired CI contains 0)' if slope_alike else 'differ'}. "
                f"Causal: {verdicts}. 'no evidence' means the intervention and its control did not differ beyond their CIs.",
        paragraphs=[f"Interventions on pre-rotation keys in layers {meta['layers']}, {meta['n_seq']} sequences, target span "
                    f"{meta['target_len']} tokens, swap fractions {meta['fracs']}, seeds {meta['seeds']}; the intervention runs at "
                    f"strength alpha={meta.get('intervention_alpha', 1.0):g}, the random-band control (same per-token change norm, "
                    f"random bands, random phases) at alpha={meta['control_alpha']:.3g} chosen to match its clean-NLL damage. "
                    "Slope = ΔNLL per unit swap fraction; dslope = change vs no intervention (paired). CIs: 95 % bootstrap over sequences.",
                    "Reading: 'depends' needs matched damage AND a slope difference whose CI excludes 0; with few sequences a null "
                    "('no evidence') is expected and is not evidence of no effect."],
        tables=[("ΔNLL on the target span and tolerance slope, trained vs random twin", summ),
                ("T1 − T2 (paired)", t12), ("Per intervention", csum[cols]),
                ("Verdicts", causal[[c for c in ["intervention", "control", "damage", "control_damage", "diff", "diff_lo",
                                                 "diff_hi", "n_seq", "damage_matched", "verdict", "direction"]
                                     if c in causal.columns]])],
        figures=[(_png(ctx, "fig_tolerance.png"), "ΔNLL vs swap fraction with 95 % CIs: T1 and T2, trained vs random twin")],
    )
    return sec, {"t1_vs_t2": t12.to_dict("records"), "causal": causal.to_dict("records")}


# ----------------------------------------------------------------------------- heads


def heads_compute(ctx) -> None:
    from ..analysis.taxonomy import head_table, head_taxonomy_with_twin, taxonomy_agreement  # noqa: PLC0415
    from ..plot.heads import plot_frequency_usage, plot_positional_symbolic_plane, plot_taxonomy_vs_share  # noqa: PLC0415

    n = 2 if ctx.cfg.quick else 4
    block = max(8, min(32, ctx.cfg.seq_len // 8))
    df = head_taxonomy_with_twin(ctx.model, ctx.tokens(n_seq=n), seed=ctx.cfg.seed, twin=ctx.twin(), layers=_layers(ctx),
                                 n_prompts=n, seq_len=ctx.cfg.seq_len, block_len=block)
    heads = head_table(df)
    ctx.work.save_df("heads.csv", heads)
    ctx.work.save_json("heads_agreement.json", taxonomy_agreement(heads))
    ctx.work.save_fig("fig_heads_plane.png", plot_positional_symbolic_plane(heads))
    ctx.work.save_fig("fig_heads_freq.png", plot_frequency_usage(df))  # band rows: head × band heat map
    ctx.work.save_fig("fig_heads_share.png", plot_taxonomy_vs_share(heads))


def heads_render(ctx) -> tuple[Section, dict]:
    heads = ctx.work.load_df("heads.csv")
    agree = ctx.work.load_json("heads_agreement.json")
    counts = heads.groupby(["twin", "label"]).size().unstack(fill_value=0).reset_index()
    sec = Section(
        "5 · Head taxonomy: positional vs symbolic heads (METHOD §6)",
        verdict="Rank correlation of (positional − symbolic) with D3's positional share: " + "; ".join(
            f"{t}: ρ={_fmt(v['rho'])} (n={v['n']})" for t, v in agree.items()),
        paragraphs=["Block swap of the context: a positional head's attention stays with the positions, a symbolic head's "
                    "follows the moved tokens (cosine scores over the moved region, query rows after it)."],
        tables=[("Head labels", counts)],
        figures=[(_png(ctx, "fig_heads_plane.png"), "Positional–symbolic plane, coloured by layer, trained vs twin"),
                 (_png(ctx, "fig_heads_freq.png"), "RoPE frequency usage: key energy share per (layer, head) × band (log scale), trained vs twin"),
                 (_png(ctx, "fig_heads_share.png"), "Taxonomy vs positional share of the logit variance")],
    )
    return sec, {"counts": counts.to_dict("records"), "agreement": agree}


STAGES = [
    ("exactness", exactness_compute, exactness_render),
    ("decomposition", decomposition_compute, decomposition_render),
    ("pattern", pattern_compute, pattern_render),
    ("tolerance", tolerance_compute, tolerance_render),
    ("heads", heads_compute, heads_render),
]
