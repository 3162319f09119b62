"""Longer texts (METHOD §7): the gap probe, Gemma3 window removal, and the attention change by head class.

Conditions (all as TransformerLens hooks from :mod:`posgen_tl.hooks.edits`):

* ``vanilla`` — the model as it is (its own RoPE at the given position ids);
* ``lm_infinite`` — distances ``> cap`` clamped to ``cap``, the first ``n_sink`` keys visible at
  their true distance (:func:`~posgen_tl.hooks.edits.lm_infinite_hooks`);
* ``disentangled`` — distances ``> cap`` replaced by ``f(q_i, cap) + g_Δ0(q_i, k_j)`` with a
  GLOBAL ``k̄`` from reference documents disjoint from the analysed ones
  (:func:`~posgen_tl.hooks.edits.disentangled_hooks`).

Units and statistics (METHOD §8): the unit is a sequence (one window), clustered by its
document; every CI is a document-level bootstrap (:func:`posgen_tl.stats.inference.bootstrap_ci`, 10 000
draws) beside a t-interval on document means, every p-value an exact/Monte-Carlo sign-flip test
over documents, Holm-adjusted within one printed table. Fewer than 32 sequences → "exploratory".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl import stats
from posgen_tl.hooks.capture import QKCapture, StopForward, check_tokens, probe_hooks, stream_qk
from posgen_tl.io.corpus import CorpusLike, Windows, document_windows, split_documents
from posgen_tl.maths.approx_logits import d3_approx_logits, exact_logits
from posgen_tl.maths.decompose import causal_mask, within_row_r
from posgen_tl.hooks.edits import (
    disentangled_hooks,
    final_residual_hook,
    lm_infinite_hooks,
    local_layers,
    window_removal_hooks,
)
from posgen_tl.maths.perturb import gap_position_ids, nll_from_logits
from posgen_tl.experiments.decomposition import analysis_windows, reference_key_means

__all__ = [
    "LengthResult",
    "span_nll",
    "gap_probe",
    "gap_summary",
    "window_removal",
    "window_summary",
    "gap_attention",
    "head_class_test",
    "classes_from_taxonomy",
    "CONDITIONS",
]

CONDITIONS = ("vanilla", "lm_infinite", "disentangled")
DEFAULT_GAPS = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass
class LengthResult:
    """Rows (one per sequence × condition × G or bucket, with ``doc``), their summary, the settings."""

    rows: pd.DataFrame
    summary: pd.DataFrame
    config: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- NLL of a span


@torch.no_grad()
def span_nll(
    model: Any, tokens: Int[Tensor, "batch pos"], start: int, stop: int | None = None, *,
    position_ids: Int[Tensor, "pos"] | Int[Tensor, "batch pos"] | None = None, fwd_hooks: Sequence = (),
    chunk: int = 256,
) -> Float[Tensor, "batch span"]:  # fmt: skip
    """Per-token next-token NLL of the tokens at sequence indices ``[start, stop)`` (float32, CPU).

    Token ``t`` is predicted at position ``t − 1``; only those ``stop − start`` residuals are
    unembedded, ``chunk`` positions at a time (a 262k vocabulary stays bounded in memory).
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
    kw = {} if position_ids is None else {"position_ids": position_ids.to(tokens.device).expand(tokens.shape[0], -1)
                                          if position_ids.ndim == 1 else position_ids.to(tokens.device)}
    with model.hooks(fwd_hooks=list(fwd_hooks) + ([fin] if fin else [])):
        try:
            logits = model(tokens, **kw)
            resid = None
        except StopForward:
            resid, logits = store["resid"], None
    targets = tokens[:, start:stop]
    out = []
    for s in range(0, stop - start, chunk):
        e = min(s + chunk, stop - start)
        lg = model.unembed(resid[:, s:e]) if resid is not None else logits[:, start - 1 + s : start - 1 + e]
        lg = torch.cat([lg, lg[:, :1]], 1)  # nll_from_logits predicts t+1 from t: pad one row
        toks = torch.cat([tokens[:, start - 1 + s : start - 1 + s + 1], targets[:, s:e]], 1)
        out.append(nll_from_logits(lg, toks)[:, : e - s].float().cpu())
    return torch.cat(out, 1)


# ----------------------------------------------------------------------------- summaries


