"""The causal test of docs/method.md §5, judged by the version-2 rule of docs/method.md §8.

Does position tolerance depend on the fast-band key offset beyond what damage explains? In each
declared layer group (each one ENTRY of the claim), the intervention ``destroy`` (remove ``k̄^(m)``
from the pre-rotation keys in the fast bands, strength ``alpha``) is compared with the unedited
model and with four controls, each brought to destroy's clean-NLL damage by its own strength:

- C1 ``random_bands``: the same per-token change moved to random other bands, random phases;
- C2 ``destroy`` in the slow bands;
- C3 ``rephase``: the fast-band offset turned by a random angle per band (keeps |k̄|, ρ);
- C4 ``noise``: same-norm random-phase noise in the same fast bands.

What makes it version 2 (the options are :class:`Config`):

- tolerance is summarised per swap fraction and by the AREA under the ΔNLL-over-p curve (primary;
  a slope that weighs small p negatively is reported, secondary only): :mod:`posgen_tl.stats.curves`;
- each control's strength is tuned on the REFERENCE documents (out of sample), and its damage is
  then tested for equivalence on the analysed documents (TOST, margin declared in the config),
  else the contrast is damage-adjusted;
- the random controls (C1, C3, C4) are drawn afresh for every document (``redraw_controls``);
- "depends" is an intersection–union test — destroy ≠ none AND destroy beyond every counted
  control in the same direction, p = the largest required p — adjusted over the run's entries and
  bounded over the declared claim (:func:`posgen_tl.stats.verdicts.causal_verdict`); a control that
  moves tolerance by itself against destroy is reported, never counted as evidence.

Sampling (docs/method.md §4): :func:`posgen_tl.io.sampling.sample_windows`; the global ``k̄`` and the
damage matching use the reference documents (context part for k̄). Swaps: ``p`` counts swapped
disjoint adjacent PAIRS of the context (≈ 2p of its tokens move); each sequence's permutation is
seeded by (base seed, document, window start, seed index) — the same under every condition.

Prefix sharing: ``TransformerBridge.forward(start_at_layer=)`` reproduces the target NLL from a
cached residual but still runs the earlier blocks (TransformerLens 4.3), so it saves nothing
(:func:`forward_costs`); the recipe shares the clean ``none`` passes instead (reused from the T1
curve of a tolerance study on the same windows when one is given).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.experiments import base
from posgen_tl.experiments.tolerance import SwapOptions, T12Result, curve_rows, nll_on_target, windows_fingerprint
from posgen_tl.hooks.capture import pattern_hooks, probe_hooks
from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, sample_windows
from posgen_tl.stats import curves, verdicts

__all__ = [
    "Config",
    "CONTROLS",
    "RANDOM_CONTROLS",
    "Condition",
    "CausalResult",
    "build_conditions",
    "resolve_groups",
    "draw_seed",
    "match_alpha",
    "attention_kl",
    "condition_rows",
    "causal_study",
    "causal_tables",
    "claim_family",
    "forward_costs",
]

CONTROLS = ("C1", "C2", "C3", "C4")
#: the controls whose edit is a random draw (bands and phases, phases, noise)
RANDOM_CONTROLS = ("C1", "C3", "C4")
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
    """Options of the causal test (docs/method.md §5, judged by §8 v2). Everything the verdict depends on —
    the groups (entries), the controls, the damage margin, the claim's family — is declared here,
    before the run."""

    NAME: ClassVar[str] = "causal"
    n_ref: int = base.option(8, "windows of the disjoint reference documents: the global k̄ (their context part) and "
                                "each control's damage matching (out of sample)", "int", quick=4)
    groups: tuple[str, ...] = base.option(("middle",), "layer groups whose keys are edited, one claim entry each: "
                                          "early, middle, late or a range such as 10-19", "names",
                                          full=("middle", "late"))
    controls: tuple[str, ...] = base.option(("C1", "C2"), "controls of docs/method.md §5, from C1,C2,C3,C4 (each is required)",
                                            "names", quick=("C1",), full=CONTROLS)
    alpha: float = base.option(0.5, "strength of 'destroy' (each control's own α is tuned to its damage)", "float")
    match_steps: int = base.option(3, "damage evaluations per control when tuning its α on the reference windows",
                                   "int", quick=2, full=5)
    redraw_controls: bool = base.option(True, "draw the random controls (C1 bands, C3 phases, C4 noise) afresh for "
                                              "every document", "bool")
    damage_margin: float = base.option(0.10, "TOST margin on clean-NLL damage, relative to destroy's (±)", "float")
    damage_rule: str = base.option("tost_or_adjust", "an unmatched control is analysed by the damage-adjusted "
                                   "contrast (tost_or_adjust), blocks 'depends' (tost), or every control is "
                                   "adjusted (adjust)", "text")
    claim: tuple[str, ...] = base.option((), "the claim's declared family as model:group entries (e.g. "
                                         "smollm2-135m:middle,gemma3-270m:middle); default: this run's groups. "
                                         "Entries of other runs bound the adjustment (Bonferroni) until all are run",
                                         "names")
    batch_size: int = base.batch_option(4)

    def check(self) -> None:
        """Raise ValueError naming the option: fewer than 3 sequences, a target that does not fit,
        fractions without 0 and one p > 0, an undeclared damage margin or an unknown damage rule."""
        if self.n_seq < 3:
            raise ValueError(f"causal: n_seq={self.n_seq}: a contrast needs at least 3 sequences")
        if not 0 < self.target() < self.seq_len - 2:
            raise ValueError(f"causal: target_len={self.target()} must be in (0, {self.seq_len - 2})")
        if sum(1 for f in self.fracs if f > 0) < 1 or 0 not in self.fracs:
            raise ValueError(f"causal: fracs must include 0 and at least one p > 0, got {list(self.fracs)}")
        if not 0 < self.damage_margin < 1:
            raise ValueError(f"causal: damage_margin must be declared in (0, 1), got {self.damage_margin}")
        if self.damage_rule not in verdicts.DAMAGE_RULES:
            raise ValueError(f"causal: damage_rule must be one of {verdicts.DAMAGE_RULES}, got {self.damage_rule!r}")


# ----------------------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Condition:
    """One condition of the factorial design: ``key`` (``none``, ``destroy``, ``C1``…), the edit
    (``None`` for ``none``), the entry (layer group label, ``""`` for ``none``) it belongs to, and
    the largest strength its matching may try."""

    key: str
    intervention: Intervention | None
    group: str = ""
    alpha_max: float = 8.0

    @property
    def kind(self) -> str:
        return "none" if self.intervention is None else self.intervention.kind

    @property
    def alpha(self) -> float:
        return 0.0 if self.intervention is None else float(self.intervention.alpha)

    @property
    def random(self) -> bool:
        """Its edit is a random draw (C1, C3, C4)."""
        return self.key in RANDOM_CONTROLS

    def with_alpha(self, a: float) -> Condition:
        return dataclasses.replace(self, intervention=self.intervention.with_alpha(a))

    def draws(self, docs: Sequence[int], seed: int, redraw: bool) -> list[int | None]:
        """The draw id (the seed of its random edit) of each document; ``None`` for a fixed edit."""
        if not self.random:
            return [None] * len(docs)
        return [draw_seed(seed, self.key, d) if redraw else int(self.intervention.seed) for d in docs]

    def for_documents(self, docs: Sequence[int], seed: int, redraw: bool) -> Condition:
        """This condition with one random draw per document of a batch (``redraw``), else itself."""
        if not (self.random and redraw):
            return self
        return dataclasses.replace(self, intervention=self.intervention.with_row_seeds(self.draws(docs, seed, redraw)))


def draw_seed(seed: int, control: str, doc: int) -> int:
    """The seed of control ``control``'s random draw for document ``doc`` (base ``seed``): a fresh draw
    per document and control, the same in every pass over that document."""
    return 1_000_003 * (int(seed) + 1) + 7_919 * (CONTROLS.index(control) + 1) + int(doc)


def build_conditions(
    layers: Sequence[int], fast: Sequence[int], slow: Sequence[int], *, alpha: float = 0.5,
    controls: Sequence[str] = CONTROLS, seed: int = 0, group: str = "",
) -> list[Condition]:  # fmt: skip
    """``destroy`` (fast bands, strength ``alpha``) and the requested controls at a starting strength
    (each control's α is tuned later, :func:`match_alpha`), all editing ``layers``; the unedited
    ``none`` is shared by every group and built by the recipe."""
    bad = [c for c in controls if c not in CONTROLS]
    if bad:
        raise ValueError(f"unknown controls {bad}; choose from {CONTROLS}")
    lay = list(layers)
    make = {
        "C1": lambda: Intervention("random_bands", fast, layers=lay, alpha=alpha, base="destroy", seed=seed + 1, label="C1"),
        "C2": lambda: Intervention("destroy", slow, layers=lay, alpha=1.0, label="C2"),
        "C3": lambda: Intervention("rephase", fast, layers=lay, alpha=1.0, seed=seed + 2, label="C3"),
        "C4": lambda: Intervention("noise", fast, layers=lay, alpha=alpha, seed=seed + 3, label="C4"),
    }
    out = [Condition("destroy", Intervention("destroy", fast, layers=lay, alpha=alpha, label="destroy"), group)]
    return out + [Condition(c, make[c](), group, alpha_max=1.0 if c == "C3" else 8.0) for c in controls]


def resolve_groups(groups: Sequence[str], n_layers: int) -> dict[str, list[int]]:
    """``{entry label: layers}`` of the declared groups (``"middle"`` → ``"L10-19"`` on a 30-layer model).

    Raises:
        ValueError: no group, an unknown group name, two groups with the same layers."""
    out: dict[str, list[int]] = {}
    for g in groups:
        text = str(g).strip()
        text = text[1:] if text[:1] in ("L", "l") and text[1:2].isdigit() else text  # "L10-19" as the tables print it
        try:
            layers = base.resolve_layers(base.parse_value("layers", text), n_layers)
        except ValueError as e:
            raise ValueError(f"layer group {g!r}: expected early, middle, late or layers like 10-19 ({e})") from None
        label = verdicts.layers_label(layers)
        if label in out:
            raise ValueError(f"groups {list(groups)} name the layers {label} twice")
        out[label] = layers
    if not out:
        raise ValueError("no layer group to edit (option groups)")
    return out


def entry_bands(spec: Any, layers: Sequence[int], fast: Sequence[int] | None, slow: Sequence[int] | None
                ) -> tuple[int, list[int], list[int]]:
    """``(n_bands, fast, slow)`` of an entry: the first / last quarter of the bands unless given (band 0 =
    fastest). Raises ValueError for a band out of range or an empty set."""
    nb = spec.layer(layers[0]).n_bands
    q = max(1, nb // 4)
    fast = list(range(q)) if fast is None else [int(b) for b in fast]
    slow = list(range(nb - q, nb)) if slow is None else [int(b) for b in slow]
    for nm, b in (("fast", fast), ("slow", slow)):
        if not b or min(b) < 0 or max(b) >= nb:
            raise ValueError(f"{nm} bands {b} out of range for {nb} bands")
    return nb, fast, slow


def _batches(windows: Windows, batch_size: int) -> list[Windows]:
    """``windows`` in consecutive batches of ``batch_size`` (a random control's draws are set per batch)."""
    return [windows.subset(range(s, min(s + batch_size, len(windows)))) for s in range(0, len(windows), batch_size)]


def _hooks(model: Any, cond: Condition, km: dict) -> list:
    return [] if cond.intervention is None else intervention_hooks(model, cond.intervention, km)


# ----------------------------------------------------------------------------- matching and passes


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


class AttentionKL:
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
    kl: AttentionKL | None = None, base: Tensor | None = None,
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


def _t1_reuse(t12: T12Result, ana: Windows, *, fracs, seeds, target_len: int, seed: int, mode: str) -> pd.Series:
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
    cl = clean.float().cpu().numpy()  # float32 like curve_rows: same rows bit for bit when the passes agree
    for frac in fracs:
        if frac == 0:
            continue
        for sd in seeds:
            nll = np.array([reuse.loc[(g, float(frac), int(sd))] for g in b], dtype=np.float32)
            rows.append(pd.DataFrame(dict(seq=range(len(b)), frac=float(frac), seed=int(sd), clean_nll=cl.astype(float),
                                          nll=nll.astype(float), delta=(nll - cl).astype(float))))
    return pd.concat(rows, ignore_index=True)


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


# ----------------------------------------------------------------------------- the recipe


@dataclass
class CausalResult:
    """Output of :func:`causal_study`.

    Attributes:
        rows: per (condition, sequence, frac, seed): ``model, layers`` (the entry; ``""`` for the
            shared ``none``), ``condition, kind, alpha, draw`` (the seed of a random control's draw
            for that document, else NaN), ``seq, doc, doc_name, frac, seed, clean_nll, nll, delta,
            base_clean_nll`` (the unedited clean NLL of that sequence).
        kl: per (condition, sequence): ``attn_kl`` — mean KL(clean ‖ edited) of attention rows in the
            edited layers (nats).
        matching: per control: the α tuned on the reference windows, its damage there, destroy's.
        tables: :func:`causal_tables` — ``verdicts, components, damage, adjusted, contrasts,
            summary, interaction``.
        config: sizes, groups, bands, seeds, controls, margin, the claim, corpus, commit, wall times.
    """

    rows: pd.DataFrame
    kl: pd.DataFrame
    matching: pd.DataFrame
    tables: dict[str, pd.DataFrame]
    config: dict = field(default_factory=dict)


def _match_on_reference(model: Any, conds: list[Condition], ref: Windows, ref_base: Tensor, km: dict, cfg: Config,
                        progress: bool) -> tuple[list[Condition], list[dict]]:
    """Tune every control's α so that its mean clean-NLL damage on the REFERENCE windows equals
    destroy's there (:func:`match_alpha`); the analysed documents are never looked at."""
    def damage(cond: Condition) -> float:
        nll = torch.cat([nll_on_target(model, w.tokens, target_len=cfg.target(), batch_size=len(w), fwd_hooks=_hooks(
            model, cond.for_documents(w.doc_ids.tolist(), cfg.seed, cfg.redraw_controls), km))
            for w in _batches(ref, cfg.batch_size)])  # fmt: skip
        return float((nll - ref_base).mean())

    target = damage(conds[0])
    out = [conds[0]]
    rows = [dict(layers=conds[0].group, condition="destroy", alpha=conds[0].alpha, reference_damage=target,
                 destroy_reference_damage=target, n_evals=1, reached=True)]
    for c in conds[1:]:
        m = match_alpha(lambda a, c=c: damage(c.with_alpha(a)), target, start=c.alpha, alpha_max=c.alpha_max,
                        max_steps=cfg.match_steps)
        out.append(c.with_alpha(m["alpha"]))
        rows.append(dict(layers=c.group, condition=c.key, alpha=m["alpha"], reference_damage=m["damage"],
                         destroy_reference_damage=target, n_evals=m["n_evals"], reached=m["reached"]))
        if progress:
            tqdm.write(f"[causal] {c.group} {c.key}: alpha={m['alpha']:.4g} reference damage={m['damage']:.4f} "
                       f"(destroy {target:.4f}, {m['n_evals']} evals{'' if m['reached'] else ', NOT REACHED'})")
    return out, rows


def _passes(model: Any, ana: Windows, conds: list[Condition], km: dict, base_nll: Tensor, cfg: Config,
            reuse: pd.Series | None, on_partial: Callable[[pd.DataFrame], None] | None,
            progress: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every condition on every batch: its clean pass (attention KL against ``none`` in its edited
    layers) and one pass per (frac > 0, seed). Returns ``(rows, kl)`` (see :class:`CausalResult`)."""
    n, target = len(ana), cfg.target()
    batches = [list(range(s, min(s + cfg.batch_size, n))) for s in range(0, n, cfg.batch_size)]
    union = sorted({x for c in conds if c.intervention is not None for x in c.intervention.layers})
    kl = AttentionKL(union)
    frames, kls = [], []
    bar = tqdm(total=len(batches) * len(conds), desc="causal", disable=not progress)
    for b in batches:
        w = ana.subset(b)
        docs = w.doc_ids.tolist()
        for c in conds:
            kl.layers = union if c.key == "none" else list(c.intervention.layers)
            shared = reuse is not None and c.key == "none"
            cd = c.for_documents(docs, cfg.seed, cfg.redraw_controls)
            df, clean, kv = condition_rows(model, w, cd, k_means=km, target_len=target, fracs=(0.0,) if shared else
                                           cfg.fracs, seeds=cfg.seeds, base_seed=cfg.seed, kl=kl)  # fmt: skip
            if shared:  # the swapped passes of `none` are the trained T1 curve of this run's tolerance study
                df = _with_reused(df, reuse, b, clean, cfg.fracs, cfg.seeds)
            draws = dict(zip(range(len(b)), c.draws(docs, cfg.seed, cfg.redraw_controls)))
            df = df.assign(layers=c.group, condition=c.key, kind=c.kind, alpha=c.alpha,
                           draw=[draws[i] for i in df["seq"]], seq=[b[i] for i in df["seq"]])
            frames.append(df)
            kls.append(pd.DataFrame(dict(layers=c.group, condition=c.key, seq=b, attn_kl=kv.cpu().numpy())))
            bar.update(1)
        if on_partial is not None and b is not batches[-1]:
            on_partial(pd.concat(frames, ignore_index=True))
    bar.close()
    info = ana.frame()
    rows = pd.concat(frames, ignore_index=True).merge(info[["seq", "doc", "doc_name"]], on="seq", how="left")
    rows["base_clean_nll"] = base_nll.cpu().numpy()[rows["seq"].to_numpy()]
    cols = ["layers", "condition", "kind", "alpha", "draw", "seq", "doc", "doc_name", "frac", "seed", "clean_nll", "nll",
            "delta", "base_clean_nll"]
    kl_df = pd.concat(kls, ignore_index=True).merge(info[["seq", "doc"]], on="seq", how="left")
    return rows[cols], kl_df


def causal_study(
    model: Any, corpus: CorpusLike = None, cfg: Config | None = None, *, fast: Sequence[int] | None = None,
    slow: Sequence[int] | None = None, windows: tuple[Windows, Windows] | None = None,
    on_partial: Callable[[pd.DataFrame], None] | None = None, progress: bool = True, t12: T12Result | None = None,
    **options: Any,
) -> CausalResult:  # fmt: skip
    """The causal test of docs/method.md §5 with controls C1–C4, judged by docs/method.md §8 v2.

    Steps: (1) analysed windows and disjoint reference windows (:func:`posgen_tl.io.sampling.sample_windows`);
    k̄ of every edited layer from the reference windows' context part; (2) the unedited clean NLL of
    both; (3) per layer group, each control's α tuned to destroy's damage on the REFERENCE windows
    (:func:`match_alpha`, ≤ ``match_steps`` evaluations; random controls drawn per reference
    document); (4) every condition on the analysed windows: its clean pass (attention KL in its
    layers) and one pass per (frac > 0, seed), random controls drawn afresh per document; (5) the
    verdict tables (:func:`causal_tables`). ``on_partial(rows)`` receives the rows so far after every
    batch but the last (a long run writes them as they come).

    Args:
        cfg: :class:`Config` (default ``Config()``) with ``options`` applied.
        fast: band indices edited as fast (default: the first quarter of the bands; band 0 = fastest).
        slow: band indices kept as slow (default: the last quarter of the bands).
        windows: pre-built ``(analysed, reference)`` windows (default: sampled by ``cfg``).
        t12: a T1/T2 result (:func:`posgen_tl.experiments.tolerance.t1_t2_study`) of the same model
            on the same analysed windows, fractions, seeds and target: ``none`` then runs only its
            clean pass and takes its swapped NLLs from the trained T1 rows (a mismatch raises).

    Returns:
        :class:`CausalResult`.

    Raises:
        ValueError: bad options (named), overlapping reference/analysed documents, a ``t12`` that
            does not match.
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the causal study")
    t_start, commit = time.time(), git_commit(short=True)
    spec, _ = probe_hooks(model)
    groups = resolve_groups(cfg.groups, spec.n_layers)
    ana, ref = windows if windows is not None else sample_windows(
        model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref,
        seed=cfg.seed)
    if set(ana.doc_ids.tolist()) & set(ref.doc_ids.tolist()):
        raise ValueError("reference and analysed windows share documents")
    reuse = None if t12 is None else _t1_reuse(t12, ana, fracs=cfg.fracs, seeds=cfg.seeds, target_len=cfg.target(),
                                               seed=cfg.seed, mode="T1")
    target, times = cfg.target(), {}
    km = key_means(model, ref.tokens[:, : ref.tokens.shape[1] - target], sorted({x for g in groups.values() for x in g}),
                   batch_size=cfg.batch_size)
    base_nll = nll_on_target(model, ana.tokens, target_len=target, batch_size=cfg.batch_size)
    ref_base = nll_on_target(model, ref.tokens, target_len=target, batch_size=cfg.batch_size)
    t0 = time.time()
    conds, matching, bands = [Condition("none", None)], [], {}
    for label, layers in groups.items():
        nb, fast_b, slow_b = entry_bands(spec, layers, fast, slow)
        bands[label] = dict(layers=layers, n_bands=nb, fast=fast_b, slow=slow_b)
        cs, m = _match_on_reference(model, build_conditions(layers, fast_b, slow_b, alpha=cfg.alpha,
                                                            controls=cfg.controls, seed=cfg.seed, group=label),
                                    ref, ref_base, km, cfg, progress)
        conds += cs
        matching += m
    times["match_s"] = time.time() - t0
    t0 = time.time()
    rows, kl = _passes(model, ana, conds, km, base_nll, cfg, reuse, on_partial, progress)
    times["passes_s"] = time.time() - t0
    config = dict(cfg.as_dict(), model=spec.model_name, target_len=target, n_seq=len(ana), n_docs=ana.n_docs,
                  n_ref=len(ref), ref_docs=sorted(set(ref.doc_ids.tolist())), entries=bands,
                  none_swaps_from_t12=reuse is not None, commit=commit,
                  windows_sha1=windows_fingerprint(ana), claim_family=claim_family(cfg, spec.model_name, groups,
                                                                                   ana.n_docs),
                  swaps="p = fraction of disjoint adjacent pairs of the context swapped: ≈ 2p of the tokens move; "
                        "per-(sequence, seed) permutations")  # fmt: skip
    tables = causal_tables(rows, kl, config)
    config["wall_s"] = {**times, "total_s": time.time() - t_start}
    return CausalResult(rows, kl, pd.DataFrame(matching), tables, config)


# ----------------------------------------------------------------------------- verdict tables


def claim_family(cfg: Config, model_name: str, groups: dict[str, list[int]], n_docs: int) -> dict:
    """The claim's family as declared by ``cfg`` before the run (the ``claim_family`` of the run's
    config): this run's entries (``model`` × each group) with their controls and document count, the
    damage margin, whether random controls are redrawn per document, and the declared size of the
    whole claim (``cfg.claim``: entries of other runs included)."""
    mine = [f"{model_name}:{label}" for label in groups]
    claim = [str(c) for c in cfg.claim] or mine
    return dict(entries=[dict(model=model_name, layers=label, controls=list(cfg.controls), n_docs=int(n_docs))
                         for label in groups],
                damage_margin_rel=float(cfg.damage_margin), controls_redrawn_per_document=bool(cfg.redraw_controls),
                damage_rule=cfg.damage_rule, order="holm", claim=claim, claim_size=max(len(claim), len(mine)))


def _units_rows(rows: pd.DataFrame, model: str) -> pd.DataFrame:
    """The rows each entry's units are built from: its conditions plus the shared ``none``."""
    edited = rows[rows["condition"] != "none"]
    none = rows[rows["condition"] == "none"]
    parts = [edited] + [none.assign(layers=g) for g in edited["layers"].unique()]
    return pd.concat(parts, ignore_index=True).assign(model=model)


def causal_tables(rows: pd.DataFrame, kl: pd.DataFrame, config: dict) -> dict[str, pd.DataFrame]:
    """Every table of the causal test from its rows (pure; also what a re-analysis calls):

    * ``verdicts`` — one row per entry: destroy − none AUC (estimate, 95 % CIs), the
      intersection–union ``p``, ``p_holm`` over this run's entries, ``p_claim`` (Bonferroni bound over
      the declared claim until its other entries are run; equal to ``p_holm`` when the run covers
      the claim), counted / excluded controls, MDE, verdict, label;
    * ``components`` / ``damage`` / ``adjusted`` — what the rule looked at (:func:`posgen_tl.stats.verdicts.causal_verdict`);
    * ``contrasts`` — per fraction, AUC and slope: destroy − none, destroy − Ck, Ck − none
      (:func:`posgen_tl.stats.verdicts.tolerance_contrasts`);
    * ``summary`` — per entry and condition: damage, attention KL, ΔNLL per fraction, AUC, slope
      (document means with bootstrap and t intervals; descriptive);
    * ``interaction`` — with two or more entries, first vs each later one: (destroy − none) per
      document compared on the same documents.
    """
    model = config["model"]
    fam_cfg = config["claim_family"]
    family = verdicts.Family.from_config(fam_cfg)
    urows = _units_rows(rows, model)
    units = curves.document_units(urows, by=("model", "layers", "condition"))
    draws = urows.assign(draw=urows["draw"].astype("Int64").astype(str).where(urows["draw"].notna(), "fixed"))
    res = verdicts.causal_verdict(units, family, draws=verdicts.control_draws(draws[draws["condition"].isin(RANDOM_CONTROLS)]))
    v = res.verdicts.copy()
    m = int(fam_cfg["claim_size"])
    v["claim_size"] = m
    v["p_claim"] = np.minimum(1.0, v["p"] * m) if m > len(v) else v["p_holm"]
    v["p_claim_method"] = (f"Bonferroni bound over the declared claim of {m} entries (its other entries are other runs)"
                           if m > len(v) else v["p_adj_method"])
    v = claim_verdicts(v, family.alpha)
    contrasts = verdicts.tolerance_contrasts(units, family_size=m)
    kl_units = _kl_units(kl, model)
    summary = curves.unit_summary(pd.concat([units, kl_units], ignore_index=True), by=("model", "layers", "condition"))
    labels = list(units["layers"].unique())
    inter = [verdicts.interaction_contrast(units, {"model": model, "layers": labels[0]}, {"model": model, "layers": g})
             for g in labels[1:]]
    return dict(verdicts=v, components=res.components, damage=res.damage, adjusted=res.adjusted, contrasts=contrasts,
                summary=summary, interaction=pd.concat(inter, ignore_index=True) if inter else pd.DataFrame())


def claim_verdicts(v: pd.DataFrame, alpha: float) -> pd.DataFrame:
    """``v`` with each verdict read at the level of the declared claim: an entry that passes over this
    run's entries (``p_holm``) but not over the claim (``p_claim ≥ alpha``, the run covering only part
    of it) reads "no evidence", and its label says why. Idempotent."""
    out = v.copy()
    weak = out["verdict"].astype(str).str.startswith("depends") & ~(out["p_claim"] < alpha)
    out.loc[weak, "verdict"] = out.loc[weak, "verdict"].str.replace("depends", "no evidence", n=1)
    out.loc[weak, "label"] = [f"p over the declared claim = {p:.3g} ≥ {alpha:g} ({m}); " + str(lab)
                              for p, m, lab in zip(out.loc[weak, "p_claim"], out.loc[weak, "p_claim_method"],
                                                   out.loc[weak, "label"])]  # fmt: skip
    return out


def _kl_units(kl: pd.DataFrame, model: str) -> pd.DataFrame:
    """Attention KL per (entry, condition, document) as units (estimator ``attn_kl``, nats); ``none``'s
    KL is 0 by definition and is repeated for every entry."""
    edited = kl[kl["condition"] != "none"]
    none = kl[kl["condition"] == "none"]
    k = pd.concat([edited] + [none.assign(layers=g) for g in edited["layers"].unique()], ignore_index=True)
    g = k.groupby(["layers", "condition", "doc"], sort=False)["attn_kl"]
    out = g.mean().reset_index().rename(columns={"attn_kl": "value"})
    out["n_seqs"] = g.size().to_numpy()
    return out.assign(model=model, estimator="attn_kl", frac=np.nan)


# ----------------------------------------------------------------------------- report / study


NAME = "causal"
ABOUT = ("does T1 tolerance depend on the fast-band key offset beyond damage? destroy vs damage-matched controls "
         "C1–C4, per-fraction and AUC contrasts, intersection–union verdict (docs/method.md §5, §8)")
NEEDS: tuple[str, ...] = ()
TABLES = ("verdicts", "components", "damage", "adjusted", "contrasts", "summary", "interaction")


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
    """The causal test; writes its rows, KL, matching, every verdict table, its configuration and a
    figure (partial rows while it runs, removed when it completes)."""
    from posgen_tl.plot.causal import plot_causal_conditions  # noqa: PLC0415

    windows = base.or_skip(ctx, "causal_config.json", "causal test", sample_windows, ctx.model, cfg.corpus,
                           n_seq=cfg.n_seq, seq_len=cfg.seq_len, n_ref=cfg.n_ref, seed=cfg.seed)
    if windows is None:
        return
    ana, ref = windows
    res = causal_study(ctx.model, cfg.corpus, cfg, windows=(ana, ref), t12=_reusable_t12(ctx, cfg),
                       on_partial=lambda rows: ctx.work.save_df("causal_partial_rows.csv", rows))
    ctx.work.path("causal_partial_rows.csv").unlink(missing_ok=True)  # complete now: no partial table beside
    ctx.work.save_df("causal_rows.csv", res.rows)
    ctx.work.save_df("causal_kl.csv", res.kl)
    ctx.work.save_df("causal_matching.csv", res.matching)
    for name in TABLES:
        ctx.work.save_df(f"causal_{name}.csv", res.tables[name])
    ctx.work.save_json("causal_config.json", res.config)
    ctx.work.save_fig("fig_causal.png", plot_causal_conditions(res.tables["summary"], res.tables["contrasts"],
                                                               title=ctx.model_name))


def _load(ctx: Any, name: str) -> pd.DataFrame:
    try:
        return ctx.work.load_df(f"causal_{name}.csv")
    except pd.errors.EmptyDataError:  # an empty table (e.g. no interaction with one entry) is written headerless
        return pd.DataFrame()


def _condition_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Per entry and condition: damage, attention KL, ΔNLL per fraction, AUC and slope as
    'estimate [ci_low, ci_high]' (95 % document bootstrap)."""
    s = summary.copy()
    s["what"] = np.where(s["estimator"] == "dnll", "ΔNLL@" + s["frac"].map(lambda f: f"{f:g}"), s["estimator"])
    s["cell"] = [f"{e:.4g} [{lo:.3g}, {hi:.3g}]" for e, lo, hi in zip(s["estimate"], s["ci_low"], s["ci_high"])]
    order = ["damage", "attn_kl", *sorted({w for w in s["what"] if w.startswith("ΔNLL")}, key=lambda w: float(w[5:])),
             "auc", "slope"]
    t = s.pivot_table(index=["layers", "condition"], columns="what", values="cell", aggfunc="first", sort=False)
    t = t[[c for c in order if c in t.columns]].reset_index()
    n = s.groupby(["layers", "condition"], sort=False)["n_docs"].first().reset_index()
    return t.merge(n, on=["layers", "condition"])


def render(ctx: Any, cfg: Config) -> Any:
    """The report section: the verdict per entry, the conditions, damage equivalence, the per-fraction
    and AUC contrasts, the interaction between entries, and the figure."""
    from posgen_tl.report.html import Section, skipped_section  # noqa: PLC0415

    config = ctx.work.load_json("causal_config.json")
    title = "5 · Does tolerance depend on the pattern? The causal test (docs/method.md §5, §8)"
    if "skipped" in config:
        return skipped_section(title, config["skipped"], "causal", config.get("hint"))
    v, dmg, con = _load(ctx, "verdicts"), _load(ctx, "damage"), _load(ctx, "contrasts")
    inter, summary = _load(ctx, "interaction"), _load(ctx, "summary")
    fam = config["claim_family"]
    v = claim_verdicts(v, verdicts.Family.from_config(fam).alpha)
    verdict = "; ".join(f"{r.layers}: {r.verdict} (destroy − none AUC {r.estimate:+.3g} nats × p "
                        f"[{r.ci_low:+.3g}, {r.ci_high:+.3g}], intersection–union p = {r.p:.3g}, p over the claim "
                        f"= {r.p_claim:.3g})" for r in v.itertuples())  # fmt: skip
    vcols = ["layers", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind", "p_holm", "p_claim", "p_claim_method",
             "counted_controls", "excluded_controls", "mde", "n_docs", "n_seqs", "verdict", "label"]
    ccols = ["layers", "contrast", "estimator", "frac", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind",
             "p_holm", "holm_scope", "mde", "n_docs", "label"]
    dcols = ["layers", "control", "estimate", "ci_low", "ci_high", "ci_level", "p", "damage", "control_damage",
             "margin_rel", "matched", "n_docs"]
    paras = [
        f"{config['n_seq']} sequences from {config['n_docs']} documents; keys edited per entry: "
        + "; ".join(f"{k} (fast bands {e['fast']}, slow bands {e['slow']})" for k, e in config["entries"].items())
        + f". destroy = remove the fast-band key offset at α = {config['alpha']}; controls {config['controls']} each tuned "
        f"to destroy's damage on {config['n_ref']} windows of the reference documents (never the analysed ones); "
        f"random controls drawn {'afresh per document' if config['redraw_controls'] else 'once'}. Swap fractions "
        f"p ∈ {config['fracs']} (≈ 2p of the context tokens move), seeds {config['seeds']}, target {config['target_len']} "
        "tokens.",
        f"Rule (declared before the run): 'depends' only if destroy ≠ none on the AUC AND destroy differs from EVERY "
        f"counted control in the same direction — each control's damage matched by TOST at ±{fam['damage_margin_rel']:g} "
        "of destroy's, else the contrast is damage-adjusted (per-document regression on the damage gap); p = the "
        "largest required p (intersection–union); Holm over this run's entries; the claim declares "
        f"{fam['claim_size']} entries ({', '.join(fam['claim'])}). A control that moves tolerance by itself against "
        "destroy is reported and not counted. The AUC (area under ΔNLL over p from p = 0) is the primary summary; "
        "the slope, which weighs small p negatively, is secondary. 'no evidence' is not evidence of no effect: the MDE "
        "column says what this n could detect.",
    ]
    tables = [("Verdict per entry (intersection–union; p_claim over the declared claim)", v[[c for c in vcols if c in v]]),
              ("Per entry and condition: damage, attention KL, ΔNLL per fraction, AUC, slope (mean [95 % document "
               "bootstrap])", _condition_table(summary)),
              ("Damage: each control vs destroy, TOST on the ratio (90 % Fieller interval of ratio − 1)",
               dmg[[c for c in dcols if c in dmg]]),
              ("Contrasts per fraction (Holm over the fractions), AUC and slope", con[[c for c in ccols if c in con]])]
    if len(inter):
        tables.append(("Interaction between entries on the same documents: (destroy − none) first − later", inter))
    expl = config["n_docs"] < curves.EXPLORATORY_MIN_DOCS
    return Section(title + (" — EXPLORATORY (fewer than 32 documents)" if expl else ""), verdict=verdict,
                   paragraphs=paras, tables=tables,
                   details=[("Components of each verdict", _load(ctx, "components")),
                            ("Controls' strengths tuned on the reference windows", _load(ctx, "matching"))],
                   figures=[(ctx.work.path("fig_causal.png").read_bytes(), "ΔNLL over the swap fraction per condition "
                             "(document means, 95 % bootstrap), and each contrast's AUC with its interval")],
                   findings=_findings(v), results={"exploratory": bool(expl), "verdicts": v.to_dict("records")})


def _findings(v: pd.DataFrame) -> list:
    """One headline per entry: the verdict, destroy − none AUC with its 95 % interval, the p over the
    declared claim, n = documents."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415

    return [Finding("causal", str(r.verdict).replace(" (exploratory)", ""), float(r.estimate),
                    f"destroy − none AUC {r.layers} (nats × p)", (float(r.ci_low), float(r.ci_high)), float(r.p_claim),
                    int(r.n_docs), note=f"{r.layers}; intersection–union p {r.p:.3g}; {r.p_claim_method}")
            for r in v.itertuples()]
