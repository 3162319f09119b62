"""Activation patching over positions (docs/method.md §9), in TransformerLens' idiom.

A clean run sees tokens at their natural position ids ``0 … n−1``; a corrupted run sees the SAME tokens with
perturbed ids (a :class:`Corruption`: T2 swaps, a gap past the trained context, a user's id map, or the uniform
shift that must change nothing under RoPE). The two runs are aligned token by token, so a quantity of one head
can be carried from one run into the other:

* **denoising** (clean → corrupted): the corrupted run with one head's quantity taken from the clean run — how
  much of the damage does that head's quantity repair (sufficiency);
* **noising** (corrupted → clean): the clean run with one head's quantity taken from the corrupted run — how
  much damage does it do alone (necessity).

Like TransformerLens' ``patching.py``: one generic function (:func:`generic_position_patch`), the setters in
:mod:`posgen_tl.hooks.patching`, and ``functools.partial`` specialisations with their own docstrings, called
``(model, corrupted, clean, metric)`` and returning ``[n_layers, n_heads]`` maps (``rot_k``: kv heads) or
``[n_layers]`` per-layer values. ``metric`` maps logits to a scalar, or to one value per sequence ``[batch]``
(then the maps gain a trailing ``batch`` axis): :func:`target_nll` is the default kind, and reads only the
logits of its target span. Heads of one layer are patched together in one forward, stacked in the batch
dimension (``replicas`` copies of the batch per forward).

Which quantity answers what. ``pos_term`` / ``sem_term`` / ``pattern`` depend on the ids only through the
distances, so under the null corruption :class:`Shift` (every id + c) their maps equal the clean metric —
the check that a map is not noise. ``rot_q`` or ``rot_k`` ALONE are not shift-invariant: a patched query
rotated at the clean ids meets keys rotated at the corrupted ids, so that head's every distance moves by the
difference of the two runs' ids (under a shift, by c). Their map answers "what if this head's queries (keys)
had the other run's positions", a mixture of both runs' distances; patching a head's q AND its kv group's k
together restores the head exactly.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm

from posgen_tl.hooks.capture import StopForward, check_tokens, probe_hooks
from posgen_tl.hooks.chunked import CHUNK, auto_chunk, forward_chunk
from posgen_tl.hooks.gate import require_exact
from posgen_tl.hooks.heap import large_blocks_kept
from posgen_tl.hooks.memory import check_forward_fits, logit_row_bytes, sequences_per_forward
from posgen_tl.hooks.patching import CHUNKABLE, QUANTITIES, TERMS, patch_hooks, patch_site, record_hooks
from posgen_tl.hooks.positions import chunked_logit_rows, final_residual_hook, reposition_hooks
from posgen_tl.hooks.reentry import forward_from, hooks_from, recorded, resid_hooks, skips_blocks
from posgen_tl.maths.perturb import (
    adjacent_swap_permutation,
    gap_position_ids,
    position_ids_for_permutation,
    row_nll,
    swap_seed,
)

__all__ = [
    "QUANTITIES", "Corruption", "Swaps", "Gap", "IdMap", "Shift", "target_nll", "target_metrics", "Group", "PatchSweep", "generic_position_patch",
    "patch_sweep", "default_replicas", "get_act_patch_rot_q", "get_act_patch_rot_k", "get_act_patch_pos_term", "get_act_patch_sem_term",
    "get_act_patch_pattern", "get_act_patch_layer", "get_act_patch_heads", "baselines", "normalised_recovery",
]  # fmt: skip

Direction = Literal["denoising", "noising"]
Metric = Callable[[Tensor], Tensor]


# ----------------------------------------------------------------------------- corruptions


@dataclass(frozen=True)
class Corruption:
    """A named perturbation of position ids (tokens never change). Subclasses define :meth:`ids_for`."""

    def ids_for(self, n_pos: int, doc: int, start: int, keep_last: int) -> Int[Tensor, "pos"]:  # pragma: no cover
        raise NotImplementedError

    #: False only for the null control, whose ids change but whose distances do not
    changes_distances: ClassVar[bool] = True

    def position_ids(
        self, n_pos: int, *, n_seq: int = 1, doc_ids: Sequence[int] | None = None, starts: Sequence[int] | None = None,
        keep_last: int = 0,
    ) -> Int[Tensor, "batch pos"]:  # fmt: skip
        """The corrupted ids of ``n_seq`` sequences of ``n_pos`` tokens, ``[batch, pos]`` int64. A random
        corruption is drawn per sequence from (``doc_ids[i]``, ``starts[i]``; default: the row index and 0), the
        same draw as the tolerance study's T2. ``keep_last`` tokens at the end (a metric's target span) keep
        their place among the swaps.

        Raises:
            ValueError: the corruption leaves some sequence's ids unchanged (nothing to patch)."""
        docs = list(range(n_seq)) if doc_ids is None else [int(d) for d in doc_ids]
        sts = [0] * len(docs) if starts is None else [int(s) for s in starts]
        if len(docs) != n_seq or len(sts) != n_seq:
            raise ValueError(f"doc_ids/starts need one entry per sequence ({n_seq})")
        ids = torch.stack([self.ids_for(n_pos, d, s, keep_last).to(torch.long) for d, s in zip(docs, sts)])
        if ids.shape != (n_seq, n_pos):
            raise ValueError(f"{self}: ids of shape {tuple(ids.shape)} for {n_seq} sequences of {n_pos} tokens")
        same = (ids == torch.arange(n_pos)).all(-1)
        if bool(same.any()):
            rows = [int(i) for i in torch.nonzero(same).flatten()[:5]]
            raise ValueError(f"{self} leaves the position ids of sequence(s) {rows} unchanged: there is no corrupted "
                             "run to patch (a larger fraction, a longer sequence, or another corruption)")
        return ids