def _ci_rows(values: np.ndarray, docs: np.ndarray) -> dict:
    m, lo, hi = stats.bootstrap_ci(values, clusters=docs, n_boot=10_000)
    out = dict(value=m, ci_low=lo, ci_high=hi, n_seq=len(values), n_docs=len(np.unique(docs)))
    if out["n_docs"] >= 2:
        _, tlo, thi = stats.t_interval(values, clusters=docs)
        out.update(t_low=tlo, t_high=thi)
    return out


def _contrast(d: np.ndarray, docs: np.ndarray) -> dict:
    """CI row of paired differences plus the sign-flip p; identically-zero differences (identical by
    construction, e.g. tokens that see no changed entry) get no p and do not enter the Holm family."""
    out = _ci_rows(d, docs)
    out["p"] = stats.sign_flip_test(d, clusters=docs) if out["n_docs"] >= 2 and np.any(d != 0) else np.nan
    return out


def _finish(df: pd.DataFrame) -> pd.DataFrame:
    if "p" in df and df["p"].notna().any():
        df["p_holm"] = stats.holm(df["p"].to_numpy(float))
    df["label"] = np.where(df["n_seq"] < 32, "exploratory", "")
    return df


# ----------------------------------------------------------------------------- windows, k̄


def _windows(model, corpus, seq_len, n_seq, n_ref, seed, reference=None) -> tuple[Windows, Windows | None]:
    if isinstance(corpus, Windows) and corpus.tokens.shape[1] < seq_len:
        raise ValueError(f"the windows hold {corpus.tokens.shape[1]} tokens; prefix + suffix need {seq_len}")
    return analysis_windows(model, corpus, reference, n_seq=n_seq, seq_len=seq_len, n_ref=n_ref, seed=seed)


def _global_kbar(model, ref: Windows | None, k_means, layers=None) -> dict:
    if k_means is not None:
        return k_means
    if ref is None:
        raise ValueError("the disentangled condition needs a global k̄: pass k_means or reference windows")
    return reference_key_means(model, ref.tokens, layers, sink=1, progress=False)


# ----------------------------------------------------------------------------- gap probe


