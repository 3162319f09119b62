"""The streaming capture of pre- and post-rotation q/k (what :mod:`posgen_tl.hooks.capture` probes).

Memory: :func:`stream_qk` calls your function for one (batch, layer) at a time while the
forward pass runs, so nothing beyond one layer of one batch is held; the forward pass
stops right after the last layer it needs (no logits are computed). :func:`capture_qk` keeps one layer
of one batch; :func:`capture_from_cache` reads a TransformerLens cache; :func:`self_check` compares a
capture's rotation with the model's own; :func:`pattern_hooks` read or write attention patterns.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.hooks.capture import (
    CaptureError,
    HookInfo,
    QKCapture,
    StopForward,
    check_position_ids,
    check_tokens,
    hook_names,
    hooks_attached,
    model_dtype,
    pre_rotation,
    probe_hooks,
    run_forward,
)
from posgen_tl.hooks.chunked import check_chunked, hooks_chunk_safe, run_chunks
from posgen_tl.hooks.heap import BatchTrim, large_blocks_kept, release_freed_memory
from posgen_tl.hooks.memory import check_forward_fits
from posgen_tl.hooks.stacking import Stacker, stack_size
from posgen_tl.hooks.tables import model_rotation_table, table_to_bands
from posgen_tl.io.spec import live_rope
from posgen_tl.maths.rope import RopeSpec, rotate, rotation_residual

__all__ = ["stream_qk", "capture_qk", "capture_from_cache", "self_check", "rotation_tolerance", "pattern_hooks",
           "release_freed_memory"]


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
    with_tables: bool = False,
    with_pattern: bool = False,
    chunk: int = 0,
    stack: int = 1,
    _gate: bool = True,
) -> None:
    """Run the model over ``tokens`` in batches and call ``fn(QKCapture)`` per (batch, layer) — or per stack of
    ``stack`` layers.

    Gated (:func:`posgen_tl.hooks.gate.require_exact`): raises ``UncheckedModelError`` if a requested
    layer's exactness check did not pass for this model, dtype and device.

    ``fn`` runs inside the forward pass, right after the layer's q/k (and scores) are
    available; the capture is dropped afterwards, so memory is one layer of one batch.
    The pass stops after the last requested layer. ``extra_hooks`` (e.g. an
    intervention from :mod:`posgen_tl.hooks.edits`) are attached for the same passes;
    captured q/k then show their effect. ``with_tables``: also give the model's own rotation
    table of the batch (``QKCapture.table_cos``/``table_sin``, where the model exposes one);
    ``with_pattern``: also its ``hook_pattern`` (``QKCapture.pattern``).

    ``stack``: hand ``fn`` up to this many layers of a batch at once, stacked on the head axis
    (:func:`posgen_tl.hooks.stacking.stack_captures`; ``QKCapture.layers`` names them; a stack closes early at a
    change of shape, positions or rope and at the batch's last layer), each stack checked once — on a GPU a check or
    an analysis costs kernel launches per operation, whatever the number of layers. Not with scores, patterns or
    tables (a stack carries q/k only). ``stack=0``: as many as :func:`posgen_tl.hooks.stacking.stack_size` allows for
    holding a batch's q/k (one layer on the CPU, and with scores, patterns or tables).

    ``chunk``: run the forward this many positions at a time through the model's key/value cache
    (:mod:`posgen_tl.hooks.chunked`: no ``[heads, n, n]`` score map is built, for long sequences); ``fn`` then gets
    each layer of the whole sequence after the batch's chunked forward. Not with scores, patterns, tables, position
    ids or extra hooks that are not :func:`~posgen_tl.hooks.chunked.chunk_safe` (their tensors would be a chunk's;
    the key edits of :mod:`posgen_tl.hooks.edits` are); a model whose cached forward does not reproduce its whole
    forward is refused (checked once per model).

    Hooks are removed when this returns or raises (KeyboardInterrupt included).
    """
    spec, info = probe_hooks(model)
    tokens = check_tokens(model, tokens, spec)
    layers = spec.layer_indices(layers)
    if not layers:
        raise ValueError("no layers selected")
    if _gate:
        from posgen_tl.hooks.gate import require_exact  # noqa: PLC0415

        require_exact(model, layers, "reading q/k")
    if position_ids is not None:
        position_ids = _checked_ids(spec, info, position_ids, tokens)
    need = _needed_hooks(spec, info, with_scores=with_scores, with_tables=with_tables, with_pattern=with_pattern)
    stack = _stack_option(model, spec, stack, tokens, batch_size, len(layers), with_scores or with_tables or with_pattern)
    rot_tol = rotation_tolerance(model_dtype(model))
    chunked = 0 < chunk < tokens.shape[1]
    if chunked:
        bad = [name for name, on in (("with_scores", with_scores), ("with_pattern", with_pattern), ("with_tables",
               with_tables), ("position_ids", position_ids is not None),
               ("extra hooks not marked chunk_safe", not hooks_chunk_safe(extra_hooks))) if on]
        if bad:
            raise ValueError(f"stream_qk(chunk={chunk}) cannot be combined with {', '.join(bad)}: those tensors "
                             "would be one chunk's, not the sequence's")
        check_chunked(model)
    trim = tokens.device.type == "cpu"  # freed host heap back to the OS when it grew (a GPU's tensors are not on it)
    trimmer = BatchTrim()
    # chunked on the CPU: also after each layer of a long sequence (seconds each), 128 MiB margin
    layer_trim = BatchTrim(growth=0.0) if chunked and trim else None
    desc = progress if isinstance(progress, str) else "capture"
    bar = tqdm(total=math.ceil(tokens.shape[0] / batch_size), desc=desc, disable=not progress, leave=False)
    # on the CPU the forward's big tensors are reused from glibc's heap instead of mmapped afresh at every layer
    with large_blocks_kept() if trim else contextlib.nullcontext(), contextlib.closing(bar):
        for b_idx, (offset, batch) in enumerate(_batches(tokens, batch_size)):
            if chunked:
                stacker = Stacker(fn, stack, layers[-1])  # (each chunk's rotation is checked as it runs)
                _chunked_batch(model, batch, b_idx, offset, layers, need, stacker, chunk=chunk, rot_tol=rot_tol,
                               after_layer=layer_trim, extra_hooks=extra_hooks)
                stacker.flush()
            else:
                pos, pos_arg = _batch_positions(position_ids, batch, offset, tokens.shape[0])
                grab = _Grab(model, spec, info, need, pos, b_idx, offset, layers[-1], rot_tol, with_tables, fn, stack)
                _whole_batch(model, batch, pos_arg, grab, layers, extra_hooks)
            bar.update(1)
            if trim:
                trimmer()


def _whole_batch(model: Any, batch: Tensor, pos_arg: Tensor | None, grab: _Grab, layers: Sequence[int],
                 extra_hooks: Sequence[tuple[str, Callable]]) -> None:
    """One batch of :func:`stream_qk` in one forward: ``grab``'s hooks on every layer of ``layers`` (and the user's
    ``extra_hooks``) for that forward only; raises CaptureError when a layer's hooks did not all fire."""
    check_forward_fits(model, batch.shape[1], batch.shape[0], "reading q/k in one forward")
    info = grab.info
    fwd = list(extra_hooks)
    for layer in layers:
        for h in grab.need:
            fwd.append((info.name(layer, h), lambda t, hook, layer=layer, h=h: grab(t, layer, h)))
    with torch.no_grad(), hooks_attached(model, fwd):
        try:
            run_forward(model, batch, pos_arg)
        except StopForward:
            pass
    grab.stacker.flush()  # a stack left open (the forward ended before its last layer): checked, handed on
    if grab.store:
        raise CaptureError(f"{grab.spec.model_name}: hooks {sorted(next(iter(grab.store.values())).keys())} fired but "
                           f"not all of {grab.need}")


