"""Per-band statistics of pre-rotation queries and keys (docs/method.md §3), streamed.

For one layer's ``q`` (or ``k``), per head and per RoPE band ``m`` — the complex
coordinate ``z_m = x[first_m] + i·x[second_m]`` of :func:`posgen_tl.maths.rope.to_bands` —
:class:`BandStats` keeps mergeable running sums (memory independent of the corpus) and
derives:

* ``energy``              ``E|z_m|²``;
* ``energy_share``        ``E|z_m|² / Σ_m E|z_m|²`` over rotated bands only (frequency
  usage); the unrotated dims ``>= rotary_dim`` are reported apart as
  ``pass_energy_share = E‖x_pass‖² / E‖x‖²``;
* ``offset_ratio``        ``ρ_m = |E z_m|² / E|z_m|²`` ∈ [0, 1] (1 token-invariant, 0 zero mean);
* ``phase_concentration`` mean resultant length ``|E[z_m / |z_m|]|`` (zero entries skipped);
* ``residual_rms``        ``sqrt(E|z_m − E z_m|²) = sqrt(E|z_m|² − |E z_m|²)`` (clamped at 0);
* ``mean``                ``E x`` over full ``d_head`` — the ``k̄`` of the D3 split.

Undefined ratios (no tokens, a band with zero energy) are NaN, never silently 0.
The residual uses the raw second moment minus the squared mean, so keep the default
float64 accumulators: the relative error of ``residual_rms²`` is ~``eps / (1 − ρ)``.

Pattern score (rotation-aware)
------------------------------
The D3 bound (docs/method.md §2) is ``|W − f − g| ≤ s·Σ_m ‖q^(m)‖·‖k^(m) − k̄^(m)‖·2|sin(Δθ_m/2)|``.
With the ENTRY-weighted rotation factor ``w_m = Σ_Δ c_Δ·2|sin(Δ·θ_m/2)| / Σ_Δ c_Δ`` over the
causal entries actually present (``c_Δ = n − sink − Δ`` entries at distance ``Δ``, window
respected; :func:`distance_weights`), ``q_rms_m = sqrt(E|q_m|²)`` and ``kres_m`` the rms of
``k_m − k̄_m`` for the chosen k̄ (global reference mean, or each sequence's own mean)::

    pred_d3_err = s·a²·Σ_m q_rms_m · kres_m · w_m / σ(W)        (:func:`predicted_d3_error`)

with ``σ(W)`` the head's within-row logit spread (:func:`within_row_spread`): the predicted
size of D3's error relative to what softmax sees. It scales with the rotation weights (a key
residual in bands that do not rotate over the distances present costs nothing; in fast
bands, the most). Lower is better (D3 expected to fit).

``legacy_pattern_score = 1 − Σ_m q_rms·k_res·w_m / Σ_m q_rms·k_rms·w_m`` (the first landing's
score) is kept only for comparison: it is unchanged when every ``w_m`` is rescaled, and its
normalisation by the key's own energy hides how large the error is relative to the logits.
``expected_bound = s·a²·Σ_m q_rms·k_res·w_m`` (residual around the analysed tokens' mean) is
an rms-style typical size of ``|W − f − g|``, not a strict bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
from einops import rearrange
from jaxtyping import Bool, Complex, Float
from torch import Tensor

from posgen_tl.maths.rope import LayerRope, Layout, band_parts, kv_head_index, to_bands

__all__ = [
    "BandStats",
    "band_stats",
    "distance_weights",
    "pattern_scores",
    "predicted_d3_error",
    "within_row_spread",
    "within_row_spread_qk",
    "within_row_spread_rows",
    "spread_row_keys",
    "fast_band_offset",
    "stats_frame",
]

_STATE_KEYS = ("n", "sum_x", "sum_abs2", "sum_unit", "pass_abs2", "n_nonzero")


def _complex_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` with NaN where ``den == 0`` (an undefined statistic)."""
    den = den.to(num.dtype) if not num.is_complex() else den.to(num.real.dtype)
    return torch.where(den != 0, num / torch.where(den != 0, den, 1), torch.nan)


