"""The causal verdict of docs/method.md §8 version 2, as pure functions on tidy tables.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

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
from posgen_tl.stats.inference import check_alpha, holm, mde, sign_flip

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
    "legacy_family",
    "default_pairs",
    "layers_label",
    "reanalyse_committed",
    "tolerance_contrasts",
]

#: docs/method.md §8's default damage margin (±10 % of destroy's damage). A run's config must STATE its
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
    """The claim's family, declared in the run's config BEFORE the run (docs/method.md §8).

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
        check_alpha(self.alpha)
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
    def from_config(cls, cfg: dict) -> Family:
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

    def check(self, units: pd.DataFrame, keys: Sequence[str] = KEYS) -> dict[str, pd.DataFrame]:
        """Raise ``ValueError`` unless ``units`` hold exactly the declared family: every entry, every
        condition of its contrasts (AUC and damage), the same documents in every condition, and the
        declared number of documents; no undeclared entry. Returns ``{entry key: its units}``."""
        miss = {*keys, "condition", "doc", "estimator", "value", "n_seqs"} - set(units.columns)
        if miss:
            raise ValueError(f"units lack column(s) {sorted(miss)}")
        subs = {" ".join(map(str, k if isinstance(k, tuple) else (k,))): g
                for k, g in units.groupby(list(keys), sort=False)}  # fmt: skip
        extra = set(subs) - {e.key for e in self.entries}
        if extra:
            raise ValueError(f"units hold entries not declared in the family: {sorted(extra)} (no extension after a look)")
        for e in self.entries:
            if e.key not in subs:
                raise ValueError(f"family entry {e.key!r} has no rows: every declared entry must be tested")
            sub = subs[e.key]
            docs = {k: frozenset(g) for k, g in sub.groupby(["estimator", "condition"], sort=False)["doc"]}
            ref = None
            for est in ("auc", "damage"):
                for c in self.conditions(e):
                    d = docs.get((est, c))
                    if not d:
                        raise ValueError(f"family entry {e.key!r}: contrast {self.intervention} − {c} cannot be formed: "
                                         f"no {est} rows for condition {c!r}")  # fmt: skip
                    if ref is not None and d != ref:
                        raise ValueError(f"family entry {e.key!r}: condition {c!r} covers other documents "
                                         f"(differ: {sorted(d ^ ref)[:10]})")  # fmt: skip
                    ref = d
            if len(ref) != e.n_docs:
                raise ValueError(f"family entry {e.key!r}: declared n_docs = {e.n_docs} before the run, the data "
                                 f"have {len(ref)} documents (n is fixed in advance)")  # fmt: skip
        return subs


def _entry_units(units: pd.DataFrame, e: FamilyEntry, keys: Sequence[str]) -> pd.DataFrame:
    vals = dict(zip(keys, (e.model, e.layers)))
    mask = np.logical_and.reduce([units[k].astype(str) == str(v) for k, v in vals.items()])
    return units[mask]


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
    df.loc[prim, "holm_scope"] = "none here: primary, judged by causal_verdict (intersection–union, family order)"
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


def _damage_row(kv: dict, wide: _Wide, c: str, intervention: str, margin_rel: float, alpha: float,
                where: str) -> dict:  # fmt: skip
    """One row of :func:`damage_equivalence`: control ``c`` against ``intervention`` in one entry."""
    gap, n_seqs = _paired(wide, c, intervention, ("damage", np.nan), where)
    y = wide.vals[("damage", np.nan)][intervention]
    x = y + gap
    n = x.size
    if n < 3:
        raise ValueError(f"{where}: damage equivalence needs at least 3 documents, got {n}")
    lo, hi = _fieller(x, y, float(sps.t.ppf(1 - alpha, n - 1)))
    p = _tost_ratio(x, y, margin_rel) if y.mean() > 0 else 1.0
    return dict(kv, control=c, estimator="damage ratio − 1", estimate=float(x.mean() / y.mean() - 1) if y.mean() else np.nan,
                ci_low=lo - 1, ci_high=hi - 1, ci_level=1 - 2 * alpha,
                ci_method="Fieller interval of mean(control)/mean(destroy) damage, minus 1 (t, n − 1 df)",
                p=p, p_kind=f"TOST: two one-sided paired t-tests on document damages, margin ±{margin_rel:g} × destroy's",
                margin_rel=float(margin_rel), damage=float(y.mean()), control_damage=float(x.mean()),
                matched=bool(p < alpha), n_docs=n, n_seqs=n_seqs,
                label=_join("matched" if p < alpha else "NOT matched (TOST)",
                            "" if y.mean() > 0 else "destroy's damage is not positive: no relative margin",
                            _exploratory(n)))  # fmt: skip


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
    check_alpha(alpha)
    rows = []
    for kv, sub in _entry_groups(units, keys):
        where = " ".join(map(str, kv.values())) or "units"
        wide = _wide(sub)
        ctrls = controls or [c for c in dict.fromkeys(sub["condition"]) if c not in (intervention, baseline)]
        rows += [_damage_row(kv, wide, c, intervention, margin_rel, alpha, where) for c in ctrls]
    return pd.DataFrame(rows)


