"""Read a model's RoPE spec from the model itself (never from defaults).

Sources, in order:

* a TransformerBridge over a HuggingFace model: the HF rotary module's ``original_inv_freq``
  (``{layer_type}_…`` for Gemma3's local/global layers; LongRoPE's long factors from HF's own init
  function), its ``attention_scaling``, each attention module's ``scaling`` (``1/scale_attn`` on
  GPT-J), the pair layout from the model's own ``apply_rotary_pos_emb``, the sliding window from
  ``layer_types`` or, without them, ``config.sliding_window`` (Mistral, Phi-3), layers without RoPE
  (NoPE) as zero frequencies, learned sinks and ``clip_qkv``; every layer's table is checked against
  the rotary module's own forward. GPT-J (no ``inv_freq``): its ``embed_positions`` sin/cos table,
  checked row by row. Attention this library does not model (MLA, chunked attention, QK-norm after
  RoPE, …) raises a :class:`RopeError` naming it;
* a TransformerBridge over a TransformerLens-native model (``boot_native``): the native
  rotary tables' frequencies (adjacent pairs), ``attn.scale``;
* a TransformerLens 3.x ``HookedTransformer``: its config (``rotary_base``,
  ``rotary_base_local``, ``rotary_dim``, ``rotary_adjacent_pairs``, NTK-by-parts, YaRN,
  linear scaling) and each attention module's ``attn_scale``/``attn_type`` — every layer's
  frequency table is checked against the module's own ``rotary_cos``/``rotary_sin`` buffers,
  so a wrong or unknown config value raises instead of giving wrong numbers.

``bridge.cfg.rotary_base`` of a 4.x bridge is never used: it reads 10000 where the
model uses 1e5 (SmolLM2) or 1e4/1e6 (Gemma3).

Where a HF decoder keeps its attention and rotary modules: :mod:`posgen_tl.io.hf_modules` (its public names are
importable from here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any

import torch

from posgen_tl.io.hf_modules import hf_attention_modules, hf_head_dim, hf_kv_heads, hf_rotary, sincos_tables
from posgen_tl.io.spec_tl import spec_from_native, spec_from_tl_config
from posgen_tl.maths.rope import LayerRope, Layout, RopeError, RopeSpec

_LAYOUTS: tuple[Layout, ...] = ("half", "adjacent")

__all__ = ["rope_spec", "SUPPORTED_ROPE_TYPES", "sincos_tables", "hf_attention_modules", "live_rope"]

#: rope types whose effect lives entirely in ``inv_freq`` and ``attention_scaling``
#: (so reading them off the rotary module is exact). ``dynamic`` is exact only up to
#: the original context; beyond it HF recomputes inv_freq per length (refused there).
#: ``longrope`` carries two frequency sets chosen by length (``LayerRope.long_inv_freq``).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "proportional", "longrope")


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
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    if hf_cfg is not None and bool(getattr(hf_cfg, "use_mem_rope", False)):
        raise RopeError(
            f"model {name!r} ({type(model.original_model).__name__}): a hybrid of Mamba layers and shared attention "
            "blocks that apply RoPE (Zamba2, use_mem_rope=True); TransformerLens reports it as positional_embedding_type="
            f"{pe!r}, and hybrid models are not supported by posgen_tl"
        )
    if pe is not None and str(pe).lower() not in ("rotary",):
        raise RopeError(
            f"model {name!r} uses positional_embedding_type={pe!r}, not rotary (RoPE): "
            "posgen_tl analyses RoPE models only (e.g. Llama, Gemma, Qwen, Mistral)."
        )
    inner = getattr(model, "original_model", None)
    if inner is not None and hasattr(inner, "config") and hasattr(inner, "named_modules"):
        return spec_from_hf(model, inner, name)
    if inner is not None and getattr(inner, "rotary", None) is not None:
        return spec_from_native(model, inner, name)
    if inner is not None and pe is not None:
        raise RopeError(f"model {name!r}: a rotary model whose rotary module could not be found")
    if cfg is not None and pe is not None and hasattr(model, "blocks"):
        return spec_from_tl_config(model, name)
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


def _layer_window(text_cfg: Any, attn: Any, layer_type: str | None, has_layer_types: bool) -> int | None:
    """The sliding window HF's mask applies to this layer, or ``None`` (full causal attention).

    With ``config.layer_types`` (Gemma 2/3, Qwen2/3, OLMo-3, GPT-OSS, SmolLM3) a layer is windowed iff
    its type is ``"sliding_attention"``; without (Mistral, Mixtral, Phi-3, Starcoder2) HF builds ONE
    sliding-window mask for every layer whenever ``config.sliding_window`` is set — the window lives
    in the config only, applied through the mask, with no per-module attribute.
    """
    if has_layer_types:
        sliding = layer_type == "sliding_attention" or bool(getattr(attn, "is_sliding", False))
    else:
        sliding = bool(getattr(text_cfg, "sliding_window", None)) or bool(getattr(attn, "is_sliding", False))
    if not sliding:
        return None
    w = getattr(attn, "sliding_window", None) or getattr(text_cfg, "sliding_window", None)
    return int(w) if w else None


def spec_from_hf(model: Any, hf: Any, name: str) -> RopeSpec:
    """The :class:`RopeSpec` of the HF model ``hf`` under the bridge ``model``, read from its modules (the
    sources: the module docstring); ``name`` labels every message.

    Raises:
        RopeError: no rotary embedding, attention this library does not model (named), or a layer whose RoPE
            cannot be reproduced exactly (:func:`_hf_layer_rope`).
    """
    config = hf.config
    arch = type(hf).__name__
    text_cfg = getattr(config, "text_config", None) or config
    layer_types = list(getattr(text_cfg, "layer_types", None) or [])
    attn_modules = hf_attention_modules(hf, name)
    n_layers = int(getattr(text_cfg, "num_hidden_layers", None) or len(attn_modules))
    if len(attn_modules) != n_layers:
        raise RopeError(f"model {name!r} ({arch}): found {len(attn_modules)} attention modules for {n_layers} layers")
    n_heads = int(text_cfg.num_attention_heads)
    n_kv = hf_kv_heads(attn_modules[0], text_cfg, n_heads)
    d_head = hf_head_dim(text_cfg, attn_modules, n_heads, name, arch)
    bridge_cfg = getattr(model, "cfg", None)
    n_ctx = int(getattr(text_cfg, "max_position_embeddings", 0) or getattr(bridge_cfg, "n_ctx", 0))
    rotary = hf_rotary(hf)
    if rotary is None:
        if sincos_tables(hf, attn_modules) is not None:  # GPT-J / CodeGen: a fixed sin|cos table, no inv_freq
            return _from_sincos_table(model, hf, name, attn_modules, n_heads, n_kv, d_head, n_ctx)
        raise RopeError(
            f"model {name!r} ({arch}): no rotary embedding was found (neither a rotary module with an inv_freq "
            "buffer nor a GPT-J/CodeGen embed_positions sin/cos table, on the attention modules or on a rotary "
            "module); is this a RoPE model?"
        )
    unmodelled = _unmodelled_attention(text_cfg, arch)
    if unmodelled:
        raise RopeError(f"model {name!r} ({arch}): {unmodelled} is not modelled by posgen_tl; refusing rather than "
                        "giving numbers that are not the model's")
    if bool(getattr(bridge_cfg, "qk_norm_after_rope", False)) or hasattr(attn_modules[0], "query_layernorm"):
        raise RopeError(
            f"model {name!r} ({arch}): QK-norm is applied AFTER RoPE (HunYuan), so the logits are not "
            "s·(R_i q)·(R_j k) of any pre-rotation q/k; posgen_tl's decomposition does not apply to this model"
        )
    rope_types: set[str] = set()
    layers = []
    extra: dict[str, Any] = {}
    bufs = dict(rotary.named_buffers(recurse=False))
    for i, attn in enumerate(attn_modules):
        lt = layer_types[i] if i < len(layer_types) else None
        lr, rtype = _hf_layer_rope(i, attn, lt, rotary=rotary, bufs=bufs, text_cfg=text_cfg,
                                   has_layer_types=bool(layer_types), bridge_cfg=bridge_cfg, d_head=d_head,
                                   n_ctx=n_ctx, name=name, arch=arch, extra=extra)
        rope_types.add(rtype)
        layers.append(lr)
    softcap = getattr(text_cfg, "attn_logit_softcapping", None)
    sinks = {i: m.sinks.detach().float().cpu().clone() for i, m in enumerate(attn_modules)
             if isinstance(getattr(m, "sinks", None), torch.Tensor)}
    q_norm = any(hasattr(m, "q_norm") or hasattr(m, "q_layernorm") for m in attn_modules)
    extra.update({"attn_logit_softcapping": softcap, "layer_types": layer_types, "architecture": arch,
                  "clip_qkv": getattr(text_cfg, "clip_qkv", None),
                  "final_logit_softcapping": getattr(text_cfg, "final_logit_softcapping", None) or None})
    if sinks:
        extra["attention_sinks"] = sinks
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


def _hf_layer_rope(i: int, attn: Any, lt: str | None, *, rotary: Any, bufs: dict[str, torch.Tensor], text_cfg: Any,
                   has_layer_types: bool, bridge_cfg: Any, d_head: int, n_ctx: int, name: str, arch: str,
                   extra: dict[str, Any]) -> tuple[LayerRope, str]:
    """Layer ``i``'s :class:`LayerRope`, read from its attention module ``attn`` (layer type ``lt``) and the rotary
    module ``rotary`` (its own buffers ``bufs``), with the layer's RoPE type (``"none"``: a layer without rotation,
    θ = 0). A dynamic-NTK layer's buffer prefix (``extra["dynamic_prefix"][i]``) and LongRoPE's switch length
    (``extra["longrope_after"]``) are recorded in ``extra``; a rotating layer's table is checked against the rotary
    module's own forward (:func:`_verify_hf_table`).

    Raises:
        RopeError: an unsupported RoPE type, a missing frequency buffer, a rotary dim above the head dim, or a
            table that differs from the model's.
    """
    if _is_nope(attn, text_cfg, lt, arch):  # no positional rotation (SmolLM3, EXAONE-4 global): θ = 0
        return LayerRope(inv_freq=torch.zeros(d_head // 2), rotary_dim=2 * (d_head // 2),
                         score_scale=_score_scale(attn, d_head), kind="nope",
                         sliding_window=_layer_window(text_cfg, attn, lt, has_layer_types)), "none"
    typed = lt is not None and f"{lt}_inv_freq" in bufs
    prefix = f"{lt}_" if typed else ""
    params = _rope_params_for(text_cfg, lt)
    rtype = str(params.get("rope_type") or params.get("type") or getattr(rotary, "rope_type", "default"))
    if isinstance(getattr(rotary, "rope_type", None), dict):
        rtype = str(rotary.rope_type.get(lt, rtype))
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise RopeError(
            f"model {name!r} ({arch}) layer {i}: RoPE scaling type {rtype!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); its frequencies cannot be reproduced exactly, "
            "so a spec would give wrong numbers."
        )
    if rtype == "dynamic":  # HF recomputes these frequencies in the forward pass (see live_rope)
        extra.setdefault("dynamic_prefix", {})[i] = prefix
    # the frequencies as built: HF rewrites ``inv_freq`` in place for LongRoPE / dynamic NTK during a
    # forward pass, ``original_inv_freq`` keeps the ones it starts from
    key = f"{prefix}original_inv_freq" if f"{prefix}original_inv_freq" in bufs else f"{prefix}inv_freq"
    if key not in bufs:
        raise RopeError(f"model {name!r} ({arch}): rotary module has no {key!r} for layer {i} ({lt})")
    inv_freq = bufs[key].detach().float().cpu().clone()
    a = float(getattr(rotary, f"{prefix}attention_scaling", None) or getattr(rotary, "attention_scaling", 1.0) or 1.0)
    long_inv, long_after = None, None
    if rtype == "longrope":
        long_inv, long_after = _longrope_long(rotary, text_cfg, lt if typed else None, inv_freq, name, i)
        extra["longrope_after"] = long_after
    layout = _apply_layout(attn, rotary, lt if typed else None, inv_freq, a, name) or \
        _hf_layout(rotary, lt if typed else None, inv_freq.numel(), bridge_cfg, name)
    window = _layer_window(text_cfg, attn, lt, has_layer_types)
    kind = "local" if window else ("global" if has_layer_types else "full")
    lr = LayerRope(
        inv_freq=inv_freq,
        rotary_dim=2 * inv_freq.numel(),
        layout=layout,
        attention_scaling=a,
        score_scale=_score_scale(attn, d_head),
        sliding_window=window,
        kind=kind,
        long_inv_freq=long_inv,
        long_after=long_after,
    )
    if lr.rotary_dim > d_head:
        raise RopeError(f"model {name!r} ({arch}): rotary dim {lr.rotary_dim} exceeds head dim {d_head}")
    _verify_hf_table(rotary, lt if typed else None, lr, n_ctx, name, i)
    return lr, rtype



def live_rope(model: Any, spec: RopeSpec, layer: int, lr: LayerRope) -> LayerRope:
    """``lr`` with the frequencies the model's rotary module holds NOW — on a dynamic-NTK layer, those HF
    computed for the forward pass under way (HF recomputes ``inv_freq`` from the largest position id,
    and keeps it across later calls until a short input resets it: the frequencies depend on the ids
    and on earlier calls, so they are read, never predicted). Every other layer: ``lr`` unchanged.

    Call it inside a forward pass (a hook), after the rotary module ran."""
    prefix = (spec.extra.get("dynamic_prefix") or {}).get(layer)
    if prefix is None:
        return lr
    rotary = _rotary_of(model)
    if rotary is None:
        raise RopeError(f"model {spec.model_name!r}: dynamic-NTK RoPE whose rotary module has disappeared")
    inv = dict(rotary.named_buffers(recurse=False))[f"{prefix}inv_freq"].detach().float().to(lr.inv_freq.device)
    a = float(getattr(rotary, f"{prefix}attention_scaling", None) or getattr(rotary, "attention_scaling", 1.0) or 1.0)
    if inv.shape == lr.inv_freq.shape and bool(torch.equal(inv, lr.inv_freq)) and a == lr.attention_scaling:
        return lr
    return dataclasses.replace(lr, inv_freq=inv, attention_scaling=a, kind=f"{lr.kind}+dynamic")


_ROTARY_CACHE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _rotary_of(model: Any) -> Any | None:
    """The HF rotary module of a bridge (cached per model)."""
    inner = getattr(model, "original_model", None)
    if inner is None:
        return None
    try:
        return _ROTARY_CACHE[inner]
    except KeyError:
        rot = _ROTARY_CACHE[inner] = hf_rotary(inner)
        return rot


def _unmodelled_attention(text_cfg: Any, arch: str) -> str | None:
    """A named attention feature whose logits are not ``s·(R_i q)·(R_j k)`` over a causal (+window) mask."""
    if getattr(text_cfg, "kv_lora_rank", None) or getattr(text_cfg, "qk_rope_head_dim", None):
        return "multi-head latent attention (DeepSeek-V2/V3 MLA: RoPE on a separate slice of q/k)"
    if getattr(text_cfg, "attention_chunk_size", None):
        return "chunked attention (Llama-4: keys masked by fixed chunks, not by a causal window)"
    if getattr(text_cfg, "attn_temperature_tuning", False) or arch.startswith("Llama4"):
        return "Llama-4 attention (position-dependent query temperature, L2 QK-norm)"
    rp = _rope_params_for(text_cfg, None)
    if isinstance(rp, dict) and rp.get("llama_4_scaling_beta") is not None:
        return "the Llama-4 query scale by position (rope_parameters.llama_4_scaling_beta, Ministral-3)"
    km = getattr(text_cfg, "key_multiplier", None)
    if km is not None and float(km) != 1.0:
        return (f"a key multiplier (config.key_multiplier = {float(km):g}, Falcon-H1: the keys are scaled inside "
                "the attention, after the hooks posgen_tl reads)")
    return None


def _is_nope(attn: Any, text_cfg: Any, layer_type: str | None, arch: str) -> bool:
    """HF layers that skip RoPE: ``use_rope = False`` (SmolLM3's ``no_rope_layers``, Llama-4), and the
    full-attention layers of hybrid models that apply RoPE only on sliding layers when a window is set
    (EXAONE-4, Cohere-2: ``if self.sliding_window is None or self.is_sliding``)."""
    if not bool(getattr(attn, "use_rope", True)):
        return True
    if arch.startswith(("Exaone4", "Cohere2")) and getattr(text_cfg, "sliding_window", None):
        return layer_type == "full_attention" or not bool(getattr(attn, "is_sliding", True))
    return False


def _apply_layout(attn: Any, rotary: Any, layer_type: str | None, inv_freq: torch.Tensor, a: float,
                  name: str) -> Layout | None:
    """The pair layout the model's OWN ``apply_rotary_pos_emb`` (its modeling module's function) uses,
    found by rotating a probe vector with the model's cos/sin and comparing with both layouts — GLM's
    table is half-split (``cat(f, f)``) while its rotation pairs adjacent dims. ``None`` where the
    function is missing or has another signature (the cos table decides then)."""
    import sys  # noqa: PLC0415

    from posgen_tl.maths.rope import rotate  # noqa: PLC0415

    fn = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        return None
    n = inv_freq.numel()
    pos = torch.arange(5)[None]
    try:
        cos, sin = _rotary_cos_sin(rotary, layer_type, pos)
        x = torch.randn(1, 1, 5, 2 * n, generator=torch.Generator().manual_seed(0))
        out = fn(x, x.clone(), cos[None], sin[None])[0]
    except Exception:  # noqa: BLE001 — another signature: fall back to the cos table
        return None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    for layout in _LAYOUTS:
        lr = LayerRope(inv_freq=inv_freq, rotary_dim=2 * n, layout=layout, attention_scaling=a)
        ours = rotate(x.transpose(1, 2), pos, lr).transpose(1, 2)
        if (ours - out).abs().max().item() <= 1e-5 * max(1.0, x.abs().max().item()):
            return layout
    for layout in _LAYOUTS:  # the opposite sign: a rotation by −θ (NanoChat's rotate_half)
        lr = LayerRope(inv_freq=-inv_freq, rotary_dim=2 * n, layout=layout, attention_scaling=a)
        ours = rotate(x.transpose(1, 2), pos, lr).transpose(1, 2)
        if (ours - out).abs().max().item() <= 1e-5 * max(1.0, x.abs().max().item()):
            pairs = "halves (m, m + r/2)" if layout == "half" else "adjacent pairs (2m, 2m + 1)"
            raise RopeError(
                f"model {name!r}: its apply_rotary_pos_emb rotates {pairs} by −θ (its rotate_half has the opposite "
                "sign, as NanoChat's); posgen_tl's bands and periods assume the +θ convention, so this model is not "
                "supported"
            )
    raise RopeError(
        f"model {name!r}: its apply_rotary_pos_emb pairs dims neither as halves (m, m + r/2) nor adjacently "
        "(2m, 2m + 1); this RoPE layout is not understood"
    )


def _score_scale(attn: Any, d_head: int) -> float:
    """``s`` of ``W = s · rot_q · rot_k``: the module's ``scaling`` (``1/scale_attn`` on GPT-J)."""
    s = getattr(attn, "scaling", None)
    if s is None and getattr(attn, "scale_attn", None) is not None:
        s = 1.0 / float(attn.scale_attn)
    return float(s if s is not None else d_head**-0.5)