def _stack_option(model: Any, spec: RopeSpec, stack: int, tokens: Tensor, batch_size: int, n_layers: int,
                  per_layer_maps: bool) -> int:
    """The layers per stack of :func:`stream_qk`: ``stack`` itself, or for ``stack=0`` as many as
    :func:`~posgen_tl.hooks.stacking.stack_size` allows for a batch's q/k (one with scores, patterns or tables).
    Raises ValueError for a stack with scores, patterns or tables (a stack carries q/k only)."""
    if stack <= 0:  # held per layer: q, k and their rotations, [batch, pos, head_index, d_head] at most
        return 1 if per_layer_maps else stack_size(model, 4 * min(batch_size, tokens.shape[0]) * tokens.shape[1]
                                                   * spec.d_head, n_layers)
    if stack > 1 and per_layer_maps:
        raise ValueError(f"stream_qk(stack={stack}) cannot be combined with scores, patterns or tables: a stack of "
                         "layers carries q/k only")
    return stack


def _chunked_batch(model: Any, batch: Tensor, b_idx: int, offset: int, layers: Sequence[int], need: Sequence[str],
                    fn: Callable[[QKCapture], None], *, chunk: int, rot_tol: float,
                    after_layer: Callable[[], Any] | None = None, extra_hooks: Sequence = ()) -> None:
    """One batch of :func:`stream_qk` with ``chunk=`` (:mod:`posgen_tl.hooks.chunked`): ``fn`` gets each layer of
    ``layers`` (in order) as one :class:`QKCapture` of the whole sequence, after the chunked forward (then
    ``after_layer()``, if given, runs: the pass's per-layer heap trimmer on the CPU); peak memory of
    the forward O(batch · heads · chunk · n) instead of O(batch · heads · n²). Only the pre-rotation q/k of ``layers``
    are held until their layer is handed on: each chunk's rotation was checked against the model's own
    (``hook_rot_q/k``, where they fire) at its absolute positions, and the whole layer's is recomputed from them
    (``rot_source="computed"``) — half the memory of keeping both. ``extra_hooks`` (each :func:`chunk_safe`) run on
    every chunk, before the capture's own."""
    spec, info = probe_hooks(model)
    pieces: dict[int, list[tuple[Tensor, Tensor]]] = {layer: [] for layer in layers}

    def keep(c: QKCapture) -> None:  # copies: the forward goes on after this hook and may reuse its tensors
        pieces[c.layer].append((c.q.clone(), c.k.clone()))

    def hooks_for(c0: int, c1: int) -> list:
        pos = torch.arange(c0, c1, device=batch.device).expand(batch.shape[0], -1)
        grab = _Grab(model, spec, info, need, pos, b_idx, offset, layers[-1], rot_tol, False, keep)
        return list(extra_hooks) + [(info.name(layer, h), lambda t, hook, layer=layer, h=h: grab(t, layer, h))
                                    for layer in layers for h in need]

    run_chunks(model, batch, chunk, hooks_for)
    n = batch.shape[1]
    pos = torch.arange(n, device=batch.device).expand(batch.shape[0], -1)
    for layer in layers:
        got = pieces.pop(layer)
        if sum(q.shape[1] for q, _ in got) != n:
            raise CaptureError(f"{spec.model_name}: layer {layer}'s hooks fired for {sum(q.shape[1] for q, _ in got)} "
                               f"of {n} positions in a chunked forward")
        q, k = (torch.cat(parts, dim=1) for parts in zip(*got))
        del got
        lr = live_rope(model, spec, layer, spec.layer(layer).for_positions(pos))
        fn(QKCapture(layer=layer, q=q, k=k, rot_q=rotate(q, pos, lr), rot_k=rotate(k, pos, lr), positions=pos, rope=lr,
                     rot_source="computed", batch_index=b_idx, seq_offset=offset))
        del q, k
        if after_layer is not None:
            after_layer()


