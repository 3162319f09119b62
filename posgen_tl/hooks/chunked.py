"""The capture of :func:`posgen_tl.hooks.stream.stream_qk` with the forward run a chunk of query positions at a time
through the model's own key/value cache: long sequences in bounded memory, and sequences from a thousand tokens
faster.

A plain forward of ``n`` tokens builds every layer's ``[batch, heads, n, n]`` score map (SmolLM2 at 16 384 tokens:
9.7 GB for one layer) before any analysis starts. Run ``chunk`` positions at a time with Hugging Face's cache, the
model attends each chunk's queries to the cached keys: its largest transient is ``[batch, heads, chunk, n]``, and it
computes only the causal part of the maps. The requested layers' pre-rotation and rotated q/k are gathered chunk by
chunk — each chunk's rotation self-checked at its absolute positions — and each layer is handed on whole, its rotation
checked again over all positions.

Whether a model's cached forward reproduces its whole forward is checked once per model (:func:`check_chunked`: the
q/k of every layer of a probe sequence, chunked vs whole); a model that fails is refused by name, and so is a RoPE that
chooses its frequencies from the sequence length (dynamic NTK, LongRoPE: a cache would rotate each chunk differently).
TransformerLens 4.3's bridge reads the cache only from ``past_key_values`` while transformers 5.x passes it as
``cache``; :func:`_cache_kwarg` bridges the two for the duration of a chunked forward (removed on every exit path).

Hooks that change the forward run on every chunk where they are marked :func:`chunk_safe`: their output on a chunk is
that chunk's part of their output on the whole sequence. The key edits of :mod:`posgen_tl.hooks.edits` are (an edited
key reaches the cache; a random draw per position reads the chunk's place through :func:`chunk_span`), and so is the
sufficiency substitution ``W ← f + g`` (:func:`posgen_tl.hooks.logits.logit_substitution_hooks` with ``rows_only``:
each chunk's queries against the keys the cache hands on) — so the causal conditions and the sufficiency test run
on texts whose whole forward does not fit in memory (:func:`posgen_tl.engine.swaps.nll_on_target`).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from posgen_tl.hooks.capture import CaptureError, StopForward, hooks_attached, model_device, model_dtype, probe_hooks

__all__ = ["CHUNK", "CHUNK_ABOVE", "CHUNK_FROM", "CHUNK_RTOL", "auto_chunk", "check_chunked", "chunk_range", "chunk_safe",
           "chunk_span", "chunk_memo", "forward_chunk",
           "hooks_chunk_safe", "run_chunks"]

#: automatic chunks (:func:`auto_chunk`): CHUNK positions beyond CHUNK_ABOVE tokens (memory: the forward's transient
#: is ``[batch, heads, CHUNK, n]``), a quarter of the sequence from CHUNK_FROM tokens on (speed: the chunks compute only
#: the causal part of the score maps — `benchmarks/bench_chunks.py`, SmolLM2, 2 threads: the capture pass 0.65× a
#: plain forward at 4 × 1024 tokens instead of 0.92×; at 8 × 512 0.86× instead of 0.82×, so not below 1 024 tokens)
CHUNK, CHUNK_ABOVE, CHUNK_FROM = 512, 2048, 1024
#: the largest difference (relative to the largest |value| of the layer) between a chunked and a whole forward's
#: rotated q/k that counts as float rounding (the two differ in matrix shapes, so in summation order)
CHUNK_RTOL = 1e-4
#: model -> {(dtype, device): None (passed) or why it failed}
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: the most bytes of tensors a chunked forward's hooks keep in :func:`chunk_memo` (beyond it, they recompute per chunk)
MEMO_BYTES = 256 * 2**20
_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("posgen_tl_chunk_memo", default=None)
#: the chunk a chunked forward is running: (its first position, its end, the sequence's length); None outside one
_SPAN: contextvars.ContextVar[tuple[int, int, int] | None] = contextvars.ContextVar("posgen_tl_chunk_span", default=None)


def chunk_span() -> tuple[int, int, int] | None:
    """``(c0, c1, n)`` while :func:`run_chunks` runs the chunk ``[c0, c1)`` of an ``n``-token sequence; ``None`` in a
    whole forward. A hook whose result depends on the absolute position (a random draw per position) reads it."""
    return _SPAN.get()


def chunk_memo() -> dict | None:
    """A dict that lives while one :func:`run_chunks` forward runs (``None`` outside one): a hook keeps there what every
    chunk would otherwise recompute for the whole sequence (a random draw per position), keyed by what determines it,
    and :func:`memo_room` says whether another ``nbytes`` fit within :data:`MEMO_BYTES`."""
    return _MEMO.get()


def memo_room(memo: dict, nbytes: int) -> bool:
    """Whether ``nbytes`` more tensors kept in ``memo`` (:func:`chunk_memo`) stay within :data:`MEMO_BYTES` in all."""
    held = sum(v.numel() * v.element_size() for v in memo.values() if isinstance(v, Tensor))
    return held + nbytes <= MEMO_BYTES


def chunk_range(n_pos: int) -> tuple[int, int, int]:
    """``(c0, c1, n)``: where the ``n_pos`` positions a hook sees lie in the sequence — the chunk :func:`chunk_span`
    names, or ``(0, n_pos, n_pos)`` in a whole forward. Raises ValueError when the chunk is not ``n_pos`` long."""
    span = chunk_span()
    if span is None:
        return 0, n_pos, n_pos
    if span[1] - span[0] != n_pos:
        raise ValueError(f"a chunk of positions {span[0]} … {span[1] - 1} reached a hook with {n_pos} positions")
    return span


def chunk_safe(fn: Callable) -> Callable:
    """Mark the hook function ``fn`` as one whose output on a chunk of positions is that chunk's part of its output on
    the whole sequence (a per-token edit; a per-position draw through :func:`chunk_span`). Returns ``fn``."""
    fn.chunk_safe = True  # type: ignore[attr-defined]
    return fn


def hooks_chunk_safe(hooks: Sequence) -> bool:
    """Every ``(name, fn)`` of ``hooks`` is marked by :func:`chunk_safe` (true for none)."""
    return all(getattr(fn, "chunk_safe", False) for _, fn in hooks)


@contextlib.contextmanager
def _cache_kwarg(model: Any) -> Iterator[None]:
    """Each attention component's ``_update_kv_cache`` also reads the cache passed as ``cache`` (transformers 5.x)."""
    patched = []
    for block in getattr(model, "blocks", []):
        attn = getattr(block, "attn", None)
        fn = getattr(attn, "_update_kv_cache", None)
        if attn is None or fn is None or "_update_kv_cache" in vars(attn):
            continue

        def update(k: Tensor, v: Tensor, _fn: Callable = fn, **kw: Any) -> tuple[Tensor, Tensor]:
            if kw.get("past_key_values") is None and kw.get("cache") is not None:
                kw["past_key_values"] = kw["cache"]
            return _fn(k, v, **kw)

        attn._update_kv_cache = update
        patched.append(attn)
    try:
        yield
    finally:
        for attn in patched:
            vars(attn).pop("_update_kv_cache", None)


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache  # noqa: PLC0415

    config = getattr(getattr(model, "original_model", None), "config", None)
    try:
        return DynamicCache(config=config) if config is not None else DynamicCache()
    except TypeError:  # an older transformers: no config argument
        return DynamicCache()


