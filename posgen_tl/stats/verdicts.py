"""The causal verdict of METHOD §8 version 2, as pure functions on tidy tables.

Input everywhere: a :func:`posgen_tl.stats.curves.document_units` table (one value per document,
condition, estimator, frac) whose ``by`` columns are the entry keys (default ``model, layers``) and
``condition`` (``none``, ``destroy``, ``C1`` …). Output: tidy DataFrames whose columns follow one
convention — ``estimate, ci_low, ci_high, ci_level, ci_method, p, p_kind, p_holm, n_docs, n_seqs,
verdict, label`` plus the identifying keys — with every statistic on DOCUMENT means.

- :class:`Family` / :class:`FamilyEntry`: the claim's family (models × layer groups, their
  controls, the order of the error control, a fixed n, the damage margin) declared before the run;
- :func:`tolerance_contrasts`: per-fraction paired contrasts (Holm over the fractions of a
  contrast), AUC (primary) and slope (secondary) contrasts;
- :func:`damage_equivalence` (TOST on clean-NLL damage, relative margin, 90 % Fieller interval)
  and :func:`damage_adjusted_contrast` (per-document regression on the damage gap);
- :func:`causal_verdict`: the intersection–union rule across the family;
- :func:`interaction_contrast` (difference of differences on the same documents) and
  :func:`equivalence` (TOST with a margin that must be declared);
- :func:`reanalyse_committed`: the committed causal rows through all of the above.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

from posgen_tl.stats.curves import (
    EXPLORATORY_MIN_DOCS,
    UNITS,
    boot_label,
    doc_bootstrap,
    doc_t_interval,
    document_units,
    unit_summary,
)
from posgen_tl.stats.inference import _check_alpha, holm, mde, sign_flip

__all__ = [
    "DAMAGE_RULES",
    "DEFAULT_DAMAGE_MARGIN_REL",
    "RANDOM_CONTROLS",
    "CausalVerdict",
    "Family",
    "FamilyEntry",
    "causal_verdict",
    "control_draws",
    "damage_adjusted_contrast",
    "damage_equivalence",
    "equivalence",
    "family_adjust",
    "interaction_contrast",
    "layers_label",
    "reanalyse_committed",
    "tolerance_contrasts",
]

#: METHOD §8's default damage margin (±10 % of destroy's damage). A run's config must STATE its
#: margin (:meth:`Family.from_config` refuses a config without one); this is what it cites.
DEFAULT_DAMAGE_MARGIN_REL = 0.10
#: the controls whose edit is random (C1 bands, C3 phases, C4 noise): drawn afresh per document.
RANDOM_CONTROLS = ("C1", "C3", "C4")
#: how a control's damage is handled: matched by TOST, else damage-adjusted ("tost_or_adjust");
#: TOST only (an unmatched control blocks "depends": "tost"); always adjusted ("adjust").
DAMAGE_RULES = ("tost_or_adjust", "tost", "adjust")
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


@dataclass(frozen=True)
class FamilyEntry:
    """One hypothesis of the claim's family: ``model`` × ``layers`` (e.g. ``"L10-19"``), the
    controls it must beat (all required) and the number of documents fixed before the run."""

    model: str
    layers: str
    controls: tuple[str, ...]
    n_docs: int

    @property
    def key(self) -> str:
        return f"{self.model} {self.layers}"


@dataclass(frozen=True)
class Family:
    """The claim's family, declared in the run's config BEFORE the run (METHOD §8).

    Attributes:
        entries: the hypotheses (model × layer group), each with its required controls and n.
        damage_margin_rel: TOST margin on damage, relative to destroy's damage (e.g. 0.10).
        controls_redrawn_per_document: whether C1/C3/C4 were drawn afresh per document.
        order: ``"holm"`` or a gatekeeping sequence (a tuple of every entry key, tested in that
            order at full α, stopping at the first non-rejection: fixed-sequence procedure).
        alpha: familywise level. damage_rule: one of :data:`DAMAGE_RULES`.
        intervention, baseline: condition names (``destroy``, ``none``).
        random_controls: controls that are random draws (checked against the draws).
    """

    entries: tuple[FamilyEntry, ...]
    damage_margin_rel: float
    controls_redrawn_per_document: bool
    order: str | tuple[str, ...] = "holm"
    alpha: float = 0.05
    damage_rule: str = "tost_or_adjust"
    intervention: str = "destroy"
    baseline: str = "none"
    random_controls: tuple[str, ...] = RANDOM_CONTROLS

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("the family has no entries")
        keys = [e.key for e in self.entries]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicated family entries: {sorted({k for k in keys if keys.count(k) > 1})}")
        m = self.damage_margin_rel
        if m is None or not (isinstance(m, (int, float)) and math.isfinite(m) and 0 < m < 1):
            raise ValueError(f"damage_margin_rel must be declared before the run as a number in (0, 1), got {m!r}")
        if not isinstance(self.controls_redrawn_per_document, bool):
            raise ValueError("controls_redrawn_per_document must be declared (True / False)")
        _check_alpha(self.alpha)
        if self.damage_rule not in DAMAGE_RULES:
            raise ValueError(f"damage_rule must be one of {DAMAGE_RULES}, got {self.damage_rule!r}")
        if self.order != "holm" and (isinstance(self.order, str) or sorted(self.order) != sorted(keys)):
            raise ValueError(f"order must be 'holm' or a sequence of every entry key exactly once {keys}, got {self.order!r}")
        for e in self.entries:
            if not e.controls or len(set(e.controls)) != len(e.controls):
                raise ValueError(f"entry {e.key!r}: controls must be non-empty and unique, got {e.controls}")
            if int(e.n_docs) != e.n_docs or e.n_docs < 2:
                raise ValueError(f"entry {e.key!r}: n_docs must be an integer ≥ 2, got {e.n_docs}")

    @classmethod
    def from_config(cls, cfg: dict) -> "Family":
        """Family from a config mapping (a run's ``claim_family``): keys ``entries`` (list of
        ``{model, layers, controls, n_docs}``), ``damage_margin_rel``, ``controls_redrawn_per_document``
        and optionally ``order``, ``alpha``, ``damage_rule``. Raises ``ValueError`` naming a missing key."""
        for k in ("entries", "damage_margin_rel", "controls_redrawn_per_document"):
            if k not in cfg or cfg[k] is None:
                raise ValueError(f"claim_family.{k} not declared: the config must state it before the run")
        entries = []
        for i, e in enumerate(cfg["entries"]):
            miss = {"model", "layers", "controls", "n_docs"} - set(e)
            if miss:
                raise ValueError(f"claim_family.entries[{i}] lacks {sorted(miss)}")
            lay = e["layers"] if isinstance(e["layers"], str) else layers_label(e["layers"])
            entries.append(FamilyEntry(str(e["model"]), lay, tuple(e["controls"]), int(e["n_docs"])))
        order = cfg.get("order", "holm")
        extra = {k: cfg[k] for k in ("alpha", "damage_rule") if k in cfg}
        return cls(tuple(entries), cfg["damage_margin_rel"], cfg["controls_redrawn_per_document"],
                   order=order if isinstance(order, str) else tuple(order), **extra)  # fmt: skip

    def conditions(self, e: FamilyEntry) -> list[str]:
        return [self.intervention, self.baseline, *e.controls]

    def check(self, units: pd.DataFrame, keys: Sequence[str] = KEYS) -> None:
        """Raise ``ValueError`` unless ``units`` hold exactly the declared family: every entry, every
        condition of its contrasts (AUC and damage), the same documents in every condition, and the
        declared number of documents; no undeclared entry."""
        miss = {*keys, "condition", "doc", "estimator", "value"} - set(units.columns)
        if miss:
            raise ValueError(f"units lack column(s) {sorted(miss)}")
        present = {" ".join(map(str, k)) for k in units[list(keys)].drop_duplicates().itertuples(index=False)}
        extra = present - {e.key for e in self.entries}
        if extra:
            raise ValueError(f"units hold entries not declared in the family: {sorted(extra)} (no extension after a look)")
        for e in self.entries:
            sub = _entry_units(units, e, keys)
            if sub.empty:
                raise ValueError(f"family entry {e.key!r} has no rows: every declared entry must be tested")
            for est in ("auc", "damage"):
                docs = None
                for c in self.conditions(e):
                    d = set(sub.loc[(sub["condition"] == c) & (sub["estimator"] == est), "doc"])
                    if not d:
                        raise ValueError(f"family entry {e.key!r}: contrast {self.intervention} − {c} cannot be formed: "
                                         f"no {est} rows for condition {c!r}")  # fmt: skip
                    if docs is not None and d != docs:
                        raise ValueError(f"family entry {e.key!r}: condition {c!r} covers other documents "
                                         f"(differ: {sorted(d ^ docs)[:10]})")  # fmt: skip
                    docs = d
            if len(docs) != e.n_docs:
                raise ValueError(f"family entry {e.key!r}: declared n_docs = {e.n_docs} before the run, the data "
                                 f"have {len(docs)} documents (n is fixed in advance)")  # fmt: skip


def _entry_units(units: pd.DataFrame, e: FamilyEntry, keys: Sequence[str]) -> pd.DataFrame:
    vals = dict(zip(keys, (e.model, e.layers)))
    mask = np.logical_and.reduce([units[k].astype(str) == str(v) for k, v in vals.items()])
    return units[mask]


# ----------------------------------------------------------------------------- contrasts


def _stat(estimator: str, frac: float) -> str:
    return estimator if estimator != "dnll" else f"dnll@{frac:g}"


def _wide(sub: pd.DataFrame) -> tuple[dict[tuple[str, float], pd.DataFrame], pd.DataFrame]:
    """``{(estimator, frac): [doc × condition] values}`` and ``n_seqs [doc × condition]`` of one entry."""
    out = {}
    for (est, fr), g in sub.groupby(["estimator", sub["frac"].fillna(-1.0)], sort=False):
        w = g.pivot(index="doc", columns="condition", values="value")
        out[(est, np.nan if fr == -1.0 else float(fr))] = w
    n = sub[sub["estimator"] == sub["estimator"].iloc[0]].pivot_table(index="doc", columns="condition",
                                                                      values="n_seqs", aggfunc="first")  # fmt: skip
    return out, n


def _paired(wide: dict, nseq: pd.DataFrame, a: str, b: str, stat: tuple[str, float], where: str) -> tuple[np.ndarray, int]:
    """Per-document ``a − b`` of one statistic (documents must match) and the number of sequences."""
    w = wide.get(stat)
    if w is None or a not in w or b not in w:
        raise ValueError(f"{where}: contrast {a} − {b} cannot be formed for {_stat(*stat)} (condition missing)")
    d = (w[a] - w[b]).to_numpy(np.float64)
    if np.isnan(d).any():
        raise ValueError(f"{where}: {a} and {b} cover different documents for {_stat(*stat)}")
    if (nseq[a] != nseq[b]).any():
        raise ValueError(f"{where}: {a} and {b} cover different sequences of some documents")
    return d, int(nseq[a].sum())


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
    for _, idx in df[self_move].groupby(list(keys), sort=False).groups.items() if keys else [(None, df[self_move].index)]:
        df.loc[idx, "p_holm"] = holm(df.loc[idx, "p"].to_numpy())
        df.loc[idx, "holm_scope"] = f"Holm over the {len(idx)} controls − {baseline} of this entry ('moves tolerance by itself')"
        df.loc[idx, "mde_alpha"] = alpha / len(idx)
    prim = (df["estimator"] == "auc") & ~self_move
    df.loc[prim, "holm_scope"] = "none here: primary, judged by causal_verdict (intersection–union, family order)"
    df.loc[prim, "mde_alpha"] = alpha / family_size
    df.loc[df["estimator"] == "slope", "holm_scope"] = "none: secondary statistic, not a verdict"
    df["mde"] = [mde(s, n, alpha=a) if n >= 2 else np.nan for s, n, a in zip(df["sd"], df["n_docs"], df["mde_alpha"])]
    return df


def tolerance_contrasts(
    units: pd.DataFrame, *, keys: Sequence[str] = KEYS, pairs: Sequence[tuple[str, str]] | None = None,
    estimators: Sequence[str] = ("auc", "dnll", "slope"), intervention: str = "destroy", baseline: str = "none",
    alpha: float = 0.05, family_size: int = 1, n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """Paired tolerance contrasts per entry, on document means (METHOD §8 v2).

    For each entry (``keys``) and pair ``(a, b)`` (default :func:`default_pairs`: destroy − none,
    destroy − Ck, Ck − none) and each statistic — ``auc`` (primary, nats × p), ``dnll`` at every
    positive fraction (nats), ``slope`` (secondary, nats per unit p) — the per-document difference
    ``a − b`` and: ``estimate`` (mean over documents), ``ci_low/ci_high`` (percentile bootstrap over
    documents, ``n_boot`` draws, ``ci_level``), ``t_low/t_high`` (t-interval, same level), ``p``
    (two-sided sign-flip over documents, :func:`~posgen_tl.stats.inference.sign_flip`) with
    ``p_kind`` (exact / Monte Carlo), ``p_holm`` with ``holm_scope``: Holm over the fractions of
    one contrast (dnll rows); Holm over the entry's ``Ck − none`` AUC rows (the "control moves
    tolerance by itself" flag); NaN for ``destroy − *`` AUC rows (their adjustment is
    :func:`causal_verdict`'s) and slope rows (not a verdict statistic); ``sd`` of the document
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
    _check_alpha(alpha)
    bad = set(estimators) - {"auc", "dnll", "slope", "damage"}
    if bad:
        raise ValueError(f"unknown estimator(s) {sorted(bad)}")
    order = {"auc": 0, "dnll": 1, "slope": 2, "damage": 3}
    rows = []
    for kv, sub in _entry_groups(units, keys):
        where = " ".join(map(str, kv.values())) or "units"
        wide, nseq = _wide(sub)
        stats = sorted((s for s in wide if s[0] in estimators), key=lambda s: (order[s[0]], np.nan_to_num(s[1])))
        if not stats:
            raise ValueError(f"{where}: none of the estimators {list(estimators)} in the units")
        conds = list(dict.fromkeys(sub["condition"]))
        for a, b in pairs or default_pairs(conds, intervention, baseline):
            cols = [_paired(wide, nseq, a, b, s, where) for s in stats]
            x = np.column_stack([c[0] for c in cols])
            for s, r in zip(stats, _contrast_block(x, n_boot=n_boot, ci_level=ci_level, seed=seed)):
                rows.append(dict(kv, contrast=f"{a} − {b}", a=a, b=b, estimator=s[0], frac=s[1], units=UNITS[s[0]], **r,
                                 n_docs=x.shape[0], n_seqs=cols[0][1]))  # fmt: skip
    df = _holm_and_mde(pd.DataFrame(rows), list(keys), alpha, family_size, intervention, baseline)
    role = {"auc": "primary (AUC)", "dnll": "per fraction", "damage": "damage difference",
            "slope": "secondary (slope: negative weights at small p, can hide or invert an effect)"}
    df["label"] = [_join(role[e], _exploratory(n)) for e, n in zip(df["estimator"], df["n_docs"])]
    cols = [*keys, "contrast", "a", "b", "estimator", "frac", "units", "estimate", "ci_low", "ci_high", "ci_level",
            "ci_method", "t_low", "t_high", "p", "p_kind", "p_holm", "holm_scope", "sd", "mde", "mde_alpha", "n_docs",
            "n_seqs", "label"]  # fmt: skip
    return df[cols]


