"""The swap/NLL engine (docs/method.md §4): target-span NLL, swapped and repositioned inputs, transposition
curves — what the tolerance study, the causal test and the substitution study share. Not an experiment: no
study Config, no verdict.

T1 swaps adjacent tokens in the context, T2 applies the same swaps to position ids only, T3 reads NLL by
position with/without an LM-Infinite distance cap. ``p`` counts swapped disjoint adjacent PAIRS, so ≈ 2p of the
context tokens move; the swaps are drawn independently per (sequence, seed)
(:func:`posgen_tl.maths.perturb.swap_seed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import check_tokens, probe_hooks
from posgen_tl.hooks.chunked import forward_chunk
from posgen_tl.hooks.heap import large_blocks_kept
from posgen_tl.hooks.memory import check_forward_fits, sequences_within
from posgen_tl.hooks.positions import StopForward, chunked_logit_rows, distance_cap_hooks, final_residual_hook
from posgen_tl.hooks.reentry import check_hooks_from, forward_from, recorded, resid_hooks, skips_blocks
from posgen_tl.io.sampling import Windows, tokens_fingerprint
from posgen_tl.maths.perturb import (
    adjacent_swap_permutation,
    nll_from_logits,
    position_ids_for_permutation,
    row_nll,
    swap_seed,
    word_units,
)
from posgen_tl.stats.inference import bootstrap_ci

__all__ = [
    "DEFAULT_FRACS",
    "SwapOptions",
    "curve_rows",
    "Prefixes",
    "perturbed_inputs",
    "sequence_perms",
    "windows_fingerprint",
    "nll_on_target",
    "transposition_curve",
    "length_curve",
    "length_summary",
]

DEFAULT_FRACS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
Hooks = Sequence[tuple[str, Callable]]


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SwapOptions(base.Config):
    """The swap design shared by the T1/T2 study and the causal test (one declaration for both)."""

    n_seq: int = base.option(12, "analysed sequences (windows of distinct documents first; at least 4)", "int",
                             quick=4, full=64)
    target_len: int = base.option(0, "tokens at the end whose NLL is measured (never perturbed); 0 = min(64, "
                                     "seq_len / 4)", "count")
    fracs: tuple[float, ...] = base.option((0.0, 0.1, 0.2), "swap fractions p (fraction of disjoint adjacent "
                                           "pairs swapped; must include 0)", "floats", quick=(0.0, 0.2),
                                           full=(0.0, 0.02, 0.05, 0.1, 0.2))
    seeds: tuple[int, ...] = base.option((0,), "swap seeds, averaged inside each sequence", "ints")

    def target(self) -> int:
        """The target length in tokens (``target_len``, or ``min(64, seq_len // 4)`` when it is 0)."""
        return self.target_len or min(64, self.seq_len // 4)


# ----------------------------------------------------------------------------- NLL


def _target_nll(model, batch, target_len, pos, hooks, resid=None, start_at_layer=None) -> Tensor:
    n = batch.shape[1]
    store: dict = {}
    fin = final_residual_hook(model, store, n - target_len - 1, n - 1)
    kw = {} if pos is None else {"position_ids": pos}
    if resid is not None:
        check_hooks_from([h[0] for h in hooks], start_at_layer)
        skips_blocks(model)  # once per model, before any hook is attached
    with model.hooks(fwd_hooks=list(hooks) + ([fin] if fin else [])):
        try:
            logits = model(batch, **kw) if resid is None else forward_from(model, resid, start_at_layer, tokens=batch, **kw)
        except StopForward:
            return _span_nll(model, store["resid"], batch[:, n - target_len :])
    return row_nll(logits[:, n - target_len - 1 : n - 1], batch[:, n - target_len :]).mean(-1)


#: bytes of float32 logits one unembedding of the target span makes at a time (:func:`_span_nll`)
SPAN_LOGIT_BYTES = 64 * 2**20


def _span_nll(model: Any, resid: Tensor, targets: Tensor) -> Tensor:
    """Mean NLL per sequence of ``targets`` ``[batch, span]`` from the final residual of the rows that predict them
    (``resid`` ``[batch, span, d_model]``): unembedded a few sequences at a time, so that at most
    :data:`SPAN_LOGIT_BYTES` of float32 logits exist at once however many sequences a forward stacks (the same numbers:
    each row's log-softmax is its own). Returns ``[batch]``."""
    b, span = targets.shape
    step = sequences_within(model, span, b, SPAN_LOGIT_BYTES)
    return torch.cat([row_nll(model.unembed(resid[s : s + step]), targets[s : s + step]).mean(-1)
                      for s in range(0, b, step)])


def _target_nll_chunked(model, batch, target_len, pos, hooks, chunk) -> Tensor:
    """:func:`_target_nll` through a forward ``chunk`` positions at a time (:func:`chunked_logit_rows`: only the
    target span's logits, no ``n × n`` map)."""
    n = batch.shape[1]
    logits = chunked_logit_rows(model, batch, chunk, hooks, (n - target_len - 1, n - 1), position_ids=pos)
    return nll_from_logits(torch.cat([logits, logits[:, :1]], 1), batch[:, n - target_len - 1 :]).mean(-1)


@torch.no_grad()
def nll_on_target(
    model: Any, tokens: Int[Tensor, "batch pos"], *, target_len: int,
    position_ids: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    fwd_hooks: Hooks = (), batch_size: int = 4,
    resid_at: tuple[int, Float[Tensor, "batch pos d_model"]] | None = None, chunk: int = -1,
) -> Float[Tensor, "batch"]:  # fmt: skip
    """Mean next-token NLL of the last ``target_len`` tokens of each sequence (float32, CPU).

    Only the span's logits are computed (final residual captured, then unembedded), so a
    262k vocabulary costs ``target_len`` rows per sequence. On the CPU the forwards run with large blocks kept in the
    heap (:func:`posgen_tl.hooks.heap.large_blocks_kept`). ``fwd_hooks`` are attached.
    ``resid_at=(L, resid)``: resume from the residual entering block ``L`` (recorded by
    :func:`posgen_tl.hooks.reentry.resid_hooks`, or ``model(tokens, stop_at_layer=L)``) without
    computing blocks ``0 … L−1`` (:func:`posgen_tl.hooks.reentry.forward_from`); ``tokens``
    still give the targets, and ``fwd_hooks`` must not touch blocks below ``L`` (ValueError).
    ``chunk``: run each forward this many positions at a time through the model's key/value cache
    (:mod:`posgen_tl.hooks.chunked`; the same numbers up to float rounding, memory O(chunk · n) instead of O(n²) per
    layer); ``-1`` (default): so beyond 2 048 tokens where the model's cached forward is exact and every hook is
    :func:`~posgen_tl.hooks.chunked.chunk_safe` (the key edits are), else whole; ``0``: whole.

    Returns:
        ``[batch]`` float32 mean NLL over the target span.
    """
    tokens = check_tokens(model, tokens, probe_hooks(model)[0])
    if not 0 < target_len < tokens.shape[1]:
        raise ValueError(f"target_len={target_len} must be in (0, {tokens.shape[1]})")
    out = []
    chunk = forward_chunk(model, tokens.shape[1], fwd_hooks, resumed=resid_at is not None, chunk=chunk)
    with large_blocks_kept() if tokens.device.type == "cpu" else contextlib.nullcontext():  # (hooks/heap.py)
        for s in range(0, tokens.shape[0], batch_size):
            batch = tokens[s : s + batch_size]
            pos = None
            if position_ids is not None:
                p = position_ids.to(batch.device)
                pos = p.expand(batch.shape[0], -1) if p.ndim == 1 else p[s : s + batch.shape[0]]
            resid = None if resid_at is None else resid_at[1][s : s + batch_size]
            layer = None if resid_at is None else resid_at[0]
            if chunk:
                out.append(_target_nll_chunked(model, batch, target_len, pos, fwd_hooks, chunk).float().cpu())
            else:
                check_forward_fits(model, batch.shape[1], batch.shape[0], "the target NLL")
                out.append(_target_nll(model, batch, target_len, pos, fwd_hooks, resid, layer).float().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------- T1 / T2


def _perms(model, tokens, frac, seed, start, stop, word_level, keys) -> Int[Tensor, "batch pos"]:
    """One permutation per row, seeded by ``swap_seed(0, *keys[row], seed)`` (independent per
    (sequence, seed); the same for T1 and T2 and for every hook set)."""
    n = tokens.shape[1]
    out = []
    for row, (doc, st) in zip(tokens.cpu(), keys):
        units = word_units(model.tokenizer.convert_ids_to_tokens(row.tolist())) if word_level else None
        out.append(adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=swap_seed(0, doc, st, seed),
                                             units=units))
    return torch.stack(out)


def transposition_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, fracs: Sequence[float] = DEFAULT_FRACS,
    seeds: Sequence[int] = (0, 1), target_len: int = 64, word_level: bool = False,
    fwd_hooks: Hooks = (), modes: Sequence[str] = ("T1",), batch_size: int = 4, start: int = 1,
    clean: Tensor | None = None, progress: bool = True, doc_ids: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
) -> pd.DataFrame:  # fmt: skip
    """T1 (tokens swapped) and/or T2 (same swaps as position ids) curves, one row per
    (mode, sequence, frac, seed): ``seq``, ``doc``, ``clean_nll``, ``nll``, ``delta`` (= nll − clean_nll).

    Swaps only in ``[start, N − target_len)`` (token 0 never moves); each sequence's swaps are
    seeded by (its ``doc_ids`` entry, its ``starts`` entry, seed) — default: the row index as
    document, start 0 — so sequences get independent swaps. ``p = 0`` reuses the clean pass
    (delta exactly 0). ``clean`` may pass precomputed clean NLLs.
    """
    n = tokens.shape[1]
    if clean is None:
        clean = nll_on_target(model, tokens, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
    docs = list(range(tokens.shape[0])) if doc_ids is None else [int(d) for d in doc_ids]
    sts = [0] * tokens.shape[0] if starts is None else [int(x) for x in starts]
    if len(docs) != tokens.shape[0] or len(sts) != tokens.shape[0]:
        raise ValueError(f"doc_ids/starts need one entry per sequence ({tokens.shape[0]})")
    rows = []
    jobs = [(m, f, s) for m in modes for f in fracs for s in seeds]
    for mode, frac, seed in tqdm(jobs, desc="T1/T2", disable=not progress, leave=False):
        if mode not in ("T1", "T2"):
            raise ValueError(f"mode must be 'T1' or 'T2', got {mode!r}")
        if frac == 0:
            nll = clean
        else:
            perm = _perms(model, tokens, frac, seed, start, n - target_len, word_level, list(zip(docs, sts)))
            if mode == "T1":
                toks = torch.gather(tokens, 1, perm.to(tokens.device))
                nll = nll_on_target(model, toks, target_len=target_len, fwd_hooks=fwd_hooks, batch_size=batch_size)
            else:
                pid = torch.stack([position_ids_for_permutation(p) for p in perm])
                nll = nll_on_target(model, tokens, target_len=target_len, position_ids=pid,
                                    fwd_hooks=fwd_hooks, batch_size=batch_size)
        for i in range(tokens.shape[0]):
            rows.append(dict(mode=mode, seq=i, doc=docs[i], frac=float(frac), seed=int(seed), clean_nll=float(clean[i]),
                             nll=float(nll[i]), delta=float(nll[i] - clean[i])))
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- T3


@torch.no_grad()
def length_curve(
    model: Any, tokens: Int[Tensor, "batch pos"], *, cap: int | None = None, bucket: int = 64,
    batch_size: int = 1, fwd_hooks: Hooks = (),
) -> pd.DataFrame:  # fmt: skip
    """T3: mean NLL per position bucket, one row per (sequence, bucket): ``cap`` (None or
    int), ``bucket_start``, ``nll``. With ``cap`` the attention logits are recomputed with
    distance ``min(i − j, cap)`` (:func:`posgen_tl.hooks.positions.distance_cap_hooks`)."""
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


# ----------------------------------------------------------------------------- swaps of windows


def sequence_perms(
    windows: Windows, frac: float, seed: int, *, start: int, stop: int, base_seed: int = 0
) -> Int[Tensor, "batch pos"]:
    """One adjacent-swap permutation per window (``new = old[perm]``), drawn independently per
    (sequence, seed) with :func:`swap_seed`: ``round(frac·(L−1))`` disjoint adjacent pairs of
    the window ``[start, stop)`` swap, so ≈ ``2·frac`` of its tokens move. ``frac = 0`` gives the
    identity. Returns ``[batch, pos]`` int64."""
    n = windows.tokens.shape[1]
    rows = [
        adjacent_swap_permutation(n, frac, start=start, stop=stop, seed=swap_seed(base_seed, d, s, seed))
        for d, s in zip(windows.doc_ids.tolist(), windows.starts.tolist())
    ]
    return torch.stack(rows)


def perturbed_inputs(
    windows: Windows, frac: float, seed: int, mode: str, *, target_len: int, base_seed: int = 0
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"] | None]:
    """``(tokens, position_ids)`` for T1 (tokens permuted, ids natural: ``None``) or T2 (tokens
    natural, ids permuted); swaps in ``[1, N − target_len)`` (token 0 and the target never move)."""
    if mode not in ("T1", "T2"):
        raise ValueError(f"mode must be 'T1' or 'T2', got {mode!r}")
    toks = windows.tokens
    n = toks.shape[1]
    if frac == 0:
        return toks, None
    perm = sequence_perms(windows, frac, seed, start=1, stop=n - target_len, base_seed=base_seed).to(toks.device)
    if mode == "T1":
        return torch.gather(toks, 1, perm), None
    return toks, torch.stack([position_ids_for_permutation(p) for p in perm]).to(toks.device)

#: a pass's residuals entering blocks: ``{pass: {layer: [batch, pos, d_model]}}``, the pass ``"clean"`` or ``(frac, seed)``
Prefixes = dict[Any, dict[int, Tensor]]


def curve_rows(
    model: Any, windows: Windows, clean: Float[Tensor, "batch"], *, fracs: Sequence[float], seeds: Sequence[int],
    mode: str, target_len: int, base_seed: int = 0, fwd_hooks: Sequence = (), record: Prefixes | None = None,
    record_at: Sequence[int] = (), resume: tuple[int, Prefixes] | None = None, chunk: int = -1,
) -> list[dict]:  # fmt: skip
    """The tolerance curve of one batch: one pass per (frac > 0, seed) of :func:`perturbed_inputs`
    (``frac = 0`` reuses ``clean``), with ``fwd_hooks`` attached. Returns one dict per (frac, seed,
    sequence): ``seq`` (position in ``windows``), ``frac, seed, clean_nll, nll, delta``.

    ``record`` (with ``record_at``): each pass also stores the residuals entering those blocks in
    ``record[(frac, seed)]``. ``resume=(L, prefixes)``: each pass resumes at block ``L`` from
    ``prefixes[(frac, seed)][L]`` (recorded by an earlier curve of the same windows and swaps) instead of
    computing blocks ``0 … L−1``. ``chunk``: as in :func:`nll_on_target`."""
    bs = windows.tokens.shape[0]
    rows = []
    for frac in fracs:
        for seed in seeds:
            if frac == 0:
                nll = clean
            else:
                toks, pid = perturbed_inputs(windows, frac, seed, mode, target_len=target_len, base_seed=base_seed)
                hooks, at = list(fwd_hooks), None
                if record is not None and record_at:
                    store: dict[int, list[Tensor]] = {}
                    hooks += resid_hooks(record_at, store)
                if resume is not None:
                    at = (resume[0], resume[1][(float(frac), int(seed))][resume[0]])
                nll = nll_on_target(model, toks, target_len=target_len, position_ids=pid, fwd_hooks=hooks,
                                    batch_size=bs, resid_at=at, chunk=chunk)
                if record is not None and record_at:
                    record[(float(frac), int(seed))] = recorded(store)
            for i in range(bs):
                rows.append(dict(seq=i, frac=float(frac), seed=int(seed), clean_nll=float(clean[i]),
                                 nll=float(nll[i]), delta=float(nll[i] - clean[i])))
    return rows


@torch.no_grad()
def windows_fingerprint(w: Windows) -> str:
    """SHA-1 of the windows' token ids (a run's record of exactly which tokens it analysed;
    :func:`posgen_tl.io.sampling.tokens_fingerprint`)."""
    return tokens_fingerprint(w.tokens)
