"""Tests of posgen_tl.heads: block swaps, positional/symbolic scores, band logits, frequency use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from posgen_tl.heads import (
    band_logits,
    band_patterns,
    block_swap_permutation,
    causal_mask,
    frequency_centroid,
    frequency_usage_frame,
    pass_logits,
    positional_share,
    positional_symbolic_scores,
    taxonomy_label,
)
from posgen_tl.perturb import inverse_permutation
from posgen_tl.rope import LayerRope, expand_kv, rotate, scores_from_rotated


def make_rope(layout="half", rotary_dim=8, score_scale=0.25) -> LayerRope:
    inv = 1.0 / 100.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return LayerRope(inv_freq=inv, rotary_dim=rotary_dim, layout=layout, score_scale=score_scale)


# ----------------------------------------------------------------------------- block swap


@pytest.mark.parametrize(
    "a,b", [((2, 6), (6, 10)), ((2, 5), (8, 14)), ((1, 8), (10, 12)), ((0, 1), (19, 20))]
)
def test_block_swap_permutation(a, b):
    n = 20
    p = block_swap_permutation(n, a, b)
    assert torch.equal(p.sort().values, torch.arange(n))
    old = torch.arange(100, 100 + n)
    new = old[p]
    la, lb = a[1] - a[0], b[1] - b[0]
    assert torch.equal(new[: a[0]], old[: a[0]])
    assert torch.equal(new[a[0] : a[0] + lb], old[b[0] : b[1]])  # B first, in order
    mid = b[0] - a[1]
    assert torch.equal(new[a[0] + lb : a[0] + lb + mid], old[a[1] : b[0]])  # shifted middle
    assert torch.equal(new[a[0] + lb + mid : b[1]], old[a[0] : a[1]])  # then A, in order
    assert torch.equal(new[b[1] :], old[b[1] :])
    assert a[0] + lb + mid + la == b[1]


def test_block_swap_invalid():
    for a, b in [((3, 2), (5, 6)), ((2, 6), (5, 8)), ((2, 4), (6, 21)), ((2, 2), (4, 6))]:
        with pytest.raises(ValueError):
            block_swap_permutation(20, a, b)


# ----------------------------------------------------------------------------- constructed heads


def _pattern(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[-1]
    return torch.softmax(logits.masked_fill(~causal_mask(n), float("-inf")), dim=-1)


N, A, B = 40, (8, 14), (17, 26)


def _positional_head(n):
    """Logits depend on the offset i − j only: a peak at i − 5 (plus a fixed offset profile)."""
    g = torch.Generator().manual_seed(0)
    prof = torch.randn(n, generator=g) * 0.3
    prof[5] += 6.0
    i = torch.arange(n)
    rel = (i[:, None] - i[None, :]).clamp_min(0)
    return _pattern(prof[rel])


def _symbolic_head(tokens, content):
    """Logits depend on the key's token identity only (a fixed token gets most mass)."""
    n = tokens.shape[0]
    return _pattern(content[tokens][None, :].expand(n, n))


def test_constructed_positional_and_symbolic_heads():
    perm = block_swap_permutation(N, A, B)
    inv = inverse_permutation(perm)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randperm(100, generator=g)[:N]  # distinct token ids
    tokens_swap = tokens[perm]
    content = torch.randn(100, generator=g) * 0.5
    content[tokens[10]] += 6.0  # the head looks for this token (inside block A)
    key_cols = torch.arange(A[0], B[1])
    # the positional head's queries must look into the moved region: i − 5 ∈ [a0, b1)
    rows_pos = torch.arange(B[1], B[1] + 5)
    rows_all = torch.arange(B[1], N)

    pos_head = torch.stack([_positional_head(N), _positional_head(N)])  # orig, swap: same
    sym_orig, sym_swap = _symbolic_head(tokens, content), _symbolic_head(tokens_swap, content)
    # stack into [batch=1, head_index=2, q, k]: head 0 positional, head 1 symbolic
    orig = torch.stack([pos_head[0], sym_orig])[None]
    swap = torch.stack([pos_head[1], sym_swap])[None]

    pos_p, sym_p = positional_symbolic_scores(orig, swap, perm, rows_pos, key_cols)
    assert pos_p.shape == (1, 2)
    assert pos_p[0, 0] > 0.999 and sym_p[0, 0] < pos_p[0, 0] - 0.5
    pos_s, sym_s = positional_symbolic_scores(orig, swap, perm, rows_all, key_cols)
    assert sym_s[0, 1] > 0.999 and pos_s[0, 1] < sym_s[0, 1] - 0.5
    labels = taxonomy_label(torch.stack([pos_p[0, 0], pos_s[0, 1]]), torch.stack([sym_p[0, 0], sym_s[0, 1]]))
    assert labels.tolist() == ["positional", "symbolic"]

    # sanity of the symbolic construction: the target token moved and the head followed it
    p_old = 10
    assert sym_orig[N - 1].argmax() == p_old and sym_swap[N - 1].argmax() == inv[p_old] != p_old