def _rotary_cos_sin(rotary: Any, layer_type: str | None, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own ``(cos, sin)`` for ``positions`` ``[1, pos]``: its rotary module's forward, asked for
    float32 output (HF casts cos/sin to the dtype of its ``x`` argument; the frequencies are the module's
    own, bf16-rounded where the module was cast)."""
    x = torch.zeros(1, dtype=torch.float32, device=next(rotary.buffers()).device)
    pos = positions.to(x.device)
    with torch.no_grad():
        out = rotary(x, pos, layer_type) if layer_type is not None else rotary(x, pos)
    cos, sin = out
    return cos.reshape(-1, cos.shape[-1]).float().cpu(), sin.reshape(-1, sin.shape[-1]).float().cpu()


def _hf_layout(rotary: Any, layer_type: str | None, n_bands: int, bridge_cfg: Any, name: str) -> Layout:
    """``"half"`` or ``"adjacent"``, read from the model's own cos table: HF duplicates the band
    frequencies as halves (``cat(f, f)``: pairs ``(m, m + r/2)``, Llama/NeoX) or interleaves them
    (``repeat_interleave(f, 2)``: pairs ``(2m, 2m+1)``, Cohere); a half-width table (GPT-OSS) is
    rotated by halves. Falls back to the bridge config's flags if the module cannot be called."""
    try:
        cos, _ = _rotary_cos_sin(rotary, layer_type, torch.arange(4)[None])
    except Exception:  # noqa: BLE001 — a rotary module with another signature: use the bridge's flags
        adjacent = bool(getattr(bridge_cfg, "rotary_adjacent_pairs", False)) or bool(
            getattr(bridge_cfg, "rotary_interleaved_cos_sin", False))
        return "adjacent" if adjacent else "half"
    w = cos.shape[-1]
    if w == n_bands:
        return "half"
    if w != 2 * n_bands:
        raise RopeError(f"model {name!r}: the rotary cos table has width {w} for {n_bands} frequency bands")
    if n_bands == 1 or torch.equal(cos[:, :n_bands], cos[:, n_bands:]):
        return "half"
    if torch.equal(cos[:, 0::2], cos[:, 1::2]):
        return "adjacent"
    raise RopeError(f"model {name!r}: the rotary cos table is neither half-split nor interleaved; layout not understood")


def _table(lr: LayerRope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our per-band ``(cos, sin)`` ``[pos, band]`` (attention scaling included)."""
    from posgen_tl.maths.rope import angles  # noqa: PLC0415

    ang = angles(positions, lr).reshape(-1, lr.n_bands)
    return ang.cos() * lr.attention_scaling, ang.sin() * lr.attention_scaling


def _verify_hf_table(rotary: Any, layer_type: str | None, lr: LayerRope, n_ctx: int, name: str, layer: int) -> None:
    """Our angles must reproduce the model's own rotary forward (cos and sin, attention scaling included)
    — below and above the LongRoPE switch — or the RoPE variant is refused."""
    lengths = [min(max(n_ctx, 2), 64)]
    if lr.long_after is not None:
        lengths = [min(lr.long_after, lengths[0]), lr.long_after + 1]
    for n in lengths:
        pos = torch.arange(n)[None]
        try:
            cos_m, sin_m = _rotary_cos_sin(rotary, layer_type, pos)
        except Exception:  # noqa: BLE001 — the probe still compares the rotation with hook_rot / hook_cos
            return
        if cos_m.shape[-1] not in (lr.n_bands, lr.rotary_dim):
            raise RopeError(f"model {name!r} layer {layer}: rotary table width {cos_m.shape[-1]} for rotary dim {lr.rotary_dim}")
        cos_o, sin_o = _table(lr, pos)  # per band; the model's table in whichever duplicated form
        n = lr.n_bands
        err = min(
            max((cos_o - cos_m[:, a]).abs().max().item(), (sin_o - sin_m[:, a]).abs().max().item(),
                (cos_o - cos_m[:, b]).abs().max().item(), (sin_o - sin_m[:, b]).abs().max().item())
            for a, b in ((slice(0, n), slice(n, 2 * n)), (slice(0, None, 2), slice(1, None, 2)))
        ) if cos_m.shape[-1] == 2 * n else max((cos_o - cos_m).abs().max().item(), (sin_o - sin_m).abs().max().item())
        tol = 1e-5 * max(1.0, lr.attention_scaling)
        if not err <= tol:
            raise RopeError(
                f"model {name!r} layer {layer}: our RoPE table differs from the model's rotary module by {err:.3g} "
                f"at {n} positions ({lr.kind}); this RoPE variant is not understood"
            )
    if lr.long_after is not None:  # the forward above switched HF's buffer: leave it as for short inputs
        with contextlib.suppress(Exception):
            _rotary_cos_sin(rotary, layer_type, torch.arange(1)[None])


def _longrope_long(rotary: Any, text_cfg: Any, layer_type: str | None, short: torch.Tensor, name: str,
                   layer: int) -> tuple[torch.Tensor, int]:
    """LongRoPE's long-factor frequencies and switch length, computed by HF's own init function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    params = _rope_params_for(text_cfg, layer_type)
    after = params.get("original_max_position_embeddings") or getattr(text_cfg, "original_max_position_embeddings", None)
    if not after:
        raise RopeError(
            f"model {name!r} layer {layer}: RoPE type 'longrope' without original_max_position_embeddings — the "
            "length at which HF switches from the short to the long factors is unknown"
        )
    kw = {"layer_type": layer_type} if layer_type is not None else {}
    try:
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, None, seq_len=int(after) + 1, **kw)
    except (KeyError, TypeError, ValueError) as e:
        raise RopeError(f"model {name!r} layer {layer}: RoPE type 'longrope' with incomplete parameters ({e!r})") from e
    long_inv = long_inv.detach().float().cpu()
    if long_inv.shape != short.shape:
        raise RopeError(f"model {name!r} layer {layer}: LongRoPE long factors of shape {tuple(long_inv.shape)}")
    return long_inv, int(after)


def _from_sincos_table(model: Any, hf: Any, name: str, attns: list, n_heads: int, n_kv: int, d_head: int,
                       n_ctx: int) -> RopeSpec:
    """GPT-J / CodeGen: an ``embed_positions = cat(sin, cos)`` table of ``p · 10000^(−2m/r)``
    (``create_sinusoidal_positions``; per attention module, or one on the model's rotary module — see
    :func:`sincos_tables`), adjacent pairs rotated (``rotate_every_two``) on the first ``rotary_dim`` dims.
    Our frequencies are built the same way and checked against the table of every layer (all
    ``n_positions`` rows)."""
    arch = type(hf).__name__
    layers = []
    tables = sincos_tables(hf, attns) or []
    for i, (attn, table) in enumerate(zip(attns, tables)):
        r = int(getattr(attn, "rotary_dim", None) or d_head)
        if table.shape[-1] != r:
            raise RopeError(f"model {name!r} ({arch}) layer {i}: sin/cos table width {table.shape[-1]} != rotary_dim {r}")
        inv = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.int64) / r))
        lr = LayerRope(inv_freq=inv.float(), rotary_dim=r, layout="adjacent", score_scale=_score_scale(attn, d_head))
        from posgen_tl.maths.rope import angles  # noqa: PLC0415

        n = int(table.shape[0])
        ang = angles(torch.arange(n), lr)
        ours = torch.cat([ang.sin(), ang.cos()], dim=-1)
        err = (ours - table.detach().float().cpu()).abs().max().item()
        if not err <= 4 * torch.finfo(table.dtype).eps:
            raise RopeError(
                f"model {name!r} ({arch}) layer {i}: the sin/cos table differs from base-10000 RoPE by {err:.3g}; "
                "this RoPE variant is not understood"
            )
        layers.append(lr)
    return RopeSpec(
        model_name=name, n_layers=len(layers), n_heads=n_heads, n_kv_heads=n_kv, d_head=d_head, n_ctx=n_ctx,
        layers=tuple(layers), rope_type="default", qk_norm=False, source=f"HF {arch} sin/cos table",
        extra={"attn_logit_softcapping": None, "layer_types": [], "architecture": arch,
               "max_position": min(int(t.shape[0]) for t in tables)},
    )