@dataclass(frozen=True)
class Swaps(Corruption):
    """T2: the swaps of a fraction ``frac`` of disjoint adjacent pairs applied to the position ids only (≈ 2·frac
    of the tokens move), in ``[1, n − keep_last)`` — the tolerance study's T2 with the same seeds."""

    frac: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.frac <= 0.5:
            raise ValueError(f"Swaps(frac={self.frac}): the fraction of swapped pairs must be in (0, 0.5]")

    def ids_for(self, n_pos: int, doc: int, start: int, keep_last: int) -> Tensor:
        perm = adjacent_swap_permutation(n_pos, self.frac, start=1, stop=n_pos - keep_last,
                                         seed=swap_seed(0, doc, start, self.seed))
        return position_ids_for_permutation(perm)

    def __str__(self) -> str:
        return f"T2 swaps (p = {self.frac:g}, seed {self.seed})"


@dataclass(frozen=True)
class Gap(Corruption):
    """The last ``keep_last`` tokens (a metric's target span; ``suffix`` if given) moved ``gap`` positions away from
    the rest: every context→target distance grows by ``gap`` (choose it past the trained context to test length)."""

    gap: int = 1024
    suffix: int | None = None

    def __post_init__(self) -> None:
        if int(self.gap) != self.gap or self.gap < 1:
            raise ValueError(f"Gap(gap={self.gap!r}): the gap must be a positive integer")

    def ids_for(self, n_pos: int, doc: int, start: int, keep_last: int) -> Tensor:
        suffix = self.suffix or keep_last
        if not 0 < suffix < n_pos:
            raise ValueError(f"{self}: the moved suffix must hold 1 … {n_pos - 1} tokens, got {suffix} (pass suffix= "
                             "or a metric with a target span)")
        return gap_position_ids(n_pos - suffix, suffix, int(self.gap))

    def __str__(self) -> str:
        return f"gap of {self.gap} before the last {self.suffix or 'target'} tokens"


@dataclass(frozen=True)
class Shift(Corruption):
    """The null control: every id shifted by ``offset``. No distance changes, so under RoPE no metric may move
    (beyond float rounding of the angles); a patching map under it must be ≈ 0 everywhere."""

    offset: int = 1000
    changes_distances: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if int(self.offset) != self.offset or self.offset <= 0:
            raise ValueError(f"Shift(offset={self.offset!r}): the offset must be a positive integer")

    def ids_for(self, n_pos: int, doc: int, start: int, keep_last: int) -> Tensor:
        return torch.arange(n_pos) + int(self.offset)

    def __str__(self) -> str:
        return f"uniform shift by {self.offset} (null control)"


