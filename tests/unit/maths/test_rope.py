"""Pure RoPE maths: orthogonality, inverses, the relative-rotation identity, band views."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.rope import (
    LayerRope,
    RopeError,
    band_indices,
    from_bands,
    relative_rotation_matrix,
    rotate,
    rotation_matrix,
    scores_from_prerotation,
    scores_from_rotated,
    to_bands,
    unrotate,
)


@st.composite
def ropes(draw):
    n_bands = draw(st.integers(1, 6))
    rotary_dim = 2 * n_bands
    extra = draw(st.integers(0, 3))
    base = draw(st.sampled_from([10.0, 1e4, 1e6]))
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    rope = LayerRope(
        inv_freq=inv.float(),
        rotary_dim=rotary_dim,
        layout=draw(st.sampled_from(["half", "adjacent"])),
        attention_scaling=draw(st.sampled_from([1.0, 1.25])),
        position_scale=draw(st.sampled_from([1.0, 2.0])),
        score_scale=draw(st.floats(0.05, 2.0)),
    )
    return rope, rotary_dim + extra


@settings(max_examples=40, deadline=None)
@given(ropes(), st.integers(-50, 50))
def test_rotation_is_orthogonal(rd, p):
    rope, d = rd
    R = rotation_matrix(p, rope, d)
    assert torch.allclose(R.T @ R, torch.eye(d, dtype=R.dtype), atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(ropes(), st.integers(0, 40), st.integers(0, 40))
def test_relative_rotation_identity(rd, i, j):
    """R_iᵀ R_j = R_{j−i} (angles composed exactly in float64)."""
    rope, d = rd
    rope64 = LayerRope(rope.inv_freq.double(), rope.rotary_dim, rope.layout, 1.0, rope.position_scale)
    Ri = _dense64(i, rope64, d)
    Rj = _dense64(j, rope64, d)
    assert torch.allclose(Ri.T @ Rj, _dense64(j - i, rope64, d), atol=1e-10)
    # the library's dense R_{j−i} (float32 angles, as the model) agrees to float32 precision
    assert torch.allclose(relative_rotation_matrix(j - i, rope64, d), _dense64(j - i, rope64, d), atol=1e-5)


def _dense64(p, rope, d):
    """Dense R_p built from float64 angles (independent of `rotate`)."""
    R = torch.eye(d, dtype=torch.float64)
    a, b = band_indices(rope.rotary_dim, rope.layout)
    th = rope.inv_freq.double() / rope.position_scale * p
    for m in range(rope.rotary_dim // 2):
        c, s = math.cos(th[m]), math.sin(th[m])
        R[a[m], a[m]], R[a[m], b[m]], R[b[m], a[m]], R[b[m], b[m]] = c, -s, s, c
    return R


@settings(max_examples=30, deadline=None)
@given(ropes(), st.integers(1, 9))
def test_unrotate_inverts_rotate(rd, n):
    rope, d = rd
    x = torch.randn(2, n, 3, d, dtype=torch.float64)
    pos = torch.arange(n).expand(2, n)
    assert torch.allclose(unrotate(rotate(x, pos, rope), pos, rope), x, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(ropes(), st.integers(1, 9))
def test_rotate_matches_dense_matrix_and_band_picture(rd, n):
    rope, d = rd
    x = torch.randn(1, n, 2, d, dtype=torch.float64)
    pos = torch.arange(n)[None]
    y = rotate(x, pos, rope)
    rope64 = LayerRope(rope.inv_freq.double(), rope.rotary_dim, rope.layout, 1.0, rope.position_scale)
    for p in range(n):
        ref = rope.attention_scaling * (x[0, p] @ _dense64(p, rope64, d).T)
        r = rope.rotary_dim
        ref[:, r:] = x[0, p, :, r:]
        assert torch.allclose(y[0, p], ref, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(ropes(), st.integers(1, 8), st.sampled_from([(2, 1), (4, 2), (6, 3), (3, 3)]))
def test_prerotation_scores_equal_rotated_scores(rd, n, heads):
    """s·(R_i q)·(R_j k) == s·a²·qᵀR_{j−i}k, with GQA group expansion."""
    rope, d = rd
    H, G = heads
    q = torch.randn(2, n, H, d, dtype=torch.float64)
    k = torch.randn(2, n, G, d, dtype=torch.float64)
    pos = torch.arange(n).expand(2, n)
    w1 = scores_from_rotated(rotate(q, pos, rope), rotate(k, pos, rope), rope.score_scale)
    w2 = scores_from_prerotation(q, k, pos, rope)
    assert torch.allclose(w1, w2, atol=1e-5)


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_band_view_round_trip_and_indexing(layout):
    r, d = 8, 11
    x = torch.randn(3, d)
    z = to_bands(x, r, layout)
    a, b = band_indices(r, layout)
    assert torch.equal(z.real, x[:, a]) and torch.equal(z.imag, x[:, b])
    assert torch.equal(from_bands(z, layout, x[:, r:]), x)
    if layout == "half":
        assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6, 7]
    else:
        assert a.tolist() == [0, 2, 4, 6] and b.tolist() == [1, 3, 5, 7]


def test_rotation_equals_complex_multiplication():
    rope = LayerRope(torch.tensor([0.7, 0.1]), 4, "half")
    x = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    pos = torch.arange(3)[None]
    zr = to_bands(rotate(x, pos, rope), 4, "half")
    ang = pos[..., None].double() * rope.inv_freq.double()
    assert torch.allclose(zr[0, :, 0], to_bands(x, 4, "half")[0, :, 0] * torch.exp(1j * ang[0]), atol=1e-6)


def test_bad_specs_raise():
    with pytest.raises(RopeError, match="layout"):
        LayerRope(torch.ones(2), 4, "interleaved")  # type: ignore[arg-type]
    with pytest.raises(RopeError, match="rotary_dim"):
        LayerRope(torch.ones(2), 5)
    with pytest.raises(RopeError, match="inv_freq"):
        LayerRope(torch.ones(3), 4)
    rope = LayerRope(torch.ones(4), 8)
    with pytest.raises(RopeError, match="smaller than rotary_dim"):
        rotate(torch.randn(1, 2, 1, 6), torch.arange(2)[None], rope)


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_rotation_residual_is_rotate_minus_rot_bit_for_bit_band_by_band(layout):
    """rotation_residual(x, rot) holds exactly rotate(x) − rot: the band parts of the rotated dims, then the unrotated
    dims (partial rotary, attention scaling, per-sequence positions)."""
    from posgen_tl.maths.rope import band_parts, rotation_residual  # noqa: PLC0415

    gen = torch.Generator().manual_seed(5)
    rope = LayerRope(inv_freq=1.0 / (30.0 ** (torch.arange(0, 6, 2).float() / 6)), rotary_dim=6, layout=layout,
                     attention_scaling=0.9)
    x, rot = torch.randn(2, 5, 3, 9, generator=gen), torch.randn(2, 5, 3, 9, generator=gen)
    pos = torch.stack([torch.arange(5), torch.arange(5) + 7])
    diff = rotate(x, pos, rope) - rot
    got = rotation_residual(x, rot, pos, rope)
    assert len(got) == 3
    assert torch.equal(got[0], band_parts(diff, 6, layout)[0]) and torch.equal(got[1], band_parts(diff, 6, layout)[1])
    assert torch.equal(got[2], diff[..., 6:])
