"""docs/method.md §7 item 4: how each head's attention changes under the gap probe, by head class.

Seed 003 predicts that symbolic mechanisms extrapolate better than positional ones; this
experiment tests it instead of assuming it: per head, the attention change when the suffix moves
``G`` ids away from its prefix (:func:`posgen_tl.experiments.gap_attention.gap_attention`), then the
positional − symbolic contrast over sequences (:func:`posgen_tl.experiments.gap_attention.head_class_test`),
head classes from a §6 taxonomy table (or, without one, the D3 positional-share proxy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import QKCapture, check_tokens, probe_hooks
from posgen_tl.hooks.edits import reference_key_means
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.io.sampling import Windows
from posgen_tl.maths.approx_logits import d3_approx_logits, exact_logits
from posgen_tl.maths.decompose import causal_mask, within_row_r
from posgen_tl.maths.perturb import gap_position_ids
from posgen_tl.stats.tables import contrast_row, finish_table

__all__ = ["Config", "Result", "NAME", "run", "render", "gap_attention", "classes_from_taxonomy", "head_class_test"]

NAME = "gap_attention"
ABOUT = "attention change per head under the gap, positional vs symbolic heads (docs/method.md §7 item 4)"
NEEDS: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the per-head gap experiment."""

    NAME: ClassVar[str] = NAME
    n_ref: int = base.n_ref_option(8, full=8)
    gap: float = base.option(2.0, "the gap G in units of the model's n_ctx", "float")
    prefix_len: int = base.option(0, "prefix tokens; 0 = max(16, seq_len / 2)", "count")
    suffix_len: int = base.option(0, "suffix tokens; 0 = max(16, seq_len / 2)", "count")
    skip: int = base.option(0, "first suffix query rows left out; 0 = min(16, suffix / 4)", "count")
    classes: str | None = base.option(None, "per-head §6 taxonomy table (heads.csv of a taxonomy study) for the head "
                                            "classes; default: the D3 f_share proxy", "text")

    def gap_layout(self) -> tuple[int, int, int]:
        """``(prefix_len, suffix_len, skip)`` with the automatic defaults resolved."""
        half = max(16, self.seq_len // 2)
        pre, suf = self.prefix_len or half, self.suffix_len or half
        return pre, suf, self.skip or min(16, suf // 4)


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
    progress: bool = True, kept: Any = None,
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

    Entries a sliding window hides are excluded. ``kept``: a :class:`~posgen_tl.io.checkpoint.Pieces` that keeps each
    finished batch (an interrupted run continues where it stopped); its fingerprint must name everything here that
    changes a number (the windows, ``k_means``, the layout, ``gap``, ``skip``, ``sink``, ``layers``), as :func:`run`'s
    does. Returns a tidy DataFrame with ``seq, doc, layer,
    head`` and the columns above.
    """
    from posgen_tl.io.checkpoint import Pieces  # noqa: PLC0415

    kept = Pieces(None, {}, "gap attention") if kept is None else kept
    spec, _ = probe_hooks(model)
    gap = 2 * spec.n_ctx if gap is None else int(gap)
    n = prefix_len + suffix_len
    tokens = check_tokens(model, windows.tokens[:, :n], spec)
    layers = list(range(spec.n_layers)) if layers is None else sorted(layers)
    rows_q = torch.arange(prefix_len + skip, n)
    docs = windows.doc_ids.cpu().numpy()

    def batch_rows(s: int) -> pd.DataFrame:
        b = tokens[s : s + batch_size]
        out = []
        res: dict[int, dict[str, Tensor]] = {}
        for tag, g in (("0", 0), ("gap", gap)):
            pos = gap_position_ids(prefix_len, suffix_len, g).expand(b.shape[0], -1)

            def on_qk(c: QKCapture, tag=tag) -> None:
                d = res.setdefault(c.layer, {})  # noqa: B023
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

    parts = [kept.rows(f"batch{batch_size}_{s:06d}", lambda s=s: batch_rows(s))  # a piece names its batch size
             for s in tqdm(range(0, tokens.shape[0], batch_size), desc="gap attention", disable=not progress, leave=False)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def classes_from_taxonomy(heads: pd.DataFrame, *, twin: str = "trained") -> pd.DataFrame:
    """Head classes ``layer, head, head_class`` from a docs/method.md §6 taxonomy table (one row per head,
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
            out.append(dict(estimator=f"{col}: positional − symbolic", **contrast_row(d, docs)))
        for c in ("positional", "symbolic"):
            d = (per[("r_far", c)] - per[("r_far_0", c)]).to_numpy()
            ok = np.isfinite(d)
            if ok.sum() >= 2:
                out.append(dict(estimator=f"D3 r_far − r_far(G=0): {c}", **contrast_row(d[ok], docs[ok])))
    res = finish_table(pd.DataFrame(out)) if out else pd.DataFrame(out)
    res["n_heads_positional"] = int(n_cls.get("positional", 0))
    res["n_heads_symbolic"] = int(n_cls.get("symbolic", 0))
    res["classes"] = source
    return res



class Result(base.Result):
    """The outcome of :func:`run`: ``tables`` ``rows`` (per sequence × layer × head: the attention change under the
    gap, :func:`posgen_tl.experiments.gap_attention.gap_attention`) and ``summary`` (the positional − symbolic contrasts,
    :func:`posgen_tl.experiments.gap_attention.head_class_test`); ``meta``: documents, the gap, the layout, the classes."""


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"rows": "gap_attention_rows.csv", "summary": "gap_attention_summary.csv"}
LEGACY_META = "gap_attention_meta.json"


@base.shares_heap
def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, progress: bool = True,
        checkpoint: str | Path | None = None, **options: Any) -> Result:
    """Per-head attention change under the gap and its positional − symbolic contrasts (``cfg`` with ``options``
    applied; head classes from ``cfg.classes``, a taxonomy study's ``heads.csv``). ``checkpoint``: a folder that
    keeps each finished batch; a rerun of the same design continues where an interrupted one stopped, to the same
    numbers. Returns its :class:`Result`."""
    from posgen_tl.engine.swaps import windows_fingerprint  # noqa: PLC0415
    from posgen_tl.io.sampling import sample_windows  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    pre, suf, skip = cfg.gap_layout()
    classes = classes_from_taxonomy(pd.read_csv(cfg.classes)) if cfg.classes else None  # a bad table: before work
    win, ref = sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=pre + suf,
                              n_ref=cfg.n_ref, seed=cfg.seed)
    assert ref is not None
    km = reference_key_means(model, ref.tokens, sink=1, progress=False)
    n_ctx = int(model.cfg.n_ctx)
    kept = base.pieces(checkpoint, NAME, cfg, model, win, reference=windows_fingerprint(ref),
                       statistics=("classes",))
    rows = gap_attention(model, win, prefix_len=pre, suffix_len=suf, gap=int(round(cfg.gap * n_ctx)), k_means=km,
                         skip=skip, progress=progress, kept=kept)
    meta = dict(n_seq=len(win), n_docs=win.n_docs, gap=cfg.gap, n_ctx=n_ctx, prefix_len=pre, suffix_len=suf,
                classes=cfg.classes)
    return Result({"rows": rows, "summary": head_class_test(rows, classes)}, cfg.as_dict(), meta)


