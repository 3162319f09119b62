"""One head, looked at closely: its logit map split into positional and semantic terms
(docs/method.md §2, the paper's Figure-1 view) and the phase angles of one RoPE band (§3).

These are the analysis halves of two figures: :func:`decompose_head` feeds
:func:`posgen_tl.plot.head_maps`, :func:`phase_angles` feeds
:func:`posgen_tl.plot.phase_histogram`. Nothing here draws; nothing in ``plot`` runs a model.

    res = pg.decompose_head(model, tokens, layer=15, head=3)
    pg.plot.head_maps(res)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from posgen_tl.hooks.capture import QKCapture, probe_hooks
from posgen_tl.hooks.stream import capture_from_cache, capture_qk
from posgen_tl.maths.decompose import d3_split, fit_additive, score_maps
from posgen_tl.maths.rope import causal_mask, to_bands

__all__ = ["HeadDecomposition", "decompose_head", "decompose_heads", "phase_angles", "phase_angles_with_twin"]

KMean = Union[Literal["global", "per_sequence"], Float[Tensor, "kv_head d_head"], Float[Tensor, "d_head"]]  # noqa: UP007


@dataclass
class HeadDecomposition:
    """D3 split of one head's logits on one sequence, with D1's fit and the scores.

    Attributes:
        layer, head: the query head; ``kv_head`` the key group it reads.
        seq: which sequence of the batch the maps show.
        k_mean_kind: ``"global"`` (k̄ from reference tokens), ``"per_sequence"`` (each
            sequence's own mean key) or ``"given"`` (a tensor was passed).
        W, f, g: ``Float[Tensor, "query_pos key_pos"]`` float64 — logits, positional term
            ``s·q_iᵀR_{j−i}k̄``, semantic term ``s·q_iᵀ(k_j − k̄)``; unmasked.
        remainder: ``W − f − g``.
        a: ``Float[Tensor, "delta"]`` D1's distance term ``a[i−j]`` (``delta = 0..pos−1``).
        mask: ``Bool[Tensor, "query_pos key_pos"]`` entries the model attends to (causal,
            sliding window); the maps are only meaningful there.
        sink: first ``sink`` keys excluded from the scores.
        scores: tidy DataFrame, one row per (sequence, estimator ∈ {D1, D3}) with columns
            ``model, layer, head, seq, estimator, k_mean, sink, r, r2, r_within``.
        model_name: the model's name.
    """

    layer: int
    head: int
    kv_head: int
    seq: int
    k_mean_kind: str
    W: Float[Tensor, "query_pos key_pos"]
    f: Float[Tensor, "query_pos key_pos"]
    g: Float[Tensor, "query_pos key_pos"]
    remainder: Float[Tensor, "query_pos key_pos"]
    a: Float[Tensor, "delta"]
    mask: Bool[Tensor, "query_pos key_pos"]
    sink: int
    scores: pd.DataFrame
    model_name: str = ""

    def score(self, estimator: str = "D3", metric: str = "r_within") -> float:
        """``metric`` of ``estimator`` on the shown sequence (e.g. ``res.score("D3", "r")``)."""
        row = self.scores[(self.scores["estimator"] == estimator) & (self.scores["seq"] == self.seq)]
        if row.empty:
            raise KeyError(f"no {estimator} scores (have {sorted(self.scores['estimator'].unique())})")
        return float(row[metric].iloc[0])

    def to_tables(self) -> dict[str, pd.DataFrame]:
        """The maps as tidy tables (what a Result saves; :meth:`from_tables` reads them back exactly):
        ``maps`` (one row per query × key: ``query, key, attended, W, f, g, remainder``), ``a`` (``delta, a``)
        and ``scores``; the scalars (layer, head, kv head, sequence, k̄ kind, sink, model) ride on ``maps``."""
        n_q, n_k = self.W.shape
        qi, kj = np.meshgrid(np.arange(n_q), np.arange(n_k), indexing="ij")
        maps = pd.DataFrame({"query": qi.ravel(), "key": kj.ravel(), "attended": self.mask.numpy().ravel(),
                             **{n: getattr(self, n).double().numpy().ravel() for n in ("W", "f", "g", "remainder")}})
        maps = maps.assign(layer=self.layer, head=self.head, kv_head=self.kv_head, seq=self.seq,
                           k_mean_kind=self.k_mean_kind, sink=self.sink, model_name=self.model_name)
        return {"maps": maps, "a": pd.DataFrame({"delta": np.arange(len(self.a)), "a": self.a.double().numpy()}),
                "scores": self.scores}

    @classmethod
    def from_tables(cls, maps: pd.DataFrame, a: pd.DataFrame, scores: pd.DataFrame) -> HeadDecomposition:
        """The :class:`HeadDecomposition` :meth:`to_tables` wrote (float64 maps, bit for bit after a
        round-trip CSV read)."""
        n_q, n_k = int(maps["query"].max()) + 1, int(maps["key"].max()) + 1

        def grid(col: str) -> Tensor:
            return torch.from_numpy(maps[col].to_numpy(np.float64).reshape(n_q, n_k).copy())

        r = maps.iloc[0]
        return cls(layer=int(r["layer"]), head=int(r["head"]), kv_head=int(r["kv_head"]), seq=int(r["seq"]),
                   k_mean_kind=str(r["k_mean_kind"]), W=grid("W"), f=grid("f"), g=grid("g"),
                   remainder=grid("remainder"), a=torch.from_numpy(a["a"].to_numpy(np.float64).copy()),
                   mask=torch.from_numpy(maps["attended"].to_numpy(bool).reshape(n_q, n_k).copy()),
                   sink=int(r["sink"]), scores=scores, model_name="" if pd.isna(r["model_name"]) else str(r["model_name"]))

    def _repr_html_(self) -> str:  # a notebook cell ending in ``res`` shows the score table
        return (f"<p>layer {self.layer}, head {self.head} (kv head {self.kv_head}), k̄: {self.k_mean_kind}, "
                f"first {self.sink} key(s) excluded from the scores</p>" + self.scores.to_html(index=False))


def _capture(model: Any, tokens_or_cache: Any, layer: int) -> QKCapture:
    if isinstance(tokens_or_cache, Tensor):
        toks = tokens_or_cache[None] if tokens_or_cache.ndim == 1 else tokens_or_cache
        return capture_qk(model, toks, [layer])[layer]
    if hasattr(tokens_or_cache, "keys") and hasattr(tokens_or_cache, "__getitem__"):
        return capture_from_cache(model, tokens_or_cache, layer)
    raise TypeError(f"expected a token tensor [batch, pos] or an ActivationCache, got {type(tokens_or_cache).__name__}")


def _k_means(model: Any, cap: QKCapture, k_mean: KMean, reference: Tensor | None, sink: int) -> tuple[Tensor, str]:
    """``k̄`` as ``[batch, kv_head, d_head]`` (one per sequence, equal rows unless per-sequence) and its kind."""
    b, kv = cap.k.shape[0], cap.k.shape[-2]
    if isinstance(k_mean, Tensor):
        km = k_mean.float().to(cap.k.device)
        km = km.expand(kv, -1) if km.ndim == 1 else km
        if km.shape != cap.k.shape[-2:]:
            raise ValueError(f"k_mean has shape {tuple(km.shape)}; expected [kv_head={kv}, d_head={cap.k.shape[-1]}]")
        return km[None].expand(b, -1, -1), "given"
    if k_mean == "per_sequence":
        if cap.k.shape[1] <= sink:
            raise ValueError(f"sequences of {cap.k.shape[1]} tokens leave no key after the first {sink} (sink)")
        return cap.k[:, sink:].mean(dim=1), "per_sequence"
    if k_mean == "global":
        if reference is None:
            raise ValueError("k_mean='global' needs reference=tokens from OTHER documents than the analysed ones "
                             "(e.g. pg.reference_windows(model, seq_len=...)[1].tokens); "
                             "or use k_mean='per_sequence'")
        from posgen_tl.hooks.edits import key_means  # noqa: PLC0415

        km = key_means(model, reference, [cap.layer], sink=sink)[cap.layer].to(cap.k.device)
        return km[None].expand(b, -1, -1), "global"
    raise ValueError(f"k_mean must be 'global', 'per_sequence' or a [kv_head, d_head] tensor, got {k_mean!r}")


def decompose_head(
    model: Any,
    tokens_or_cache: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | Any,
    layer: int,
    head: int,
    *,
    k_mean: KMean = "per_sequence",
    reference: Int[Tensor, "n_ref pos"] | None = None,
    sink: int = 1,
    seq: int = 0,
) -> HeadDecomposition:
    """Split one head's attention logits ``W = f + g + remainder`` (D3) and fit D1's
    ``a[i−j] + b[i] + c[j]``, on every sequence of the batch; keep the maps of sequence ``seq``.

    Args:
        tokens_or_cache: token ids ``[batch, pos]`` (or ``[pos]``), or an ``ActivationCache``
            from ``model.run_with_cache(tokens)`` (then no forward pass is run).
        layer: the layer (``-1`` = the last one).
        head: the query head (``-1`` = the last one; its key group is ``head // (n_heads // n_kv_heads)``).
        k_mean: which mean pre-rotation key ``k̄`` (docs/method.md §2 — it decides what a D3 score
            means): ``"per_sequence"`` (each sequence's own keys, first ``sink`` positions
            excluded; the default), ``"global"`` (one k̄ from ``reference`` tokens of other
            documents) or a tensor ``[kv_head, d_head]``.
        reference: tokens for ``k_mean="global"``; never the analysed tokens.
        sink: the first ``sink`` keys are excluded from the scores (and from k̄).

    Raises:
        IndexRangeError: ``layer`` or ``head`` outside the model (the message names the valid range).

    Returns:
        :class:`HeadDecomposition` — float64 maps ``[query_pos, key_pos]`` of sequence ``seq``
        and a tidy ``scores`` frame (one row per sequence × {D1, D3}).
    """
    spec, _ = probe_hooks(model)
    layer, head = spec.layer_index(layer), spec.head_index(head)
    cap = _capture(model, tokens_or_cache, layer)
    if not 0 <= seq < cap.q.shape[0]:
        raise ValueError(f"seq={seq} out of range for a batch of {cap.q.shape[0]}")
    km, kind = _k_means(model, cap, k_mean, reference, sink)
    return _decompose(spec, cap, head, km, kind, sink, seq)


def decompose_heads(
    model: Any,
    tokens_or_cache: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | Any,
    layer: int,
    heads: Sequence[int] | None = None,
    *,
    k_mean: KMean = "per_sequence",
    reference: Int[Tensor, "n_ref pos"] | None = None,
    sink: int = 1,
    seq: int = 0,
) -> dict[int, HeadDecomposition]:
    """:func:`decompose_head` of several heads of one layer (default: every head) from ONE capture and one k̄:
    a single forward pass (none from an ``ActivationCache``) however many heads, where a loop over
    :func:`decompose_head` with tokens runs one per head. Returns ``{head: HeadDecomposition}`` in the order of
    ``heads``; every map and score equals :func:`decompose_head`'s for that head.

    Raises:
        IndexRangeError: ``layer`` or a head outside the model (the message names the valid range).
        ValueError: an empty ``heads`` or a repeated head."""
    spec, _ = probe_hooks(model)
    layer = spec.layer_index(layer)
    hs = list(range(spec.n_heads)) if heads is None else [spec.head_index(h) for h in heads]
    if not hs or len(set(hs)) != len(hs):
        raise ValueError(f"heads must name distinct heads of the layer, got {heads!r}")
    cap = _capture(model, tokens_or_cache, layer)
    if not 0 <= seq < cap.q.shape[0]:
        raise ValueError(f"seq={seq} out of range for a batch of {cap.q.shape[0]}")
    km, kind = _k_means(model, cap, k_mean, reference, sink)
    return {h: _decompose(spec, cap, h, km, kind, sink, seq) for h in hs}


def _decompose(spec: Any, cap: QKCapture, head: int, km: Tensor, kind: str, sink: int, seq: int) -> HeadDecomposition:
    """One head's :class:`HeadDecomposition` from a layer's capture and its k̄ ``[batch, kv_head, d_head]``."""
    b, n = cap.q.shape[:2]
    kv = spec.kv_group(head)
    window = cap.rope.sliding_window
    score_mask = causal_mask(n, sink=sink, sliding_window=window)
    rows, keep = [], None
    for s in range(b):
        split = d3_split(cap.q[s : s + 1, :, head : head + 1], cap.k[s : s + 1, :, kv : kv + 1],
                         km[s, kv : kv + 1], cap.positions[s : s + 1], cap.rope)
        w, fg = split.W[0, 0], split.f[0, 0] + split.g[0, 0]
        fit = fit_additive(w, score_mask, three_axis=True)
        for est, approx in (("D1", fit.fitted), ("D3", fg)):
            sc = score_maps(w, approx, score_mask)
            rows.append({"layer": cap.layer, "head": head, "seq": s, "estimator": est, "k_mean": kind, "sink": sink,
                         **{k: float(v) for k, v in sc.items()}})
        if s == seq:
            keep = (split, fit)
    assert keep is not None
    split, fit = keep
    W, f, g = split.W[0, 0].cpu(), split.f[0, 0].cpu(), split.g[0, 0].cpu()
    scores = pd.DataFrame(rows).assign(model=spec.model_name)
    scores = scores[["model", "layer", "head", "seq", "estimator", "k_mean", "sink", "r", "r2", "r_within"]]
    return HeadDecomposition(
        layer=cap.layer, head=head, kv_head=kv, seq=seq, k_mean_kind=kind, W=W, f=f, g=g, remainder=W - f - g,
        a=fit.a.cpu(), mask=causal_mask(n, sliding_window=window), sink=sink, scores=scores,
        model_name=spec.model_name,
    )


def phase_angles(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    head: int,
    band: int,
    which: Literal["q", "k"] = "k",
    *,
    sink: int = 1,
    twin_label: str = "trained",
) -> pd.DataFrame:
    """Phase angles ``arg z_m`` (radians, in ``(−π, π]``) of one head's band over all tokens
    after the first ``sink`` of every sequence; zero-norm entries dropped.

    ``head`` indexes kv-groups for ``which="k"``, query heads for ``"q"``. One layer is held
    in memory: keep ``tokens`` small.

    Returns:
        Tidy DataFrame, one row per token: ``model, twin, layer, which, head, band, seq, pos, phase``.
    """
    spec, _ = probe_hooks(model)
    cap = capture_qk(model, tokens, [layer])[layer]
    x = (cap.q if which == "q" else cap.k)[:, sink:, head]  # batch pos d_head
    z = to_bands(x.double(), cap.rope.rotary_dim, cap.rope.layout)[..., band]  # batch pos
    seq, pos = np.meshgrid(np.arange(z.shape[0]), np.arange(sink, sink + z.shape[1]), indexing="ij")
    keep = (z.abs() > 0).cpu().numpy()
    return pd.DataFrame({
        "model": spec.model_name, "twin": twin_label, "layer": cap.layer, "which": which, "head": head,
        "band": band, "seq": seq[keep], "pos": pos[keep], "phase": torch.angle(z).cpu().numpy()[keep],
    })


def phase_angles_with_twin(
    model: Any, tokens: Int[Tensor, "batch pos"], layer: int, head: int, band: int, which: Literal["q", "k"] = "k",
    *, twin: Any = None, seed: int = 0, sink: int = 1,
) -> pd.DataFrame:
    """:func:`phase_angles` of ``model`` (twin ``"trained"``) and of ``random_twin(model, seed)``
    (twin ``"random"``, or the prebuilt ``twin``) on the same tokens, concatenated."""
    from posgen_tl.io.models import random_twin  # noqa: PLC0415

    twin = random_twin(model, seed) if twin is None else twin
    name = probe_hooks(model)[0].model_name
    parts = [phase_angles(m, tokens, layer, head, band, which, sink=sink, twin_label=t)
             for t, m in (("trained", model), ("random", twin))]
    return pd.concat(parts, ignore_index=True).assign(model=name)