# ----------------------------------------------------------------------------- damage


def _fieller(x: np.ndarray, y: np.ndarray, t: float) -> tuple[float, float]:
    """Fieller interval of ``mean(x)/mean(y)`` from paired per-document values at critical ``t``
    (``(−inf, inf)`` when ``mean(y)`` is not significantly non-zero: the interval is unbounded)."""
    n = x.size
    mx, my = x.mean(), y.mean()
    cov = np.cov(x, y, ddof=1) / n
    a = my**2 - t**2 * cov[1, 1]
    b = -2 * (mx * my - t**2 * cov[0, 1])
    c = mx**2 - t**2 * cov[0, 0]
    disc = b**2 - 4 * a * c
    if a <= 0 or disc < 0:
        return -math.inf, math.inf
    r = math.sqrt(disc)
    return (-b - r) / (2 * a), (-b + r) / (2 * a)


def _tost_ratio(x: np.ndarray, y: np.ndarray, margin_rel: float) -> float:
    """TOST p of ``(1 − m)·E y < E x < (1 + m)·E y`` from paired documents (two one-sided t-tests
    on ``x − (1 ∓ m)·y``, n − 1 df). Returns ``max`` of the two one-sided p's."""
    n = x.size
    ps = []
    for lam, side in ((1 - margin_rel, 1), (1 + margin_rel, -1)):  # H0: E x ≤ (1−m)E y  /  E x ≥ (1+m)E y
        d = x - lam * y
        se = d.std(ddof=1) / math.sqrt(n)
        if se == 0:
            ps.append(0.0 if side * d.mean() > 0 else 1.0)
        else:
            ps.append(float(sps.t.sf(side * d.mean() / se, n - 1)))
    return max(ps)


