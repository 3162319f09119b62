"""docs/method.md §7 item 4: how each head's attention changes under the gap probe, by head class.

Seed 003 predicts that symbolic mechanisms extrapolate better than positional ones; this
experiment tests it instead of assuming it: per head, the attention change when the suffix moves
``G`` ids away from its prefix (:func:`posgen_tl.experiments.length.gap_attention`), then the
positional − symbolic contrast over sequences (:func:`posgen_tl.experiments.length.head_class_test`),
head classes from a §6 taxonomy table (or, without one, the D3 positional-share proxy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from posgen_tl.experiments import base
from posgen_tl.experiments import length as L

__all__ = ["Config", "Result", "NAME", "run", "render"]

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


class Result(base.Result):
    """The outcome of :func:`run`: ``tables`` ``rows`` (per sequence × layer × head: the attention change under the
    gap, :func:`posgen_tl.experiments.length.gap_attention`) and ``summary`` (the positional − symbolic contrasts,
    :func:`posgen_tl.experiments.length.head_class_test`); ``meta``: documents, the gap, the layout, the classes."""


#: the tables' files in a study folder (the names published runs already carry)
FILES = {"rows": "gap_attention_rows.csv", "summary": "gap_attention_summary.csv"}
LEGACY_META = "gap_attention_meta.json"


def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, progress: bool = True, **options: Any) -> Result:
    """Per-head attention change under the gap and its positional − symbolic contrasts (``cfg`` with ``options``
    applied; head classes from ``cfg.classes``, a taxonomy study's ``heads.csv``). Returns its :class:`Result`."""
    from posgen_tl.experiments.decomposition import reference_key_means  # noqa: PLC0415
    from posgen_tl.io.sampling import sample_windows  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, options)
    pre, suf, skip = cfg.gap_layout()
    classes = L.classes_from_taxonomy(pd.read_csv(cfg.classes)) if cfg.classes else None  # a bad table: before work
    win, ref = sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq, seq_len=pre + suf,
                              n_ref=cfg.n_ref, seed=cfg.seed)
    assert ref is not None
    km = reference_key_means(model, ref.tokens, sink=1, progress=False)
    n_ctx = int(model.cfg.n_ctx)
    rows = L.gap_attention(model, win, prefix_len=pre, suffix_len=suf, gap=int(round(cfg.gap * n_ctx)), k_means=km,
                           skip=skip, progress=progress)
    meta = dict(n_seq=len(win), n_docs=win.n_docs, gap=cfg.gap, n_ctx=n_ctx, prefix_len=pre, suffix_len=suf,
                classes=cfg.classes)
    return Result({"rows": rows, "summary": L.head_class_test(rows, classes)}, cfg.as_dict(), meta)


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
