"""RoPE, exactly: the spec of a model's rotary embedding and pure rotation maths.

Everything here is a pure tensor function of a :class:`LayerRope` / :class:`RopeSpec`;
reading the spec *from* a model lives in :mod:`posgen_tl.io.spec`.

Conventions (docs/method.md §1)
--------------------------
* Band ``m`` (a "plane") is the coordinate pair ``(m, m + r/2)`` for the half-split
  (HF / NeoX) layout and ``(2m, 2m + 1)`` for the adjacent (GPT-J) layout; dims
  ``>= r`` (the rotary dim) are not rotated.
* Band 0 is the HIGHEST frequency (``inv_freq`` is decreasing, as in HF).
* A band is viewed as a complex number ``z = x[first] + i·x[second]``; rotating by
  angle ``φ`` is ``z·e^{iφ}`` — exactly what HF's ``x·cos + rotate_half(x)·sin`` does.
* ``rotate(x, p)`` is ``a·R_p x`` where ``a`` is the model's ``attention_scaling``
  (1 for default RoPE, ≠ 1 for YaRN/LongRoPE, which scale cos and sin).
* Attention logits: ``W[i, j] = s · rot_q_i · rot_k_j = s·a² · q_iᵀ R_{j−i} k_j``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from einops import rearrange
from jaxtyping import Bool, Complex, Float, Int
from torch import Tensor

Layout = Literal["half", "adjacent"]

__all__ = ["Layout", "LayerRope", "RopeSpec", "RopeError", "IndexRangeError", "angles", "rotate", "unrotate",
           "band_indices", "to_bands", "band_parts", "from_bands", "rotate_bands", "relative_rotation_matrix",
           "rotation_matrix", "scores_from_rotated", "scores_from_prerotation", "expand_kv", "kv_head_index",
           "band_periods", "causal_mask", "attention_pattern", "rotate_with_table", "rotation_table",
           "rotation_residual"]


class RopeError(ValueError):
    """The model has no usable RoPE, or its RoPE variant is not understood."""


class IndexRangeError(ValueError, IndexError):
    """A layer or head index outside the model (the message names the valid range)."""


@dataclass(frozen=True)
class LayerRope:
    """Rotary embedding of one attention layer.

    Attributes:
        inv_freq: angular frequency per band, ``Float[Tensor, "band"]`` (band 0 fastest),
            float32 as the model holds it (the model's own ``inv_freq`` buffer).
        rotary_dim: number of rotated dims ``r`` (``r/2`` bands); dims ``>= r`` pass through.
        layout: ``"half"`` (pairs ``(m, m+r/2)``) or ``"adjacent"`` (pairs ``(2m, 2m+1)``).
        attention_scaling: factor ``a`` multiplying cos and sin (YaRN/LongRoPE), else 1.
        position_scale: positions are divided by this before multiplying ``inv_freq``
            (TransformerLens-native linear scaling); HF folds linear scaling into inv_freq.
        score_scale: ``s`` in ``W = s · rot_q · rot_k`` (``1/sqrt(d_head)`` for Llama,
            ``query_pre_attn_scalar**-0.5`` for Gemma).
        sliding_window: keys with ``i − j >= sliding_window`` are masked (Gemma local
            layers), ``None`` for full causal attention.
        kind: free-form label, e.g. ``"global"`` / ``"local"`` (Gemma3) or ``"full"``.
        angle_divisor: ``None`` (angles ``p · inv_freq``, as HF and the bridge compute them), or
            the per-band float32 ``1/inv_freq`` that a TransformerLens 3.x ``HookedTransformer``
            divides positions by (``p / freq``): set, :func:`angles` divides by it so the
            rotation matches ``hook_rot_q``/``hook_rot_k`` bit for bit at every position.
        long_inv_freq: LongRoPE (Phi-3.5, Phi-4-mini): the frequencies HF switches to when a forward
            pass's largest position id reaches ``long_after`` (``original_max_position_embeddings``);
            ``inv_freq`` then holds the short-factor frequencies. :func:`angles` picks the set per call
            exactly as HF does (``max(position_ids) + 1 > long_after``); :meth:`for_positions` returns
            the resolved single-set rope. ``None`` for every other RoPE type.
        long_after: the LongRoPE switch length (see ``long_inv_freq``).
    """

    inv_freq: Tensor
    rotary_dim: int
    layout: Layout = "half"
    attention_scaling: float = 1.0
    position_scale: float = 1.0
    score_scale: float = 1.0
    sliding_window: int | None = None
    kind: str = "full"
    angle_divisor: Tensor | None = None
    long_inv_freq: Tensor | None = None
    long_after: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("half", "adjacent"):
            raise RopeError(f"unknown RoPE pair layout {self.layout!r}; use 'half' or 'adjacent'")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise RopeError(f"rotary_dim must be a positive even integer, got {self.rotary_dim}")
        if self.inv_freq.ndim != 1 or self.inv_freq.shape[0] != self.rotary_dim // 2:
            raise RopeError(
                f"inv_freq has shape {tuple(self.inv_freq.shape)}; expected ({self.rotary_dim // 2},)"
            )
        if self.angle_divisor is not None and self.angle_divisor.shape != self.inv_freq.shape:
            raise RopeError(
                f"angle_divisor has shape {tuple(self.angle_divisor.shape)}; expected {tuple(self.inv_freq.shape)}"
            )
        if (self.long_inv_freq is None) != (self.long_after is None):
            raise RopeError("long_inv_freq and long_after (LongRoPE) must be given together")
        if self.long_inv_freq is not None and self.long_inv_freq.shape != self.inv_freq.shape:
            raise RopeError(
                f"long_inv_freq has shape {tuple(self.long_inv_freq.shape)}; expected {tuple(self.inv_freq.shape)}"
            )

    def for_positions(self, positions: Tensor) -> LayerRope:
        """The single-frequency-set rope a forward pass with these position ids uses: ``self`` unless
        LongRoPE, where the long factors apply when ``max(positions) + 1 > long_after`` (as HF's
        ``longrope_frequency_update``: one choice for the whole batch)."""
        if self.long_inv_freq is None:
            return self
        long = int(positions.max()) + 1 > int(self.long_after)  # type: ignore[arg-type]
        inv = self.long_inv_freq if long else self.inv_freq
        return dataclasses.replace(self, inv_freq=inv, long_inv_freq=None, long_after=None,
                                   kind=f"{self.kind}+long" if long else self.kind)

    @property
    def n_bands(self) -> int:
        return self.rotary_dim // 2

    @property
    def theta(self) -> Float[Tensor, "band"]:
        """Angular frequency per band in radians per position (``inv_freq / position_scale``)."""
        return self.inv_freq.double() / self.position_scale

    def to(self, device: torch.device | str) -> LayerRope:
        return dataclasses.replace(
            self,
            inv_freq=self.inv_freq.to(device),
            angle_divisor=None if self.angle_divisor is None else self.angle_divisor.to(device),
            long_inv_freq=None if self.long_inv_freq is None else self.long_inv_freq.to(device),
        )


def _same_tensor(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def _shared_rope(lr: LayerRope, seen: list[LayerRope]) -> LayerRope:
    """``lr``, or an earlier :class:`LayerRope` of ``seen`` equal to it in every field (tensors compared exactly)."""
    for other in seen:
        if other is lr or (all(getattr(lr, f.name) == getattr(other, f.name) for f in dataclasses.fields(LayerRope)
                                if f.name not in _TENSOR_FIELDS)
                           and all(_same_tensor(getattr(lr, f), getattr(other, f)) for f in _TENSOR_FIELDS)):
            return other
    seen.append(lr)
    return lr


_TENSOR_FIELDS = ("inv_freq", "angle_divisor", "long_inv_freq")


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of a whole model: one :class:`LayerRope` per layer plus the head geometry.

    ``n_heads`` query heads read kv-group ``h // (n_heads // n_kv_heads)``.
    ``qk_norm`` says the model normalises q/k before RoPE (then the pre-rotation
    tensors are ``hook_q_normed``/``hook_k_normed``, not ``hook_q``/``hook_k``).
    """

    model_name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    n_ctx: int
    layers: tuple[LayerRope, ...]
    rope_type: str = "default"
    qk_norm: bool = False
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.layers) != self.n_layers:
            raise RopeError(f"{len(self.layers)} LayerRope entries for {self.n_layers} layers")
        if self.n_heads % self.n_kv_heads:
            raise RopeError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        # layers with an equal rope share ONE object (checked once, here): what is computed per rope — a rotation
        # table, a stack of layers scored together — is then recognised by identity, with no device read per use
        shared: list[LayerRope] = []
        object.__setattr__(self, "layers", tuple(_shared_rope(lr, shared) for lr in self.layers))

    def layer(self, layer: int) -> LayerRope:
        """The :class:`LayerRope` of ``layer`` (``-1`` is the last layer).

        Raises:
            IndexRangeError: ``layer`` is outside ``-n_layers … n_layers − 1``."""
        return self.layers[self.layer_index(layer)]

    def layer_index(self, layer: int) -> int:
        """``layer`` as an index ``0 … n_layers − 1``; negative indices count from the end (``-1`` = last).

        Raises:
            IndexRangeError: ``layer`` is outside ``-n_layers … n_layers − 1`` (never wrapped)."""
        i = int(layer)
        if not -self.n_layers <= i < self.n_layers:
            raise IndexRangeError(
                f"layer {i} does not exist in {self.model_name or 'this model'} ({self.n_layers} layers: "
                f"valid indices 0 … {self.n_layers - 1}, or -{self.n_layers} … -1 from the end)"
            )
        return i % self.n_layers

    def layer_indices(self, layers: Sequence[int] | range | None) -> list[int]:
        """The sorted distinct layer indices ``layers`` names (``None`` → every layer; negative indices
        count from the end). Raises :class:`IndexRangeError` for an index outside the model."""
        if layers is None:
            return list(range(self.n_layers))
        return sorted({self.layer_index(x) for x in layers})

    def head_index(self, head: int, *, kv: bool = False) -> int:
        """``head`` as a query-head (``kv=True``: key/value-head) index; negative counts from the end.

        Raises:
            IndexRangeError: ``head`` is outside the model's heads."""
        n = self.n_kv_heads if kv else self.n_heads
        i = int(head)
        if not -n <= i < n:
            what = "key/value head" if kv else "head"
            raise IndexRangeError(
                f"{what} {i} does not exist in {self.model_name or 'this model'} ({n} {what}s per layer: valid "
                f"indices 0 … {n - 1}, or -{n} … -1 from the end)"
            )
        return i % n

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_group(self, head: int) -> int:
        """The kv-group (key/value head) read by query head ``head`` (:func:`kv_head_index`)."""
        return int(kv_head_index(self.n_heads, self.n_kv_heads)[head])

    def describe(self) -> list[dict]:
        """One dict per layer (for a DataFrame): kind, rotary dim, base-equivalent, window."""
        rows = []
        for i, lr in enumerate(self.layers):
            th = lr.theta
            rows.append(
                dict(
                    layer=i,
                    kind=lr.kind,
                    layout=lr.layout,
                    rotary_dim=lr.rotary_dim,
                    n_bands=lr.n_bands,
                    theta_fastest=float(th[0]),
                    theta_slowest=float(th[-1]),
                    period_slowest=float(2 * torch.pi / th[-1]),
                    attention_scaling=lr.attention_scaling,
                    score_scale=lr.score_scale,
                    sliding_window=lr.sliding_window,
                )
            )
        return rows