class BandStats:
    """Mergeable running sums for one layer's q or k: memory independent of corpus size.

    State (all on one device, float ``dtype``): ``n`` tokens seen (int64 scalar),
    ``sum_x`` [head_index d_head], ``sum_abs2`` [head_index band] (``Σ|z_m|²``),
    ``sum_unit`` [head_index band] complex (``Σ z_m/|z_m|`` over nonzero ``z_m``),
    ``pass_abs2`` [head_index] (``Σ‖x_pass‖²``), ``n_nonzero`` [head_index band] int64.
    """

    def __init__(
        self,
        n_heads: int,
        d_head: int,
        rotary_dim: int,
        layout: Layout,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> None:
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d_head:
            raise ValueError(f"rotary_dim={rotary_dim} must be even, positive and <= d_head={d_head}")
        if layout not in ("half", "adjacent"):
            raise ValueError(f"unknown layout {layout!r}; use 'half' or 'adjacent'")
        self.n_heads, self.d_head, self.rotary_dim, self.layout = n_heads, d_head, rotary_dim, layout
        self.dtype = dtype
        nb, kw = rotary_dim // 2, dict(dtype=dtype, device=device)
        self.n = torch.zeros((), dtype=torch.int64, device=device)
        self.sum_x = torch.zeros(n_heads, d_head, **kw)
        self.sum_abs2 = torch.zeros(n_heads, nb, **kw)
        self.sum_unit = torch.zeros(n_heads, nb, dtype=_complex_dtype(dtype), device=device)
        self.pass_abs2 = torch.zeros(n_heads, **kw)
        self.n_nonzero = torch.zeros(n_heads, nb, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ accumulate

    @property
    def n_bands(self) -> int:
        return self.rotary_dim // 2

    @property
    def n_tokens(self) -> int:
        """Number of (unmasked) tokens accumulated so far."""
        return int(self.n)

    def _empty_like(self) -> BandStats:
        return BandStats(
            self.n_heads, self.d_head, self.rotary_dim, self.layout, self.dtype, self.sum_x.device
        )

    def update(
        self,
        x: Float[Tensor, "batch pos head_index d_head"],
        mask: Bool[Tensor, "batch pos"] | None = None,
    ) -> Float[Tensor, "token head_index band"]:
        """Accumulate ``x`` in place; positions where ``mask`` is False are ignored. Returns ``|z_m|²`` of the
        accumulated tokens (``[(batch pos) kept, head_index, band]`` in the accumulators' dtype; without a mask a view
        of ``[batch, pos, head_index, band]``), e.g. for :meth:`posgen_tl.maths.rho.SequenceBandSums.update`."""
        if x.ndim != 4 or tuple(x.shape[-2:]) != (self.n_heads, self.d_head):
            raise ValueError(
                f"x has shape {tuple(x.shape)}; expected [batch, pos, {self.n_heads}, {self.d_head}]"
            )
        dev = self.sum_x.device
        tokens = rearrange(x, "batch pos head d -> (batch pos) head d")
        if mask is not None:
            if tuple(mask.shape) != tuple(x.shape[:2]):
                raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(x.shape[:2])}")
            tokens = tokens[rearrange(mask.to(tokens.device, torch.bool), "batch pos -> (batch pos)")]
        tokens = tokens.to(device=dev, dtype=self.dtype)
        a, b = band_parts(tokens, self.rotary_dim, self.layout)  # tok head band: Re z, Im z (views)
        abs2 = a * a + b * b
        inv = abs2.rsqrt().nan_to_num_(nan=0.0, posinf=0.0)  # 1/|z| (z/|z|: the unit phasor, 0 for z = 0)
        self.n += tokens.shape[0]
        self.sum_x += tokens.sum(0)
        self.sum_abs2 += abs2.sum(0)
        self.sum_unit += torch.complex((a * inv).sum(0), (b * inv).sum(0))
        self.pass_abs2 += tokens[..., self.rotary_dim :].square().sum((0, -1))
        self.n_nonzero += (abs2 > 0).sum(0)  # (a NaN counts as zero, as its phasor does)
        return abs2

    def merge(self, other: BandStats) -> BandStats:
        """A new accumulator equal to having seen both streams (inputs unchanged)."""
        mine = (self.n_heads, self.d_head, self.rotary_dim, self.layout)
        theirs = (other.n_heads, other.d_head, other.rotary_dim, other.layout)
        if mine != theirs:
            raise ValueError(f"cannot merge BandStats {mine} with {theirs}")
        out = self._empty_like()
        for key in _STATE_KEYS:
            a, b = getattr(self, key), getattr(other, key)
            setattr(out, key, a + b.to(device=a.device, dtype=a.dtype))
        return out

    # ------------------------------------------------------------------ statistics

    def mean(self) -> Float[Tensor, "head_index d_head"]:
        """``E x`` per head over all of ``d_head`` (pass dims included): the D3 ``k̄``."""
        return _div(self.sum_x, self.n)

    @staticmethod
    def state_mean(state: dict) -> Float[Tensor, "head_index d_head"]:
        """:meth:`mean` of a :meth:`state_dict` without rebuilding the accumulator (the same numbers)."""
        return _div(state["sum_x"], state["n"])

    def mean_bands(self) -> Complex[Tensor, "head_index band"]:
        """``E z_m`` per head and band, complex ``[head_index band]``."""
        return to_bands(self.mean(), self.rotary_dim, self.layout)

    def energy(self) -> Float[Tensor, "head_index band"]:
        """``E|z_m|²`` per head and band."""
        return _div(self.sum_abs2, self.n)

    def pass_energy(self) -> Float[Tensor, "head_index"]:
        """``E‖x_pass‖²`` per head (dims ``>= rotary_dim``; 0 without partial rotary)."""
        return _div(self.pass_abs2, self.n)

    def energy_share(self) -> Float[Tensor, "head_index band"]:
        """``E|z_m|² / Σ_m E|z_m|²`` (rotated bands only); rows sum to 1."""
        return _div(self.sum_abs2, self.sum_abs2.sum(-1, keepdim=True))

    def pass_energy_share(self) -> Float[Tensor, "head_index"]:
        """``E‖x_pass‖² / E‖x‖²`` per head."""
        return _div(self.pass_abs2, self.sum_abs2.sum(-1) + self.pass_abs2)

    def offset_ratio(self) -> Float[Tensor, "head_index band"]:
        """``ρ_m = |E z_m|² / E|z_m|²`` ∈ [0, 1] (NaN for a zero-energy band)."""
        return _div(self.mean_bands().abs().square(), self.energy()).clamp(0.0, 1.0)

    def phase_concentration(self) -> Float[Tensor, "head_index band"]:
        """Mean resultant length ``|E[z_m/|z_m|]|`` ∈ [0, 1] over entries with ``z_m ≠ 0``."""
        return _div(self.sum_unit, self.n_nonzero).abs()

    def residual_rms(self) -> Float[Tensor, "head_index band"]:
        """``sqrt(E|z_m|² − |E z_m|²)`` (clamped at 0): rms of ``z_m − E z_m``."""
        return (self.energy() - self.mean_bands().abs().square()).clamp_min(0.0).sqrt()

    def band_statistics(self) -> dict[str, Float[Tensor, "head_index band"]]:
        """The per-(head, band) statistics of the tables, by column name: ``energy_share``, ``offset_ratio``,
        ``phase_concentration``, ``residual_rms``, ``energy``."""
        return {"energy_share": self.energy_share(), "offset_ratio": self.offset_ratio(),
                "phase_concentration": self.phase_concentration(), "residual_rms": self.residual_rms(),
                "energy": self.energy()}

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        """Config and cloned sums; :meth:`from_state_dict` restores an equal accumulator."""
        state = {key: getattr(self, key).detach().clone() for key in _STATE_KEYS}
        state.update(
            n_heads=self.n_heads, d_head=self.d_head, rotary_dim=self.rotary_dim,
            layout=self.layout, dtype=str(self.dtype).removeprefix("torch."),
        )
        return state

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str | None = None) -> BandStats:
        """Inverse of :meth:`state_dict` (optionally onto ``device``)."""
        dtype = getattr(torch, state["dtype"]) if isinstance(state["dtype"], str) else state["dtype"]
        out = cls(state["n_heads"], state["d_head"], state["rotary_dim"], state["layout"], dtype, device)
        for key in _STATE_KEYS:
            ref = getattr(out, key)
            if tuple(state[key].shape) != tuple(ref.shape):
                raise ValueError(f"state {key!r} has shape {tuple(state[key].shape)}, expected {tuple(ref.shape)}")
            setattr(out, key, state[key].detach().to(device=ref.device, dtype=ref.dtype).clone())
        return out

    @classmethod
    def from_state_dicts(cls, states: Sequence[dict]) -> BandStats:
        """One accumulator holding the heads of several :meth:`state_dict` outputs side by side, in order — a stack
        of layers, or a layer's query heads then its key heads — so that every statistic is computed for all of them
        in one go (the same numbers as each one's own). Fresh tensors (nothing shared with ``states``).

        Raises:
            ValueError: where the states did not see the same tokens (``n``) or differ in ``d_head``,
                ``rotary_dim``, ``layout`` or ``dtype``, or a tensor's shape does not match its ``n_heads``.
        """
        if not states:
            raise ValueError("no accumulator states to put side by side")
        first, conf = states[0], ("d_head", "rotary_dim", "layout", "dtype")
        for st in states[1:]:
            if any(st[c] != first[c] for c in conf):
                raise ValueError(f"cannot put side by side accumulators of {[first[c] for c in conf]} and "
                                 f"{[st[c] for c in conf]} (d_head, rotary_dim, layout, dtype)")
            if not torch.equal(st["n"], first["n"]):
                raise ValueError(f"cannot put side by side accumulators of {int(first['n'])} and {int(st['n'])} tokens")
        dtype = getattr(torch, first["dtype"]) if isinstance(first["dtype"], str) else first["dtype"]
        h, nb = sum(int(st["n_heads"]) for st in states), int(first["rotary_dim"]) // 2
        out = cls.__new__(cls)
        out.n_heads, out.d_head, out.rotary_dim, out.layout = h, int(first["d_head"]), int(first["rotary_dim"]), first["layout"]
        out.dtype = dtype
        shapes = {"sum_x": (h, out.d_head), "sum_abs2": (h, nb), "sum_unit": (h, nb), "pass_abs2": (h,), "n_nonzero": (h, nb)}
        kinds = {"sum_unit": _complex_dtype(dtype), "n_nonzero": torch.int64}
        out.n = first["n"].detach().to(torch.int64).clone()
        for key, shape in shapes.items():
            v = torch.cat([st[key].detach() for st in states]).to(kinds.get(key, dtype))
            if tuple(v.shape) != shape:
                raise ValueError(f"state {key!r} of the {len(states)} accumulators has shape {tuple(v.shape)}, "
                                 f"expected {shape}")
            setattr(out, key, v)
        return out

    def __repr__(self) -> str:
        return (
            f"BandStats(n_heads={self.n_heads}, d_head={self.d_head}, rotary_dim={self.rotary_dim}, "
            f"layout={self.layout!r}, n_tokens={self.n_tokens})"
        )