def damage_equivalence(
    units: pd.DataFrame, *, margin_rel: float, keys: Sequence[str] = KEYS, controls: Sequence[str] | None = None,
    intervention: str = "destroy", baseline: str = "none", alpha: float = 0.05,
) -> pd.DataFrame:  # fmt: skip
    """Is each control's clean-NLL damage equivalent to the intervention's? TOST, margin declared.

    Per entry and control ``Ck``, on paired per-document damages ``x = Ck``, ``y = destroy``
    (estimator ``"damage"`` of the units, nats): H0 ``E x ≤ (1 − m)·E y`` or ``E x ≥ (1 + m)·E y``
    (``m = margin_rel``, relative to destroy's damage, declared before the run — never derived
    from these data), each rejected by a one-sided paired t-test on ``x − (1 ∓ m)·y`` (n − 1 df).
    ``matched`` iff ``p = max`` of the two < ``alpha`` ⇔ the ``1 − 2α`` (90 %) Fieller interval of
    ``E x / E y`` lies inside ``(1 − m, 1 + m)``. CI overlap is never a match.

    Returns:
        ``pd.DataFrame``: ``*keys, control, estimator ("damage ratio − 1"), estimate`` (``mean x /
        mean y − 1``), ``ci_low, ci_high`` (Fieller interval − 1; ±inf when destroy's damage is not
        significantly positive), ``ci_level`` (``1 − 2α``), ``ci_method, p`` (TOST), ``p_kind,
        margin_rel, damage, control_damage`` (means over documents, nats), ``matched, n_docs,
        n_seqs, label``.

    Raises:
        ValueError: ``margin_rel`` not declared (None) or outside (0, 1); a condition without
            damage rows; conditions on different documents.
    """
    if margin_rel is None or not (math.isfinite(margin_rel) and 0 < margin_rel < 1):
        raise ValueError(f"damage margin not declared: margin_rel must be stated before the run in (0, 1), got {margin_rel!r}")
    _check_alpha(alpha)
    rows = []
    for kv, sub in _entry_groups(units, keys):
        where = " ".join(map(str, kv.values())) or "units"
        wide, nseq = _wide(sub)
        ctrls = controls or [c for c in dict.fromkeys(sub["condition"]) if c not in (intervention, baseline)]
        for c in ctrls:
            gap, n_seqs = _paired(wide, nseq, c, intervention, ("damage", np.nan), where)
            y = wide[("damage", np.nan)][intervention].to_numpy(np.float64)
            x = y + gap
            n = x.size
            if n < 3:
                raise ValueError(f"{where}: damage equivalence needs at least 3 documents, got {n}")
            t = float(sps.t.ppf(1 - alpha, n - 1))
            lo, hi = _fieller(x, y, t)
            p = _tost_ratio(x, y, margin_rel) if y.mean() > 0 else 1.0
            rows.append(dict(kv, control=c, estimator="damage ratio − 1", estimate=float(x.mean() / y.mean() - 1),
                             ci_low=lo - 1, ci_high=hi - 1, ci_level=1 - 2 * alpha,
                             ci_method="Fieller interval of mean(control)/mean(destroy) damage, minus 1 (t, n − 1 df)",
                             p=p, p_kind=f"TOST: two one-sided paired t-tests on document damages, margin ±{margin_rel:g} × destroy's",
                             margin_rel=float(margin_rel), damage=float(y.mean()), control_damage=float(x.mean()),
                             matched=bool(p < alpha), n_docs=n, n_seqs=n_seqs,
                             label=_join("matched" if p < alpha else "NOT matched (TOST)",
                                         "" if y.mean() > 0 else "destroy's damage is not positive: no relative margin",
                                         _exploratory(n))))  # fmt: skip
    return pd.DataFrame(rows)


