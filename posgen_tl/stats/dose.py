"""Causal verdicts v3: dose–response curves compared at COMMON damage (docs/method.md §5, §8).

Every condition (destroy and each control) runs at a grid of strengths α (α = 0 included, where every
condition is the unedited model). Per document, condition and strength the run measures the DAMAGE (the
increase of the clean NLL of the untouched target) and the TOLERANCE LOSS (e.g. the area under the
ΔNLL-over-swap-fraction curve). A control is compared with destroy only where both did the SAME damage:

1. per document and condition, tolerance is read off its dose curve at each common damage level L
   (levels declared before the run) — by interpolation only: the curve's damages (made nondecreasing in
   α by isotonic regression) must bracket L, otherwise the document does not contribute at L;
2. per document, destroy − control is averaged over the levels both curves bracket; the estimate is the
   mean over documents, its p an exact sign-flip over documents, its interval a document bootstrap;
3. a control that brackets the levels for fewer than ``min_coverage`` (75 %) of the documents is
   UNREACHABLE and the entry is "not testable" — never dropped, never extrapolated;
4. destroy − none is the mean over the same levels of destroy's tolerance there minus the unedited
   model's (α = 0); a control whose own tolerance at the levels differs from none's in the direction
   OPPOSITE to destroy's (p < α) would inflate destroy − control by itself: the entry is "not testable";
5. "depends" = an intersection–union test: destroy − none and destroy − every control all reject at α,
   in the same direction; its p is the largest of them. Otherwise "not detected", with the minimum
   detectable effect of the WHOLE intersection–union test (:func:`iut_mde`).

No regression across documents, no matched single strength: a document's damage never enters its own
tolerance contrast (the v2 adjustment was coupled to the outcome and its slope was negative in every
row). :func:`dose_verdict` is the only place the v3 verdict word is decided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import optimize

from posgen_tl.stats.curves import doc_bootstrap
from posgen_tl.stats.inference import check_alpha, sign_flip, t_test_power

__all__ = ["DoseDesign", "isotonic", "tolerance_at", "curves_at_levels", "damage_curves", "common_damage_contrasts",
           "dose_verdict", "iut_mde", "VERDICTS"]

#: the verdict words of :func:`dose_verdict`
VERDICTS = ("depends", "not detected", "not testable")


@dataclass(frozen=True)
class DoseDesign:
    """What is declared before a dose–response run: the common damage levels (nats), the level α of every
    test, the coverage a control must reach, and which conditions are the intervention and the baseline."""

    levels: tuple[float, ...]
    alpha: float = 0.05
    min_coverage: float = 0.75
    intervention: str = "destroy"
    baseline: str = "none"
    interpolation: str = "linear"
    n_boot: int = 10_000
    seed: int = 0
    controls: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        lv = np.asarray(self.levels, dtype=float)
        if lv.size == 0 or not np.all(np.isfinite(lv)) or np.any(lv <= 0):
            raise ValueError(f"levels must be positive finite damages (nats), got {self.levels!r}")
        if not 0 < self.min_coverage <= 1:
            raise ValueError(f"min_coverage must be in (0, 1], got {self.min_coverage}")
        if self.interpolation not in ("linear", "pchip"):
            raise ValueError(f"interpolation must be 'linear' or 'pchip', got {self.interpolation!r}")


def isotonic(y: Any) -> np.ndarray:
    """The nondecreasing least-squares fit to ``y`` (pool-adjacent-violators), in the given order."""
    v = [float(x) for x in np.asarray(y, dtype=float)]
    blocks: list[list[float]] = []  # [mean, weight]
    for x in v:
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2 = blocks.pop()
            m1, w1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
    return np.concatenate([np.full(int(w), m) for m, w in blocks]) if blocks else np.zeros(0)


def tolerance_at(damage: Any, tolerance: Any, levels: Any, *, interpolation: str = "linear") -> np.ndarray:
    """Tolerance read off ONE dose curve at each damage level, by interpolation only.

    ``damage``/``tolerance``: the curve's points in the order of increasing strength (α = 0 first). The
    damages are made nondecreasing in strength (:func:`isotonic`); points of equal damage are averaged.
    A level outside ``[min damage, max damage]`` gives NaN (the curve does not bracket it).

    Returns:
        ``float64 [K]`` — one value per level (NaN where not bracketed)."""
    d = isotonic(damage)
    t = np.asarray(tolerance, dtype=float)
    lv = np.asarray(levels, dtype=float)
    if d.shape != t.shape or d.ndim != 1:
        raise ValueError(f"damage and tolerance must be 1-D of one length, got {np.shape(damage)}, {np.shape(tolerance)}")
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(t))):
        raise ValueError("a dose curve holds NaN/inf damage or tolerance")
    ud, inv = np.unique(d, return_inverse=True)
    ut = np.bincount(inv, weights=t) / np.bincount(inv)
    out = np.full(lv.shape, np.nan)
    inside = (lv >= ud[0]) & (lv <= ud[-1])
    if ud.size == 1:
        out[inside] = ut[0]
        return out
    if interpolation == "pchip":
        from scipy.interpolate import PchipInterpolator  # noqa: PLC0415

        out[inside] = PchipInterpolator(ud, ut, extrapolate=False)(lv[inside])
    else:
        out[inside] = np.interp(lv[inside], ud, ut)
    return out


def curves_at_levels(rows: pd.DataFrame, levels: Sequence[float] | np.ndarray, *, interpolation: str = "linear") -> pd.DataFrame:
    """Every (document, condition) dose curve read at the levels.

    ``rows``: one row per document × condition × strength with columns ``doc, condition, alpha, damage,
    tolerance`` (a condition's α = 0 row is the unedited model: damage 0). Returns one row per document ×
    condition × level: ``doc, condition, level, tolerance`` (NaN where the curve does not bracket it).

    Raises:
        ValueError: a missing column, a duplicated (doc, condition, alpha), or a non-finite value."""
    need = {"doc", "condition", "alpha", "damage", "tolerance"}
    if not need <= set(rows.columns):
        raise ValueError(f"dose rows need columns {sorted(need)}; missing {sorted(need - set(rows.columns))}")
    if rows.duplicated(["doc", "condition", "alpha"]).any():
        raise ValueError("dose rows hold a (doc, condition, alpha) twice: average the sequences of a document first")
    lv = np.asarray(levels, float)
    srt = rows.sort_values(["doc", "condition", "alpha"], kind="mergesort")
    dmg, tol = srt["damage"].to_numpy(float), srt["tolerance"].to_numpy(float)
    keys = srt[["doc", "condition"]].to_numpy()
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
    ends = np.r_[starts[1:], len(srt)]
    vals = [tolerance_at(dmg[a:b], tol[a:b], lv, interpolation=interpolation) for a, b in zip(starts, ends)]
    k = lv.size
    return pd.DataFrame({"doc": np.repeat(keys[starts, 0], k), "condition": np.repeat(keys[starts, 1], k),
                         "level": np.tile(lv, len(starts)), "tolerance": np.concatenate(vals) if vals else []})



def damage_curves(u: pd.DataFrame, levels: Sequence[float], *, points: int = 24, seed: int = 0) -> pd.DataFrame:
    """The dose–response figure's data for one entry's units ``u`` (:func:`posgen_tl.engine.dose.dose_units`):
    each condition's tolerance read at ``points`` damages from 0 to the largest declared level × 2, averaged over
    the documents whose curve brackets the damage, with a 95 % document-bootstrap band and the coverage; the
    unedited model (``none``) is the one row at damage 0. Columns: ``condition, damage, tolerance, ci_low,
    ci_high, n_docs, coverage``."""
    top = 2.0 * max(levels)
    grid = np.linspace(top / points, top, points)
    at = curves_at_levels(u, grid)
    n = u["doc"].nunique()
    zero = u[u["alpha"] == 0].groupby("doc")["tolerance"].mean().to_numpy(float)
    lo0, hi0 = doc_bootstrap(zero, n_boot=2000, seed=seed)
    out = [dict(condition="none", damage=0.0, tolerance=float(zero.mean()), ci_low=float(np.ravel(lo0)[0]),
                ci_high=float(np.ravel(hi0)[0]), n_docs=int(zero.size), coverage=1.0)]
    for (cond, lv), g in at.groupby(["condition", "level"], sort=True):
        x = g["tolerance"].dropna().to_numpy(float)
        lo, hi = doc_bootstrap(x, n_boot=2000, seed=seed) if x.size >= 3 else (np.array([np.nan]), np.array([np.nan]))
        out.append(dict(condition=cond, damage=float(lv), tolerance=float(x.mean()) if x.size else np.nan,
                        ci_low=float(np.ravel(lo)[0]), ci_high=float(np.ravel(hi)[0]), n_docs=int(x.size),
                        coverage=x.size / n))
    return pd.DataFrame(out)

def _unedited(rows: pd.DataFrame) -> pd.Series:
    """Per document, the unedited model's tolerance (the α = 0 rows, equal across conditions)."""
    zero = rows[rows["alpha"] == 0]
    if zero.empty:
        raise ValueError("dose rows need the α = 0 point (the unedited model) of every document")
    return zero.groupby("doc")["tolerance"].mean()


def _row(name: str, per_doc: pd.Series, coverage: np.ndarray, design: DoseDesign, levels: np.ndarray) -> dict:
    x = per_doc.dropna().to_numpy(float)
    row = dict(contrast=name, n_docs=int(x.size), coverage_min=float(np.min(coverage)) if coverage.size else np.nan,
               coverage=";".join(f"{lv:g}:{c:.2f}" for lv, c in zip(levels, coverage)))
    if x.size < 3:
        return dict(row, estimate=float(np.mean(x)) if x.size else np.nan, ci_low=np.nan, ci_high=np.nan,
                    p=np.nan, p_kind="fewer than 3 documents bracket the levels", sd=np.nan)
    p, kind = sign_flip(x, seed=design.seed)
    lo, hi = doc_bootstrap(x, n_boot=design.n_boot, seed=design.seed)
    return dict(row, estimate=float(x.mean()), ci_low=float(lo[0]), ci_high=float(hi[0]), p=float(p), p_kind=kind,
                sd=float(x.std(ddof=1)))


def common_damage_contrasts(rows: pd.DataFrame, design: DoseDesign) -> pd.DataFrame:
    """The contrasts of one entry (one model × layer group × corpus) at common damage.

    One row per contrast — ``destroy − none``, ``destroy − Ck`` for every control, and ``Ck − none`` (does
    the control move tolerance by itself?) — with ``estimate`` (mean over documents of the per-document
    mean over bracketed levels, nats × p), ``ci_low/ci_high`` (document bootstrap, 95 %), ``p`` (exact
    sign-flip over documents, ``p_kind`` its label), ``n_docs`` (documents that bracket at least one level),
    ``coverage`` per level and ``coverage_min`` (fraction of documents whose curves bracket the level),
    ``sd`` (of the per-document values: the pilot's input to :func:`iut_mde`)."""
    levels = np.asarray(design.levels, float)
    at = curves_at_levels(rows, levels, interpolation=design.interpolation)
    wide = at.pivot_table(index=["doc", "level"], columns="condition", values="tolerance", dropna=False)
    base = _unedited(rows)
    iv = design.intervention
    if iv not in wide.columns:
        raise ValueError(f"no {iv!r} rows in the dose rows (conditions: {sorted(wide.columns)})")
    controls = list(design.controls) or sorted(c for c in wide.columns if c not in (iv, design.baseline))
    docs = sorted(rows["doc"].unique())
    n_docs = len(docs)
    base_l = base.reindex(wide.index.get_level_values("doc")).to_numpy()

    def per_doc(diff: pd.Series) -> pd.Series:
        return diff.groupby(level="doc").mean()  # NaN levels skipped; all-NaN → NaN (no contribution)

    def coverage(ok: pd.Series) -> np.ndarray:
        return np.array([ok.xs(lv, level="level").reindex(docs).fillna(False).sum() / n_docs for lv in levels])

    out = []
    d_iv = wide[iv]
    out.append(_row(f"{iv} − {design.baseline}", per_doc(d_iv - base_l), coverage(d_iv.notna()), design, levels))
    for c in controls:
        if c not in wide.columns:
            raise ValueError(f"control {c!r} has no dose rows")
        both = d_iv.notna() & wide[c].notna()
        out.append(_row(f"{iv} − {c}", per_doc((d_iv - wide[c]).where(both)), coverage(both), design, levels))
        out.append(_row(f"{c} − {design.baseline}", per_doc(wide[c] - base_l), coverage(wide[c].notna()), design, levels))
    return pd.DataFrame(out)


def iut_mde(sds: Sequence[float], n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The minimum detectable effect of the WHOLE intersection–union test: the smallest common true effect
    δ at which all its contrasts (per-document sds ``sds``, ``n`` documents, two-sided paired t-tests at
    ``alpha``) reject together with probability ``power``, taking their rejections as independent — a
    conservative bound (positively correlated contrasts reject together more often), always at least the
    largest single-contrast MDE."""
    check_alpha(alpha)
    s = [float(x) for x in sds]
    if n < 2 or not s or not all(np.isfinite(s)) or min(s) < 0:
        raise ValueError(f"iut_mde needs n ≥ 2 and finite sds ≥ 0, got n={n}, sds={sds}")
    if max(s) == 0:
        return 0.0

    def joint(delta: float) -> float:
        return math.prod(t_test_power(delta, sd, n, alpha) if sd > 0 else 1.0 for sd in s)

    hi = max(s)
    while joint(hi) < power:
        hi *= 2.0
    return float(optimize.brentq(lambda x: joint(x) - power, 0.0, hi, xtol=1e-12 * hi, rtol=1e-10))


def dose_verdict(contrasts: pd.DataFrame, design: DoseDesign) -> dict[str, Any]:
    """The v3 verdict of one entry from :func:`common_damage_contrasts`.

    Returns a dict: ``verdict`` (one of :data:`VERDICTS`), ``reason`` (one sentence), ``p_iut`` (the largest
    of the required p's, NaN when not testable), ``direction`` (+1/−1: sign of destroy − none),
    ``binding`` (the contrast whose p is ``p_iut``), ``mde_iut`` (:func:`iut_mde` from the required
    contrasts' per-document sds and the smallest n; NaN if not computable), ``required`` (the contrasts
    the test needs) and ``unreachable`` / ``self_moving`` (the controls that made the entry not testable)."""
    iv, base, a = design.intervention, design.baseline, design.alpha
    by = contrasts.set_index("contrast")
    main = by.loc[f"{iv} − {base}"]
    controls = [c.split(" − ", 1)[1] for c in by.index if c.startswith(f"{iv} − ") and c != f"{iv} − {base}"]
    required = [f"{iv} − {base}", *(f"{iv} − {c}" for c in controls)]
    out: dict[str, Any] = dict(required=required, unreachable=[], self_moving=[], p_iut=np.nan, binding="",
                               direction=int(np.sign(main["estimate"])) if np.isfinite(main["estimate"]) else 0,
                               mde_iut=np.nan)
    sds = [float(by.loc[r, "sd"]) for r in required]
    ns = [int(by.loc[r, "n_docs"]) for r in required]
    if all(np.isfinite(sds)) and min(ns) >= 2:
        out["mde_iut"] = iut_mde(sds, min(ns), alpha=a)
    unreachable = [c for c in controls if not by.loc[f"{iv} − {c}", "coverage_min"] >= design.min_coverage]
    if not main["coverage_min"] >= design.min_coverage:  # NaN (no document at all) included
        unreachable.insert(0, iv)
    if unreachable:
        cov = ", ".join(f"{c} ({by.loc[f'{iv} − {c}' if c != iv else f'{iv} − {base}', 'coverage_min']:.0%})"
                        for c in unreachable)
        return dict(out, verdict="not testable", unreachable=unreachable,
                    reason=f"unreachable at the declared damage levels: {cov} of documents bracket every level "
                           f"(needs {design.min_coverage:.0%}); no control is dropped or extrapolated")
    s0 = out["direction"]
    moving = [c for c in controls if by.loc[f"{c} − {base}", "p"] < a and np.sign(by.loc[f"{c} − {base}", "estimate"]) == -s0]
    if moving:
        return dict(out, verdict="not testable", self_moving=moving,
                    reason=f"{', '.join(moving)} move(s) tolerance by themselves opposite to {iv} (p < {a:g}): "
                           f"{iv} − control would be inflated by the control's own effect")
    ps = [float(by.loc[r, "p"]) for r in required]
    if not all(np.isfinite(ps)):
        return dict(out, verdict="not testable", reason="fewer than 3 documents bracket the levels for a contrast")
    k = int(np.argmax(ps))
    out.update(p_iut=ps[k], binding=required[k])
    same = all(np.sign(by.loc[r, "estimate"]) == s0 for r in required) and s0 != 0
    if same and ps[k] < a:
        return dict(out, verdict="depends",
                    reason=f"{iv} − {base} and {iv} − every control at common damage reject at {a:g} in one "
                           f"direction (largest p {ps[k]:.3g}, {required[k]})")
    why = (f"largest p {ps[k]:.3g} ({required[k]})" if same else "the contrasts do not share one direction")
    mde = out["mde_iut"]
    return dict(out, verdict="not detected",
                reason=f"{why}; the intersection–union test's MDE is {mde:.3g} nats × p" if np.isfinite(mde) else why)
