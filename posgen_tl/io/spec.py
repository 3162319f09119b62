"""Read a model's RoPE spec from the model itself (never from defaults).

Sources, in order:

* a TransformerBridge over a HuggingFace model: the HF rotary module's ``inv_freq``
  (``{layer_type}_inv_freq`` for Gemma3's local/global layers), its
  ``attention_scaling``, each attention module's ``scaling`` and ``sliding_window``;
* a TransformerBridge over a TransformerLens-native model (``boot_native``): the native
  rotary tables' frequencies (adjacent pairs), ``attn.scale``;
* a TransformerLens 3.x ``HookedTransformer``: its config (``rotary_base``,
  ``rotary_base_local``, ``rotary_dim``, ``rotary_adjacent_pairs``, NTK-by-parts, YaRN,
  linear scaling) and each attention module's ``attn_scale``/``attn_type`` — every layer's
  frequency table is checked against the module's own ``rotary_cos``/``rotary_sin`` buffers,
  so a wrong or unknown config value raises instead of giving wrong numbers.

``bridge.cfg.rotary_base`` of a 4.x bridge is never used: it reads 10000 where the
model uses 1e5 (SmolLM2) or 1e4/1e6 (Gemma3).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from posgen_tl.maths.rope import LayerRope, RopeError, RopeSpec

__all__ = ["rope_spec", "SUPPORTED_ROPE_TYPES"]

#: rope types whose effect lives entirely in ``inv_freq`` and ``attention_scaling``
#: (so reading them off the rotary module is exact). ``dynamic`` is exact only up to
#: the original context; beyond it HF recomputes inv_freq per length (refused there).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "proportional")


def _model_name(model: Any) -> str:
    cfg = getattr(model, "cfg", None)
    return str(getattr(cfg, "model_name", None) or type(model).__name__)


def rope_spec(model: Any) -> RopeSpec:
    """Return the :class:`RopeSpec` of ``model`` (a bridge or a HookedTransformer).

    Raises:
        RopeError: the model has no rotary position embedding, or uses a RoPE scaling
            type this library cannot reproduce exactly (the message names both).
    """
    cfg = getattr(model, "cfg", None)
    pe = getattr(cfg, "positional_embedding_type", None)
    name = _model_name(model)
    if pe is not None and str(pe).lower() not in ("rotary",):
        raise RopeError(
            f"model {name!r} uses positional_embedding_type={pe!r}, not rotary (RoPE): "
            "posgen_tl analyses RoPE models only (e.g. Llama, Gemma, Qwen, Mistral)."
        )
    inner = getattr(model, "original_model", None)
    if inner is not None and hasattr(inner, "config") and hasattr(inner, "named_modules"):
        return _from_hf(model, inner, name)
    if inner is not None and getattr(inner, "rotary", None) is not None:
        return _from_native(model, inner, name)
    if inner is not None and pe is not None:
        raise RopeError(f"model {name!r}: a rotary model whose rotary module could not be found")
    if cfg is not None and pe is not None and hasattr(model, "blocks"):
        return _from_tl_config(model, name)
    raise RopeError(
        f"cannot read a RoPE spec from {type(model).__name__}: expected a TransformerBridge "
        "or a HookedTransformer with positional_embedding_type='rotary'."
    )


# ----------------------------------------------------------------------------- HF


def _rope_params_for(config: Any, layer_type: str | None) -> dict:
    rp = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rp, dict) and layer_type is not None and layer_type in rp and isinstance(rp[layer_type], dict):
        return rp[layer_type]
    return rp if isinstance(rp, dict) else {}


def _from_hf(model: Any, hf: Any, name: str) -> RopeSpec:
    config = hf.config
    text_cfg = getattr(config, "text_config", None) or config
    layer_types = list(getattr(text_cfg, "layer_types", None) or [])
    # the rotary module: one with inv_freq buffers
    rotary = None
    for _, mod in hf.named_modules():
        bufs = dict(mod.named_buffers(recurse=False))
        if any(k == "inv_freq" or k.endswith("_inv_freq") for k in bufs):
            rotary = mod
            break
    if rotary is None:
        raise RopeError(
            f"model {name!r} ({type(hf).__name__}): no rotary embedding module with an inv_freq "
            "buffer was found; is this a RoPE model?"
        )
    attn_modules = _hf_attention_modules(hf)
    n_layers = int(getattr(text_cfg, "num_hidden_layers", len(attn_modules)))
    if len(attn_modules) != n_layers:
        raise RopeError(f"model {name!r}: found {len(attn_modules)} attention modules for {n_layers} layers")
    bridge_cfg = getattr(model, "cfg", None)
    adjacent = bool(getattr(bridge_cfg, "rotary_adjacent_pairs", False)) or bool(
        getattr(bridge_cfg, "rotary_interleaved_cos_sin", False)
    )
    layout = "adjacent" if adjacent else "half"
    n_heads = int(getattr(text_cfg, "num_attention_heads"))
    n_kv = int(getattr(text_cfg, "num_key_value_heads", None) or n_heads)
    d_head = int(getattr(text_cfg, "head_dim", None) or getattr(text_cfg, "hidden_size") // n_heads)
    n_ctx = int(getattr(text_cfg, "max_position_embeddings", 0) or getattr(bridge_cfg, "n_ctx", 0))
    rope_types: set[str] = set()
    layers = []
    for i, attn in enumerate(attn_modules):
        lt = layer_types[i] if i < len(layer_types) else None
        bufs = dict(rotary.named_buffers(recurse=False))
        key = f"{lt}_inv_freq" if lt is not None and f"{lt}_inv_freq" in bufs else "inv_freq"
        if key not in bufs:
            raise RopeError(f"model {name!r}: rotary module has no {key!r} for layer {i} ({lt})")
        inv_freq = bufs[key].detach().float().cpu().clone()
        scaling_attr = f"{lt}_attention_scaling" if lt is not None and hasattr(rotary, f"{lt}_attention_scaling") else "attention_scaling"
        a = float(getattr(rotary, scaling_attr, 1.0) or 1.0)
        params = _rope_params_for(text_cfg, lt)
        rtype = str(params.get("rope_type") or params.get("type") or getattr(rotary, "rope_type", "default"))
        if isinstance(getattr(rotary, "rope_type", None), dict):
            rtype = str(rotary.rope_type.get(lt, rtype))
        if rtype not in SUPPORTED_ROPE_TYPES:
            raise RopeError(
                f"model {name!r} layer {i}: RoPE scaling type {rtype!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); its frequencies depend on the "
                "input length, so a single spec would give wrong numbers."
            )
        rope_types.add(rtype)
        scale = float(getattr(attn, "scaling", None) or d_head**-0.5)
        window = None
        is_sliding = bool(getattr(attn, "is_sliding", False)) or (lt == "sliding_attention")
        if is_sliding:
            window = getattr(attn, "sliding_window", None) or getattr(text_cfg, "sliding_window", None)
            window = int(window) if window else None
        kind = "local" if window else ("global" if layer_types else "full")
        layers.append(
            LayerRope(
                inv_freq=inv_freq,
                rotary_dim=2 * inv_freq.numel(),
                layout=layout,
                attention_scaling=a,
                score_scale=scale,
                sliding_window=window,
                kind=kind,
            )
        )
    softcap = getattr(text_cfg, "attn_logit_softcapping", None)
    q_norm = any(hasattr(m, "q_norm") for m in attn_modules)
    extra = {"attn_logit_softcapping": softcap, "layer_types": layer_types}
    if "dynamic" in rope_types:
        extra["dynamic_max_len"] = int(
            _rope_params_for(text_cfg, None).get("original_max_position_embeddings") or n_ctx
        )
    return RopeSpec(
        model_name=name,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=d_head,
        n_ctx=n_ctx,
        layers=tuple(layers),
        rope_type="+".join(sorted(rope_types)),
        qk_norm=q_norm,
        source=f"HF {type(rotary).__name__}",
        extra=extra,
    )


def _hf_attention_modules(hf: Any) -> list:
    """The per-layer self-attention modules of a HF decoder, in layer order."""
    base = getattr(hf, "model", hf)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    if layers is None:
        raise RopeError(f"{type(hf).__name__}: cannot find the decoder layers")
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None) or getattr(layer, "attn", None)
        if attn is None:
            raise RopeError(f"{type(hf).__name__}: a decoder layer without a self-attention module")
        out.append(attn)
    return out


# ----------------------------------------------------------------------------- native


def _from_native(model: Any, native: Any, name: str) -> RopeSpec:
    cfg = model.cfg
    rotary = native.rotary
    rotary_dim = int(rotary.rotary_dim)
    from transformer_lens.model_bridge.sources.native.model import _resolve_rope_scaling

    _, position_scale, inv_freq = _resolve_rope_scaling(cfg, rotary_dim)
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
        extra={"attn_logit_softcapping": (float(cfg.attn_scores_soft_cap) if cfg.attn_scores_soft_cap > 0 else None)},
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


def _from_tl_config(model: Any, name: str) -> RopeSpec:
    """HookedTransformer (TransformerLens 3.x): per layer, the frequencies its attention module
    uses (``rotary_base`` or ``rotary_base_local``, NTK-by-parts, YaRN, linear scaling), the
    module's own ``attn_scale`` and ``attn_type``/``window_size`` — each frequency table checked
    against the module's ``rotary_cos``/``rotary_sin`` buffers (a mismatch raises)."""
    cfg = model.cfg
    d_head = int(cfg.d_head)
    rotary_dim = int(getattr(cfg, "rotary_dim", None) or d_head)
    layout = "adjacent" if getattr(cfg, "rotary_adjacent_pairs", False) else "half"
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
    extra: dict[str, Any] = {"attn_logit_softcapping": softcap if softcap > 0 else None}
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
