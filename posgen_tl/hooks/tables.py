"""The model's OWN rotation tables: read from ``hook_cos``/``hook_sin`` or a rotary buffer, as per-band
``(cos, sin)`` — what :func:`posgen_tl.hooks.capture.probe_hooks` and the streamed capture compare our
rotation with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.maths.rope import LayerRope, RopeError

if TYPE_CHECKING:
    from posgen_tl.hooks.capture import HookInfo

__all__ = ["table_to_bands", "table_buffer_source", "model_rotation_table", "probe_table"]


def table_to_bands(cos: Tensor, sin: Tensor, lr: LayerRope) -> tuple[Tensor, Tensor, float]:
    """A model's rotation table ``[..., pos, w]`` as per-band ``[..., pos, band]``, and how far the raw
    table is from a duplicated form (``w`` = 2·bands: halves ``cat(f, f)`` — Llama, and GLM, which then
    pairs adjacent dims — or interleaved ``repeat_interleave(f, 2)``, Cohere; ``w`` = bands: a
    half-width table, GPT-OSS). The table's form is read from the table, the pairing is ``lr.layout``."""
    n, w = lr.n_bands, cos.shape[-1]
    if w == n:
        return cos, sin, 0.0
    if w != 2 * n:
        raise RopeError(f"the model's rotation table has width {w} for a {n}-band rope (rotary dim {lr.rotary_dim})")
    forms = []
    for first, second in ((slice(0, n), slice(n, None)), (slice(0, None, 2), slice(1, None, 2))):
        cb, sb = cos[..., first], sin[..., first]
        err = max((cos[..., second] - cb).abs().max().item(), (sin[..., second] - sb).abs().max().item())
        forms.append((err, cb, sb))
    err, cb, sb = min(forms, key=lambda f: f[0])
    return cb, sb, err


def table_buffer_source(model: Any) -> str:
    """Where the model keeps a fixed rotation table we can index by position (when ``hook_cos`` does not
    fire): ``"embed_positions"`` (HF GPT-J/CodeGen: ``cat(sin, cos)``, per attention module or on the rotary
    module),
    ``"rotary.cos_cached"`` (a TransformerLens-native bridge), else ``"none"``."""
    inner = getattr(model, "original_model", None)
    if inner is None:
        return "none"
    if getattr(getattr(inner, "rotary", None), "cos_cached", None) is not None:
        return "rotary.cos_cached"
    if hasattr(inner, "config") and hasattr(inner, "named_modules"):
        from posgen_tl.io.spec import sincos_tables  # noqa: PLC0415

        try:
            tables = sincos_tables(inner)
        except RopeError:
            return "none"
        if tables:
            return "embed_positions"
    return "none"


def model_rotation_table(
    model: Any, info: HookInfo, layer: int, positions: Int[Tensor, "batch pos"], lr: LayerRope
) -> tuple[Float[Tensor, "batch pos band"], Float[Tensor, "batch pos band"], float] | None:
    """The model's OWN per-band ``(cos, sin)`` for ``positions`` from a rotary buffer (``info.table_source``
    ``"embed_positions"`` or ``"rotary.cos_cached"``), with the table's format error; ``None`` where the
    model keeps no such buffer (``hook_cos``/``hook_sin`` are read during the forward pass instead)."""
    src = info.table_source
    inner: Any = getattr(model, "original_model", None)
    if src == "embed_positions":
        from posgen_tl.io.spec import sincos_tables  # noqa: PLC0415

        tables = sincos_tables(inner)
        if tables is None:
            raise RopeError(f"{type(inner).__name__}: the embed_positions sin/cos table has disappeared")
        table = tables[layer].detach().float()
        t = table[positions.to(table.device).long()]  # [batch, pos, r] = cat(sin, cos)
        half = t.shape[-1] // 2
        sin, cos = t[..., :half], t[..., half:]
        if half != lr.n_bands:
            raise RopeError(f"GPT-J sin/cos table of {half} bands for a {lr.n_bands}-band rope")
        return cos.to(positions.device), sin.to(positions.device), 0.0
    if src == "rotary.cos_cached":
        rot = inner.rotary
        idx = positions.to(rot.cos_cached.device).long()
        cos, sin = rot.cos_cached[idx].float(), rot.sin_cached[idx].float()
        cb, sb, err = table_to_bands(cos, sin, lr)
        return cb.to(positions.device), sb.to(positions.device), err
    return None


def probe_table(model: Any, info: HookInfo, got: dict, layer: int, pos: Tensor, lr: LayerRope):
    """The model's per-band table for the probe's positions (hooks or buffer), or ``None`` (also on a
    layer without RoPE, whose ``hook_cos`` still carries the table the other layers use)."""
    if lr.kind == "nope":
        return None
    if info.cos_fires:
        cos, sin = got[(layer, "hook_cos")], got[(layer, "hook_sin")]
        cos = cos.expand(pos.shape[0], *cos.shape[-2:]) if cos.ndim == 3 else cos.expand(pos.shape[0], *cos.shape)
        sin = sin.expand(pos.shape[0], *sin.shape[-2:]) if sin.ndim == 3 else sin.expand(pos.shape[0], *sin.shape)
        return table_to_bands(cos, sin, lr)
    return model_rotation_table(model, info, layer, pos, lr)