def _ols_intercept(y: np.ndarray, g: np.ndarray, ci_level: float) -> dict[str, float]:
    """OLS ``y = b0 + b1·g``: intercept, its t-interval and two-sided t p (n − 2 df), and b1."""
    n = y.size
    gc = g - g.mean()
    sgg = float(gc @ gc)
    if n < 4 or sgg <= 1e-300:
        raise ValueError(f"damage-adjusted contrast needs ≥ 4 documents with a spread of the damage gap (n = {n})")
    b1 = float(gc @ (y - y.mean())) / sgg
    b0 = float(y.mean() - b1 * g.mean())
    res = y - b0 - b1 * g
    s2 = float(res @ res) / (n - 2)
    se = math.sqrt(s2 * (1 / n + g.mean() ** 2 / sgg))
    tc = float(sps.t.ppf((1 + ci_level) / 2, n - 2))
    p = 1.0 if se == 0 and b0 == 0 else (0.0 if se == 0 else float(2 * sps.t.sf(abs(b0) / se, n - 2)))
    return dict(b0=b0, b1=b1, t_low=b0 - tc * se, t_high=b0 + tc * se, p=p)


def _boot_intercepts(y: np.ndarray, g: np.ndarray, *, n_boot: int, seed: int) -> np.ndarray:
    """Intercepts of the OLS refit on ``n_boot`` document resamples (degenerate resamples dropped)."""
    n = y.size
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n)) + n * np.arange(n_boot)[:, None]
    w = np.bincount(idx.ravel(), minlength=n_boot * n).reshape(n_boot, n) / n
    gm, ym = w @ g, w @ y
    sgg = w @ (g * g) - gm**2
    sgy = w @ (g * y) - gm * ym
    ok = sgg > 1e-12 * max(float(np.var(g)), 1e-300)
    b1 = sgy[ok] / sgg[ok]
    return ym[ok] - b1 * gm[ok]