def _checked_ids(spec: RopeSpec, info: HookInfo, position_ids: Tensor, tokens: Tensor) -> Tensor:
    """``position_ids`` checked for a streamed capture: the right shape, a forward that takes them, inside the
    model's sin/cos table. Raises CaptureError naming what is wrong."""
    position_ids = check_position_ids(position_ids, tokens.shape[0], tokens.shape[1], spec.model_name)
    if not info.position_ids:
        raise CaptureError(
            f"{spec.model_name}: a {info.backend} model's forward takes no position_ids (TransformerLens 3.x "
            "HookedTransformer); run with posgen_tl.hooks.positions.reposition_hooks(model, position_ids) "
            "as extra_hooks instead"
        )
    table = spec.extra.get("max_position")
    if table is not None and int(position_ids.max()) >= int(table):
        raise CaptureError(
            f"{spec.model_name}: position id {int(position_ids.max())} is past the model's table of {table} positions "
            "(its sin/cos table is built for max_position_embeddings); run with "
            "posgen_tl.hooks.positions.reposition_hooks(model, position_ids) as extra_hooks instead"
        )
    return position_ids


def _needed_hooks(spec: RopeSpec, info: HookInfo, *, with_scores: bool, with_tables: bool,
                  with_pattern: bool) -> list[str]:
    """The attention hooks a capture of each layer waits for. Raises CaptureError for scores or patterns the
    model does not deliver."""
    need = [info.q_hook, info.k_hook]
    if info.rot_fires:
        need += ["hook_rot_q", "hook_rot_k"]
    if with_scores:
        if info.scores_kind == "absent":
            raise CaptureError(f"{spec.model_name}: hook_attn_scores does not fire; scores are unavailable")
        need.append("hook_attn_scores")
    if with_tables and info.cos_fires:
        need += ["hook_cos", "hook_sin"]
    if with_pattern:
        if not info.pattern_fires:
            raise CaptureError(f"{spec.model_name}: hook_pattern does not fire; attention patterns are unavailable")
        need.append("hook_pattern")
    return need


