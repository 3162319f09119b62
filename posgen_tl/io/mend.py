"""Mends for a TransformerBridge over a Hugging Face model where the installed transformers and
TransformerLens disagree — applied by :func:`posgen_tl.load_model`, each exact, each checked.

transformers 5.24 changed two things TransformerLens 4.3's bridge still expects the old way:

* **GPT-J / CodeGen's sin/cos table moved** from each attention module (``attn.embed_positions``,
  with ``attn.scale_attn = sqrt(head_dim)``) to one rotary module (``model.rotary_emb.embed_positions``,
  with ``attn.scaling = head_dim**-0.5``). TransformerLens' CodeGen attention reads the old attributes
  and fails in the model's own forward pass. :func:`mend_hf_for_bridge` gives each attention module
  the attributes it had: the SAME table (a non-persistent buffer holding the rotary module's values)
  and ``scale_attn = 1 / scaling``. Nothing the model computes changes: the table is identical.
* **Rotation in float32**: OLMo's rotary module now returns float32 cos/sin for a half-precision
  model, and its ``apply_rotary_pos_emb`` rounds the rotated q/k back to the model's dtype. The
  bridge's generic attention applies Llama's rotation, which keeps float32, so q/k reach the
  ``value`` matmul in float32 and the forward pass dies. :func:`mend_bridge_rotation_dtype` adds a
  permanent hook on ``hook_rot_q``/``hook_rot_k`` of the affected layers that rounds to the model's
  dtype — exactly HF's ``q_embed.to(q.dtype)``. It is added only where the rotary module returns
  another dtype than its input (checked on the model), so nothing else is touched.

Both are verified by the architecture matrix (tests/arch_matrix.py) against Hugging Face's own eager
attention of the same weights, in float32, bfloat16 and float16.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

__all__ = ["mend_hf_for_bridge", "mend_bridge_rotation_dtype", "MENDED"]

#: what was mended on a bridge (``MENDED[bridge]``: one-line descriptions; ``posgen-tl check`` prints them)
MENDED: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()

_TABLE_ATTENTIONS = ("GPTJAttention", "CodeGenAttention")


def mend_hf_for_bridge(hf: Any) -> list[str]:
    """Give GPT-J / CodeGen attention modules the ``embed_positions`` table and ``scale_attn`` that
    TransformerLens' bridge reads, where the installed transformers keeps them elsewhere (≥ 5.24).

    Returns one line per mend applied (empty where nothing was needed)."""
    from posgen_tl.io.spec import hf_attention_modules, sincos_tables  # noqa: PLC0415
    from posgen_tl.maths.rope import RopeError  # noqa: PLC0415

    try:
        attns = hf_attention_modules(hf)
    except RopeError:
        return []
    if not any(type(a).__name__ in _TABLE_ATTENTIONS for a in attns):
        return []
    found = sincos_tables(hf, attns)
    tables: list[torch.Tensor | None] = list(found) if found is not None else [None] * len(attns)
    done = []
    for a, table in zip(attns, tables):
        if not isinstance(getattr(a, "embed_positions", None), torch.Tensor) and table is not None:
            a.register_buffer("embed_positions", table, persistent=False)
            done.append(f"{type(a).__name__}.embed_positions = the rotary module's table")
        if getattr(a, "scale_attn", None) is None and getattr(a, "scaling", None):
            a.scale_attn = torch.tensor(1.0 / float(a.scaling), dtype=torch.float32)
            if not math.isfinite(float(a.scale_attn)):
                raise RopeError(f"{type(a).__name__}: scaling {a.scaling!r} has no finite inverse")
            done.append(f"{type(a).__name__}.scale_attn = 1 / scaling")
    return sorted(set(done))


def _rotary_returns_other_dtype(hf: Any, dtype: torch.dtype) -> bool:
    """Whether the model's HF rotary module returns cos/sin in another dtype than its input's."""
    from posgen_tl.io.spec import hf_rotary  # noqa: PLC0415

    rotary = hf_rotary(hf)
    if rotary is None:
        return False
    buf = next(rotary.buffers(), None)
    device = buf.device if buf is not None else torch.device("cpu")
    x = torch.zeros(1, 1, dtype=dtype, device=device)
    pos = torch.arange(2, device=device)[None]
    cfg = getattr(hf.config, "text_config", None) or hf.config
    layer_types = sorted(set(getattr(cfg, "layer_types", None) or [])) or [None]
    for lt in layer_types:  # per-layer-type rotary modules (Gemma 3, OLMo-3) take the layer type
        try:
            with torch.no_grad():
                out = rotary(x, pos) if lt is None else rotary(x, pos, lt)
        except (TypeError, KeyError, AttributeError):
            continue
        if isinstance(out, tuple) and isinstance(out[0], torch.Tensor) and out[0].dtype != dtype:
            return True
    return False


def mend_bridge_rotation_dtype(bridge: Any, hf: Any, dtype: torch.dtype) -> list[str]:
    """Permanent hooks rounding ``hook_rot_q``/``hook_rot_k`` to the model's ``dtype`` where the HF rotary
    module returns float32 cos/sin for a half-precision model (what HF's own rotation does).

    Returns one line per mend applied (empty where nothing was needed)."""
    if dtype not in (torch.float16, torch.bfloat16) or not _rotary_returns_other_dtype(hf, dtype):
        return []
    names = [n for n in getattr(bridge, "hook_dict", {}) if n.endswith(("attn.hook_rot_q", "attn.hook_rot_k"))]

    def round_to_model(t: torch.Tensor, hook: Any) -> torch.Tensor:
        return t.to(dtype) if t.dtype != dtype else t

    for n in names:
        bridge.hook_dict[n].add_hook(round_to_model, is_permanent=True)
    return [f"hook_rot_q/hook_rot_k of {len(names) // 2} layers rounded to {str(dtype).removeprefix('torch.')} "
            "(HF's rotary module returns float32 cos/sin; HF rounds the rotated q/k back)"] if names else []
