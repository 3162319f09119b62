"""Hook-based, streaming capture of pre- and post-rotation q/k — the only module that
walks TransformerLens hook names (with :mod:`posgen_tl.hooks.edits` for writing hooks).

Which tensor is "pre-rotation"? The one that enters RoPE: ``hook_q``/``hook_k`` on
plain models, ``hook_q_normed``/``hook_k_normed`` on bridges with QK-norm (Gemma3),
where ``hook_q`` is *before* the norm. A TransformerLens 3.x ``HookedTransformer`` has no
``hook_q_normed``: there it is ``attn.q_norm.hook_normalized`` (flattened, before the norm
weight) times ``attn.q_norm.w`` — the model's own product, so bit-exact. Which names and
layouts each backend uses is stated in :mod:`posgen_tl.compat`; the probe verifies them.
Where ``hook_rot_q``/``hook_rot_k`` do not fire
(TransformerLens-native models, some adapters), the rotation is computed from the
spec; where ``hook_attn_scores`` holds post-softmax weights, that is detected and the
exactness check compares ``softmax(W)`` with it instead (and says so).

This module holds the capture's types, the checks of tokens and position ids, the layouts, and the
probe of what a model's hooks deliver (:func:`probe_hooks`); the streaming capture itself —
:func:`~posgen_tl.hooks.stream.stream_qk`, :func:`~posgen_tl.hooks.stream.capture_qk`, the self-check and the
pattern hooks — is in :mod:`posgen_tl.hooks.stream` (its names stay importable from here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl import compat
from posgen_tl.hooks.aside import others_hooks_set_aside
from posgen_tl.hooks.tables import model_rotation_table, probe_table, table_buffer_source, table_to_bands
from posgen_tl.io.spec import rope_spec
from posgen_tl.maths.rope import (
    LayerRope,
    RopeError,
    RopeSpec,
    attention_pattern,
    causal_mask,
    expand_kv,
    rotate,
    rotate_with_table,
    scores_from_rotated,
)

__all__ = [
    "QKCapture",
    "HookInfo",
    "CaptureError",
    "StopForward",
    "probe_hooks",
    "check_tokens",
    "check_position_ids",
    "refuse_multistream",
    "hooks_attached",
    "model_device",
    "pre_rotation",
    "pre_rotation_stash",
    "stash_shape",
    "to_heads",
    "from_heads",
    "model_rotation_table",
    "require_pre_softmax",
    "run_forward",
    "hook_names",
    "table_to_bands",
]


class CaptureError(RuntimeError):
    """The model's hooks cannot give what was asked (named in the message)."""


class StopForward(Exception):
    """Raised inside a hook to end a forward pass early (nothing after it — e.g. the logits — is computed)."""


