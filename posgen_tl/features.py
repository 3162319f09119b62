"""Per-band statistics of pre-rotation queries and keys (METHOD.md §3), streamed.

For one layer's ``q`` (or ``k``), per head and per RoPE band ``m`` — the complex
coordinate ``z_m = x[first_m] + i·x[second_m]`` of :func:`posgen_tl.rope.to_bands` —
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

Pattern score
-------------
The D3 bound (METHOD §2) is ``|W − f − g| ≤ s·Σ_m ‖q^(m)‖·‖k^(m) − k̄^(m)‖·2|sin(Δθ_m/2)|``.
With the distance weight ``w_m(L) = mean_{Δ=1..L} 2|sin(Δ·θ_m/2)|`` (``θ_m = rope.theta``)
and, for query head ``h`` reading kv-group ``g = h // (H/G)``,
``q_rms_m = sqrt(E|q_m|²)``, ``k_rms_m = sqrt(E|k_m|²)``, ``k_res_m = residual_rms(k)_m``::

    c_m     = q_rms_m · k_rms_m · w_m          (rotation-weighted key energy)
    bound_m = q_rms_m · k_res_m · w_m          (rotation-weighted key residual)
    pattern_score  = 1 − Σ_m bound_m / Σ_m c_m          ∈ [0, 1]
    expected_bound = s · a² · Σ_m bound_m

``pattern_score`` is 1 when keys are token-invariant in every band that rotates over
distances ``≤ L`` (then D3 is exact) and 0 when no band carries a key offset; bands with
``θ_m = 0`` get ``w_m = 0`` and never count. Pass-through dims do not rotate, so they are
absorbed exactly by the semantic term ``g`` and do not enter either sum.
``expected_bound`` replaces the per-entry norms of the bound by rms values and averages
the rotation factor over distances: it is an rms-style *typical size* of ``|W − f − g|``,
not a strict bound.
"""

from __future__ import annotations

import pandas as pd
import torch
from einops import rearrange
from jaxtyping import Bool, Complex, Float
from torch import Tensor

from posgen_tl.rope import LayerRope, Layout, to_bands

__all__ = [
    "BandStats",
    "band_stats",
    "distance_weights",
    "pattern_scores",
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

    def _empty_like(self) -> "BandStats":
        return BandStats(
            self.n_heads, self.d_head, self.rotary_dim, self.layout, self.dtype, self.sum_x.device
        )

    def update(
        self,
        x: Float[Tensor, "batch pos head_index d_head"],
        mask: Bool[Tensor, "batch pos"] | None = None,
    ) -> None:
        """Accumulate ``x`` in place; positions where ``mask`` is False are ignored."""
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
        z = to_bands(tokens, self.rotary_dim, self.layout)  # tok head band
        abs2 = z.real.square() + z.imag.square()
        mag = abs2.sqrt()
        nonzero = mag > 0
        unit = torch.where(nonzero, z / torch.where(nonzero, mag, 1), 0)
        self.n += tokens.shape[0]
        self.sum_x += tokens.sum(0)
        self.sum_abs2 += abs2.sum(0)
        self.sum_unit += unit.sum(0)
        self.pass_abs2 += tokens[..., self.rotary_dim :].square().sum((0, -1))
        self.n_nonzero += nonzero.sum(0)

    def merge(self, other: "BandStats") -> "BandStats":
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
    def from_state_dict(cls, state: dict, device: torch.device | str | None = None) -> "BandStats":
        """Inverse of :meth:`state_dict` (optionally onto ``device``)."""
        dtype = getattr(torch, state["dtype"]) if isinstance(state["dtype"], str) else state["dtype"]
        out = cls(state["n_heads"], state["d_head"], state["rotary_dim"], state["layout"], dtype, device)
        for key in _STATE_KEYS:
            ref = getattr(out, key)
            if tuple(state[key].shape) != tuple(ref.shape):
                raise ValueError(f"state {key!r} has shape {tuple(state[key].shape)}, expected {tuple(ref.shape)}")
            setattr(out, key, state[key].detach().to(device=ref.device, dtype=ref.dtype).clone())
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


def distance_weights(rope: LayerRope, max_distance: int, chunk: int = 4096) -> Float[Tensor, "band"]:
    """``w_m(L) = mean_{Δ=1..L} 2|sin(Δ·θ_m/2)|`` in float64, ``L = max_distance``.

    With a sliding window, keys at ``Δ >= window`` are masked, so ``L`` is capped at
    ``window − 1``. Returns ``[band]`` on ``rope.inv_freq``'s device; 0 where ``θ_m = 0``.
    """
    if max_distance < 1:
        raise ValueError(f"max_distance must be >= 1, got {max_distance}")
    L = max_distance if rope.sliding_window is None else min(max_distance, rope.sliding_window - 1)
    L = max(L, 1)
    theta = rope.theta
    total = torch.zeros_like(theta)
    for start in range(1, L + 1, chunk):  # bounded memory for long contexts
        delta = torch.arange(start, min(start + chunk, L + 1), dtype=theta.dtype, device=theta.device)
        total += (2 * torch.sin(delta[:, None] * theta / 2).abs()).sum(0)
    return total / L


def pattern_scores(
    q_stats: BandStats, k_stats: BandStats, rope: LayerRope, max_distance: int
) -> dict[str, Tensor]:
    """Per-query-head pattern score and rotation-weighted residual (module docstring).

    ``q_stats`` has ``H`` query heads, ``k_stats`` ``G`` kv-groups; head ``h`` reads
    group ``h // (H // G)``. Returns float64 tensors:
    ``"pattern_score"`` [head_index] ∈ [0, 1] (NaN if no key energy in any rotating band),
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
    w = distance_weights(rope, max_distance).to(dev, torch.float64)
    q_rms = q_stats.energy().double().sqrt()
    k_rms = k_stats.energy().double().to(dev).sqrt().repeat_interleave(H // G, dim=0)
    k_res = k_stats.residual_rms().double().to(dev).repeat_interleave(H // G, dim=0)
    c = q_rms * k_rms * w
    bound = q_rms * k_res * w
    scale = rope.score_scale * rope.attention_scaling**2
    return {
        "pattern_score": (1 - _div(bound.sum(-1), c.sum(-1))).clamp(0.0, 1.0),
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
    cols = {
        "energy_share": stats.energy_share(),
        "offset_ratio": stats.offset_ratio(),
        "phase_concentration": stats.phase_concentration(),
        "residual_rms": stats.residual_rms(),
        "energy": stats.energy(),
    }
    n = H * B
    frame = {
        "model": [model] * n, "twin": [twin] * n, "layer": [layer] * n, "which": [which] * n,
        "head": head.reshape(-1).numpy(), "band": band.reshape(-1).numpy(),
    }
    frame.update({k: v.detach().double().reshape(-1).cpu().numpy() for k, v in cols.items()})
    return pd.DataFrame(frame)
