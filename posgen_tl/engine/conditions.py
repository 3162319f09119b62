"""The conditions of the causal test (docs/method.md §5) and their passes: the intervention ``destroy`` and the
controls C1–C4 as :class:`Condition` objects, their per-document random draws, the layer groups (entries) and
band sets they edit, the tuning of a strength to a damage (:func:`match_alpha`), the attention change
(:class:`AttentionKL`) and one condition's clean and swapped passes (:func:`condition_rows`). Not an experiment.

- C1 ``random_bands``: the same per-token change moved to random other bands, random phases;
- C2 ``destroy`` in the slow bands;
- C3 ``rephase``: the fast-band offset turned by a random angle per band (keeps |k̄|, ρ);
- C4 ``noise``: same-norm random-phase noise in the same fast bands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from posgen_tl.engine.swaps import Prefixes, curve_rows, nll_on_target
from posgen_tl.experiments import base
from posgen_tl.hooks.chunked import chunk_range, chunk_safe
from posgen_tl.hooks.edits import Intervention, intervention_hooks
from posgen_tl.hooks.stream import pattern_hooks
from posgen_tl.io.sampling import Windows
from posgen_tl.stats.verdicts import layers_label

__all__ = ["CONTROLS", "RANDOM_CONTROLS", "CONTROL_TEXT", "Condition", "draw_seed", "build_conditions",
           "resolve_groups", "entry_bands", "match_alpha", "AttentionKL", "StackedKL", "PairedKL", "attention_kl", "condition_rows", "edit_hooks", "first_edited"]


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

    def edit(self) -> Intervention:
        """The condition's edit. Raises ValueError for the unedited ``none``."""
        if self.intervention is None:
            raise ValueError(f"condition {self.key!r} edits nothing")
        return self.intervention

    def with_alpha(self, a: float) -> Condition:
        """This condition at strength ``a``."""
        return dataclasses.replace(self, intervention=self.edit().with_alpha(a))

    def draws(self, docs: Sequence[int], seed: int, redraw: bool) -> list[int | None]:
        """The draw id (the seed of its random edit) of each document; ``None`` for a fixed edit."""
        if not self.random:
            return [None] * len(docs)
        return [draw_seed(seed, self.key, d) if redraw else int(self.edit().seed) for d in docs]

    def for_documents(self, docs: Sequence[int], seed: int, redraw: bool) -> Condition:
        """This condition with one random draw per document of a batch (``redraw``), else itself."""
        if not (self.random and redraw):
            return self
        seeds = [draw_seed(seed, self.key, d) for d in docs]
        return dataclasses.replace(self, intervention=self.edit().with_row_seeds(seeds))


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
        label = layers_label(layers)
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


def _hooks(model: Any, cond: Condition, km: dict | None) -> list:
    return [] if cond.intervention is None else intervention_hooks(model, cond.intervention, km)


def edit_hooks(model: Any, conditions: Sequence[Condition], k_means: dict | None) -> list:
    """Every hook of the ``conditions``' edits at their own strengths, in order (to ask, e.g., whether all of them are
    chunk-safe). Raises ValueError for a condition that edits nothing."""
    return [h for c in conditions for h in intervention_hooks(model, c.edit(), k_means)]


def match_alpha(
    damage_fn: Callable[[float], float], target: float, *, start: float = 1.0, alpha_max: float = 8.0,
    max_steps: int = 5, rel_tol: float = 0.05,
) -> dict[str, Any]:  # fmt: skip
    """Find ``alpha`` with ``damage_fn(alpha) ≈ target`` (damage assumed to grow with alpha).

    Bracketing from ``start`` upwards, then false-position (secant inside the bracket; a bisection
    step where it stalls), at most ``max_steps`` evaluations in all. Each bracketing step grows α by
    ``√(target / damage)·1.25`` — the factor that reaches the target if damage grows like α², as a
    small edit's does — clipped to ×2 … ×8 (×8 while the damage is still 0), never past
    ``alpha_max``; so a control that needs α ≈ 25 is bracketed in three evaluations, not six.
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
        grow = 8.0 if d_hi <= 0 else min(max(math.sqrt(target / d_hi) * 1.25, 2.0), 8.0)
        hi = min(grow * hi, alpha_max)
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


class StackedKL:
    """:class:`AttentionKL`'s compare mode for ONE forward that holds several conditions side by side in its batch:
    rows ``i·n_seq … (i+1)·n_seq − 1`` are condition ``i``'s edited copy of the same ``n_seq`` sequences, compared with
    the unedited patterns ``ref`` (``{layer: [n_seq, head_index, query_pos, key_pos]}``, recorded by an
    :class:`AttentionKL` in reference mode) on that condition's own ``layers_per[i]`` — the same numbers as one
    :class:`AttentionKL` per condition, each condition's rows a slice of the stacked pattern."""

    def __init__(self, ref: dict[int, Tensor], layers_per: Sequence[Sequence[int]], n_seq: int):
        self.ref, self.per, self.n_seq = ref, [list(x) for x in layers_per], int(n_seq)
        self.layers = sorted({x for ls in self.per for x in ls})
        missing = [x for x in self.layers if x not in ref]
        if missing:
            raise ValueError(f"no unedited attention patterns of layers {missing} to compare with")
        self.acc: dict[int, dict[int, Tensor]] = {}
        self.mode = "compare"

    def __call__(self, layer: int, pat: Float[Tensor, "batch head_index query_pos key_pos"]) -> None:
        b = self.n_seq
        if pat.shape[0] != b * len(self.per):
            raise ValueError(f"layer {layer}: a pattern of {pat.shape[0]} sequences, expected {len(self.per)} "
                             f"conditions × {b}")
        self.acc[layer] = {i: attention_kl(self.ref[layer], pat[i * b : (i + 1) * b])
                           for i, ls in enumerate(self.per) if layer in ls}

    def per_sequence(self) -> Float[Tensor, "batch"]:
        """``[conditions · n_seq]``: each condition's per-sequence mean over its layers, condition by condition."""
        out = []
        for i, ls in enumerate(self.per):
            missing = [x for x in ls if i not in self.acc.get(x, {})]
            if missing:
                raise RuntimeError(f"attention patterns of layers {missing} were not captured")
            out.append(torch.stack([self.acc[x][i] for x in ls]).mean(0))
        return torch.cat(out)