@dataclass
class QKCapture:
    """q/k of one layer for one batch. All float32 (cast from the model dtype).

    Attributes:
        q: pre-rotation queries ``[batch, pos, head_index, d_head]``.
        k: pre-rotation keys, kv-groups ``[batch, pos, kv_head, d_head]``.
        rot_q / rot_k: rotated (as from ``hook_rot_q``/``hook_rot_k`` or computed).
        positions: position ids used ``[batch, pos]``.
        scores: the model's ``hook_attn_scores`` if requested ``[batch, head_index, query_pos, key_pos]``.
        rope: this layer's :class:`LayerRope` for these positions (LongRoPE resolved to the short or long
            set, as the model chose it); ``rot_source``: ``"hook"`` or ``"computed"``.
        batch_index: index of this batch in the stream; ``seq_offset``: index of its first sequence.
        table_cos / table_sin: the model's OWN rotation table for these positions, per band
            ``[batch, pos, band]`` (from ``hook_cos``/``hook_sin`` or a rotary buffer), if requested and
            available; ``table_source`` says which, ``table_format_err`` how far the raw table was from the
            layout's duplicated form (0 when it matches).
        pattern: the model's ``hook_pattern`` ``[batch, head_index, query_pos, key_pos]``, if requested.
        layers: the layers of a capture stacked on the head axis (:func:`posgen_tl.hooks.stacking.stack_captures`),
            in the head axis's order; empty for one layer (:attr:`layer_ids` gives both as a tuple).
    """

    layer: int
    q: Float[Tensor, "batch pos head_index d_head"]
    k: Float[Tensor, "batch pos kv_head d_head"]
    rot_q: Float[Tensor, "batch pos head_index d_head"]
    rot_k: Float[Tensor, "batch pos kv_head d_head"]
    positions: Int[Tensor, "batch pos"]
    rope: LayerRope
    rot_source: str
    scores: Float[Tensor, "batch head_index query_pos key_pos"] | None = None
    scores_kind: str = "absent"
    batch_index: int = 0
    seq_offset: int = 0
    table_cos: Float[Tensor, "batch pos band"] | None = None
    table_sin: Float[Tensor, "batch pos band"] | None = None
    table_source: str = "none"
    table_format_err: float = 0.0
    pattern: Float[Tensor, "batch head_index query_pos key_pos"] | None = None
    layers: tuple[int, ...] = ()

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The layers this capture holds: ``layers`` of a stack, else ``(layer,)``."""
        return self.layers or (self.layer,)

    @property
    def n_heads(self) -> int:
        return self.q.shape[-2]

    def k_expanded(self) -> Float[Tensor, "batch pos head_index d_head"]:
        """Pre-rotation keys repeated to query heads (head ``h`` reads group ``h // (H//G)``)."""
        return expand_kv(self.k, self.n_heads)

    def rot_k_expanded(self) -> Float[Tensor, "batch pos head_index d_head"]:
        return expand_kv(self.rot_k, self.n_heads)

    def logits(self) -> Float[Tensor, "batch head_index query_pos key_pos"]:
        """Recomputed pre-softmax logits ``s · rot_q · rot_k`` (unmasked, no soft-cap)."""
        return scores_from_rotated(self.rot_q, self.rot_k, self.rope.score_scale)


@dataclass(frozen=True)
class HookInfo:
    """What a model's hooks deliver (probed once per model with a short forward).

    ``normed_layout`` is the layout of the pre-rotation hooks ``q_hook``/``k_hook``:
    ``"bshd"`` (``[batch, pos, head, d_head]``: ``hook_q``, or a bridge's per-head norm),
    ``"bhsd"`` (a bridge's ``hook_q_normed`` after Gemma3's post-reshape norm), ``"flat"``
    (``[batch, pos, head·d_head]``: OLMo-2 normalises the flattened q/k before splitting heads), or
    ``"flat_prescale"`` (a HookedTransformer's ``q_norm.hook_normalized``: flattened and before
    the norm weight ``norm_weight``). Use :func:`pre_rotation` to read such a tensor.
    ``cos_fires``: ``hook_cos``/``hook_sin`` (the model's own rotation table per forward) fire;
    ``table_source``: where :func:`model_rotation_table` reads the model's table (``"hook_cos/hook_sin"``,
    a buffer name, or ``"none"``). ``clip_qk``: OLMo's ``clip_qkv`` — the model clamps q/k to ``±clip_qk``
    after the hook and before RoPE; :func:`pre_rotation` applies the same clamp.
    """

    q_hook: str  # "hook_q", "hook_q_normed" or "q_norm.hook_normalized"
    k_hook: str
    normed_layout: str  # "bshd", "bhsd" or "flat_prescale"
    rot_fires: bool
    scores_kind: str  # "pre_softmax", "post_softmax", "absent", "unknown"
    attn_prefix: str = "blocks.{layer}.attn."
    backend: str = "other"  # compat.backend(model): "hooked", "bridge", "other"
    scores_masked: bool | None = None  # hook_attn_scores fires after the causal/window mask
    norm_weight: tuple[str, str, str] | None = None  # flat_prescale: (q module, k module, weight attr)
    position_ids: bool = True  # forward(..., position_ids=) is accepted
    cos_fires: bool = False
    table_source: str = "none"
    pattern_fires: bool = False
    clip_qk: float | None = None  # OLMo / OLMoE ``clip_qkv``: q/k are clamped to ±clip after the hook, before RoPE

    def name(self, layer: int, hook: str) -> str:
        return self.attn_prefix.format(layer=layer) + hook


def pre_rotation(
    model: Any, info: HookInfo, layer: int, which: str, x: Tensor, batch: int, pos: int, d_head: int
) -> Float[Tensor, "batch pos head d_head"]:
    """The tensor that enters RoPE, from what ``info.q_hook``/``info.k_hook`` (``which`` = 'q'/'k')
    delivered, as ``[batch, pos, head, d_head]`` in the model's dtype.

    ``flat_prescale`` (HookedTransformer QK-norm): ``hook_normalized.to(w.dtype) * w`` reshaped —
    the same product the model's ``RMSNorm`` computes next, so the result is bit-exact.
    """
    if info.normed_layout == "flat_prescale":
        assert info.norm_weight is not None
        q_mod, k_mod, attr = info.norm_weight
        w = getattr(model.get_submodule(info.name(layer, q_mod if which == "q" else k_mod).rstrip(".")), attr)
        return (x.to(w.dtype) * w).reshape(batch, pos, -1, d_head)
    out = to_heads(x, info.normed_layout, d_head)
    if info.clip_qk is not None:  # HF OLMo: q_proj(h).clamp_(-clip, clip) (OLMoE: after its flat QK-norm)
        out = out.clamp(-info.clip_qk, info.clip_qk)
    return out


_PROBES: weakref.WeakKeyDictionary[Any, tuple[RopeSpec, HookInfo]] = weakref.WeakKeyDictionary()


def model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def hook_names(model: Any) -> set[str]:
    hd = getattr(model, "hook_dict", None)
    if hd is None:
        raise CaptureError(f"{type(model).__name__} exposes no hook_dict: not a TransformerLens model")
    return set(hd.keys())


@contextlib.contextmanager
def hooks_attached(model: Any, fwd_hooks: Sequence[tuple[str, Callable]]) -> Iterator[None]:
    """Attach forward hooks for the duration of the block; removed on every exit path.

    Uses the model's own ``hooks()`` context (TransformerLens 3.x and 4.x), which
    removes exactly the hooks it added, so the user's own hooks stay untouched.
    """
    with model.hooks(fwd_hooks=list(fwd_hooks)):
        yield


def run_forward(model: Any, tokens: Tensor, position_ids: Tensor | None) -> None:
    kwargs: dict[str, Any] = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    try:
        model(tokens, return_type=None, **kwargs)
    except TypeError:
        model(tokens, **kwargs)


def check_position_ids(position_ids: Tensor, batch: int, n_pos: int, model_name: str = "model") -> Tensor:
    """Validate position ids for a ``[batch, n_pos]`` token batch: integer ``[pos]`` or ``[batch, pos]``.

    Raises:
        CaptureError: multi-stream M-RoPE ids ``[3, batch, pos]`` (Qwen2-VL / Qwen3-VL / Qwen3.5 with images or
            video: each section of the head rotates by its own stream) — not supported, named; text-only
            inputs (one stream, which these models spread to every section) are.
        ValueError: any other shape, a length other than the sequence's, or a non-integer dtype."""
    if not isinstance(position_ids, Tensor):
        position_ids = torch.as_tensor(position_ids)
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be integer ids, got dtype {position_ids.dtype}")
    refuse_multistream(position_ids, model_name)
    if position_ids.ndim not in (1, 2) or position_ids.shape[-1] != n_pos or \
            (position_ids.ndim == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(f"position_ids must be [pos={n_pos}] or [batch={batch}, pos={n_pos}], "
                         f"got shape {tuple(position_ids.shape)}")
    return position_ids


def refuse_multistream(position_ids: Any, model_name: str = "model") -> None:
    """Raise :class:`CaptureError` for multi-stream M-RoPE ids ``[3 or 4, batch, pos]`` (see
    :func:`check_position_ids`); any other ids pass."""
    shape = tuple(torch.as_tensor(position_ids).shape)
    if len(shape) == 3 and shape[0] in (3, 4):
        raise CaptureError(
            f"{model_name}: position_ids of shape {shape} are multi-stream M-RoPE ids (one stream "
            "per section of the head: temporal, height, width — Qwen2-VL, Qwen3-VL, Qwen3.5 with images or video); "
            "posgen_tl rotates every band by one stream of ids and does not support them. Text-only inputs pass one "
            "stream ([pos] or [batch, pos]), which these models give to every section"
        )


def check_tokens(model: Any, tokens: Tensor, spec: RopeSpec | None = None) -> Int[Tensor, "batch pos"]:
    """Validate a token batch: integer dtype, 2-D, non-empty, within context and vocab.

    Tokens on another device than the model are moved to it (documented fallback).
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, pos], got shape {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise ValueError("empty token batch: nothing to analyse (is the text empty?)")
    n_ctx = spec.n_ctx if spec is not None else int(getattr(getattr(model, "cfg", None), "n_ctx", 0) or 0)
    if n_ctx and tokens.shape[1] > n_ctx:
        raise ValueError(
            f"sequence length {tokens.shape[1]} exceeds the model's context of {n_ctx} positions"
        )
    if spec is not None and "dynamic_max_len" in spec.extra and tokens.shape[1] > spec.extra["dynamic_max_len"]:
        raise RopeError(
            f"dynamic NTK RoPE changes its frequencies past {spec.extra['dynamic_max_len']} tokens; "
            f"a {tokens.shape[1]}-token sequence would not match a single spec"
        )
    d_vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 0)
    if d_vocab and (int(tokens.max()) >= d_vocab or int(tokens.min()) < 0):
        raise ValueError(f"token ids must lie in [0, {d_vocab}); got range [{int(tokens.min())}, {int(tokens.max())}]")
    mask = compat.implicit_attention_mask(model, tokens)
    if mask is not None and not bool(mask.all()):
        rows = sorted({int(r) for r in (mask == 0).nonzero()[:, 0].tolist()})
        raise ValueError(
            f"sequences {rows[:8]} start with the pad token (id {model.tokenizer.pad_token_id}): this HookedTransformer "
            "(tokenizer padding_side='left') would mask those leading tokens and shift every later position, so "
            "positions would not be 0..n-1; pass unpadded, equal-length sequences (e.g. corpus_tokens) or set "
            "model.tokenizer.padding_side = 'right'"
        )
    return tokens.to(model_device(model))


def _to_bshd(x: Tensor, layout: str) -> Tensor:
    return x.transpose(1, 2) if layout == "bhsd" else x


def to_heads(x: Tensor, layout: str, d_head: int) -> Float[Tensor, "batch pos head d_head"]:
    """A pre-rotation hook's tensor in ``layout`` (:attr:`HookInfo.normed_layout`: ``bshd``, ``bhsd`` or
    ``flat`` = ``[batch, pos, head·d_head]``) as ``[batch, pos, head, d_head]`` (a view where possible).

    Raises:
        CaptureError: ``flat_prescale`` (its values need the norm weight: use :func:`pre_rotation`)."""
    if layout == "flat":
        return x.reshape(x.shape[0], x.shape[1], -1, d_head)
    if layout == "flat_prescale":
        raise CaptureError("a flat_prescale hook holds values before the norm weight: use pre_rotation()")
    return _to_bshd(x, layout)


def from_heads(y: Tensor, layout: str, like: Tensor) -> Tensor:
    """Inverse of :func:`to_heads`: ``[batch, pos, head, d_head]`` back to the hook's own layout and
    shape (that of ``like``)."""
    if layout == "flat":
        return y.reshape(like.shape)
    return _to_bshd(y, layout)


def stash_shape(x: Tensor, hook: Any, *, stash: dict) -> None:
    """On ``hook_q``/``hook_k`` (``[batch, pos, head, d]``): remember ``(batch, pos)`` for a flattened norm hook."""
    stash["shape"] = (x.shape[0], x.shape[1])


def pre_rotation_stash(model: Any, info: HookInfo, layer: int, d_head: int, stash: dict) -> list[tuple[str, Callable]]:
    """Forward hooks that put ``layer``'s pre-rotation queries and keys, exactly as the model's RoPE
    receives them (:func:`pre_rotation`: every hook layout, the flat QK-norm weight, OLMo's clamp), into
    ``stash['q']`` / ``stash['k']`` as float32 ``[batch, pos, head, d_head]``.

    Returns ``[(hook_name, fn), ...]`` (the hooks return nothing: the forward is unchanged)."""

    def keep(x: Tensor, hook: Any, key: str) -> None:
        b, s = stash.get("shape", (x.shape[0], x.shape[1]))  # (batch, pos) from hook_q on a flattened norm hook
        stash[key] = pre_rotation(model, info, layer, key, x, b, s, d_head).float()

    out: list[tuple[str, Callable]] = []
    if info.normed_layout == "flat_prescale":
        out.append((info.name(layer, "hook_q"), functools.partial(stash_shape, stash=stash)))
    for key, h in (("q", info.q_hook), ("k", info.k_hook)):
        out.append((info.name(layer, h), functools.partial(keep, key=key)))
    return out


def model_dtype(model: Any) -> torch.dtype:
    """The model's parameter dtype (float32 when it has none)."""
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError, TypeError):
        return torch.float32


def masked_threshold(dtype: torch.dtype) -> float:
    """A score at or below this is a masked entry of a model in ``dtype``: masks write ``-inf`` or the
    dtype's most negative value (``-3.4e38`` in float32 / bfloat16, ``-65504`` in float16)."""
    return float(torch.finfo(dtype).min) / 2 if dtype.is_floating_point else -1e30


def _probe_tokens(model: Any, spec: RopeSpec) -> Tensor:
    """The probe's ``[1, n]`` tokens: ``max(6, window + 2)`` when a layer has a sliding window of ≤ 30 (so the
    window masks something), never a length equal to a head count, no pad token."""
    d_vocab = int(getattr(model.cfg, "d_vocab", 0) or 32)
    windows = [lr.sliding_window for lr in spec.layers if lr.sliding_window]
    n_probe = max(6, min(min(windows) + 2, 32)) if windows else 6  # the window masks something
    while n_probe in (spec.n_heads, spec.n_kv_heads):  # [b, head, pos, d] and [b, pos, head, d] must differ
        n_probe += 1
    toks = torch.arange(n_probe) % max(d_vocab - 1, 1) + 1
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if pad is not None:  # a HookedTransformer may mask leading pad tokens by itself (compat.implicit_attention_mask)
        toks = torch.where(toks == pad, (pad + 1) % max(d_vocab, 2), toks)
    return toks[None].to(model_device(model))


def _probe_forward(model: Any, spec: RopeSpec, layers: Sequence[int], wanted: Sequence[str], pre: str,
                   toks: Tensor) -> dict[tuple[int, str], Tensor]:
    """One forward on ``toks`` recording every hook of ``wanted`` that fires on ``layers``: ``{(layer, hook): float32}``.

    Raises:
        CaptureError: the model's own forward fails on the probe."""
    names = hook_names(model)
    got: dict[tuple[int, str], Tensor] = {}

    def save(t: Tensor, hook: Any, key: tuple[int, str]) -> None:
        got[key] = t.detach().float().clone()

    fwd = [(pre.format(layer=layer) + h, lambda t, hook, key=(layer, h): save(t, hook, key))
           for layer in layers for h in wanted if pre.format(layer=layer) + h in names]
    with torch.no_grad(), others_hooks_set_aside(model), hooks_attached(model, fwd):  # the model's, not a caller's edit
        try:
            run_forward(model, toks, None)
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError) as e:
            dt = str(model_dtype(model)).replace("torch.", "")
            raise CaptureError(
                f"{spec.model_name}: the model's own forward pass fails on a {toks.shape[1]}-token probe in {dt} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); nothing can be "
                f"captured from {spec.extra.get('architecture', type(model).__name__)} here"
            ) from e
    return got