# ----------------------------------------------------------------------------- angles


def angles(
    positions: Int[Tensor, "*batch pos"] | Float[Tensor, "*batch pos"], rope: LayerRope
) -> Float[Tensor, "*batch pos band"]:
    """Rotation angle ``p·θ_m`` per position and band, computed as the model does (float32).

    HF computes ``inv_freq.float() @ position_ids.float()`` in float32; a K=1 matmul is an
    elementwise product, so this reproduces the model's angles bit for bit. A TransformerLens
    3.x ``HookedTransformer`` divides instead (``p / freq``): with ``rope.angle_divisor`` set,
    so does this. LongRoPE: the short or long frequencies, chosen from ``positions`` as HF does.
    """
    rope = rope.for_positions(positions)
    pos = positions.float()
    if rope.position_scale != 1.0:
        pos = pos / rope.position_scale
    if rope.angle_divisor is not None:
        return pos[..., None] / _on_device(rope.angle_divisor, positions.device)
    return pos[..., None] * _on_device(rope.inv_freq, positions.device)


_COPIES: list[tuple[Tensor, int, torch.device, Tensor]] = []  # (source held: an id is never reused, its version, …)


def _on_device(t: Tensor, device: torch.device) -> Tensor:
    """``t.float().to(device)``, made once per tensor (and version) and device: a copy from the host to a GPU waits
    for the GPU's queue, and the frequencies are read at every layer of every batch."""
    if t.device == device:
        return t.float()
    for src, version, dev, copy in _COPIES:
        if src is t and version == t._version and dev == device:
            return copy
    copy = t.float().to(device)
    _COPIES.insert(0, (t, t._version, device, copy))
    del _COPIES[16:]
    return copy