def _batch_positions(position_ids: Tensor | None, batch: Tensor, offset: int,
                     n_total: int) -> tuple[Tensor, Tensor | None]:
    """``(positions [batch, pos], what the forward is given)`` for one batch (``None``: its natural ids)."""
    if position_ids is None:
        return torch.arange(batch.shape[1], device=batch.device).expand(batch.shape[0], -1), None
    pid = position_ids.to(batch.device)
    pos = pid.expand(batch.shape[0], -1) if pid.ndim == 1 or pid.shape[0] == 1 and n_total > 1 \
        else pid[offset : offset + batch.shape[0]]
    return pos, pos


class _Grab:
    """The hook body of one batch of :func:`stream_qk`: collects a layer's hooks; once all of ``need`` fired,
    builds its :class:`QKCapture` and hands it on — checked (:func:`_check_capture`) and given to ``fn`` at once
    (``stack`` 1), or gathered into stacks of ``stack`` layers, each checked once before ``fn`` gets it — and drops
    it (the forward stops after the last layer)."""

    def __init__(self, model: Any, spec: RopeSpec, info: HookInfo, need: Sequence[str], pos: Tensor, b_idx: int,
                 offset: int, last_layer: int, rot_tol: float, with_tables: bool, fn: Callable[[QKCapture], None],
                 stack: int = 1):
        self.model, self.spec, self.info, self.need, self.pos = model, spec, info, list(need), pos
        self.b_idx, self.offset, self.last_layer, self.rot_tol = b_idx, offset, last_layer, rot_tol
        self.with_tables, self.fn = with_tables, fn
        self.store: dict[int, dict[str, Tensor]] = {}
        self.stacker = Stacker(fn, stack, last_layer, check=self._check_stack)

    def _check_stack(self, cap: QKCapture, parts: Sequence[QKCapture]) -> None:  # parts: what cap stacks
        hooks = {self.info.q_hook: cap.q, self.info.k_hook: cap.k}
        if cap.rot_source == "hook":
            hooks.update(hook_rot_q=cap.rot_q, hook_rot_k=cap.rot_k)
        _check_capture(cap, hooks, self.rot_tol, self.spec.model_name, self.b_idx)

    def __call__(self, t: Tensor, layer: int, h: str) -> None:
        spec, info, pos = self.spec, self.info, self.pos
        d = self.store.setdefault(layer, {})
        x = t.detach()
        if h in (info.q_hook, info.k_hook):
            x = pre_rotation(self.model, info, layer, "q" if h == info.q_hook else "k", x, pos.shape[0], pos.shape[1],
                             spec.d_head)
        d[h] = x.float()
        if len(d) < len(self.need):
            return
        lr = live_rope(self.model, spec, layer, spec.layer(layer).for_positions(pos))
        cap = _make_capture(layer, d, lr, info, pos, self.b_idx, self.offset)
        del self.store[layer]
        if self.stacker.group > 1:
            self.stacker(cap)  # checked once per stack, before fn sees it
        else:
            _check_capture(cap, d, self.rot_tol, spec.model_name, self.b_idx)
            if self.with_tables:
                _attach_table(self.model, cap, d, info)
            self.fn(cap)
        if layer == self.last_layer:
            raise StopForward