def _normed_layout(spec: RopeSpec, conv: Any, qn: Tensor, kn: Tensor, q_hook: str, n_probe: int) -> str:
    """The layout of the QK-normed hooks: the convention's ``flat_prescale``, or read from the probe's shapes
    (``bhsd``: the bridge's documented ``[b, head, pos, d]``, Gemma3; ``bshd``; ``flat``: OLMo-2's norm over the
    flattened heads).

    Raises:
        CaptureError: a shape that is none of these."""
    if conv.normed_layout == "flat_prescale":
        return "flat_prescale"
    if qn.ndim == 4 and qn.shape[1] == spec.n_heads and qn.shape[2] == n_probe:
        return "bhsd"
    if qn.ndim == 4 and qn.shape[1] == n_probe and qn.shape[2] == spec.n_heads:
        return "bshd"
    if qn.ndim == 3 and qn.shape[-1] == spec.n_heads * spec.d_head and kn.shape[-1] == spec.n_kv_heads * spec.d_head:
        return "flat"  # OLMo-2: QK-norm over the flattened heads, [b, pos, head·d_head]
    raise CaptureError(
        f"{spec.model_name}: {q_hook} has shape {tuple(qn.shape)}, which is none of [batch, head, pos, "
        f"d_head], [batch, pos, head, d_head] or [batch, pos, head·d_head] for {spec.n_heads} heads of "
        f"{spec.d_head} dims at {n_probe} positions; cannot read the pre-rotation queries"
    )


