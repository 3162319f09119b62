"""Contrasts and equivalence on tidy per-document tables (docs/method.md §8), as pure functions.

Input: a :func:`posgen_tl.stats.curves.document_units` table (one value per document, condition, estimator,
frac) whose ``by`` columns are the entry keys (default ``model, layers``) and ``condition``. Output: tidy
DataFrames whose columns follow one convention — ``estimate, ci_low, ci_high, ci_level, ci_method, p, p_kind,
p_holm, n_docs, n_seqs`` plus the identifying keys — with every statistic on DOCUMENT means.

- :func:`tolerance_contrasts`: per-fraction paired contrasts (Holm over the fractions of a contrast), AUC
  (primary) and slope (secondary) contrasts;
- :func:`interaction_contrast` (difference of differences on the same documents) and :func:`equivalence`
  (TOST with a margin that must be declared);
- :func:`family_adjust`: Holm or a declared gatekeeping order over a family of p-values.

The causal verdict (dose–response at common damage) is :mod:`posgen_tl.stats.dose`'s; the version-2 rule that
lived here (damage matching by TOST, else a regression adjustment coupled to the outcome) was withdrawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from posgen_tl.stats.curves import (
    EXPLORATORY_MIN_DOCS,
    UNITS,
    boot_label,
    doc_bootstrap,
    doc_t_interval,
)
from posgen_tl.stats.inference import check_alpha, holm, mde, sign_flip

__all__ = [
    "default_pairs",
    "equivalence",
    "family_adjust",
    "interaction_contrast",
    "layers_label",
    "tolerance_contrasts",
]

KEYS = ("model", "layers")


def layers_label(layers: Sequence[int]) -> str:
    """``[10, 11, …, 19]`` → ``"L10-19"`` (a contiguous range), else ``"L3,5,9"``."""
    ls = sorted(int(x) for x in layers)
    if not ls:
        raise ValueError("layers is empty")
    if ls == list(range(ls[0], ls[-1] + 1)):
        return f"L{ls[0]}-{ls[-1]}" if len(ls) > 1 else f"L{ls[0]}"
    return "L" + ",".join(map(str, ls))


def _exploratory(n_docs: int) -> str:
    return f"exploratory ({n_docs} documents < {EXPLORATORY_MIN_DOCS})" if n_docs < EXPLORATORY_MIN_DOCS else ""


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


# ----------------------------------------------------------------------------- the family


# ----------------------------------------------------------------------------- contrasts


def _stat(estimator: str, frac: float) -> str:
    return estimator if estimator != "dnll" else f"dnll@{frac:g}"


class _Wide(NamedTuple):
    """One entry's units as arrays: ``docs`` (sorted ids), ``vals[(estimator, frac)][condition]``
    (``float64 [n_docs]``, NaN where a condition lacks a document) and ``nseq[condition]``."""

    docs: np.ndarray
    vals: dict
    nseq: dict


def _wide(sub: pd.DataFrame) -> _Wide:
    fr = sub["frac"].to_numpy(np.float64)
    est = sub["estimator"].to_numpy().astype(str)
    s_codes, s_keys = pd.factorize(pd.Series(est) + "@" + pd.Series(np.where(np.isnan(fr), -1.0, fr)).astype(str))
    docs, d_i = np.unique(sub["doc"].to_numpy(), return_inverse=True)
    conds, c_i = np.unique(sub["condition"].to_numpy().astype(str), return_inverse=True)
    flat = (s_codes * docs.size + d_i) * conds.size + c_i
    if np.unique(flat).size != flat.size:
        raise ValueError("units have several values for one (estimator, frac, document, condition)")
    v = np.full(len(s_keys) * docs.size * conds.size, np.nan)
    v[flat] = sub["value"].to_numpy(np.float64)
    v = v.reshape(len(s_keys), docs.size, conds.size)
    n = np.zeros(docs.size * conds.size, dtype=np.int64)
    n[d_i * conds.size + c_i] = sub["n_seqs"].to_numpy()
    n = n.reshape(docs.size, conds.size)
    vals = {}
    for k, key in enumerate(s_keys):
        e, f = key.split("@")
        vals[(e, np.nan if float(f) == -1.0 else float(f))] = {c: v[k, :, j] for j, c in enumerate(conds)}
    return _Wide(docs, vals, {c: n[:, j] for j, c in enumerate(conds)})


def _paired(wide: _Wide, a: str, b: str, stat: tuple[str, float], where: str) -> tuple[np.ndarray, int]:
    """Per-document ``a − b`` of one statistic (documents must match) and the number of sequences."""
    w = wide.vals.get(stat)
    if w is None or a not in w or b not in w:
        raise ValueError(f"{where}: contrast {a} − {b} cannot be formed for {_stat(*stat)} (condition missing)")
    d = w[a] - w[b]
    if np.isnan(d).any():
        raise ValueError(f"{where}: {a} and {b} cover different documents for {_stat(*stat)}")
    na, nb = wide.nseq[a], wide.nseq[b]
    if (na != nb).any():
        raise ValueError(f"{where}: {a} and {b} cover different sequences of some documents")
    return d, int(na.sum())


def _contrast_block(x: np.ndarray, *, n_boot: int, ci_level: float, seed: int) -> list[dict]:
    """Statistics of each column of ``x`` (``[n_docs, k]`` per-document differences)."""
    lo, hi = doc_bootstrap(x, n_boot=n_boot, ci_level=ci_level, seed=seed)
    tlo, thi = doc_t_interval(x, ci_level=ci_level)
    out = []
    for j in range(x.shape[1]):
        p, kind = sign_flip(x[:, j], seed=seed)
        out.append(dict(estimate=float(x[:, j].mean()), ci_low=float(lo[j]), ci_high=float(hi[j]), ci_level=ci_level,
                        ci_method=boot_label(n_boot), t_low=float(tlo[j]), t_high=float(thi[j]), p=p, p_kind=kind,
                        sd=float(x[:, j].std(ddof=1))))  # fmt: skip
    return out


def default_pairs(conditions: Sequence[str], intervention: str = "destroy", baseline: str = "none") -> list[tuple[str, str]]:
    """``(destroy, none)``, ``(destroy, Ck)`` for every other condition, then ``(Ck, none)``."""
    ctrls = [c for c in conditions if c not in (intervention, baseline)]
    return [(intervention, baseline), *((intervention, c) for c in ctrls), *((c, baseline) for c in ctrls)]


def _pair_rows(kv: dict, wide: _Wide, pairs: Sequence[tuple[str, str]], stats: list, where: str, *,
               n_boot: int, ci_level: float, seed: int) -> list[dict]:  # fmt: skip
    """Contrast rows (without Holm / MDE) of each pair × statistic of one entry."""
    rows = []
    for a, b in pairs:
        cols = [_paired(wide, a, b, s, where) for s in stats]
        x = np.column_stack([c[0] for c in cols])
        for s, r in zip(stats, _contrast_block(x, n_boot=n_boot, ci_level=ci_level, seed=seed)):
            rows.append(dict(kv, contrast=f"{a} − {b}", a=a, b=b, estimator=s[0], frac=s[1], units=UNITS[s[0]], **r,
                             n_docs=x.shape[0], n_seqs=cols[0][1]))  # fmt: skip
    return rows


def _entry_groups(units: pd.DataFrame, keys: Sequence[str]):
    if not keys:
        yield {}, units
        return
    for kv, sub in units.groupby(list(keys), sort=False):
        yield dict(zip(keys, kv if isinstance(kv, tuple) else (kv,))), sub


def _holm_and_mde(
    df: pd.DataFrame, keys: Sequence[str], alpha: float, family_size: int, intervention: str, baseline: str
) -> pd.DataFrame:
    """Add ``p_holm, holm_scope, mde_alpha, mde`` to a contrast table (rules in :func:`tolerance_contrasts`)."""
    df["p_holm"], df["holm_scope"], df["mde_alpha"] = np.nan, "", float(alpha)
    grp = [*keys, "contrast"]
    dn = df["estimator"] == "dnll"
    for _, idx in df[dn].groupby(grp, sort=False).groups.items():
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p"].to_numpy())
        df.loc[idx, "holm_scope"] = f"Holm over the {len(idx)} fractions of this contrast"
        df.loc[idx, "mde_alpha"] = alpha / len(idx)
    self_move = (df["estimator"] == "auc") & (df["b"] == baseline) & (df["a"] != intervention)
    groups = df[self_move].groupby(list(keys), sort=False).groups.items() if keys else [(None, df[self_move].index)]
    for _, idx in (g for g in groups if len(g[1])):
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p"].to_numpy())
        df.loc[idx, "holm_scope"] = f"Holm over the {len(idx)} controls − {baseline} of this entry ('moves tolerance by itself')"
        df.loc[idx, "mde_alpha"] = alpha / len(idx)
    prim = (df["estimator"] == "auc") & ~self_move & (df["a"] == intervention)
    df.loc[prim, "holm_scope"] = "none here: primary, judged by the study's intersection–union rule (family order)"
    df.loc[prim, "mde_alpha"] = alpha / family_size
    other = (df["estimator"] == "auc") & ~self_move & ~prim
    df.loc[other, "holm_scope"] = "none: one AUC test per contrast (declare its family before adjusting)"
    df.loc[df["estimator"] == "slope", "holm_scope"] = "none: secondary statistic, not a verdict"
    df["mde"] = [mde(s, n, alpha=a) if n >= 2 else np.nan for s, n, a in zip(df["sd"], df["n_docs"], df["mde_alpha"])]
    return df


def tolerance_contrasts(
    units: pd.DataFrame, *, keys: Sequence[str] = KEYS, pairs: Sequence[tuple[str, str]] | None = None,
    estimators: Sequence[str] = ("auc", "dnll", "slope"), intervention: str = "destroy", baseline: str = "none",
    alpha: float = 0.05, family_size: int = 1, n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Paired tolerance contrasts per entry, on document means (docs/method.md §8 v2).

    For each entry (``keys``) and pair ``(a, b)`` (default :func:`default_pairs`: destroy − none,
    destroy − Ck, Ck − none) and each statistic — ``auc`` (primary, nats × p), ``dnll`` at every
    positive fraction (nats), ``slope`` (secondary, nats per unit p) — the per-document difference
    ``a − b`` and: ``estimate`` (mean over documents), ``ci_low/ci_high`` (percentile bootstrap over
    documents, ``n_boot`` draws, ``ci_level``), ``t_low/t_high`` (t-interval, same level), ``p``
    (two-sided sign-flip over documents, :func:`~posgen_tl.stats.inference.sign_flip`) with
    ``p_kind`` (exact / Monte Carlo), ``p_holm`` with ``holm_scope``: Holm over the fractions of
    one contrast (dnll rows); Holm over the entry's ``Ck − none`` AUC rows (the "control moves
    tolerance by itself" flag); NaN for ``destroy − *`` AUC rows (their adjustment is
    :mod:`posgen_tl.stats.dose`'s) and slope rows (not a verdict statistic); ``sd`` of the document
    differences and ``mde`` (80 % power, two-sided, at ``mde_alpha`` = the level the adjustment
    leaves: α/#fractions, α/#controls, α/``family_size``, α for slopes).

    Returns:
        ``pd.DataFrame`` with columns ``*keys, contrast, a, b, estimator, frac, units, estimate,
        ci_low, ci_high, ci_level, ci_method, t_low, t_high, p, p_kind, p_holm, holm_scope, sd,
        mde, mde_alpha, n_docs, n_seqs, label``.

    Raises:
        ValueError: a condition missing for a pair, conditions on different documents or
            sequences, an unknown estimator, bad ``alpha``.
    """
    check_alpha(alpha)
    bad = set(estimators) - {"auc", "dnll", "slope", "damage"}
    if bad:
        raise ValueError(f"unknown estimator(s) {sorted(bad)}")
    order = {"auc": 0, "dnll": 1, "slope": 2, "damage": 3}
    rows = []
    for kv, sub in _entry_groups(units, keys):
        where = " ".join(map(str, kv.values())) or "units"
        wide = _wide(sub)
        stats = sorted((s for s in wide.vals if s[0] in estimators), key=lambda s: (order[s[0]], np.nan_to_num(s[1])))
        if not stats:
            raise ValueError(f"{where}: none of the estimators {list(estimators)} in the units")
        conds = list(dict.fromkeys(sub["condition"]))
        rows += _pair_rows(kv, wide, pairs or default_pairs(conds, intervention, baseline), stats, where,
                           n_boot=n_boot, ci_level=ci_level, seed=seed)  # fmt: skip
    df = _holm_and_mde(pd.DataFrame(rows), list(keys), alpha, family_size, intervention, baseline)
    role = {"auc": "primary (AUC)", "dnll": "per fraction", "damage": "damage difference",
            "slope": "secondary (slope: negative weights at small p, can hide or invert an effect)"}
    df["label"] = [_join(role[e], _exploratory(n)) for e, n in zip(df["estimator"], df["n_docs"])]
    cols = [*keys, "contrast", "a", "b", "estimator", "frac", "units", "estimate", "ci_low", "ci_high", "ci_level",
            "ci_method", "t_low", "t_high", "p", "p_kind", "p_holm", "holm_scope", "sd", "mde", "mde_alpha", "n_docs",
            "n_seqs", "label"]  # fmt: skip
    return df[cols]