#: relative rotation tolerance of a float32 model (the exactness check's too)
ROT_RTOL = 1e-5


def rotation_tolerance(dtype: torch.dtype) -> float:
    """The relative tolerance (to the largest |value|) within which our rotation must reproduce the model's:
    ``1e-5`` for a float32 model, ``8·eps`` of a bf16/fp16 one (such a model rounds its own rotation)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return max(ROT_RTOL, 8 * eps)


def _check_capture(cap: QKCapture, hooks: dict[str, Tensor], rel_tol: float, model_name: str, b_idx: int) -> None:
    """The checks of one capture — a layer, or a stack of layers (:func:`posgen_tl.hooks.stacking.stack_captures`;
    ``hooks`` then holds the stacked tensors) — with ONE read from the device (on a GPU each read waits for the queue): every captured q/k
    hook finite and, where the model's rotated q/k fired, :func:`self_check`'s comparison.

    Raises :class:`CaptureError` as they do (non-finite values name the hook, the layer and the batch)."""
    names = [h for h in hooks if h not in ("hook_attn_scores", "hook_pattern")]
    # a sum of finite values is finite unless it overflows (then the exact test runs): one reduction per hook,
    # no [batch, pos, head, d_head] boolean temporary
    reads = [torch.stack([hooks[h].sum() for h in names])] if names else []
    if cap.rot_source == "hook":
        reads.append(_rotation_errors(cap))
    vals = torch.cat(reads).tolist() if reads else []
    bad = [h for h, v in zip(names, vals) if not math.isfinite(v) and not bool(torch.isfinite(hooks[h]).all())]
    if bad:  # named by its first layer (a stack's later layers inherit a NaN through the residual stream)
        layer, h, n_bad = _first_non_finite(cap, {h: hooks[h] for h in bad})
        raise CaptureError(
            f"{model_name}: {n_bad} non-finite value(s) (NaN/inf) in blocks.{layer}.attn.{h} "
            f"(batch {b_idx}); the model's activations overflowed or the weights are corrupted — "
            "refusing to compute statistics from them"
        )
    if cap.rot_source == "hook":
        _raise_if_rotation_differs(cap, vals[len(names):], rel_tol, model_name)


def _first_non_finite(cap: QKCapture, bad: dict[str, Tensor]) -> tuple[int, str, int]:
    """``(layer, hook, count)``: the first layer (then hook) of ``cap`` whose values in ``bad`` (hook → tensor, a
    stack's layers side by side on the head axis) are not finite, and how many are not."""
    n_layers = len(cap.layer_ids)
    pieces = {h: torch.chunk(x, n_layers, dim=2) if n_layers > 1 else (x,) for h, x in bad.items()}
    for i, layer in enumerate(cap.layer_ids):
        for h, xs in pieces.items():
            n_bad = int((~torch.isfinite(xs[i])).sum())
            if n_bad:
                return layer, h, n_bad
    raise AssertionError("no non-finite value in the hooks reported non-finite")


def _rotation_errors(cap: QKCapture) -> Tensor:
    """``[err_q, ref_q, err_k, ref_k]`` per layer of the capture, ``[4 · layers]`` on the device: the largest |our
    rotation − the model's| and |the model's| of each layer (of a stack too: each layer against its own values).

    The difference comes from :func:`~posgen_tl.maths.rope.rotation_residual` (rotate's own products band by band, no
    rotated copy)."""
    n_layers = len(cap.layer_ids)

    def top(x: Tensor) -> Tensor:  # the largest |x| of each layer (a stack's layers side by side on the head axis)
        # max(max x, −min x): no |x| temporary, ~10× faster on the CPU than vector_norm(ord=inf); a NaN propagates
        if n_layers == 1:  # both in one pass
            lo, hi = torch.aminmax(x)
            return torch.maximum(hi, lo.neg()).reshape(1)
        y = x.reshape(*x.shape[:2], n_layers, -1)
        return torch.maximum(y.amax(dim=(0, 1, 3)), y.amin(dim=(0, 1, 3)).neg_())

    out = []
    for pre, rot in ((cap.q, cap.rot_q), (cap.k, cap.rot_k)):
        out += [torch.stack([top(x) for x in rotation_residual(pre, rot, cap.positions, cap.rope)]).amax(0), top(rot)]
    return torch.cat(out).to(torch.float32)


def _raise_if_rotation_differs(cap: QKCapture, errs: list[float], rel_tol: float, model_name: str) -> None:
    n_layers = len(cap.layer_ids)
    err_q, ref_q, err_k, ref_k = (errs[i * n_layers : (i + 1) * n_layers] for i in range(4))
    for i, layer in enumerate(cap.layer_ids):
        rels = [err / ref if ref > 0 else err for err, ref in ((err_q[i], ref_q[i]), (err_k[i], ref_k[i]))]
        worst = math.nan if any(math.isnan(r) for r in rels) else max(rels)
        if not worst <= rel_tol:
            raise CaptureError(
                f"{model_name} layer {layer}: the rotation the spec gives ({cap.rope.kind}, positions "
                f"{int(cap.positions.min())}…{int(cap.positions.max())}) differs from the model's own "
                f"hook_rot_q/hook_rot_k by {worst:.3g} (relative; tolerance {rel_tol:g}); refusing to compute from q/k "
                "whose rotation is not the model's — a RoPE variant whose frequencies depend on the position ids or "
                "the length, or a hook that changed the rotated q/k without the positions"
            )


def self_check(cap: QKCapture, rel_tol: float, model_name: str = "model") -> None:
    """Raise :class:`CaptureError` unless the spec's rotation of the captured pre-rotation q/k at the
    capture's positions reproduces the model's own rotated q/k (``hook_rot_q``/``hook_rot_k``) within
    ``rel_tol`` (relative to their largest |value|; a NaN never passes). A capture whose rotation was
    computed (no hook) has nothing independent to compare with here; the exactness check covers it.

    Every analysis computes from ``cap.q``/``cap.k``/``cap.rope``/``cap.positions``: this makes a RoPE the
    spec does not reproduce (frequencies that depend on the ids or the length, a rotation hook changed by
    another hook without the positions) an error instead of wrong numbers."""
    if cap.rot_source != "hook":
        return
    _raise_if_rotation_differs(cap, _rotation_errors(cap).tolist(), rel_tol, model_name)


def _make_capture(layer, d, lr, info, pos, b_idx, offset) -> QKCapture:
    q, k = d[info.q_hook], d[info.k_hook]
    if info.rot_fires and "hook_rot_q" in d and "hook_rot_k" in d:
        rq, rk, src = d["hook_rot_q"], d["hook_rot_k"], "hook"
    else:
        rq, rk, src = rotate(q, pos, lr), rotate(k, pos, lr), "computed"
    scores = d.get("hook_attn_scores")
    return QKCapture(
        layer=layer, q=q, k=k, rot_q=rq, rot_k=rk, positions=pos, rope=lr, rot_source=src,
        scores=scores, scores_kind=info.scores_kind if scores is not None else "absent",
        batch_index=b_idx, seq_offset=offset, pattern=d.get("hook_pattern"),
    )


def _attach_table(model: Any, cap: QKCapture, d: dict, info: HookInfo) -> None:
    """Fill ``cap.table_cos/table_sin`` with the model's own rotation table of this batch (not on a layer
    without RoPE: its ``hook_cos`` carries the other layers' table)."""
    if cap.rope.kind == "nope":
        return
    pos = cap.positions
    if "hook_cos" in d and "hook_sin" in d:
        cos, sin = d["hook_cos"], d["hook_sin"]
        cos = cos.expand(pos.shape[0], *cos.shape[-2:]) if cos.ndim == 3 else cos.expand(pos.shape[0], *cos.shape)
        sin = sin.expand(pos.shape[0], *sin.shape[-2:]) if sin.ndim == 3 else sin.expand(pos.shape[0], *sin.shape)
        cb, sb, err = table_to_bands(cos, sin, cap.rope)
        src = "hook_cos/hook_sin"
    else:
        t = model_rotation_table(model, info, cap.layer, pos, cap.rope)
        if t is None:
            return
        (cb, sb, err), src = t, info.table_source
    cap.table_cos, cap.table_sin, cap.table_source, cap.table_format_err = cb, sb, src, err


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
    from posgen_tl.hooks.gate import require_exact  # noqa: PLC0415

    spec, info = probe_hooks(model)
    layer = spec.layer_index(layer)
    require_exact(model, [layer], "reading q/k from a cache")
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
        d[h] = cache[name].detach()
    if info.name(layer, "hook_q") in keys:  # [batch, pos, head, d_head] on every backend
        batch, n_pos = (int(x) for x in cache[info.name(layer, "hook_q")].shape[:2])
    elif info.normed_layout in ("bshd", "bhsd", "flat"):
        x = d[info.q_hook]
        batch, n_pos = int(x.shape[0]), int(x.shape[2] if info.normed_layout == "bhsd" else x.shape[1])
    else:
        raise CaptureError(f"the cache has no {info.name(layer, 'hook_q')!r}, needed to unflatten {info.q_hook}")
    for h in (info.q_hook, info.k_hook):
        d[h] = pre_rotation(model, info, layer, "q" if h == info.q_hook else "k", d[h], batch, n_pos,
                            spec.d_head).float()
    for h in ("hook_rot_q", "hook_rot_k"):
        if h in d:
            d[h] = d[h].float()
    q = d[info.q_hook]
    pos = torch.arange(q.shape[1], device=q.device).expand(q.shape[0], -1)
    if info.rot_fires and not ("hook_rot_q" in d and "hook_rot_k" in d):
        info = HookInfo(info.q_hook, info.k_hook, info.normed_layout, False, info.scores_kind, info.attn_prefix)
    cap = _make_capture(layer, d, live_rope(model, spec, layer, spec.layer(layer).for_positions(pos)), info, pos, 0, 0)
    self_check(cap, rotation_tolerance(model_dtype(model)), spec.model_name)
    return cap


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
    names = hook_names(model)
    out = []
    for layer in spec.layer_indices(layers):
        name = info.name(layer, "hook_pattern")
        if name not in names:
            raise CaptureError(f"{spec.model_name}: no {name} hook: attention patterns are unavailable")

        def grab(t: Tensor, hook: Any, layer: int = layer) -> None:
            fn(layer, t.detach().float())

        out.append((name, grab))
    return out
