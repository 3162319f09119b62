"""The pilot of the causal dose–response test (docs/method.md §8 v3): run on REFERENCE windows only, before the
analysed documents are looked at, it tunes every control's strength to destroy's damage, lays out each condition's
grid of strengths, and declares the common damage levels and the per-document spread from which the power of the
whole test is planned (:func:`needed_n`).

``cfg`` is the causal experiment's Config (:class:`posgen_tl.experiments.causal.Config`): the pilot reads its
``batch_size``, ``seed``, ``target()``, ``match_steps``, ``relative``, ``fracs``, ``seeds``, ``levels``,
``test_alpha`` and ``min_coverage``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from posgen_tl.engine.conditions import Condition, edit_hooks, first_edited, match_alpha
from posgen_tl.engine.dose import dose_batches, dose_units, strength_grid
from posgen_tl.engine.swaps import nll_on_target
from posgen_tl.hooks.chunked import forward_chunk
from posgen_tl.hooks.edits import intervention_hooks
from posgen_tl.hooks.reentry import recorded, resid_hooks
from posgen_tl.io.sampling import Windows
from posgen_tl.stats.dose import DoseDesign, common_damage_contrasts, iut_mde

__all__ = ["Pilot", "PilotKeeper", "pilot", "needed_n", "design", "required", "STRENGTH_CAP", "DEFAULT_CAP"]

#: the largest strength a condition's grid may reach, by edit kind (a rephase beyond 1 wraps around)
STRENGTH_CAP = {"rephase": 1.0}
DEFAULT_CAP = 32.0


@dataclass(frozen=True)
class Pilot:
    """What the pilot on the reference windows declares before the analysed documents are looked at.

    Attributes:
        grids: per entry (``layers``) × condition: ``tuned`` (its strength at destroy's damage), ``reached``
            (the tuning found destroy's damage below the cap), ``reference_damage`` (its damage there),
            ``destroy_damage``, ``cap`` and ``strengths`` (the grid, α = 0 first, ``;``-joined).
        units: the pilot's dose units (:func:`posgen_tl.engine.dose.dose_units`).
        levels: per entry, the common damage levels (nats).
        sds: per entry, the per-document sd of every required contrast on the pilot (nats × p).
        seconds_per_window: wall seconds of the pilot's dose rows per window (all entries, the whole grid).
    """

    grids: pd.DataFrame
    units: pd.DataFrame
    levels: dict[str, tuple[float, ...]]
    sds: dict[str, dict[str, float]]
    seconds_per_window: float

    def strengths(self) -> dict[tuple[str, str], tuple[float, ...]]:
        """``{(entry, condition): grid}``."""
        return {(r.layers, r.condition): tuple(float(x) for x in str(r.strengths).split(";"))
                for r in self.grids.itertuples()}

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (:meth:`from_dict` inverts it)."""
        return dict(grids=self.grids.to_dict("records"), units=self.units.to_dict("records"),
                    levels={k: list(v) for k, v in self.levels.items()}, sds=self.sds,
                    seconds_per_window=self.seconds_per_window)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pilot:
        return cls(pd.DataFrame(d["grids"]), pd.DataFrame(d["units"]),
                   {k: tuple(float(x) for x in v) for k, v in d["levels"].items()},
                   {k: {c: float(s) for c, s in v.items()} for k, v in d["sds"].items()}, float(d["seconds_per_window"]))


def _cap(c: Condition) -> float:
    return STRENGTH_CAP.get(c.kind, DEFAULT_CAP)


def _mean_damage(model: Any, cond: Condition, ref: Windows, ref_base: torch.Tensor, km: dict, cfg: Any,
                 prefix: Mapping[int, torch.Tensor]) -> float:
    """Mean clean-NLL damage of ``cond`` on the reference windows (random controls drawn per document), each
    pass resumed at the condition's first edited layer from ``prefix`` (the unedited residuals there; a pass with
    none recorded there runs from the start, in chunks beyond 2 048 tokens)."""
    out = []
    start = first_edited(cond)
    for s in range(0, len(ref), cfg.batch_size):
        e = min(s + cfg.batch_size, len(ref))
        w = ref.subset(range(s, e))
        cd = cond.for_documents(w.doc_ids.tolist(), cfg.seed, True)
        if cd.intervention is None:
            raise ValueError("the unedited condition has no damage to tune")
        out.append(nll_on_target(model, w.tokens, target_len=cfg.target(), batch_size=len(w),
                                 fwd_hooks=intervention_hooks(model, cd.intervention, km),
                                 resid_at=None if start is None or start not in prefix else (start, prefix[start][s:e])))
    return float((torch.cat(out) - ref_base).mean())


def _tune(model: Any, conds: list[Condition], ref: Windows, ref_base: torch.Tensor, km: dict, cfg: Any,
          progress: bool, prefix: Mapping[int, torch.Tensor]) -> list[dict[str, Any]]:
    """Each condition's tuned strength: destroy's is ``cfg.alpha``; a control's brings its mean damage on the
    reference windows to destroy's (:func:`posgen_tl.engine.conditions.match_alpha`)."""
    target = _mean_damage(model, conds[0], ref, ref_base, km, cfg, prefix)
    rows = [dict(layers=conds[0].group, condition="destroy", tuned=conds[0].alpha, reached=True,
                 reference_damage=target, destroy_damage=target, cap=_cap(conds[0]))]
    for c in conds[1:]:
        def damage(a: float, c: Condition = c) -> float:
            return _mean_damage(model, c.with_alpha(a), ref, ref_base, km, cfg, prefix)

        m = match_alpha(damage, target, start=c.alpha, alpha_max=_cap(c), max_steps=cfg.match_steps)
        rows.append(dict(layers=c.group, condition=c.key, tuned=m["alpha"], reached=m["reached"],
                         reference_damage=m["damage"], destroy_damage=target, cap=_cap(c)))
        if progress:
            miss = "" if m["reached"] else f" — destroy's damage not reached in {m['n_evals']} evaluations (α ≤ {_cap(c):g})"
            tqdm.write(f"[causal] pilot {c.group} {c.key}: tuned α={m['alpha']:.4g}, damage {m['damage']:.4g} "
                       f"(destroy {target:.4g}){miss}")
    return rows


def needed_n(sds: Sequence[float], effect: float, *, alpha: float, power: float = 0.8, n_max: int = 100_000) -> int | None:
    """The smallest number of documents at which :func:`posgen_tl.stats.dose.iut_mde` is at most ``effect``
    (``None`` when even ``n_max`` is not enough or the sds are unusable)."""
    s = [float(x) for x in sds]
    if not s or not all(np.isfinite(s)):
        return None
    if iut_mde(s, n_max, alpha=alpha, power=power) > effect:
        return None
    lo, hi = 2, n_max
    while lo < hi:
        mid = (lo + hi) // 2
        if iut_mde(s, mid, alpha=alpha, power=power) <= effect:
            hi = mid
        else:
            lo = mid + 1
    return lo


def design(levels: Sequence[float], cfg: Any, controls: Sequence[str]) -> DoseDesign:
    """The declared design of one entry's contrasts: its levels, the test's α, the coverage rule, its controls."""
    return DoseDesign(levels=tuple(float(x) for x in levels), alpha=cfg.test_alpha, min_coverage=cfg.min_coverage,
                      controls=tuple(controls), seed=cfg.seed)


def required(contrasts: pd.DataFrame, controls: Sequence[str]) -> pd.DataFrame:
    """The rows of the contrasts the intersection–union test needs: destroy − none and destroy − every control."""
    want = ["destroy − none", *(f"destroy − {c}" for c in controls)]
    return contrasts.set_index("contrast").loc[want]


class PilotKeeper(Protocol):
    """Where an interrupted pilot keeps what it finished (the causal run's checkpoint folder): the tuned strengths,
    then the dose rows of each batch of reference windows with the seconds they took."""

    def tuned(self) -> list[dict[str, Any]] | None: ...

    def save_tuned(self, rows: list[dict[str, Any]]) -> None: ...

    def ref_batch(self, b0: int) -> tuple[pd.DataFrame, float] | None: ...

    def save_ref_batch(self, b0: int, rows: pd.DataFrame, seconds: float) -> None: ...


def pilot(
    model: Any, ref: Windows, k_means: dict, conditions: Mapping[str, list[Condition]], cfg: Any, *,
    progress: bool = True, keep: PilotKeeper | None = None,
) -> Pilot:  # fmt: skip
    """The pilot on the REFERENCE windows (never the analysed ones): tuned strengths and grids, the dose rows
    of the grid, the declared levels and the per-document spread of every required contrast.

    ``conditions``: per entry label, ``[destroy, *controls]`` (:func:`posgen_tl.engine.conditions.build_conditions`).
    ``keep``: where the tuning and each batch of the dose rows are kept as they finish; a rerun takes them from
    there (the same numbers: random draws and swaps are per document, not per batch).
    Returns a :class:`Pilot` (with fewer than 3 reference documents its spreads are NaN: no power can be planned,
    and the power table says so; when destroy damages no pilot document and no levels are declared, the entry's
    levels are empty and the entry is "not testable", :data:`NO_LEVELS`)."""
    starts = sorted({s for cs in conditions.values() for c in cs if (s := first_edited(c))})
    if forward_chunk(model, ref.tokens.shape[1], edit_hooks(model, [c for cs in conditions.values() for c in cs],
                                                            k_means)):
        starts = []  # long texts: every pass in chunks through the cache (none resumed from a recorded residual)
    store: dict[int, list[torch.Tensor]] = {}
    ref_base = nll_on_target(model, ref.tokens, target_len=cfg.target(), batch_size=cfg.batch_size,
                             fwd_hooks=resid_hooks(starts, store))
    prefix = recorded(store)  # the tuning's passes resume at each condition's first edited layer
    rows: list[dict[str, Any]] | None = keep.tuned() if keep is not None else None
    if rows is None:
        rows = []
        for conds in conditions.values():
            rows += _tune(model, conds, ref, ref_base, k_means, cfg, progress, prefix)
        if keep is not None:
            keep.save_tuned(rows)
    grids = pd.DataFrame(rows)
    grids["strengths"] = [";".join(f"{a:.6g}" for a in strength_grid(r.tuned, cfg.relative, alpha_max=r.cap))
                          for r in grids.itertuples()]
    flat = [c for cs in conditions.values() for c in cs]
    strengths = {(r.layers, r.condition): tuple(float(x) for x in r.strengths.split(";")) for r in grids.itertuples()}
    pr, seconds = dose_batches(model, ref, flat, strengths, cfg, k_means=k_means, desc="pilot batches",
                               load=keep.ref_batch if keep is not None else None,
                               save=(lambda b0, rows, s, n: keep.save_ref_batch(b0, rows, s)) if keep is not None else None,
                               progress=progress)
    seconds /= len(ref)
    units = dose_units(pr)
    levels: dict[str, tuple[float, ...]] = {}
    sds: dict[str, dict[str, float]] = {}
    for label, conds in conditions.items():
        u = units[units["layers"] == label]
        d = u[(u["condition"] == "destroy") & np.isclose(u["alpha"], conds[0].alpha)]["damage"].to_numpy(float)
        if cfg.levels:
            lv = tuple(float(x) for x in cfg.levels)
        elif np.any(d > 0):
            lv = tuple(float(x) for x in np.quantile(d[d > 0], [0.25, 0.5, 0.75]))
        else:  # no level can be declared: the entry will be "not testable" (NO_LEVELS says why)
            lv = ()
        levels[label] = lv
        ctl = [c.key for c in conds[1:]]
        if lv:
            con = common_damage_contrasts(u, design(lv, cfg, ctl))
            sds[label] = {k: float(v) for k, v in required(con, ctl)["sd"].items()}
        else:
            sds[label] = {k: float("nan") for k in ["destroy − none", *(f"destroy − {c}" for c in ctl)]}
    return Pilot(grids, units, levels, sds, seconds)
