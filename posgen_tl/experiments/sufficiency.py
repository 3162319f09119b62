"""Faithfulness (sufficiency) of the D3 decomposition, docs/method.md §5 / issue #12 item 5.

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
Statistics (docs/method.md §8): unit = sequence, clustered by document; document bootstrap CI
(10 000), t-interval, sign-flip p, Holm over the printed table; n < 32 → "exploratory".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from posgen_tl import stats
from posgen_tl.engine.swaps import nll_on_target, transposition_curve, windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.capture import model_device, probe_hooks
from posgen_tl.hooks.chunked import forward_chunk
from posgen_tl.hooks.edits import reference_key_means
from posgen_tl.hooks.logits import sufficiency_hooks
from posgen_tl.hooks.memory import SUBSTITUTION_MAPS, free_bytes
from posgen_tl.hooks.reentry import recorded, resid_hooks
from posgen_tl.io.corpus import CorpusLike
from posgen_tl.io.sampling import Windows, resolve_windows
from posgen_tl.maths import groups as layer_grouping
from posgen_tl.maths.groups import group_label
from posgen_tl.stats.tables import ci_row, contrast_row, finish_table

__all__ = ["Config", "Result", "run", "render", "sufficiency", "sufficiency_equivalence", "SOURCES", "layer_groups",
           "sufficiency_hooks_for", "sufficiency_summary"]

SOURCES = ("d3", "d3_quantile", "d1", "wrong_kbar")
#: the most bytes of residuals :func:`run` keeps so that a group's substituted passes resume at its first layer (beyond
#: them, or beyond a quarter of the free memory, every pass runs from the first block)
PREFIX_BYTES = 1 << 30


def layer_groups(n_layers: int) -> dict[str, list[int]]:
    """``{"0–9": [0..9], "10–19": [...], "20–29": [...], "all": [...]}``: the layer thirds of
    :func:`posgen_tl.maths.groups.layer_groups`, labelled by their range, and all layers."""
    out = {group_label(ls): ls for ls in layer_grouping.layer_groups(n_layers).values() if ls}
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


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the sufficiency test (docs/method.md §5, substitution)."""

    NAME: ClassVar[str] = "sufficiency"
    n_ref: int = base.n_ref_option()
    target_len: int = base.option(0, "tokens at the end whose NLL is measured; 0 = min(64, seq_len / 4)", "count")
    sources: tuple[str, ...] = base.option(("d3", "d1"), "substituted logits: d3 (f + g_Δ0), d3_quantile, and the d1 and "
                                           "wrong_kbar controls", "names", full=SOURCES)
    tolerance: tuple[tuple[str, str], ...] = base.option((), "source:group pairs whose T1 tolerance "
                                                         "slope is measured, e.g. d3:all", "pairs",
                                                         full=(("d3", "all"),))
    fracs: tuple[float, ...] = base.option((0.0, 0.1, 0.2), "swap fractions of the tolerance slopes (must include 0)",
                                           "floats")
    seeds: tuple[int, ...] = base.option((0,), "swap seeds of the tolerance slopes", "ints")
    gamma: float = base.option(0.9, "per-row quantile of the d3_quantile source (entries below it are replaced)", "float")
    delta0: int = base.option(0, "reference offset Δ0 of g_Δ0", "count")
    keep_sink: int = base.option(1, "first keys kept exact", "count")
    margin: float = base.option(0.05, "equivalence margin (nats of ΔNLL) for 'the substitution barely moves the NLL': "
                                      "TOST, declared before the run", "float")
    batch_size: int = base.batch_option(0, auto=True)

    def target(self) -> int:
        """The target length (``target_len``, or ``min(64, seq_len // 4)`` when it is 0)."""
        return self.target_len or min(64, self.seq_len // 4)


class Result(base.Result):
    """The outcome of :func:`run`.

    Attributes:
        tables: ``rows`` (per source × group × sequence: ``source, group, layers, seq, doc, doc_name, clean_nll, nll,
            dnll`` and, for the measured tolerance pairs, ``slope, clean_slope, dslope``), ``summary``
            (:func:`sufficiency_summary`) and ``equivalence`` (:func:`sufficiency_equivalence` at the declared margin).
        config: the Config's options. meta: model, documents, sizes, the layer groups, the k̄ kind.
    """




#: the tables' files in a study folder (the names published runs already carry)
FILES = {"rows": "sufficiency_rows.csv", "summary": "sufficiency_summary.csv",
         "equivalence": "sufficiency_equivalence.csv"}
LEGACY_META = "sufficiency_meta.json"


@base.shares_heap
def run(
    model: Any, cfg: Config | None = None, *, corpus: CorpusLike | Windows = None,
    groups: dict[str, Sequence[int]] | None = None, k_means: dict | None = None, reference: Windows | None = None,
    checkpoint: str | Path | None = None, progress: bool = True, **options: Any,
) -> Result:  # fmt: skip
    """Substitute ``W ← f + g_Δ0`` (and the controls) in layer groups; clean NLL and tolerance.

    Args:
        cfg: :class:`Config` (with ``options`` applied): sizes, ``sources`` (a subset of
            :data:`SOURCES`), ``gamma`` (the per-row quantile of ``d3_quantile``), ``tolerance``
            (``(source, group)`` pairs whose T1 tolerance slope is measured, plus the unmodified
            model — each costs ``len(fracs)·len(seeds)`` forward passes), ``delta0``, ``keep_sink``.
        corpus: a corpus or ready :class:`~posgen_tl.io.sampling.Windows` (default ``cfg.corpus``).
        groups: ``{label: layers}`` (default :func:`layer_groups`: the layer thirds + all).
        k_means: global k̄ per layer (default: ``n_ref`` windows of disjoint documents).
        checkpoint: a folder that keeps the clean run and each finished (source, group); a rerun of the same design
            continues where an interrupted one stopped (another design's folder is refused: ValueError).

    Returns:
        :class:`Result` (tables ``rows``, ``summary``, ``equivalence``).
    """
    cfg = base.config_of(Config, cfg, options)
    base.gate(model, cfg, "the sufficiency study")
    sources, gamma, delta0, keep_sink, tolerance = cfg.sources, cfg.gamma, cfg.delta0, cfg.keep_sink, cfg.tolerance
    fracs, seeds, target_len = cfg.fracs, cfg.seeds, cfg.target()
    spec, _ = probe_hooks(model)
    groups = layer_groups(spec.n_layers) if groups is None else groups
    bad = set(sources) - set(SOURCES)
    if bad:
        raise ValueError(f"unknown source(s) {sorted(bad)}; choose from {SOURCES}")
    win, ref = resolve_windows(model, cfg.corpus if corpus is None else corpus, reference, n_seq=cfg.n_seq, seq_len=cfg.seq_len,
                               n_ref=cfg.n_ref if k_means is None else 0, seed=cfg.seed)
    if k_means is None:
        if ref is None:
            raise ValueError("pass k_means or reference windows (the global k̄ needs disjoint documents)")
        k_means = reference_key_means(model, ref.tokens, sink=1, progress=False)
    tokens = win.tokens
    batch_size = base.auto_batch(cfg, model, tokens.shape[1], tokens.shape[0], extra_maps=SUBSTITUTION_MAPS)
    docs = win.doc_ids.cpu().numpy()
    tol_set = {tuple(t) for t in tolerance}
    ck = base.pieces(checkpoint, NAME, cfg, model, win, groups=[[k, list(v)] for k, v in groups.items()],
                     reference=None if ref is None else windows_fingerprint(ref),
                     k_means=base.means_fingerprint(k_means))

    def slopes(hooks, base) -> np.ndarray:
        df = transposition_curve(model, tokens, fracs=fracs, seeds=seeds, target_len=target_len, fwd_hooks=hooks,
                                 batch_size=batch_size, clean=base, progress=False)
        return stats.per_sequence_slopes(df).sort_index().to_numpy(float)

    jobs = [(s, g) for g in groups for s in sources]
    resume = _Resume(model, tokens, [groups[g] for _, g in jobs], target_len, batch_size)

    def clean_rows() -> pd.DataFrame:
        c = nll_on_target(model, tokens, target_len=target_len, batch_size=batch_size, fwd_hooks=resume.hooks())
        out = pd.DataFrame(dict(seq=range(len(win)), clean_nll=c.double().cpu().numpy()))
        if tol_set:
            out["clean_slope"] = slopes([], c)
        return out

    base_rows = ck.rows("clean", clean_rows)
    clean = base_rows["clean_nll"].to_numpy(float)
    clean_slope = base_rows["clean_slope"].to_numpy(float) if tol_set else None

    def job_rows(source: str, group: str) -> pd.DataFrame:
        layers = list(groups[group])
        hooks = sufficiency_hooks_for(model, source, layers, k_means, gamma=gamma, delta0=delta0, keep_sink=keep_sink)
        nll = nll_on_target(model, tokens, target_len=target_len, fwd_hooks=hooks, batch_size=batch_size,
                            resid_at=resume.at(layers))
        sl = slopes(hooks, nll) if (source, group) in tol_set else None
        rows = []
        for i in range(len(win)):
            r = dict(source=source, group=group, layers=f"{layers[0]}–{layers[-1]}", seq=i, doc=int(docs[i]),
                     doc_name=win.doc_names[int(docs[i])], clean_nll=float(clean[i]), nll=float(nll[i]),
                     dnll=float(nll[i]) - float(clean[i]))
            if sl is not None and clean_slope is not None:
                r.update(slope=float(sl[i]), clean_slope=float(clean_slope[i]), dslope=float(sl[i] - clean_slope[i]))
            rows.append(r)
        return pd.DataFrame(rows)

    parts = [ck.rows(f"job_{j:03d}", lambda s=s, g=g: job_rows(s, g))
             for j, (s, g) in enumerate(tqdm(jobs, desc="sufficiency", disable=not progress, leave=False))]
    df = pd.concat(parts, ignore_index=True)
    meta = dict(model=spec.model_name, n_seq=len(win), n_docs=win.n_docs, seq_len=tokens.shape[1],
                target_len=target_len, gamma=gamma, delta0=delta0, keep_sink=keep_sink,
                k_mean="global (disjoint documents)", fracs=list(fracs), seeds=list(seeds),
                groups={k: list(v) for k, v in groups.items()})
    tables = {"rows": df, "summary": sufficiency_summary(df), "equivalence": sufficiency_equivalence(df, cfg.margin)}
    return Result(tables, cfg.as_dict(), meta)


def resume_layers(model: Any, tokens: Any, groups: Sequence[Sequence[int]]) -> list[int]:
    """The layers (above 0) at which the substituted passes of ``groups`` resume from the unsubstituted residuals
    (the blocks below a group's first layer compute what the clean pass computed: the same numbers), sorted; none
    where the clean pass runs in chunks (long sequences), or where the residuals of ``tokens`` at those layers would
    exceed :data:`PREFIX_BYTES` or a quarter of the free memory."""
    starts = sorted({min(g) for g in groups if g and min(g) > 0})
    if not starts or forward_chunk(model, tokens.shape[1]):
        return []
    cfg = getattr(model, "cfg", None)
    d_model = int(getattr(cfg, "d_model", 0) or 0)
    dtype = getattr(cfg, "dtype", None)
    size = tokens.shape[0] * tokens.shape[1] * d_model * (dtype.itemsize if hasattr(dtype, "itemsize") else 4)
    free = free_bytes(model_device(model))
    budget = PREFIX_BYTES if free is None else min(PREFIX_BYTES, free // 4)
    return starts if d_model and size * len(starts) <= budget else []


class _Resume:
    """The unsubstituted residuals entering the first layer of each group that starts above block 0
    (:func:`resume_layers`): recorded by the clean pass (:meth:`hooks`), or by a pass of their own when the clean rows
    came from a checkpoint, and handed to the group's passes (:meth:`at`)."""

    def __init__(self, model: Any, tokens: Any, groups: Sequence[Sequence[int]], target_len: int,
                 batch_size: int) -> None:
        self.model, self.tokens, self.target_len, self.batch_size = model, tokens, target_len, batch_size
        self.starts = resume_layers(model, tokens, groups)
        self.store: dict[int, list] = {}
        self.prefix: dict[int, Any] = {}

    def hooks(self) -> list:
        """The hooks that record the residuals in a pass over the tokens (none where no group resumes)."""
        return resid_hooks(self.starts, self.store)

    def at(self, layers: Sequence[int]) -> tuple[int, Any] | None:
        """``(first layer, residuals entering it)`` for a group's passes (``resid_at`` of :func:`nll_on_target`);
        None: from the first block."""
        if not layers or min(layers) not in self.starts:
            return None
        if not self.prefix:
            if not self.store:
                nll_on_target(self.model, self.tokens, target_len=self.target_len, batch_size=self.batch_size,
                              fwd_hooks=self.hooks())
            self.prefix.update(recorded(self.store))
            self.store.clear()
        return min(layers), self.prefix[min(layers)]


def sufficiency(model: Any, corpus: CorpusLike | Windows = None, cfg: Config | None = None, **kw: Any) -> Result:
    """:func:`run` with the corpus as the second argument (the library's earlier name, kept as an alias)."""
    return run(model, cfg, corpus=corpus, **kw)





def sufficiency_equivalence(rows: pd.DataFrame, margin: float) -> pd.DataFrame:
    """Per (source, group): is the ΔNLL of the substitution within ``±margin`` nats? TOST on document
    means (:func:`posgen_tl.stats.verdicts.equivalence`; 90 % interval) — the only way this package
    says a substitution "barely moves" the NLL. Columns as that function's, plus ``source, group``."""
    from posgen_tl.stats.verdicts import equivalence  # noqa: PLC0415

    out = [equivalence(g["dnll"].to_numpy(), doc=g["doc"].to_numpy(), margin=margin,
                       margin_source="declared in the sufficiency Config (margin) before the run",
                       what="ΔNLL of the substitution (nats)").assign(source=source, group=group)
           for (source, group), g in rows.groupby(["source", "group"], sort=False)]
    return pd.concat(out, ignore_index=True)


def sufficiency_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (source, group): ``clean_nll``; ``dnll`` (ΔNLL of the target span vs the unmodified model)
    and, where measured, ``dslope`` (change of the T1 tolerance slope): mean of document means,
    document-bootstrap CI, t-interval, sign-flip p over documents, Holm over the whole table, n."""
    out = []
    for (source, group), g in rows.groupby(["source", "group"], sort=False):
        docs = g["doc"].to_numpy()
        base = dict(source=source, group=group, layers=g["layers"].iloc[0])
        out.append({**base, "estimator": "clean_nll", **ci_row(g["clean_nll"].to_numpy(), docs), "p": np.nan})
        out.append({**base, "estimator": "dnll", **contrast_row(g["dnll"].to_numpy(), docs)})
        if "dslope" in g and g["dslope"].notna().all():
            out.append({**base, "estimator": "dslope", **contrast_row(g["dslope"].to_numpy(), docs)})
    return finish_table(pd.DataFrame(out))


# ----------------------------------------------------------------------------- report / study


NAME = "sufficiency"
ABOUT = "substitute the logits by f + g (D3, global k̄) per layer group, with D1 and wrong-k̄ controls (docs/method.md §5)"
NEEDS: tuple[str, ...] = ()


def render(result: Result) -> Any:
    """The report section: ΔNLL per source and layer group, beside the controls, and the figure."""
    from posgen_tl.plot.sufficiency import plot_sufficiency  # noqa: PLC0415
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    title = "6 · Sufficiency: does f + g carry what the model uses? (docs/method.md §5)"
    meta = result.meta
    if result.skipped:
        return skipped_section(title, result.skipped, "sufficiency", meta.get("hint"))
    summ = result.tables["summary"]
    d = summ[summ["estimator"] == "dnll"]
    line = "; ".join(f"{r.source} @ {r.group}: {r.estimate:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]"
                     for r in d.itertuples() if r.source == "d3")
    cols = ["source", "group", "estimator", "estimate", "ci_low", "ci_high", "ci_level", "p", "p_kind", "p_holm",
            "n_docs", "n_seqs", "label"]
    fig = plot_sufficiency(summ, title=f"Sufficiency — {meta.get('model', '')}")
    return Section(
        title,
        verdict=f"ΔNLL (last {meta['target_len']} tokens) when the logits are replaced by f + g_Δ0: {line}.",
        paragraphs=[f"W ← f + g_Δ0 (Δ0 = {meta['delta0']}, global k̄ from documents disjoint from the analysed ones) in "
                    f"each layer group, sink key kept exact; 'd3_quantile' replaces only entries below the row's "
                    f"{meta['gamma']:g}-quantile (LM-Infinite keeps the top ones). Controls: 'd1' substitutes the "
                    "in-sample D1 least-squares fit a[i−j] + b[i] + c[j] of the same map; 'wrong_kbar' builds D3 from "
                    "another layer's k̄. Small ΔNLL for d3 but large for the controls = f + g carries what the model "
                    "uses. The random twin is not shown: its NLL is near log|V| whatever its logits are."],
        tables=[("ΔNLL and clean NLL per source and layer group (document-bootstrap CI, sign-flip p, Holm)",
                 summ[[c for c in cols if c in summ.columns]]),
                ("Does the substitution barely move the NLL? TOST within the declared margin (90 % interval)",
                 result.tables["equivalence"][["source", "group", "estimate", "ci_low", "ci_high", "ci_level", "p",
                                               "margin", "verdict", "n_docs"]])],
        figures=[(figure_to_png(fig), "ΔNLL by layer group: D3 substitution vs the D1 and wrong-k̄ controls")],
        findings=_findings(summ),
        results={"sufficiency": summ.to_dict("records"), "meta": meta},
    )


def _findings(summ: pd.DataFrame) -> list:
    """Substitution W ← f + g_Δ0 in ALL layers (the pre-declared group "all"): ΔNLL vs the unmodified
    model (document-bootstrap CI, Holm p of the table); the note compares it with the D1 control of
    the same group. "costs NLL" when p < .05 and ΔNLL > 0, else "no evidence of a cost" (never
    "sufficient": that needs an equivalence test with a declared margin)."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415
    from posgen_tl.report.text import p_label, sig3  # noqa: PLC0415

    g = summ[(summ["source"] == "d3") & (summ["group"] == "all") & (summ["estimator"] == "dnll")]
    if g.empty:
        return [Finding("sufficiency", "not testable", note="no d3 substitution of all layers in this run")]
    r = g.iloc[0]
    p = float(r["p_holm"]) if r["p_holm"] == r["p_holm"] else float(r["p"])
    note = "layers: all; global k̄"
    ctrl = summ[(summ["source"] == "d1") & (summ["group"] == "all") & (summ["estimator"] == "dnll")]
    if len(ctrl):
        note += f"; D1 control ΔNLL {sig3(float(ctrl.iloc[0]['estimate']))}"
    word = "costs NLL" if p == p and p < 0.05 and r["estimate"] > 0 else "no evidence of a cost"
    return [Finding("sufficiency", word, float(r["estimate"]), "ΔNLL of f + g substitution (nats)",
                    (float(r["ci_low"]), float(r["ci_high"])), p, int(r["n_docs"]), note=note, p_kind=p_label(r))]