def damage_adjusted_contrast(
    units: pd.DataFrame, *, keys: Sequence[str] = KEYS, controls: Sequence[str] | None = None,
    intervention: str = "destroy", baseline: str = "none", estimator: str = "auc", n_boot: int = 10_000,
    ci_level: float = 0.95, seed: int = 0,
) -> pd.DataFrame:  # fmt: skip
    """``destroy − Ck`` at EQUAL damage: per-document regression on the damage gap.

    Per entry and control, over documents: ``y_d = destroy_d − Ck_d`` of ``estimator`` (default
    the AUC, nats × p) and ``g_d = damage(destroy)_d − damage(Ck)_d`` (nats); OLS ``y = b0 + b1·g``.
    ``b0`` is the contrast at zero damage gap (an extrapolation when the gaps sit far from 0, which
    widens its interval, as it should).

    Returns:
        ``pd.DataFrame``: ``*keys, contrast, control, estimator, estimate`` (``b0``), ``ci_low,
        ci_high`` (percentile bootstrap over documents, pairs resampled and refitted), ``ci_level,
        ci_method, t_low, t_high`` (OLS t-interval, n − 2 df), ``p, p_kind`` (OLS t-test of the
        intercept, parametric), ``gap_mean`` (nats), ``gap_slope`` (``b1``, per nat of gap),
        ``n_docs, n_seqs, label``.

    Raises:
        ValueError: missing conditions or damage rows, different documents, fewer than 4
            documents or no spread of the damage gap.
    """
    rows = []
    for kv, sub in _entry_groups(units, keys):
        where = " ".join(map(str, kv.values())) or "units"
        wide, nseq = _wide(sub)
        ctrls = controls or [c for c in dict.fromkeys(sub["condition"]) if c not in (intervention, baseline)]
        for c in ctrls:
            y, n_seqs = _paired(wide, nseq, intervention, c, (estimator, np.nan), where)
            g, _ = _paired(wide, nseq, intervention, c, ("damage", np.nan), where)
            fit = _ols_intercept(y, g, ci_level)
            lo, hi = np.quantile(_boot_intercepts(y, g, n_boot=n_boot, seed=seed), [(1 - ci_level) / 2, (1 + ci_level) / 2])
            rows.append(dict(kv, contrast=f"{intervention} − {c} at equal damage", control=c, estimator=estimator,
                             estimate=fit["b0"], ci_low=float(lo), ci_high=float(hi), ci_level=ci_level,
                             ci_method=f"percentile bootstrap over documents ({n_boot} draws, pairs refitted); "
                                       "t_low/t_high: OLS t-interval (n − 2 df)",
                             t_low=fit["t_low"], t_high=fit["t_high"], p=fit["p"],
                             p_kind="OLS t-test of the intercept (n − 2 df; parametric)", gap_mean=float(g.mean()),
                             gap_slope=fit["b1"], n_docs=y.size, n_seqs=n_seqs,
                             label=_join("damage-adjusted (regression on the per-document damage gap)",
                                         _exploratory(y.size))))  # fmt: skip
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- the verdict


