"""Summary tables of the head taxonomy (docs/method.md §6), from its tidy frames alone: label counts
(:func:`label_counts`, :func:`labels_by_layer_group`), the D3 positional share of positional vs symbolic heads
(:func:`share_by_class`, Mann–Whitney U) and the agreement of the two (:func:`taxonomy_agreement`,
:func:`agreement_table`, Spearman across heads). Heads are the unit: read every p as descriptive.

:mod:`posgen_tl.experiments.taxonomy` computes the frames and re-exports these functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import mannwhitneyu, spearmanr

from posgen_tl.maths.groups import layer_group
from posgen_tl.maths.taxonomy import LABELS

__all__ = ["label_counts", "share_by_class", "taxonomy_agreement", "labels_by_layer_group", "agreement_table",
           "taxonomy_link"]


def _heads(df: pd.DataFrame) -> pd.DataFrame:
    """The full-head rows (``band == −1``) of a taxonomy frame; a frame without a band column as is."""
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
    :func:`posgen_tl.maths.groups.layer_group`, default
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


def taxonomy_link(heads: pd.DataFrame, labels: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """Do the heads a taxonomy labels ``positional`` carry more patching effect than its ``symbolic`` heads? Per map
    ((corruption,) quantity, direction), per layer holding both kinds among the patched heads: mean effect of its positional heads
    − mean effect of its symbolic heads; the LAYER is the unit (heads of one layer share their input and are not
    independent): mean over layers, 95 % bootstrap over layers, exact sign-flip over layers.

    ``labels``: ``layer, head, label`` (a taxonomy study's ``heads.csv``; rows of its random twin are ignored).
    Returns one row per map: ``(corruption,) quantity, direction, n_layers, estimate, ci_low, ci_high, ci_level,
    p, p_kind`` (``n_layers < 3``: no test, NaN)."""
    from posgen_tl.stats.inference import bootstrap_ci, sign_flip  # noqa: PLC0415

    missing = {"layer", "head", "label"} - set(labels.columns)
    if missing:
        raise ValueError(f"the taxonomy table lacks the column(s) {sorted(missing)} (a taxonomy study's heads.csv has them)")
    lab = labels[labels["twin"] == "trained"] if "twin" in labels.columns else labels
    lab = lab[["layer", "head", "label"]]
    rows = []
    keys = [k for k in ("corruption", "quantity", "direction") if k in heads.columns]
    for key, g in heads.groupby(keys, sort=False):
        m = g.merge(lab, on=["layer", "head"])
        per = m[m["label"].isin(["positional", "symbolic"])].groupby(["layer", "label"])["effect"].mean().unstack()
        per = per.dropna() if {"positional", "symbolic"} <= set(per.columns) else per.iloc[0:0]
        diff = (per["positional"] - per["symbolic"]).to_numpy() if len(per) else np.array([])
        row: dict[str, Any] = dict(zip(keys, key))
        row.update(n_layers=len(diff), estimate=np.nan, ci_low=np.nan, ci_high=np.nan, ci_level=0.95, p=np.nan,
                   p_kind="too few layers with both kinds")
        if len(diff) >= 3:
            est, lo, hi = bootstrap_ci(diff, seed=seed)
            p, kind = sign_flip(diff, unit="layers")
            row.update(estimate=est, ci_low=lo, ci_high=hi, p=p, p_kind=kind)
        rows.append(row)
    return pd.DataFrame(rows)
