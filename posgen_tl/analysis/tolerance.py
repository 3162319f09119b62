"""Position tolerance (METHOD.md §4) and the causal test of §5, as tidy DataFrames.

T1 swaps adjacent tokens in the context, T2 applies the same swaps to position ids only, T3
reads NLL by position with/without an LM-Infinite distance cap. Tolerance of a model (or of
a model under an :class:`~posgen_tl.interventions.Intervention`) is the least-squares slope of
ΔNLL (target span) over the swap fraction ``p``, with a bootstrap CI over sequences.

Units and CIs: the unit is a sequence (seeds are averaged within a sequence first); every
CI is a 95 % percentile bootstrap over sequences, paired wherever two conditions share them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from ..interventions import (
    Intervention,
    StopForward,
    distance_cap_hooks,
    final_residual_hook,
    intervention_hooks,
    key_means,
)
from ..capture import check_tokens, probe_hooks
from ..perturb import (
    adjacent_swap_permutation,
    nll_from_logits,
    position_ids_for_permutation,
    word_units,
)
from ..stats import bootstrap_ci, slope_ci

__all__ = [
    "nll_on_target",
    "transposition_curve",
    "curve_summary",
    "t1_vs_t2",
    "length_curve",
    "length_summary",
    "tolerance_rows",
    "summarize_tolerance",
    "tolerance_under_intervention",
    "clean_damage",
    "matched_alpha",
    "causal_table",
]

DEFAULT_FRACS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
Hooks = Sequence[tuple[str, Callable]]


# ----------------------------------------------------------------------------- NLL


def _target_nll(model, batch, target_len, pos, hooks) -> Tensor:
    n = batch.shape[1]
    store: dict = {}
    fin = final_residual_hook(model, store, n - target_len - 1, n - 1)
    kw = {} if pos is None else {"position_ids": pos}
    with model.hooks(fwd_hooks=list(hooks) + ([fin] if fin else [])):
        try:
            logits = model(batch, **kw)
        except StopForward:
            logits = model.unembed(store["resid"])
    if fin is None:
        logits = logits[:, n - target_len - 1 : n - 1]
    return nll_from_logits(torch.cat([logits, logits[:, :1]], 1), batch[:, n - target_len - 1 :]).mean(-1)


@torch.no_grad()
def nll_on_target(
    model: Any, tokens: Int[Tensor, "batch pos"], *, target_len: int,
    position_ids: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    fwd_hooks: Hooks = (), batch_size: int = 4,
) -> Float[Tensor, "batch"]:  # fmt: skip
    """Mean next-token NLL of the last ``target_len`` tokens of each sequence (float32, CPU).

    Only the span's logits are computed (final residual captured, then unembedded), so a
    262k vocabulary costs ``target_len`` rows per sequence. ``fwd_hooks`` are attached.
    """
    tokens = check_tokens(model, tokens, probe_hooks(model)[0])
    if not 0 < target_len < tokens.shape[1]:
        raise ValueError(f"target_len={target_len} must be in (0, {tokens.shape[1]})")
    out = []
    for s in range(0, tokens.shape[0], batch_size):
        batch = tokens[s : s + batch_size]
        pos = None
        if position_ids is not None:
            p = position_ids.to(batch.device)
            pos = p.expand(batch.shape[0], -1) if p.ndim == 1 else p[s : s + batch.shape[0]]
        out.append(_target_nll(model, batch, target_len, pos, fwd_hooks).float().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------- T1 / T2


def _perms(model, tokens, frac, seed, start, stop, word_level) -> Int[Tensor, "batch pos"]:
    n = tokens.shape[1]
    if not word_level:
        return adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=seed).expand(tokens.shape[0], -1)
    out = []
    for row in tokens.cpu():
        units = word_units(model.tokenizer.convert_ids_to_tokens(row.tolist()))
        out.append(adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=seed, units=units))
    return torch.stack(out)


def transposition_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, fracs: Sequence[float] = DEFAULT_FRACS,
    seeds: Sequence[int] = (0, 1), target_len: int = 64, word_level: bool = False,
    fwd_hooks: Hooks = (), modes: Sequence[str] = ("T1",), batch_size: int = 4, start: int = 1,
    clean: Tensor | None = None, progress: bool = True,
) -> pd.DataFrame:  # fmt: skip
    """T1 (tokens swapped) and/or T2 (same swaps as position ids) curves, one row per
    (mode, sequence, frac, seed): ``clean_nll``, ``nll``, ``delta`` (= nll − clean_nll).

    Swaps only in ``[start, N − target_len)`` (token 0 never moves). ``p = 0`` reuses the
    clean pass (delta exactly 0). ``clean`` may pass precomputed clean NLLs.
    """
    n = tokens.shape[1]
    if clean is None:
        clean = nll_on_target(model, tokens, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
    rows = []
    jobs = [(m, f, s) for m in modes for f in fracs for s in seeds]
    for mode, frac, seed in tqdm(jobs, desc="T1/T2", disable=not progress, leave=False):
        if mode not in ("T1", "T2"):
            raise ValueError(f"mode must be 'T1' or 'T2', got {mode!r}")
        if frac == 0:
            nll = clean
        else:
            perm = _perms(model, tokens, frac, seed, start, n - target_len, word_level)
            if mode == "T1":
                toks = torch.gather(tokens, 1, perm.to(tokens.device))
                nll = nll_on_target(model, toks, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
            else:
                pid = torch.stack([position_ids_for_permutation(p) for p in perm])
                nll = nll_on_target(model, tokens, target_len=target_len, position_ids=pid,
                                    fwd_hooks=fwd_hooks, batch_size=batch_size)
        for i in range(tokens.shape[0]):
            rows.append(dict(mode=mode, seq=i, frac=float(frac), seed=int(seed), clean_nll=float(clean[i]),
                             nll=float(nll[i]), delta=float(nll[i] - clean[i])))
    return pd.DataFrame(rows)


def _per_seq(df: pd.DataFrame, value: str = "delta") -> tuple[np.ndarray, np.ndarray]:
    """``(p [n_p], y [n_seq, n_p])``: seeds averaged within each sequence."""
    w = df.groupby(["seq", "frac"])[value].mean().unstack("frac").sort_index(axis=1)
    return w.columns.to_numpy(float), w.to_numpy(float)


def curve_summary(df: pd.DataFrame, by: Sequence[str] = ("mode",)) -> pd.DataFrame:
    """Tidy summary per group and ``frac``: estimator ``'dnll'`` (mean ΔNLL) and ``'slope'``
    (ΔNLL per unit p, frac = NaN) with ``value, ci_low, ci_high, n_seq``."""
    rows = []
    for key, g in df.groupby(list(by), sort=False):
        key = key if isinstance(key, tuple) else (key,)
        base = dict(zip(by, key))
        p, y = _per_seq(g)
        for j, f in enumerate(p):
            m, lo, hi = bootstrap_ci(y[:, j])
            rows.append({**base, "estimator": "dnll", "frac": f, "value": m, "ci_low": lo, "ci_high": hi, "n_seq": len(y)})
        s, lo, hi = slope_ci(p, y)
        rows.append({**base, "estimator": "slope", "frac": np.nan, "value": s, "ci_low": lo, "ci_high": hi, "n_seq": len(y)})
    return pd.DataFrame(rows)


def t1_vs_t2(df: pd.DataFrame) -> pd.DataFrame:
    """Paired T1 − T2 difference of ΔNLL per frac and of the slope (CI over sequences).
    ``alike`` is True where the CI contains 0."""
    p1, y1 = _per_seq(df[df["mode"] == "T1"])
    p2, y2 = _per_seq(df[df["mode"] == "T2"])
    if not np.array_equal(p1, p2):
        raise ValueError("T1 and T2 were run at different fracs")
    rows = []
    for j, f in enumerate(p1):
        if f == 0:
            continue
        m, lo, hi = bootstrap_ci(y1[:, j], paired_with=y2[:, j])
        rows.append(dict(estimator="dnll", frac=f, value=m, ci_low=lo, ci_high=hi, alike=lo <= 0 <= hi))
    s, lo, hi = slope_ci(p1, y1 - y2)
    rows.append(dict(estimator="slope", frac=np.nan, value=s, ci_low=lo, ci_high=hi, alike=lo <= 0 <= hi))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- T3


@torch.no_grad()
def length_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, cap: int | None = None, bucket: int = 64,
    batch_size: int = 1, fwd_hooks: Hooks = (),
) -> pd.DataFrame:  # fmt: skip
    """T3: mean NLL per position bucket, one row per (sequence, bucket): ``cap`` (None or
    int), ``bucket_start``, ``nll``. With ``cap`` the attention logits are recomputed with
    distance ``min(i − j, cap)`` (:func:`posgen_tl.interventions.distance_cap_hooks`)."""
    tokens = check_tokens(model, tokens, probe_hooks(model)[0])
    hooks = list(fwd_hooks) + (distance_cap_hooks(model, cap) if cap is not None else [])
    rows = []
    for s in range(0, tokens.shape[0], batch_size):
        batch = tokens[s : s + batch_size]
        with model.hooks(fwd_hooks=hooks):
            nll = nll_from_logits(model(batch), batch).float().cpu()  # predicts tokens 1..N-1
        for i in range(batch.shape[0]):
            for b0 in range(0, nll.shape[1], bucket):
                rows.append(dict(cap=cap, seq=s + i, bucket_start=b0 + 1, nll=float(nll[i, b0 : b0 + bucket].mean())))
    return pd.DataFrame(rows)


def length_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Mean NLL per (cap, bucket) with bootstrap CI over sequences."""
    rows = []
    for (cap, b0), g in df.assign(cap=df["cap"].fillna(-1)).groupby(["cap", "bucket_start"]):
        m, lo, hi = bootstrap_ci(g.sort_values("seq")["nll"].to_numpy())
        rows.append(dict(cap=None if cap == -1 else int(cap), bucket_start=b0, value=m, ci_low=lo, ci_high=hi, n_seq=len(g)))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- §5 causal test