def run_chunks(model: Any, tokens: Tensor, chunk: int, hooks_for: Callable[[int, int], list], *,
               position_ids: Tensor | None = None, return_type: str | None = None) -> dict[int, Any]:
    """The forward of ``tokens`` ``chunk`` positions at a time through one cache; ``hooks_for(c0, c1)`` gives the
    hooks of the chunk ``[c0, c1)`` (a hook may raise :class:`StopForward` to end that chunk's pass; while a chunk
    runs, :func:`chunk_span` says which). ``position_ids`` ``[batch, pos]`` (or ``[pos]``): the ids the forward is
    given, sliced per chunk (default: ``arange``). Returns ``{c0: the model's output}`` for the chunks that ran to the
    end with ``return_type`` (``"logits"``: ``[batch, c1 − c0, d_vocab]``)."""
    cache = _new_cache(model)
    n = tokens.shape[1]
    if position_ids is not None and position_ids.shape[-1] != n:
        raise ValueError(f"position_ids have {position_ids.shape[-1]} entries but the sequence has {n}")
    out: dict[int, Any] = {}
    memo = _MEMO.set({})
    with contextlib.ExitStack() as stack:
        stack.callback(_MEMO.reset, memo)
        stack.enter_context(_cache_kwarg(model))
        for c0 in range(0, n, chunk):
            c1 = min(c0 + chunk, n)
            if position_ids is None:
                pos = torch.arange(c0, c1, device=tokens.device).expand(tokens.shape[0], -1)
            else:
                pos = position_ids[..., c0:c1].to(tokens.device).expand(tokens.shape[0], -1)
            token = _SPAN.set((c0, c1, n))
            try:
                with torch.no_grad(), hooks_attached(model, hooks_for(c0, c1)):
                    out[c0] = model(tokens[:, c0:c1], return_type=return_type, position_ids=pos, cache=cache,
                                    use_cache=True)
            except StopForward:
                pass
            finally:
                _SPAN.reset(token)
    return out


