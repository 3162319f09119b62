"""Residual re-entry: resume a forward pass at block ``L`` from a recorded residual, WITHOUT computing blocks
``0 … L−1`` again.

Many analyses run the same input many times with hooks that only touch layers ``≥ L`` (a causal condition's
edited layers, a patched head's layer): everything below ``L`` is the same in every one of those forwards. The
residual entering block ``L`` is recorded once (:func:`resid_hooks`, a hook at ``blocks.L.hook_resid_pre`` of a
pass that runs anyway) and each later forward starts there (:func:`forward_from`).

TransformerLens 3.x's ``HookedTransformer`` skips the blocks below ``start_at_layer`` itself. TransformerLens
4.x's bridge takes ``start_at_layer`` but still executes blocks ``0 … L−1`` inside the Hugging Face forward
and discards their output (exact, not faster); 3.x's bridge refuses it (the residual is then put in by a hook
at block ``L``). On a bridge :func:`forward_from` lets the blocks below ``L`` pass their input through
unchanged instead of computing them. Whether that is exact is not assumed: once per model (:func:`skips_blocks`, called before
any hooks are attached) a short input is run both ways and the logits compared; a model whose blocks return more than their hidden
states, or whose comparison fails, keeps the bridge's own (slower, exact) path.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["forward_from", "takes_start_at_layer", "resid_hooks", "recorded", "hooks_from", "check_hooks_from", "skips_blocks", "computing_every_block",
           "is_bridge", "SKIP_TOLERANCE"]

#: largest |Δ logit| / max |logit| between a skipped and a full re-entered forward for the skip to be used
SKIP_TOLERANCE = 1e-5

_ABSENT = object()

#: per model: how its blocks' Hugging Face layers return (``"tensor"`` / ``"tuple"``), or ``None`` = never skip
_KIND: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()


def is_bridge(model: Any) -> bool:
    """Whether ``model`` is a TransformerLens 4.x bridge (blocks wrap Hugging Face layers)."""
    blocks = getattr(model, "blocks", None)
    return blocks is not None and len(blocks) > 0 and hasattr(blocks[0], "original_component")


def resid_hooks(layers: Sequence[int], store: dict[int, list[Tensor]]) -> list[tuple[str, Any]]:
    """Hooks recording the residual entering each block of ``layers``: every forward appends a detached copy
    ``[batch, pos, d_model]`` to ``store[layer]`` (:func:`recorded` joins them); they change nothing."""

    def rec(x: Tensor, hook: Any, layer: int) -> None:
        store.setdefault(layer, []).append(x.detach().clone())

    return [(f"blocks.{int(layer)}.hook_resid_pre", lambda x, hook, _l=int(layer): rec(x, hook, _l)) for layer in layers]


def recorded(store: dict[int, list[Tensor]]) -> dict[int, Tensor]:
    """``{layer: [batch, pos, d_model]}``: the residuals :func:`resid_hooks` recorded, forwards joined in order."""
    return {layer: torch.cat(parts) for layer, parts in store.items()}


def _block_of(name: str) -> int | None:
    parts = str(name).split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit() else None


def hooks_from(hooks: Sequence[tuple[str, Any]], layer: int) -> list[tuple[str, Any]]:
    """``hooks`` without those on blocks below ``layer`` (in a forward resumed there they would not fire)."""
    return [h for h in hooks if (b := _block_of(h[0])) is None or b >= int(layer)]


def check_hooks_from(names: Sequence[str], layer: int) -> None:
    """Refuse hooks on blocks below ``layer``: in a forward resumed at ``layer`` they would silently not fire.

    Raises:
        ValueError: naming the first such hook."""
    for name in names:
        if (b := _block_of(name)) is not None and b < int(layer):
            raise ValueError(f"hook {name!r} is on a block below {layer}, where the forward resumes: it would not fire")


@contextlib.contextmanager
def _passing_through(model: Any, start: int, kind: str) -> Iterator[None]:
    """Blocks ``0 … start−1`` of a bridge return their input hidden states unchanged (restored on exit)."""

    def through(*args: Any, **kwargs: Any) -> Any:
        h = args[0] if args else kwargs["hidden_states"]
        return h if kind == "tensor" else (h,)

    layers = [model.blocks[i].original_component for i in range(start)]
    # an instance-level forward already there (accelerate's device hooks put one) is put back as it was
    saved = [(m, m.__dict__.get("forward", _ABSENT)) for m in layers]
    try:
        for m in layers:
            m.forward = through
        yield
    finally:
        for m, f in saved:
            if f is _ABSENT:
                m.__dict__.pop("forward", None)
            else:
                m.forward = f


def _probe_kind(model: Any) -> str | None:
    """How block 0's Hugging Face layer returns, seen in a 1 × 4-token forward (``None``: not a plain
    hidden-state tensor or one-element tuple)."""
    seen: list[Any] = []
    handle = model.blocks[0].original_component.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            model(_probe_tokens(model))
    finally:
        handle.remove()
    out = seen[0] if seen else None
    if isinstance(out, Tensor):
        return "tensor"
    if isinstance(out, tuple) and len(out) >= 1 and isinstance(out[0], Tensor) and all(x is None for x in out[1:]):
        return "tuple" if len(out) == 1 else None
    return None


def _probe_tokens(model: Any) -> Tensor:
    v = int(model.cfg.d_vocab)
    dev = next(model.parameters()).device
    return (torch.arange(4, device=dev)[None] * 7919 + 11) % max(v - 1, 1) + 1


def takes_start_at_layer(model: Any) -> bool:
    """Whether the model's forward takes ``start_at_layer`` (TransformerLens 3.x's bridge refuses it)."""
    from posgen_tl.compat import tl_version_tuple  # noqa: PLC0415

    return not is_bridge(model) or tl_version_tuple()[0] >= 4


def _resume(model: Any, resid: Tensor, layer: int, tokens: Tensor | None, **kwargs: Any) -> Any:
    """The forward resumed at block ``layer``: ``start_at_layer`` where the model takes it, otherwise ``tokens``
    run with the residual entering block ``layer`` replaced by ``resid``."""
    if takes_start_at_layer(model):
        return model(resid, start_at_layer=layer, **kwargs)
    if tokens is None:
        raise ValueError("resuming a forward on this TransformerLens bridge needs the tokens (tokens=)")

    def inject(x: Tensor, hook: Any) -> Tensor:
        return resid.to(x.dtype)

    with model.hooks(fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", inject)]):
        return model(tokens, **kwargs)


def skips_blocks(model: Any) -> bool:
    """Whether :func:`forward_from` skips the blocks below its start on ``model`` — checked once per model: a
    TransformerLens 3.x ``HookedTransformer`` always; a bridge when its layers return their hidden states alone
    and a skipped resumed forward's logits equal the computed resumed forward's within :data:`SKIP_TOLERANCE`
    (relative to the largest logit) on a short input (a skipped forward that raises counts as unequal)."""
    if not is_bridge(model):
        return True
    if model in _KIND:
        return _KIND[model] is not None
    try:
        kind = _probe_kind(model)
    except Exception:  # noqa: BLE001 - a model that cannot even run the probe is never skipped
        kind = None
    if kind is not None and len(model.blocks) > 1:
        toks = _probe_tokens(model)
        start = len(model.blocks) // 2
        try:
            with torch.no_grad():
                store: dict[int, list[Tensor]] = {}
                with model.hooks(fwd_hooks=resid_hooks([start], store)):
                    model(toks)
                resid = recorded(store)[start]
                full = _resume(model, resid, start, toks).float()
                with _passing_through(model, start, kind):
                    fast = _resume(model, resid, start, toks).float()
            err = float((fast - full).abs().max()) / max(float(full.abs().max()), 1e-30)
        except Exception:  # noqa: BLE001 - a model the pass-through does not fit keeps the exact path
            err = float("inf")
        if not err <= SKIP_TOLERANCE:
            kind = None
    _KIND[model] = kind
    return kind is not None


@contextlib.contextmanager
def computing_every_block(model: Any) -> Iterator[None]:
    """Inside, :func:`forward_from` computes the blocks below its start on ``model`` (and discards them), as
    TransformerLens' own ``start_at_layer`` does — for comparing costs or ruling re-entry out while debugging."""
    skips_blocks(model)
    saved = _KIND.get(model)
    _KIND[model] = None
    try:
        yield
    finally:
        _KIND[model] = saved


def forward_from(
    model: Any, resid: Float[Tensor, "batch pos d_model"], layer: int, *,
    tokens: Tensor | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    """The forward resumed at block ``layer`` from the residual entering it (``model(resid,
    start_at_layer=layer, **kwargs)``; on a TransformerLens 3.x bridge, which refuses ``start_at_layer``,
    ``tokens`` — the input whose residual ``resid`` is — run with ``resid`` put in at block ``layer``), with
    blocks ``0 … layer−1`` not computed where :func:`skips_blocks` has found that exact (otherwise computed
    and discarded, as TransformerLens does). Call :func:`skips_blocks` once BEFORE attaching hooks (its check
    runs forwards of its own, which must not meet them); until it has run on a bridge, the blocks are
    computed. Hooks attached around the call on layers below ``layer`` do not fire. Returns what the model's
    forward returns."""
    layer = int(layer)
    if layer <= 0 or not is_bridge(model) or not _KIND.get(model):
        return _resume(model, resid, layer, tokens, **kwargs)
    with _passing_through(model, layer, _KIND[model] or "tensor"):
        return _resume(model, resid, layer, tokens, **kwargs)
