"""The causal test, version 3 (docs/method.md §5, §8): dose–response curves compared at COMMON damage.

Does position tolerance depend on the fast-band key offset? In each declared layer group (one ENTRY of
the claim) the intervention ``destroy`` and the controls C1–C4 (:data:`posgen_tl.engine.conditions.CONTROLS`)
each run at a GRID of strengths on the same analysed windows and the same swaps; per document, condition
and strength the run measures the damage (clean-NLL increase of the untouched target over the unedited
model) and the tolerance loss (area under ΔNLL over the swap fraction, against the condition's own clean
NLL; the same area against the unedited clean NLL is kept beside it). Destroy and a control are compared
only where both did the same damage, each document's curve interpolated (:mod:`posgen_tl.stats.dose`).

The protocol of one run (:func:`run`):

1. analysed windows and windows of DISJOINT reference documents (:func:`posgen_tl.io.sampling.sample_windows`);
   ``k̄`` from the reference windows' context part;
2. the PILOT, on the reference windows only (:func:`pilot`): each control's strength tuned to destroy's
   damage there (the grid's centre), every condition's grid ``tuned × relative`` (×0.25 … ×4 by default),
   the dose rows of the whole grid, the common damage levels (the quartiles of destroy's per-document
   damage at its tuned strength, unless declared), the per-document spread of every required contrast and
   from it the minimum detectable effect of the whole intersection–union test at the declared n
   (:func:`posgen_tl.stats.dose.iut_mde`, at α / the claim's size) and the n that would reach the smallest
   effect of interest; the seconds per window;
3. every condition at every strength on the analysed windows, batch by batch — with a ``checkpoint``
   folder each finished batch is kept, so an interrupted run continues where it stopped;
4. per entry: the contrasts at common damage, the verdict (:func:`posgen_tl.stats.dose.dose_verdict`),
   the family adjustment over the declared claim, and the tolerance-vs-damage curves of the figure.

:func:`run` returns a frozen :class:`Result` (its tables, config and metadata; no file is written but the
checkpoint), :func:`render` turns a Result into a report section, :func:`save` / :func:`load` keep one in a
folder. No regression across documents and no single matched strength enter the verdict.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from posgen_tl.engine.conditions import CONTROLS, Condition, build_conditions, entry_bands, resolve_groups
from posgen_tl.engine.dose import dose_batches, dose_units
from posgen_tl.engine.pilot import Pilot, needed_n, pilot, required
from posgen_tl.engine.pilot import design as design_of
from posgen_tl.engine.swaps import SwapOptions, windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.edits import key_means
from posgen_tl.io.checkpoint import RunFolder
from posgen_tl.io.sampling import Windows, check_disjoint, sample_windows
from posgen_tl.stats.dose import common_damage_contrasts, damage_curves, dose_verdict, iut_mde
from posgen_tl.stats.familywise import claim_adjust

__all__ = ["NAME", "ABOUT", "NEEDS", "Config", "Pilot", "Result", "pilot", "run", "render", "save", "load",
           "needed_n", "causal_study", "headline", "run_or_skip"]

NAME = "causal"
ABOUT = ("does T1 tolerance depend on the fast-band key offset? destroy and controls C1–C4 as dose–response "
         "curves, compared at common damage (docs/method.md §5, §8 v3)")
NEEDS: tuple[str, ...] = ()
TITLE = "5 · Does tolerance depend on the pattern? Dose–response at common damage (docs/method.md §5, §8)"
#: the tables of a Result, in the order a page shows them
TABLES = ("verdicts", "contrasts", "contrasts_unedited", "power", "grids", "conditions", "curves", "units",
          "pilot_units")
#: the largest strength a grid may reach, per edit kind: rephase turns k̄ by α·φ (α = 1 is a full random
#: rotation); the other edits scale a change and are capped only to stay finite


@dataclass(frozen=True)
class Config(SwapOptions):
    """Options of the dose–response causal test. Everything the verdict depends on — entries, controls,
    grid, levels (or the rule that declares them from the pilot), α, coverage, the claim's family and
    the smallest effect of interest — is fixed here, before the run."""

    NAME: ClassVar[str] = NAME
    fracs: tuple[float, ...] = base.option((0.0, 0.2), "swap fractions p (fraction of disjoint adjacent pairs "
                                           "swapped; must include 0)", "floats", quick=(0.0, 0.2),
                                           full=(0.0, 0.1, 0.2))
    n_ref: int = base.option(8, "windows of the disjoint reference documents: the global k̄ and the pilot "
                                 "(strength grids, damage levels, power)", "int", quick=4, full=16)
    groups: tuple[str, ...] = base.option(("middle",), "layer groups whose keys are edited, one claim entry each: "
                                          "early, middle, late or a range such as 10-19", "names",
                                          full=("middle", "late"))
    controls: tuple[str, ...] = base.option(("C1", "C2"), "controls of docs/method.md §5, from C1,C2,C3,C4 (every one "
                                            "is required by the verdict)", "names", quick=("C1",), full=CONTROLS)
    alpha: float = base.option(0.5, "destroy's tuned strength (each control is tuned to its damage on the pilot)",
                               "float")
    relative: tuple[float, ...] = base.option((0.25, 1.0, 4.0), "each condition's strengths relative to its tuned "
                                              "strength (α = 0 is added)", "floats")
    levels: tuple[float, ...] = base.option((), "common damage levels (nats), declared; empty: the quartiles of "
                                            "destroy's per-document damage at its tuned strength on the pilot "
                                            "(documents it damages)",
                                            "floats")
    effect: float = base.option(0.001, "smallest effect of interest (nats × p): the power target", "float")
    test_alpha: float = base.option(0.05, "level α of the claim (family-wise over the declared claim)", "float")
    min_coverage: float = base.option(0.75, "share of documents whose curves must bracket every level", "float")
    match_steps: int = base.option(3, "damage evaluations per control when tuning its strength on the pilot",
                                   "int", quick=2, full=5)
    claim: tuple[str, ...] = base.option((), "the claim's declared family as model:group entries (this model's may "
                                         "name groups, e.g. middle; other models' need labels, e.g. L6-11); must "
                                         "hold this run's entries; default: this run's entries. Entries of other "
                                         "runs bound the adjustment (Bonferroni)", "names")
    skip: int = base.option(0, "leave out the first SKIP analysed windows of the seeded order (one per document "
                               "first): with the same seed, a new run on documents an earlier run of SKIP windows "
                               "never saw, on the same reference windows", "int")
    batch_size: int = base.batch_option(4)

    def check(self) -> None:
        """Raise ValueError naming the option: fewer than 3 sequences, a target that does not fit, fractions
        without 0 and a p > 0, a grid without a point below and above the tuned strength, levels that are
        not positive, a non-positive effect, α or coverage outside (0, 1)."""
        if self.n_seq < 3:
            raise ValueError(f"{NAME}: n_seq={self.n_seq}: a contrast needs at least 3 documents")
        if self.skip < 0:
            raise ValueError(f"{NAME}: skip={self.skip} must be at least 0")
        if not 0 < self.target() < self.seq_len - 2:
            raise ValueError(f"{NAME}: target_len={self.target()} must be in (0, {self.seq_len - 2})")
        if 0 not in self.fracs or not any(f > 0 for f in self.fracs):
            raise ValueError(f"{NAME}: fracs must include 0 and at least one p > 0, got {list(self.fracs)}")
        rel = [float(r) for r in self.relative]
        if not rel or min(rel) <= 0 or min(rel) >= 1 or max(rel) <= 1 or 1.0 not in rel:
            raise ValueError(f"{NAME}: relative={rel}: the grid needs the tuned strength (1) and strengths below and "
                             "above it")
        if any(not float(x) > 0 for x in self.levels):
            raise ValueError(f"{NAME}: levels must be positive damages in nats, got {list(self.levels)}")
        if not self.effect > 0:
            raise ValueError(f"{NAME}: effect must be a positive smallest effect of interest, got {self.effect}")
        if not 0 < self.test_alpha < 1 or not 0 < self.min_coverage <= 1:
            raise ValueError(f"{NAME}: test_alpha must be in (0, 1) and min_coverage in (0, 1], got "
                             f"{self.test_alpha}, {self.min_coverage}")

    def claim_entries(self, model: str, entries: Sequence[str], n_layers: int) -> tuple[list[str], bool]:
        """The declared family as ``model:L…`` labels and whether this run holds all of it.

        ``claim`` entries of this ``model`` may name groups (``smollm2-135m:middle``) or labels (``…:L10-19``);
        other models' entries must be labels. Default: this run's ``entries``.

        Raises:
            ValueError: an entry without ``model:``, an entry repeated, or one of this run's entries missing
                from the claim (a run may only adjust over a family it belongs to)."""
        mine = [f"{model}:{e}" for e in entries]
        if not self.claim:
            return mine, True
        out: list[str] = []
        for c in self.claim:
            mdl, sep, grp = str(c).partition(":")
            if not sep or not mdl or not grp:
                raise ValueError(f"{NAME}: claim entry {c!r}: expected model:group (e.g. {mine[0]})")
            if mdl == model:
                grp = next(iter(resolve_groups((grp,), n_layers)))
            out.append(f"{mdl}:{grp}")
        if len(set(out)) < len(out):
            raise ValueError(f"{NAME}: the claim names an entry twice: {out}")
        missing = [e for e in mine if e not in out]
        if missing:
            raise ValueError(f"{NAME}: this run's entries {missing} are not in the declared claim {out}")
        return out, set(out) == set(mine)


# ----------------------------------------------------------------------------- pilot


# ----------------------------------------------------------------------------- checkpoint


class _Checkpoint(RunFolder):
    """A folder that keeps a run's pilot — its tuning and each batch of its dose rows as they finish, then the
    whole pilot — and the finished analysed batches.

    Two keys guard it: the PILOT key (the config but ``n_seq``, the model, the reference windows) and the RUN
    key (the whole config and the analysed windows too). Another pilot key is refused (another design); the
    same pilot with another run key (e.g. the n chosen from the pilot's power) keeps the pilot and drops the
    batches."""

    def __init__(self, folder: str | Path, fingerprint: dict[str, Any]):
        super().__init__(folder)
        pilot_fp = {k: v for k, v in fingerprint.items() if k != "analysed"}
        pilot_fp["config"] = {k: v for k, v in fingerprint["config"].items() if k not in ("n_seq", "skip")}
        key = dict(pilot=json.dumps(pilot_fp, sort_keys=True, default=str),
                   run=json.dumps(fingerprint, sort_keys=True, default=str))
        old = self.read_json("fingerprint")
        if old is not None and old.get("pilot") != key["pilot"]:
            raise ValueError(f"{NAME}: the checkpoint {self.dir} belongs to another run (config, model or "
                             "reference windows differ); give a new folder or delete it")
        if old is not None and old.get("run") != key["run"]:
            self.drop("batch_*")
        self.write_json("fingerprint", key)

    def pilot(self) -> Pilot | None:
        d = self.read_json("pilot")
        return None if d is None else Pilot.from_dict(d)

    def save_pilot(self, p: Pilot) -> None:
        """The finished pilot; the unfinished pilot's pieces are dropped."""
        self.write_json("pilot", p.as_dict())
        self.drop("pilot_batch_*", "pilot_tuned.json")

    # the unfinished pilot (engine.pilot.PilotKeeper): its tuning, then each batch of its dose rows

    def tuned(self) -> list[dict[str, Any]] | None:
        return self.read_json("pilot_tuned")

    def save_tuned(self, rows: list[dict[str, Any]]) -> None:
        self.write_json("pilot_tuned", rows)

    def ref_batch(self, b0: int) -> tuple[pd.DataFrame, float] | None:
        rec, rows = self.read_json(f"pilot_batch_{b0:06d}"), self.read_rows(f"pilot_batch_{b0:06d}")
        return None if rec is None or rows is None else (rows, float(rec["seconds"]))

    def save_ref_batch(self, b0: int, rows: pd.DataFrame, seconds: float) -> None:
        self.write_json(f"pilot_batch_{b0:06d}", dict(seconds=seconds))
        self.write_rows(f"pilot_batch_{b0:06d}", rows)

    # the analysed batches

    def batch(self, b0: int) -> pd.DataFrame | None:
        """The rows of a finished batch (its record and its rows both written), else None."""
        return self.read_rows(f"batch_{b0:06d}") if self.has(f"batch_{b0:06d}", suffix=".json") else None

    def save_batch(self, b0: int, rows: pd.DataFrame, meta: dict[str, Any]) -> None:
        """The batch's record (commit, seconds), then its rows: the rows mark the batch finished."""
        self.write_json(f"batch_{b0:06d}", meta, default=str)
        self.write_rows(f"batch_{b0:06d}", rows)

    def batch_meta(self) -> list[dict[str, Any]]:
        return self.records("batch_*")


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``verdicts`` (one row per entry: the verdict, destroy − none's effect/interval/p, the
            intersection–union p and its binding contrast, the family-adjusted p, the MDE at the declared n),
            ``contrasts`` / ``contrasts_unedited`` (:func:`posgen_tl.stats.dose.common_damage_contrasts` per
            entry, tolerance against the edited / the unedited clean NLL), ``power`` (per entry: the pilot's
            MDE at this n, ``n_needed`` the n that reaches ``effect`` — NaN when none up to 100 000 does), ``grids`` (the pilot's strengths), ``curves``
            ``conditions`` (per entry × condition × strength: documents, mean damage, mean attention KL in the
            edited layers, mean tolerance and its sd over documents), ``curves``
            (per entry × condition × damage: mean tolerance over the documents that bracket it, 95 %
            document-bootstrap band, coverage — the figure's data), ``units`` (per entry × document ×
            condition × strength: damage and both tolerances) and ``pilot_units``.
        config: the Config's options (``Config.as_dict``).
        meta: model, windows' fingerprint, documents, levels, wall times, the commits of the batches.
    """


#: the columns of a contrasts table (:func:`posgen_tl.stats.dose.common_damage_contrasts`, with the entry)
CONTRAST_COLUMNS = ["contrast", "n_docs", "coverage_min", "coverage", "estimate", "ci_low", "ci_high", "p", "p_kind",
                    "sd", "layers"]
#: why an entry without levels is not testable
NO_LEVELS = ("destroy did no damage to any pilot document at its tuned strength, so no common damage level could be "
             "declared; declare levels or raise alpha")


def _entry_tables(label: str, u: pd.DataFrame, levels: Sequence[float], controls: Sequence[str], cfg: Config,
                  m: int) -> tuple[dict[str, Any], pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    if not levels:
        row = dict(layers=label, verdict="not testable", estimate=np.nan, ci_low=np.nan, ci_high=np.nan, p=np.nan,
                   p_iut=np.nan, p_test=np.nan, iut_rejects=False, binding="", mde=np.nan, mde_n=0,
                   n_docs=int(u["doc"].nunique()), levels="", reason=NO_LEVELS, unreachable="", self_moving="")
        empty = pd.DataFrame(columns=CONTRAST_COLUMNS)
        return row, empty, empty.copy(), pd.DataFrame(columns=["condition", "damage", "tolerance", "ci_low",
                                                               "ci_high", "n_docs", "coverage", "layers"])
    design = design_of(levels, cfg, controls)
    con = common_damage_contrasts(u, design)
    con_u = common_damage_contrasts(u.assign(tolerance=u["tolerance_unedited"]), design)
    v = dose_verdict(con, design)
    main = con.set_index("contrast").loc["destroy − none"]
    req = required(con, controls)
    sds = req["sd"].to_numpy(float)
    n = int(req["n_docs"].min())
    mde = iut_mde(sds, n, alpha=cfg.test_alpha / m) if np.all(np.isfinite(sds)) and n >= 2 else np.nan
    # the p that enters the family: the intersection–union p only where every required contrast points the way
    # destroy − none does (a test that cannot say "depends" must not take a small p into Holm's ranking)
    same = v["direction"] != 0 and all(np.sign(x) == v["direction"] for x in req["estimate"])
    p_test = v["p_iut"] if (same or not np.isfinite(v["p_iut"])) else 1.0
    reason = str(v["reason"])
    if v["verdict"] == "not detected":
        reason = reason.split("; the intersection–union test's MDE")[0] + (
            f"; the whole test's MDE at α/{m} is {mde:.3g} nats × p with n = {n}" if np.isfinite(mde) else "")
    row = dict(layers=label, verdict=v["verdict"], estimate=main["estimate"], ci_low=main["ci_low"],
               ci_high=main["ci_high"], p=main["p"], p_iut=v["p_iut"], p_test=p_test,
               iut_rejects=v["verdict"] == "depends", binding=v["binding"], mde=mde, mde_n=n,
               n_docs=int(u["doc"].nunique()), levels=";".join(f"{x:.4g}" for x in levels), reason=reason,
               unreachable=",".join(v["unreachable"]), self_moving=",".join(v["self_moving"]))
    return row, con.assign(layers=label), con_u.assign(layers=label), damage_curves(u, levels, seed=cfg.seed).assign(layers=label)


def _verdicts(rows: list[dict[str, Any]], cfg: Config, m: int) -> pd.DataFrame:
    v = pd.DataFrame(rows)
    adj, how = claim_adjust(v["p_test"].to_numpy(float), m)
    v["p_family"], v["p_family_method"] = adj, how
    demote = (v["verdict"] == "depends") & ~(v["p_family"] < cfg.test_alpha)
    v.loc[demote, "reason"] = v.loc[demote, "reason"] + f"; not below α = {cfg.test_alpha:g} after the adjustment ({how})"
    v.loc[demote, "verdict"] = "not detected"
    return v


def _fingerprint(cfg: Config, model_name: str, ana: Windows, ref: Windows) -> dict[str, Any]:
    return dict(config=cfg.as_dict(), model=model_name, analysed=windows_fingerprint(ana),
                reference=windows_fingerprint(ref))


@base.shares_heap
def run(
    model: Any, cfg: Config | None = None, *, corpus: Any = None, windows: tuple[Windows, Windows] | None = None,
    checkpoint: str | Path | None = None, progress: bool = True, **options: Any,
) -> Result:  # fmt: skip
    """The dose–response causal test on ``model`` (steps in the module's docstring).

    Args:
        cfg: :class:`Config` (default ``Config()``) with ``options`` applied.
        corpus: the documents (default ``cfg.corpus``, the pydoc topics when that is ``None``).
        windows: pre-built ``(analysed, reference)`` windows from disjoint documents.
        checkpoint: a folder that keeps the pilot and every finished batch; a rerun with the same config,
            model and windows continues from it (another run's folder is refused).

    Returns:
        :class:`Result`.

    Raises:
        UncheckedModelError: the model has not passed the exactness check (the gate).
        ValueError: bad options (named), overlapping reference and analysed documents, a foreign checkpoint.
    """
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.io.provenance import git_commit  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    cfg.check()
    base.gate(model, cfg, f"the {NAME} study")
    t_start, commit = time.time(), git_commit(short=True)
    spec, _ = probe_hooks(model)
    entries = resolve_groups(cfg.groups, spec.n_layers)
    claim, whole = cfg.claim_entries(spec.model_name, list(entries), spec.n_layers)  # before any work
    ana, ref = windows if windows is not None else _sampled(model, cfg, corpus)
    check_disjoint(ana, ref)
    ck = None if checkpoint is None else _Checkpoint(checkpoint, _fingerprint(cfg, spec.model_name, ana, ref))
    layers = sorted({x for g in entries.values() for x in g})
    km = key_means(model, ref.tokens[:, : ref.tokens.shape[1] - cfg.target()], layers, batch_size=cfg.batch_size)
    conditions, bands = _conditions(spec, entries, cfg)
    t0 = time.time()
    plan = ck.pilot() if ck is not None else None
    if plan is None:
        plan = pilot(model, ref, km, conditions, cfg, progress=progress, keep=ck)
        if ck is not None:
            ck.save_pilot(plan)
    pilot_s, t0 = time.time() - t0, time.time()
    rows = _passes(model, ana, [c for cs in conditions.values() for c in cs], plan.strengths(), km, cfg, ck, commit,
                   progress)
    passes_s = time.time() - t0
    units = dose_units(rows)
    m = len(claim)
    vrows, cons, cons_u, curves, power = [], [], [], [], []
    for label, conds in conditions.items():
        ctl = [c.key for c in conds[1:]]
        row, con, con_u, cur = _entry_tables(label, units[units["layers"] == label], plan.levels[label], ctl, cfg, m)
        vrows.append(row)
        cons.append(con)
        cons_u.append(con_u)
        curves.append(cur)
        power.append(_power_row(label, plan, ana.n_docs, cfg, m))
    summary = (units.groupby(["layers", "condition", "alpha"], sort=True)
               .agg(n_docs=("doc", "nunique"), damage=("damage", "mean"), attn_kl=("attn_kl", "mean"),
                    tolerance=("tolerance", "mean"), tolerance_sd=("tolerance", "std")).reset_index())
    pw = pd.DataFrame(power)
    pw["powered"] = pw["pilot_mde"] <= pw["effect"]
    batches: list[dict[str, Any]] = ck.batch_meta() if ck is not None else [dict(commit=commit)]
    meta = dict(model=spec.model_name, claim=claim, n_seq=len(ana), n_docs=ana.n_docs, n_ref=len(ref), ref_docs=ref.n_docs,
                windows_sha1=windows_fingerprint(ana), entries=bands, target_len=cfg.target(),
                levels={k: list(v) for k, v in plan.levels.items()}, family=m,
                commits=sorted({b.get("commit") or "" for b in batches}), commit=commit,
                seconds_per_window_pilot=plan.seconds_per_window,
                wall_s=dict(pilot_s=pilot_s, passes_s=passes_s, total_s=time.time() - t_start,
                            batches_s=float(sum(b.get("seconds", 0.0) for b in batches))))
    tables = dict(verdicts=_verdicts(vrows, cfg, m), contrasts=pd.concat(cons, ignore_index=True),
                  contrasts_unedited=pd.concat(cons_u, ignore_index=True), power=pw, grids=plan.grids,
                  conditions=summary,
                  curves=pd.concat(curves, ignore_index=True), units=units, pilot_units=plan.units)
    return Result(tables, cfg.as_dict(), meta)


def _skipped(cfg: Mapping[str, Any]) -> str:
    """What the page says of ``skip`` (nothing when no window was left out)."""
    k = int(cfg.get("skip", 0) or 0)
    return f" (the first {k} windows of the seeded order left out: the documents of an earlier run)" if k else ""


def _sampled(model: Any, cfg: Config, corpus: Any) -> tuple[Windows, Windows]:
    """The analysed and reference windows of ``cfg`` (disjoint documents) from ``corpus`` (default ``cfg.corpus``)."""
    ana, ref = sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=cfg.seq_len,
                              n_ref=cfg.n_ref, seed=cfg.seed, skip=cfg.skip)
    assert ref is not None
    return ana, ref


def _conditions(spec: Any, entries: dict[str, list[int]], cfg: Config
                ) -> tuple[dict[str, list[Condition]], dict[str, dict[str, Any]]]:
    """Per entry label: ``[destroy, *controls]`` and its bands (``layers``, ``n_bands``, ``fast``, ``slow``)."""
    conditions: dict[str, list[Condition]] = {}
    bands: dict[str, dict[str, Any]] = {}
    for label, lay in entries.items():
        nb, fast, slow = entry_bands(spec, lay, None, None)
        bands[label] = dict(layers=lay, n_bands=nb, fast=fast, slow=slow)
        conditions[label] = build_conditions(lay, fast, slow, alpha=cfg.alpha, controls=cfg.controls, seed=cfg.seed,
                                             group=label)
    return conditions, bands


def _passes(model: Any, ana: Windows, flat: list[Condition], strengths: dict, km: dict, cfg: Config,
            ck: _Checkpoint | None, commit: str | None, progress: bool) -> pd.DataFrame:
    """The dose rows of every analysed batch (:func:`posgen_tl.engine.dose.dose_batches`), a finished batch taken
    from the checkpoint and each new one saved there."""
    def load(b0: int) -> tuple[pd.DataFrame, float] | None:
        rows = ck.batch(b0) if ck is not None else None
        return None if rows is None else (rows, 0.0)

    def save(b0: int, rows: pd.DataFrame, seconds: float, n: int) -> None:
        if ck is not None:
            ck.save_batch(b0, rows, dict(commit=commit, seconds=seconds, windows=n))

    return dose_batches(model, ana, flat, strengths, cfg, k_means=km, load=load, save=save, desc=f"{NAME} batches",
                        progress=progress)[0]


def _power_row(label: str, plan: Pilot, n: int, cfg: Config, m: int) -> dict[str, Any]:
    """One entry's power: the pilot's minimal detectable effect at ``n`` documents and the documents needed for
    ``cfg.effect``, at the entry's share ``α / m`` of the family."""
    sds = list(plan.sds[label].values())
    ok = bool(sds) and all(np.isfinite(sds)) and n >= 2
    a = cfg.test_alpha / m
    return dict(layers=label, n_docs=n, family=m, alpha_per_entry=a, effect=cfg.effect,
                pilot_mde=iut_mde(sds, n, alpha=a) if ok else np.nan,
                n_needed=float(needed_n(sds, cfg.effect, alpha=a) or np.nan) if ok else np.nan,
                pilot_docs=int(plan.units["doc"].nunique()), **{f"sd {k}": v for k, v in plan.sds[label].items()})


def run_or_skip(model: Any, cfg: Config, **kw: Any) -> Result:
    """:func:`run`, or a Result whose ``meta["skipped"]`` says why when the corpus cannot give the windows or the
    library refuses the model by name (:func:`posgen_tl.experiments.base.run_or_skip`). Any other error propagates."""
    return base.run_or_skip(run, Result, "the causal study", model, cfg, **kw)


def causal_study(model: Any, corpus: Any = None, cfg: Config | None = None, **options: Any) -> Result:
    """The library's name for :func:`run` (``pg.causal_study(model, corpus, **options)``): the dose–response
    causal test. Returns its :class:`Result`."""
    return run(model, cfg, corpus=corpus, **options)


# ----------------------------------------------------------------------------- files


#: text columns whose empty cells read back as "" (not NaN)
TEXT_COLUMNS = ("unreachable", "self_moving", "binding")


def save(result: Result, folder: str | Path) -> list[Path]:
    """:func:`posgen_tl.experiments.registry.save` of this experiment: ``causal_<table>.csv`` per table and
    ``causal_result.json`` (config and meta) in ``folder``. Returns the written paths."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    return registry.save(NAME, result, folder)


def load(folder: str | Path) -> Result:
    """The :class:`Result` :func:`save` wrote into ``folder`` (:func:`posgen_tl.experiments.registry.load`).

    Raises:
        FileNotFoundError: no result of this experiment there."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    return registry.load(NAME, folder)


# ----------------------------------------------------------------------------- render


def _fmt(x: Any) -> str:
    from posgen_tl.report.text import sig3  # noqa: PLC0415

    return sig3(x)


def headline(v: pd.Series) -> str:
    """One entry's verdict in one sentence, its effect, interval and p from ONE contrast (destroy − none at the
    common damage levels) and the verdict's own p labelled beside it."""
    eff = (f"destroy − none at common damage {_fmt(v['estimate'])} nats × p [{_fmt(v['ci_low'])}, "
           f"{_fmt(v['ci_high'])}], sign-flip p = {_fmt(v['p'])}")
    if v["verdict"] == "depends":
        tail = f"intersection–union p = {_fmt(v['p_iut'])} ({v['binding']}), adjusted {_fmt(v['p_family'])}"
    elif v["verdict"] == "not detected":
        tail = (f"intersection–union p = {_fmt(v['p_iut'])} ({v['binding']}); MDE of the whole test "
                f"{_fmt(v['mde'])} nats × p at n = {int(v['mde_n'])}")
    else:
        tail = str(v["reason"])
    return f"{v['layers']}: {v['verdict']} — {eff}; {tail}"


def _finding(v: pd.Series, contrasts: pd.DataFrame) -> Any:
    """One entry's headline: where the intersection–union test ran, its BINDING contrast (the control, or none,
    with the largest p: the one that decides) — its effect, interval and own p, which is the intersection–union
    p; where it could not run ("not testable"), destroy − none at common damage with the reason. One contrast per
    line: effect, interval and p always belong together."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415

    binding = str(v.get("binding") or "")
    row = contrasts[(contrasts["layers"] == v["layers"]) & (contrasts["contrast"] == binding)] if binding else None
    if row is not None and len(row):
        c = row.iloc[0]
        return Finding("causal", str(v["verdict"]), effect=float(c["estimate"]),
                       what=f"{binding} at common damage (the binding contrast), {v['layers']} (nats × p)",
                       ci=(float(c["ci_low"]), float(c["ci_high"])), p=float(c["p"]), n=int(v["n_docs"]),
                       note=str(v["reason"]),
                       p_kind=f"{_kind(c)}; the largest p of the intersection–union test (so its p), before the "
                              "adjustment over the declared claim")
    dn = contrasts[(contrasts["layers"] == v["layers"]) & (contrasts["contrast"] == "destroy − none")]
    return Finding("causal", str(v["verdict"]), effect=float(v["estimate"]),
                   what=f"destroy − none at common damage, {v['layers']} (nats × p)",
                   ci=(float(v["ci_low"]), float(v["ci_high"])), p=float(v["p"]), n=int(v["n_docs"]),
                   note=str(v["reason"]),
                   p_kind=(_kind(dn.iloc[0]) if len(dn) else "sign-flip over documents") + "; unadjusted, and not the "
                          "test of the claim (the entry is not testable)")


def _kind(row: pd.Series) -> str:
    k = str(row.get("p_kind") or "")
    return k if k and k != "nan" else "sign-flip over documents"


def render(result: Result) -> Any:
    """The report section of a :class:`Result`: the verdict per entry, the tolerance-vs-damage figure per
    entry, the power and the pilot's grids, the contrasts at common damage."""
    from posgen_tl.plot.causal import plot_dose_curves  # noqa: PLC0415
    from posgen_tl.report.html import Section, figure_to_png  # noqa: PLC0415

    t, meta, cfg = result.tables, result.meta, result.config
    if "skipped" in meta:
        from posgen_tl.report.html import skipped_section  # noqa: PLC0415

        return skipped_section(TITLE, meta["skipped"], "causal", meta.get("hint"))
    v = t["verdicts"]
    figs = []
    for label in v["layers"]:
        fig = plot_dose_curves(t["curves"][t["curves"]["layers"] == label], meta["levels"][label],
                               title=f"{meta['model']} {label}: tolerance loss vs damage")
        figs.append((figure_to_png(fig), f"{label}: tolerance loss (AUC of ΔNLL over p, nats × p) against damage (clean-NLL "
                                   "increase, nats), one curve per condition, 95 % document-bootstrap band; dotted: "
                                   "the declared common damage levels"))
    pw = t["power"]
    power_text = "; ".join(
        f"{r.layers}: power not computable (the pilot's spreads are undefined: too few reference documents or no "
        "declarable level)" if not np.isfinite(r.pilot_mde) else
        f"{r.layers}: MDE {_fmt(r.pilot_mde)} at n = {r.n_docs} documents vs the smallest effect of interest "
        f"{_fmt(r.effect)} — " + ("powered" if r.powered else
                                  f"NOT powered (n ≈ {int(r.n_needed)} would be)" if np.isfinite(r.n_needed)
                                  else "NOT powered")
        for r in pw.itertuples())
    findings = [_finding(r, t["contrasts"]) for _, r in v.iterrows()]
    show = v[["layers", "verdict", "estimate", "ci_low", "ci_high", "p", "p_iut", "binding", "p_family", "mde",
              "n_docs", "levels"]]
    return Section(
        TITLE,
        verdict="; ".join(headline(r) for _, r in v.iterrows()),
        paragraphs=[
            f"{meta['n_seq']} windows from {meta['n_docs']} documents{_skipped(cfg)}; the pilot ran on {meta['n_ref']} "
            f"windows of {meta['ref_docs']} other documents. Every condition (destroy and controls {', '.join(cfg['controls'])}) "
            f"ran at strengths ×{', ×'.join(f'{r:g}' for r in cfg['relative'])} of its tuned strength plus α = 0, "
            f"on the same swaps (p ∈ {list(cfg['fracs'])}).",
            "Rule (declared before the run): per document, each curve of tolerance loss against damage is read at the "
            "declared common damage levels by interpolation only; 'depends' needs destroy − none AND destroy − every "
            "control (at common damage) to reject in one direction by exact sign-flip over documents (the largest p "
            f"binds), then the family adjustment ({v['p_family_method'].iloc[0]}). A control that brackets a level for "
            f"fewer than {cfg['min_coverage']:.0%} of documents or moves tolerance by itself makes the entry 'not "
            "testable'. 'not detected' is not evidence of no effect: the MDE says what this n could detect.",
            f"Power (pilot): {power_text}.",
        ],
        tables=[("Verdict per entry (effect, interval and p: destroy − none at common damage)", show),
                ("Contrasts at common damage (tolerance against the edited clean NLL)", t["contrasts"]),
                ("Power from the pilot", pw)],
        details=[("Per condition and strength: damage, attention change (KL of attention rows in the edited "
                  "layers, nats) and tolerance loss, means over documents", t["conditions"]),
                 ("Strength grids from the pilot", t["grids"]),
                 ("Contrasts at common damage, tolerance against the UNEDITED clean NLL", t["contrasts_unedited"])],
        figures=figs, findings=findings,
        results=dict(verdicts=v.to_dict("records"), power=pw.to_dict("records"), meta=meta))
