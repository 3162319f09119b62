"""Read a model's RoPE spec from the model itself (never from defaults).

Sources, in order:

* a TransformerBridge over a HuggingFace model: the HF rotary module's ``inv_freq``
  (``{layer_type}_inv_freq`` for Gemma3's local/global layers), its
  ``attention_scaling``, each attention module's ``scaling`` and ``sliding_window``;
* a TransformerBridge over a TransformerLens-native model (``boot_native``): the native
  rotary tables' frequencies (adjacent pairs), ``attn.scale``;
* a TransformerLens 3.x ``HookedTransformer``: its config (``rotary_base``,
  ``rotary_dim``, ``rotary_adjacent_pairs``, NTK-by-parts) — ``cfg.rotary_base`` is
  only trusted there, because the 4.x bridge reports a wrong value (MODELS.md).

``bridge.cfg.rotary_base`` of a 4.x bridge is never used: it reads 10000 where the
model uses 1e5 (SmolLM2) or 1e4/1e6 (Gemma3).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .rope import LayerRope, RopeError, RopeSpec

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


def _from_tl_config(model: Any, name: str) -> RopeSpec:
    """HookedTransformer (TransformerLens 3.x): the config is authoritative there."""
    cfg = model.cfg
    d_head = int(cfg.d_head)
    rotary_dim = int(getattr(cfg, "rotary_dim", None) or d_head)
    base = float(cfg.rotary_base)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    if getattr(cfg, "use_NTK_by_parts_rope", False):
        factor = float(cfg.NTK_by_parts_factor)
        low = float(cfg.NTK_by_parts_low_freq_factor)
        high = float(cfg.NTK_by_parts_high_freq_factor)
        old_ctx = float(cfg.NTK_original_ctx_len)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        inv_freq = torch.where(
            wavelen > old_ctx / low,
            inv_freq / factor,
            torch.where(wavelen < old_ctx / high, inv_freq, (1 - smooth) * inv_freq / factor + smooth * inv_freq),
        )
    layout = "adjacent" if getattr(cfg, "rotary_adjacent_pairs", False) else "half"
    scale = 1.0 / float(cfg.attn_scale) if getattr(cfg, "use_attn_scale", True) else 1.0
    n_heads = int(cfg.n_heads)
    n_kv = int(getattr(cfg, "n_key_value_heads", None) or n_heads)
    window = int(cfg.window_size) if getattr(cfg, "window_size", None) else None
    attn_types = list(getattr(cfg, "attn_types", None) or [])
    layers = []
    for i in range(int(cfg.n_layers)):
        local = bool(attn_types) and attn_types[i] == "local"
        layers.append(
            LayerRope(
                inv_freq=inv_freq.float(),
                rotary_dim=rotary_dim,
                layout=layout,
                score_scale=scale,
                sliding_window=window if local else None,
                kind="local" if local else "full",
            )
        )
    return RopeSpec(
        model_name=name,
        n_layers=int(cfg.n_layers),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        d_head=d_head,
        n_ctx=int(cfg.n_ctx),
        layers=tuple(layers),
        rope_type="ntk_by_parts" if getattr(cfg, "use_NTK_by_parts_rope", False) else "default",
        qk_norm=bool(getattr(cfg, "use_qk_norm", False)),
        source="HookedTransformer config",
        extra={"attn_logit_softcapping": None},
    )
