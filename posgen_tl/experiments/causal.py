"""The causal test of METHOD §5 with the factorial controls C1–C4.

One recipe (its options: :class:`Config`), called by the report, the ``study`` command and notebooks:

* :func:`causal_study` — does position tolerance depend on the fast-band key offset? The
  intervention ``destroy`` (remove ``k̄^(m)`` from the pre-rotation keys in the fast bands of a
  layer subset, strength ``alpha``) against the no-intervention baseline and four controls, each
  matched to the intervention's clean-NLL damage by searching its own strength:

  - C1 ``random_bands``: the same per-token change moved to random other bands, random phases;
  - C2 ``destroy`` in the slow bands;
  - C3 ``rephase``: the fast-band offset turned by a fixed random angle per band (keeps |k̄|, ρ);
  - C4 ``noise``: same-norm random-phase noise in the same fast bands.

  Verdicts come from :func:`posgen_tl.stats.inference.verdict_table` only (METHOD §8): one family
  (destroy vs C1 — the PRIMARY contrast, declared in the config before the run — vs C2, C3,
  C4 and vs none), Holm-adjusted exact sign-flip tests over per-sequence slope differences,
  document bootstrap, split-half sign, damage matching.
The T1/T2 study of §4 (same swap design: :class:`posgen_tl.experiments.tolerance.SwapOptions`)
lives in :mod:`posgen_tl.experiments.tolerance`.

Sampling (METHOD §4): :func:`posgen_tl.io.sampling.sample_windows` — windows of the ANALYSED
documents (one window per document first, seeded offsets); the global ``k̄`` comes from windows
of the DISJOINT reference documents, context part only. Swaps: ``p`` counts swapped disjoint adjacent PAIRS of the context, so ≈ 2p of the context
tokens move; each sequence's permutation is seeded by (base seed, its document id, its window
start, the seed index) — the same sequence gets the same swaps under every condition and in
T1 and T2 (pairing), different sequences get different swaps.

Prefix sharing: every condition edits only layers ≥ L0, so the residual entering L0 is the
same for all conditions. TransformerLens 4.3's ``TransformerBridge.forward(start_at_layer=)``
reproduces the target NLL exactly from a cached residual (tested), but per its own docstring
"blocks 0..k-1 still execute internally (their output is discarded)", so it saves no compute
(measured: :func:`forward_costs`). The recipe therefore does not use it; it shares the clean
passes (the ``none`` condition is computed once and is every damage's baseline), batches
sequences and unembeds only the target span.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.hooks.capture import pattern_hooks, probe_hooks
from posgen_tl import stats
from posgen_tl.experiments import base
from posgen_tl.experiments.tolerance import (
    SwapOptions,
    T12Result,
    curve_rows,
    nll_on_target,
    windows_fingerprint,
)
from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, sample_windows
from posgen_tl.report.text import md_table

__all__ = [
    "Config",
    "CONTROLS",
    "CausalResult",
    "build_conditions",
    "match_alpha",
    "attention_kl",
    "condition_rows",
    "contrasts_from_rows",
    "summarize_conditions",
    "causal_study",
    "forward_costs",
    "write_causal_outputs",
    "load_causal_outputs",
    "causal_markdown",
    "causal_reading",
]

CONTROLS = ("C1", "C2", "C3", "C4")
CONTROL_TEXT = {
    "none": "no intervention",
    "destroy": "destroy the fast-band key offset (k ← k − α·k̄)",
    "C1": "C1: the destroy change moved to random other bands, random phase per token",
    "C2": "C2: destroy the key offset in the slow bands",
    "C3": "C3: rephase the fast-band offset (k̄ turned by α·φ_m; keeps |k̄|, ρ)",
    "C4": "C4: same-norm random-phase noise in the fast bands",
}


@dataclass(frozen=True)
class Config(SwapOptions):
    """Options of the causal test (METHOD §5)."""

    NAME: ClassVar[str] = "causal"
    n_ref: int = base.option(4, "windows of the disjoint reference documents for the global k̄", "int", quick=2, full=8)
    layers: Any = base.option("middle", "layers whose keys are edited", "layers")
    controls: tuple[str, ...] = base.option(CONTROLS, "controls of METHOD §5 to run, from C1,C2,C3,C4", "names",
                                            quick=("C1",))
    alpha: float = base.option(0.5, "strength of 'destroy' (each control's own α is matched to its damage)", "float")
    primary: str = base.option("destroy vs C1", "the pre-declared primary contrast", "text")
    match_subset: int = base.option(16, "sequences used to match each control's damage", "int")
    match_steps: int = base.option(3, "damage evaluations per control when matching", "int", quick=2, full=5)
    batch_size: int = base.option(4, "sequences per forward batch", "int")


# ----------------------------------------------------------------------------- sampling


# ----------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Condition:
    """One condition of the factorial design: ``key`` (``none``, ``destroy``, ``C1``…), the edit
    (``None`` for ``none``), and how its strength was found."""

    key: str
    intervention: Intervention | None
    alpha_max: float = 8.0

    @property
    def kind(self) -> str:
        return "none" if self.intervention is None else self.intervention.kind

    @property
    def alpha(self) -> float:
        return 0.0 if self.intervention is None else float(self.intervention.alpha)

    def with_alpha(self, a: float) -> "Condition":
        return dataclasses.replace(self, intervention=self.intervention.with_alpha(a))


def build_conditions(
    layers: Sequence[int], fast: Sequence[int], slow: Sequence[int], *, alpha: float = 0.5,
    controls: Sequence[str] = CONTROLS, seed: int = 0,
) -> list[Condition]:  # fmt: skip
    """``none``, ``destroy`` (fast bands, strength ``alpha``) and the requested controls at a
    starting strength (their final alpha is matched later, :func:`match_alpha`)."""
    bad = [c for c in controls if c not in CONTROLS]
    if bad:
        raise ValueError(f"unknown controls {bad}; choose from {CONTROLS}")
    lay = list(layers)
    out = [Condition("none", None), Condition("destroy", Intervention("destroy", fast, layers=lay, alpha=alpha,
                                                                      label="destroy"))]
    make = {
        "C1": lambda: Intervention("random_bands", fast, layers=lay, alpha=alpha, base="destroy", seed=seed + 1, label="C1"),
        "C2": lambda: Intervention("destroy", slow, layers=lay, alpha=1.0, label="C2"),
        "C3": lambda: Intervention("rephase", fast, layers=lay, alpha=1.0, seed=seed + 2, label="C3"),
        "C4": lambda: Intervention("noise", fast, layers=lay, alpha=alpha, seed=seed + 3, label="C4"),
    }
    for c in controls:
        out.append(Condition(c, make[c](), alpha_max=1.0 if c == "C3" else 8.0))
    return out


def _hooks(model, cond: Condition, km) -> list:
    return [] if cond.intervention is None else intervention_hooks(model, cond.intervention, km)


def match_alpha(
    damage_fn: Callable[[float], float], target: float, *, start: float = 1.0, alpha_max: float = 8.0,
    max_steps: int = 5, rel_tol: float = 0.05,
) -> dict[str, Any]:  # fmt: skip
    """Find ``alpha`` with ``damage_fn(alpha) ≈ target`` (damage assumed to grow with alpha).

    Bracketing (``start``, then doubling up to ``alpha_max``) and false-position (secant inside
    the bracket; a bisection step where it stalls), at most ``max_steps`` evaluations in all.
    Stops when ``|damage − target| ≤ rel_tol·|target|``.

    Returns:
        dict ``alpha`` (best found), ``damage`` (its damage), ``target``, ``n_evals``,
        ``reached`` (the bracket contained the target — False when even ``alpha_max`` did less
        damage: the control is then reported UNMATCHED), ``trace`` (list of (alpha, damage)).
    """
    trace: list[tuple[float, float]] = []

    def ev(a: float) -> float:
        d = float(damage_fn(a))
        trace.append((a, d))
        return d

    tol = rel_tol * max(abs(target), 1e-4)
    lo, d_lo = 0.0, 0.0
    hi = min(start, alpha_max)
    d_hi = ev(hi)
    while d_hi < target and hi < alpha_max and len(trace) < max_steps:
        lo, d_lo = hi, d_hi
        hi = min(2 * hi, alpha_max)
        d_hi = ev(hi)
    reached = d_hi >= target
    side = 0
    while reached and abs(trace[-1][1] - target) > tol and len(trace) < max_steps:
        t = (target - d_lo) / (d_hi - d_lo) if d_hi > d_lo else 0.5
        t = min(max(t, 0.1), 0.9) if side == 0 else 0.5  # Illinois-like guard: bisect after a repeat
        a = lo + t * (hi - lo)
        d = ev(a)
        if d < target:
            side = 1 if side == -1 else -1 if side == 0 else 0
            lo, d_lo = a, d
        else:
            side = 1 if side == 1 else 0
            hi, d_hi = a, d
    best = min(trace, key=lambda ad: abs(ad[1] - target))
    return dict(alpha=best[0], damage=best[1], target=float(target), n_evals=len(trace), reached=bool(reached),
                trace=trace)


# ----------------------------------------------------------------------------- passes


class _KL:
    """Attention-change accumulator: KL(clean ‖ edited) of attention rows in ``layers``.

    ``reference`` mode stores the clean patterns of a batch; ``compare`` mode adds per-sequence
    mean KL over heads, query rows ``1..N−1`` (row 0, the sink/BOS row, excluded) and layers."""

    def __init__(self, layers: Sequence[int]):
        self.layers = list(layers)
        self.ref: dict[int, Tensor] = {}
        self.acc: dict[int, Tensor] = {}
        self.mode = "reference"

    def __call__(self, layer: int, pat: Float[Tensor, "batch head_index query_pos key_pos"]) -> None:
        if self.mode == "reference":
            self.ref[layer] = pat
        else:
            self.acc[layer] = attention_kl(self.ref[layer], pat)

    def per_sequence(self) -> Float[Tensor, "batch"]:
        missing = [lay for lay in self.layers if lay not in self.acc]
        if missing:
            raise RuntimeError(f"attention patterns of layers {missing} were not captured")
        return torch.stack([self.acc[lay] for lay in self.layers]).mean(0)


def attention_kl(
    p: Float[Tensor, "batch head_index query_pos key_pos"], q: Float[Tensor, "batch head_index query_pos key_pos"]
) -> Float[Tensor, "batch"]:
    """Mean over heads and query rows ``1..N−1`` of ``KL(p_row ‖ q_row)`` (nats), per sequence.

    Causal rows: entries with ``p = 0`` (masked keys) contribute 0; ``q`` is floored at 1e-30
    where ``p > 0``. Row 0 (a single key: KL ≡ 0) is excluded."""
    p, q = p[:, :, 1:].double(), q[:, :, 1:].double()
    kl = (torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(1e-30))).sum(-1)
    return kl.clamp_min(0).mean((1, 2)).float()


def condition_rows(
    model: Any, windows: Windows, cond: Condition, *, k_means: dict | None, target_len: int,
    fracs: Sequence[float], seeds: Sequence[int], mode: str = "T1", base_seed: int = 0,
    kl: _KL | None = None, base: Tensor | None = None,
) -> tuple[pd.DataFrame, Tensor, Tensor | None]:  # fmt: skip
    """Rows of one condition on one batch of windows: the clean pass (with attention capture
    when ``kl`` is given) and one pass per (frac > 0, seed).

    Returns ``(rows, clean_nll [batch], kl [batch] or None)``; rows have ``seq`` = position in
    ``windows`` (the caller maps it to global ids), ``frac, seed, clean_nll, nll, delta``."""
    hooks = _hooks(model, cond, k_means)
    bs = windows.tokens.shape[0]
    kl_vals = None
    extra = [] if kl is None else pattern_hooks(model, kl.layers, kl)
    if kl is not None:
        kl.mode = "reference" if cond.key == "none" else "compare"
        kl.acc = {}
    clean = nll_on_target(model, windows.tokens, target_len=target_len, fwd_hooks=hooks + extra, batch_size=bs)
    if kl is not None:
        kl_vals = torch.zeros(bs) if cond.key == "none" else kl.per_sequence()
    rows = curve_rows(model, windows, clean, fracs=fracs, seeds=seeds, mode=mode, target_len=target_len,
                      base_seed=base_seed, fwd_hooks=hooks)
    return pd.DataFrame(rows), clean, kl_vals


# ----------------------------------------------------------------------------- statistics glue


def contrasts_from_rows(rows: pd.DataFrame, pairs: Sequence[tuple[str, str]], primary: str | None) -> list:
    """:class:`posgen_tl.stats.inference.Contrast` per ``(intervention, control)`` pair, named
    ``"<intervention> vs <control>"``; the one named ``primary`` is flagged primary.

    Per sequence: ``d`` = slope(intervention) − slope(control) (paired by ``seq``), damages =
    mean ``clean_nll − base_clean_nll``; document ids from the ``doc`` column.

    Raises:
        ValueError: a label without rows, mismatched sequence sets, NaN slopes, no ``doc``."""

    if "doc" not in rows.columns:
        raise ValueError("rows have no 'doc' column: every rows frame must carry the document id")
    names = [f"{a} vs {b}" for a, b in pairs]
    if primary is not None and primary not in names:
        raise ValueError(f"the declared primary contrast {primary!r} is not in the family {names}")
    doc = rows.groupby("seq")["doc"].first()
    out = []
    for iv, ctrl in pairs:
        parts = {}
        for role, label in (("intervention", iv), ("control", ctrl)):
            g = rows[rows["intervention"] == label]
            if g.empty:
                raise ValueError(f"no rows for {role} {label!r}; present: {sorted(rows['intervention'].unique())}")
            dmg = (g["clean_nll"] - g["base_clean_nll"]).groupby(g["seq"]).mean()
            parts[role] = (stats.per_sequence_slopes(g), dmg)
        d, seq = stats.paired_differences(parts["intervention"][0], parts["control"][0])
        name = f"{iv} vs {ctrl}"
        if len(seq) < 3:
            raise ValueError(f"contrast {name!r}: needs at least 3 sequences, got {len(seq)}")
        out.append(stats.Contrast(name=name, intervention=iv, control=ctrl, d=d, seq=seq, doc=doc.loc[seq].to_numpy(),
                                  damage=parts["intervention"][1].loc[seq].to_numpy(float),
                                  control_damage=parts["control"][1].loc[seq].to_numpy(float),
                                  primary=name == primary))
    return out


def summarize_conditions(rows: pd.DataFrame, kl: pd.DataFrame | None = None, *, n_boot: int = 10_000) -> pd.DataFrame:
    """One row per condition: ``condition, kind, alpha, n_seq, n_docs, clean_nll, damage
    (+ _lo/_hi: document bootstrap), attn_kl (+ CI), slope (+ CI), dnll@p`` (mean ΔNLL per p)."""

    out = []
    for key, g in rows.groupby("intervention", sort=False):
        doc = g.groupby("seq")["doc"].first()
        dmg = (g["clean_nll"] - g["base_clean_nll"]).groupby(g["seq"]).mean().loc[doc.index]
        sl = stats.per_sequence_slopes(g).loc[doc.index]
        row = dict(condition=key, kind=g["kind"].iloc[0], alpha=float(g["alpha"].iloc[0]), n_seq=len(doc),
                   n_docs=int(doc.nunique()), clean_nll=float(g.groupby("seq")["clean_nll"].first().mean()))
        for nm, v in (("damage", dmg), ("slope", sl)):
            m, lo, hi = stats.bootstrap_ci(v.to_numpy(), clusters=doc.to_numpy(), n_boot=n_boot)
            row.update({nm: m, f"{nm}_lo": lo, f"{nm}_hi": hi})
        if kl is not None and key in set(kl["intervention"]):
            k = kl[kl["intervention"] == key].set_index("seq")["attn_kl"].loc[doc.index]
            m, lo, hi = stats.bootstrap_ci(k.to_numpy(), clusters=doc.to_numpy(), n_boot=n_boot)
            row.update(attn_kl=m, attn_kl_lo=lo, attn_kl_hi=hi)
        for f, v in g.groupby("frac")["delta"].mean().items():
            if f > 0:
                row[f"dnll@{f:g}"] = float(v)
        out.append(row)
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------- the recipe


@dataclass
class CausalResult:
    """Output of :func:`causal_study`.

    Attributes:
        rows: per (condition, sequence, frac, seed): ``intervention`` (condition key), ``kind``,
            ``alpha``, ``seq``, ``doc``, ``doc_name``, ``frac``, ``seed``, ``clean_nll``, ``nll``,
            ``delta``, ``base_clean_nll`` (the ``none`` clean NLL of that sequence).
        kl: per (condition, sequence): ``attn_kl`` (mean KL(clean ‖ edited) of attention rows in
            the edited layers, nats).
        conditions: per condition: description, kind, alpha, bands, matching, damage, attention
            KL and slope with document-bootstrap CIs, ``n_seq``, ``n_docs``.
        contrasts: :func:`posgen_tl.stats.inference.verdict_table` of the family (empty if < 2 conditions).
        config: sizes, layers, bands, seeds, primary contrast, corpus, commit, wall times,
            ``partial`` (True while conditions are missing).
    """

    rows: pd.DataFrame
    kl: pd.DataFrame
    conditions: pd.DataFrame
    contrasts: pd.DataFrame
    config: dict = field(default_factory=dict)


def _bands(spec, layers, fast, slow):
    nb = spec.layer(layers[0]).n_bands
    q = max(1, nb // 4)
    fast = list(range(q)) if fast is None else [int(b) for b in fast]
    slow = list(range(nb - q, nb)) if slow is None else [int(b) for b in slow]
    for nm, b in (("fast", fast), ("slow", slow)):
        if not b or min(b) < 0 or max(b) >= nb:
            raise ValueError(f"{nm} bands {b} out of range for {nb} bands")
    return nb, fast, slow


def _result(rows, kl, conds, match, config, pairs, primary, partial: bool = False) -> CausalResult:
    """Tables from rows. ``partial``: each contrast uses the sequences both of its conditions have
    finished (the ``n_seq`` column says how many); a complete run never drops a sequence."""

    summ = summarize_conditions(rows, kl)
    meta = pd.DataFrame([dict(condition=c.key, description=CONTROL_TEXT[c.key],
                              bands=",".join(map(str, c.intervention.bands)) if c.intervention else "",
                              **{f"match_{k}": v for k, v in match.get(c.key, {}).items() if k != "trace"})
                         for c in conds])  # fmt: skip
    summ = meta.merge(summ, on="condition", how="right")
    present = set(rows["intervention"])
    fam = [(a, b) for a, b in pairs if a in present and b in present]
    table = pd.DataFrame()
    prim = primary if any(f"{a} vs {b}" == primary for a, b in fam) else None
    if fam and not partial:
        table = stats.verdict_table(contrasts_from_rows(rows, fam, prim))
    elif fam:
        cs = []
        for a, b in fam:
            common = set(rows.loc[rows["intervention"] == a, "seq"]) & set(rows.loc[rows["intervention"] == b, "seq"])
            sub = rows[rows["intervention"].isin([a, b]) & rows["seq"].isin(common)]
            if len(common) >= 3:
                cs += contrasts_from_rows(sub, [(a, b)], prim if f"{a} vs {b}" == prim else None)
        table = stats.verdict_table(cs) if cs else table
    return CausalResult(rows, kl, summ, table, config)


def _t1_reuse(t12: "T12Result", ana: Windows, *, fracs, seeds, target_len: int, seed: int, mode: str) -> pd.Series:
    """The trained model's T1 NLL per ``(seq, frac, seed)`` of ``t12``, after checking that those
    passes are exactly the ones the ``none`` condition would run. Raises ``ValueError`` naming the
    first mismatch."""
    c = t12.config
    checks = [("mode", mode, "T1"), ("seed", seed, c.get("seed")), ("target_len", target_len, c.get("target_len")),
              ("n_seq", len(ana), c.get("n_seq")), ("seq_len", int(ana.tokens.shape[1]), c.get("seq_len"))]
    for name, mine, theirs in checks:
        if mine != theirs:
            raise ValueError(f"t12 cannot stand in for the 'none' passes: {name} is {mine!r} here, {theirs!r} in t12")
    r = t12.rows[(t12.rows["twin"] == "trained") & (t12.rows["mode"] == "T1")]
    want = {(float(f), int(s)) for f in fracs if f > 0 for s in seeds}
    have = set(zip(r["frac"].astype(float), r["seed"].astype(int)))
    if not want <= have:
        raise ValueError(f"t12 lacks the (frac, seed) passes {sorted(want - have)} of this run")
    if c.get("windows_sha1") != windows_fingerprint(ana):
        raise ValueError("t12 was computed on other windows (the SHA-1 of their tokens differs or is not recorded)")
    return r.set_index(["seq", "frac", "seed"])["nll"]


def _with_reused(df: pd.DataFrame, reuse: pd.Series, b: Sequence[int], clean: Tensor, fracs, seeds) -> pd.DataFrame:
    """``df`` (the frac = 0 rows of one batch) completed by the reused swapped-pass NLLs, in the
    row order of :func:`curve_rows` (frac, seed, sequence)."""
    rows = [df]
    cl = clean.float().numpy()  # float32 like curve_rows: same rows bit for bit when the passes agree
    for frac in fracs:
        if frac == 0:
            continue
        for sd in seeds:
            nll = np.array([reuse.loc[(g, float(frac), int(sd))] for g in b], dtype=np.float32)
            rows.append(pd.DataFrame(dict(seq=range(len(b)), frac=float(frac), seed=int(sd), clean_nll=cl.astype(float),
                                          nll=nll.astype(float), delta=(nll - cl).astype(float))))
    return pd.concat(rows, ignore_index=True)


def causal_study(
    model: Any, corpus: CorpusLike = None, cfg: Config | None = None, *, fast: Sequence[int] | None = None,
    slow: Sequence[int] | None = None, mode: str = "T1", windows: tuple[Windows, Windows] | None = None,
    on_partial: Callable[[CausalResult], None] | None = None, progress: bool = True,
    t12: T12Result | None = None, **options: Any,
) -> CausalResult:  # fmt: skip
    """The causal test of METHOD §5 with controls C1–C4 and verdicts by METHOD §8.

    Steps: (1) windows of the analysed documents and a disjoint reference set
    (:func:`posgen_tl.io.sampling.sample_windows`); k̄ per edited layer from the reference windows' context part;
    (2) clean NLL (``none``) on all sequences; (3) the destroy damage on the first
    ``match_subset`` sequences and, per control, its own alpha matched to it
    (:func:`match_alpha`, ≤ ``match_steps`` evaluations; unmatched controls are kept and
    flagged); (4) per condition and batch: the clean pass (with the attention change in the
    edited layers) and one pass per (frac > 0, seed); (5) the family of contrasts
    ``destroy vs <control>`` and ``destroy vs none`` through :func:`posgen_tl.stats.inference.verdict_table`.

    Conditions run in two phases — ``none, destroy`` and the primary control first, the other
    controls after — and ``on_partial(result)`` is called after every batch until the run is
    complete (``config['partial']`` is True there; ``config['n_seq_done']`` says how many
    sequences the primary phase has finished), so a long study writes its results as they come.

    Args:
        cfg: :class:`Config` (default ``Config()``) with ``options`` applied: sizes, edited layers
            (default the middle group of :func:`posgen_tl.maths.groups.layer_groups`), controls, α of
            ``destroy``, the pre-declared primary contrast, damage matching.
        fast/slow: band indices (default: the first / last quarter of the bands; band 0 = fastest).
        windows: pre-built ``(analysed, reference)`` windows (default
            :func:`posgen_tl.io.sampling.sample_windows`).
        t12: a :func:`t1_t2_study` result of the same model on the same analysed windows, seeds,
            fracs, target and ``seed`` (``mode="T1"``): the ``none`` condition then runs only its
            clean pass (the attention reference) and takes its swapped-pass NLLs from the
            trained T1 rows instead of recomputing the identical passes (the report runs both;
            ΔNLL is taken against this run's clean pass). A mismatch raises ``ValueError``.

    Returns:
        :class:`CausalResult`.

    Raises:
        ValueError: bad bands/controls, a primary contrast outside the family, fewer than 3
            sequences (from the verdict code), overlapping reference/analysed documents.
    """
    cfg = base.config_of(Config, cfg, options)
    n_seq, seq_len, target_len, fracs, seeds = cfg.n_seq, cfg.seq_len, cfg.target(), cfg.fracs, cfg.seeds
    alpha, controls, primary, match_subset = cfg.alpha, cfg.controls, cfg.primary, cfg.match_subset
    match_steps, seed, n_ref, batch_size = cfg.match_steps, cfg.seed, cfg.n_ref, cfg.batch_size
    t_start = time.time()
    spec, _ = probe_hooks(model)
    layers = base.resolve_layers(cfg.layers, spec.n_layers)
    nb, fast, slow = _bands(spec, layers, fast, slow)
    if n_seq < 3:
        raise ValueError(f"n_seq={n_seq}: a contrast needs at least 3 sequences")
    if not 0 < target_len < seq_len - 2:
        raise ValueError(f"target_len={target_len} must be in (0, {seq_len - 2})")
    if sum(1 for f in fracs if f > 0) < 1 or 0 not in fracs:
        raise ValueError(f"fracs must include 0 and at least one p > 0, got {fracs}")
    conds = build_conditions(layers, fast, slow, alpha=alpha, controls=controls, seed=seed)
    pairs = [("destroy", c) for c in controls] + [("destroy", "none")]
    if primary not in {f"{a} vs {b}" for a, b in pairs}:
        raise ValueError(f"primary contrast {primary!r} is not in the family {[f'{a} vs {b}' for a, b in pairs]}")
    ana, ref = windows if windows is not None else sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=n_seq, seq_len=seq_len,
                                                                  n_ref=n_ref, seed=seed)
    if set(ana.doc_ids.tolist()) & set(ref.doc_ids.tolist()):
        raise ValueError("reference and analysed windows share documents")
    reuse = None if t12 is None else _t1_reuse(t12, ana, fracs=fracs, seeds=seeds, target_len=target_len, seed=seed,
                                                mode=mode)
    times: dict[str, float] = {}
    t0 = time.time()
    km = key_means(model, ref.tokens[:, : ref.tokens.shape[1] - target_len], layers, batch_size=batch_size)
    times["k_means_s"] = time.time() - t0
    n = len(ana)
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]

    # (2) clean NLL without intervention (the baseline of every damage)
    t0 = time.time()
    base_nll = torch.cat([nll_on_target(model, ana.tokens[b], target_len=target_len, batch_size=len(b)) for b in batches])
    times["base_s"] = time.time() - t0

    # (3) matched strengths on a subset
    t0 = time.time()
    sub = list(range(min(max(match_subset, 1), n)))
    sub_toks = ana.tokens[sub]

    def damage_on_subset(cond: Condition) -> float:
        nll = nll_on_target(model, sub_toks, target_len=target_len, fwd_hooks=_hooks(model, cond, km),
                            batch_size=batch_size)
        return float((nll - base_nll[sub]).mean())

    match: dict[str, dict] = {}
    target = damage_on_subset(conds[1])
    match["destroy"] = dict(alpha=alpha, damage=target, target=target, n_evals=1, reached=True, matched=True)
    for i, c in enumerate(conds):
        if c.key in ("none", "destroy"):
            continue
        m = match_alpha(lambda a, c=c: damage_on_subset(c.with_alpha(a)), target, start=c.alpha,
                        alpha_max=c.alpha_max, max_steps=match_steps)
        m["matched"] = bool(m["reached"] and abs(m["damage"] - target) <= 0.10 * abs(target))
        match[c.key] = m
        conds[i] = c.with_alpha(m["alpha"])
        if progress:
            tqdm.write(f"[causal] {c.key}: alpha={m['alpha']:.4g} damage={m['damage']:.4f} (target {target:.4f}, "
                       f"{m['n_evals']} evals, {'matched' if m['matched'] else 'UNMATCHED'})")
    times["match_s"] = time.time() - t0

    config = dict(model=getattr(spec, "model_name", None), corpus="pydoc topics" if corpus is None else str(corpus)[:80],
                  none_swaps_from_t12=reuse is not None,
                  n_seq=n, n_docs=ana.n_docs, n_ref=len(ref), ref_docs=sorted(set(ref.doc_ids.tolist())),
                  seq_len=int(ana.tokens.shape[1]), target_len=target_len, fracs=list(map(float, fracs)),
                  seeds=list(map(int, seeds)), layers=layers, n_bands=nb, fast=fast, slow=slow, alpha=alpha,
                  controls=list(controls), primary=primary, family=[f"{a} vs {b}" for a, b in pairs], mode=mode,
                  match_subset=len(sub), seed=seed, commit=git_commit(short=True), batch_size=batch_size,
                  swaps="p = fraction of disjoint adjacent pairs of the context swapped: ≈ 2p of the tokens move; "
                        "per-(sequence, seed) permutations")  # fmt: skip

    # (4) the passes, in two phases
    first = ["none", "destroy"] + ([primary.split(" vs ")[1]] if primary.split(" vs ")[1] in controls else [])
    phases = [[c for c in conds if c.key in first], [c for c in conds if c.key not in first]]
    frames, kls = [], []
    info = ana.frame()
    kl = _KL(layers)
    done: list[Condition] = []

    def assemble(running: list[Condition], *, partial: bool, n_done: int, ph: int) -> CausalResult:
        rows = pd.concat(frames, ignore_index=True).merge(info[["seq", "doc", "doc_name"]], on="seq", how="left")
        rows["base_clean_nll"] = base_nll.numpy()[rows["seq"].to_numpy()]
        rows = rows[["intervention", "kind", "alpha", "seq", "doc", "doc_name", "frac", "seed", "clean_nll", "nll",
                     "delta", "base_clean_nll"]]
        keys = [c.key for c in done + running]
        cfg = dict(config, partial=partial, conditions_done=[c.key for c in done], conditions_running=[c.key for c in running],
                   n_seq_done={"phase": ph + 1, "sequences": n_done}, wall_s={**times, "total_s": time.time() - t_start})
        return _result(rows, pd.concat(kls, ignore_index=True), [c for c in conds if c.key in keys], match, cfg, pairs,
                       primary, partial=partial)
    last_phase = max(i for i, p in enumerate(phases) if p)
    for ph, phase in enumerate(phases):
        if not phase:
            continue
        t0 = time.time()
        jobs = [(b, c) for b in batches for c in phase]
        bar = tqdm(total=len(jobs), desc=f"causal phase {ph + 1}", disable=not progress)
        for b in batches:
            w = ana.subset(b)
            if phase[0].key != "none":  # attention reference for this batch (clean, no edit)
                condition_rows(model, w, conds[0], k_means=km, target_len=target_len, fracs=(0.0,), seeds=(0,),
                               kl=kl)  # fmt: skip
            for c in phase:
                shared = reuse is not None and c.key == "none"
                df, clean, kv = condition_rows(model, w, c, k_means=km, target_len=target_len,
                                               fracs=(0.0,) if shared else fracs, seeds=seeds, mode=mode, base_seed=seed,
                                               kl=kl)  # fmt: skip
                if shared:  # the swapped passes of `none` are the trained T1 curve: reuse them
                    df = _with_reused(df, reuse, b, clean, fracs, seeds)
                df["seq"] = [b[i] for i in df["seq"]]
                df.insert(0, "intervention", c.key)
                df.insert(1, "kind", c.kind)
                df.insert(2, "alpha", c.alpha)
                frames.append(df)
                kls.append(pd.DataFrame(dict(intervention=c.key, seq=b, attn_kl=kv.numpy())))
                bar.update(1)
            if on_partial is not None and not (ph == last_phase and b is batches[-1]):
                on_partial(assemble(phase, partial=True, n_done=b[-1] + 1, ph=ph))
        bar.close()
        times[f"phase{ph + 1}_s"] = time.time() - t0
        done += phase
        res = assemble([], partial=len(done) < len(conds), n_done=n, ph=ph)
    return res


# ----------------------------------------------------------------------------- cost per forward


@torch.no_grad()
def forward_costs(model: Any, tokens: Int[Tensor, "batch pos"], layer: int, *, target_len: int = 64,
                  repeats: int = 1) -> dict[str, float]:  # fmt: skip
    """Seconds per sequence forward: full (target-only unembedding), the prefix
    ``stop_at_layer=layer``, and the rest from the cached residual (``start_at_layer=layer``),
    plus ``max_abs_diff`` between the full and the resumed target NLL.

    Uses :func:`posgen_tl.experiments.tolerance.nll_on_target` (``start_at_layer`` passes through
    its ``forward_kwargs``)."""
    n = tokens.shape[0]
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    for _ in range(repeats):
        full = nll_on_target(model, tokens, target_len=target_len, batch_size=n)
    out["full_s_per_seq"] = (time.perf_counter() - t0) / (repeats * n)
    t0 = time.perf_counter()
    for _ in range(repeats):
        resid = model(tokens, stop_at_layer=layer)
    out["prefix_s_per_seq"] = (time.perf_counter() - t0) / (repeats * n)
    t0 = time.perf_counter()
    for _ in range(repeats):
        resumed = nll_on_target(model, tokens, target_len=target_len, batch_size=n, resid_at=(layer, resid))
    out["resumed_s_per_seq"] = (time.perf_counter() - t0) / (repeats * n)
    out["max_abs_diff"] = float((full - resumed).abs().max())
    out["layer"] = layer
    out["seq_len"] = int(tokens.shape[1])
    return out


# ----------------------------------------------------------------------------- outputs


COND_COLS = ["condition", "description", "kind", "alpha", "bands", "match_matched", "n_seq", "n_docs", "clean_nll",
             "damage", "damage_lo", "damage_hi", "attn_kl", "attn_kl_lo", "attn_kl_hi", "slope", "slope_lo", "slope_hi"]
CONTRAST_COLS = ["contrast", "primary", "n_seq", "n_docs", "mean_diff", "boot_lo", "boot_hi", "t_lo", "t_hi", "p_exact",
                 "p_holm", "damage", "control_damage", "damage_matched", "half_a", "half_b", "split_half_agree", "mde",
                 "verdict"]


def causal_reading(contrasts: pd.DataFrame, alpha: float = 0.05) -> str | None:
    """Which side carries a "depends"? A contrast ``intervention vs control`` can pass the METHOD §8
    rule because the CONTROL changes tolerance while the intervention does not. When the family
    holds ``<intervention> vs none`` and that contrast is not significant (Holm p ≥ ``alpha``)
    while some ``<intervention> vs <control>`` reads "depends", return the sentence that says so
    (with both effects); else ``None``. Returns text for tables and reports, never a verdict."""
    if contrasts is None or not len(contrasts) or "contrast" not in contrasts:
        return None
    c = contrasts.set_index("contrast")
    out = []
    for iv in dict.fromkeys(str(x).split(" vs ")[0] for x in c.index):
        key = f"{iv} vs none"
        if key not in c.index or not c.loc[key, "p_holm"] >= alpha:
            continue
        dep = [k for k in c.index if k.startswith(f"{iv} vs ") and k != key and str(c.loc[k, "verdict"]).startswith("depends")]
        if dep:
            r = c.loc[key]
            out.append(f"`{iv}` itself does not measurably change the tolerance slope ({key}: {r['mean_diff']:+.3g} "
                       f"[{r['boot_lo']:+.3g}, {r['boot_hi']:+.3g}], Holm p = {r['p_holm']:.3g}); the \"depends\" of "
                       + ", ".join(f"`{k}` ({c.loc[k, 'mean_diff']:+.3g})" for k in dep)
                       + " is carried by the control's own change of the slope. This is not evidence that tolerance "
                       "depends on what the intervention removes.")
    return " ".join(out) or None


def causal_markdown(result: CausalResult, title: str = "Causal test") -> str:
    """Markdown: the per-condition table, the verdict table (from ``verdict_table`` only),
    each contrast's reason, and the configuration."""
    c = result.config
    if c.get("partial"):
        nd = c.get("n_seq_done") or {}
        running = c.get("conditions_running", [])
        todo = [k for k in ["none", "destroy", *c.get("controls", [])] if k not in c.get("conditions_done", []) + running]
        status = (f"PARTIAL — phase {nd.get('phase')}: {nd.get('sequences')} of {c.get('n_seq')} sequences done for "
                  f"{', '.join(running) or '—'}; finished on all sequences: {', '.join(c.get('conditions_done', [])) or '—'}; "
                  f"not started: {', '.join(todo) or '—'}")
    else:
        status = "complete"
    n_now = int(result.contrasts["n_seq"].max()) if len(result.contrasts) else 0
    expl = f" — EXPLORATORY (n = {n_now} < 32 sequences)" if n_now < 32 else ""
    lines = [f"## {title}{expl}", "", f"Status: {status}.", "",
             f"{c.get('model')}: {c.get('n_seq')} sequences from {c.get('n_docs')} documents × {c.get('seq_len')} tokens; "
             f"target = last {c.get('target_len')} tokens; T1 swaps at p ∈ {c.get('fracs')} ({c.get('swaps')}); seeds "
             f"{c.get('seeds')}; keys edited in layers {c.get('layers')}; fast bands {c.get('fast')}, slow bands "
             f"{c.get('slow')} of {c.get('n_bands')}; destroy α = {c.get('alpha')}; k̄ from {c.get('n_ref')} windows of "
             f"{len(c.get('ref_docs', []))} reference documents disjoint from the analysed ones. Controls matched on the "
             f"first {c.get('match_subset')} sequences. PRIMARY contrast (declared before the run): `{c.get('primary')}`.",
             "", "### Per condition (damage = clean-NLL increase; attn KL = mean KL(clean ‖ edited) of attention rows "
             "in the edited layers; slope = ΔNLL per unit p; CIs: 95 % document bootstrap)", "",
             md_table(result.conditions, COND_COLS)]  # fmt: skip
    if len(result.contrasts):
        lines += ["", "### Contrasts (one family, Holm-adjusted; verdicts from `posgen_tl.stats.inference.verdict_table`)", "",
                  md_table(result.contrasts, CONTRAST_COLS), ""]
        lines += [f"- `{r.contrast}`: {r.verdict} — {r.reason}" for r in result.contrasts.itertuples()]
        reading = causal_reading(result.contrasts)
        if reading:
            lines += ["", f"**Reading.** {reading}"]
    w = c.get("wall_s", {})
    lines += ["", "Wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in w.items()) + f"; commit {c.get('commit')}.", ""]
    return "\n".join(lines)


def write_causal_outputs(result: CausalResult, out_dir: str | Path, tag: str = "causal") -> dict[str, Path]:
    """Write ``{tag}_rows.csv``, ``{tag}_kl.csv``, ``{tag}_conditions.csv``, ``{tag}_contrasts.csv``,
    ``{tag}_config.json`` and ``{tag}.md`` (the markdown table) under ``out_dir``; returns the paths."""
    import json  # noqa: PLC0415

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {k: out / f"{tag}_{k}.csv" for k in ("rows", "kl", "conditions", "contrasts")}
    result.rows.to_csv(paths["rows"], index=False)
    result.kl.to_csv(paths["kl"], index=False)
    result.conditions.to_csv(paths["conditions"], index=False)
    result.contrasts.to_csv(paths["contrasts"], index=False)
    paths["config"] = out / f"{tag}_config.json"
    paths["config"].write_text(json.dumps(result.config, indent=1, default=str))
    paths["md"] = out / f"{tag}.md"
    paths["md"].write_text(causal_markdown(result, f"Causal test ({tag})"))
    return paths


def load_causal_outputs(out_dir: str | Path, tag: str = "causal") -> CausalResult:
    """Read back what :func:`write_causal_outputs` wrote (``{tag}_*.csv`` and ``{tag}_config.json``)
    — or the tolerance study's folder (``posgen-tl study tolerance``, ``tag="causal"``) — as a
    :class:`CausalResult` (tables as written; nothing is recomputed)."""
    import json  # noqa: PLC0415

    out = Path(out_dir)

    def read(k: str) -> pd.DataFrame:
        p = out / f"{tag}_{k}.csv"
        if k == "contrasts" and not p.exists():  # a study/report folder names the contrasts table ``causal_table.csv``
            p = out / f"{tag}_table.csv"
        return pd.read_csv(p) if p.stat().st_size > 1 else pd.DataFrame()

    return CausalResult(read("rows"), read("kl"), read("conditions"), read("contrasts"),
                        json.loads((out / f"{tag}_config.json").read_text()))




# ----------------------------------------------------------------------------- report / study


NAME = "causal"
ABOUT = "does T1 tolerance depend on the fast-band key offset? destroy vs matched controls C1–C4 (METHOD §5)"
NEEDS: tuple[str, ...] = ()


def _reusable_t12(ctx: Any, cfg: Config) -> T12Result | None:
    """The T1/T2 result of this run's tolerance study, when its swapped passes are exactly the ones
    the ``none`` condition would run (same windows, fractions, seeds, target); else None."""
    t12 = ctx.shared.get("t12")
    if t12 is None:
        return None
    c = t12.config
    same = (c.get("n_seq") == cfg.n_seq and c.get("seq_len") == cfg.seq_len and c.get("seed") == cfg.seed
            and c.get("target_len") == cfg.target() and set(cfg.fracs) <= set(c.get("fracs", []))
            and set(cfg.seeds) <= set(c.get("seeds", [])))
    return t12 if same else None


def compute(ctx: Any, cfg: Config) -> None:
    """The causal test with its controls; writes rows, KL, conditions, the contrast table, its
    configuration and a figure (partial tables while it runs, removed when it completes)."""
    from posgen_tl.io.corpus import CorpusError  # noqa: PLC0415
    from posgen_tl.plot.causal import plot_causal_conditions  # noqa: PLC0415

    try:
        ana, ref = sample_windows(ctx.model, cfg.corpus, n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref,
                                  seed=cfg.seed)
    except (CorpusError, ValueError) as e:  # e.g. a one-document corpus: no disjoint reference documents
        ctx.work.save_json("causal_meta.json", {"skipped": f"causal test skipped: {e}"})
        return

    def partial(r: CausalResult) -> None:  # a long run writes its tables as they come
        ctx.work.save_df("causal_partial_conditions.csv", r.conditions)
        ctx.work.save_df("causal_partial_table.csv", r.contrasts)
        ctx.work.save_json("causal_partial_config.json", r.config)

    res = causal_study(ctx.model, cfg.corpus, cfg, windows=(ana, ref), on_partial=partial, t12=_reusable_t12(ctx, cfg))
    for f in ("causal_partial_conditions.csv", "causal_partial_table.csv", "causal_partial_config.json"):
        ctx.work.path(f).unlink(missing_ok=True)  # complete now: no partial tables beside the final ones
    ctx.work.save_df("causal_rows.csv", res.rows)
    ctx.work.save_df("causal_kl.csv", res.kl)
    ctx.work.save_df("causal_conditions.csv", res.conditions)
    ctx.work.save_df("causal_table.csv", res.contrasts)
    ctx.work.save_json("causal_config.json", res.config)
    ctx.work.save_fig("fig_causal.png", plot_causal_conditions(res.conditions, title=ctx.model_name))
    ctx.work.save_json("causal_meta.json", {"n_seq": len(ana), "n_docs": ana.n_docs, "controls": list(cfg.controls),
                                            **{k: res.config[k] for k in ("layers", "fast", "slow", "alpha", "primary",
                                                                           "match_subset", "target_len", "fracs")}})


def render(ctx: Any, cfg: Config) -> Any:
    """The report section: conditions (damage, attention KL, slope), the contrast family, the figure."""
    from posgen_tl.report.html import Section  # noqa: PLC0415

    meta = ctx.work.load_json("causal_meta.json")
    title = "5 · Does tolerance depend on the pattern? The causal test (METHOD §5)"
    if "skipped" in meta:
        return Section(title, verdict=meta["skipped"], results={"skipped": meta["skipped"]},
                       paragraphs=["Give a corpus of several documents: k̄ must come from documents disjoint from the "
                                   "analysed ones."])
    table = ctx.work.load_df("causal_table.csv")
    conds = ctx.work.load_df("causal_conditions.csv")
    prim = table[table["primary"].astype(bool)]
    pv = (f"primary contrast `{prim['contrast'].iloc[0]}`: {prim['verdict'].iloc[0]}" if len(prim) else "no primary")
    verdicts = [f"Causal test, {pv} (verdicts from the METHOD §8 rule: Holm-adjusted exact sign-flip p, matched "
                "damage, split-half sign)"]
    reading = causal_reading(table)
    if reading:
        verdicts.append("Reading: " + reading.rstrip("."))
    expl = meta["n_seq"] < 32
    return Section(
        title + (" — EXPLORATORY (n < 32 sequences)" if expl else ""),
        verdict=". ".join(verdicts) + ".",
        paragraphs=[f"{meta['n_seq']} sequences from {meta['n_docs']} documents; keys edited in layers {meta['layers']}; "
                    f"destroy = remove the fast-band key offset (bands {meta['fast']}) at α = {meta['alpha']}; controls "
                    f"{meta['controls']} each matched to its clean-NLL damage on {meta['match_subset']} sequences by its own "
                    "α (C1 random bands, C2 slow bands, C3 rephase, C4 same-norm noise). k̄ from reference documents "
                    "disjoint from the analysed ones. 'no evidence' is not evidence of no effect: the MDE column says "
                    "what this n could detect."],
        tables=[("Per condition: damage, attention KL, slope", conds[[c for c in ["condition", "kind", "alpha", "n_seq",
                 "n_docs", "damage", "damage_lo", "damage_hi", "attn_kl", "slope", "slope_lo", "slope_hi"] if c in conds]]),
                ("Contrasts (one family; Holm)", table[[c for c in ["contrast", "primary", "n_seq", "n_docs", "mean_diff",
                 "boot_lo", "boot_hi", "t_lo", "t_hi", "p_exact", "p_holm", "damage_matched", "split_half_agree", "mde",
                 "verdict"] if c in table]])],
        figures=[(ctx.work.path("fig_causal.png").read_bytes(), "Conditions: slope vs damage, and attention change")],
        findings=_findings(table),
        results={"exploratory": expl, "causal": table.to_dict("records")},
    )


def _findings(table: pd.DataFrame) -> list:
    """The PRIMARY contrast of the causal table, as judged by :func:`posgen_tl.stats.inference.verdict_table`
    over the whole family of the table; a caveat when only the control carries the difference."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415

    prim = table[table["primary"].astype(bool)] if "primary" in table.columns else table
    r = (prim if len(prim) else table).iloc[0]
    note = f"{r['intervention']} vs {r['control']}; Holm p"
    if causal_reading(table) and str(r["verdict"]).startswith("depends"):
        note += f"; CAUTION: {r['intervention']} vs none is not significant — the control carries the difference"
    return [Finding("causal", str(r["verdict"]).replace(" (exploratory)", ""), float(r["mean_diff"]),
                    "slope(intervention) − slope(control)", (float(r["boot_lo"]), float(r["boot_hi"])),
                    float(r["p_holm"]), int(r["n_seq"]), note=note)]