def _ols_intercept(y: np.ndarray, g: np.ndarray, ci_level: float) -> dict[str, float]:
    """OLS ``y = b0 + b1·g``: intercept, its t-interval and two-sided t p (n − 2 df), and b1 (a gap
    that is 0 in every document needs no adjustment: then the one-sample t on ``y``, n − 1 df)."""
    n = y.size
    gc = g - g.mean()
    sgg = float(gc @ gc)
    if n < 4:
        raise ValueError(f"damage-adjusted contrast needs ≥ 4 documents, got {n}")
    if sgg <= 1e-300:
        if np.any(g != 0):
            raise ValueError("the damage gap is the same non-zero value in every document: the contrast at equal "
                             "damage is not identified")  # fmt: skip
        se = float(y.std(ddof=1)) / math.sqrt(n)  # gap ≡ 0: already at equal damage, the plain t-test (n − 1 df)
        tc = float(sps.t.ppf((1 + ci_level) / 2, n - 1))
        p = 1.0 if se == 0 and y.mean() == 0 else (0.0 if se == 0 else float(2 * sps.t.sf(abs(y.mean()) / se, n - 1)))
        return dict(b0=float(y.mean()), b1=0.0, t_low=float(y.mean()) - tc * se, t_high=float(y.mean()) + tc * se, p=p)
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
    if not np.any(g != 0):  # already at equal damage: the bootstrap of the mean
        return ym
    sgg = w @ (g * g) - gm**2
    sgy = w @ (g * y) - gm * ym
    ok = sgg > 1e-12 * max(float(np.var(g)), 1e-300)
    b1 = sgy[ok] / sgg[ok]
    return ym[ok] - b1 * gm[ok]