def band_stats(
    x: Float[Tensor, "batch pos head_index d_head"],
    rotary_dim: int,
    layout: Layout,
    mask: Bool[Tensor, "batch pos"] | None = None,
) -> BandStats:
    """One-shot :class:`BandStats` of a batch (float64 accumulators on ``x``'s device)."""
    stats = BandStats(x.shape[-2], x.shape[-1], rotary_dim, layout, device=x.device)
    stats.update(x, mask)
    return stats


# ----------------------------------------------------------------------------- pattern score


def distance_weights(
    rope: LayerRope, max_distance: int, chunk: int = 4096, *, sink: int = 0
) -> Float[Tensor, "band"]:
    """Entry-weighted mean rotation factor ``w_m = Σ_Δ c_Δ·2|sin(Δ·θ_m/2)| / Σ_Δ c_Δ`` (float64).

    The average runs over the causal entries of a map of ``n = max_distance + 1`` positions
    with the first ``sink`` keys excluded: distance ``Δ = i − j`` occurs ``c_Δ = n − sink − Δ``
    times (``Δ = 0 .. n − 1 − sink``; ``Δ = 0`` counts, with factor 0). With a sliding window,
    only ``Δ < window`` enters. Returns ``[band]`` on ``rope.inv_freq``'s device; 0 where ``θ_m = 0``.
    """
    if max_distance < 1:
        raise ValueError(f"max_distance must be >= 1, got {max_distance}")
    n = max_distance + 1
    if not 0 <= sink < n:
        raise ValueError(f"sink={sink} must be in [0, {n - 1}]")
    top = n - 1 - sink if rope.sliding_window is None else min(n - 1 - sink, rope.sliding_window - 1)
    theta = rope.theta.double()
    total = torch.zeros_like(theta)
    weight = 0.0
    for start in range(0, top + 1, chunk):  # bounded memory for long contexts
        delta = torch.arange(start, min(start + chunk, top + 1), dtype=theta.dtype, device=theta.device)
        c = n - sink - delta
        total += (c[:, None] * 2 * torch.sin(delta[:, None] * theta / 2).abs()).sum(0)
        weight += float(c.sum())
    return total / weight


