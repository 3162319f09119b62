"""Query head h reads kv head h // (H / G) — HF's repeat_kv — in expand_kv and in EVERY place that
expands keys (or per-group key statistics) to query heads.

H = 6 query heads over G = 3 kv heads: h // 2 = [0, 0, 1, 1, 2, 2] while the wrong h % 3 = [0, 1, 2, 0, 1, 2],
so each test below fails under the wrong mapping. The reference expansion is written out here, not taken
from the library: every function is called once with G kv heads and once with the keys already expanded
to H heads by that explicit index, and both must agree."""

from __future__ import annotations

import pytest
import torch

from posgen_tl.maths import approx_logits as al
from posgen_tl.maths import band_stats as bs
from posgen_tl.maths import decompose as dc
from posgen_tl.maths import perturb
from posgen_tl.maths import taxonomy as tx
from posgen_tl.maths.rope import (
    LayerRope,
    RopeError,
    RopeSpec,
    expand_kv,
    kv_head_index,
    rotate,
    scores_from_prerotation,
    scores_from_rotated,
)

H, G, D, R, N = 6, 3, 8, 6, 7
IDX = [h // (H // G) for h in range(H)]  # [0, 0, 1, 1, 2, 2]: the mapping, written out
ROPE = LayerRope(inv_freq=1.0 / 100.0 ** (torch.arange(0, R, 2).float() / R), rotary_dim=R, score_scale=0.3)


def _qk(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, N, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, N, G, D, generator=g, dtype=torch.float64)
    return q, k, k[..., IDX, :]  # q, kv-group keys, keys expanded by the explicit index


def test_kv_head_index_and_expand_kv():
    assert kv_head_index(H, G).tolist() == IDX == [0, 0, 1, 1, 2, 2]
    assert kv_head_index(4, 1).tolist() == [0, 0, 0, 0] and kv_head_index(3, 3).tolist() == [0, 1, 2]
    _, k, kh = _qk()
    assert torch.equal(expand_kv(k, H), kh)
    for h in range(H):
        assert torch.equal(expand_kv(k, H)[..., h, :], k[..., h // 2, :])
    with pytest.raises(RopeError, match="multiple"):
        kv_head_index(6, 4)


def test_spec_kv_group():
    spec = RopeSpec("m", 1, H, G, D, 16, (ROPE,))
    assert [spec.kv_group(h) for h in range(H)] == IDX


def test_scores_from_rotated_and_prerotation():
    q, k, kh = _qk()
    pos = torch.arange(N).expand(2, N)
    rq, rk, rkh = rotate(q, pos, ROPE), rotate(k, pos, ROPE), rotate(kh, pos, ROPE)
    w = scores_from_rotated(rq, rk, 0.3)
    assert torch.equal(w, scores_from_rotated(rq, rkh, 0.3))
    for h in range(H):  # head h against kv head h // 2, by hand
        torch.testing.assert_close(w[:, h], 0.3 * rq[:, :, h] @ rk[:, :, h // 2].transpose(-1, -2))
    torch.testing.assert_close(scores_from_prerotation(q, k, pos, ROPE), scores_from_prerotation(q, kh, pos, ROPE))


def test_d3_split_and_bound():
    q, k, kh = _qk(1)
    pos = torch.arange(N).expand(2, N)
    kbar = k.mean(1)  # [b, G, d]: per-sequence mean per kv head
    a = dc.d3_split(q, k, kbar, pos, ROPE)
    b = dc.d3_split(q, kh, kbar[:, IDX], pos, ROPE)
    for name in ("W", "f", "g"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-12)
    torch.testing.assert_close(dc.d3_bound(q, k, kbar, pos, ROPE), dc.d3_bound(q, kh, kbar[:, IDX], pos, ROPE))


def test_approx_logits_and_capped_scores():
    q, k, kh = _qk(2)
    kbar = k.mean((0, 1))  # [G, d]
    same = lambda x, y: torch.testing.assert_close(x, y, rtol=0, atol=1e-12, equal_nan=True)  # noqa: E731
    same(al.exact_logits(q, k, ROPE), al.exact_logits(q, kh, ROPE))
    same(al.d3_approx_logits(q, k, kbar, ROPE), al.d3_approx_logits(q, kh, kbar[IDX], ROPE))
    rows = al.d3_row_blocks(q, k, kbar, ROPE, dtype=torch.float64), al.d3_row_blocks(q, kh, kbar[IDX], ROPE,
                                                                                       dtype=torch.float64)
    same(rows[0](2, N), rows[1](2, N))  # per kv-group vs keys expanded by the explicit index
    same(al.lm_infinite_logits(q, k, ROPE, 3, n_sink=1), al.lm_infinite_logits(q, kh, ROPE, 3, n_sink=1))
    same(al.disentangled_logits(q, k, kbar, ROPE, 3), al.disentangled_logits(q, kh, kbar[IDX], ROPE, 3))
    same(perturb.capped_scores(q, k, ROPE, 3), perturb.capped_scores(q, kh, ROPE, 3))


def test_band_logits():
    q, k, kh = _qk(3)
    pos = torch.arange(N).expand(2, N)
    rq, rk = rotate(q, pos, ROPE), rotate(k, pos, ROPE)
    torch.testing.assert_close(tx.band_logits(rq, rk, ROPE), tx.band_logits(rq, rk[..., IDX, :], ROPE))


def test_band_statistics_expanded_to_query_heads():
    g = torch.Generator().manual_seed(4)
    q_e = torch.rand(H, R // 2, generator=g, dtype=torch.float64)
    k_e = torch.rand(G, R // 2, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [10.0], [100.0]])
    w, spread = torch.rand(R // 2, dtype=torch.float64), torch.ones(H, dtype=torch.float64)
    a = bs.predicted_d3_error(q_e, k_e, w, spread)["pred_d3_err"]
    assert torch.equal(a, bs.predicted_d3_error(q_e, k_e[IDX], w, spread)["pred_d3_err"])
    q, k, kh = _qk(5)
    qs, ks, khs = (bs.BandStats(x.shape[-2], D, R, "half") for x in (q, k, kh))
    for st, x in ((qs, q), (ks, k), (khs, kh)):
        st.update(x)
    pa, pb = bs.pattern_scores(qs, ks, ROPE, N), bs.pattern_scores(qs, khs, ROPE, N)
    for key in ("legacy_pattern_score", "expected_bound"):
        torch.testing.assert_close(pa[key], pb[key], equal_nan=True)
    pos = torch.arange(N).expand(2, N)  # the block-Gram spread groups heads with a rearrange of its own
    rq, rk = rotate(q, pos, ROPE), rotate(k, pos, ROPE)
    sa = bs.within_row_spread_qk(rq, rk, 0.3, sliding_window=4, block=2)
    sb = bs.within_row_spread_qk(rq, rk[..., IDX, :], 0.3, sliding_window=4, block=2)
    torch.testing.assert_close(sa[0], sb[0])


def test_pattern_frames_kv_group_column():
    from posgen_tl.experiments.pattern import pattern_frames

    q, k, _ = _qk(6)
    qs, ks = bs.BandStats(H, D, R, "half"), bs.BandStats(G, D, R, "half")
    qs.update(q)
    ks.update(k * torch.tensor([1.0, 5.0, 25.0], dtype=torch.float64)[:, None])  # distinct key energies per group
    _, heads = pattern_frames(qs, ks, ROPE, layer=0, max_distance=N)
    assert heads["kv_group"].tolist() == IDX
    cent = tx.frequency_centroid(ks.energy_share()).numpy()
    assert heads["key_energy_centroid"].tolist() == pytest.approx(cent[IDX].tolist())


@pytest.fixture(scope="module")
def gqa_model():
    import tiny_models as tm

    return tm.hf_llama(n_heads=4, n_kv=2)[0]  # head h reads kv head h // 2 (h % 2 would differ for h = 1, 2)


def test_capture_and_head_maps_read_kv_head_h_over_group_size(gqa_model):
    from posgen_tl.experiments.head_maps import decompose_head
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.maths.rope import causal_mask

    toks = torch.randint(3, 90, (1, 9), generator=torch.Generator().manual_seed(0))
    c = capture_qk(gqa_model, toks, layers=[1], with_scores=True)[1]
    assert torch.equal(c.k_expanded(), c.k[..., [0, 0, 1, 1], :])
    m = causal_mask(9)
    for h in range(4):
        hd = decompose_head(gqa_model, toks, layer=1, head=h, sink=0)
        assert hd.kv_head == h // 2
        torch.testing.assert_close(hd.W.float()[m], c.scores[0, h][m], rtol=0, atol=1e-4)


def test_taxonomy_key_energy_follows_the_kv_group(gqa_model):
    """Heads 0 and 1 read kv head 0, heads 2 and 3 kv head 1: their key energy shares pair up that way."""
    from posgen_tl.experiments.taxonomy import head_taxonomy

    toks = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(1))
    df = head_taxonomy(gqa_model, toks[:2], toks[2:], n_seq=2, n_perm=2, region_len=6, n_query=6,
                       seq_len=24, n_ref=1, progress=False)
    share = df[(df.layer == 0) & (df.band == 0)].set_index("head")["k_energy_share"]
    assert share[0] == share[1] and share[2] == share[3] and share[0] != share[2]