# ----------------------------------------------------------------------------- damage


# ----------------------------------------------------------------------------- the verdict


def family_adjust(p: Any, order: str | Sequence[str], keys: Sequence[str]) -> tuple[np.ndarray, str]:
    """Family-adjusted p-values of the entries' p ``p`` (same order as ``keys``).

    ``order="holm"``: Holm step-down. A sequence of keys: fixed-sequence gatekeeping — entry ``i``
    of the sequence gets ``max`` of the p's up to it (rejected only if every earlier one is).
    Returns ``(p_adj, method)``; ``method`` is the text for the ``p_adj_method`` column."""
    pv = np.asarray(p, dtype=np.float64)
    if order == "holm":
        return holm(pv), f"Holm over the {pv.size} entries of the declared family"
    pos = {k: i for i, k in enumerate(keys)}
    if sorted(order) != sorted(keys):
        raise ValueError(f"gatekeeping order {list(order)} must list every entry {list(keys)} exactly once")
    out = np.empty_like(pv)
    run = 0.0
    for k in order:
        run = max(run, pv[pos[k]])
        out[pos[k]] = run
    return out, "fixed-sequence gatekeeping in the declared order: " + " → ".join(order)


# ----------------------------------------------------------------------------- interaction, equivalence


def _select(units: pd.DataFrame, where: dict, keys: Sequence[str]) -> pd.DataFrame:
    bad = set(where) - set(keys)
    if bad or not where:
        raise ValueError(f"select an entry by its keys {list(keys)}, got {where}")
    mask = np.logical_and.reduce([units[k].astype(str) == str(v) for k, v in where.items()])
    if not mask.any():
        raise ValueError(f"no units for {where}")
    return units[mask]