def check_chunked(model: Any) -> None:
    """Raise :class:`CaptureError` unless a forward run a chunk at a time through the model's cache gives every
    layer's pre-rotation (and, where its hooks fire, rotated) q/k of a probe sequence as the whole forward does, within :data:`CHUNK_RTOL` of each layer's
    largest |value|. The probe: 3 chunks of 16 tokens; with sliding windows (largest ``w``), chunks of ``w/2`` over
    ``3w`` tokens, so the cache drops keys that fell out of a window. Checked once per model, dtype and device."""
    spec, info = probe_hooks(model)
    length_dependent = sorted({"dynamic", "longrope"} & set(spec.rope_type.split("+")))
    if length_dependent:
        raise CaptureError(f"{spec.model_name}: its RoPE ({', '.join(length_dependent)}) chooses frequencies from the "
                           "sequence length, so a forward in chunks would rotate each chunk differently; analyse long "
                           "sequences without chunk=")
    key = (model_dtype(model), str(model_device(model)))
    done = _CHECKED.setdefault(model, {})
    if key not in done:
        windows = [lr.sliding_window for lr in spec.layers if lr.sliding_window]
        chunk = max(8, max(windows) // 2) if windows else 16
        done[key] = _chunked_mismatch(model, spec, info, chunk, 6 if windows else 3)
    if done[key] is not None:
        raise CaptureError(f"{spec.model_name}: a chunked forward through the model's key/value cache does not "
                           f"reproduce its whole forward ({done[key]}); analyse long sequences without chunk=")


def auto_chunk(model: Any, n: int, chunk: int = -1, extra_hooks: Sequence = (), *, memory_only: bool = False) -> int:
    """The ``chunk`` to capture ``n``-token sequences with: ``chunk`` itself when ≥ 0 (0: one whole forward); for
    ``-1`` (automatic), where every extra hook is :func:`chunk_safe` (another's tensors would be a chunk's) and the model
    passes :func:`check_chunked`, :data:`CHUNK` beyond :data:`CHUNK_ABOVE` tokens and, unless ``memory_only``,
    ``⌈n/4⌉`` from :data:`CHUNK_FROM` tokens on — else 0. ``memory_only``: for an analysis that would pay for the
    chunks elsewhere (a pass that would read a whole forward's score maps instead). A model that fails the
    check gets one whole forward (exact), with a warning beyond :data:`CHUNK_ABOVE` tokens, where that forward's
    memory grows as n². On a GPU chunks only ever save memory (each chunk's forward costs as many kernel launches
    as a whole one), so there ``memory_only`` always holds."""
    if chunk >= 0:
        return chunk
    memory_only = memory_only or model_device(model).type != "cpu"
    if n < (CHUNK_ABOVE + 1 if memory_only else CHUNK_FROM) or not hooks_chunk_safe(extra_hooks):
        return 0
    try:
        check_chunked(model)
    except CaptureError as e:
        if n > CHUNK_ABOVE:
            warnings.warn(f"{e} — capturing {n}-token sequences in one forward instead (exact; memory O(n²) per "
                          "layer)", stacklevel=2)
        return 0
    return CHUNK if n > CHUNK_ABOVE else -(-n // 4)


def forward_chunk(model: Any, n: int, hooks: Sequence = (), *, resumed: bool = False, chunk: int = -1) -> int:
    """The chunk a pass that runs the model's forward (with ``hooks``) over ``n`` tokens uses: ``chunk`` ≥ 0 as given
    (checked: the hooks :func:`chunk_safe`, the model's cached forward exact, the pass not resumed from a residual),
    ``-1``: :func:`auto_chunk`'s choice for memory (beyond :data:`CHUNK_ABOVE` tokens), never when ``resumed``.
    Raises ValueError (CaptureError from :func:`check_chunked`) for a chunk that cannot be run."""
    if chunk < 0:
        return 0 if resumed else auto_chunk(model, n, -1, hooks, memory_only=True)
    if 0 < chunk < n:
        if resumed:
            raise ValueError(f"chunk={chunk} cannot be combined with resid_at: a resumed forward runs whole")
        if not hooks_chunk_safe(hooks):
            raise ValueError(f"chunk={chunk}: fwd_hooks not marked chunk_safe would see one chunk's tensors, not the "
                             "sequence's (the key edits of posgen_tl.hooks.edits are chunk_safe)")
        check_chunked(model)
        return chunk
    return 0


def _chunked_mismatch(model: Any, spec: Any, info: Any, chunk: int, n_chunks: int) -> str | None:
    """Why a chunked forward differs from the whole one on a probe sequence (``None``: it does not). Compared:
    every layer's pre-rotation q/k hooks and, where they fire, its rotated q/k."""
    if info.backend != "bridge":
        return f"needs a TransformerBridge (this is a {info.backend} model)"
    n = chunk * n_chunks
    dev = model_device(model)
    d_vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 32)
    tokens = torch.randint(1, max(d_vocab - 1, 2), (1, n), generator=torch.Generator().manual_seed(0)).to(dev)
    kinds = [info.q_hook, info.k_hook] + (["hook_rot_q", "hook_rot_k"] if info.rot_fires else [])
    names = [(layer, h) for layer in range(spec.n_layers) for h in kinds]
    last = spec.n_layers - 1

    def hooks(store: dict) -> list:
        def keep(t: Tensor, hook: Any, key: tuple[int, str]) -> None:
            store.setdefault(key, []).append(t.detach().float().clone())
            if key[0] == last and all(len(store.get((last, h), [])) == len(store[(0, kinds[0])]) for h in kinds):
                raise StopForward  # the unembedding is not compared

        return [(info.name(layer, h), lambda t, hook, key=(layer, h): keep(t, hook, key)) for layer, h in names]

    whole: dict = {}
    try:
        with torch.no_grad(), hooks_attached(model, hooks(whole)), contextlib.suppress(StopForward):
            model(tokens, return_type=None)
        parts: dict = {}
        run_chunks(model, tokens, chunk, lambda c0, c1: hooks(parts))
    except Exception as e:  # noqa: BLE001 - any failure of the cached forward means: not usable
        return f"{type(e).__name__}: {e}"
    for key in names:
        got = parts.get(key, [])
        if len(whole.get(key, [])) != 1 or len(got) != n_chunks:
            return f"blocks.{key[0]}.attn.{key[1]} fired {len(got)} times over {n_chunks} chunks"
        a = whole[key][0]
        axes = [i for i, s in enumerate(a.shape) if s == n and got[0].shape[i] == chunk]
        if len(axes) != 1:
            return f"blocks.{key[0]}.attn.{key[1]}: no position axis in {tuple(got[0].shape)}"
        b = torch.cat(got, dim=axes[0])
        ref = float(a.abs().max())
        err = float((a - b).abs().max())
        if not err <= CHUNK_RTOL * max(ref, 1e-30):
            return f"blocks.{key[0]}.attn.{key[1]}: relative difference {err / max(ref, 1e-30):.1e}"
    return None