def clean_damage(model, tokens, intervention, *, k_means, target_len=64, base=None, batch_size=4) -> float:
    """Mean clean-NLL increase caused by ``intervention`` (``base`` = clean NLL without it)."""
    base = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size) if base is None else base
    nll = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size,
                        fwd_hooks=intervention_hooks(model, intervention, k_means))
    return float((nll - base).mean())


def matched_alpha(
    model: Any, tokens: Tensor, intervention: Intervention, target_damage: float, *,
    k_means: dict, target_len: int = 64, base: Tensor | None = None, rel_tol: float = 0.05,
    max_iter: int = 7, batch_size: int = 4, alpha_max: float = 8.0,
) -> tuple[float, float]:  # fmt: skip
    """Bisection on ``alpha`` so that ``clean_damage(intervention at alpha) ≈ target_damage``.

    Assumes damage grows with alpha. For a ``random_bands`` control the upper end doubles
    from 1 up to ``alpha_max`` until the damage exceeds the target. Returns
    ``(alpha, damage)``; the largest alpha tried when even that does less damage (the caller
    must report the mismatch: :func:`causal_table` flags it).
    """
    base = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size) if base is None else base
    dmg = lambda a: clean_damage(model, tokens, intervention.with_alpha(a), k_means=k_means,  # noqa: E731
                                 target_len=target_len, base=base, batch_size=batch_size)
    hi, d_hi = 1.0, dmg(1.0)
    while d_hi <= target_damage and intervention.kind == "random_bands" and hi < alpha_max:
        hi = min(2 * hi, alpha_max)
        d_hi = dmg(hi)
    if d_hi <= target_damage:
        return hi, d_hi
    lo, best = 0.0, (hi, d_hi)
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        d = dmg(mid)
        if abs(d - target_damage) < abs(best[1] - target_damage):
            best = (mid, d)
        if abs(d - target_damage) <= rel_tol * max(abs(target_damage), 1e-3):
            return mid, d
        lo, hi = (mid, hi) if d < target_damage else (lo, mid)
    return best