def within_row_spread(
    W: Float[Tensor, "batch head_index query_pos key_pos"], mask: Bool[Tensor, "query_pos key_pos"]
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """Mergeable sums of the within-row logit spread: ``(Σ (W_ij − mean_i W)², n_entries)``.

    Sums over the batch and every row with ``>= 2`` masked entries (row means over the mask);
    ``σ(W) = sqrt(ss / n)`` is the head's within-row logit spread (softmax ignores row
    constants). Returns float64 ``([head_index], scalar)``; float32 maps are summed per row in
    float32 (two-pass: deviations from the row mean first, so no cancellation), rows in float64.
    """
    mask = mask.to(device=W.device, dtype=torch.bool)
    mask = mask & (mask.sum(-1, keepdim=True) >= 2)
    dt = torch.float64 if W.dtype == torch.float64 else torch.float32
    mf = mask.to(dt)
    cnt = mf.sum(-1).clamp(min=1)
    x = W.to(dt) * mf  # a fresh buffer: W is never modified
    mean = x.sum(-1, keepdim=True) / cnt[:, None]
    x.addcmul_(mean, mf, value=-1)  # two-pass: deviations from the row mean, zero off the mask
    ss = x.square_().sum(-1).double().sum((0, 2))
    return ss, mask.double().sum() * W.shape[0]


def spread_row_keys(rot_q: Tensor, rot_k: Tensor, sink: int, sliding_window: int | None,
                    block: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The checked inputs of the spread functions (here and in :mod:`posgen_tl.maths.spread`) and each query row's
    keys under ``causal_mask(n, sink=sink, sliding_window=sliding_window)``: ``(pos, lo, cnt, valid)``, int64 /
    bool ``[pos]`` — row ``i`` sees keys ``lo[i] … i`` (``cnt`` of them) and counts when it has at least two. Raises
    ValueError for q/k of mismatched shapes, query heads not a multiple of the kv heads, or ``block < 1``."""
    if rot_q.ndim != 4 or rot_k.ndim != 4 or rot_q.shape[:2] != rot_k.shape[:2] or rot_q.shape[-1] != rot_k.shape[-1]:
        raise ValueError(f"rot_q {tuple(rot_q.shape)} and rot_k {tuple(rot_k.shape)} must be [batch, pos, heads, d_head] "
                         "with the same batch, pos and d_head")
    h, kv = rot_q.shape[2], rot_k.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads are not a multiple of {kv} kv heads")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    pos = torch.arange(rot_q.shape[1], device=rot_q.device)
    lo = (pos - sliding_window + 1 if sliding_window is not None else torch.zeros_like(pos)).clamp(min=sink)
    cnt = (pos - lo + 1).clamp(min=0)
    return pos, lo, cnt, cnt >= 2


def within_row_spread_qk(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 32,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`within_row_spread` of ``W = s·rot_q·rot_kᵀ`` under ``causal_mask(n, sink=, sliding_window=)``,
    without building the ``n × n`` maps.

    Per query row ``Σ_j (W_ij − mean)² = Σ_j W_ij² − (Σ_j W_ij)²/cnt`` with
    ``Σ_j W_ij² = s²·q_iᵀ (Σ_j k_j k_jᵀ) q_i``: the key blocks every row of a query block sees
    enter through block prefix sums of ``k`` and ``k kᵀ`` (``d × d`` per block); only the
    ≤ 2 partial key blocks at each end of a row's range are scored explicitly. Cost per row
    ``O(d² + block·d)`` instead of ``O(n·d)``. In float64, with keys centred by their sequence mean
    (a row constant: the spread is unchanged, the cancellation smaller). GQA: head ``h`` reads
    kv-group ``h // (H / G)``. Returns float64 ``([head_index], scalar)`` as :func:`within_row_spread`.
    """
    pos, lo, cnt, valid = spread_row_keys(rot_q, rot_k, sink, sliding_window, block)
    b, n, h, d = rot_q.shape
    kv = rot_k.shape[-2]
    dev = rot_q.device
    q = rearrange(rot_q.double(), "b i (kv g) d -> b kv g i d", kv=kv)
    k = rot_k.double()
    k = rearrange(k - k.mean(1, keepdim=True), "b j kv d -> b kv j d")
    nb = -(-n // block)
    kp = torch.nn.functional.pad(k, (0, 0, 0, nb * block - n)).reshape(b, kv, nb, block, d)
    zero1, zero2 = k.new_zeros(b, kv, 1, d), k.new_zeros(b, kv, 1, d, d)
    p1 = torch.cat([zero1, kp.sum(3).cumsum(2)], 2)  # b kv nb+1 d: Σ of keys before block t
    p2 = torch.cat([zero2, torch.einsum("bkxjd,bkxje->bkxde", kp, kp).cumsum(2)], 2)  # b kv nb+1 d d

    def first_key(i: int) -> int:  # = lo[i], in Python: no device-to-host copy per block on a GPU
        return max(sink, i - sliding_window + 1) if sliding_window is not None else sink

    ss = torch.zeros(b, kv, q.shape[2], dtype=torch.float64, device=dev)
    for t in range(nb):
        i0, i1 = t * block, min(n, (t + 1) * block)
        qi = q[:, :, :, i0:i1]  # b kv g r d
        s1 = torch.zeros(qi.shape[:-1], dtype=torch.float64, device=dev)
        s2 = torch.zeros_like(s1)
        a_min, a_max = first_key(i0), first_key(i1 - 1)  # lo is non-decreasing: every row sees [a_max, i0]
        f0, f1 = -(-a_max // block), (i0 + 1) // block  # whole key blocks inside [a_max, i0]
        spans = [(a_min, i1)]
        if f0 < f1:
            ksum, gram = p1[:, :, f1] - p1[:, :, f0], p2[:, :, f1] - p2[:, :, f0]  # b kv d, b kv d d
            s1 += torch.einsum("bkgrd,bkd->bkgr", qi, ksum)
            s2 += (torch.einsum("bkgrd,bkde->bkgre", qi, gram) * qi).sum(-1)
            spans = [(a_min, f0 * block), (f1 * block, i1)]
        for e0, e1 in spans:
            if e1 <= e0:
                continue
            j = torch.arange(e0, e1, device=dev)
            m = ((j[None, :] >= lo[i0:i1, None]) & (j[None, :] <= pos[i0:i1, None])).double()  # r e
            w = torch.einsum("bkgrd,bked->bkgre", qi, k[:, :, e0:e1]) * m
            s1 += w.sum(-1)
            s2 += (w * w).sum(-1)
        s1, s2 = s1 * score_scale, s2 * score_scale**2
        c = cnt[i0:i1].clamp(min=1).double()
        ss += ((s2 - s1 * s1 / c) * valid[i0:i1].double()).sum(-1)
    return rearrange(ss.sum(0), "kv g -> (kv g)"), (cnt * valid).sum().double() * b


def within_row_spread_rows(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
    *,
    sink: int = 0,
    sliding_window: int | None = None,
    block: int = 64,
) -> tuple[Float[Tensor, "head_index"], Float[Tensor, ""]]:
    """:func:`within_row_spread` of ``W = s·rot_q·rot_kᵀ`` under ``causal_mask(n, sink=, sliding_window=)``, the maps
    built ``block`` query rows at a time on the keys those rows can see (``lo[first row] … last row``): a block costs
    its share of the band, not of the square, and its few passes stay in the processor's cache. Within a block the
    steps of :func:`within_row_spread` on the explicit maps, in the inputs' precision (float32 from a model, as
    :func:`within_row_spread` on ``c.logits()``): the entries off the mask zeroed, each row's mean over its mask, the
    deviations from it (zero off the mask again) and the sum of their squares — two passes, no cancellation; rows
    summed in float64, ``s²`` applied in float64 at the end. GQA: head ``h`` reads kv-group ``h // (H / G)``. Returns
    float64 ``([head_index], scalar)`` as :func:`within_row_spread`."""
    pos, lo, cnt, valid = spread_row_keys(rot_q, rot_k, sink, sliding_window, block)
    b, n, h, d = rot_q.shape
    kv = rot_k.shape[-2]
    g = h // kv
    q = rearrange(rot_q, "b i (kv g) d -> b kv g i d", kv=kv)
    k = rearrange(rot_k.to(rot_q.dtype), "b j kv d -> b kv j d")
    weight = valid.to(q.dtype)
    per_row = cnt.clamp(min=1).to(q.dtype)
    ss = torch.zeros(b, kv, g, dtype=torch.float64, device=rot_q.device)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        k0 = max(sink, r0 - sliding_window + 1) if sliding_window is not None else sink  # = lo[r0], from Python
        if k0 >= r1:
            continue
        w = (q[:, :, :, r0:r1].reshape(b, kv, -1, d) @ k[:, :, k0:r1].mT).view(b, kv, g, r1 - r0, r1 - k0)
        m = None
        if sliding_window is None:  # every row sees keys sink … i: zero j > i (the block's keys start at the sink)
            w.tril_(r0 - k0)
        else:
            j = pos[k0:r1]
            m = ((j[None, :] >= lo[r0:r1, None]) & (j[None, :] <= pos[r0:r1, None])).to(q.dtype)
            w.mul_(m)
        w.sub_((w.sum(-1) / per_row[r0:r1])[..., None])  # deviations from each row's mean
        if m is None:  # (the mean was subtracted off the mask too: zeroed again)
            w.tril_(r0 - k0)
        else:
            w.mul_(m)
        ss += (torch.linalg.vector_norm(w, dim=-1).square_() * weight[r0:r1]).double().sum(-1)
    return rearrange(ss.sum(0), "kv g -> (kv g)") * score_scale**2, (cnt * valid).sum().double() * b


def predicted_d3_error(
    q_energy: Float[Tensor, "head_index band"],
    k_res_energy: Float[Tensor, "kv_head band"],
    weights: Float[Tensor, "band"],
    logit_spread: Float[Tensor, "head_index"],
    scale: float = 1.0,
) -> dict[str, Tensor]:
    """Rotation-aware pattern score: predicted relative D3 error per query head (module docstring).

    ``scale·Σ_m sqrt(q_energy_m)·sqrt(k_res_energy_m)·w_m / σ(W)``; ``k_res_energy`` per kv
    group (expanded to query heads: head ``h`` reads group ``h // (H/G)``), e.g.
    ``E|k_m − k̄_m|²`` for the global k̄ or the within-sequence residual for a per-sequence k̄.
    Returns float64 ``{"pred_d3_err": [head_index], "per_band": [head_index, band]}``
    (``per_band`` sums to ``pred_d3_err``); NaN where ``σ(W) = 0``.
    """
    H, G = q_energy.shape[0], k_res_energy.shape[0]
    if H % G:
        raise ValueError(f"{H} query heads are not a multiple of {G} kv heads")
    kres = k_res_energy.double().to(q_energy.device).clamp_min(0).sqrt()[kv_head_index(H, G, q_energy.device)]
    per_band = scale * q_energy.double().clamp_min(0).sqrt() * kres * weights.double().to(q_energy.device)
    per_band = _div(per_band, logit_spread.double().to(q_energy.device)[:, None])
    return {"pred_d3_err": per_band.sum(-1), "per_band": per_band}


def pattern_scores(
    q_stats: BandStats, k_stats: BandStats, rope: LayerRope, max_distance: int, *, sink: int = 0
) -> dict[str, Tensor]:
    """LEGACY pattern score and rotation-weighted residual of the first landing (module docstring).

    ``q_stats`` has ``H`` query heads, ``k_stats`` ``G`` kv-groups; head ``h`` reads
    group ``h // (H // G)``; ``w_m`` = :func:`distance_weights` ``(rope, max_distance, sink=sink)``.
    Returns float64 tensors:
    ``"legacy_pattern_score"`` [head_index] ∈ [0, 1] (NaN if no key energy in any rotating
    band; invariant to rescaling every ``w_m`` — use :func:`predicted_d3_error` instead),
    ``"expected_bound"`` [head_index] = ``s·a²·Σ_m bound_m``,
    ``"bound_per_band"`` [head_index band] = ``s·a²·bound_m`` (sums to ``expected_bound``).
    """
    H, G = q_stats.n_heads, k_stats.n_heads
    if H % G:
        raise ValueError(f"{H} query heads are not a multiple of {G} kv heads")
    for name, st in (("q", q_stats), ("k", k_stats)):
        if st.rotary_dim != rope.rotary_dim or st.layout != rope.layout:
            raise ValueError(
                f"{name}_stats has rotary_dim={st.rotary_dim}, layout={st.layout!r}; the rope has "
                f"rotary_dim={rope.rotary_dim}, layout={rope.layout!r}"
            )
    dev = q_stats.sum_x.device
    w = distance_weights(rope, max_distance, sink=sink).to(dev, torch.float64)
    q_rms = q_stats.energy().double().sqrt()
    k_rms = k_stats.energy().double().to(dev).sqrt()[kv_head_index(H, G, dev)]
    k_res = k_stats.residual_rms().double().to(dev)[kv_head_index(H, G, dev)]
    c = q_rms * k_rms * w
    bound = q_rms * k_res * w
    scale = rope.score_scale * rope.attention_scaling**2
    return {
        "legacy_pattern_score": (1 - _div(bound.sum(-1), c.sum(-1))).clamp(0.0, 1.0),
        "expected_bound": scale * bound.sum(-1),
        "bound_per_band": scale * bound,
    }


def fast_band_offset(k_stats: BandStats, n_fast: int) -> Float[Tensor, "head_index"]:
    """Mean offset ratio ``ρ`` over the ``n_fast`` fastest bands (band 0 fastest), NaN-skipping."""
    if not 1 <= n_fast <= k_stats.n_bands:
        raise ValueError(f"n_fast must be in [1, {k_stats.n_bands}], got {n_fast}")
    return torch.nanmean(k_stats.offset_ratio()[:, :n_fast], dim=-1)


def stats_frame(
    stats: BandStats, *, layer: int, which: str, model: str = "", twin: str = "trained"
) -> pd.DataFrame:
    """Tidy ``pandas.DataFrame``, one row per (head, band): model, twin, layer, which,
    head, band, energy_share, offset_ratio, phase_concentration, residual_rms, energy."""
    if which not in ("q", "k"):
        raise ValueError(f"which must be 'q' or 'k', got {which!r}")
    H, B = stats.n_heads, stats.n_bands
    head, band = torch.meshgrid(torch.arange(H), torch.arange(B), indexing="ij")
    cols = stats.band_statistics()
    n = H * B
    frame = {
        "model": [model] * n, "twin": [twin] * n, "layer": [layer] * n, "which": [which] * n,
        "head": head.reshape(-1).cpu().numpy(), "band": band.reshape(-1).cpu().numpy(),
    }
    frame.update({k: v.detach().double().reshape(-1).cpu().numpy() for k, v in cols.items()})
    return pd.DataFrame(frame)