class CausalVerdict(NamedTuple):
    """Output of :func:`causal_verdict`: ``verdicts`` (one row per family entry), ``components``
    (every contrast the rule looked at, required or not counted), ``damage``
    (:func:`damage_equivalence`), ``adjusted`` (:func:`damage_adjusted_contrast` rows used)."""

    verdicts: pd.DataFrame
    components: pd.DataFrame
    damage: pd.DataFrame
    adjusted: pd.DataFrame


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


def control_draws(rows: pd.DataFrame, *, keys: Sequence[str] = KEYS, draw: str = "draw") -> pd.DataFrame | None:
    """The random controls' draw ids per ``(*keys, condition, doc)`` from rows carrying a ``draw``
    column (the seed of the control's random bands / phases / noise), else ``None``."""
    if draw not in rows.columns:
        return None
    return rows[[*keys, "condition", "doc", draw]].drop_duplicates().rename(columns={draw: "draw"})


def _draws_label(draws: pd.DataFrame | None, family: Family, keys: Sequence[str]) -> str:
    """Check the random controls' draws against the family's declaration; return the label."""
    rc = sorted({c for e in family.entries for c in e.controls if c in family.random_controls})
    if not rc:
        return ""
    if draws is None:
        if family.controls_redrawn_per_document:
            raise ValueError("the config says controls_redrawn_per_document=True but no draws were given (no 'draw' "
                             "column): per-document draws cannot be checked")  # fmt: skip
        return (f"random controls {', '.join(rc)}: ONE draw each (not redrawn per document) — the test is conditional "
                "on that draw; their spread over draws is in no interval")  # fmt: skip
    for e in family.entries:
        d = _entry_units(draws, e, keys)
        for c in (c for c in e.controls if c in family.random_controls):
            dc = d[d["condition"] == c]
            if dc.groupby("doc")["draw"].nunique().max() != 1 or dc["doc"].nunique() != e.n_docs:
                raise ValueError(f"{e.key}: control {c} needs exactly one draw id per document for each of its {e.n_docs} documents")
            per_doc = dc["draw"].nunique() == e.n_docs
            if per_doc != family.controls_redrawn_per_document:
                raise ValueError(f"{e.key}: control {c} has {dc['draw'].nunique()} distinct draw(s) for {e.n_docs} "
                                 f"documents, but the config says controls_redrawn_per_document="
                                 f"{family.controls_redrawn_per_document}")  # fmt: skip
    if family.controls_redrawn_per_document:
        return f"random controls {', '.join(rc)}: drawn afresh per document (the test integrates over their randomness)"
    return f"random controls {', '.join(rc)}: ONE draw each (checked): the test is conditional on that draw"


def _component(kv: dict, name: str, control: str, role: str, status: str, r: Any, s0: float, counted: bool,
               self_row: Any = None) -> dict:  # fmt: skip
    """One row of the components table (``r``: a contrast row, plain or damage-adjusted)."""
    same = bool(s0 != 0 and np.sign(r["estimate"]) == s0)
    return dict(kv, component=name, control=control, role=role, damage_status=status, estimate=r["estimate"],
                ci_low=r["ci_low"], ci_high=r["ci_high"], ci_level=r["ci_level"], ci_method=r["ci_method"],
                t_low=r["t_low"], t_high=r["t_high"], p=r["p"], p_kind=r["p_kind"],
                p_iut=(r["p"] if same and "unmatched" not in status else 1.0) if counted else np.nan,
                same_direction=same, moves_by_itself=None if self_row is None else bool(self_row["moves"]),
                self_estimate=np.nan if self_row is None else self_row["estimate"],
                self_p_holm=np.nan if self_row is None else self_row["p_holm"], n_docs=r["n_docs"], n_seqs=r["n_seqs"])  # fmt: skip