@dataclass(frozen=True, eq=False)
class IdMap(Corruption):
    """A user-supplied map: ``ids`` ``[pos]`` (every sequence) or ``[batch, pos]`` (one row per sequence)."""

    ids: Tensor | None = None
    name: str = "user id map"

    def __post_init__(self) -> None:
        if self.ids is None or torch.as_tensor(self.ids).ndim not in (1, 2):
            raise ValueError("IdMap needs ids of shape [pos] or [batch, pos]")
        t = torch.as_tensor(self.ids)
        if t.dtype.is_floating_point or bool((t < 0).any()):
            raise ValueError("IdMap ids must be non-negative integers")

    def position_ids(self, n_pos: int, *, n_seq: int = 1, doc_ids=None, starts=None, keep_last: int = 0) -> Tensor:
        t = torch.as_tensor(self.ids).to(torch.long)
        if t.shape[-1] != n_pos or (t.ndim == 2 and t.shape[0] != n_seq):
            raise ValueError(f"{self}: ids of shape {tuple(t.shape)} do not fit {n_seq} sequences of {n_pos} tokens "
                             "(clean and corrupted runs must have the same length)")
        t = t.expand(n_seq, n_pos)
        if bool((t == torch.arange(n_pos)).all(-1).any()):
            raise ValueError(f"{self} leaves some sequence's position ids unchanged: there is no corrupted run to patch")
        return t.clone()

    def __str__(self) -> str:
        return self.name


# ----------------------------------------------------------------------------- metrics


def target_nll(tokens: Int[Tensor, "batch pos"], target_len: int) -> Metric:
    """The default metric: mean next-token NLL of the last ``target_len`` tokens of each sequence, ``[batch]``.

    The returned callable takes the logits of the target span only (``[batch, target_len, d_vocab]``: the
    engine computes no other row, so a 262k vocabulary stays cheap) or full logits ``[batch, pos, d_vocab]``.
    Its ``target_len`` attribute tells a corruption which tokens to keep in place."""
    tokens = torch.as_tensor(tokens)
    n = tokens.shape[1]
    if not 0 < target_len < n:
        raise ValueError(f"target_len={target_len} must be in (0, {n})")
    target = tokens[:, n - target_len :]

    def metric(logits: Tensor) -> Tensor:
        if logits.shape[1] == n:
            logits = logits[:, n - target_len - 1 : n - 1]
        return row_nll(logits, target).float().mean(-1)

    metric.target_len = target_len  # type: ignore[attr-defined]
    metric.logit_rows = (n - target_len - 1, n - 1)  # type: ignore[attr-defined]
    return metric


@torch.no_grad()
def target_metrics(model: Any, tokens: Int[Tensor, "batch pos"], target_len: int) -> Metric:
    """The study's metric: per sequence ``[nll, kl_to_clean]`` (``[batch, 2]``, ``outputs`` names them) — the target
    span's mean NLL (:func:`target_nll`) and the mean KL(clean ‖ run) of its next-token distributions, the second
    metric reported beside the first (a patch can restore the NLL while moving the distribution elsewhere).
    Runs one clean forward for the reference distributions."""
    spec, _ = probe_hooks(model)
    tokens = check_tokens(model, tokens, spec)
    nll = target_nll(tokens, target_len)
    n = tokens.shape[1]
    clean = _run_logits(model, tokens, [], nll.logit_rows).float().log_softmax(-1)  # type: ignore[attr-defined]
    p_clean = clean.exp()

    def metric(logits: Tensor) -> Tensor:
        lg = logits[:, n - target_len - 1 : n - 1] if logits.shape[1] == n else logits
        lp = lg.float().log_softmax(-1)
        kl = (p_clean * (clean - lp)).sum(-1).mean(-1)
        return torch.stack([nll(lg), kl], -1)

    metric.target_len = target_len  # type: ignore[attr-defined]
    metric.logit_rows = nll.logit_rows  # type: ignore[attr-defined]
    metric.outputs = ("nll", "kl_to_clean")  # type: ignore[attr-defined]
    return metric