def tolerance_rows(
    model: Any, tokens: Tensor, interventions: Sequence[Intervention], *, k_means: dict | None = None,
    fracs: Sequence[float] = (0.0, 0.05, 0.1, 0.2), seeds: Sequence[int] = (0, 1), target_len: int = 64,
    mode: str = "T1", batch_size: int = 4, include_none: bool = True, base: Tensor | None = None,
) -> pd.DataFrame:  # fmt: skip
    """Per-sequence rows of the T1/T2 curve under each intervention (plus ``none``):
    ``intervention, kind, alpha, mode, seq, frac, seed, clean_nll, nll, delta, base_clean_nll``.

    ``base``: the clean target NLL without intervention (:func:`nll_on_target`), if already
    computed — saves one forward pass over ``tokens``."""
    if k_means is None and any(iv.kind != "noop" for iv in interventions):
        k_means = key_means(model, tokens[:, : tokens.shape[1] - target_len])
    if base is None:
        base = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size)
    todo = ([None] if include_none else []) + list(interventions)
    frames = []
    for iv in tqdm(todo, desc="interventions", leave=False):
        hooks = [] if iv is None else intervention_hooks(model, iv, k_means)
        clean = base if iv is None else nll_on_target(model, tokens, target_len=target_len, fwd_hooks=hooks,
                                                      batch_size=batch_size)
        df = transposition_curve(model, tokens, fracs=fracs, seeds=seeds, target_len=target_len, fwd_hooks=hooks,
                                 modes=(mode,), batch_size=batch_size, clean=clean, progress=False)
        df.insert(0, "intervention", "none" if iv is None else iv.label)
        df.insert(1, "kind", "none" if iv is None else iv.kind)
        df.insert(2, "alpha", 0.0 if iv is None else float(iv.alpha))
        df["base_clean_nll"] = df["seq"].map(lambda i: float(base[i]))
        frames.append(df)
    return pd.DataFrame(pd.concat(frames, ignore_index=True))