def _check_rotation(model: Any, spec: RopeSpec, info: HookInfo, got: dict, layer: int, pos: Tensor,
                    q: Tensor, tol: float) -> None:
    """Our rotation of the probe's pre-rotation queries against the model's ``hook_rot_q`` (where it fires) and
    its own rotation table. Raises RopeError naming the difference."""
    lr = spec.layer(layer).for_positions(pos)
    rq = rotate(q, pos, lr)
    ref = rq.abs().max().item() + 1e-12
    if info.rot_fires:
        err = (rq - got[(layer, "hook_rot_q")]).abs().max().item()
        if err > tol * ref:
            raise RopeError(
                f"{spec.model_name}: our RoPE (from {spec.source}) differs from the model's layer-{layer} "
                f"hook_rot_q by {err:.3g} (max |rot_q| {ref:.3g}); the RoPE variant is not understood"
            )
    table = probe_table(model, info, got, layer, pos, lr)
    if table is not None:
        cb, sb, ferr = table
        err = (rotate_with_table(q, cb, sb, lr) - rq).abs().max().item()
        if err > tol * ref or ferr > tol * max(1.0, lr.attention_scaling):
            raise RopeError(
                f"{spec.model_name}: our RoPE (from {spec.source}) differs from the model's own layer-{layer} "
                f"rotation table ({info.table_source}) by {max(err / ref, ferr):.3g} (relative; layout "
                f"{lr.layout!r}); the RoPE variant is not understood"
            )


