"""Faithfulness (sufficiency) of the D3 decomposition, METHOD §5 / issue #12 item 5.

SUBSTITUTE the attention logits of a layer subset by a decomposition and measure what the model
loses: ``W ← f + g_Δ0`` (D3 at reference offset Δ0, GLOBAL k̄ from reference documents DISJOINT
from the analysed ones), for all visible entries (``gamma=None``) or only the entries below the
row's ``gamma``-quantile (LM-Infinite's code keeps the logits above its cap and replaces the rest).
The sink key column is kept exact (``keep_sink``). Controls at the same layers:

* ``d1`` — the D1 least-squares fit ``a[i−j] + b[i] + c[j]`` of the very map being replaced
  (in-sample: it knows this sequence's logits; a high-r additive fit that is NOT a mechanism);
* ``wrong_kbar`` — D3 built with another layer's k̄ (layer ``(l + L/2) mod L``).

Read-outs per sequence: clean NLL of the last ``target_len`` tokens and its change vs the
unmodified model (``dnll``); for the conditions in ``tolerance``, the T1 tolerance slope (ΔNLL per
unit swap fraction, seeds averaged inside the sequence) and its change vs the unmodified model.
Statistics (METHOD §8): unit = sequence, clustered by document; document bootstrap CI
(10 000), t-interval, sign-flip p, Holm over the printed table; n < 32 → "exploratory".
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from posgen_tl import stats
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.io.corpus import CorpusLike, Windows
from posgen_tl.hooks.edits import sufficiency_hooks
from posgen_tl.experiments.decomposition import analysis_windows, reference_key_means
from posgen_tl.experiments.length import LengthResult, _ci_rows, _contrast, _finish
from posgen_tl.experiments.tolerance import nll_on_target, transposition_curve

__all__ = ["SOURCES", "layer_groups", "sufficiency_hooks_for", "sufficiency", "sufficiency_summary"]

SOURCES = ("d3", "d3_quantile", "d1", "wrong_kbar")


def layer_groups(n_layers: int, n_groups: int = 3) -> dict[str, list[int]]:
    """``{"0–9": [0..9], "10–19": [...], "20–29": [...], "all": [...]}``: contiguous thirds + all."""
    edges = np.linspace(0, n_layers, n_groups + 1).round().astype(int)
    out = {f"{a}–{b - 1}": list(range(a, b)) for a, b in zip(edges[:-1], edges[1:]) if b > a}
    out["all"] = list(range(n_layers))
    return out


def sufficiency_hooks_for(
    model: Any, source: str, layers: Sequence[int], k_means: dict, *, gamma: float = 0.9, delta0: int = 0,
    keep_sink: int = 1,
) -> list:  # fmt: skip
    """Hooks of one condition of :func:`sufficiency` (``source`` in :data:`SOURCES`) on ``layers``."""
    n_layers = probe_hooks(model)[0].n_layers
    if source == "d3":
        return sufficiency_hooks(model, k_means=k_means, layers=layers, delta0=delta0, keep_sink=keep_sink)
    if source == "d3_quantile":
        return sufficiency_hooks(model, k_means=k_means, layers=layers, delta0=delta0, keep_sink=keep_sink, gamma=gamma)
    if source == "d1":
        return sufficiency_hooks(model, source="d1", layers=layers, keep_sink=keep_sink)
    if source == "wrong_kbar":
        other = {layer: (layer + n_layers // 2) % n_layers for layer in range(n_layers)}
        return sufficiency_hooks(model, k_means=k_means, layers=layers, delta0=delta0, keep_sink=keep_sink,
                                 mean_layer=other)
    raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")


def sufficiency(
    model: Any, corpus: CorpusLike | Windows = None, *, n_seq: int = 32, seq_len: int = 256, target_len: int = 64,
    groups: dict[str, Sequence[int]] | None = None, sources: Sequence[str] = SOURCES, gamma: float = 0.9,
    delta0: int = 0, keep_sink: int = 1, n_ref: int = 8, k_means: dict | None = None,
    reference: Windows | None = None, tolerance: Sequence[tuple[str, str]] = (),
    fracs: Sequence[float] = (0.0, 0.05, 0.1, 0.2), seeds: Sequence[int] = (0,), seed: int = 0,
    batch_size: int = 4, progress: bool = True,
) -> LengthResult:  # fmt: skip
    """Substitute ``W ← f + g_Δ0`` (and the controls) in layer groups; clean NLL and tolerance.

    Args:
        groups: ``{label: layers}`` (default :func:`layer_groups`: thirds + all).
        sources: conditions, subset of :data:`SOURCES`.
        gamma: the per-row quantile of ``d3_quantile`` (entries below it are replaced).
        tolerance: ``(source, group)`` pairs whose T1 tolerance slope is measured (plus the
            unmodified model) — each costs ``len(fracs)·len(seeds)`` forward passes.
        k_means: global k̄ per layer (default: ``n_ref`` windows of disjoint documents).

    Returns:
        :class:`~posgen_tl.experiments.length.LengthResult` with ``rows`` (``source, group, layers, seq,
        doc, doc_name, clean_nll, nll, dnll`` and, for measured pairs, ``slope, dslope``) and
        ``summary`` (:func:`sufficiency_summary`).
    """
    spec, _ = probe_hooks(model)
    groups = layer_groups(spec.n_layers) if groups is None else groups
    bad = set(sources) - set(SOURCES)
    if bad:
        raise ValueError(f"unknown source(s) {sorted(bad)}; choose from {SOURCES}")
    win, ref = analysis_windows(model, corpus, reference, n_seq=n_seq, seq_len=seq_len, n_ref=n_ref, seed=seed)
    if k_means is None:
        if ref is None:
            raise ValueError("pass k_means or reference windows (the global k̄ needs disjoint documents)")
        k_means = reference_key_means(model, ref.tokens, sink=1, progress=False)
    tokens = win.tokens
    docs = win.doc_ids.numpy()
    clean = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size)
    tol_set = {tuple(t) for t in tolerance}

    def slopes(hooks, base) -> np.ndarray:
        df = transposition_curve(model, tokens, fracs=fracs, seeds=seeds, target_len=target_len, fwd_hooks=hooks,
                                 batch_size=batch_size, clean=base, progress=False)
        return stats.per_sequence_slopes(df).sort_index().to_numpy(float)

    clean_slope = slopes([], clean) if tol_set else None
    rows = []
    jobs = [(s, g) for g in groups for s in sources]
    for source, group in tqdm(jobs, desc="sufficiency", disable=not progress, leave=False):
        layers = list(groups[group])
        hooks = sufficiency_hooks_for(model, source, layers, k_means, gamma=gamma, delta0=delta0, keep_sink=keep_sink)
        nll = nll_on_target(model, tokens, target_len=target_len, fwd_hooks=hooks, batch_size=batch_size)
        sl = slopes(hooks, nll) if (source, group) in tol_set else None
        for i in range(len(win)):
            r = dict(source=source, group=group, layers=f"{layers[0]}–{layers[-1]}", seq=i, doc=int(docs[i]),
                     doc_name=win.doc_names[int(docs[i])], clean_nll=float(clean[i]), nll=float(nll[i]),
                     dnll=float(nll[i] - clean[i]))
            if sl is not None:
                r.update(slope=float(sl[i]), clean_slope=float(clean_slope[i]), dslope=float(sl[i] - clean_slope[i]))
            rows.append(r)
    df = pd.DataFrame(rows)
    cfg = dict(model=spec.model_name, n_seq=len(win), n_docs=win.n_docs, seq_len=tokens.shape[1], target_len=target_len,
               gamma=gamma, delta0=delta0, keep_sink=keep_sink, k_mean="global (disjoint documents)",
               fracs=list(fracs), seeds=list(seeds), groups={k: list(v) for k, v in groups.items()})
    return LengthResult(df, sufficiency_summary(df), cfg)


def sufficiency_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (source, group): ``dnll`` (ΔNLL of the target span vs the unmodified model) and, where
    measured, ``dslope`` (change of the T1 tolerance slope): mean, document-bootstrap CI,
    t-interval, sign-flip p, Holm over the whole table, n."""
    out = []
    for (source, group), g in rows.groupby(["source", "group"], sort=False):
        docs = g["doc"].to_numpy()
        base = dict(source=source, group=group, layers=g["layers"].iloc[0])
        out.append({**base, "estimator": "clean_nll", **_ci_rows(g["clean_nll"].to_numpy(), docs), "p": np.nan})
        out.append({**base, "estimator": "dnll", **_contrast(g["dnll"].to_numpy(), docs)})
        if "dslope" in g and g["dslope"].notna().all():
            out.append({**base, "estimator": "dslope", **_contrast(g["dslope"].to_numpy(), docs)})
    return _finish(pd.DataFrame(out))