def _adjusted_row(kv: dict, wide: _Wide, c: str, intervention: str, estimator: str, where: str, *,
                  n_boot: int, ci_level: float, seed: int) -> dict:  # fmt: skip
    """One row of :func:`damage_adjusted_contrast`: ``intervention − c`` at equal damage in one entry."""
    y, n_seqs = _paired(wide, intervention, c, (estimator, np.nan), where)
    g, _ = _paired(wide, intervention, c, ("damage", np.nan), where)
    if y.size < 4:  # an intercept and a slope leave n − 2 df: below 4 documents nothing to test (p stays NaN)
        nan = float("nan")
        return dict(kv, contrast=f"{intervention} − {c} at equal damage", control=c, estimator=estimator,
                    estimate=nan, ci_low=nan, ci_high=nan, ci_level=ci_level, ci_method="not computed",
                    t_low=nan, t_high=nan, p=nan, p_kind="not identified", gap_mean=float(g.mean()),
                    gap_slope=nan, n_docs=y.size, n_seqs=n_seqs,
                    label=f"not identified: the damage-adjusted contrast needs ≥ 4 documents, got {y.size}")  # fmt: skip
    fit = _ols_intercept(y, g, ci_level)
    lo, hi = np.quantile(_boot_intercepts(y, g, n_boot=n_boot, seed=seed), [(1 - ci_level) / 2, (1 + ci_level) / 2])
    return dict(kv, contrast=f"{intervention} − {c} at equal damage", control=c, estimator=estimator,
                estimate=fit["b0"], ci_low=float(lo), ci_high=float(hi), ci_level=ci_level,
                ci_method=f"percentile bootstrap over documents ({n_boot} draws, pairs refitted); "
                          "t_low/t_high: OLS t-interval (n − 2 df)",
                t_low=fit["t_low"], t_high=fit["t_high"], p=fit["p"],
                p_kind="OLS t-test of the intercept (n − 2 df; parametric)", gap_mean=float(g.mean()),
                gap_slope=fit["b1"], n_docs=y.size, n_seqs=n_seqs,
                label=_join("damage-adjusted (regression on the per-document damage gap)", _exploratory(y.size)))  # fmt: skip


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
        wide = _wide(sub)
        ctrls = controls or [c for c in dict.fromkeys(sub["condition"]) if c not in (intervention, baseline)]
        rows += [_adjusted_row(kv, wide, c, intervention, estimator, where, n_boot=n_boot, ci_level=ci_level,
                               seed=seed) for c in ctrls]  # fmt: skip
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
    wide = _wide(sub)
    dmg = {c: _damage_row(kv, wide, c, iv, family.damage_margin_rel, a, e.key) for c in e.controls}
    rule = family.damage_rule
    need_adj = [c for c in e.controls if rule == "adjust" or (rule == "tost_or_adjust" and not dmg[c]["matched"])]
    adj_i = {c: _adjusted_row(kv, wide, c, iv, "auc", e.key, n_boot=n_boot, ci_level=ci_level, seed=seed)
             for c in need_adj}  # fmt: skip
    pairs = [(iv, base), *((c, base) for c in e.controls), *((iv, c) for c in e.controls if c not in need_adj)]
    con = {r["contrast"]: r for r in _pair_rows(kv, wide, pairs, [("auc", np.nan)], e.key, n_boot=n_boot,
                                                  ci_level=ci_level, seed=seed)}  # fmt: skip
    for c, ph in zip(e.controls, holm([con[f"{c} − {base}"]["p"] for c in e.controls])):
        con[f"{c} − {base}"]["p_holm"] = ph  # Holm over the entry's controls − none
    r0 = con[f"{iv} − {base}"]
    s0 = float(np.sign(r0["estimate"]))
    comps = [_component(kv, f"{iv} − {base}", "", "required: destroy moves tolerance", "", r0, s0, True)]
    counted, notes = [], []
    for c in e.controls:
        self_row = dict(con[f"{c} − {base}"])
        self_row["moves"] = bool(self_row["p_holm"] < a)
        opposite = bool(self_row["moves"] and np.sign(self_row["estimate"]) != s0)
        tost = f"TOST p = {dmg[c]['p']:.3g}, margin ±{family.damage_margin_rel:g}"
        if c in need_adj:
            r, status = adj_i[c], f"adjusted ({'rule adjust' if rule == 'adjust' else 'not matched'}: {tost})"
        else:
            r = con[f"{iv} − {c}"]
            status = f"matched ({tost})" if dmg[c]["matched"] else f"unmatched, blocks under rule 'tost' ({tost})"
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
    fails = [f"{x['component']}: " + ("not identified (fewer than 4 documents)" if x["p"] != x["p"] else
             f"p = {x['p']:.3g}" + ("" if x["same_direction"] else " (direction differs)"))
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
    return row, comps, pd.DataFrame(list(dmg.values())), pd.DataFrame(list(adj_i.values()))


def causal_verdict(
    units: pd.DataFrame, family: Family, *, draws: pd.DataFrame | None = None, keys: Sequence[str] = KEYS,
    n_boot: int = 10_000, ci_level: float = 0.95, seed: int = 0, note: str = "",
) -> CausalVerdict:  # fmt: skip
    """docs/method.md §8 v2: does tolerance depend on the pattern beyond damage? One verdict per family entry.

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
    subs = family.check(units, keys)
    drawn = _draws_label(draws, family, keys)
    m, a = len(family.entries), family.alpha
    rows, comps, dmgs, adjs = [], [], [], []
    for e in family.entries:
        r, c, d, j = _entry_verdict(subs[e.key], e, family, keys, m, n_boot=n_boot,
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


def _read_run(rows_csv: str | Path, config_json: str | Path) -> tuple[pd.DataFrame, dict]:
    """Rows with ``model, layers, condition`` columns (legacy ``intervention`` renamed) and the config."""
    cfg = json.loads(Path(config_json).read_text())
    rows = pd.read_csv(rows_csv)
    if "condition" not in rows.columns:
        if "intervention" not in rows.columns:
            raise ValueError(f"{rows_csv}: rows have neither 'condition' nor 'intervention'")
        rows = rows.rename(columns={"intervention": "condition"})
    for k in ("model", "layers"):
        if k not in cfg:
            raise ValueError(f"{config_json}: config lacks {k!r}")
    return rows.assign(model=str(cfg["model"]), layers=layers_label(cfg["layers"])), cfg


def legacy_family(configs: Sequence[dict], *, damage_margin_rel: float, order: str | Sequence[str] = "holm") -> tuple[Family, str]:
    """The family of runs whose configs declared none (every run before docs/method.md §8 v2): one entry per
    (model, layers) with the run's controls and recorded ``n_docs``; ``controls_redrawn_per_document``
    from the config, else False (those runs seeded each random control once). Returns ``(family,
    note)``; the note says that family, order and margin were stated AFTER the data."""
    entries = tuple(FamilyEntry(str(c["model"]), layers_label(c["layers"]), tuple(c["controls"]), int(c["n_docs"]))
                    for c in configs)  # fmt: skip
    redrawn = {bool(c.get("controls_redrawn_per_document", False)) for c in configs}
    if len(redrawn) != 1:
        raise ValueError("the runs disagree on controls_redrawn_per_document: one family needs one design")
    fam = Family(entries, damage_margin_rel, redrawn.pop(), order=order if isinstance(order, str) else tuple(order))
    subsets = sorted({str(c.get("match_subset", "?")) for c in configs})
    note = (f"LEGACY re-analysis: family ({len(entries)} entries), order ({order if isinstance(order, str) else 'sequence'}) "
            f"and damage margin (±{damage_margin_rel:g}) stated after the data, not in the runs' configs; controls' "
            f"strengths were tuned on the first {'/'.join(subsets)} analysed windows (in sample)")  # fmt: skip
    return fam, note


def reanalyse_committed(
    runs: Sequence[tuple[str | Path, str | Path]], *, damage_margin_rel: float = DEFAULT_DAMAGE_MARGIN_REL,
    order: str | Sequence[str] = "holm", n_boot: int = 10_000, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Committed causal runs (``(rows_csv, config_json)`` per model × layer group) through the v2 rule.

    The runs form ONE family. A config with ``claim_family`` supplies it (:meth:`Family.from_config`,
    the same for every run); otherwise :func:`legacy_family` builds it and every verdict's label
    says so (margin default: docs/method.md §8's ±10 %).

    Returns:
        dict with ``family`` (:class:`Family`), ``note`` (legacy note or ""), ``units``
        (:func:`~posgen_tl.stats.curves.document_units`), ``summary`` (per condition, descriptive),
        ``per_fraction`` (:func:`tolerance_contrasts`, every contrast × AUC / per-fraction ΔNLL /
        slope), ``verdicts``, ``components``, ``damage``, ``adjusted`` (:func:`causal_verdict`) and
        ``interactions`` (:func:`interaction_contrast` of destroy − none between the layer groups
        of one model, where they share their documents).
    """
    read = [_read_run(r, c) for r, c in runs]
    rows = pd.concat([r for r, _ in read], ignore_index=True)
    cfgs = [c for _, c in read]
    declared = [c.get("claim_family") for c in cfgs]
    if any(d is not None for d in declared):
        if any(d != declared[0] for d in declared):
            raise ValueError("the runs declare different claim families: one family per claim")
        family, note = Family.from_config(declared[0]), ""
    else:
        family, note = legacy_family(cfgs, damage_margin_rel=damage_margin_rel, order=order)
    units = document_units(rows, by=("model", "layers", "condition"))
    verdict = causal_verdict(units, family, draws=control_draws(rows), n_boot=n_boot, seed=seed, note=note)
    inter = []
    ent = list(family.entries)
    for i, e1 in enumerate(ent):
        for e2 in ent[i + 1:]:
            if e1.model == e2.model:
                try:
                    inter.append(interaction_contrast(units, {"model": e1.model, "layers": e1.layers},
                                                      {"model": e2.model, "layers": e2.layers}, n_boot=n_boot, seed=seed))
                except ValueError as err:  # not on the same documents: no paired interaction exists
                    inter.append(pd.DataFrame([dict(first=e1.key, second=e2.key, label=f"not testable: {err}")]))
    return dict(family=family, note=note, units=units,
                summary=unit_summary(units, by=("model", "layers", "condition"), n_boot=n_boot, seed=seed),
                per_fraction=tolerance_contrasts(units, family_size=len(ent), alpha=family.alpha, n_boot=n_boot, seed=seed),
                verdicts=verdict.verdicts, components=verdict.components, damage=verdict.damage,
                adjusted=verdict.adjusted, interactions=pd.concat(inter, ignore_index=True) if inter else pd.DataFrame())  # fmt: skip