def render(result: Result) -> Any:
    """The section: the positional − symbolic contrasts of the attention change."""
    from posgen_tl.report.html import Section, skipped_section  # noqa: PLC0415

    title = "Attention change under the gap, by head class (docs/method.md §7, seed 003)"
    if result.skipped:
        return skipped_section(title, result.skipped, None, result.meta.get("hint"))
    summ, meta = result.tables["summary"], result.meta
    src = summ["classes"].iloc[0] if len(summ) else "?"
    return Section(
        title,
        verdict=(f"G = {meta['gap']:g}·n_ctx; head classes: {src} ({int(summ['n_heads_positional'].iloc[0])} "
                 f"positional, {int(summ['n_heads_symbolic'].iloc[0])} symbolic heads)." if len(summ) else "no contrast"),
        paragraphs=[f"{meta['n_seq']} sequences from {meta['n_docs']} documents: prefix {meta['prefix_len']} ‖ suffix "
                    f"{meta['suffix_len']} tokens, the suffix moved G ids away. Per sequence, the mean over the heads of "
                    "each class; contrasts positional − symbolic over sequences (document bootstrap, sign-flip p, "
                    "Holm). A positive KL contrast supports seed 003 (symbolic heads extrapolate better)."],
        tables=[("Contrasts", summ)],
        results={"summary": summ.to_dict("records"), "meta": meta})
