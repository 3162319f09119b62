"""Longer texts (docs/method.md §7): the gap probe, Gemma3 window removal, and the attention change by head class.

Conditions (all as TransformerLens hooks from :mod:`posgen_tl.hooks.edits`):

* ``vanilla`` — the model as it is (its own RoPE at the given position ids);
* ``lm_infinite`` — distances ``> cap`` clamped to ``cap``, the first ``n_sink`` keys visible at
  their true distance (:func:`~posgen_tl.hooks.logits.lm_infinite_hooks`);
* ``disentangled`` — distances ``> cap`` replaced by ``f(q_i, cap) + g_Δ0(q_i, k_j)`` with a
  GLOBAL ``k̄`` from reference documents disjoint from the analysed ones
  (:func:`~posgen_tl.hooks.logits.disentangled_hooks`).

Units and statistics (docs/method.md §8): the unit is a sequence (one window), clustered by its
document; every CI is a document-level bootstrap (:func:`posgen_tl.stats.inference.bootstrap_ci`, 10 000
draws) beside a t-interval on document means, every p-value an exact/Monte-Carlo sign-flip test
over documents, Holm-adjusted within one printed table. Fewer than 32 sequences → "exploratory".
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.engine.swaps import SPAN_LOGIT_BYTES, windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.capture import StopForward, check_tokens, probe_hooks
from posgen_tl.hooks.edits import reference_key_means
from posgen_tl.hooks.heap import large_blocks_kept
from posgen_tl.hooks.logits import disentangled_hooks, lm_infinite_hooks, local_layers, window_removal_hooks
from posgen_tl.hooks.memory import SUBSTITUTION_MAPS, sequences_within
from posgen_tl.hooks.positions import final_residual_hook, reposition_hooks
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.sampling import Windows, resolve_windows, sample_windows
from posgen_tl.maths.perturb import gap_position_ids, row_nll
from posgen_tl.maths.rope import RopeError, RopeSpec
from posgen_tl.stats.tables import ci_row, contrast_row, finish_table

__all__ = ["Config", "Result", "run", "render", "LengthResult", "span_nll", "gap_probe", "gap_summary", "window_removal",
           "window_summary", "CONDITIONS"]

CONDITIONS = ("vanilla", "lm_infinite", "disentangled")
DEFAULT_GAPS = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass
class LengthResult:
    """Rows (one per sequence × condition × G or bucket, with ``doc``), their summary, the settings."""

    rows: pd.DataFrame
    summary: pd.DataFrame
    config: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- NLL of a span


def _position_kwargs(model: Any, tokens: Tensor, position_ids: Tensor | None) -> tuple[dict, list]:
    """How a forward gets ``position_ids``: as the forward's own argument, or — where the model keeps
    a fixed table of positions shorter than the ids (GPT-J, CodeGen: ``embed_positions``) or takes no
    ``position_ids`` — by re-rotation hooks (:func:`~posgen_tl.hooks.positions.reposition_hooks`, the
    same rotation up to float rounding). Returns ``(forward kwargs, hooks to append after the caller's)``."""
    if position_ids is None:
        return {}, []
    spec, info = probe_hooks(model)
    table = spec.extra.get("max_position")
    if info.position_ids and (table is None or int(position_ids.max()) < int(table)):
        pos = position_ids.to(tokens.device)
        return {"position_ids": pos.expand(tokens.shape[0], -1) if pos.ndim == 1 else pos}, []
    return {}, reposition_hooks(model, position_ids)


@torch.no_grad()
def span_nll(
    model: Any, tokens: Int[Tensor, "batch pos"], start: int, stop: int | None = None, *,
    position_ids: Int[Tensor, "pos"] | Int[Tensor, "batch pos"] | None = None, fwd_hooks: Sequence = (),
    chunk: int = 256,
) -> Float[Tensor, "batch span"]:  # fmt: skip
    """Per-token next-token NLL of the tokens at sequence indices ``[start, stop)`` (float32, CPU).

    Token ``t`` is predicted at position ``t − 1``; only those ``stop − start`` residuals are
    unembedded, ``chunk`` positions and as many sequences at a time as keep the float32 logits within
    :data:`posgen_tl.engine.swaps.SPAN_LOGIT_BYTES` (a 262k vocabulary stays bounded in memory, and on the CPU the blocks
    stay in the heap instead of being mapped and zero-filled at every pass).
    ``fwd_hooks`` are attached for the pass and removed on every exit path.

    Returns:
        ``Float[Tensor, "batch span"]`` with ``span = stop − start``.
    """
    n = tokens.shape[1]
    stop = n if stop is None else stop
    if not 1 <= start < stop <= n:
        raise ValueError(f"span [{start}, {stop}) must satisfy 1 <= start < stop <= {n}")
    store: dict = {}
    fin = final_residual_hook(model, store, start - 1, stop - 1)
    kw, moved = _position_kwargs(model, tokens, position_ids)
    heap = large_blocks_kept() if tokens.device.type == "cpu" else contextlib.nullcontext()  # (hooks/heap.py)
    with heap, model.hooks(fwd_hooks=list(fwd_hooks) + moved + ([fin] if fin else [])):
        try:
            logits = model(tokens, **kw)
            resid = None
        except StopForward:
            resid, logits = store["resid"], None
    targets = tokens[:, start:stop]
    b, span = targets.shape
    step = sequences_within(model, min(chunk, span), b, SPAN_LOGIT_BYTES)  # sequences per block
    out = torch.empty(b, span)
    for s in range(0, span, chunk):  # at most SPAN_LOGIT_BYTES of logits at a time: kept in the heap, not mapped anew
        e = min(s + chunk, span)
        for r in range(0, b, step):
            q = min(r + step, b)
            lg = model.unembed(resid[r:q, s:e]) if resid is not None else logits[r:q, start - 1 + s : start - 1 + e]
            out[r:q, s:e] = row_nll(lg, targets[r:q, s:e]).float().cpu()  # row t−1 predicts token t
    return out


# ----------------------------------------------------------------------------- windows, k̄


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the longer-texts experiment (docs/method.md §7): the gap probe and, on sliding-window
    models, window removal."""

    NAME: ClassVar[str] = "length"
    n_seq: int = base.option(12, "analysed sequences of the gap probe (windows of distinct documents first)", "int",
                             quick=2, full=32)
    n_ref: int = base.n_ref_option()
    gap: bool = base.option(True, "run the gap probe", "bool")
    gaps: tuple[float, ...] = base.option((0.0, 1.0, 2.0), "gaps G in units of the model's n_ctx", "floats",
                                          full=DEFAULT_GAPS)
    prefix_len: int = base.option(0, "prefix tokens; 0 = max(16, seq_len / 2)", "count")
    suffix_len: int = base.option(0, "suffix tokens; 0 = max(16, seq_len / 2)", "count")
    skip: int = base.option(0, "first suffix tokens left out of the NLL; 0 = min(16, suffix / 4)", "count")
    delta0: int = base.option(0, "reference offset Δ0 of the disentangled logits f(q, C) + g_Δ0", "count")
    batch_size: int = base.batch_option(0, "gap-probe sequences", auto=True)
    window: bool = base.option(True, "run window removal on sliding-window models", "bool")
    window_seq_len: int = base.option(2048, "tokens per sequence of the window-removal run", "int", quick=768)
    window_n_seq: int = base.option(4, "sequences of the window-removal run", "int", quick=2, full=16)
    bucket: int = base.option(256, "position bucket of the window-removal NLL", "int")
    max_per_doc: int = base.option(0, "window removal: most windows taken from one long document (0 = no limit)",
                                   "count")

    def gap_layout(self) -> tuple[int, int, int]:
        """``(prefix_len, suffix_len, skip)`` with the automatic defaults resolved."""
        half = max(16, self.seq_len // 2)
        pre, suf = self.prefix_len or half, self.suffix_len or half
        return pre, suf, self.skip or min(16, suf // 4)


def _global_kbar(model, ref: Windows | None, k_means, layers=None) -> dict:
    if k_means is not None:
        return k_means
    if ref is None:
        raise ValueError("the disentangled condition needs a global k̄: pass k_means or reference windows")
    return reference_key_means(model, ref.tokens, layers, sink=1, progress=False)


# ----------------------------------------------------------------------------- gap probe


def gap_probe(
    model: Any, corpus: CorpusLike | Windows = None, cfg: Config | None = None, *,
    conditions: Sequence[str] = CONDITIONS, cap: int | None = None, n_sink: int = 1, k_means: dict | None = None,
    reference: Windows | None = None, checkpoint: str | Path | None = None, progress: bool = True, **options: Any,
) -> LengthResult:  # fmt: skip
    """Gap probe: NLL of a suffix whose position ids are moved ``G`` past its prefix.

    Each sequence is one window of ``prefix_len + suffix_len`` consecutive tokens of a document
    (BOS first where the model's policy adds one); prefix ids ``0..|P|−1``, suffix ids
    ``|P| + G ..`` (:func:`posgen_tl.maths.perturb.gap_position_ids`). ``gaps`` are fractions of the
    model's trained context ``n_ctx`` (G = round(frac·n_ctx)).

    Why G shifts only prefix→suffix distances: with RoPE the logit of query i and key j
    depends on the ids only through ``p_i − p_j``; inside the prefix and inside the suffix both
    ids move together (local distances stay natural), while every suffix→prefix distance grows
    by exactly G — so the suffix sees its prefix at distances up to ``G + |P| + |S| − 1``, past
    ``n_ctx`` for ``G ≥ n_ctx``. A constant shift of ALL ids changes no distance and therefore
    nothing (up to float rounding of the angles; tested). The first suffix token is predicted by
    the prefix's last position, which never sees the gap.

    Read-out: mean NLL of suffix tokens ``[|P| + skip, |P| + |S|)`` (column ``nll``; the first
    ``skip`` suffix tokens are EXCLUDED — they have almost no local context, so their NLL is a
    different quantity); the excluded gap-dependent tokens ``[|P| + 1, |P| + skip)`` are column
    ``nll_first``. Where no distance exceeds ``cap`` the LM-Infinite and disentangled hooks are
    exact no-ops (tested), so those rows reuse the vanilla numbers (``reused=True``).

    Args:
        cfg: :class:`Config` (with ``options`` applied): ``gaps``, the prefix/suffix/skip layout
            (:meth:`Config.gap_layout`), ``n_seq``, ``n_ref``, ``delta0`` (Δ0 of ``g_Δ0``; 0 = D3), ``seed``.
        cap: ``C`` of both approximations (default ``n_ctx``: only unseen distances are touched).
        n_sink: keys kept at their true distance.
        k_means: global k̄ per layer (default: from ``n_ref`` windows of disjoint documents).
        checkpoint: a folder that keeps each finished (gap, condition); a rerun of the same design continues where
            an interrupted one stopped (another design's folder is refused: ValueError).

    Returns:
        :class:`LengthResult`: ``rows`` (model-independent columns ``condition, gap_frac, gap,
        max_distance, seq, doc, doc_name, nll, nll_first, reused``) and ``summary``
        (:func:`gap_summary`).

    Raises:
        ValueError: negative gap or cap, ``skip ≥ suffix_len``, windows shorter than
        ``prefix_len + suffix_len``, unknown condition. CaptureError: scores not pre-softmax.
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the gap probe")
    prefix_len, suffix_len, skip = cfg.gap_layout()
    gaps, delta0 = cfg.gaps, cfg.delta0
    spec, info = probe_hooks(model)
    n_ctx = spec.n_ctx
    cap, n = n_ctx if cap is None else cap, prefix_len + suffix_len
    conditions = _gap_conditions(spec, conditions, gaps, cap, prefix_len, suffix_len, skip)
    if isinstance(corpus, Windows) and corpus.tokens.shape[1] < n:
        raise ValueError(f"the windows hold {corpus.tokens.shape[1]} tokens; prefix + suffix need {n}")
    win, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=n,
                               n_ref=cfg.n_ref if "disentangled" in conditions and k_means is None else 0, seed=cfg.seed)
    tokens = check_tokens(model, win.tokens[:, :n], spec)
    batch_size = base.auto_batch(cfg, model, n, tokens.shape[0], extra_maps=SUBSTITUTION_MAPS)
    ck = base.pieces(checkpoint, NAME, cfg, model, win, part="gap probe", conditions=list(conditions), cap=cap,
                     n_sink=n_sink, reference=None if ref is None else windows_fingerprint(ref),
                     k_means=base.means_fingerprint(k_means))
    if "disentangled" in conditions:
        k_means = _global_kbar(model, ref, k_means)
    df = _gap_rows(model, tokens, win, [(float(g), c) for g in gaps for c in conditions], n_ctx=n_ctx,
                   prefix_len=prefix_len, suffix_len=suffix_len, skip=skip, cap=cap, n_sink=n_sink, k_means=k_means,
                   delta0=delta0, batch_size=batch_size, progress=progress, pieces=ck)
    cfg = dict(model=spec.model_name, n_ctx=n_ctx, prefix_len=prefix_len, suffix_len=suffix_len, skip=skip, cap=cap,
               n_sink=n_sink, delta0=delta0, n_seq=len(win), n_docs=win.n_docs, k_mean="global (disjoint documents)")
    return LengthResult(df, gap_summary(df), cfg)


def _gap_conditions(spec: RopeSpec, conditions: Sequence[str], gaps: Sequence[float], cap: int, prefix_len: int,
                    suffix_len: int, skip: int) -> tuple[str, ...]:
    """The conditions :func:`gap_probe` runs (``"vanilla"`` first where it is missing: the reused rows copy it),
    after checking its settings against the model's spec.

    Raises:
        ValueError: a negative or non-integer ``cap``, a negative gap, a bad prefix/suffix/skip layout or an
            unknown condition. RopeError: positions past where a dynamic-NTK model changes its frequencies.
    """
    n_ctx = spec.n_ctx
    if int(cap) != cap or cap < 0:
        raise ValueError(f"cap must be a non-negative integer, got {cap!r}")
    if any(g < 0 for g in gaps):
        raise ValueError(f"gaps must be >= 0 (fractions of n_ctx), got {list(gaps)}")
    if prefix_len < 1 or suffix_len < 1 or not 1 <= skip < suffix_len:
        raise ValueError(f"need prefix_len, suffix_len >= 1 and 1 <= skip < suffix_len; got {prefix_len}, {suffix_len}, {skip}")
    bad = set(conditions) - set(CONDITIONS)
    if bad:
        raise ValueError(f"unknown condition(s) {sorted(bad)}; choose from {CONDITIONS}")
    if "vanilla" not in conditions:
        conditions = ("vanilla", *conditions)
    n = prefix_len + suffix_len
    dyn = spec.extra.get("dynamic_max_len")
    top = int(gap_position_ids(prefix_len, suffix_len, int(round(max(gaps) * n_ctx)))[-1]) + 1 if gaps else n
    if dyn is not None and top > int(dyn):
        raise RopeError(f"{spec.model_name}: dynamic NTK RoPE changes its frequencies once positions pass {dyn}; the gap "
                        f"probe's positions reach {top}, where the model's rotation is not the one this library "
                        "models (its logit substitutions would not be the model's); use gaps below "
                        f"{(int(dyn) - n) / n_ctx:.3g}·n_ctx")
    return tuple(conditions)


def _gap_rows(model: Any, tokens: Tensor, win: Windows, jobs: list[tuple[float, str]], *, n_ctx: int, prefix_len: int,
              suffix_len: int, skip: int, cap: int, n_sink: int, k_means: dict | None, delta0: int, batch_size: int,
              progress: bool, pieces: Any) -> pd.DataFrame:
    """The per-sequence rows of :func:`gap_probe`, one ``(gap fraction, condition)`` job after another, ``tokens``
    ``[seq, prefix_len + suffix_len]`` in batches of ``batch_size``; a job whose largest distance stays within ``cap``
    reuses the vanilla rows of its gap (``reused=True``: the approximations are exact no-ops there). ``pieces``
    (:func:`posgen_tl.experiments.base.pieces`) keeps each computed job.

    Returns:
        one row per job × sequence: ``condition, gap_frac, gap, max_distance, seq, doc, doc_name, nll, nll_first,
        reused``.
    """
    n = prefix_len + suffix_len
    docs = win.doc_ids.cpu().numpy()
    parts: list[pd.DataFrame] = []

    def job_rows(frac: float, cond: str, gap: int, pos: Tensor, max_d: int) -> pd.DataFrame:
        hooks = []
        if cond == "lm_infinite":
            hooks = lm_infinite_hooks(model, cap, n_sink=n_sink, position_ids=pos)
        elif cond == "disentangled":
            hooks = disentangled_hooks(model, k_means, cap, delta0=delta0, n_sink=n_sink, position_ids=pos)
        rows = []
        for s in range(0, tokens.shape[0], batch_size):
            b = tokens[s : s + batch_size]
            nll = span_nll(model, b, prefix_len + 1, n, position_ids=pos, fwd_hooks=hooks)
            for i in range(b.shape[0]):
                rows.append(dict(condition=cond, gap_frac=frac, gap=gap, max_distance=max_d, seq=s + i,
                                 doc=int(docs[s + i]), doc_name=win.doc_names[int(docs[s + i])],
                                 nll=float(nll[i, skip - 1 :].mean()), nll_first=float(nll[i, : skip - 1].mean()),
                                 reused=False))
        return pd.DataFrame(rows)

    for j, (frac, cond) in enumerate(tqdm(jobs, desc="gap probe", disable=not progress, leave=False)):
        gap = int(round(frac * n_ctx))
        pos = gap_position_ids(prefix_len, suffix_len, gap)
        max_d = int(pos[-1] - pos[0])
        if cond != "vanilla" and max_d <= cap:
            vanilla = [p for p in parts if p["condition"].iloc[0] == "vanilla" and p["gap"].iloc[0] == gap]
            parts += [v.assign(condition=cond, reused=True) for v in vanilla]
            continue
        parts.append(pieces.rows(f"gap_{j:03d}", lambda f=frac, c=cond, g=gap, p=pos, m=max_d: job_rows(f, c, g, p, m)))
    return pd.concat(parts, ignore_index=True)


def gap_summary(rows: pd.DataFrame, value: str = "nll") -> pd.DataFrame:
    """Per condition and G: mean suffix NLL (document-bootstrap CI, t-interval), the paired change
    vs G = 0 of the same condition (``estimator='d_vs_gap0'``, sign-flip p) and vs vanilla at the
    same G (``'d_vs_vanilla'``). Holm over all p-values of the table; ``label`` 'exploratory' if n < 32."""
    out = []
    key = ["seq", "doc"]
    for (cond, gap), g in rows.groupby(["condition", "gap"], sort=True):
        g = g.sort_values("seq")
        base = dict(condition=cond, gap=gap, gap_frac=g["gap_frac"].iloc[0])
        out.append({**base, "estimator": "nll", **ci_row(g[value].to_numpy(), g["doc"].to_numpy()), "p": np.nan})
        ref0 = rows[(rows["condition"] == cond) & (rows["gap"] == rows["gap"].min())].sort_values("seq")
        if gap != rows["gap"].min():
            m = g.merge(ref0, on=key, suffixes=("", "_0"))
            out.append({**base, "estimator": "d_vs_gap0",
                        **contrast_row((m[value] - m[f"{value}_0"]).to_numpy(), m["doc"].to_numpy())})
        if cond != "vanilla" and not g["reused"].all():
            van = rows[(rows["condition"] == "vanilla") & (rows["gap"] == gap)]
            m = g.merge(van, on=key, suffixes=("", "_v"))
            out.append({**base, "estimator": "d_vs_vanilla",
                        **contrast_row((m[value] - m[f"{value}_v"]).to_numpy(), m["doc"].to_numpy())})
    return finish_table(pd.DataFrame(out))


# ----------------------------------------------------------------------------- Gemma3 window removal


def window_removal(
    model: Any, corpus: CorpusLike | Windows = None, cfg: Config | None = None, *,
    conditions: Sequence[str] = ("window", "no_window", "lm_infinite", "disentangled"), cap: int | None = None,
    n_sink: int = 1, k_means: dict | None = None, reference: Windows | None = None,
    checkpoint: str | Path | None = None, progress: bool = True, **options: Any,
) -> LengthResult:  # fmt: skip
    """Gemma3 local layers without their sliding window, NLL by position bucket.

    Conditions (only LOCAL layers are touched; global layers run as trained):
    ``window`` (the model as trained), ``no_window`` (local layers attend over the whole causal
    context with exact RoPE logits — distances ``window..seq_len−1`` they never trained on),
    ``lm_infinite`` (no window, local distances ``> cap`` clamped to ``cap``, default
    ``window − 1``), ``disentangled`` (no window, local distances ``> cap`` replaced by
    ``f(q_i, cap) + g_Δ0`` with a global k̄ from disjoint documents).

    Sizes from ``cfg`` (:class:`Config`, with ``options`` applied): ``window_seq_len``,
    ``window_n_seq``, ``bucket``, ``max_per_doc``, ``n_ref``, ``delta0``. Windows
    (:func:`posgen_tl.io.sampling.sample_windows` with ``reference_docs="short"``): documents are
    short, so a long document may give several (disjoint) windows (``max_per_doc``); the unit stays
    the window, clustered by document. The k̄ reference uses ``min(256, seq_len // 4)``-token windows
    of documents too short to give a ``seq_len`` window (disjoint by construction); fewer analysed
    windows than ``window_n_seq`` are used as they are. ``checkpoint``: a folder that keeps each finished condition
    (its per-token NLL); a rerun of the same design continues where an interrupted one stopped.

    Returns:
        :class:`LengthResult`: rows ``condition, seq, doc, doc_name, bucket_start, nll`` (mean NLL
        of the tokens predicted in ``[bucket_start, bucket_start + bucket)``), summary
        (:func:`window_summary`).

    Raises:
        ValueError: a model without sliding-window layers; no document long enough.
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "window removal")
    seq_len, n_seq, bucket, delta0 = cfg.window_seq_len, cfg.window_n_seq, cfg.bucket, cfg.delta0
    spec, _ = probe_hooks(model)
    local = local_layers(model)
    if not local:
        raise ValueError(f"{spec.model_name} has no sliding-window layers: nothing to remove")
    window = min(spec.layer(x).sliding_window for x in local)
    cap = window - 1 if cap is None else cap
    if int(cap) != cap or cap < 0:
        raise ValueError(f"cap must be a non-negative integer, got {cap!r}")
    if isinstance(corpus, Windows):
        win, ref = corpus.subset(range(min(n_seq, len(corpus)))), reference
    else:
        win, ref = sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=None, seq_len=seq_len, n_ref=cfg.n_ref, seed=cfg.seed,
                                  ref_seq_len=min(256, max(2, seq_len // 4)), max_per_doc=cfg.max_per_doc or None,
                                  reference_docs="short")
        win = win.subset(range(min(n_seq, len(win))))
    tokens = check_tokens(model, win.tokens, spec)
    ck = base.pieces(checkpoint, NAME, cfg, model, win, part="window removal", conditions=list(conditions), cap=cap,
                     n_sink=n_sink, reference=None if ref is None else windows_fingerprint(ref),
                     k_means=base.means_fingerprint(k_means))
    if "disentangled" in conditions:
        k_means = _global_kbar(model, ref, k_means, local)
    hooks = {
        "window": [],
        "no_window": window_removal_hooks(model),
        "lm_infinite": lm_infinite_hooks(model, cap, n_sink=n_sink, layers=local, remove_window=True),
        "disentangled": (disentangled_hooks(model, k_means, cap, delta0=delta0, n_sink=n_sink, layers=local,
                                            remove_window=True) if "disentangled" in conditions else []),
    }
    bad = set(conditions) - set(hooks)
    if bad:
        raise ValueError(f"unknown condition(s) {sorted(bad)}; choose from {sorted(hooks)}")
    docs = win.doc_ids.cpu().numpy()
    rows = []
    n = tokens.shape[1]
    # tokens 1..window are predicted from positions that see no distance ≥ window: identical in every
    # condition (tested), so the no-window conditions reuse the window run's NLL there
    conditions = sorted(conditions, key=lambda c: c != "window")
    first: dict[int, Tensor] = {}

    def per_token(cond: str) -> pd.DataFrame:
        """Per sequence the NLL of every predicted token (``t`` = 1 … n − 1), float32 as the model gives it."""
        out = []
        for s in tqdm(range(tokens.shape[0]), desc=f"window removal: {cond}", disable=not progress, leave=False):
            if cond != "window" and s in first and window + 1 < n:
                tail = span_nll(model, tokens[s : s + 1], window + 1, n, fwd_hooks=hooks[cond])[0]
                nll = torch.cat([first[s], tail])
            else:
                nll = span_nll(model, tokens[s : s + 1], 1, n, fwd_hooks=hooks[cond])[0]  # token t at nll[t − 1]
            out.append(pd.DataFrame(dict(seq=s, t=np.arange(1, n), nll=nll.double().cpu().numpy())))
        return pd.concat(out, ignore_index=True)

    for cond in conditions:
        tok = ck.rows(f"window_{cond}", lambda c=cond: per_token(c))
        for key, g in tok.groupby("seq", sort=True):
            s = int(key)
            nll = torch.tensor(g.sort_values("t")["nll"].to_numpy(), dtype=torch.float32)  # exact: float32 values
            if cond == "window":
                first[s] = nll[:window]
            for b0 in range(0, n - 1, bucket):
                rows.append(dict(condition=cond, seq=s, doc=int(docs[s]), doc_name=win.doc_names[int(docs[s])],
                                 bucket_start=b0 + 1, nll=float(nll[b0 : b0 + bucket].mean())))
    df = pd.DataFrame(rows)
    cfg = dict(model=spec.model_name, seq_len=n, window=window, cap=cap, n_sink=n_sink, delta0=delta0,
               local_layers=local, n_seq=len(win), n_docs=win.n_docs)
    return LengthResult(df, window_summary(df), cfg)


def window_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per condition and bucket: mean NLL (document-bootstrap CI) and the paired change vs
    ``window`` (sign-flip p, Holm over the table)."""
    out = []
    for (cond, b0), g in rows.groupby(["condition", "bucket_start"], sort=True):
        base = dict(condition=cond, bucket_start=b0)
        out.append({**base, "estimator": "nll", **ci_row(g["nll"].to_numpy(), g["doc"].to_numpy()), "p": np.nan})
        if cond != "window" and "window" in set(rows["condition"]):
            ref = rows[(rows["condition"] == "window") & (rows["bucket_start"] == b0)]
            m = g.merge(ref, on=["seq", "doc"], suffixes=("", "_w"))
            out.append({**base, "estimator": "d_vs_window",
                        **contrast_row((m["nll"] - m["nll_w"]).to_numpy(), m["doc"].to_numpy())})
    return finish_table(pd.DataFrame(out))


# ----------------------------------------------------------------------------- report / study


NAME = "length"
ABOUT = ("longer texts: gap probe and (sliding-window models) window removal, vanilla / LM-Infinite / "
         "disentangled (docs/method.md §7)")
NEEDS: tuple[str, ...] = ()


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``gap_rows`` / ``gap_summary`` (:func:`gap_probe`: per sequence × condition × gap, and
            :func:`gap_summary`) where the gap probe ran; ``window_rows`` / ``window_summary``
            (:func:`window_removal`) on a model with sliding-window layers.
        config: the Config's options. meta: ``model``; ``gap`` (the probe's settings, or ``{"gap": False}``) and
            ``window`` (window removal's settings, where it ran).
    """


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"gap_rows": "length_gap_rows.csv", "gap_summary": "length_gap_summary.csv",
         "window_rows": "length_window_rows.csv", "window_summary": "length_window_summary.csv"}
LEGACY_META = {"gap": "length_gap_meta.json", "window": "length_window_meta.json"}


@base.shares_heap
def run(model: Any, cfg: Config | None = None, *, corpus: CorpusLike | Windows = None,
        checkpoint: str | Path | None = None, progress: bool = True, **options: Any) -> Result:
    """The gap probe (:func:`gap_probe`) and, on a model with sliding-window layers, window removal
    (:func:`window_removal`), as ``cfg`` (with ``options`` applied) asks. Returns their :class:`Result`.
    ``checkpoint``: a folder that keeps each finished piece of both (subfolders ``gap``, ``window``), so an
    interrupted run continues where it stopped."""
    cfg = base.config_of(Config, cfg, options)
    corpus = cfg.corpus if corpus is None else corpus
    tables: dict[str, pd.DataFrame] = {}
    meta: dict[str, Any] = {"model": probe_hooks(model)[0].model_name, "gap": {"gap": False}}
    if cfg.gap:
        res = gap_probe(model, corpus, cfg, progress=progress,
                        checkpoint=None if checkpoint is None else Path(checkpoint) / "gap")
        tables.update(gap_rows=res.rows, gap_summary=res.summary)
        meta["gap"] = res.config
    if local_layers(model) and cfg.window:
        wr = window_removal(model, corpus, cfg, progress=progress,
                            checkpoint=None if checkpoint is None else Path(checkpoint) / "window")
        tables.update(window_rows=wr.rows, window_summary=wr.summary)
        meta["window"] = wr.config
    return Result(tables, cfg.as_dict(), meta)


def _verdict_gap(summ: pd.DataFrame) -> str:
    d = summ[(summ["estimator"] == "d_vs_gap0") & (summ["condition"] == "vanilla")]
    if not len(d):
        return "no gap beyond 0 was run"
    top = d.sort_values("gap").iloc[-1]
    word = "degrades" if top["ci_low"] > 0 else "does NOT clearly degrade (tolerance rather than failure)"
    return (f"Vanilla suffix NLL at G = {top['gap_frac']:g}·n_ctx vs G = 0: {top['estimate']:+.3f} nats "
            f"[{top['ci_low']:+.3f}, {top['ci_high']:+.3f}] — the model {word} at that gap.")


def render(result: Result) -> Any:
    """The report section: suffix NLL per gap and condition, window removal by position bucket, figures."""
    from posgen_tl.plot.length import plot_gap_probe, plot_window_removal  # noqa: PLC0415
    from posgen_tl.report.html import Finding, Section, figure_to_png, skipped_section  # noqa: PLC0415

    title = "8 · Longer texts: unseen distances (docs/method.md §7)"
    if result.skipped:
        return skipped_section(title, result.skipped, "length", result.meta.get("hint"))
    meta, t = result.meta.get("gap", {}), result.tables
    name = result.meta.get("model") or meta.get("model", "")
    tables, figures, paras, verdict = [], [], [], "The gap probe was not run (option gap=false)."
    res: dict[str, Any] = {"meta": meta}
    findings = [Finding("length", "not run", note="gap probe not run (option gap=false)")]
    if "gap_summary" in t:
        summ = t["gap_summary"]
        cols = ["condition", "gap_frac", "gap", "estimator", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind",
                "p_holm", "n_docs", "n_seqs", "label"]
        tables.append(("Suffix NLL per gap and condition; d_vs_gap0 / d_vs_vanilla are paired changes "
                       "(document-bootstrap CI, sign-flip p, Holm)", summ[[c for c in cols if c in summ.columns]]))
        figures.append((figure_to_png(plot_gap_probe(summ, title=f"Gap probe — {name}")),
                        "Suffix NLL vs gap G, vanilla / LM-Infinite / disentangled"))
        res["gap"] = summ.to_dict("records")
        verdict = _verdict_gap(summ)
        findings = _findings(summ)
        paras.append(
            f"Sequence = prefix ({meta['prefix_len']} tokens) ‖ suffix ({meta['suffix_len']}); suffix ids shifted by G. "
            "RoPE logits depend on ids only through i − j, so G changes only the suffix→prefix distances (a constant "
            "shift of all ids changes nothing); at G ≥ n_ctx the suffix sees its prefix at distances never trained on. "
            f"NLL of suffix tokens after the first {meta['skip']}. Conditions: LM-Infinite clamps distances > C = "
            f"{meta['cap']} (first {meta['n_sink']} key at its true distance); 'disentangled' replaces them by "
            f"f(q, C) + g_Δ0 (Δ0 = {meta['delta0']}, global k̄ from disjoint documents). Where no distance exceeds C "
            "both are exact no-ops. The random twin is not shown: its NLL is near log|V| at every gap, so a gap "
            "effect there means nothing.")
    if "window_summary" in t:
        wsum, wmeta = t["window_summary"], result.meta.get("window", {})
        tables.append((f"Window removal ({wmeta['seq_len']} tokens, local layers {wmeta['local_layers']}): NLL by "
                       "position bucket; d_vs_window = paired change vs the trained window", wsum))
        figures.append((figure_to_png(plot_window_removal(wsum, title=f"Window removal — {name}")),
                        "NLL by position, local layers with / without the window"))
        res["window"] = wsum.to_dict("records")
    return Section(title, verdict=verdict, paragraphs=paras, tables=tables, figures=figures, findings=findings,
                   results=res)


def _holm_or_raw(row: pd.Series) -> float:
    """The row's Holm-adjusted p where the table has one, else its raw p (NaN where neither was computed:
    a summary in which no contrast could be tested has no p columns filled)."""
    for key in ("p_holm", "p"):
        v = row.get(key)
        if v is not None and v == v:
            return float(v)
    return float("nan")


def _findings(summ: pd.DataFrame) -> list:
    """Gap probe: vanilla suffix NLL at the LARGEST gap minus at G = 0 (paired per sequence,
    document-bootstrap CI, Holm-adjusted sign-flip p of the table); the note gives the disentangled −
    vanilla change at that gap. "degrades" / "improves" (p < .05) or "no evidence"."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.report.text import p_label, sig3  # noqa: PLC0415

    d = summ[(summ["estimator"] == "d_vs_gap0") & (summ["condition"] == "vanilla")]
    if d.empty:
        return [Finding("length", "not testable", note="no gap beyond 0 in this run")]
    r = d.sort_values("gap").iloc[-1]
    p = _holm_or_raw(r)
    note = f"G = {r['gap_frac']:g}·n_ctx vs G = 0"
    dis = summ[(summ["estimator"] == "d_vs_vanilla") & (summ["condition"] == "disentangled") & (summ["gap"] == r["gap"])]
    if len(dis):
        q = dis.iloc[0]
        pq = _holm_or_raw(q)
        note += (f"; disentangled − vanilla there {sig3(float(q['estimate']))} [{sig3(float(q['ci_low']))}, "
                 f"{sig3(float(q['ci_high']))}], p = {sig3(pq)}")
    word = ("degrades" if r["estimate"] > 0 else "improves") if p == p and p < 0.05 else "no evidence"
    return [Finding("length", word, float(r["estimate"]), "vanilla suffix ΔNLL (nats)",
                    (float(r["ci_low"]), float(r["ci_high"])), p, int(r["n_docs"]), note=note, p_kind=p_label(r))]

