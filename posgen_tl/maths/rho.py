"""The offset ratio ρ of a RoPE band in three honest forms (docs/method.md §3), streamed per sequence.

For one layer's pre-rotation ``q`` (or ``k``), head ``h`` and band ``m`` (complex coordinate
``z = x^(m)`` of :func:`posgen_tl.maths.rope.to_bands`), with sequences ``s`` from documents ``d``:

* ``rho_within``  mean over sequences of ``|mean_s z|² / mean_s |z|²`` — token-invariance
  INSIDE a text (how much of the band is one constant vector per sequence);
* ``rho_cross``   ``Re⟨z̄_A, z̄_B⟩ / E|z|²`` with ``z̄_A``, ``z̄_B`` the token means over two
  disjoint halves of the DOCUMENTS (cross-fitted; averaged over ``n_splits`` seeded random
  splits). The halves are independent, so ``E Re⟨z̄_A, z̄_B⟩ = |E z|²`` exactly: an unbiased
  estimate of the text-independent offset. It can be negative (no shared offset + noise);
* ``stability``   ``rho_cross / rho_within`` — the share of the within-text offset that is
  the SAME vector across texts (≈ 1 one offset for all texts, ≈ 0 a per-text constant);
* ``rho_plugin``  the naive ``|E z|² / E|z|²`` (legacy; never report it alone). It is biased
  upward by between-text variance of the per-sequence means (≈ var/n_docs), not by i.i.d.
  token noise — which is why ``rho_cross`` exists.

:class:`SequenceBandSums` keeps, per sequence, its document id, token count, ``Σ z`` and
``Σ |z|²`` (``O(n_seq · heads · bands)``, tiny) — mergeable, and exact for every form above.
It also gives the within-sequence residual energy ``E_s E|z − mean_s z|²`` (the key residual
around a per-sequence k̄) and the residual around any given k̄ (a global reference mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Complex, Float, Int
from torch import Tensor

from posgen_tl.maths.rope import Layout, band_parts

__all__ = ["SequenceBandSums", "rho_forms", "RHO_FORMS"]

RHO_FORMS = ("rho_within", "rho_cross", "stability", "rho_plugin")
_STATE_KEYS = ("doc", "n", "sum_z", "sum_abs2")


def _nan_div(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den != 0, num / torch.where(den != 0, den, 1), torch.nan)


class _Flushed:
    """A state field of :class:`SequenceBandSums`, read and written after the updates still on their device are
    brought in (``_flush``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        obj._flush()
        return getattr(obj, self.attr)

    def __set__(self, obj: Any, value: Tensor) -> None:
        obj._flush()
        setattr(obj, self.attr, value)


class SequenceBandSums:
    """Per-sequence band sums of one layer's q or k, mergeable (concatenation of sequences).

    State (float64 / complex128 on CPU): ``doc`` [seq] int64 document ids, ``n`` [seq] int64
    token counts, ``sum_z`` [seq, head_index, band] complex ``Σ z``, ``sum_abs2``
    [seq, head_index, band] ``Σ |z|²``. Only the rotated dims enter (bands ``< rotary_dim/2``).
    """

    doc, n, sum_z, sum_abs2 = _Flushed(), _Flushed(), _Flushed(), _Flushed()

    def __init__(self, n_heads: int, rotary_dim: int, layout: Layout) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be even and positive")
        if layout not in ("half", "adjacent"):
            raise ValueError(f"unknown layout {layout!r}; use 'half' or 'adjacent'")
        self.n_heads, self.rotary_dim, self.layout = n_heads, rotary_dim, layout
        nb = rotary_dim // 2
        self._pending: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # updates still on their device
        self._doc = torch.zeros(0, dtype=torch.int64)
        self._n = torch.zeros(0, dtype=torch.int64)
        self._sum_z = torch.zeros(0, n_heads, nb, dtype=torch.complex128)
        self._sum_abs2 = torch.zeros(0, n_heads, nb, dtype=torch.float64)

    def _flush(self) -> None:
        """Bring the updates still on their device to the CPU state, one copy per field (a GPU stream pays one
        wait for all its batches, not one per update)."""
        if not self._pending:
            return
        parts, self._pending = self._pending, []
        for i, key in enumerate(_STATE_KEYS):
            new = torch.cat([p[i].to(getattr(self, "_" + key).device) for p in parts]) if i == 0 else \
                torch.cat([p[i] for p in parts]).cpu()
            setattr(self, "_" + key, torch.cat([getattr(self, "_" + key), new]))

    @property
    def n_bands(self) -> int:
        return self.rotary_dim // 2

    @property
    def n_seq(self) -> int:
        return int(self.n.numel())

    def update(
        self,
        x: Float[Tensor, "batch pos head_index d_head"],
        docs: Int[Tensor, "batch"],
        mask: Bool[Tensor, "batch pos"] | None = None,
        abs2: Float[Tensor, "batch pos head_index band"] | None = None,
    ) -> None:
        """Append one row per sequence of ``x`` (positions where ``mask`` is False ignored). ``abs2``: ``|z_m|²`` of
        ``x``'s bands in float64 where the caller has them already (:meth:`posgen_tl.maths.band_stats.BandStats.update`
        returns them): the same numbers, one product fewer."""
        if x.ndim != 4 or x.shape[-2] != self.n_heads or x.shape[-1] < self.rotary_dim:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [batch, pos, {self.n_heads}, >= {self.rotary_dim}]")
        docs = torch.as_tensor(docs, dtype=torch.int64).reshape(-1).cpu()
        if docs.numel() != x.shape[0]:
            raise ValueError(f"{docs.numel()} document ids for {x.shape[0]} sequences")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(x.shape[:2])}")
        a, b = band_parts(x.double(), self.rotary_dim, self.layout)  # b pos h m: Re z, Im z
        w = None if mask is None else mask.to(x.device, torch.bool).double()

        def masked_sum(v: Tensor) -> Tensor:  # Σ over kept positions per sequence: [b, h, m]
            return v.sum(1) if w is None else torch.einsum("bp,bphm->bhm", w, v)

        n = torch.full(x.shape[:1], x.shape[1], device=x.device) if w is None else w.sum(1)
        # kept on x's device until read (:meth:`_flush`): no copy to the host per batch and layer
        if abs2 is None:
            abs2 = a * a + b * b
        elif tuple(abs2.shape) != tuple(a.shape) or abs2.dtype != torch.float64:
            raise ValueError(f"abs2 has shape {tuple(abs2.shape)} and dtype {abs2.dtype}; expected {tuple(a.shape)}, "
                             "float64")
        self._pending.append((docs, n.long(), torch.complex(masked_sum(a), masked_sum(b)), masked_sum(abs2)))

    def merge(self, other: SequenceBandSums) -> SequenceBandSums:
        """A new accumulator holding both sets of sequences (inputs unchanged)."""
        if (self.n_heads, self.rotary_dim, self.layout) != (other.n_heads, other.rotary_dim, other.layout):
            raise ValueError("cannot merge SequenceBandSums of different heads / rotary_dim / layout")
        out = SequenceBandSums(self.n_heads, self.rotary_dim, self.layout)
        for key in _STATE_KEYS:
            setattr(out, key, torch.cat([getattr(self, key), getattr(other, key)]))
        return out

    # ------------------------------------------------------------------ statistics

    def _total(self) -> tuple[Tensor, Tensor, Tensor]:
        n = self.n.sum().double()
        return n, self.sum_z.sum(0), self.sum_abs2.sum(0)

    def energy(self) -> Float[Tensor, "head_index band"]:
        """``E|z|²`` over all tokens, ``[head_index, band]``."""
        n, _, s2 = self._total()
        return _nan_div(s2, n)

    def mean_bands(self) -> Complex[Tensor, "head_index band"]:
        """``E z`` over all tokens, complex ``[head_index, band]``."""
        n, sz, _ = self._total()
        return sz / n if n > 0 else torch.full_like(sz, complex("nan"))

    def rho_plugin(self) -> Float[Tensor, "head_index band"]:
        """Legacy plug-in ``|E z|² / E|z|²`` (biased upward by between-text variance)."""
        return _nan_div(self.mean_bands().abs().square(), self.energy())

    def rho_within(self) -> Float[Tensor, "head_index band"]:
        """Mean over sequences of ``|mean_s z|² / mean_s |z|²`` (sequences with tokens only)."""
        ok = self.n > 0
        n = self.n[ok].double()[:, None, None]
        z2 = torch.view_as_real(self.sum_z[ok]).square()
        m2 = (z2[..., 0] + z2[..., 1]) / n.square()  # |mean_s z|² (no complex division, no reduction over an axis of 2)
        per = _nan_div(m2, self.sum_abs2[ok] / n)
        return torch.nanmean(per, 0) if ok.any() else torch.full(self.sum_z.shape[1:], torch.nan, dtype=torch.float64)

    def cross_offset(self, n_splits: int = 16, seed: int = 0) -> Float[Tensor, "head_index band"]:
        """``Re⟨z̄_A, z̄_B⟩`` averaged over ``n_splits`` seeded random halvings of the documents.

        Unbiased for ``|E z|²`` when documents are independent. NaN with fewer than 2 documents.
        """
        docs = torch.unique(self.doc[self.n > 0])
        if docs.numel() < 2:
            return torch.full(self.sum_z.shape[1:], torch.nan, dtype=torch.float64)
        half_a, half_b = _halves(tuple(docs.tolist()), tuple(self.doc.tolist()), max(1, n_splits), int(seed))
        # per column c, the mean over splits s of z̄_A[c]·z̄_B[c] is Σ_{p,q} flat[p, c]·M[p, q]·flat[q, c] with
        # M = mean_s a_s b_sᵀ / (n_A,s · n_B,s) (a_s, b_s: the halves' sequence indicators): the splits folded into one
        # [seq, seq] matrix, the [seq, column] work one product (real and imaginary parts as real columns:
        # Re(z̄_A · conj z̄_B) = Re·Re + Im·Im)
        n = self.n.double()
        m = (half_a / (half_a @ n)[:, None]).T @ (half_b / (half_b @ n)[:, None]) / half_a.shape[0]
        flat = torch.view_as_real(self.sum_z).reshape(len(self.doc), -1)  # [seq, head·band·2]
        prod = (flat * (m @ flat)).sum(0).reshape(-1, 2)
        return (prod[:, 0] + prod[:, 1]).reshape(self.sum_z.shape[1:])

    def rho_cross(self, n_splits: int = 16, seed: int = 0) -> Float[Tensor, "head_index band"]:
        """Cross-fitted ``Re⟨z̄_A, z̄_B⟩ / E|z|²`` (document halves; may be < 0)."""
        return _nan_div(self.cross_offset(n_splits, seed), self.energy())

    def stability(self, n_splits: int = 16, seed: int = 0) -> Float[Tensor, "head_index band"]:
        """``rho_cross / rho_within``: the share of the within-text offset shared across texts."""
        return _nan_div(self.rho_cross(n_splits, seed), self.rho_within())

    def within_residual_energy(self) -> Float[Tensor, "head_index band"]:
        """``Σ_s Σ_t |z − mean_s z|² / Σ_s n_s``: residual energy around each sequence's own mean."""
        ok = self.n > 0
        n = self.n[ok].double()[:, None, None]
        res = self.sum_abs2[ok] - self.sum_z[ok].abs().square() / n
        return _nan_div(res.sum(0).clamp_min(0.0), n.sum())

    def residual_energy(self, center: Complex[Tensor, "head_index band"]) -> Float[Tensor, "head_index band"]:
        """``E|z − c|²`` around a fixed ``center`` (e.g. a global reference k̄'s bands)."""
        c = center.to(torch.complex128).cpu()
        ez = self.mean_bands()
        return (self.energy() - 2 * (ez * c.conj()).real + c.abs().square()).clamp_min(0.0)

    def forms(self, n_splits: int = 16, seed: int = 0) -> dict[str, Float[Tensor, "head_index band"]]:
        """``{rho_within, rho_cross, stability, rho_plugin}``, each float64 ``[head_index, band]``."""
        within, cross = self.rho_within(), self.rho_cross(n_splits, seed)
        return {"rho_within": within, "rho_cross": cross, "stability": _nan_div(cross, within),
                "rho_plugin": self.rho_plugin()}

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        state = {key: getattr(self, key).clone() for key in _STATE_KEYS}
        state.update(n_heads=self.n_heads, rotary_dim=self.rotary_dim, layout=self.layout)
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> SequenceBandSums:
        out = cls(state["n_heads"], state["rotary_dim"], state["layout"])
        for key in _STATE_KEYS:
            setattr(out, key, state[key].clone())
        return out

    @classmethod
    def from_state_dicts(cls, states: Sequence[dict]) -> SequenceBandSums:
        """One accumulator holding the heads of several :meth:`state_dict` outputs side by side, in order (a stack of
        layers, or a layer's query heads then its key heads): the same sequences (``doc`` and ``n`` equal), one
        ``rotary_dim`` and ``layout``; ``ValueError`` otherwise. Fresh tensors."""
        if not states:
            raise ValueError("no accumulator states to put side by side")
        first = states[0]
        for st in states[1:]:
            if (st["rotary_dim"], st["layout"]) != (first["rotary_dim"], first["layout"]):
                raise ValueError(f"cannot put side by side sequence sums of rotary_dim/layout {first['rotary_dim']}/"
                                 f"{first['layout']!r} and {st['rotary_dim']}/{st['layout']!r}")
            if not (torch.equal(st["doc"], first["doc"]) and torch.equal(st["n"], first["n"])):
                raise ValueError("cannot put side by side sequence sums of different sequences (doc ids or token counts)")
        out = cls(sum(int(st["n_heads"]) for st in states), first["rotary_dim"], first["layout"])
        out.doc, out.n = first["doc"].clone(), first["n"].clone()
        out.sum_z = torch.cat([st["sum_z"] for st in states], dim=1)
        out.sum_abs2 = torch.cat([st["sum_abs2"] for st in states], dim=1)
        if out.sum_z.shape[1:] != (out.n_heads, out.n_bands) or out.sum_abs2.shape != out.sum_z.shape:
            raise ValueError(f"sequence sums of shapes {tuple(out.sum_z.shape)} / {tuple(out.sum_abs2.shape)} for "
                             f"{out.n_heads} heads and {out.n_bands} bands")
        return out

    def __repr__(self) -> str:
        return (f"SequenceBandSums(n_heads={self.n_heads}, rotary_dim={self.rotary_dim}, layout={self.layout!r}, "
                f"n_seq={self.n_seq}, n_docs={int(torch.unique(self.doc).numel())})")