def gap_probe(
    model: Any, corpus: CorpusLike | Windows = None, *, prefix_len: int = 256, suffix_len: int = 256,
    gaps: Sequence[float] = DEFAULT_GAPS, conditions: Sequence[str] = CONDITIONS, cap: int | None = None,
    n_sink: int = 1, delta0: int = 0, skip: int = 16, n_seq: int = 32, n_ref: int = 8,
    k_means: dict | None = None, reference: Windows | None = None, seed: int = 0, batch_size: int = 2,
    progress: bool = True,
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
        cap: ``C`` of both approximations (default ``n_ctx``: only unseen distances are touched).
        n_sink: keys kept at their true distance. delta0: Δ0 of ``g_Δ0`` (0 = D3).
        k_means: global k̄ per layer (default: from ``n_ref`` windows of disjoint documents).

    Returns:
        :class:`LengthResult`: ``rows`` (model-independent columns ``condition, gap_frac, gap,
        max_distance, seq, doc, doc_name, nll, nll_first, reused``) and ``summary``
        (:func:`gap_summary`).

    Raises:
        ValueError: negative gap or cap, ``skip ≥ suffix_len``, windows shorter than
        ``prefix_len + suffix_len``, unknown condition. CaptureError: scores not pre-softmax.
    """
    spec, info = probe_hooks(model)
    n_ctx = spec.n_ctx
    cap = n_ctx if cap is None else cap
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
    win, ref = _windows(model, corpus, n, n_seq, n_ref, seed, reference)
    tokens = check_tokens(model, win.tokens[:, :n], spec)
    if "disentangled" in conditions:
        k_means = _global_kbar(model, ref, k_means)
    docs = win.doc_ids.numpy()
    rows = []
    jobs = [(float(g), c) for g in gaps for c in conditions]
    for frac, cond in tqdm(jobs, desc="gap probe", disable=not progress, leave=False):
        gap = int(round(frac * n_ctx))
        pos = gap_position_ids(prefix_len, suffix_len, gap)
        max_d = int(pos[-1] - pos[0])
        reused = cond != "vanilla" and max_d <= cap
        if reused:
            base = [r for r in rows if r["condition"] == "vanilla" and r["gap"] == gap]
            rows += [{**r, "condition": cond, "reused": True} for r in base]
            continue
        hooks = []
        if cond == "lm_infinite":
            hooks = lm_infinite_hooks(model, cap, n_sink=n_sink, position_ids=pos)
        elif cond == "disentangled":
            hooks = disentangled_hooks(model, k_means, cap, delta0=delta0, n_sink=n_sink, position_ids=pos)
        for s in range(0, tokens.shape[0], batch_size):
            b = tokens[s : s + batch_size]
            nll = span_nll(model, b, prefix_len + 1, n, position_ids=pos, fwd_hooks=hooks)
            for i in range(b.shape[0]):
                rows.append(dict(condition=cond, gap_frac=frac, gap=gap, max_distance=max_d, seq=s + i,
                                 doc=int(docs[s + i]), doc_name=win.doc_names[int(docs[s + i])],
                                 nll=float(nll[i, skip - 1 :].mean()), nll_first=float(nll[i, : skip - 1].mean()),
                                 reused=False))
    df = pd.DataFrame(rows)
    cfg = dict(model=spec.model_name, n_ctx=n_ctx, prefix_len=prefix_len, suffix_len=suffix_len, skip=skip, cap=cap,
               n_sink=n_sink, delta0=delta0, n_seq=len(win), n_docs=win.n_docs, k_mean="global (disjoint documents)")
    return LengthResult(df, gap_summary(df), cfg)


def gap_summary(rows: pd.DataFrame, value: str = "nll") -> pd.DataFrame:
    """Per condition and G: mean suffix NLL (document-bootstrap CI, t-interval), the paired change
    vs G = 0 of the same condition (``estimator='d_vs_gap0'``, sign-flip p) and vs vanilla at the
    same G (``'d_vs_vanilla'``). Holm over all p-values of the table; ``label`` 'exploratory' if n < 32."""
    out = []
    key = ["seq", "doc"]
    for (cond, gap), g in rows.groupby(["condition", "gap"], sort=True):
        g = g.sort_values("seq")
        base = dict(condition=cond, gap=gap, gap_frac=g["gap_frac"].iloc[0])
        out.append({**base, "estimator": "nll", **_ci_rows(g[value].to_numpy(), g["doc"].to_numpy()), "p": np.nan})
        ref0 = rows[(rows["condition"] == cond) & (rows["gap"] == rows["gap"].min())].sort_values("seq")
        if gap != rows["gap"].min():
            m = g.merge(ref0, on=key, suffixes=("", "_0"))
            out.append({**base, "estimator": "d_vs_gap0",
                        **_contrast((m[value] - m[f"{value}_0"]).to_numpy(), m["doc"].to_numpy())})
        if cond != "vanilla" and not g["reused"].all():
            van = rows[(rows["condition"] == "vanilla") & (rows["gap"] == gap)]
            m = g.merge(van, on=key, suffixes=("", "_v"))
            out.append({**base, "estimator": "d_vs_vanilla",
                        **_contrast((m[value] - m[f"{value}_v"]).to_numpy(), m["doc"].to_numpy())})
    return _finish(pd.DataFrame(out))


# ----------------------------------------------------------------------------- Gemma3 window removal


def _long_windows(model, corpus, seq_len, n_seq, n_ref, seed, max_per_doc) -> tuple[Windows, Windows]:
    """Analysed windows of ``seq_len`` (several per long document allowed) and reference windows of
    ``min(256, seq_len // 4)`` tokens from DISJOINT documents — preferring documents too short for an analysed window."""
    from posgen_tl.io.corpus import _named_docs  # noqa: PLC0415

    texts, _ = _named_docs(corpus)
    tok = model.tokenizer
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    short = [i for i, L in enumerate(lengths) if L < seq_len]
    if len(short) >= 2:
        ref_docs = short
        ana_docs = [i for i in range(len(texts)) if i not in set(short)]
    else:
        ana_docs, ref_docs = split_documents(len(texts), seed=seed)
    if not ana_docs:
        raise ValueError(f"no document of the corpus has {seq_len} tokens: window removal needs longer texts")
    ana = document_windows(model, corpus, seq_len=seq_len, n_seq=None, docs=ana_docs, max_per_doc=max_per_doc, seed=seed)
    ana = ana.subset(range(min(n_seq, len(ana))))
    ref = document_windows(model, corpus, seq_len=min(256, max(2, seq_len // 4)), n_seq=n_ref, docs=ref_docs, seed=seed)
    assert not set(ana.doc_ids.tolist()) & set(ref.doc_ids.tolist())
    return ana, ref


def window_removal(
    model: Any, corpus: CorpusLike | Windows = None, *, seq_len: int = 2048, n_seq: int = 16, bucket: int = 256,
    conditions: Sequence[str] = ("window", "no_window", "lm_infinite", "disentangled"), cap: int | None = None,
    n_sink: int = 1, delta0: int = 0, n_ref: int = 8, k_means: dict | None = None, reference: Windows | None = None,
    max_per_doc: int | None = None, seed: int = 0, progress: bool = True,
) -> LengthResult:  # fmt: skip
    """Gemma3 local layers without their sliding window, NLL by position bucket.

    Conditions (only LOCAL layers are touched; global layers run as trained):
    ``window`` (the model as trained), ``no_window`` (local layers attend over the whole causal
    context with exact RoPE logits — distances ``window..seq_len−1`` they never trained on),
    ``lm_infinite`` (no window, local distances ``> cap`` clamped to ``cap``, default
    ``window − 1``), ``disentangled`` (no window, local distances ``> cap`` replaced by
    ``f(q_i, cap) + g_Δ0`` with a global k̄ from disjoint documents).

    Windows: documents are short, so a long document may give several (disjoint) windows
    (``max_per_doc``); the unit stays the window, clustered by document. The k̄ reference uses
    ``min(256, seq_len // 4)``-token windows of documents too short to give a ``seq_len`` window (disjoint by construction).

    Returns:
        :class:`LengthResult`: rows ``condition, seq, doc, doc_name, bucket_start, nll`` (mean NLL
        of the tokens predicted in ``[bucket_start, bucket_start + bucket)``), summary
        (:func:`window_summary`).

    Raises:
        ValueError: a model without sliding-window layers; no document long enough.
    """
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
        win, ref = _long_windows(model, corpus, seq_len, n_seq, n_ref, seed, max_per_doc)
    tokens = check_tokens(model, win.tokens, spec)
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
    docs = win.doc_ids.numpy()
    rows = []
    n = tokens.shape[1]
    # tokens 1..window are predicted from positions that see no distance ≥ window: identical in every
    # condition (tested), so the no-window conditions reuse the window run's NLL there
    conditions = sorted(conditions, key=lambda c: c != "window")
    first: dict[int, Tensor] = {}
    for cond in conditions:
        for s in tqdm(range(tokens.shape[0]), desc=f"window removal: {cond}", disable=not progress, leave=False):
            if cond != "window" and s in first and window + 1 < n:
                tail = span_nll(model, tokens[s : s + 1], window + 1, n, fwd_hooks=hooks[cond])[0]
                nll = torch.cat([first[s], tail])
            else:
                nll = span_nll(model, tokens[s : s + 1], 1, n, fwd_hooks=hooks[cond])[0]  # token t at nll[t − 1]
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
        out.append({**base, "estimator": "nll", **_ci_rows(g["nll"].to_numpy(), g["doc"].to_numpy()), "p": np.nan})
        if cond != "window" and "window" in set(rows["condition"]):
            ref = rows[(rows["condition"] == "window") & (rows["bucket_start"] == b0)]
            m = g.merge(ref, on=["seq", "doc"], suffixes=("", "_w"))
            out.append({**base, "estimator": "d_vs_window",
                        **_contrast((m["nll"] - m["nll_w"]).to_numpy(), m["doc"].to_numpy())})
    return _finish(pd.DataFrame(out))


# ----------------------------------------------------------------------------- mechanism link


def _var_within(x: Tensor, mask: Tensor) -> Tensor:
    """Mean within-row variance of ``x`` over ``mask`` entries: ``[batch, head]``."""
    mf = mask.double()
    x = torch.where(mask, x, 0.0)  # off-mask entries may be -inf
    cnt = mf.sum(-1).clamp(min=1)
    xm = (x * mf).sum(-1) / cnt
    v = (((x - xm[..., None]) * mf) ** 2).sum(-1) / cnt
    rows = (mask.sum(-1) >= 2).double()
    return (v * rows).sum(-1) / rows.sum(-1).clamp(min=1)


@torch.no_grad()
def gap_attention(
    model: Any, windows: Windows, *, prefix_len: int, suffix_len: int, gap: int | None = None,
    k_means: dict, skip: int = 16, sink: int = 1, layers: Sequence[int] | None = None, batch_size: int = 1,
    progress: bool = True,
) -> pd.DataFrame:  # fmt: skip
    """Per (sequence, layer, head): how attention changes when the suffix is moved ``gap`` ids away.

    Two passes per batch (G = 0 and G = ``gap``, default ``2·n_ctx``) capture the attention pattern
    of the suffix query rows ``[|P| + skip, |P| + |S|)`` and the layer's pre-rotation q/k:

    * ``kl`` — mean over those rows of ``KL(p_G ‖ p_0)`` (nats; upstream layers' changes included);
    * ``mass_far_0`` / ``mass_far_gap`` — attention mass on the prefix keys ``[sink, |P|)``;
    * ``f_share`` — at G = 0, within-row variance of D3's ``f`` over that of ``f`` plus ``g``
      (global k̄; rows over causal keys ``≥ sink``): the head-class proxy of :func:`head_class_test`;
    * ``r_far`` / ``r_far_0`` — D3 within-row r (W vs f + g, global k̄) on the far entries (suffix
      rows × prefix keys ``≥ sink``) at G = ``gap`` and at G = 0; ``r_near`` on suffix × suffix keys.
      With ``gap ≥ n_ctx`` every far entry lies beyond the trained context.

    Entries a sliding window hides are excluded. Returns a tidy DataFrame with ``seq, doc, layer,
    head`` and the columns above.
    """
    spec, _ = probe_hooks(model)
    gap = 2 * spec.n_ctx if gap is None else int(gap)
    n = prefix_len + suffix_len
    tokens = check_tokens(model, windows.tokens[:, :n], spec)
    layers = list(range(spec.n_layers)) if layers is None else sorted(layers)
    rows_q = torch.arange(prefix_len + skip, n)
    docs = windows.doc_ids.numpy()
    out = []
    for s in tqdm(range(0, tokens.shape[0], batch_size), desc="gap attention", disable=not progress, leave=False):
        b = tokens[s : s + batch_size]
        res: dict[int, dict[str, Tensor]] = {}
        for tag, g in (("0", 0), ("gap", gap)):
            pos = gap_position_ids(prefix_len, suffix_len, g).expand(b.shape[0], -1)

            def on_qk(c: QKCapture, tag=tag) -> None:
                d = res.setdefault(c.layer, {})
                rope = c.rope
                # the model's own pattern: softmax of its (masked) pre-softmax scores
                d[f"p_{tag}"] = torch.softmax(c.scores[:, :, rows_q].float(), dim=-1)
                km = k_means[c.layer]
                W = exact_logits(c.q, c.k, rope, c.positions, dtype=torch.float32)
                approx = d3_approx_logits(c.q, c.k, km, rope, positions=c.positions, dtype=torch.float32)
                kbar = km.float().expand(c.k.shape[0], c.k.shape[1], -1, -1)
                f = d3_approx_logits(c.q, kbar, km, rope, positions=c.positions, dtype=torch.float32)  # k := k̄ → g = 0
                m = causal_mask(n, sink=sink, sliding_window=rope.sliding_window, device=c.q.device)
                far = torch.zeros_like(m)
                far[prefix_len + skip :, sink:prefix_len] = True
                far &= m
                near = torch.zeros_like(m)
                near[prefix_len + skip :, prefix_len:] = True
                near &= m
                d[f"r_far_{tag}"] = within_row_r(W, approx, far) if far.any() else torch.full(W.shape[:2], torch.nan)
                if tag == "0":
                    vf, vg = _var_within(f.double(), m), _var_within((approx - f).double(), m)
                    d["f_share"] = vf / (vf + vg)
                else:
                    d["r_near"] = within_row_r(W, approx, near)

            stream_qk(model, b, on_qk, layers, with_scores=True, batch_size=b.shape[0], position_ids=pos,
                      progress=False)
        for layer in layers:
            d = res[layer]
            p0, pg = d["p_0"].clamp(min=1e-12), d["p_gap"].clamp(min=1e-12)
            kl = (d["p_gap"] * (pg.log() - p0.log())).sum(-1).mean(-1)  # b h
            m0 = d["p_0"][..., sink:prefix_len].sum(-1).mean(-1)
            mg = d["p_gap"][..., sink:prefix_len].sum(-1).mean(-1)
            for i in range(b.shape[0]):
                for h in range(kl.shape[1]):
                    out.append(dict(seq=s + i, doc=int(docs[s + i]), layer=layer, head=h, gap=gap,
                                    kl=float(kl[i, h]), mass_far_0=float(m0[i, h]), mass_far_gap=float(mg[i, h]),
                                    f_share=float(d["f_share"][i, h]), r_far=float(d["r_far_gap"][i, h]),
                                    r_far_0=float(d["r_far_0"][i, h]), r_near=float(d["r_near"][i, h])))
    return pd.DataFrame(out)


def classes_from_taxonomy(heads: pd.DataFrame, *, twin: str = "trained") -> pd.DataFrame:
    """Head classes ``layer, head, head_class`` from a METHOD §6 taxonomy table (one row per head,
    e.g. :func:`posgen_tl.experiments.taxonomy.head_table` or ``heads_<model>.csv``): heads labelled
    ``positional`` or ``symbolic`` keep their label; ``both``/``neither``/excluded heads are left
    out (they belong to neither side of the contrast). Rows of ``twin`` only when the table has a
    ``twin`` column.

    Raises:
        ValueError: a needed column is missing, the twin has no rows, or a (layer, head) repeats.
    """
    need = {"layer", "head", "label"}
    if not need <= set(heads.columns):
        raise ValueError(f"taxonomy table lacks columns {sorted(need - set(heads.columns))}; "
                         "give the per-head table of the §6 taxonomy (columns layer, head, label)")
    t = heads[heads["twin"] == twin] if "twin" in heads.columns else heads
    if t.empty:
        raise ValueError(f"taxonomy table has no rows for twin {twin!r} (present: {sorted(set(heads['twin']))})")
    if t.duplicated(["layer", "head"]).any():
        raise ValueError("taxonomy table has repeated (layer, head) rows for one model")
    t = t[t["label"].isin(["positional", "symbolic"])]
    return t[["layer", "head"]].assign(head_class=t["label"].to_numpy()).reset_index(drop=True)


def head_class_test(rows: pd.DataFrame, classes: pd.DataFrame | None = None, *, threshold: float = 0.5) -> pd.DataFrame:
    """Seed 003's prediction: symbolic heads' attention changes LESS under the gap than positional ones'.

    ``classes``: a DataFrame ``layer, head, head_class`` (e.g. from the §6 taxonomy). Without it
    the PROXY is used: ``positional`` if the head's mean D3 ``f_share`` (share of within-row logit
    variance carried by the positional term f, global k̄) is ``≥ threshold``, else ``symbolic`` —
    a decomposition-based stand-in, not the §6 permutation taxonomy.

    Per sequence, the mean over heads of each class is taken; the contrast
    ``d = positional − symbolic`` (of ``kl`` and of ``|mass_far_gap − mass_far_0|``) is tested over
    sequences clustered by document (sign-flip p, bootstrap CI, Holm over the table). A positive
    ``d`` supports the prediction. Also reported: mean D3 within-row r on far vs the same entries at
    G = 0, per class.

    Returns:
        Tidy DataFrame ``estimator, value, ci_low, ci_high, t_low, t_high, p, p_holm, n_seq, n_docs,
        n_heads_positional, n_heads_symbolic, classes``.
    """
    df = rows.copy()
    df["d_mass"] = (df["mass_far_gap"] - df["mass_far_0"]).abs()
    if classes is None:
        share = df.groupby(["layer", "head"])["f_share"].mean()
        cls = (share >= threshold).map({True: "positional", False: "symbolic"}).rename("head_class").reset_index()
        source = f"proxy: mean D3 f_share ≥ {threshold} → positional"
    else:
        cls, source = classes[["layer", "head", "head_class"]], "taxonomy"
    df = df.merge(cls, on=["layer", "head"])
    n_cls = cls["head_class"].value_counts()
    per = df.groupby(["seq", "doc", "head_class"])[["kl", "d_mass", "r_far", "r_far_0"]].mean().unstack("head_class")
    out = []
    if {"positional", "symbolic"} <= set(cls["head_class"]):
        docs = per.index.get_level_values("doc").to_numpy()
        for col in ("kl", "d_mass"):
            d = (per[(col, "positional")] - per[(col, "symbolic")]).to_numpy()
            out.append(dict(estimator=f"{col}: positional − symbolic", **_contrast(d, docs)))
        for c in ("positional", "symbolic"):
            d = (per[("r_far", c)] - per[("r_far_0", c)]).to_numpy()
            ok = np.isfinite(d)
            if ok.sum() >= 2:
                out.append(dict(estimator=f"D3 r_far − r_far(G=0): {c}", **_contrast(d[ok], docs[ok])))
    res = _finish(pd.DataFrame(out)) if out else pd.DataFrame(out)
    res["n_heads_positional"] = int(n_cls.get("positional", 0))
    res["n_heads_symbolic"] = int(n_cls.get("symbolic", 0))
    res["classes"] = source
    return res
