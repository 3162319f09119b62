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

Memory: :func:`stream_qk` calls your function for one (batch, layer) at a time while the
forward pass runs, so nothing beyond one layer of one batch is held; the forward pass
stops right after the last layer it needs (no logits are computed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl import compat
from posgen_tl.maths.rope import LayerRope, RopeError, RopeSpec, expand_kv, rotate, scores_from_rotated
from posgen_tl.io.spec import rope_spec

__all__ = [
    "QKCapture",
    "HookInfo",
    "CaptureError",
    "StopForward",
    "probe_hooks",
    "stream_qk",
    "capture_qk",
    "capture_from_cache",
    "check_tokens",
    "hooks_attached",
    "model_device",
    "pre_rotation",
    "pattern_hooks",
    "require_pre_softmax",
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
        rope: this layer's :class:`LayerRope`; ``rot_source``: ``"hook"`` or ``"computed"``.
        batch_index: index of this batch in the stream; ``seq_offset``: index of its first sequence.
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
    ``"bhsd"`` (a bridge's ``hook_q_normed`` after Gemma3's post-reshape norm), or
    ``"flat_prescale"`` (a HookedTransformer's ``q_norm.hook_normalized``: flattened and before
    the norm weight ``norm_weight``). Use :func:`pre_rotation` to read such a tensor.
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
    return _to_bshd(x, info.normed_layout)


_PROBES: "weakref.WeakKeyDictionary[Any, tuple[RopeSpec, HookInfo]]" = weakref.WeakKeyDictionary()


def model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _hook_names(model: Any) -> set[str]:
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


def _forward(model: Any, tokens: Tensor, position_ids: Tensor | None) -> None:
    kwargs: dict[str, Any] = {}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    try:
        model(tokens, return_type=None, **kwargs)
    except TypeError:
        model(tokens, **kwargs)


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


def probe_hooks(model: Any, *, refresh: bool = False) -> tuple[RopeSpec, HookInfo]:
    """Find which hooks fire and what they hold; verify our rotation against the model.

    Returns ``(spec, info)`` and caches it per model object.

    Raises:
        RopeError: non-RoPE model, or our rotation disagrees with ``hook_rot_q``.
        CaptureError: ``hook_q``/``hook_k`` do not fire.
    """
    if not refresh and model in _PROBES:
        return _PROBES[model]
    spec = rope_spec(model)
    names = _hook_names(model)
    conv = compat.conventions(model)
    pre = "blocks.{layer}.attn."
    if not any(n.startswith("blocks.0.attn.hook_q") for n in names):
        raise CaptureError(f"{spec.model_name}: no blocks.0.attn.hook_q hook point")
    probe_layers = sorted({0, spec.n_layers - 1})
    wanted = [conv.q_pre, conv.k_pre, conv.q_normed, conv.k_normed, "hook_rot_q", "hook_rot_k", "hook_attn_scores"]
    got: dict[tuple[int, str], Tensor] = {}

    def save(t: Tensor, hook: Any, key: tuple[int, str]) -> None:
        got[key] = t.detach().float().clone()

    fwd = []
    for layer in probe_layers:
        for h in wanted:
            nm = pre.format(layer=layer) + h
            if nm in names:
                fwd.append((nm, lambda t, hook, key=(layer, h): save(t, hook, key)))
    d_vocab = int(getattr(model.cfg, "d_vocab", 0) or 32)
    n_probe = 6  # a length no head count equals, so [b, head, pos, d] and [b, pos, head, d] differ
    while n_probe in (spec.n_heads, spec.n_kv_heads):
        n_probe += 1
    toks = torch.arange(n_probe) % max(d_vocab - 1, 1) + 1
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if pad is not None:  # a HookedTransformer may mask leading pad tokens by itself (compat.implicit_attention_mask)
        toks = torch.where(toks == pad, (pad + 1) % max(d_vocab, 2), toks)
    toks = toks[None].to(model_device(model))
    with torch.no_grad(), hooks_attached(model, fwd):
        _forward(model, toks, None)
    layer = probe_layers[-1]
    if (layer, conv.q_pre) not in got or (layer, conv.k_pre) not in got:
        raise CaptureError(
            f"{spec.model_name}: {conv.q_pre}/{conv.k_pre} do not fire on this model; posgen_tl cannot read q/k here"
        )
    use_norm = (layer, conv.q_normed) in got and (layer, conv.k_normed) in got
    q_hook, k_hook = (conv.q_normed, conv.k_normed) if use_norm else (conv.q_pre, conv.k_pre)
    normed_layout = "bshd"
    if use_norm and conv.normed_layout == "flat_prescale":
        normed_layout = "flat_prescale"
    elif use_norm:  # the bridge's documented [b, head, pos, d] (Gemma3), verified on the probe's shape
        qn = got[(layer, q_hook)]
        normed_layout = "bhsd" if qn.ndim == 4 and qn.shape[1] == spec.n_heads and qn.shape[2] == n_probe else "bshd"
    rot_fires = (layer, "hook_rot_q") in got and (layer, "hook_rot_k") in got
    if conv.rot_always_fires and not rot_fires:
        raise CaptureError(f"{spec.model_name}: hook_rot_q/hook_rot_k did not fire on a {conv.backend} model")
    try:  # a bf16/fp16 model rounds its own rotation and scores to its precision
        eps = torch.finfo(next(model.parameters()).dtype).eps
    except (StopIteration, AttributeError, TypeError):
        eps = 0.0
    info = HookInfo(
        q_hook, k_hook, normed_layout, rot_fires, "absent", pre, backend=conv.backend,
        norm_weight=conv.norm_weight if normed_layout == "flat_prescale" else None, position_ids=conv.position_ids,
    )
    pos = torch.arange(n_probe, device=toks.device)[None]
    for layer in probe_layers:  # first and last layer: Gemma3's local and global kinds both checked
        lr = spec.layer(layer)
        q = pre_rotation(model, info, layer, "q", got[(layer, q_hook)], 1, n_probe, spec.d_head).float()
        k = pre_rotation(model, info, layer, "k", got[(layer, k_hook)], 1, n_probe, spec.d_head).float()
        rq, rk = rotate(q, pos, lr), rotate(k, pos, lr)
        if rot_fires:
            err = (rq - got[(layer, "hook_rot_q")]).abs().max().item()
            ref = got[(layer, "hook_rot_q")].abs().max().item() + 1e-12
            if err > max(1e-4, 16 * eps) * ref:
                raise RopeError(
                    f"{spec.model_name}: our RoPE (from {spec.source}) differs from the model's layer-{layer} "
                    f"hook_rot_q by {err:.3g} (max |rot_q| {ref:.3g}); the RoPE variant is not understood"
                )
            rq, rk = got[(layer, "hook_rot_q")], got[(layer, "hook_rot_k")]
    scores_kind, scores_masked = "absent", None
    if (layer, "hook_attn_scores") in got:
        s = got[(layer, "hook_attn_scores")]
        w = scores_from_rotated(rq, rk, lr.score_scale)
        cap = spec.extra.get("attn_logit_softcapping")
        if cap:
            w = torch.tanh(w / cap) * cap
        tri = torch.ones(n_probe, n_probe, dtype=torch.bool, device=w.device).tril()
        scale = w[..., tri].abs().max().item() + 1e-12
        if (w - s)[..., tri].abs().max().item() <= max(1e-4, 16 * eps) * scale:
            scores_kind = "pre_softmax"
            # after the mask: every future entry is -inf (or the dtype's most negative value)
            scores_masked = bool((s[..., ~tri] <= -1e30).all() or torch.isneginf(s[..., ~tri]).all())
        else:
            p = torch.softmax(w.masked_fill(~tri, float("-inf")), dim=-1)
            scores_kind = "post_softmax" if (p - s)[..., tri].abs().max().item() < max(1e-4, 16 * eps) else "unknown"
            scores_masked = bool((s[..., ~tri] == 0).all()) if scores_kind == "post_softmax" else None
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


def _batches(tokens: Tensor, batch_size: int) -> Iterable[tuple[int, Tensor]]:
    for i in range(0, tokens.shape[0], batch_size):
        yield i, tokens[i : i + batch_size]


def stream_qk(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    fn: Callable[[QKCapture], None],
    layers: Sequence[int] | None = None,
    *,
    with_scores: bool = False,
    batch_size: int = 8,
    position_ids: Int[Tensor, "batch pos"] | Int[Tensor, "pos"] | None = None,
    extra_hooks: Sequence[tuple[str, Callable]] = (),
    progress: bool | str = True,
) -> None:
    """Run the model over ``tokens`` in batches and call ``fn(QKCapture)`` per (batch, layer).

    ``fn`` runs inside the forward pass, right after the layer's q/k (and scores) are
    available; the capture is dropped afterwards, so memory is one layer of one batch.
    The pass stops after the last requested layer. ``extra_hooks`` (e.g. an
    intervention from :mod:`posgen_tl.hooks.edits`) are attached for the same passes;
    captured q/k then show their effect.

    Hooks are removed when this returns or raises (KeyboardInterrupt included).
    """
    spec, info = probe_hooks(model)
    tokens = check_tokens(model, tokens, spec)
    layers = list(range(spec.n_layers)) if layers is None else sorted({int(x) % spec.n_layers for x in layers})
    if not layers:
        raise ValueError("no layers selected")
    if with_scores and info.scores_kind == "absent":
        raise CaptureError(f"{spec.model_name}: hook_attn_scores does not fire; scores are unavailable")
    if position_ids is not None and not info.position_ids:
        raise CaptureError(
            f"{spec.model_name}: a {info.backend} model's forward takes no position_ids (TransformerLens 3.x "
            "HookedTransformer); run with posgen_tl.hooks.edits.reposition_hooks(model, position_ids) "
            "as extra_hooks instead"
        )
    need = [info.q_hook, info.k_hook]
    if info.rot_fires:
        need += ["hook_rot_q", "hook_rot_k"]
    if with_scores:
        need.append("hook_attn_scores")
    last_layer = layers[-1]
    n_batches = math.ceil(tokens.shape[0] / batch_size)
    desc = progress if isinstance(progress, str) else "capture"
    bar = tqdm(total=n_batches, desc=desc, disable=not progress, leave=False)
    try:
        for b_idx, (offset, batch) in enumerate(_batches(tokens, batch_size)):
            if position_ids is None:
                pos = torch.arange(batch.shape[1], device=batch.device).expand(batch.shape[0], -1)
                pos_arg = None
            else:
                pid = position_ids.to(batch.device)
                pos = pid.expand(batch.shape[0], -1) if pid.ndim == 1 else pid[offset : offset + batch.shape[0]]
                pos_arg = pos
            store: dict[int, dict[str, Tensor]] = {}

            def grab(t: Tensor, hook: Any, layer: int, h: str, pos=pos, b_idx=b_idx, offset=offset) -> None:
                d = store.setdefault(layer, {})
                x = t.detach()
                if h in (info.q_hook, info.k_hook):
                    x = pre_rotation(model, info, layer, "q" if h == info.q_hook else "k", x,
                                     pos.shape[0], pos.shape[1], spec.d_head)
                x = x.float()
                if h != "hook_attn_scores" and not bool(torch.isfinite(x).all()):
                    bad = int((~torch.isfinite(x)).sum())
                    raise CaptureError(
                        f"{spec.model_name}: {bad} non-finite value(s) (NaN/inf) in blocks.{layer}.attn.{h} "
                        f"(batch {b_idx}); the model's activations overflowed or the weights are corrupted — "
                        "refusing to compute statistics from them"
                    )
                d[h] = x
                if len(d) == len(need):
                    cap = _make_capture(layer, d, spec.layer(layer), info, pos, b_idx, offset)
                    del store[layer]
                    fn(cap)
                    if layer == last_layer:
                        raise StopForward

            fwd = list(extra_hooks)
            for layer in layers:
                for h in need:
                    fwd.append((info.name(layer, h), lambda t, hook, layer=layer, h=h: grab(t, hook, layer, h)))
            with torch.no_grad(), hooks_attached(model, fwd):
                try:
                    _forward(model, batch, pos_arg)
                except StopForward:
                    pass
            if store:
                raise CaptureError(
                    f"{spec.model_name}: hooks {sorted(next(iter(store.values())).keys())} fired but not all of {need}"
                )
            bar.update(1)
            release_freed_memory()
    finally:
        bar.close()


_LIBC: Any = None


def release_freed_memory() -> bool:
    """Return freed heap pages to the operating system (glibc's ``malloc_trim(0)``); ``True`` if it ran.

    Called by :func:`stream_qk` after each batch. glibc keeps freed mid-sized blocks (below its
    32 MiB ``mmap`` threshold) resident, and the holes between long-lived small objects are not
    reused by later requests of other sizes, so a streaming run's resident memory otherwise grows
    with the number of batches (measured: 625 → 1 317 MiB from 4 to 32 sequences of 512 tokens).
    A no-op (``False``) where there is no glibc (macOS, Windows, musl)."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes  # noqa: PLC0415

            lib = ctypes.CDLL("libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


def _make_capture(layer, d, lr, info, pos, b_idx, offset) -> QKCapture:
    q, k = d[info.q_hook], d[info.k_hook]
    if info.rot_fires:
        rq, rk, src = d["hook_rot_q"], d["hook_rot_k"], "hook"
    else:
        rq, rk, src = rotate(q, pos, lr), rotate(k, pos, lr), "computed"
    scores = d.get("hook_attn_scores")
    return QKCapture(
        layer=layer, q=q, k=k, rot_q=rq, rot_k=rk, positions=pos, rope=lr, rot_source=src,
        scores=scores, scores_kind=info.scores_kind if scores is not None else "absent",
        batch_index=b_idx, seq_offset=offset,
    )


def capture_qk(
    model: Any,
    tokens: Int[Tensor, "batch pos"],
    layers: Sequence[int] | None = None,
    *,
    with_scores: bool = False,
    position_ids: Tensor | None = None,
) -> dict[int, QKCapture]:
    """Capture q/k of ``layers`` for one (small) batch, held in memory: ``{layer: QKCapture}``.

    For long runs use :func:`stream_qk`, which never holds more than one layer.
    """
    out: dict[int, QKCapture] = {}
    tokens = tokens[None] if tokens.ndim == 1 else tokens

    def keep(c: QKCapture) -> None:
        out[c.layer] = c

    stream_qk(model, tokens, keep, layers, with_scores=with_scores, batch_size=max(1, tokens.shape[0]),
              position_ids=position_ids, progress=False)
    return out


def capture_from_cache(model: Any, cache: Any, layer: int) -> QKCapture:
    """The :class:`QKCapture` of ``layer`` read from a TransformerLens ``ActivationCache``
    (``model.run_with_cache(tokens)``), without running the model again.

    The cache must hold the layer's pre-rotation q/k hooks (``hook_q``/``hook_k``, or the
    ``*_normed`` ones on QK-norm models); ``hook_rot_q``/``hook_rot_k`` are used when present,
    otherwise the rotation is computed from the spec. Positions are ``0..pos−1``.

    Raises:
        CaptureError: the cache lacks the hooks (the message names them).
    """
    spec, info = probe_hooks(model)
    layer = int(layer) % spec.n_layers
    need = [info.q_hook, info.k_hook] + (["hook_rot_q", "hook_rot_k"] if info.rot_fires else [])
    keys = set(cache.keys()) if hasattr(cache, "keys") else set()
    d: dict[str, Tensor] = {}
    for h in need:
        name = info.name(layer, h)
        if name not in keys:
            if h.startswith("hook_rot"):
                continue  # rotation recomputed below
            raise CaptureError(f"the cache has no {name!r}; run model.run_with_cache(tokens) without names_filter, "
                               f"or keep that hook")
        x = cache[name].detach()
        if h in ("hook_q_normed", "hook_k_normed"):
            x = _to_bshd(x, info.normed_layout)
        d[h] = x.float()
    q = d[info.q_hook]
    pos = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1)
    if info.rot_fires and not ("hook_rot_q" in d and "hook_rot_k" in d):
        info = HookInfo(info.q_hook, info.k_hook, info.normed_layout, False, info.scores_kind, info.attn_prefix)
    return _make_capture(layer, d, spec.layer(layer), info, pos, 0, 0)


def pattern_hooks(
    model: Any, layers: Sequence[int], fn: Callable[[int, Float[Tensor, "batch head_index query_pos key_pos"]], None]
) -> list[tuple[str, Callable]]:
    """Read-only hooks on ``blocks.{l}.attn.hook_pattern`` (post-softmax attention) of ``layers``.

    ``fn(layer, pattern)`` receives the pattern ``[batch, head_index, query_pos, key_pos]``
    (float32, detached); the hook returns ``None`` (the forward pass is not changed).

    Raises:
        CaptureError: the model has no ``hook_pattern`` for one of the layers.
    """
    spec, info = probe_hooks(model)
    names = _hook_names(model)
    out = []
    for layer in sorted({int(x) % spec.n_layers for x in layers}):
        name = info.name(layer, "hook_pattern")
        if name not in names:
            raise CaptureError(f"{spec.model_name}: no {name} hook: attention patterns are unavailable")

        def grab(t: Tensor, hook: Any, layer: int = layer) -> None:
            fn(layer, t.detach().float())

        out.append((name, grab))
    return out
