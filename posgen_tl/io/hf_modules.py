"""Where a Hugging Face decoder keeps what its RoPE spec is read from: the per-layer self-attention modules
(:func:`hf_attention_modules`, hybrid models refused by name), the rotary module, GPT-J/CodeGen's sin/cos tables
(:func:`sincos_tables`), and the number of key/value heads and the head dimension the attention modules really use.

:func:`posgen_tl.io.spec.rope_spec` reads the spec from these; :mod:`posgen_tl.io.spec` re-exports the public names.
"""

from __future__ import annotations

from typing import Any

import torch

from posgen_tl.maths.rope import RopeError

__all__ = ["hf_attention_modules", "sincos_tables"]


#: where HF decoders keep their layers (checked in order; then any ModuleList of the right length)
_LAYER_PATHS = ("model.layers", "model.language_model.layers", "language_model.layers", "gpt_neox.layers",
                "transformer.h", "transformer.layers", "model.decoder.layers", "layers", "h")
#: the self-attention child of a decoder layer, by HF name
_ATTN_NAMES = ("self_attn", "attention", "attn", "self_attention")


def _attention_of(layer: Any) -> Any | None:
    """The HF self-attention module of a decoder layer (unwrapped from a TransformerBridge component,
    which replaces it inside the booted model), or ``None``."""
    layer = getattr(layer, "original_component", None) or layer
    for nm in _ATTN_NAMES:
        mod = getattr(layer, nm, None)
        if mod is not None:
            return getattr(mod, "original_component", None) or mod
    mod = getattr(layer, "temporal_block", None)  # RecurrentGemma: attention OR a recurrent block, by layer
    mod = getattr(mod, "original_component", None) or mod
    if mod is not None and "Attention" in type(mod).__name__:
        return mod
    return None


def hf_rotary(hf: Any) -> Any | None:
    """The HF rotary-embedding module (one holding an ``inv_freq`` / ``{layer_type}_inv_freq`` buffer)."""
    for _, mod in hf.named_modules():
        bufs = dict(mod.named_buffers(recurse=False))
        if any(k == "inv_freq" or k.endswith("_inv_freq") for k in bufs):
            return mod
    return None


def hf_attention_modules(hf: Any, name: str | None = None) -> list:
    """The per-layer self-attention modules of a HF decoder, in layer order.

    Looks at the usual places (``model.layers``, ``gpt_neox.layers``, ``transformer.h``, …), then at any
    ``ModuleList`` with ``num_hidden_layers`` entries that hold a self-attention child.
    """
    import torch.nn as nn  # noqa: PLC0415

    arch = type(hf).__name__
    cfg = getattr(hf.config, "text_config", None) or hf.config
    n = getattr(cfg, "num_hidden_layers", None)
    layers = None
    for path in _LAYER_PATHS:
        obj: Any = hf
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (nn.ModuleList, list, tuple)) and len(obj) and any(_attention_of(x) is not None for x in obj):
            layers = obj
            break
    if layers is None:
        for _, mod in hf.named_modules():
            if isinstance(mod, nn.ModuleList) and len(mod) and (n is None or len(mod) == n) \
                    and any(_attention_of(x) is not None for x in mod):
                layers = mod
                break
    label = f"model {name!r} ({arch})" if name else arch
    if layers is None:
        raise RopeError(
            f"{label}: cannot find the decoder layers (looked for {', '.join(_LAYER_PATHS)} and any "
            f"ModuleList of {n} layers with a {'/'.join(_ATTN_NAMES)} child)"
        )
    out = [_attention_of(layer) for layer in layers]
    other = [i for i, a in enumerate(out) if a is None]
    if other:
        kinds = sorted({type(getattr(layers[i], "original_component", None) or layers[i]).__name__ for i in other})
        mixers = sorted({type(m).__name__ for i in other for nm, m in
                         (getattr(layers[i], "original_component", None) or layers[i]).named_children()
                         if any(w in nm.lower() for w in ("mamba", "linear_attn", "conv", "temporal", "mixer", "ssm",
                                                          "recurrent")) and "norm" not in nm.lower()})
        raise RopeError(
            f"{label}: a hybrid model — of its {len(out)} decoder layers, layer(s) {_ranges(other)} are not attention "
            f"({', '.join(mixers or kinds)}) and layer(s) {_ranges([i for i in range(len(out)) if i not in other])} "
            "are. "
            "posgen_tl's analyses need every decoder layer to be RoPE attention, so hybrid models are not supported"
        )
    return out


def _ranges(idx: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(idx):
        if start is None:
            start = x
        if i + 1 == len(idx) or idx[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def sincos_tables(hf: Any, attns: list | None = None) -> list[torch.Tensor] | None:
    """The per-layer ``embed_positions = cat(sin, cos)`` tables of a GPT-J / CodeGen model, wherever the
    installed transformers keeps them: on each attention module (transformers ≤ 5.23) or on one shared
    rotary module (``model.rotary_emb.embed_positions``, transformers ≥ 5.24). ``None``: no such table.
    Each entry is the live buffer ``[n_positions, rotary_dim]`` (not a copy)."""
    attns = hf_attention_modules(hf) if attns is None else attns
    own = [getattr(a, "embed_positions", None) for a in attns]
    if attns and all(isinstance(t, torch.Tensor) for t in own):
        return own  # type: ignore[return-value]
    for _, mod in hf.named_modules():
        buf = dict(mod.named_buffers(recurse=False)).get("embed_positions")
        if isinstance(buf, torch.Tensor) and buf.ndim == 2:
            return [buf] * len(attns)
    return None


def hf_kv_heads(attn: Any, cfg: Any, n_heads: int) -> int:
    """The number of key/value heads the attention module really uses: its own attribute where it has
    one (Falcon's multi-query attention keeps ``config.num_kv_heads`` = the query heads but uses 1),
    else ``config.num_key_value_heads``, else one per query head."""
    for attr in ("num_key_value_heads", "num_kv_heads"):
        v = getattr(attn, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    groups = getattr(attn, "num_key_value_groups", None)
    if isinstance(groups, int) and groups > 0 and n_heads % groups == 0:
        return n_heads // groups
    return int(getattr(cfg, "num_key_value_heads", None) or n_heads)


def hf_head_dim(text_cfg: Any, attns: list, n_heads: int, name: str, arch: str) -> int:
    """The head dimension every attention layer uses — each module's own ``head_dim`` where it has one
    (never a per-layer config attribute read globally: transformers refuses that for Gemma 4).

    Raises:
        RopeError: layers with different head dimensions (Gemma 4's wider global layers)."""
    dims = {int(d) for d in (getattr(a, "head_dim", None) for a in attns) if isinstance(d, int) and d > 0}
    if len(dims) > 1:
        per = [int(getattr(a, "head_dim", 0) or 0) for a in attns]
        raise RopeError(
            f"model {name!r} ({arch}): the head dimension differs between layers ({', '.join(map(str, sorted(dims)))}; "
            f"per layer {per}); posgen_tl's spec holds one head dimension per model, so this model is not supported"
        )
    if dims:
        return dims.pop()
    try:
        d = getattr(text_cfg, "head_dim", None)
    except Exception:  # noqa: BLE001 — transformers' AmbiguousGlobalPerLayerAttributeError
        d = None
    return int(d or text_cfg.hidden_size // n_heads)