def _ratio_ci(num: np.ndarray, den: np.ndarray, n_boot=2000, seed=0) -> tuple[float, float, float]:
    """mean(num)/mean(den) with a paired bootstrap over units (NaN if den ≈ 0)."""
    if abs(den.mean()) < 1e-2:  # < 0.01 nats of damage: ratio meaningless
        return np.nan, np.nan, np.nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(num), size=(n_boot, len(num)))
    r = num[idx].mean(1) / den[idx].mean(1)
    lo, hi = np.nanquantile(r, [0.025, 0.975])
    return float(num.mean() / den.mean()), float(lo), float(hi)


def summarize_tolerance(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per intervention: clean NLL, damage (paired CI), ΔNLL at each p, slope (CI),
    slope change vs ``none`` (paired CI) and that change per unit of damage (ratio CI)."""
    out, ref = [], None
    if "none" in set(rows["intervention"]):
        _, ref = _per_seq(rows[rows["intervention"] == "none"])
    for label, g in rows.groupby("intervention", sort=False):
        p, y = _per_seq(g)
        cl = g.groupby("seq")["clean_nll"].first().to_numpy()
        bl = g.groupby("seq")["base_clean_nll"].first().to_numpy()
        dmg = bootstrap_ci(cl, paired_with=bl)
        s = slope_ci(p, y)
        row = dict(intervention=label, kind=g["kind"].iloc[0], alpha=g["alpha"].iloc[0], mode=g["mode"].iloc[0],
                   n_seq=len(y), n_seeds=g["seed"].nunique(), clean_nll=float(cl.mean()),
                   damage=dmg[0], damage_lo=dmg[1], damage_hi=dmg[2], slope=s[0], slope_lo=s[1], slope_hi=s[2])
        for j, f in enumerate(p):
            if f > 0:
                m, lo, hi = bootstrap_ci(y[:, j])
                row.update({f"dnll@{f:g}": m, f"dnll@{f:g}_lo": lo, f"dnll@{f:g}_hi": hi})
        if ref is not None and label != "none":
            d = slope_ci(p, y - ref)
            pc = p - p.mean()
            per_seq_dslope = (y - ref) @ pc / (pc @ pc)
            nr = _ratio_ci(per_seq_dslope, cl - bl)
            row.update(dslope=d[0], dslope_lo=d[1], dslope_hi=d[2], dslope_per_damage=nr[0],
                       dslope_per_damage_lo=nr[1], dslope_per_damage_hi=nr[2])
        out.append(row)
    res = pd.DataFrame(out)
    res.attrs["rows"] = rows
    return res


def tolerance_under_intervention(model, tokens, interventions, *, k_means=None, fracs=(0.0, 0.05, 0.1, 0.2),
                                 seeds=(0, 1), target_len=64, mode="T1", batch_size=4) -> pd.DataFrame:
    """:func:`tolerance_rows` then :func:`summarize_tolerance` (rows kept in ``.attrs['rows']``)."""
    return summarize_tolerance(tolerance_rows(model, tokens, interventions, k_means=k_means, fracs=fracs,
                                              seeds=seeds, target_len=target_len, mode=mode, batch_size=batch_size))


def causal_table(df: pd.DataFrame, pairs: dict[str, str], *, match_tol: float = 0.2) -> pd.DataFrame:
    """Intervention vs its damage-matched control: ``pairs = {intervention_label: control_label}``.

    ``df`` = output of :func:`summarize_tolerance` (per-sequence rows in ``attrs['rows']``)
    or the rows themselves. ``verdict`` is ``'depends'`` only where the two slope CIs do not
    overlap or the paired (same sequences, seeds, swaps) slope-difference CI excludes 0;
    otherwise ``'no evidence'`` (which is not evidence of no effect). A separation with
    clean damages that differ by more than ``match_tol`` (relative; at least 0.02 nats) is
    reported as ``'unmatched control'``: a floor/ceiling effect could explain it.
    """
    rows = df.attrs.get("rows", df) if "delta" not in df.columns else df
    out = []
    for iv, ctrl in pairs.items():
        a, b = rows[rows["intervention"] == iv], rows[rows["intervention"] == ctrl]
        if a.empty or b.empty:
            raise KeyError(f"missing rows for {iv if a.empty else ctrl!r}")
        p, ya = _per_seq(a)
        _, yb = _per_seq(b)
        sa, sb, d = slope_ci(p, ya), slope_ci(p, yb), slope_ci(p, ya - yb)
        da = float((a.groupby("seq")["clean_nll"].first() - a.groupby("seq")["base_clean_nll"].first()).mean())
        db = float((b.groupby("seq")["clean_nll"].first() - b.groupby("seq")["base_clean_nll"].first()).mean())
        separate = sa[1] > sb[2] or sb[1] > sa[2]
        excl = d[1] > 0 or d[2] < 0
        matched = abs(da - db) <= max(match_tol * abs(da), 0.02)
        verdict = ("depends" if matched else "unmatched control") if (separate or excl) else "no evidence"
        out.append(dict(intervention=iv, control=ctrl, damage=da, control_damage=db, slope=sa[0], slope_lo=sa[1],
                        slope_hi=sa[2], control_slope=sb[0], control_slope_lo=sb[1], control_slope_hi=sb[2],
                        diff=d[0], diff_lo=d[1], diff_hi=d[2], n_seq=len(ya), damage_matched=matched, verdict=verdict,
                        direction=("less tolerant" if d[0] > 0 else "more tolerant") if verdict == "depends" else ""))
    return pd.DataFrame(out)