def _run_logits(model: Any, batch: Tensor, hooks: list, rows: tuple[int, int] | None,
                resid_at: tuple[int, Tensor] | None = None) -> Tensor:
    """Logits of a forward with ``hooks``: only ``rows`` (start, stop) where the model lets the final residual be
    read; ``resid_at=(L, resid)`` resumes at block ``L`` (hooks below it are dropped: they would not fire). Run a
    chunk at a time through the model's cache beyond 2 048 tokens where every hook is ``chunk_safe`` and ``rows``
    are given (:func:`posgen_tl.hooks.positions.chunked_logit_rows`)."""
    chunk = forward_chunk(model, batch.shape[1], hooks, resumed=resid_at is not None) if rows else 0
    if chunk:
        return chunked_logit_rows(model, batch, chunk, hooks, rows)  # type: ignore[arg-type]
    check_forward_fits(model, batch.shape[1], batch.shape[0], "activation patching")
    store: dict = {}
    fin = final_residual_hook(model, store, *rows) if rows is not None else None
    if resid_at is not None:
        skips_blocks(model)  # once per model, before any hook is attached
        hooks = hooks_from(hooks, resid_at[0])
    heap = large_blocks_kept() if batch.device.type == "cpu" else contextlib.nullcontext()  # (hooks/heap.py)
    with heap, model.hooks(fwd_hooks=hooks + ([fin] if fin else [])):
        try:
            logits = model(batch) if resid_at is None else forward_from(model, resid_at[1], resid_at[0], tokens=batch)
        except StopForward:
            return model.unembed(store["resid"])
    return logits if rows is None else logits[:, rows[0] : rows[1]]


# ----------------------------------------------------------------------------- groups


#: one patch: ``{layer: heads}`` (query heads; kv heads for ``rot_k``), every position
Group = Mapping[int, Sequence[int]]


@dataclass(frozen=True)
class PatchSweep:
    """What :func:`patch_sweep` measured on one batch.

    Attributes:
        values: the metric with each group patched, ``[group]`` or ``[group, batch]``.
        clean / corrupted: the metric of the two unpatched runs (``[]`` or ``[batch]``).
        position_ids: the corrupted run's ids ``[batch, pos]``; ``direction``, ``quantity``, ``corruption``.
        source: what the source run recorded (``{layer: tensor}``, or the pre-rotation q/k of a logit term),
            reusable by another sweep of the same batch (``reuse=``).
        prefix: the base run's residuals entering the blocks where the patched forwards resumed
            (``{layer: [batch, pos, d_model]}``; every block below a group's first patched layer is the base
            run's, so it is not computed again).
        replicas: the most groups one patched forward stacked (the ``replicas`` asked for, or the default).
    """

    values: Tensor
    clean: Tensor
    corrupted: Tensor
    position_ids: Tensor
    direction: str
    quantity: str
    corruption: str
    source: dict = field(default_factory=dict, repr=False)
    prefix: dict = field(default_factory=dict, repr=False)
    replicas: int = 0