def _entry_verdict(sub: pd.DataFrame, e: FamilyEntry, family: Family, keys: Sequence[str], m: int, *, n_boot: int,
                   ci_level: float, seed: int) -> tuple[dict, list[dict], pd.DataFrame, pd.DataFrame]:  # fmt: skip
    """The intersection–union test of one entry: (verdict row without the family adjustment,
    component rows, damage table, adjusted-contrast table)."""
    iv, base, a = family.intervention, family.baseline, family.alpha
    kv = dict(zip(keys, (e.model, e.layers)))
    con = tolerance_contrasts(sub, keys=keys, pairs=default_pairs(family.conditions(e), iv, base), estimators=("auc",),
                              intervention=iv, baseline=base, alpha=a, family_size=m, n_boot=n_boot,
                              ci_level=ci_level, seed=seed).set_index("contrast")  # fmt: skip
    dmg = damage_equivalence(sub, margin_rel=family.damage_margin_rel, keys=keys, controls=e.controls,
                             intervention=iv, baseline=base, alpha=a).set_index("control")  # fmt: skip
    rule = family.damage_rule
    need_adj = [c for c in e.controls if rule == "adjust" or (rule == "tost_or_adjust" and not dmg.loc[c, "matched"])]
    adj = (damage_adjusted_contrast(sub, keys=keys, controls=need_adj, intervention=iv, baseline=base, n_boot=n_boot,
                                    ci_level=ci_level, seed=seed) if need_adj else pd.DataFrame())  # fmt: skip
    adj_i = adj.set_index("control") if len(adj) else adj
    r0 = con.loc[f"{iv} − {base}"]
    s0 = float(np.sign(r0["estimate"]))
    comps = [_component(kv, f"{iv} − {base}", "", "required: destroy moves tolerance", "", r0, s0, True)]
    counted, notes = [], []
    for c in e.controls:
        self_row = con.loc[f"{c} − {base}"].copy()
        self_row["moves"] = bool(self_row["p_holm"] < a)
        opposite = bool(self_row["moves"] and np.sign(self_row["estimate"]) != s0)
        tost = f"TOST p = {dmg.loc[c, 'p']:.3g}, margin ±{family.damage_margin_rel:g}"
        if c in need_adj:
            r, status = adj_i.loc[c], f"adjusted ({'rule adjust' if rule == 'adjust' else 'not matched'}: {tost})"
        else:
            r = con.loc[f"{iv} − {c}"]
            status = f"matched ({tost})" if dmg.loc[c, "matched"] else f"unmatched, blocks under rule 'tost' ({tost})"
        role = ("not counted: control moves tolerance by itself, opposite to destroy" if opposite else "required")
        name = f"{iv} − {c}" + (" at equal damage" if c in need_adj else "")
        comps.append(_component(kv, name, c, role, status, r, s0, not opposite, self_row))
        if self_row["moves"]:
            notes.append(f"{c} moves tolerance by itself ({self_row['estimate']:+.3g} nats × p vs {base}, Holm p = "
                         f"{self_row['p_holm']:.2g}; {'opposite to destroy: not counted' if opposite else 'same direction'})")  # fmt: skip
        if not opposite:
            counted.append(c)
    p_req = [x["p_iut"] for x in comps if x["p_iut"] == x["p_iut"]]  # NaN: not counted
    p_iut = max(p_req) if counted else 1.0
    fails = [f"{x['component']}: p = {x['p']:.3g}" + ("" if x["same_direction"] else " (direction differs)")
             for x in comps if x["p_iut"] == x["p_iut"] and not x["p_iut"] < a]  # fmt: skip
    if not counted:
        fails.append("no control left that does not move tolerance by itself against destroy")
    row = dict(kv, claim=f"tolerance depends on what {iv} removes, beyond damage", estimator="auc",
               estimate=r0["estimate"], ci_low=r0["ci_low"], ci_high=r0["ci_high"], ci_level=r0["ci_level"],
               ci_method=r0["ci_method"], t_low=r0["t_low"], t_high=r0["t_high"], p=p_iut,
               p_kind="intersection–union: max of the required p's (" + "; ".join(sorted({x["p_kind"] for x in comps})) + ")",
               counted_controls=",".join(counted), excluded_controls=",".join(c for c in e.controls if c not in counted),
               sd=r0["sd"], n_docs=int(r0["n_docs"]), n_seqs=int(r0["n_seqs"]), fails="; ".join(fails),
               notes="; ".join(notes))  # fmt: skip
    return row, comps, dmg.reset_index()[[*keys, "control", *[k for k in dmg.columns if k not in keys]]], adj