def band_indices(rotary_dim: int, layout: Layout) -> tuple[Tensor, Tensor]:
    """Index tensors ``(first, second)`` of the two coordinates of each band."""
    half = rotary_dim // 2
    m = torch.arange(half)
    if layout == "half":
        return m, m + half
    if layout == "adjacent":
        return 2 * m, 2 * m + 1
    raise RopeError(f"unknown layout {layout!r}")


def band_parts(x: Float[Tensor, "*batch d_head"], rotary_dim: int, layout: Layout) -> tuple[Tensor, Tensor]:
    """The real and imaginary parts of :func:`to_bands`, ``[*batch, band]`` each, as VIEWS of ``x``."""
    rot = x[..., :rotary_dim]
    pairs = rot.unflatten(-1, (2, -1)).movedim(-2, 0) if layout == "half" else rot.unflatten(-1, (-1, 2)).movedim(-1, 0)
    return pairs[0], pairs[1]


def to_bands(x: Float[Tensor, "*batch d_head"], rotary_dim: int, layout: Layout) -> Complex[Tensor, "*batch band"]:
    """View the rotated part of ``x`` as complex bands ``z_m = x[first_m] + i·x[second_m]``."""
    a, b = band_parts(x, rotary_dim, layout)
    return torch.complex(a.contiguous(), b.contiguous())