class PairedKL:
    """KL(clean ‖ edited) of attention rows in ``layers`` from ONE forward whose batch holds ``n_seq`` sequences
    unedited (rows ``0 … n_seq − 1``) and the same sequences edited (the next ``n_seq`` rows): each layer's pattern
    rows are compared as they come, so nothing of ``[batch, heads, n, n]`` is kept and the forward may run in chunks
    (:func:`posgen_tl.hooks.chunked.chunk_range` says which query rows a chunk holds). The same per-sequence mean as
    :class:`AttentionKL` (heads, query rows ``1 … N−1``, layers), its sums in float64."""

    def __init__(self, layers: Sequence[int], n_seq: int):
        self.layers, self.n_seq = list(layers), int(n_seq)
        self.sums: dict[int, Tensor] = {}
        self.rows: dict[int, int] = {}

    def __call__(self, layer: int, pat: Float[Tensor, "batch head_index query_pos key_pos"]) -> None:
        b = self.n_seq
        if pat.shape[0] != 2 * b:
            raise ValueError(f"layer {layer}: a pattern of {pat.shape[0]} sequences, expected {b} unedited + {b} edited")
        c0, _, _ = chunk_range(pat.shape[-2])
        skip = 1 if c0 == 0 else 0  # row 0 (one key: KL ≡ 0) is left out, as in attention_kl
        total = torch.zeros(b, dtype=torch.float64, device=pat.device)
        for h in range(pat.shape[1]):  # a head at a time: float64 rows of [batch, rows, keys], not of every head
            p, q = pat[:b, h, skip:].double(), pat[b:, h, skip:].double()
            total += (torch.xlogy(p, p) - torch.xlogy(p, q.clamp_min(1e-30))).sum(-1).clamp_min(0).sum(-1)
        self.sums[layer] = self.sums.get(layer, 0) + total
        self.rows[layer] = self.rows.get(layer, 0) + pat.shape[1] * (pat.shape[-2] - skip)

    def per_sequence(self) -> Float[Tensor, "batch"]:
        """Per sequence: the mean over the layers of each one's mean KL over heads and query rows (float32, CPU)."""
        missing = [lay for lay in self.layers if lay not in self.sums]
        if missing:
            raise RuntimeError(f"attention patterns of layers {missing} were not captured")
        return torch.stack([self.sums[lay] / self.rows[lay] for lay in self.layers]).mean(0).float().cpu()

    def hooks(self, model: Any) -> list:
        """Read-only pattern hooks of ``layers`` feeding this accumulator (chunk-safe)."""
        return [(name, chunk_safe(fn)) for name, fn in pattern_hooks(model, self.layers, self)]


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
    kl: AttentionKL | StackedKL | None = None, base: Tensor | None = None, prefix: Prefixes | None = None,
    hooks: list | None = None,
) -> tuple[pd.DataFrame, Tensor, Tensor | None]:  # fmt: skip
    """Rows of one condition on one batch of windows: the clean pass (with attention capture
    when ``kl`` is given) and one pass per (frac > 0, seed).

    ``hooks``: the edit's hooks instead of ``cond``'s own — several conditions stacked in the batch
    (:func:`posgen_tl.hooks.edits.hooks_on_rows`, with a :class:`StackedKL`; ``cond`` then names the stack's first
    edited layer and its kind).

    ``prefix``: the unedited passes' residuals (``{"clean" or (frac, seed): {layer: resid}}``, recorded at
    the condition's first edited layer by :func:`posgen_tl.engine.swaps.curve_rows`): every pass resumes
    there instead of recomputing the unedited blocks below it (the same numbers up to float rounding).

    Returns ``(rows, clean_nll [batch], kl [batch] or None)``; rows have ``seq`` = position in
    ``windows`` (the caller maps it to global ids), ``frac, seed, clean_nll, nll, delta``."""
    hooks = _hooks(model, cond, k_means) if hooks is None else hooks
    bs = windows.tokens.shape[0]
    kl_vals = None
    extra = [] if kl is None else pattern_hooks(model, kl.layers, kl)
    if kl is not None:
        kl.mode = "reference" if cond.key == "none" else "compare"
        kl.acc = {}
    start = first_edited(cond) if prefix is not None else None
    at = None if start is None else (start, prefix["clean"][start])  # type: ignore[index]
    clean = nll_on_target(model, windows.tokens, target_len=target_len, fwd_hooks=hooks + extra, batch_size=bs,
                          resid_at=at)
    if kl is not None:
        kl_vals = torch.zeros(bs) if cond.key == "none" else kl.per_sequence()
    rows = curve_rows(model, windows, clean, fracs=fracs, seeds=seeds, mode=mode, target_len=target_len,
                      base_seed=base_seed, fwd_hooks=hooks,
                      resume=None if start is None else (start, prefix))  # type: ignore[arg-type]
    return pd.DataFrame(rows), clean, kl_vals


def first_edited(cond: Condition) -> int | None:
    """The lowest layer ``cond`` edits (``None``: no edit, or an edit of every layer)."""
    layers = None if cond.intervention is None else cond.intervention.layers
    return min(int(x) for x in layers) if layers else None
