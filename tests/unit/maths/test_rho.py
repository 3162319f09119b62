"""ρ in three forms (docs/method.md §3): definitions, mergeability, and unbiasedness of the cross-fitted
ρ on synthetic data with a known offset and per-document random offsets (the plug-in is biased up)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.maths.groups import band_group
from posgen_tl.maths.rho import SequenceBandSums, rho_forms
from posgen_tl.maths.rope import from_bands, to_bands

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/maths/conftest.py


def _cgauss(shape, sd, g):
    """complex Gaussian with E|z|² = sd²."""
    return torch.complex(torch.randn(shape, generator=g, dtype=torch.float64),
                         torch.randn(shape, generator=g, dtype=torch.float64)) * (sd / math.sqrt(2))


def _synthetic(mu, sd_doc, sd_tok, n_docs, seq_per_doc, n_tok, g, layout="half"):
    """x [n_docs·seq_per_doc, n_tok, 1 head, d=2·bands]: z = μ + o_doc + ε."""
    nb = mu.shape[-1]
    o = _cgauss((n_docs, 1, 1, 1, nb), sd_doc, g).expand(n_docs, seq_per_doc, 1, 1, nb)
    z = mu + o + _cgauss((n_docs, seq_per_doc, n_tok, 1, nb), sd_tok, g)
    z = z.reshape(n_docs * seq_per_doc, n_tok, 1, nb)
    docs = torch.arange(n_docs).repeat_interleave(seq_per_doc)
    return from_bands(z, layout), docs


def test_definitions_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, 2, 8, generator=g, dtype=torch.float64) + 0.7
    docs = torch.tensor([0, 0, 1, 2, 2, 3])
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[:, 0] = False
    out = rho_forms(x, docs, 6, "adjacent", mask, n_splits=1, seed=3)
    z = to_bands(x[:, 1:], 6, "adjacent")  # seq tok head band
    within = torch.stack([z[s].mean(0).abs() ** 2 / (z[s].abs() ** 2).mean(0) for s in range(6)]).mean(0)
    torch.testing.assert_close(out["rho_within"], within)
    e = (z.abs() ** 2).mean((0, 1))
    torch.testing.assert_close(out["rho_plugin"], z.mean((0, 1)).abs() ** 2 / e)
    # one split: reproduce the halves from the same seeded permutation
    perm = torch.tensor([0, 1, 2, 3])[torch.randperm(4, generator=torch.Generator().manual_seed(30_011 + 3))]
    a, b = torch.isin(docs, perm[:2]), torch.isin(docs, perm[2:])
    za, zb = z[a].reshape(-1, 2, 3).mean(0), z[b].reshape(-1, 2, 3).mean(0)
    torch.testing.assert_close(out["rho_cross"], (za * zb.conj()).real / e)
    torch.testing.assert_close(out["stability"], out["rho_cross"] / out["rho_within"])
    assert out["rho_within"].shape == (2, 3)


@pytest.mark.parametrize("layout", ["half", "adjacent"])
def test_band_energies_given_by_the_band_statistics_give_the_same_sums(layout):
    """The feature statistics compute ``|z|²`` once (``BandStats.update`` returns it) and hand it to
    ``SequenceBandSums.update``: the state is bit-identical to computing it there; a wrong shape or dtype is refused."""
    from posgen_tl.maths.band_stats import BandStats

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 2, 10, generator=g, dtype=torch.float64)
    x[0, 2, 1, :] = 0.0  # a zero band: no phasor, counted apart
    docs = torch.tensor([4, 4, 9])
    stats = BandStats(2, 10, 8, layout)
    abs2 = stats.update(x)
    z = to_bands(x, 8, layout)
    torch.testing.assert_close(abs2, (z.abs() ** 2).reshape(-1, 2, 4), rtol=1e-15, atol=0)
    assert int(stats.n_nonzero.sum()) == 3 * 7 * 2 * 4 - 4
    mine, theirs = SequenceBandSums(2, 8, layout), SequenceBandSums(2, 8, layout)
    mine.update(x, docs, abs2=abs2.view(3, 7, 2, 4))
    theirs.update(x, docs)
    for key in ("doc", "n", "sum_z", "sum_abs2"):
        assert torch.equal(getattr(mine, key), getattr(theirs, key)), key
    with pytest.raises(ValueError, match="abs2 has shape"):
        mine.update(x, docs, abs2=abs2)  # flattened tokens: not [batch, pos, head, band]
    with pytest.raises(ValueError, match="float64"):
        mine.update(x, docs, abs2=abs2.view(3, 7, 2, 4).float())


def test_merge_equals_one_pass_and_residuals():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 3, 4, generator=g, dtype=torch.float64) + 0.3
    docs = torch.tensor([4, 4, 5, 6, 7])
    whole = SequenceBandSums(3, 4, "half")
    whole.update(x, docs)
    a, b = SequenceBandSums(3, 4, "half"), SequenceBandSums(3, 4, "half")
    a.update(x[:2], docs[:2])
    b.update(x[2:], docs[2:])
    m = SequenceBandSums.from_state_dict(a.merge(b).state_dict())
    for k, v in whole.forms().items():
        torch.testing.assert_close(m.forms()[k], v)
    z = to_bands(x, 4, "half")
    own = (z - z.mean(1, keepdim=True)).abs().square().mean((0, 1))
    torch.testing.assert_close(whole.within_residual_energy(), own)
    c = torch.complex(torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64))
    torch.testing.assert_close(whole.residual_energy(c), (z - c).abs().square().mean((0, 1)))
    with pytest.raises(ValueError):
        whole.update(x, docs[:2])
    one = SequenceBandSums(3, 4, "half")
    one.update(x[:1], docs[:1])
    assert torch.isnan(one.rho_cross()).all()  # one document: no cross-fit possible


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(1, 3), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_cross_offset_is_the_mean_over_splits_of_the_halves_product(n_docs, seq_per_doc, n_splits, seed):
    """``cross_offset`` (its splits folded into one [seq, seq] matrix) equals the definition split by split: the
    token means of the two halves of documents, Re(z̄_A · conj z̄_B), averaged over the seeded halvings — with
    sequences of different lengths, a sequence without tokens, and means far from zero (cancellation)."""
    g = torch.Generator().manual_seed(seed)
    n_seq = n_docs * seq_per_doc
    x = torch.randn(n_seq, 9, 2, 6, generator=g, dtype=torch.float64) * 0.3 + 5.0
    docs = torch.arange(n_docs).repeat_interleave(seq_per_doc)
    mask = torch.rand(n_seq, 9, generator=g) < 0.7
    mask[0] = False  # no tokens: left out of every half's mean
    s = SequenceBandSums(2, 6, "half")
    s.update(x, docs, mask)
    z = to_bands(x, 6, "half")  # seq tok head band
    kept = sorted({int(d) for d, m in zip(docs, mask) if m.any()})
    if len(kept) < 2:
        assert torch.isnan(s.cross_offset(n_splits, seed)).all()
        return
    gen, want = torch.Generator().manual_seed(30_011 + seed), []
    for _ in range(n_splits):
        perm = torch.tensor(kept)[torch.randperm(len(kept), generator=gen)]
        halves = [torch.isin(docs, perm[: len(kept) // 2]), torch.isin(docs, perm[len(kept) // 2 :])]
        za, zb = ((z * (m[:, None] & mask)[..., None, None]).sum((0, 1)) / (m[:, None] & mask).sum()
                  for m in halves)
        want.append((za * zb.conj()).real)
    want = torch.stack(want).mean(0)
    torch.testing.assert_close(s.cross_offset(n_splits, seed), want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


@settings(max_examples=8, deadline=None, derandomize=True)  # a 4-SE check on 16 means: fixed draws, no flakes
@given(
    mu_abs=st.floats(0.3, 1.0),
    sd_doc=st.floats(1.0, 2.0),
    sd_tok=st.floats(0.2, 1.0),
    n_docs=st.integers(4, 8),
    seq_per_doc=st.integers(1, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_rho_cross_unbiased_plugin_biased(mu_abs, sd_doc, sd_tok, n_docs, seq_per_doc, seed):
    """Mean over many draws: ρ_cross's numerator is unbiased for |E z|² and ρ_cross ≈ the true
    |E z|²/E|z|²; the plug-in is biased upward by the between-document variance."""
    g = torch.Generator().manual_seed(seed)
    nb, draws, n_tok = 2, 400, 16
    mu = torch.polar(torch.full((nb,), mu_abs, dtype=torch.float64), torch.tensor([0.3, 2.0], dtype=torch.float64))
    energy = mu_abs**2 + sd_doc**2 + sd_tok**2
    truth = mu_abs**2 / energy
    cross, num, plug, within = [], [], [], []
    for _ in range(draws):
        x, docs = _synthetic(mu, sd_doc, sd_tok, n_docs, seq_per_doc, n_tok, g)
        s = SequenceBandSums(1, 2 * nb, "half")
        s.update(x, docs)
        cross.append(s.rho_cross(n_splits=4)[0])
        num.append(s.cross_offset(n_splits=4)[0])
        plug.append(s.rho_plugin()[0])
        within.append(s.rho_within()[0])
    cross, num, plug = torch.stack(cross), torch.stack(num), torch.stack(plug)
    se = lambda t: t.std(0) / math.sqrt(draws)  # noqa: E731
    assert ((num.mean(0) - mu_abs**2).abs() < 4 * se(num) + 1e-3).all(), (num.mean(0), mu_abs**2)
    assert ((cross.mean(0) - truth).abs() < 4 * se(cross) + 0.01).all(), (cross.mean(0), truth)
    # plug-in bias ≈ sd_doc²/(n_docs·E|z|²): clearly above the truth
    assert (plug.mean(0) - truth > 4 * se(plug)).all(), (plug.mean(0), truth)
    assert (torch.stack(within).mean(0) > cross.mean(0)).all()  # per-text constants inflate ρ_within


def test_stability_separates_shared_from_per_text_offsets():
    """Same within-text ρ; one offset shared by all texts (stability ≈ 1) vs per-text random (≈ 0)."""
    g = torch.Generator().manual_seed(5)
    mu = torch.tensor([1.0 + 0.5j, -0.8j], dtype=torch.complex128)
    x_shared, docs = _synthetic(mu, 0.0, 0.5, 24, 1, 64, g)
    x_text, _ = _synthetic(torch.zeros(2, dtype=torch.complex128), 1.15, 0.5, 24, 1, 64, g)
    a, b = rho_forms(x_shared, docs, 4, "half"), rho_forms(x_text, docs, 4, "half")
    assert (a["stability"] > 0.9).all() and (b["stability"].abs() < 0.3).all()
    assert (a["rho_within"] - b["rho_within"]).abs().max() < 0.15


def test_band_group():
    assert [band_group(b, 6) for b in range(6)] == ["fast", "fast", "middle", "middle", "slow", "slow"]