def from_bands(z: Complex[Tensor, "*batch band"], layout: Layout,
               passthrough: Float[Tensor, "*batch rest"] | None = None) -> Float[Tensor, "*batch d_head"]:
    """Inverse of :func:`to_bands`; ``passthrough`` holds the unrotated dims ``>= r``."""
    a, b = z.real, z.imag
    if layout == "half":
        rot = torch.cat([a, b], dim=-1)
    else:
        rot = rearrange(torch.stack([a, b], dim=-1), "... band two -> ... (band two)")
    if passthrough is not None and passthrough.shape[-1]:
        rot = torch.cat([rot, passthrough], dim=-1)
    return rot


#: the last few rotation tables (:func:`rotation_table`): every layer of a batch rotates at the same positions with an
#: equal rope, so on a GPU the table's dozen kernel launches (and the frequencies' copy to the device) run once per
#: batch instead of once per layer and tensor. Keyed by the objects themselves (held, so an id is never reused) and
#: the positions' version counter (an in-place change of the positions is never served a stale table).
_TABLES: list[tuple[tuple, tuple[Tensor, Tensor]]] = []
_TABLES_MAX = 8


def rotation_table(
    positions: Tensor, rope: LayerRope, dtype: torch.dtype, sign: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(a·cos(sign·φ), a·sin(sign·φ))`` ``[*batch, pos, band]`` in ``dtype`` (cached for the last few tables)."""
    key = (positions, positions._version, rope, dtype, sign)
    for k, v in _TABLES:
        if k[0] is positions and k[1] == positions._version and k[2] is rope and k[3] == dtype and k[4] == sign:
            return v
    ang = angles(positions, rope)
    if sign != 1.0:
        ang = ang * sign
    cos = ang.cos() * rope.attention_scaling
    sin = ang.sin() * rope.attention_scaling
    out = cos.to(dtype), sin.to(dtype)
    _TABLES.insert(0, (key, out))
    del _TABLES[_TABLES_MAX:]
    return out


def _apply(x: Tensor, cos: Tensor, sin: Tensor, rope: LayerRope) -> Tensor:
    """``x·cos + rotate_half(x)·sin`` on the rotary dims, as HF/TL write it.

    ``cos``/``sin`` are per band ``[..., pos, band]`` and broadcast over the head axis.
    """
    r = rope.rotary_dim
    x_rot, x_pass = x[..., :r], x[..., r:]
    # [.., pos, band] -> [.., pos, 1(head), band]
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    if rope.layout == "half":
        cos_f = torch.cat([cos, cos], dim=-1)
        sin_f = torch.cat([sin, sin], dim=-1)
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated_half = torch.cat([-x2, x1], dim=-1)
    else:
        cos_f = cos.repeat_interleave(2, dim=-1)
        sin_f = sin.repeat_interleave(2, dim=-1)
        pairs = rearrange(x_rot, "... (band two) -> ... band two", two=2)
        rotated_half = rearrange(
            torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1), "... band two -> ... (band two)"
        )
    out = x_rot * cos_f + rotated_half * sin_f
    if x_pass.shape[-1]:
        out = torch.cat([out, x_pass], dim=-1)
    return out


def rotate(
    x: Float[Tensor, "*batch pos head_index d_head"],
    positions: Int[Tensor, "*batch pos"] | Int[Tensor, "pos"],
    rope: LayerRope,
) -> Float[Tensor, "*batch pos head_index d_head"]:
    """Apply RoPE at ``positions``: returns ``a·R_p x`` per position, same shape as ``x``.

    Matches ``hook_rot_q``/``hook_rot_k`` of TransformerLens/HF to float rounding
    (identical op order: float32 angles, ``x·cos + rotate_half(x)·sin``).
    """
    if x.shape[-1] < rope.rotary_dim:
        raise RopeError(f"d_head={x.shape[-1]} is smaller than rotary_dim={rope.rotary_dim}")
    cos, sin = rotation_table(positions.to(x.device), rope, x.dtype)
    return _apply(x, cos, sin, rope)


def rotation_residual(
    x: Float[Tensor, "*batch pos head_index d_head"],
    rot: Float[Tensor, "*batch pos head_index d_head"],
    positions: Int[Tensor, "*batch pos"] | Int[Tensor, "pos"],
    rope: LayerRope,
) -> list[Tensor]:
    """``rotate(x, positions, rope) − rot`` without the rotated copy: :func:`_apply`'s products band by band (each
    rounded as it rounds them: the same bits) written into the difference — the first and second band parts
    ``[*batch, pos, head_index, band]``, then the unrotated dims ``[..., d_head − rotary_dim]`` where there are any."""
    cos, sin = (t.unsqueeze(-2) for t in rotation_table(positions.to(x.device), rope, x.dtype))
    (a, b), (ra, rb) = band_parts(x, rope.rotary_dim, rope.layout), band_parts(rot, rope.rotary_dim, rope.layout)
    out = [torch.mul(a, cos).sub_(torch.mul(b, sin)).sub_(ra), torch.mul(b, cos).add_(torch.mul(a, sin)).sub_(rb)]
    return out + ([x[..., rope.rotary_dim :] - rot[..., rope.rotary_dim :]] if x.shape[-1] > rope.rotary_dim else [])


def rotate_with_table(
    x: Float[Tensor, "*batch pos head_index d_head"],
    cos: Float[Tensor, "*batch pos band"],
    sin: Float[Tensor, "*batch pos band"],
    rope: LayerRope,
) -> Float[Tensor, "*batch pos head_index d_head"]:
    """Rotate ``x`` with a GIVEN per-band table (the model's own ``cos``/``sin``, attention scaling
    included) instead of our angles: ``x·cos + rotate_half(x)·sin`` in ``rope.layout`` on the first
    ``rope.rotary_dim`` dims, the rest passed through. Returns the shape of ``x`` (in ``x``'s dtype).
    Used to check :func:`rotate` against a rotation that does not come from the spec."""
    if cos.shape[-1] != rope.n_bands or sin.shape[-1] != rope.n_bands:
        raise RopeError(f"a rotation table of {cos.shape[-1]} bands for a {rope.n_bands}-band rope")
    return _apply(x, cos.to(x.dtype), sin.to(x.dtype), rope)


def unrotate(
    x: Float[Tensor, "*batch pos head_index d_head"],
    positions: Int[Tensor, "*batch pos"] | Int[Tensor, "pos"],
    rope: LayerRope,
) -> Float[Tensor, "*batch pos head_index d_head"]:
    """Inverse of :func:`rotate`: ``R_{−p} x / a`` (undoes the attention scaling too)."""
    cos, sin = rotation_table(positions.to(x.device), rope, x.dtype, sign=-1.0)
    a2 = rope.attention_scaling**2
    out = _apply(x, cos, sin, rope)
    if a2 != 1.0:
        r = rope.rotary_dim
        out = torch.cat([out[..., :r] / a2, out[..., r:]], dim=-1)
    return out


def rotate_bands(
    z: Complex[Tensor, "*batch band"], phase: Float[Tensor, "*batch band"]
) -> Complex[Tensor, "*batch band"]:
    """Rotate complex bands by ``phase`` radians (``z·e^{i·phase}``)."""
    return z * torch.polar(torch.ones_like(phase), phase)


def rotation_matrix(p: float, rope: LayerRope, d_head: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Dense ``[d_head, d_head]`` matrix of ``R_p`` (without attention scaling); for tests."""
    eye = torch.eye(d_head, dtype=dtype)
    rows = rotate(eye[:, None, None, :], torch.full((d_head, 1), p, dtype=torch.float64), _plain(rope, dtype))
    # rows[i] = R_p e_i  -> column i of R_p
    return rows[:, 0, 0, :].T


def relative_rotation_matrix(delta: float, rope: LayerRope, d_head: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Dense ``R_delta`` (``delta = j − i``) so that ``q_iᵀ R_{j−i} k_j = (R_i q_i)·(R_j k_j)``."""
    return rotation_matrix(delta, rope, d_head, dtype)


def _plain(rope: LayerRope, dtype: torch.dtype) -> LayerRope:
    return dataclasses.replace(
        rope,
        inv_freq=rope.inv_freq.to(dtype),
        attention_scaling=1.0,
        angle_divisor=None if rope.angle_divisor is None else rope.angle_divisor.to(dtype),
        long_inv_freq=None if rope.long_inv_freq is None else rope.long_inv_freq.to(dtype),
    )


# ----------------------------------------------------------------------------- scores


def expand_kv(
    k: Float[Tensor, "*batch pos kv_head d_head"], n_heads: int
) -> Float[Tensor, "*batch pos head_index d_head"]:
    """Repeat kv-groups to query heads: query head ``h`` reads group ``h // (H // G)`` (HF's
    ``repeat_kv``: consecutive query heads share a group), so the result is
    ``[*batch, pos, head_index, d_head]`` with ``out[..., h, :] == k[..., h // (H // G), :]``."""
    return k.index_select(-2, kv_head_index(n_heads, k.shape[-2], device=k.device))


def kv_head_index(n_heads: int, n_kv_heads: int, device: torch.device | str | None = None) -> Int[Tensor, "head_index"]:
    """The kv head each query head reads: ``idx[h] = h // (n_heads // n_kv_heads)`` (HF's ``repeat_kv``:
    consecutive query heads share a group), as an int64 ``[head_index]`` tensor — the ONE place of the
    package that maps query heads to kv heads (:func:`expand_kv`, ``RopeSpec.kv_group``, per-group
    statistics expanded to heads all use it).

    Raises:
        RopeError: ``n_heads`` is not a positive multiple of ``n_kv_heads``.
    """
    if n_kv_heads <= 0 or n_heads <= 0 or n_heads % n_kv_heads:
        raise RopeError(f"n_heads={n_heads} is not a multiple of the {n_kv_heads} kv heads")
    return torch.arange(n_heads, device=device) // (n_heads // n_kv_heads)


def scores_from_rotated(
    rot_q: Float[Tensor, "batch pos head_index d_head"],
    rot_k: Float[Tensor, "batch pos kv_head d_head"],
    score_scale: float,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """``W = s · rot_q · rot_kᵀ`` (no mask), kv-groups expanded to query heads."""
    k = expand_kv(rot_k, rot_q.shape[-2])
    return torch.einsum("bqhd,bkhd->bhqk", rot_q, k) * score_scale


def scores_from_prerotation(
    q: Float[Tensor, "batch pos head_index d_head"],
    k: Float[Tensor, "batch pos kv_head d_head"],
    positions: Int[Tensor, "batch pos"],
    rope: LayerRope,
) -> Float[Tensor, "batch head_index query_pos key_pos"]:
    """``W[i, j] = s·a²·q_iᵀ R_{j−i} k_j`` computed in the band (complex) picture.

    Independent of :func:`rotate`: used to cross-check the rotation and the identity
    ``(R_i q)·(R_j k) = qᵀ R_{j−i} k``.
    """
    r = rope.rotary_dim
    k = expand_kv(k, q.shape[-2])
    zq = to_bands(q.double(), r, rope.layout)  # b q h m
    zk = to_bands(k.double(), r, rope.layout)
    ang = angles(positions, rope).double()  # b pos m (float32 angles, as the model)
    zq = zq * torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
    zk = zk * torch.polar(torch.ones_like(ang), ang)[:, :, None, :]
    w = torch.einsum("bqhm,bkhm->bhqk", zq, zk.conj()).real
    w = w * rope.attention_scaling**2
    if q.shape[-1] > r:
        w = w + torch.einsum("bqhd,bkhd->bhqk", q[..., r:].double(), k[..., r:].double())
    return (w * rope.score_scale).to(q.dtype)


def band_periods(rope: LayerRope) -> Float[Tensor, "band"]:
    """Period ``2π/θ_m`` in positions for each band (band 0 shortest)."""
    return 2 * torch.pi / rope.theta


def causal_mask(
    n_pos: int, *, sink: int = 0, sliding_window: int | None = None, device: torch.device | str | None = None
) -> Bool[Tensor, "query_pos key_pos"]:
    """``True`` where query ``i`` sees key ``j``: ``j ≤ i``, ``j ≥ sink`` and ``i − j < sliding_window``.

    The one mask of the package: ``sink=0`` gives the model's own attention mask (causal, plus
    the layer's sliding window); ``sink > 0`` also drops the first ``sink`` keys, as the fits
    and scores of :mod:`posgen_tl.maths.decompose` do (rows ``i < sink`` are then all False).
    Everything after ``n_pos`` is keyword-only, so a positional ``sink``/``window`` mix-up
    fails loudly instead of giving a wrong mask.

    Returns:
        ``Bool[Tensor, "query_pos key_pos"]`` of shape ``[n_pos, n_pos]``.
    """
    i = torch.arange(n_pos, device=device)[:, None]
    j = torch.arange(n_pos, device=device)[None, :]
    m = (j <= i) & (j >= sink)
    if sliding_window is not None:
        m = m & (i - j < sliding_window)
    return m


def attention_pattern(
    w: Float[Tensor, "*batch head_index query_pos key_pos"],
    mask: Bool[Tensor, "query_pos key_pos"],
    sinks: Float[Tensor, "head_index"] | None = None,
) -> Float[Tensor, "*batch head_index query_pos key_pos"]:
    """The attention pattern the model computes from pre-softmax logits ``w`` (soft-cap already
    applied): softmax over the keys ``mask`` leaves visible, masked entries exactly 0.

    ``sinks`` (GPT-OSS's learned per-head sink logits, TransformerLens 3.x ``use_attention_sinks``):
    one extra logit per head joins every row's softmax and is dropped after it, so a row sums to less
    than 1 — as HF and TransformerLens do. Computed in float64 at least (float32/half inputs are
    promoted); returns the shape of ``w``.
    """
    x = w.double() if w.dtype != torch.float64 else w
    x = x.masked_fill(~mask.to(x.device), float("-inf"))
    if sinks is None:
        return torch.softmax(x, dim=-1)
    s = sinks.to(device=x.device, dtype=x.dtype)
    if s.ndim != 1 or s.shape[0] != x.shape[-3]:
        raise RopeError(f"attention sinks have shape {tuple(s.shape)}; expected ({x.shape[-3]},) — one per head")
    col = s[:, None, None].expand(*x.shape[:-1], 1)
    return torch.softmax(torch.cat([x, col], dim=-1), dim=-1)[..., :-1]