def interaction_contrast(
    units: pd.DataFrame, first: dict, second: dict, *, a: str = "destroy", b: str = "none",
    estimators: Sequence[str] = ("auc", "dnll"), keys: Sequence[str] = KEYS, n_boot: int = 10_000,
    ci_level: float = 0.95, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Difference of differences between two entries on the SAME documents (paired interaction).

    Per document: ``(a − b)`` in ``first`` (e.g. ``{"model": "smollm2-135m", "layers": "L10-19"}``)
    minus ``(a − b)`` in ``second``; the documents (and their sequence counts) must be identical.
    "Middle vs late layers" is this test, never two separate tests read side by side.

    Returns:
        ``pd.DataFrame``: ``contrast, first, second, estimator, frac, units, estimate, ci_low,
        ci_high, ci_level, ci_method, t_low, t_high, p, p_kind, p_holm`` (Holm over the fractions
        for dnll rows; the AUC row's own p — it is one pre-declared test), ``holm_scope, n_docs,
        n_seqs, label``.

    Raises:
        ValueError: an entry without units, different documents in the two entries, a missing
            condition.
    """
    names = [" ".join(str(w[k]) for k in keys if k in w) for w in (first, second)]
    w1, w2 = (_wide(_select(units, w, keys)) for w in (first, second))
    stats = sorted((s for s in w1.vals if s[0] in estimators and s in w2.vals),
                   key=lambda s: (s[0] != "auc", np.nan_to_num(s[1])))  # fmt: skip
    if not stats:
        raise ValueError(f"none of the estimators {list(estimators)} in both entries")
    if not np.array_equal(w1.docs, w2.docs) or not np.array_equal(w1.nseq.get(a), w2.nseq.get(a)):
        raise ValueError(f"{names[0]} and {names[1]} are not on the same documents/sequences "
                         f"(differ: {sorted(set(w1.docs) ^ set(w2.docs))[:10]}): a paired interaction needs them")  # fmt: skip
    d1 = [_paired(w1, a, b, s, names[0]) for s in stats]
    x = np.column_stack([u[0] for u in d1]) - np.column_stack([_paired(w2, a, b, s, names[1])[0] for s in stats])
    rows = [dict(contrast=f"({a} − {b})[{names[0]}] − ({a} − {b})[{names[1]}]", first=names[0], second=names[1],
                 estimator=s[0], frac=s[1], units=UNITS[s[0]], **r, n_docs=x.shape[0], n_seqs=d1[0][1])
            for s, r in zip(stats, _contrast_block(x, n_boot=n_boot, ci_level=ci_level, seed=seed))]  # fmt: skip
    df = pd.DataFrame(rows).drop(columns="sd")
    dn = df["estimator"] == "dnll"
    df["p_holm"] = df["p"]
    df.loc[dn, "p_holm"] = holm(df.loc[dn, "p"].to_numpy()) if dn.any() else np.nan
    df["holm_scope"] = np.where(dn, f"Holm over the {int(dn.sum())} fractions", "none: one pre-declared test")
    df["label"] = [_join("paired interaction on the same documents", _exploratory(n)) for n in df["n_docs"]]
    return df


def equivalence(
    values: Any, *, doc: Any, margin: float | None, margin_source: str | None, alpha: float = 0.05,
    what: str = "difference",
) -> pd.DataFrame:  # fmt: skip
    """TOST equivalence of a mean difference to 0 within ``±margin`` — the ONLY way to say "alike"
    or "barely moves" (T1 vs T2, sufficiency). The margin must be declared before the data.

    ``values`` are per-sequence (or per-document) differences, ``doc`` their document ids; the
    test runs on document means (:func:`~posgen_tl.stats.inference.tost`).

    Returns:
        One-row ``pd.DataFrame``: ``what, estimate, ci_low, ci_high`` (the 1 − 2α = 90 %
        t-interval), ``ci_level, ci_method, p`` (TOST: max of the two one-sided p), ``p_kind,
        margin, margin_source, equivalent, n_docs, n_seqs, verdict`` ("equivalent within ±m" /
        "not shown equivalent (±m)"), ``label``.

    Raises:
        ValueError: margin not declared (None) or not positive, no ``margin_source``, fewer than 2
            documents, length mismatch, non-finite values.
    """
    from posgen_tl.stats.inference import as_1d, cluster_labels, cluster_means, tost  # noqa: PLC0415

    if margin is None:
        raise ValueError("equivalence margin not declared: state it before the data (never derive it from them)")
    if not margin_source:
        raise ValueError("margin_source must say where the margin was declared before the data (e.g. the run's config)")
    x = as_1d(values, "values")
    units, _ = cluster_means(x, cluster_labels(doc, x.size, "doc"))
    r = tost(units, float(margin), alpha=alpha)
    n = int(units.size)
    ok = bool(r["equivalent"])
    return pd.DataFrame([dict(
        what=what, estimate=r["mean"], ci_low=r["lo"], ci_high=r["hi"], ci_level=r["ci_level"],
        ci_method=f"t-interval on document means at {1 - 2 * alpha:.0%} (the TOST interval)", p=r["p"],
        p_kind="TOST (two one-sided t-tests on document means, n − 1 df)", margin=float(margin),
        margin_source=margin_source, equivalent=ok, n_docs=n, n_seqs=int(x.size),
        verdict=(f"equivalent within ±{margin:g}" if ok else f"not shown equivalent (±{margin:g})"),
        label=_join("equivalence (TOST)", _exploratory(n)))])  # fmt: skip


# ----------------------------------------------------------------------------- committed outputs