def _scores_kind(spec: RopeSpec, lr: Any, s: Tensor, rq: Tensor, rk: Tensor, layer: int, dtype: torch.dtype,
                 tol: float) -> tuple[str, bool | None]:
    """What ``hook_attn_scores`` holds on one probed layer: ``("pre_softmax", masked)`` when our logits
    (soft-capped) equal it on the entries the layer's mask leaves visible — ``masked``: every hidden entry is
    already −inf (or the dtype's most negative value) —, ``("post_softmax", masked)`` when our pattern (sinks
    included) does — ``masked``: hidden entries are 0 —, else ``("unknown", None)``."""
    n_probe = rq.shape[1]
    w = scores_from_rotated(rq, rk, lr.score_scale)
    cap = spec.extra.get("attn_logit_softcapping")
    if cap:
        w = torch.tanh(w / cap) * cap
    m = causal_mask(n_probe, sliding_window=lr.sliding_window, device=w.device)
    scale = w[..., m].abs().max().item() + 1e-12
    if (w - s)[..., m].abs().max().item() <= tol * scale:
        return "pre_softmax", bool((s[..., ~m] <= masked_threshold(dtype)).all()) if bool((~m).any()) else None
    p = attention_pattern(w, m, (spec.extra.get("attention_sinks") or {}).get(layer))
    kind = "post_softmax" if (p - s)[..., m].abs().max().item() < tol else "unknown"
    return kind, bool((s[..., ~m] == 0).all()) if kind == "post_softmax" else None


