"""Fixtures shared by the stats table tests: clustered per-sequence rows and independent statistics.

The independent computations here never call posgen_tl: a plain loop bootstrap over DOCUMENT means,
the same over SEQUENCES (what a mutated table would do), the Student-t interval, and the exact
sign-flip p by brute-force enumeration.
"""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy import stats as sps

FRACS = (0.02, 0.05, 0.10, 0.20)


def clustered_rows(seed=0, n_docs=16, per_doc=4, conditions=("none", "destroy", "C1"), effect=None, doc_sd=0.6,
                   seq_sd=0.15, damage=None, seeds=(0, 1)):  # fmt: skip
    """Per-(condition, sequence, frac, seed) rows with a strong DOCUMENT random effect on every
    difference (16 documents × 4 sequences by default): a bootstrap over sequences is much too
    narrow here. ΔNLL(p) = p·(1 + effect_c) + doc effect·p + sequence noise; ``delta`` = 0 at p = 0."""
    rng = np.random.default_rng(seed)
    effect = {"none": 0.0, "destroy": 0.3, "C1": 0.1, "C2": 0.0, **(effect or {})}
    damage = {"none": 0.0, "destroy": 0.5, "C1": 0.45, **(damage or {})}
    doc = np.repeat(np.arange(n_docs), per_doc)
    seq = np.arange(doc.size)
    base_clean = 2.0 + rng.normal(0, 0.2, doc.size)
    rows = []
    for c in conditions:
        doc_eff = rng.normal(0, doc_sd, n_docs)[doc]
        dmg_doc = damage[c] * np.exp(rng.normal(0, 0.3, n_docs))[doc] if damage[c] else np.zeros(doc.size)
        dmg = dmg_doc + (rng.normal(0, 0.05, doc.size) if damage[c] else 0.0)
        for f in (0.0, *FRACS):
            for s in seeds:
                delta = np.zeros(doc.size) if f == 0 else f * (1 + effect[c] + doc_eff) + rng.normal(0, seq_sd, doc.size) * f
                rows.append(pd.DataFrame(dict(condition=c, seq=seq, doc=doc, frac=f, seed=s, clean_nll=base_clean + dmg,
                                              nll=base_clean + dmg + delta, delta=delta, base_clean_nll=base_clean)))
    return pd.concat(rows, ignore_index=True)


def loop_bootstrap(values, n_boot=20_000, level=0.95, seed=12345):
    """Percentile bootstrap of the mean of ``values`` (each value one resampled unit), plain loop."""
    rng = np.random.default_rng(seed)
    v = np.asarray(values, float)
    means = np.array([v[rng.integers(0, v.size, v.size)].mean() for _ in range(n_boot)])
    return tuple(np.quantile(means, [(1 - level) / 2, (1 + level) / 2]))


def t_ci(values, level=0.95):
    v = np.asarray(values, float)
    h = sps.t.ppf((1 + level) / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    return v.mean() - h, v.mean() + h


def brute_sign_flip(x):
    """Two-sided sign-flip p over all 2^n patterns (ties within 1e-9·Σ|x|), numpy enumeration."""
    x = np.asarray(x, float)
    signs = 1 - 2 * ((np.arange(2**x.size)[:, None] >> np.arange(x.size)) & 1)
    return float(np.mean(np.abs(signs @ x) >= abs(x.sum()) - 1e-9 * np.abs(x).sum()))


def brute_holm(p):
    """Holm adjusted p by the textbook definition, loop over all p."""
    p = np.asarray(p, float)
    m = p.size
    order = np.argsort(p)
    out = np.empty(m)
    run = 0.0
    for rank, i in enumerate(order):
        run = max(run, min(1.0, (m - rank) * p[i]))
        out[i] = run
    return out


def curve_per_sequence(rows, condition):
    """``[n_seq, n_fracs]`` seed-averaged ΔNLL of one condition and the doc of each sequence (independent)."""
    g = rows[(rows["condition"] == condition) & (rows["frac"] > 0)]
    w = g.groupby(["seq", "frac"])["delta"].mean().unstack()
    doc = g.groupby("seq")["doc"].first().loc[w.index]
    return w.to_numpy(), doc.to_numpy()


def trapezoid_auc(y):
    """AUC by numpy's trapezoid on the curve with (0, 0) prepended, per row (independent)."""
    p = np.concatenate([[0.0], FRACS])
    yy = np.column_stack([np.zeros(len(y)), y])
    return np.array([sum((p[i + 1] - p[i]) * (r[i + 1] + r[i]) / 2 for i in range(len(p) - 1)) for r in yy])


def doc_means(values, doc):
    return pd.Series(values).groupby(np.asarray(doc)).mean().to_numpy()


def pairs(it):
    return list(itertools.combinations(it, 2))
