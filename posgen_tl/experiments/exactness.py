"""Exactness check: our RoPE and recomputed logits against the model's own hooks.

For every selected layer: ``R_pos(q_pre) == hook_rot_q`` (and k), and
``s · rot_q · rot_k == hook_attn_scores`` on unmasked entries (causal, inside the
sliding window). Where the model's ``hook_attn_scores`` is post-softmax, ``softmax(W)``
is compared with it instead, and the table says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from posgen_tl.experiments import base
from posgen_tl.hooks.capture import QKCapture, probe_hooks, stream_qk
from posgen_tl.maths.rope import causal_mask, rotate

__all__ = ["exactness_table", "ROT_RTOL", "SCORE_RTOL"]

#: tolerances, relative to the largest |value| of the compared tensor (float32 maths)
ROT_RTOL = 1e-5
SCORE_RTOL = 1e-5
PATTERN_ATOL = 1e-5


def exactness_table(
    model: Any, tokens: Tensor, layers: Sequence[int] | None = None, *, progress: bool = False
) -> pd.DataFrame:
    """One row per layer: max errors of rotation and recomputed scores, and ``passed``.

    Columns: ``layer, kind, rot_source, rot_q_max_err, rot_k_max_err, rot_ref,
    scores_kind, score_max_err, score_ref, score_rel_err, passed``. Errors are max
    absolute differences; ``*_ref`` is the max |value| they are relative to. Tolerances:
    ``ROT_RTOL``/``SCORE_RTOL`` (1e-5) for float32 models, ``8·eps`` of the model dtype for
    bf16/fp16 models (whose own rotation rounds to that precision).
    """
    spec, info = probe_hooks(model)
    rows: list[dict] = []
    # a bf16/fp16 model rounds its own rotation: scale the tolerances with its precision
    try:
        eps = torch.finfo(next(model.parameters()).dtype).eps
    except (StopIteration, AttributeError, TypeError):
        eps = torch.finfo(torch.float32).eps
    rot_tol, score_tol = max(ROT_RTOL, 8 * eps), max(SCORE_RTOL, 8 * eps)
    pattern_tol = max(PATTERN_ATOL, 8 * eps)
    with_scores = info.scores_kind in ("pre_softmax", "post_softmax")
    cap = spec.extra.get("attn_logit_softcapping")

    def check(c: QKCapture) -> None:
        lr = c.rope
        rq = rotate(c.q, c.positions, lr)
        rk = rotate(c.k, c.positions, lr)
        row: dict[str, Any] = dict(layer=c.layer, kind=lr.kind, rot_source=c.rot_source)
        ref = max(c.rot_q.abs().max().item(), c.rot_k.abs().max().item())
        row["rot_ref"] = ref
        if c.rot_source == "hook":
            row["rot_q_max_err"] = (rq - c.rot_q).abs().max().item()
            row["rot_k_max_err"] = (rk - c.rot_k).abs().max().item()
        else:
            row["rot_q_max_err"] = row["rot_k_max_err"] = float("nan")
        row["scores_kind"] = c.scores_kind
        ok = c.rot_source != "hook" or max(row["rot_q_max_err"], row["rot_k_max_err"]) <= rot_tol * ref
        if c.scores is not None:
            w = c.logits()
            if cap:
                w = torch.tanh(w / cap) * cap
            m = causal_mask(w.shape[-1], sliding_window=lr.sliding_window, device=w.device)
            if c.scores_kind == "post_softmax":
                w = torch.softmax(w.masked_fill(~m, float("-inf")), dim=-1)
                err = (w - c.scores)[..., m].abs().max().item()
                row.update(score_max_err=err, score_ref=1.0, score_rel_err=err)
                ok &= err <= pattern_tol
            else:
                err = (w - c.scores)[..., m].abs().max().item()
                sref = c.scores[..., m].abs().max().item() + 1e-30
                row.update(score_max_err=err, score_ref=sref, score_rel_err=err / sref)
                ok &= err <= score_tol * sref
        else:
            row.update(score_max_err=float("nan"), score_ref=float("nan"), score_rel_err=float("nan"))
        row["passed"] = bool(ok)
        rows.append(row)

    stream_qk(model, tokens, check, layers, with_scores=with_scores, batch_size=max(1, tokens.shape[0]),
              progress="exactness" if progress else False)
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- the experiment


NAME = "exactness"
ABOUT = "captured q/k reproduce the model's rotation and scores (METHOD §1)"
NEEDS: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the exactness check (``posgen-tl check`` and the report's first section)."""

    NAME: ClassVar[str] = NAME
    n_seq: int = base.option(2, "sequences compared", "int")
    seq_len: int = base.option(64, "tokens per sequence", "int")
    layers: Any = base.option("all", "layers checked", "layers")


def run(model: Any, cfg: Config | None = None, **overrides: Any) -> pd.DataFrame:
    """:func:`exactness_table` on ``cfg.n_seq × cfg.seq_len`` tokens of the corpus (consecutive chunks).
    Returns the table (one row per layer)."""
    from posgen_tl.io.corpus import corpus_tokens  # noqa: PLC0415

    cfg = base.config_of(Config, cfg, overrides)
    tokens = corpus_tokens(model, cfg.corpus, seq_len=cfg.seq_len, n_seq=cfg.n_seq)
    layers = base.resolve_layers(cfg.layers, probe_hooks(model)[0].n_layers)
    return exactness_table(model, tokens, layers, progress=True)


def compute(ctx: Any, cfg: Config) -> None:
    ctx.work.save_df("exactness.csv", run(ctx.model, cfg))


def render(ctx: Any, cfg: Config) -> Any:
    from posgen_tl.report.html import Section  # noqa: PLC0415

    df = ctx.work.load_df("exactness.csv")
    ok = bool(df["passed"].all())
    res = {"passed": ok, "max_rot_err": float(np.nanmax(df[["rot_q_max_err", "rot_k_max_err"]].to_numpy()))
           if df["rot_q_max_err"].notna().any() else None,
           "max_score_rel_err": float(df["score_rel_err"].max())}
    table = ("Per layer", df[["layer", "kind", "rot_source", "rot_q_max_err", "rot_k_max_err", "scores_kind",
                              "score_max_err", "score_rel_err", "passed"]])
    failed = df.loc[~df["passed"].astype(bool), "layer"].tolist()
    return Section(
        "1 · Exactness of captured q/k",
        verdict=(f"PASS on all {len(df)} layers: our RoPE on the pre-rotation q/k reproduces hook_rot_q/k, and s·rot_q·rot_k "
                 f"reproduces hook_attn_scores (max relative score error {res['max_score_rel_err']:.3g})." if ok else
                 f"FAIL on layers {failed}: the captured q/k do not reproduce the model's scores; every later number is suspect."),
        paragraphs=[] if ok else ["Every later number is computed from these captured tensors; a failure here makes them meaningless."],
        tables=[] if ok else [table],
        details=[table] if ok else [],
        results=res,
    )