def probe_hooks(model: Any, *, refresh: bool = False) -> tuple[RopeSpec, HookInfo]:
    """Find which hooks fire and what they hold; verify our rotation against the model.

    One short forward pass (``max(6, window + 2)`` tokens when a layer has a sliding window of
    ≤ 30, so that the window masks something; never a length equal to a head count). On the first
    and last layer: our rotation is compared with ``hook_rot_q/k`` (if they fire) and with the model's
    own rotation table (``hook_cos``/``hook_sin`` or a rotary buffer); ``hook_attn_scores`` is
    classified as pre-softmax (our logits, soft-capped, equal it on the entries the layer's mask —
    causal and sliding window — leaves visible) or post-softmax (our pattern, sinks included, equals
    it), and whether the mask was applied before the hook.

    Returns ``(spec, info)`` and caches it per model object. The probe's forward runs with a caller's temporary hooks
    set aside, permanent ones kept (:func:`~posgen_tl.hooks.aside.others_hooks_set_aside`): the answer describes the
    model as loaded, whoever asks first.

    Raises:
        RopeError: non-RoPE model, or our rotation disagrees with the model's.
        CaptureError: ``hook_q``/``hook_k`` do not fire, or q/k hooks of an unknown shape.
    """
    if not refresh and model in _PROBES:
        return _PROBES[model]
    spec = rope_spec(model)
    conv = compat.conventions(model)
    pre = "blocks.{layer}.attn."
    if not any(n.startswith("blocks.0.attn.hook_q") for n in hook_names(model)):
        raise CaptureError(f"{spec.model_name}: no blocks.0.attn.hook_q hook point")
    probe_layers = sorted({0, spec.n_layers - 1})
    wanted = [conv.q_pre, conv.k_pre, conv.q_normed, conv.k_normed, "hook_rot_q", "hook_rot_k", "hook_attn_scores",
              "hook_cos", "hook_sin", "hook_pattern"]
    toks = _probe_tokens(model, spec)
    n_probe = toks.shape[1]
    got = _probe_forward(model, spec, probe_layers, wanted, pre, toks)
    layer = probe_layers[-1]
    if (layer, conv.q_pre) not in got or (layer, conv.k_pre) not in got:
        raise CaptureError(
            f"{spec.model_name}: {conv.q_pre}/{conv.k_pre} do not fire on this model; posgen_tl cannot read q/k here"
        )
    use_norm = (layer, conv.q_normed) in got and (layer, conv.k_normed) in got
    q_hook, k_hook = (conv.q_normed, conv.k_normed) if use_norm else (conv.q_pre, conv.k_pre)
    normed_layout = _normed_layout(spec, conv, got[(layer, q_hook)], got[(layer, k_hook)], q_hook, n_probe) \
        if use_norm else "bshd"
    rot_fires = (layer, "hook_rot_q") in got and (layer, "hook_rot_k") in got
    cos_fires = (layer, "hook_cos") in got and (layer, "hook_sin") in got
    if conv.rot_always_fires and not rot_fires:
        raise CaptureError(f"{spec.model_name}: hook_rot_q/hook_rot_k did not fire on a {conv.backend} model")
    dtype = model_dtype(model)
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0  # a bf16/fp16 model rounds to its precision
    tol = max(1e-4, 16 * eps)
    info = HookInfo(
        q_hook, k_hook, normed_layout, rot_fires, "absent", pre, backend=conv.backend,
        norm_weight=conv.norm_weight if normed_layout == "flat_prescale" else None, position_ids=conv.position_ids,
        cos_fires=cos_fires, table_source="hook_cos/hook_sin" if cos_fires else table_buffer_source(model),
        pattern_fires=(layer, "hook_pattern") in got,
        clip_qk=_clip_qk(spec, normed_layout),
    )
    pos = torch.arange(n_probe, device=toks.device)[None]
    scores_kind, scores_masked = "absent", None
    for layer in probe_layers:  # first and last layer: Gemma3's local and global kinds both checked
        q = pre_rotation(model, info, layer, "q", got[(layer, q_hook)], 1, n_probe, spec.d_head).float()
        k = pre_rotation(model, info, layer, "k", got[(layer, k_hook)], 1, n_probe, spec.d_head).float()
        _check_rotation(model, spec, info, got, layer, pos, q, tol)
        if (layer, "hook_attn_scores") not in got:
            continue
        lr = spec.layer(layer).for_positions(pos)
        rq, rk = (got[(layer, "hook_rot_q")], got[(layer, "hook_rot_k")]) if rot_fires else (rotate(q, pos, lr), rotate(k, pos, lr))
        kind, masked = _scores_kind(spec, lr, got[(layer, "hook_attn_scores")], rq, rk, layer, dtype, tol)
        scores_kind = kind if scores_kind in ("absent", kind) else "unknown"
        if masked is not None:
            scores_masked = masked if scores_masked is None else (scores_masked and masked)
    info = dataclasses.replace(info, scores_kind=scores_kind, scores_masked=scores_masked)
    _PROBES[model] = (spec, info)
    return spec, info