def default_replicas(model: Any, n_heads: int, n_seq: int, n: int, rows: int | None = None, logit_rows: int = 0) -> int:
    """The replicas a patched forward stacks by default: the heads of one layer, fewer where that many copies of
    ``n_seq`` sequences of ``n`` tokens would take more than their share of the free memory
    (:func:`posgen_tl.hooks.memory.sequences_per_forward`, ``rows`` query positions at a time in a chunked forward;
    ``logit_rows`` the rows of float32 logits the metric reads, counted twice — the logits and their log-softmax: a
    262 144-token vocabulary makes them the larger part; at least one)."""
    fit = sequences_per_forward(model, n, rows=rows, extra=logit_row_bytes(model, logit_rows))
    return n_heads if fit is None else max(1, min(n_heads, fit // max(1, n_seq)))


def _check_metric(v: Any, n_seq: int, outputs: Sequence[str] | None = None) -> Tensor:
    if not isinstance(v, Tensor):
        v = torch.as_tensor(v)
    want = (n_seq, len(outputs)) if outputs else None
    if want is not None and tuple(v.shape) != want:
        raise ValueError(f"the metric returned shape {tuple(v.shape)}: it declares outputs {list(outputs or [])}, so "
                         f"it must return [{n_seq}, {len(outputs or [])}]")
    if want is None and (v.ndim > 1 or (v.ndim == 1 and v.shape[0] != n_seq)):
        raise ValueError(f"the metric returned shape {tuple(v.shape)}: it must return a scalar or one value per "
                         f"sequence [{n_seq}]")
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"the metric returned a non-finite value ({v.flatten()[:4].tolist()}): patching results "
                         "would be meaningless")
    return v.detach().float().cpu()


def _run_metric(model: Any, tokens: Tensor, metric: Metric, hooks: list, n_rep: int,
                resid_at: tuple[int, Tensor] | None = None) -> Tensor:
    """The metric of each replica of a forward on ``tokens`` repeated ``n_rep`` times: ``[replica, *metric]``
    (``resid_at=(L, resid)``: resumed at block ``L`` from ``resid`` repeated likewise)."""
    at = None if resid_at is None else (resid_at[0], resid_at[1].repeat(n_rep, 1, 1))
    logits = _run_logits(model, tokens.repeat(n_rep, 1), hooks, getattr(metric, "logit_rows", None), at)
    b = tokens.shape[0]
    outs = getattr(metric, "outputs", None)
    return torch.stack([_check_metric(metric(logits[r * b : (r + 1) * b]), b, outs) for r in range(n_rep)])


def _groups_masks(groups: Sequence[Group], n_pos: int, n_idx: int, spec: Any, kv: bool) -> dict[int, Tensor]:
    masks: dict[int, Tensor] = {}
    for r, g in enumerate(groups):
        for layer, heads in g.items():
            li = spec.layer_index(layer)
            m = masks.setdefault(li, torch.zeros(len(groups), n_pos, n_idx, dtype=torch.bool))
            for h in heads:
                m[r, :, spec.head_index(h, kv=kv)] = True
    return masks


@torch.no_grad()
def patch_sweep(
    model: Any, corrupted: Corruption, clean: Int[Tensor, "batch pos"], metric: Metric, *, quantity: str,
    groups: Sequence[Group], direction: Direction = "denoising", k_means: Mapping[int, Tensor] | None = None,
    doc_ids: Sequence[int] | None = None, starts: Sequence[int] | None = None, replicas: int | None = None,
    verbose: bool = False, reuse: PatchSweep | None = None,
) -> PatchSweep:  # fmt: skip
    """Patch ``quantity`` of each group of heads, one group per replica, and return every metric (:class:`PatchSweep`).

    ``direction="denoising"``: base = the corrupted run, source = the clean run; ``"noising"``: the reverse.
    The source run's baseline forward records the quantity in every layer the groups touch; then forwards of up to
    ``replicas`` stacked copies of the batch each patch one group per copy (default ``replicas``: the number of heads
    per layer, fewer where their attention maps would outgrow half the free memory — long sequences,
    :mod:`posgen_tl.hooks.memory`) — groups with the same first patched layer together, ``ceil(count / replicas)`` forwards per such
    layer —, each resumed at that layer from the base run's residual there (:mod:`posgen_tl.hooks.reentry`: the
    blocks below are the base run's and are not computed again; the batch keeps one ``[batch, pos, d_model]`` residual
    per such layer while it runs). Beyond 2 048 tokens a ``rot_q`` / ``rot_k`` sweep whose metric reads only its
    ``logit_rows`` runs every forward a chunk at a time through the model's cache instead (:mod:`posgen_tl.hooks.chunked`:
    memory O(chunk · n) per layer; a chunked forward resumes nowhere, so the patched ones compute every block).
    The logit terms need ``k_means`` (the global mean pre-rotation key per layer,
    :func:`posgen_tl.hooks.edits.key_means` on reference documents).
    ``reuse``: an earlier sweep of the same batch, quantity kind, direction and corrupted ids (e.g. the same
    logit term with another k̄: the recorded q/k do not depend on k̄) — its baselines and recording are taken
    instead of two forwards.

    Raises:
        ValueError: an unknown quantity or direction, an empty group list or a group that names no layer, a
            metric that returns a non-scalar or a non-finite value, a corruption that leaves the ids unchanged.
        IndexRangeError: a layer or head outside the model.
        CaptureError: the model cannot deliver the quantity (named)."""
    if direction not in ("denoising", "noising"):
        raise ValueError(f"direction must be 'denoising' (clean → corrupted) or 'noising' (corrupted → clean), "
                         f"got {direction!r}")
    if not groups:
        raise ValueError("no group of heads to patch")
    empty = [i for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(f"group {empty[0]} of the sweep patches no layer: each group maps layers to heads")
    site = patch_site(model, quantity)
    spec, _ = probe_hooks(model)
    tokens = check_tokens(model, clean, spec)
    b, n = tokens.shape
    n_idx = spec.n_kv_heads if site.kv else spec.n_heads
    layers = sorted(_groups_masks(groups, n, n_idx, spec, site.kv))
    require_exact(model, layers, "activation patching")
    if quantity in TERMS and (k_means is None or any(layer not in k_means for layer in layers)):
        raise ValueError(f"patching {quantity} needs the global mean key k̄ of layers {layers} (k_means=; "
                         "posgen_tl.hooks.edits.key_means on reference documents)")
    ids = corrupted.position_ids(n, n_seq=b, doc_ids=doc_ids, starts=starts,
                                 keep_last=int(getattr(metric, "target_len", 0))).to(tokens.device)
    # the base run is the one patched; the source run is recorded once, in its own baseline forward
    src_ids, base_ids = (None, ids) if direction == "denoising" else (ids, None)
    store: dict[int, Any] = {}
    rec = record_hooks(model, quantity, layers, store)
    rep = reposition_hooks(model, ids)
    # long sequences: every forward a chunk at a time through the cache (rot_q/rot_k), none resumed from a residual
    chunked = quantity in CHUNKABLE and bool(getattr(metric, "logit_rows", None)) and \
        auto_chunk(model, n, -1, memory_only=True) > 0
    lr = getattr(metric, "logit_rows", None) or (0, n)
    n_rep = max(1, int(replicas)) if replicas else default_replicas(model, spec.n_heads, b, n, CHUNK if chunked else None,
                                                                    lr[1] - lr[0])
    order = _parts(groups, n_rep, spec)  # [(first patched layer, group indices)] per patched forward
    starts = [] if chunked else sorted({start for start, _ in order} - {0})
    base_store: dict[int, list[Tensor]] = {}
    base_rec = resid_hooks(starts, base_store)  # the base run's residuals, where the patched forwards resume
    if reuse is not None:
        if (reuse.quantity, reuse.direction) != (quantity, direction) or not torch.equal(reuse.position_ids, ids.cpu()) \
                or not set(layers) <= set(reuse.source):
            raise ValueError("reuse= needs a sweep of the same quantity, direction, corrupted ids and layers")
        store, clean_m, corr_m = reuse.source, reuse.clean, reuse.corrupted
        prefix = dict(reuse.prefix)
        if not set(starts) <= set(prefix):  # the earlier sweep resumed elsewhere: record the base run once more
            _run_metric(model, tokens, metric, (list(rep) if direction == "denoising" else []) + base_rec, 1)
            prefix.update(recorded(base_store))
    elif direction == "denoising":
        clean_m = _run_metric(model, tokens, metric, rec.around(), 1)[0]
        corr_m = _run_metric(model, tokens, metric, list(rep) + base_rec, 1)[0]
        prefix = recorded(base_store)
    else:
        clean_m = _run_metric(model, tokens, metric, base_rec, 1)[0]
        corr_m = _run_metric(model, tokens, metric, rec.around(rep), 1)[0]
        prefix = recorded(base_store)
    out = []
    for start, idx in tqdm(order, desc=f"patching {quantity}", disable=not verbose, leave=False):
        part = [groups[i] for i in idx]
        masks = _groups_masks(part, n, n_idx, spec, site.kv)
        ph = patch_hooks(model, quantity, masks, store, k_means=k_means, base_positions=base_ids,
                         source_positions=src_ids)
        base_rep = reposition_hooks(model, base_ids.repeat(len(part), 1)) if base_ids is not None else []
        # every block below the first patched layer is the base run's: resume there
        out.append(_run_metric(model, tokens, metric, ph.around(base_rep), len(part),
                               None if start == 0 or chunked else (start, prefix[start])))
    values = torch.empty_like(stacked := torch.cat(out))
    values[torch.tensor([i for _, idx in order for i in idx])] = stacked  # back in the order of ``groups``
    return PatchSweep(values, clean_m, corr_m, ids.cpu(), direction, quantity, str(corrupted), store, prefix,
                      max(len(idx) for _, idx in order))


def _parts(groups: Sequence[Group], n_rep: int, spec: Any) -> list[tuple[int, list[int]]]:
    """The patched forwards of a sweep: per forward its first patched layer and the indices of its groups in
    ``groups``. Groups whose first
    patched layer is the same share forwards (a forward resumes at its groups' first layer, so a group that starts
    higher would pay for the blocks in between), in chunks of at most ``n_rep`` that differ in size by at most one;
    the forwards go in the order of their first layer. This minimises the blocks computed, not the forwards: a sweep
    of whole layers runs one forward per layer (before, ``n_rep`` layers shared one forward from the lowest), and the
    base run keeps one residual ``[batch, pos, d_model]`` per layer that starts a forward."""
    by_start: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_start.setdefault(min(spec.layer_index(layer) for layer in g), []).append(i)
    out: list[tuple[int, list[int]]] = []
    for start in sorted(by_start):
        idx = by_start[start]
        k = -(-len(idx) // n_rep)
        out += [(start, idx[j * len(idx) // k : (j + 1) * len(idx) // k]) for j in range(k)]
    return out


# ----------------------------------------------------------------------------- the generic function + partials


def generic_position_patch(
    model: Any, corrupted: Corruption, clean: Int[Tensor, "batch pos"], metric: Metric, *, quantity: str,
    by: Literal["head", "layer"] = "head", layers: Sequence[int] | None = None, direction: Direction = "denoising",
    k_means: Mapping[int, Tensor] | None = None, verbose: bool = True, **kwargs: Any,
) -> Tensor:  # fmt: skip
    """The metric with ``quantity`` patched per (layer, head) — ``[n_layers, n_heads]`` (``rot_k``: kv heads) —
    or per whole layer (``by="layer"``: ``[n_layers]``), ``(…, batch)`` when the metric returns one value per
    sequence. Rows of layers not in ``layers`` are NaN. Everything else as :func:`patch_sweep`."""
    spec, _ = probe_hooks(model)
    site = patch_site(model, quantity)
    n_idx = spec.n_kv_heads if site.kv else spec.n_heads
    want = spec.layer_indices(layers)
    if by == "head":
        groups: list[Group] = [{layer: [h]} for layer in want for h in range(n_idx)]
    elif by == "layer":
        groups = [{layer: list(range(n_idx))} for layer in want]
    else:
        raise ValueError(f"by must be 'head' or 'layer', got {by!r}")
    sw = patch_sweep(model, corrupted, clean, metric, quantity=quantity, groups=groups, direction=direction,
                     k_means=k_means, verbose=verbose, **kwargs)
    shape = (spec.n_layers, n_idx) if by == "head" else (spec.n_layers,)
    out = torch.full((*shape, *sw.values.shape[1:]), math.nan)
    vals = sw.values.reshape(len(want), *(() if by == "layer" else (n_idx,)), *sw.values.shape[1:])
    out[want] = vals
    return out


def _partial(quantity: str, doc: str) -> Callable[..., Tensor]:
    f = functools.partial(generic_position_patch, quantity=quantity, by="head")
    f.__doc__ = doc
    return f


get_act_patch_rot_q = _partial("rot_q", """``get_act_patch_rot_q(model, corrupted, clean, metric, **kw)``: each head's
ROTATED QUERIES patched (all positions), ``[n_layers, n_heads]`` (:func:`generic_position_patch`).""")
get_act_patch_rot_k = _partial("rot_k", """``get_act_patch_rot_k(model, corrupted, clean, metric, **kw)``: each key/value
head's ROTATED KEYS patched (GQA: one kv head serves its group), ``[n_layers, n_kv_heads]``.""")
get_act_patch_pos_term = _partial("pos_term", """``get_act_patch_pos_term(model, corrupted, clean, metric, *, k_means,
**kw)``: each head's POSITIONAL TERM only — logits ``f_source + g_base + remainder_base`` with
``f = s·q_iᵀR_{p_j−p_i}k̄`` — ``[n_layers, n_heads]``.""")
get_act_patch_sem_term = _partial("sem_term", """``get_act_patch_sem_term(model, corrupted, clean, metric, *, k_means,
**kw)``: each head's SEMANTIC TERM only — logits ``f_base + g_source + remainder_base`` with ``g = s·q_iᵀ(k_j − k̄)``
— ``[n_layers, n_heads]``.""")
get_act_patch_pattern = _partial("pattern", """``get_act_patch_pattern(model, corrupted, clean, metric, **kw)``: each
head's ATTENTION PATTERN patched, ``[n_layers, n_heads]``.""")


def get_act_patch_layer(model: Any, corrupted: Corruption, clean: Tensor, metric: Metric, *, quantity: str = "rot_q",
                        **kwargs: Any) -> Tensor:
    """``quantity`` of ALL heads of a layer patched together, per layer: ``[n_layers]`` (backup heads can hide a
    single head's effect; this is the grouped patch beside the per-head maps)."""
    return generic_position_patch(model, corrupted, clean, metric, quantity=quantity, by="layer", **kwargs)


def get_act_patch_heads(model: Any, corrupted: Corruption, clean: Tensor, metric: Metric,
                        heads: Sequence[tuple[int, int]], *, quantity: str = "rot_q", **kwargs: Any) -> Tensor:
    """``quantity`` of the given ``(layer, head)`` pairs patched together (e.g. the top-k heads of a map): the
    metric, ``[]`` or ``[batch]``."""
    if not heads:
        raise ValueError("heads is empty: name at least one (layer, head)")
    group: dict[int, list[int]] = {}
    for layer, h in heads:
        group.setdefault(int(layer), []).append(int(h))
    return patch_sweep(model, corrupted, clean, metric, quantity=quantity, groups=[group], **kwargs).values[0]


@torch.no_grad()
def baselines(model: Any, corrupted: Corruption, clean: Tensor, metric: Metric, *,
              doc_ids: Sequence[int] | None = None, starts: Sequence[int] | None = None) -> dict[str, Tensor]:
    """``{"clean", "corrupted"}``: the metric of the two unpatched runs (``[]`` or ``[batch]``)."""
    got = corrupted_metrics(model, {"corrupted": corrupted}, clean, metric, doc_ids=doc_ids, starts=starts)
    return {"clean": got["clean"], "corrupted": got["corrupted"]}


def corrupted_metrics(model: Any, corruptions: Mapping[str, Corruption], clean: Tensor, metric: Metric, *,
                      doc_ids: Sequence[int] | None = None, starts: Sequence[int] | None = None) -> dict[str, Tensor]:
    """The metric of the clean run (key ``"clean"``, natural ids) and of each named corruption's run (its name), from
    ONE clean forward and one forward per corruption — ``[]`` or ``[batch]`` each.

    Raises:
        ValueError: a corruption is named ``"clean"``."""
    if "clean" in corruptions:
        raise ValueError("a corruption cannot be named 'clean' (that key holds the clean run's metric)")
    spec, _ = probe_hooks(model)
    tokens = check_tokens(model, clean, spec)
    out = {"clean": _run_metric(model, tokens, metric, [], 1)[0]}
    for name, corr in corruptions.items():
        ids = corr.position_ids(tokens.shape[1], n_seq=tokens.shape[0], doc_ids=doc_ids, starts=starts,
                                keep_last=int(getattr(metric, "target_len", 0))).to(tokens.device)
        out[name] = _run_metric(model, tokens, metric, reposition_hooks(model, ids), 1)[0]
    return out


def normalised_recovery(patched: Tensor, clean: Tensor, corrupted: Tensor, direction: Direction = "denoising") -> Tensor:
    """``(corrupted − patched) / (corrupted − clean)`` (denoising: 1 = the patch repairs all the damage) or
    ``(patched − clean) / (corrupted − clean)`` (noising: 1 = the patch alone does all of it). NaN where the
    corruption did no damage (``corrupted == clean``): recovery is undefined there, not 0."""
    gap = corrupted - clean
    num = corrupted - patched if direction == "denoising" else patched - clean
    return torch.where(gap != 0, num / torch.where(gap != 0, gap, torch.ones_like(gap)), torch.full_like(gap, math.nan))

