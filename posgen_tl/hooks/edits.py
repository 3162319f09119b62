"""Interventions on pre-rotation keys/queries (docs/method.md §5), as plain TransformerLens hooks.

Like TransformerLens' ``patching.py``: one generic hook builder (:func:`intervention_hooks`)
and small ``functools.partial`` specialisations (:func:`enforce_hooks`, :func:`destroy_hooks`,
...). Every builder returns ``list[(hook_name, fn)]``, usable as

    with model.hooks(fwd_hooks=intervention_hooks(model, iv, k_means)):
        model(tokens)
    model.run_with_hooks(tokens, fwd_hooks=intervention_hooks(model, iv, k_means))

Position hooks (T2 by re-rotation, distance caps) live in :mod:`posgen_tl.hooks.positions`, logit
substitution (LM-Infinite, disentangled, sufficiency) in :mod:`posgen_tl.hooks.logits`; only the
modules of :mod:`posgen_tl.hooks` know hook names.

Band picture (docs/method.md §1, §5): each band ``m`` of a pre-rotation key is a complex number
``k^(m)``; ``k̄^(m)`` is the band of the mean key of that kv-group (:func:`key_means`).

* ``enforce``: ``k^(m) ← k̄^(m)`` (token-invariant keys: D3 exact in those bands);
* ``destroy``: ``k^(m) ← k^(m) − k̄^(m)`` (remove the offset);
* ``rephase``: ``k^(m) ← (k^(m) − k̄^(m)) + k̄^(m)·e^{iαφ_m}`` with a fixed random phase
  ``φ_m`` per (layer, head, band) drawn from ``seed``; ``alpha`` scales the ANGLE, so the
  offset keeps its norm ``|k̄^(m)|`` (and ρ) at every strength (docs/method.md §5 control C3);
* ``noise``: ``k^(m) ← k^(m) + α·|k̄^(m)|·e^{iψ}`` with a random phase ``ψ`` per (position,
  head, band) drawn from ``seed`` and the layer: per token, a change with exactly the norm of
  ``destroy``'s change ``−α·k̄^(m)`` in the same bands, but no constant direction (control C4);
* ``random_bands`` (control): the change vector that ``base`` (enforce/destroy/rephase)
  would make in ``bands``/``heads`` is TRANSPLANTED, complex entry by complex entry (each
  entry times a random unit phase per position when ``scramble``), into
  ``len(bands)`` other bands chosen at random (seeded per layer, drawn from the bands not in
  ``bands`` when there are enough) and, when ``heads`` is given, into the same number of
  randomly chosen heads. Per token the change therefore has exactly the intervention's norm
  at the same ``alpha``; it lands where the intervention does not act;
* ``noop``: hooks that return ``None`` (the tensor is not touched; logits bit-identical).

Strength: ``k ← k + alpha·(k_intervened − k)`` on the selected bands/heads only (``rephase``:
the angle; ``noise``: the norm, as above); the other coordinates (and pass-through dims
``>= rotary_dim``) are returned bit-for-bit. ``alpha > 1`` (over-driving the edit, e.g.
``k − 1.5·k̄``) is allowed for every kind except ``enforce``, so that a control can be matched
to an intervention's clean-NLL damage; tables report the alpha used.

Random phases (``random_bands`` scramble, ``noise``) are drawn per POSITION index (not per
sequence): the edited model is one fixed function, identical for every sequence and batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Complex, Float, Int
from torch import Tensor

from posgen_tl.hooks.capture import CaptureError, from_heads, pre_rotation, probe_hooks, stash_shape, to_heads
from posgen_tl.hooks.chunked import chunk_memo, chunk_range, chunk_safe, hooks_chunk_safe, memo_room
from posgen_tl.hooks.gate import require_exact
from posgen_tl.hooks.stream import stream_qk
from posgen_tl.maths.band_stats import BandStats
from posgen_tl.maths.rope import LayerRope, from_bands, to_bands

__all__ = [
    "Intervention",
    "key_means",
    "reference_key_means",
    "feature_means",
    "shared_means",
    "intervention_hooks",
    "hooks_on_rows",
    "kind_hooks",
    "enforce_hooks",
    "destroy_hooks",
    "rephase_hooks",
    "random_bands_hooks",
    "noise_hooks",
    "noop_hooks",
    "KINDS",
    "change_vectors",
    "CHANGES",
    "enforce_change",
    "destroy_change",
    "rephase_change",
    "noise_change",
]

Kind = Literal["enforce", "destroy", "rephase", "random_bands", "noise", "noop"]
KINDS = ("enforce", "destroy", "rephase", "random_bands", "noise", "noop")
HookList = list[tuple[str, Callable]]


@dataclass(frozen=True)
class Intervention:
    """What to change in the pre-rotation keys (``target='k'``) or queries (``'q'``).

    Attributes:
        kind: ``'enforce' | 'destroy' | 'rephase' | 'random_bands' | 'noise' | 'noop'``.
        bands: band indices (band 0 = fastest) the intervention acts on.
        heads: kv-groups (keys) or query heads (queries); ``None`` = all.
        layers: layers; ``None`` = all.
        alpha: strength, 0 = clean, 1 = fully intervened. ``enforce`` needs ``[0, 1]``; the
            other kinds accept ``alpha > 1`` (the change is then ``alpha`` × the unit change:
            over-driven), so that a control's clean damage can be matched to an intervention's.
        target: ``'k'`` or ``'q'``.
        seed: seeds rephase phases and the random control's band/head choice.
        label: free text for tables.
        base: for ``random_bands``, the kind whose change vector is transplanted.
        scramble: for ``random_bands``, multiply each transplanted complex entry by a random
            unit phase ``e^{iψ}`` drawn per (position, head, band) from ``seed`` (norm kept
            exactly). Without it a constant change (``destroy``'s ``−k̄``) moved into slow bands
            is a near row-constant logit shift that softmax ignores, and no strength reaches
            the intervention's damage.
        row_seeds: one seed per batch row replacing ``seed`` for that row's random draws (the
            causal test draws its random controls afresh per document: the seed of the row's
            document). ``None``: every row uses ``seed``.
    """

    kind: Kind
    bands: Sequence[int] = ()
    heads: Sequence[int] | None = None
    layers: Sequence[int] | None = None
    alpha: float = 1.0
    target: Literal["k", "q"] = "k"
    seed: int = 0
    label: str = ""
    base: Literal["enforce", "destroy", "rephase"] = "destroy"
    scramble: bool = True
    row_seeds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown intervention kind {self.kind!r}")
        if self.target not in ("k", "q"):
            raise ValueError(f"target must be 'k' or 'q', got {self.target!r}")
        if self.base not in ("enforce", "destroy", "rephase"):
            raise ValueError(f"random_bands base must be enforce/destroy/rephase, got {self.base!r}")
        hi = 1.0 if self.kind == "enforce" else math.inf
        if not (0.0 <= float(self.alpha) <= hi) or math.isnan(self.alpha):
            raise ValueError(f"alpha must be in [0, {hi}] for {self.kind}, got {self.alpha}")
        if self.kind != "noop" and not len(self.bands):
            raise ValueError(f"{self.kind}: no bands given")
        if not self.label:
            object.__setattr__(self, "label", f"{self.kind} {self.target} bands {_span(self.bands)}")

    def with_alpha(self, alpha: float) -> Intervention:
        """A copy at strength ``alpha``."""
        return dataclasses.replace(self, alpha=float(alpha))

    def with_row_seeds(self, seeds: Sequence[int] | None) -> Intervention:
        """A copy whose random draws use ``seeds[i]`` for batch row ``i`` (``None``: ``seed`` for all)."""
        return dataclasses.replace(self, row_seeds=None if seeds is None else tuple(int(s) for s in seeds))


def _span(b: Sequence[int]) -> str:
    b = sorted(int(x) for x in b)
    if b and b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}–{b[-1]}"
    return ",".join(map(str, b))


# ----------------------------------------------------------------------------- means


def feature_means(
    model: Any, tokens: Int[Tensor, "batch pos"], layers: Sequence[int] | None = None, *,
    sink: int = 1, target: Literal["k", "q"] = "k", batch_size: int = 8, progress: bool | str = False,
    extra_hooks: Sequence[tuple[str, Callable]] = (), dtype: torch.dtype = torch.float32, chunk: int = -1,
) -> dict[int, Float[Tensor, "head d_head"]]:  # fmt: skip
    """Mean pre-rotation key (or query) per layer and head, first ``sink`` positions excluded —
    the ``k̄`` of docs/method.md §2 and §5 (the package's one implementation of it).

    Streamed with :class:`posgen_tl.maths.band_stats.BandStats` (float64 accumulation), so memory does
    not grow with ``tokens``. For the *global* k̄ pass tokens from documents disjoint from the
    analysed ones (:func:`posgen_tl.io.corpus.reference_windows`). ``extra_hooks`` are attached
    during the pass (the means then see their edit). ``chunk``: the forward's positions per chunk
    (:func:`posgen_tl.hooks.chunked.auto_chunk`; −1 automatic, 0 one whole forward).

    Returns:
        ``{layer: Float[Tensor, "kv_head d_head"]}`` (``"head_index d_head"`` for queries) in ``dtype``, on the CPU.
    """
    key = _means_key(model, tokens, layers, sink, target, batch_size, dtype, chunk) \
        if _MEANS_SCOPES and not extra_hooks and not _transient_hooks(model) else None
    kept = _MEANS.get(key) if key is not None else None
    if kept is not None and kept[0] is model:
        return {layer: m.clone() for layer, m in kept[1].items()}
    stats: dict[tuple[int, ...], BandStats] = {}  # per stack of layers (stacked on the head axis on a GPU)

    def acc(c) -> None:
        x = c.k if target == "k" else c.q
        if c.layer_ids not in stats:
            stats[c.layer_ids] = BandStats(x.shape[-2], x.shape[-1], c.rope.rotary_dim, c.rope.layout, device=x.device)
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        mask[:, :sink] = False
        stats[c.layer_ids].update(x, mask)

    label = progress if isinstance(progress, str) else "means"
    from posgen_tl.hooks.chunked import auto_chunk  # noqa: PLC0415

    stream_qk(model, tokens, acc, layers, batch_size=batch_size, extra_hooks=extra_hooks,
              progress=label if progress else False, chunk=auto_chunk(model, tokens.shape[-1], chunk, extra_hooks),
              stack=0)  # layers stacked where that saves time (a GPU)
    out: dict[int, Tensor] = {}
    for group, st in stats.items():  # a stack's means cut back into its layers'
        out.update(zip(group, torch.chunk(st.mean().to(dtype).cpu(), len(group))))  # on the CPU, as documented
    out = dict(sorted(out.items()))
    if key is not None:
        _MEANS[key] = (model, {layer: m.clone() for layer, m in out.items()})
    return out


#: the means :func:`feature_means` computed inside :func:`shared_means` scopes: key → (model, {layer: mean})
_MEANS: dict[tuple, tuple[Any, dict[int, Tensor]]] = {}
#: how many :func:`shared_means` scopes are open (the memo is used only while one is)
_MEANS_SCOPES: list[int] = []


def _means_key(model: Any, tokens: Tensor, layers: Sequence[int] | None, sink: int, target: str, batch_size: int,
               dtype: torch.dtype, chunk: int) -> tuple:
    """What a pass of :func:`feature_means` depends on besides the model's weights: the tokens (their digest), the
    layers, the sink, the feature, the batch size (the forward's rounding) and the dtype and chunk."""
    from posgen_tl.io.sampling import tokens_fingerprint  # noqa: PLC0415

    t = torch.as_tensor(tokens)
    every = range(probe_hooks(model)[0].n_layers) if layers is None else layers  # None and every layer read alike
    return (id(model), tokens_fingerprint(t), tuple(t.shape), tuple(int(x) for x in every), int(sink), target,
            int(batch_size), str(dtype), int(chunk))


def _transient_hooks(model: Any) -> bool:
    """Whether a hook other than a permanent one is attached to ``model`` (a caller's ``model.hooks(...)``): a mean
    computed under it is not the model's own and is neither kept nor taken."""
    points = getattr(model, "hook_dict", None)
    if not isinstance(points, dict):
        return True  # hooks that cannot be inspected count as attached
    return any(not getattr(h, "is_permanent", False) for hp in points.values()
               for h in list(getattr(hp, "fwd_hooks", ())) + list(getattr(hp, "bwd_hooks", ())))


@contextlib.contextmanager
def shared_means() -> Iterator[None]:
    """A scope in which :func:`feature_means` (so :func:`key_means` and :func:`reference_key_means`) computes each
    mean once: a second call with the same model object, tokens, layers, sink, feature, batch size, dtype and chunk
    (and no ``extra_hooks``) gets copies of the first's numbers — the same numbers its own pass would give. For a run
    that owns its models while several experiments read the same reference windows (``posgen-tl report``); the
    models' weights must not change inside the scope. The kept means are dropped when the outermost scope closes."""
    _MEANS_SCOPES.append(1)
    try:
        yield
    finally:
        _MEANS_SCOPES.pop()
        if not _MEANS_SCOPES:
            _MEANS.clear()


key_means = functools.partial(feature_means, target="k")
key_means.__doc__ = """``key_means(model, tokens, layers=None, *, sink=1, batch_size=8, dtype=torch.float32)``:
the mean pre-rotation key ``k̄`` per layer, ``{layer: Float[Tensor, "kv_head d_head"]}``
(:func:`feature_means` with ``target="k"``)."""


# ----------------------------------------------------------------------------- the edit


def _phases(seed: int, layer: int, n_heads: int, n_bands: int) -> Float[Tensor, "head band"]:
    g = torch.Generator().manual_seed(1_000_003 * int(seed) + layer)
    return torch.rand(n_heads, n_bands, generator=g, dtype=torch.float64).float() * (2 * math.pi)


def _control_choice(iv: Intervention, layer: int, n_heads: int, n_bands: int,
                    seed: int | None = None) -> tuple[list[int], list[int] | None]:
    """Random target bands (and heads) of the random_bands control, seeded per layer (and row)."""
    g = torch.Generator().manual_seed(7_919 * int(iv.seed if seed is None else seed) + 31 * layer + 1)
    bands = [int(b) for b in iv.bands]
    others = [b for b in range(n_bands) if b not in bands]
    pool = others if len(others) >= len(bands) else list(range(n_bands))
    new_bands = [pool[i] for i in torch.randperm(len(pool), generator=g)[: len(bands)].tolist()]
    new_heads = None
    if iv.heads is not None:
        heads = [int(h) for h in iv.heads]
        rest = [h for h in range(n_heads) if h not in heads]
        hp = rest if len(rest) >= len(heads) else list(range(n_heads))
        new_heads = [hp[i] for i in torch.randperm(len(hp), generator=g)[: len(heads)].tolist()]
    return new_bands, new_heads


def _per_position(g: torch.Generator, n_pos: int, rest: tuple[int, ...]) -> Float[Tensor, "pos ..."]:
    """Uniform draws ``[n_pos, *rest]`` (float64 drawn, float32 returned) for the positions of this forward — in a
    chunk of a chunked forward (:func:`posgen_tl.hooks.chunked.chunk_range`) the chunk's rows of the whole sequence's
    draw, so a chunked forward draws what the whole forward draws. ``g`` must be freshly seeded: the whole sequence's
    table is drawn once per forward and kept in its :func:`~posgen_tl.hooks.chunked.chunk_memo` under that seed."""
    c0, c1, n = chunk_range(n_pos)
    memo = chunk_memo()
    if memo is None or c1 - c0 == n:
        return torch.rand((n, *rest), generator=g, dtype=torch.float64)[c0:c1].float()
    key = ("per_position", g.initial_seed(), n, rest)  # the generator is seeded afresh for each draw
    table = memo.get(key)
    if table is None:
        table = torch.rand((n, *rest), generator=g, dtype=torch.float64).float()
        if memo_room(memo, table.numel() * table.element_size()):
            memo[key] = table
    return table[c0:c1].clone()


# One small pure function per edit kind: the complex change of the selected bands ``zs``
# ``[batch, pos, head, band]`` given the offset ``zb`` ``[head, band]`` of the same selection, at
# strength ``alpha``. ``heads``/``bands`` index the selection (for per-band random draws).


def enforce_change(zs: Tensor, zb: Tensor, alpha: float, **_: Any) -> Tensor:
    """``enforce``: ``α·(k̄^(m) − k^(m))`` — the token's band moved towards the mean key (D3 exact at α = 1)."""
    return (zb.expand_as(zs) - zs) * alpha


def destroy_change(zs: Tensor, zb: Tensor, alpha: float, **_: Any) -> Tensor:
    """``destroy``: ``−α·k̄^(m)`` — the offset removed, the token's own variation kept."""
    return (-zb).expand_as(zs) * alpha


def rephase_change(zs: Tensor, zb: Tensor, alpha: float, *, seed: int, layer: int, heads: Tensor, bands: Tensor,
                   n_heads: int, n_bands: int, **_: Any) -> Tensor:
    """``rephase`` (control C3): ``k̄^(m)·(e^{iαφ_m} − 1)`` with a fixed random phase ``φ_m`` per
    (layer, head, band) from ``seed`` — the offset turns; its norm ``|k̄^(m)|`` (and ρ) is kept at every α."""
    ph = _phases(seed, layer, n_heads, n_bands)[heads][:, bands].to(zs.device) * alpha
    return (zb * (torch.polar(torch.ones_like(ph), ph) - 1)).expand_as(zs)


def noise_change(zs: Tensor, zb: Tensor, alpha: float, *, seed: int, layer: int, heads: Tensor, bands: Tensor,
                 n_heads: int, n_bands: int, **_: Any) -> Tensor:
    """``noise`` (control C4): ``α·|k̄^(m)|·e^{iψ}`` with a random phase ``ψ`` per (position, head, band)
    from ``seed`` and the layer — per token exactly ``destroy``'s norm, no constant direction."""
    g = torch.Generator().manual_seed(15_485_863 * int(seed) + 13 * layer + 5)
    psi = _per_position(g, zs.shape[1], (n_heads, n_bands))
    psi = psi[:, heads][..., bands].to(zs.device) * (2 * math.pi)
    return ((zb.abs() * alpha)[None, None] * torch.polar(torch.ones_like(psi), psi)[None]).expand_as(zs)


#: kind → its change function (``random_bands`` transplants the change of its ``base`` kind)
CHANGES: dict[str, Callable[..., Tensor]] = {"enforce": enforce_change, "destroy": destroy_change,
                                             "rephase": rephase_change, "noise": noise_change}


def _row_change(z: Tensor, zbar: Tensor, iv: Intervention, layer: int, seed: int) -> Complex[Tensor, "batch pos head band"]:
    """:func:`change_vectors` for rows that share one random draw (``seed``)."""
    n_heads, n_bands = z.shape[-2], z.shape[-1]
    delta = torch.zeros_like(z)
    bands = torch.as_tensor([int(b) for b in iv.bands], dtype=torch.long)
    if bands.numel() and (bands.min() < 0 or bands.max() >= n_bands):
        raise ValueError(f"bands {list(iv.bands)} out of range for {n_bands} bands (layer {layer})")
    heads = torch.arange(n_heads) if iv.heads is None else torch.as_tensor([int(h) for h in iv.heads])
    if heads.numel() and (heads.min() < 0 or heads.max() >= n_heads):
        raise ValueError(f"heads {list(iv.heads)} out of range for {n_heads} heads (layer {layer})")
    kind = iv.base if iv.kind == "random_bands" else iv.kind
    d = CHANGES[kind](z[:, :, heads][..., bands], zbar[heads][:, bands], float(iv.alpha), seed=seed, layer=layer,
                      heads=heads, bands=bands, n_heads=n_heads, n_bands=n_bands)
    if iv.kind == "random_bands":  # transplant into random other bands (and heads), random phase per entry
        nb, nh = _control_choice(iv, layer, n_heads, n_bands, seed)
        bands = torch.as_tensor(nb, dtype=torch.long)
        heads = heads if nh is None else torch.as_tensor(nh, dtype=torch.long)
        if iv.scramble:
            g = torch.Generator().manual_seed(104_729 * int(seed) + 17 * layer + 3)
            psi = _per_position(g, d.shape[1], tuple(d.shape[2:])).to(d.device) * (2 * math.pi)
            d = d * torch.polar(torch.ones_like(psi), psi)
    delta[:, :, heads[:, None].expand(-1, bands.numel()), bands[None, :].expand(heads.numel(), -1)] = d
    return delta


def change_vectors(
    x: Float[Tensor, "batch pos head d_head"], mean: Float[Tensor, "head d_head"], iv: Intervention,
    rope: LayerRope, layer: int,
) -> Complex[Tensor, "batch pos head band"]:  # fmt: skip
    """The complex change ``alpha·(z_intervened − z)`` per token, head and band (zero elsewhere).

    Pure function (no hooks): the change function of ``iv.kind`` (:data:`CHANGES`) on the selected
    bands/heads, transplanted for ``random_bands``. Random draws (C1 bands and phases, C3 phases,
    C4 noise) use ``iv.seed``, or ``iv.row_seeds[i]`` for batch row ``i`` when given (a control
    drawn afresh per document: docs/method.md §8).

    Raises:
        ValueError: bands/heads out of range; ``row_seeds`` not one per batch row.
    """
    z = to_bands(x.float(), rope.rotary_dim, rope.layout)
    zbar = to_bands(mean.float().to(x.device), rope.rotary_dim, rope.layout)  # head band
    if iv.row_seeds is None:
        return _row_change(z, zbar, iv, layer, iv.seed)
    if len(iv.row_seeds) != z.shape[0]:
        raise ValueError(f"{iv.label}: {len(iv.row_seeds)} row seeds for a batch of {z.shape[0]} rows")
    return torch.cat([_row_change(z[i : i + 1], zbar, iv, layer, s) for i, s in enumerate(iv.row_seeds)])


def _edit(
    x: Tensor, hook: Any, *, iv: Intervention, mean: Tensor, rope: LayerRope, layer: int, layout: str = "bshd"
) -> Tensor:
    xs = to_heads(x, layout, mean.shape[-1])
    delta = change_vectors(xs, mean, iv, rope, layer)
    r = rope.rotary_dim
    z = to_bands(xs.float(), r, rope.layout)
    touched = delta != 0
    out_z = torch.where(touched, z + delta, z)
    if iv.alpha == 1.0 and iv.kind == "enforce":  # exact k̄ (no z + (k̄ − z) rounding)
        zbar = to_bands(mean.float().to(x.device), r, rope.layout).expand_as(z)
        out_z = torch.where(touched, zbar, z)
    rot = from_bands(out_z, rope.layout).to(x.dtype)
    out = torch.cat([rot, xs[..., r:]], dim=-1) if xs.shape[-1] > r else rot
    return from_heads(out, layout, x)


def _edit_prescale(
    x: Tensor, hook: Any, *, iv: Intervention, mean: Tensor, rope: LayerRope, layer: int,
    model: Any, info: Any, d_head: int, stash: dict,
) -> Tensor:
    """:func:`_edit` on a flattened QK-norm hook *before* the norm weight (TL 3.x
    ``HookedTransformer``: ``attn.k_norm.hook_normalized``, which the model multiplies by ``w`` next).

    The pre-rotation tensor ``x·w`` is edited as in :func:`_edit`; edited coordinates are returned
    divided by ``w`` (so the model's ``·w`` gives the edit, up to one rounding), every other
    coordinate is returned bit for bit.

    Raises:
        CaptureError: an edited coordinate has norm weight 0 (no value before the weight reaches it).
    """
    b, s = stash["shape"]
    pre = pre_rotation(model, info, layer, iv.target, x, b, s, d_head)
    edited = _edit(pre, hook, iv=iv, mean=mean, rope=rope, layer=layer)
    changed = edited != pre
    q_mod, k_mod, attr = info.norm_weight
    w = getattr(model.get_submodule(info.name(layer, q_mod if iv.target == "q" else k_mod).rstrip(".")), attr)
    w = w.reshape(-1, d_head)  # [1, d_head] (per-head norm) or [head, d_head] (norm over all heads)
    if bool((changed & (w == 0)).any()):
        raise CaptureError(
            f"layer {layer}: {iv.label} changes coordinates whose QK-norm weight is 0; they cannot be reached "
            "through the pre-weight hook of this HookedTransformer"
        )
    out = torch.where(changed, edited.float() / w.float(), x.reshape(pre.shape).float())
    return out.reshape(x.shape).to(x.dtype)


@chunk_safe
def _noop(x: Tensor, hook: Any) -> None:
    return None


def intervention_hooks(
    model: Any, intervention: Intervention, k_means: dict[int, Tensor] | None = None
) -> HookList:
    """TransformerLens forward hooks that apply ``intervention`` to pre-rotation k (or q).

    ``k_means`` = :func:`key_means` (or query means for ``target='q'``) for every layer
    touched; not needed for ``noop``. Returns ``[(hook_name, fn), ...]``; hooks return the
    edited tensor in the model's dtype and the hook's own layout.
    """
    spec, info = probe_hooks(model)
    layers = range(spec.n_layers) if intervention.layers is None else intervention.layers
    layers = spec.layer_indices(layers)
    if intervention.kind != "noop":
        require_exact(model, layers, f"the key edit {intervention.kind!r}")
    hook = info.q_hook if intervention.target == "q" else info.k_hook
    # TL 3.x HookedTransformer + QK-norm: the hook sits before the norm weight (see _edit_prescale)
    prescale = info.normed_layout == "flat_prescale"
    out: HookList = []
    for layer in layers:
        name = info.name(layer, hook)
        if intervention.kind == "noop":
            out.append((name, _noop))
            continue
        if k_means is None or layer not in k_means:
            raise ValueError(f"{intervention.label}: no mean {intervention.target} for layer {layer} (pass key_means(...))")
        if prescale:
            stash: dict = {}
            out.append((info.name(layer, f"hook_{intervention.target}"), functools.partial(stash_shape, stash=stash)))
            out.append((name, functools.partial(
                _edit_prescale, iv=intervention, mean=k_means[layer], rope=spec.layer(layer), layer=layer,
                model=model, info=info, d_head=spec.d_head, stash=stash)))
            continue
        fn = functools.partial(
            _edit, iv=intervention, mean=k_means[layer], rope=spec.layer(layer), layer=layer,
            layout=info.normed_layout)
        out.append((name, chunk_safe(fn)))  # per token; the random draws per position read the chunk's span
    return out


def hooks_on_rows(hooks: HookList, rows: slice) -> HookList:
    """``hooks`` restricted to the batch rows ``rows`` (every TransformerLens activation is batch-first): each hook sees
    only those rows, the others pass unchanged — one forward then holds sequences with and without an edit side by
    side. A hook that edits its tensor in place edits those rows of the activation; one that returns a tensor has it
    written into them (the activation itself is not touched: another hook may hold it). Chunk-safe where the hook is."""
    out: HookList = []
    for name, fn in hooks:
        def part(t: Tensor, hook: Any, _fn: Callable = fn) -> Tensor | None:
            r = _fn(t[rows], hook=hook)
            if r is None:
                return None
            whole = t.clone()
            whole[rows] = r
            return whole

        out.append((name, chunk_safe(part) if hooks_chunk_safe([(name, fn)]) else part))
    return out


def kind_hooks(model: Any, k_means: dict[int, Tensor] | None, bands: Sequence[int] = (), *, kind: Kind,
               **kw: Any) -> HookList:
    """``intervention_hooks(model, Intervention(kind, bands=bands, **kw), k_means)`` — the generic
    builder with the kind as an argument; the ``*_hooks`` partials below fix it."""
    return intervention_hooks(model, Intervention(kind=kind, bands=bands, **kw), k_means)


enforce_hooks = functools.partial(kind_hooks, kind="enforce")
enforce_hooks.__doc__ = """``enforce_hooks(model, k_means, bands, **kw)``: hooks that set each token's pre-rotation key
band to the mean key, ``k^(m) ← k^(m) + α·(k̄^(m) − k^(m))`` in ``bands`` (band 0 = fastest) — at
α = 1 every key is k̄ there and D3 is exact in those bands. ``k_means`` from :func:`key_means`;
``kw``: the :class:`Intervention` fields (``layers``, ``heads``, ``alpha`` ∈ [0, 1], ``target``).
Returns ``[(hook_name, fn), ...]`` for ``model.hooks(fwd_hooks=...)``."""

destroy_hooks = functools.partial(kind_hooks, kind="destroy")
destroy_hooks.__doc__ = """``destroy_hooks(model, k_means, bands, **kw)``: hooks that remove the key offset,
``k^(m) ← k^(m) − α·k̄^(m)`` in ``bands`` — exactly the positional term f of those bands goes, g and the
remainder stay (docs/method.md §5's intervention). ``alpha > 1`` over-drives it. ``kw`` as :class:`Intervention`.
Example: ``model.run_with_hooks(tokens, fwd_hooks=destroy_hooks(model, key_means(model, ref), range(8), alpha=0.5))``."""

rephase_hooks = functools.partial(kind_hooks, kind="rephase")
rephase_hooks.__doc__ = """``rephase_hooks(model, k_means, bands, seed=…, **kw)``: control C3 — the fast-band offset
turned by ``α·φ_m`` (a fixed random phase per layer, head and band from ``seed``), its norm |k̄^(m)| and
ρ kept at every strength: the kernel's shape changes, its size does not."""

random_bands_hooks = functools.partial(kind_hooks, kind="random_bands")
random_bands_hooks.__doc__ = """``random_bands_hooks(model, k_means, bands, base="destroy", seed=…, **kw)``: control C1 —
the change ``base`` would make in ``bands``, transplanted entry by entry into as many randomly chosen
OTHER bands (and heads, when ``heads`` is given), each entry with a random unit phase: per token the
same norm as the intervention, where the intervention does not act."""

noise_hooks = functools.partial(kind_hooks, kind="noise")
noise_hooks.__doc__ = """``noise_hooks(model, k_means, bands, seed=…, **kw)``: control C4 — per token and band a change
``α·|k̄^(m)|·e^{iψ}`` with a random phase ψ per (position, head, band): destroy's norm in the same bands,
no constant direction."""


def noop_hooks(model: Any, layers: Sequence[int] | None = None) -> HookList:
    """Hooks on the pre-rotation key hooks that return ``None`` (tensor untouched)."""
    return intervention_hooks(model, Intervention(kind="noop", layers=layers, label="noop"))


def reference_key_means(
    model: Any,
    tokens: Any,
    layers: Sequence[int] | None = None,
    *,
    sink: int = 1,
    batch_size: int = 4,
    progress: bool = True,
    extra_hooks: Sequence = (),
    chunk: int = -1,
) -> dict[int, Float[Tensor, "kv_head d_head"]]:
    """Mean PRE-rotation key ``k̄`` per layer and kv-group over ``tokens`` (positions ``< sink``
    excluded): :func:`posgen_tl.hooks.edits.feature_means` in float64 (``tokens`` may be
    :class:`~posgen_tl.io.corpus.Windows`; ``chunk`` as there). Returns ``{layer: Float[Tensor, "kv_head d_head"]}``
    float64."""
    tokens = getattr(tokens, "tokens", tokens)  # Windows → their token ids
    return feature_means(model, tokens, layers, sink=sink, target="k", batch_size=batch_size,
                         progress="k̄ reference" if progress else False, extra_hooks=extra_hooks, dtype=torch.float64,
                         chunk=chunk)
