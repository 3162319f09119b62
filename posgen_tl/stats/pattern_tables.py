"""Summary tables of the feature-pattern experiment (docs/method.md §3), from its tidy frames alone: the keys' ρ
forms by band group (:func:`rho_by_band_group`) and the link of the per-head pattern scores to D3
(:func:`link_to_decomposition`: Spearman across heads, each twin and k̄ kind apart, with its controls).

:mod:`posgen_tl.experiments.pattern` computes the frames and re-exports these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = ["SCORES", "link_to_decomposition", "rho_by_band_group"]

SCORES = {"pred_d3_err": "rotation-aware predicted relative D3 error (lower = D3 expected to fit)",
          "blind_d3_err": "control: the same with every band given the mean rotation weight (rotation-blind)",
          "residual_size": "control: numerator only, s·Σ‖q‖‖k−k̄‖w (logit units, no σ(W))",
          "inv_logit_spread": "control: 1/σ(W) alone",
          "legacy_pattern_score": "LEGACY first-landing score (invariant to rescaling rotation weights)"}


def _spearman(x: pd.Series, y: pd.Series) -> tuple[float, float, int]:
    """Spearman rho, scipy's two-sided p-value, and n over the finite pairs."""
    from scipy import stats  # noqa: PLC0415

    ok = np.isfinite(x.to_numpy(dtype=float)) & np.isfinite(y.to_numpy(dtype=float))
    n = int(ok.sum())
    xv, yv = x.to_numpy(dtype=float)[ok], y.to_numpy(dtype=float)[ok]
    if n < 3 or np.ptp(xv) == 0 or np.ptp(yv) == 0:
        return float("nan"), float("nan"), n
    res = stats.spearmanr(xv, yv)
    return float(res.statistic), float(res.pvalue), n


def link_to_decomposition(
    pattern_heads: pd.DataFrame,
    decomposition: pd.DataFrame,
    *,
    on: Sequence[str] = ("model", "twin", "layer", "head"),
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Join per-head pattern scores with D3 scores and rank-correlate them across heads,
    within each twin SEPARATELY (pooling trained and random heads manufactures a correlation
    from two clusters) and per k̄ kind.

    Args:
        pattern_heads: ``heads`` frame of :func:`~posgen_tl.experiments.pattern.feature_pattern` (or a
            :class:`~posgen_tl.experiments.pattern.TwinPattern`).
        decomposition: per-sequence rows of :func:`posgen_tl.experiments.decomposition.decompose_model`;
            only ``estimator == "D3"`` rows with ``sink_excluded`` are used, averaged over ``seq``.
        on: join keys (drop ``"model"`` if the two frames label models differently).

    Returns:
        ``(merged, summary)``: ``merged`` = one row per (head, k_mean) with the pattern columns,
        ``pred_d3_err`` (the column of the matching k̄ kind) and the seq-mean ``r, r2,
        r_within, d3_err_mean, d3_bound_mean`` plus ``n_seq``; ``summary`` = one row per
        (twin, k_mean, score) with ``spearman`` (score vs D3 within-row r), ``p`` (scipy's
        two-sided p-value), ``n_heads`` and ``description``. A working score has a NEGATIVE
        Spearman for ``pred_d3_err`` (more predicted error, lower r). Controls beside it: the
        rotation-blind version, the numerator alone and ``1/σ(W)`` alone — the rotation-aware
        score is only informative where it beats them.
    """
    on = list(on)
    if not isinstance(pattern_heads, pd.DataFrame):
        pattern_heads = pattern_heads.heads
    d = decomposition[(decomposition["estimator"] == "D3") & decomposition["sink_excluded"].astype(bool)]
    if d.empty:
        raise ValueError("the decomposition frame has no D3 rows with sink_excluded=True")
    if "k_mean" not in d:
        d = d.assign(k_mean="global")
    vals = ["r", "r2", "r_within", "d3_err_mean", "d3_bound_mean"]
    agg = d.groupby(on + ["k_mean"], as_index=False).agg(**{v: (v, "mean") for v in vals}, n_seq=("seq", "nunique"))
    parts = []
    for kind, a in agg.groupby("k_mean"):
        h = pattern_heads.copy()
        col = f"pred_d3_err_{kind}"
        h["pred_d3_err"] = h[col] if col in h else np.nan
        h["blind_d3_err"] = h[f"blind_d3_err_{kind}"] if f"blind_d3_err_{kind}" in h else np.nan
        h["residual_size"] = h["pred_d3_err"] * h["logit_spread"] if "logit_spread" in h else np.nan
        h["inv_logit_spread"] = 1.0 / h["logit_spread"] if "logit_spread" in h else np.nan
        parts.append(h.merge(a, on=on, how="inner"))
    merged = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if merged.empty:
        raise ValueError(f"no rows in common on {on}: check the model/twin labels of the two frames")
    rows = []
    twins = sorted(set(merged["twin"]), key=lambda t: ({"trained": 0, "random": 1}.get(t, 2), str(t)))
    for twin in twins:
        for kind in sorted(set(merged["k_mean"])):
            g = merged[(merged["twin"] == twin) & (merged["k_mean"] == kind)]
            for score, desc in SCORES.items():
                if score not in g or g[score].isna().all():
                    continue
                rho, p, n = _spearman(g[score], g["r_within"])
                rows.append({"twin": twin, "k_mean": kind, "score": score, "spearman": rho, "p": p, "n_heads": n,
                             "description": desc})
    return merged, pd.DataFrame(rows)


def rho_by_band_group(bands: pd.DataFrame) -> pd.DataFrame:
    """Key ρ forms per (twin, band group): means over layers × kv heads × bands (stability: median)
    and each head's share of key energy in the group (mean over heads)."""
    k = bands[bands["which"] == "k"]
    by_group = k.groupby(["twin", "band_group"], as_index=False).agg(
        rho_within=("rho_within", "mean"), rho_cross=("rho_cross", "mean"), stability_median=("stability", "median"),
        rho_plugin_legacy=("offset_ratio", "mean"))
    share = (k.groupby(["twin", "layer", "head", "band_group"])["energy_share"].sum()
             .groupby(["twin", "band_group"]).mean().rename("key_energy_share_of_group").reset_index())
    return by_group.merge(share, on=["twin", "band_group"])
