"""LongRoPE in LayerRope, the recomputed attention pattern with learned sinks, rotation by a given table."""

from __future__ import annotations

import math

import pytest
import torch

from posgen_tl.maths.rope import (
    LayerRope,
    RopeError,
    angles,
    attention_pattern,
    causal_mask,
    rotate,
    rotate_with_table,
    unrotate,
)

SHORT = torch.tensor([0.5, 0.05, 0.005])
LONG = torch.tensor([0.25, 0.01, 0.0005])


def _longrope() -> LayerRope:
    return LayerRope(inv_freq=SHORT, rotary_dim=6, attention_scaling=1.2, long_inv_freq=LONG, long_after=16)


def test_longrope_picks_the_factor_set_from_the_largest_position_id_as_hf():
    lr = _longrope()
    assert lr.for_positions(torch.arange(16)).inv_freq is SHORT  # max id + 1 = 16 = original length: short
    assert torch.equal(lr.for_positions(torch.arange(17)).inv_freq, LONG)
    assert lr.for_positions(torch.arange(17)).long_inv_freq is None and lr.for_positions(torch.arange(17)).kind == "full+long"
    # one choice for the whole batch (HF: max over position_ids), so a short row rotates with LONG too
    pos = torch.stack([torch.arange(17), torch.arange(17).clamp(max=3)])
    torch.testing.assert_close(angles(pos, lr)[1], pos[1, :, None].float() * LONG)
    torch.testing.assert_close(angles(torch.arange(8)[None], lr)[0], torch.arange(8)[:, None].float() * SHORT)
    x = torch.randn(1, 20, 2, 8, dtype=torch.float64)
    p = torch.arange(20)[None]
    torch.testing.assert_close(unrotate(rotate(x, p, lr), p, lr), x, rtol=0, atol=1e-5)  # float32 angles


def test_longrope_fields_are_checked():
    with pytest.raises(RopeError, match="together"):
        LayerRope(inv_freq=SHORT, rotary_dim=6, long_inv_freq=LONG)
    with pytest.raises(RopeError, match="long_inv_freq has shape"):
        LayerRope(inv_freq=SHORT, rotary_dim=6, long_inv_freq=LONG[:2], long_after=4)


def test_attention_pattern_with_and_without_sinks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64) * 3
    m = causal_mask(5, sliding_window=3)
    p = attention_pattern(w, m)
    assert torch.equal(p[..., ~m], torch.zeros_like(p[..., ~m]))
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    sinks = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    ps = attention_pattern(w, m, sinks)
    for h in range(3):  # by hand: exp(w) / (Σ_visible exp(w) + exp(sink_h))
        e = torch.where(m, w[:, h].exp(), 0.0)
        torch.testing.assert_close(ps[:, h], e / (e.sum(-1, keepdim=True) + math.exp(sinks[h])))
    assert (ps.sum(-1) < 1).all()
    with pytest.raises(RopeError, match="one per head"):
        attention_pattern(w, m, sinks[:2])


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_rotate_with_the_models_table_equals_rotate(layout):
    lr = LayerRope(inv_freq=torch.tensor([0.9, 0.1]), rotary_dim=4, layout=layout, attention_scaling=1.1)
    x = torch.randn(2, 6, 3, 5)
    pos = torch.arange(6).expand(2, 6)
    ang = angles(pos, lr)
    table = rotate_with_table(x, ang.cos() * 1.1, ang.sin() * 1.1, lr)
    assert torch.equal(table, rotate(x, pos, lr))
    wrong = rotate_with_table(x, ang.cos() * 1.1, -ang.sin() * 1.1, lr)  # the opposite direction differs
    assert not torch.allclose(wrong, table)
    with pytest.raises(RopeError, match="bands"):
        rotate_with_table(x, ang.cos()[..., :1], ang.sin()[..., :1], lr)