def test_positional_symbolic_edge_cases():
    perm = block_swap_permutation(N, A, B)
    key_cols = torch.arange(A[0], B[1])
    pat = _positional_head(N)[None, None]
    # rows whose attention misses the region are ignored; all ignored -> NaN
    zero = torch.zeros_like(pat)
    zero[..., torch.arange(N), torch.arange(N)] = 1.0  # attend to self only (outside the region)
    pos, sym = positional_symbolic_scores(zero, zero, perm, torch.arange(B[1], N), key_cols)
    assert torch.isnan(pos).all() and torch.isnan(sym).all()
    assert taxonomy_label(pos, sym).tolist() == [["undefined"]]
    with pytest.raises(ValueError, match="moved"):
        positional_symbolic_scores(pat, pat, perm, torch.tensor([A[0], B[1]]), key_cols)
    assert taxonomy_label(np.array([0.5, 0.9, 0.2]), np.array([0.45, 0.2, 0.9])).tolist() == [
        "mixed", "positional", "symbolic"
    ]


# ----------------------------------------------------------------------------- band view


@pytest.mark.parametrize("layout", ["half", "adjacent"])
@pytest.mark.parametrize("d_head,rotary_dim", [(8, 8), (12, 8)])
def test_band_logits_sum_identity(layout, d_head, rotary_dim):
    torch.manual_seed(0)
    rope = make_rope(layout, rotary_dim)
    b, n, h, g = 2, 11, 4, 2
    ar = torch.arange(n)
    rot_q = rotate(torch.randn(b, n, h, d_head, dtype=torch.float64), ar, rope)
    rot_k_grouped = rotate(torch.randn(b, n, g, d_head, dtype=torch.float64), ar, rope)
    ref = scores_from_rotated(rot_q, rot_k_grouped, rope.score_scale)
    bl = band_logits(rot_q, rot_k_grouped, rope)
    pl = pass_logits(rot_q, rot_k_grouped, rope)
    assert bl.shape == (b, h, rotary_dim // 2, n, n) and pl.shape == (b, h, n, n)
    torch.testing.assert_close(bl.sum(2) + pl, ref, rtol=0, atol=1e-10)
    # pre-expanded keys give the same; pass term vanishes iff no pass-through dims
    torch.testing.assert_close(band_logits(rot_q, expand_kv(rot_k_grouped, h), rope), bl)
    assert (pl.abs().max() == 0) == (d_head == rotary_dim)
    # each band is its own 2-D head: band m only sees coordinates of band m
    z = rot_q.clone()
    z[..., 1] += 1.0  # perturb one coordinate: band 1 (half) or band 0 (adjacent)
    changed = (band_logits(z, rot_k_grouped, rope) - bl).abs().amax((0, 1, 3, 4)) > 0
    assert changed.tolist() == [i == (1 if layout == "half" else 0) for i in range(rotary_dim // 2)]


def test_band_patterns():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 4, 6, 6)
    mask = causal_mask(6, sliding_window=3)
    p = band_patterns(logits, mask)
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 4, 6))
    assert (p[..., ~mask] == 0).all()
    ref = torch.softmax(logits[0, 0, 0, 4, 2:5], -1)
    torch.testing.assert_close(p[0, 0, 0, 4, 2:5], ref)
    none = band_patterns(logits, torch.zeros(6, 6, dtype=torch.bool))
    assert (none == 0).all()


def test_positional_share():
    torch.manual_seed(2)
    n = 10
    mask = causal_mask(n)
    i = torch.arange(n)
    f = torch.randn(n)[(i[:, None] - i[None, :]).clamp_min(0)][None].expand(3, n, n).clone()
    g = torch.randn(3, n, n)
    row_const = torch.randn(3, n, 1)
    share = positional_share(f, g, mask)
    assert share.shape == (3,) and ((share > 0) & (share < 1)).all()
    torch.testing.assert_close(positional_share(f + row_const, g - row_const, mask), share)  # row constants ignored
    g_masked = g.masked_fill(~mask, float("-inf"))  # masked entries ignored (even -inf)
    torch.testing.assert_close(positional_share(f, g_masked, mask), share)
    torch.testing.assert_close(positional_share(f, torch.zeros_like(g), mask), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(positional_share(2 * g, g, mask), torch.full((3,), 0.8, dtype=torch.float64))


def test_frequency_centroid_and_frame():
    e = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(frequency_centroid(e), torch.tensor([0.0, 3.0, 1.5], dtype=torch.float64))
    df = frequency_usage_frame(e, layer=3, which="k", model="m", twin="random")
    assert len(df) == 12
    assert set(df.columns) >= {"model", "twin", "layer", "which", "head", "band", "energy_share", "centroid"}
    row = df[(df["head"] == 2) & (df["band"] == 1)].iloc[0]
    assert row.energy_share == 0.25 and row.centroid == 1.5 and row.layer == 3 and row.twin == "random"
    assert df.groupby("head").energy_share.sum().tolist() == [1.0, 1.0, 1.0]
