"""The RoPE spec of models that are not a bridge over Hugging Face: a TransformerBridge over a TransformerLens-native
model (its rotary tables) and a TransformerLens 3.x ``HookedTransformer`` (its config, every layer's table checked
against the attention module's own ``rotary_cos``/``rotary_sin`` buffers). :func:`posgen_tl.io.spec.rope_spec`
dispatches here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posgen_tl.maths.rope import LayerRope, Layout, RopeError, RopeSpec

__all__: list[str] = []


# ----------------------------------------------------------------------------- native


def spec_from_native(model: Any, native: Any, name: str) -> RopeSpec:
    cfg = model.cfg
    rotary = native.rotary
    rotary_dim = int(rotary.rotary_dim)
    from posgen_tl.compat import native_rope_scaling  # noqa: PLC0415

    _, position_scale, inv_freq = native_rope_scaling(cfg, rotary_dim)
    n_heads = int(cfg.n_heads)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    layers = []
    for blk in native.layers:
        layers.append(
            LayerRope(
                inv_freq=inv_freq.float().clone(),
                rotary_dim=rotary_dim,
                layout="adjacent",
                position_scale=float(position_scale),
                score_scale=1.0 / float(blk.attn.scale),
                kind="full",
            )
        )
    rs = getattr(cfg, "rope_scaling", None)
    rtype = str((rs or {}).get("rope_type") or (rs or {}).get("type") or "default") if isinstance(rs, dict) else "default"
    return RopeSpec(
        model_name=name,
        n_layers=int(cfg.n_layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=int(cfg.d_head),
        n_ctx=int(cfg.n_ctx),
        layers=tuple(layers),
        rope_type=rtype,
        qk_norm=False,
        source="TransformerLens native rotary",
        extra={"attn_logit_softcapping": (float(cfg.attn_scores_soft_cap) if cfg.attn_scores_soft_cap > 0 else None),
               "final_logit_softcapping": _output_cap(cfg)},
    )


# ----------------------------------------------------------------------------- TL 3.x


def _tl_freq(cfg: Any, rotary_dim: int, base: float, local: bool) -> tuple[torch.Tensor, float, str]:
    """The per-band divisor ``freq`` a TL 3.x ``HookedTransformer`` divides positions by, its
    sin/cos factor, and the RoPE type name — the same expressions, in the same dtype, as
    ``AbstractAttention.calculate_sin_cos_rotary`` (verified against the model's tables after)."""
    hp = torch.float64 if getattr(cfg, "dtype", torch.float32) == torch.float64 else torch.float32
    use_yarn = bool(getattr(cfg, "use_yarn_rope", False)) and not (
        bool(getattr(cfg, "yarn_global_attn_only", False)) and local
    )
    if getattr(cfg, "use_NTK_by_parts_rope", False):
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        factor = cfg.NTK_by_parts_factor
        low, high = cfg.NTK_by_parts_low_freq_factor, cfg.NTK_by_parts_high_freq_factor
        old_ctx = cfg.NTK_original_ctx_len
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        inv_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return 1 / torch.where(medium, smoothed, inv_llama), 1.0, "ntk_by_parts"
    if use_yarn:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=hp) / rotary_dim))
        orig = cfg.yarn_original_max_position_embeddings

        def corr(n_rot: float) -> float:
            return (rotary_dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr(cfg.yarn_beta_fast), corr(cfg.yarn_beta_slow)
        if getattr(cfg, "yarn_truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        ramp = torch.arange(rotary_dim // 2, dtype=hp)
        hi_f = float(hi) + 0.001 if lo == hi else float(hi)
        ramp = torch.clamp((ramp - lo) / (hi_f - lo), 0, 1)
        inv_freq = (inv_freq / cfg.yarn_factor) * ramp + inv_freq * (1 - ramp)
        return 1.0 / inv_freq, float(cfg.yarn_attention_factor), "yarn"
    dim = torch.arange(rotary_dim // 2, dtype=hp)
    freq = base ** (dim / (rotary_dim / 2))
    factor = float(getattr(cfg, "rotary_scaling_factor", 1.0) or 1.0)
    if factor != 1.0 and not local:
        return freq * factor, 1.0, "linear"
    return freq, 1.0, "default"


def _verify_tl_table(attn: Any, lr: LayerRope, name: str, layer: int, n_check: int = 1024) -> None:
    """Our cos/sin must equal the attention module's own ``rotary_cos``/``rotary_sin`` tables."""
    cos_t, sin_t = getattr(attn, "rotary_cos", None), getattr(attn, "rotary_sin", None)
    if cos_t is None or sin_t is None:
        raise RopeError(f"model {name!r} layer {layer}: no rotary_cos/rotary_sin tables on the attention module")
    n = min(int(cos_t.shape[0]), n_check)
    from posgen_tl.maths.rope import angles  # noqa: PLC0415

    ang = angles(torch.arange(n, device=cos_t.device), lr)
    rep = (lambda t: t.repeat_interleave(2, dim=-1)) if lr.layout == "adjacent" else (lambda t: torch.cat([t, t], -1))
    ours_cos = rep(ang.cos().to(cos_t.dtype) * lr.attention_scaling)
    ours_sin = rep(ang.sin().to(sin_t.dtype) * lr.attention_scaling)
    err = max((ours_cos - cos_t[:n]).abs().max().item(), (ours_sin - sin_t[:n]).abs().max().item())
    tol = 4 * torch.finfo(cos_t.dtype).eps * max(1.0, lr.attention_scaling)
    if not err <= tol:
        raise RopeError(
            f"model {name!r} layer {layer}: the rotary table computed from the config (rotary_base, "
            f"rotary_base_local, NTK-by-parts, YaRN, rotary_scaling_factor) differs from the model's own "
            f"rotary_cos/rotary_sin by {err:.3g}; this RoPE variant is not understood"
        )


def spec_from_tl_config(model: Any, name: str) -> RopeSpec:
    """HookedTransformer (TransformerLens 3.x): per layer, the frequencies its attention module
    uses (``rotary_base`` or ``rotary_base_local``, NTK-by-parts, YaRN, linear scaling), the
    module's own ``attn_scale`` and ``attn_type``/``window_size`` — each frequency table checked
    against the module's ``rotary_cos``/``rotary_sin`` buffers (a mismatch raises)."""
    cfg = model.cfg
    d_head = int(cfg.d_head)
    rotary_dim = int(getattr(cfg, "rotary_dim", None) or d_head)
    layout: Layout = "adjacent" if getattr(cfg, "rotary_adjacent_pairs", False) else "half"
    blocks = list(model.blocks)
    attns = [blk.attn for blk in blocks]
    kinds = ["local" if getattr(a, "attn_type", "global") == "local" else "global" for a in attns]
    has_local = "local" in kinds
    layers, rope_types = [], set()
    for i, attn in enumerate(attns):
        local = kinds[i] == "local"
        base_local = getattr(cfg, "rotary_base_local", None)
        base = float(base_local if (local and base_local is not None) else cfg.rotary_base)
        divisor, a, rtype = _tl_freq(cfg, rotary_dim, base, local)
        rope_types.add(rtype)
        divisor = divisor.float()
        lr = LayerRope(
            inv_freq=(1.0 / divisor.double()).float(),
            rotary_dim=rotary_dim,
            layout=layout,
            attention_scaling=a,
            score_scale=1.0 / float(attn.attn_scale),
            sliding_window=int(cfg.window_size) if local else None,
            kind="local" if local else ("global" if has_local else "full"),
            angle_divisor=divisor,
        )
        _verify_tl_table(attn, lr, name, i)
        layers.append(lr)
    n_heads = int(cfg.n_heads)
    softcap = float(getattr(cfg, "attn_scores_soft_cap", -1.0) or -1.0)
    extra: dict[str, Any] = {"attn_logit_softcapping": softcap if softcap > 0 else None,
                             "final_logit_softcapping": _output_cap(cfg)}
    if getattr(cfg, "use_attention_sinks", False):  # learned per-head sink logits joining each softmax row
        extra["attention_sinks"] = {i: a.sinks.detach().float().cpu().clone() for i, a in enumerate(attns)}
    if getattr(cfg, "use_dynamic_ntk_rope", False) or getattr(cfg, "use_logn_attn", False):
        # Qwen-1: frequencies (dynamic NTK) and query scale (log-n) change past the training length
        extra["dynamic_max_len"] = int(getattr(cfg, "train_seq_length", None) or cfg.n_ctx)
    return RopeSpec(
        model_name=name,
        n_layers=len(blocks),
        n_heads=n_heads,
        n_kv_heads=int(getattr(cfg, "n_key_value_heads", None) or n_heads),
        d_head=d_head,
        n_ctx=int(cfg.n_ctx),
        layers=tuple(layers),
        rope_type="+".join(sorted(rope_types)),
        qk_norm=getattr(attns[0], "q_norm", None) is not None,
        source="HookedTransformer config, checked against its rotary tables",
        extra=extra,
    )


def _output_cap(cfg: Any) -> float | None:
    """A TransformerLens config's soft-cap of the output logits (``output_logits_soft_cap``; ``None`` when off)."""
    cap = float(getattr(cfg, "output_logits_soft_cap", -1.0) or -1.0)
    return cap if cap > 0 else None