def causal_verdict(
    units: pd.DataFrame, family: Family, *, draws: pd.DataFrame | None = None, keys: Sequence[str] = KEYS,
    n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0, note: str = "",
) -> CausalVerdict:  # fmt: skip
    """METHOD §8 v2: does tolerance depend on the pattern beyond damage? One verdict per family entry.

    Per entry (intersection–union test on the AUC, document means): required are (1) destroy −
    none ≠ 0 (sign-flip p, sign ``s``), and (2) for EVERY control ``Ck`` of the entry, destroy −
    Ck ≠ 0 with the same sign ``s`` — the plain contrast when Ck's damage is matched
    (:func:`damage_equivalence`, TOST at the declared margin), else the damage-adjusted contrast
    (:func:`damage_adjusted_contrast`; rule ``"tost"``: an unmatched control blocks). A control
    that moves tolerance by itself (Ck − none AUC, Holm over the entry's controls, p < α) against
    destroy's direction is reported and NOT counted (its contrast would borrow the control's own
    move); if no control is left the entry cannot pass. A required contrast with the wrong sign
    has ``p_iut = 1``. The entry's p is the largest required ``p_iut`` (a valid p of the union
    null); across entries the family's declared order adjusts it (:func:`family_adjust`).

    Returns:
        :class:`CausalVerdict`; its ``verdicts`` columns: ``*keys, claim, estimator`` ("auc"),
        ``estimate, ci_low, ci_high, ci_level, ci_method, t_low, t_high`` (destroy − none AUC,
        nats × p, document bootstrap / t), ``p`` (IUT), ``p_kind, p_holm`` (family-adjusted),
        ``p_adj_method, counted_controls, excluded_controls, sd, mde, mde_alpha`` (80 % power for
        destroy − none at the level the family adjustment leaves: α/m for Holm, α for a fixed
        sequence), ``n_docs, n_seqs, verdict`` ("depends" / "no evidence", + " (exploratory)" below
        32 documents), ``label`` (reasons, controls moving by themselves, draws, ``note``).

    Raises:
        ValueError: units not matching the declared family (:meth:`Family.check`), draws not
            matching ``controls_redrawn_per_document``, degenerate damage data.
    """
    family.check(units, keys)
    drawn = _draws_label(draws, family, keys)
    m, a = len(family.entries), family.alpha
    rows, comps, dmgs, adjs = [], [], [], []
    for e in family.entries:
        r, c, d, j = _entry_verdict(_entry_units(units, e, keys), e, family, keys, m, n_boot=n_boot,
                                    ci_level=ci_level, seed=seed)  # fmt: skip
        rows.append(r)
        comps += c
        dmgs.append(d)
        adjs.append(j)
    out = pd.DataFrame(rows)
    out["p_holm"], method = family_adjust(out["p"].to_numpy(), family.order, [e.key for e in family.entries])
    out["p_adj_method"] = method
    out["mde_alpha"] = a / m if family.order == "holm" else a
    out["mde"] = [mde(s, n, alpha=al) for s, n, al in zip(out["sd"], out["n_docs"], out["mde_alpha"])]
    verdicts, labels = [], []
    for r in out.itertuples(index=False):
        ok = r.p_holm < a
        verdicts.append(("depends" if ok else "no evidence") + (" (exploratory)" if r.n_docs < EXPLORATORY_MIN_DOCS else ""))
        why = (f"destroy − none and destroy − every counted control ({r.counted_controls}) agree in sign; IUT p = "
               f"{r.p:.3g}, adjusted {r.p_holm:.3g} < {a:g}") if ok else _join(
            r.fails or f"IUT p = {r.p:.3g} but adjusted p = {r.p_holm:.3g} ≥ {a:g}",
            f"MDE (80 %, α = {r.mde_alpha:.3g}) = {r.mde:.3g} nats × p")  # fmt: skip
        labels.append(_join(why, r.notes, drawn, note, _exploratory(r.n_docs)))
    out["verdict"], out["label"] = verdicts, labels
    cols = [*keys, "claim", "estimator", "estimate", "ci_low", "ci_high", "ci_level", "ci_method", "t_low", "t_high",
            "p", "p_kind", "p_holm", "p_adj_method", "counted_controls", "excluded_controls", "sd", "mde", "mde_alpha",
            "n_docs", "n_seqs", "verdict", "label"]  # fmt: skip
    comp = pd.DataFrame(comps)
    comp["label"] = [_join(r, _exploratory(n)) for r, n in zip(comp["role"], comp["n_docs"])]
    return CausalVerdict(out[cols], comp, pd.concat(dmgs, ignore_index=True),
                         pd.concat([j for j in adjs if len(j)], ignore_index=True) if any(len(j) for j in adjs) else pd.DataFrame())  # fmt: skip