_HALVES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _halves(docs: tuple[int, ...], seq_docs: tuple[int, ...], n_splits: int, seed: int) -> tuple[Tensor, Tensor]:
    """The ``n_splits`` seeded random halvings of the documents ``docs`` as float64 ``[split, seq]`` indicators of
    the sequences (``seq_docs``) in half A and in half B — the splits of :meth:`SequenceBandSums.cross_offset`,
    drawn once per (documents, splits, seed): every layer and q/k of a run shares them."""
    key = (docs, seq_docs, n_splits, seed)
    if key not in _HALVES:
        if len(_HALVES) > 64:
            _HALVES.clear()
        gen = torch.Generator().manual_seed(30_011 + seed)
        d, sd = torch.tensor(docs), torch.tensor(seq_docs, dtype=torch.int64)
        a, b = [], []
        for _ in range(n_splits):
            perm = d[torch.randperm(len(docs), generator=gen)]
            a.append(torch.isin(sd, perm[: len(docs) // 2]))
            b.append(torch.isin(sd, perm[len(docs) // 2 :]))
        _HALVES[key] = torch.stack(a).double(), torch.stack(b).double()
    return _HALVES[key]


def rho_forms(
    x: Float[Tensor, "batch pos head_index d_head"],
    docs: Int[Tensor, "batch"],
    rotary_dim: int,
    layout: Layout,
    mask: Bool[Tensor, "batch pos"] | None = None,
    *,
    n_splits: int = 16,
    seed: int = 0,
) -> dict[str, Float[Tensor, "head_index band"]]:
    """One-shot :meth:`SequenceBandSums.forms` of a batch: ``{rho_within, rho_cross, stability,
    rho_plugin}`` float64 ``[head_index, band]``."""
    s = SequenceBandSums(x.shape[-2], rotary_dim, layout)
    s.update(x, docs, mask)
    return s.forms(n_splits, seed)