def require_pre_softmax(model: Any, what: str) -> tuple[RopeSpec, HookInfo]:
    """``probe_hooks(model)``, after checking that ``hook_attn_scores`` holds pre-softmax logits (``what``
    needs to rewrite them).

    Raises:
        CaptureError: the scores are post-softmax, unknown or absent (the message names ``what``)."""
    spec, info = probe_hooks(model)
    if info.scores_kind != "pre_softmax":
        raise CaptureError(f"{spec.model_name}: hook_attn_scores holds {info.scores_kind!r} values, not pre-softmax "
                           f"logits; {what} is impossible on this model")
    return spec, info


def _clip_qk(spec: RopeSpec, normed_layout: str) -> float | None:
    """OLMo's ``clip_qkv`` applies to the tensor our q/k hook reads (plain ``hook_q`` or a flat QK-norm);
    with a per-head QK-norm the order is not known and the model is refused."""
    clip = spec.extra.get("clip_qkv")
    if clip is None:
        return None
    if normed_layout not in ("bshd", "flat"):
        raise CaptureError(
            f"{spec.model_name}: clip_qkv together with a per-head QK-norm ({normed_layout}) is not supported: "
            "the order of clamp and norm is unknown"
        )
    return float(clip)


#: names that live in :mod:`posgen_tl.hooks.stream` and stay importable from here
_STREAM = ("capture_from_cache", "capture_qk", "pattern_hooks", "release_freed_memory", "rotation_tolerance",
           "self_check", "stream_qk", "ROT_RTOL")


def __getattr__(name: str) -> Any:
    if name in _STREAM:
        from posgen_tl.hooks import stream  # noqa: PLC0415 — imported on first use: stream imports this module

        return getattr(stream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
