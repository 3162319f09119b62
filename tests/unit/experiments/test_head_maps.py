"""One head up close (posgen_tl.experiments.head_maps) and the figure contract of posgen_tl.plot:
data in, a closed pyplot Figure out, nothing left open for Jupyter to show a second time."""

from __future__ import annotations

import inspect

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl import plot
from posgen_tl.experiments.head_maps import decompose_head, decompose_heads, phase_angles, phase_angles_with_twin
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.maths.decompose import d3_split, fit_additive, score_maps
from posgen_tl.maths.rope import causal_mask

N_POS = 20


def _tokens(n=3, seed=0):
    return torch.randint(3, 50, (n, N_POS), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return tm.hf_llama()[0]


def test_decompose_head_matches_reference_functions(llama):
    toks = _tokens()
    res = decompose_head(llama, toks, layer=1, head=3, seq=1)
    spec, _ = probe_hooks(llama)
    assert res.kv_head == 3 // (spec.n_heads // spec.n_kv_heads) == 1
    cap = capture_qk(llama, toks, [1])[1]
    kbar = cap.k[1, 1:].mean(0)  # sequence 1's own mean key, sink excluded
    ref = d3_split(cap.q[1:2], cap.k[1:2], kbar, cap.positions[1:2], cap.rope)
    torch.testing.assert_close(res.W, ref.W[0, 3])
    torch.testing.assert_close(res.f, ref.f[0, 3])
    torch.testing.assert_close(res.remainder, ref.W[0, 3] - ref.f[0, 3] - ref.g[0, 3])
    m = causal_mask(N_POS, sink=1)
    want = score_maps(ref.W[0, 3], ref.f[0, 3] + ref.g[0, 3], m)
    assert res.score("D3", "r_within") == pytest.approx(float(want["r_within"]))
    d1 = score_maps(ref.W[0, 3], fit_additive(ref.W[0, 3], m).fitted, m)
    assert res.score("D1", "r") == pytest.approx(float(d1["r"]))
    s = res.scores
    assert list(s.columns) == ["model", "layer", "head", "seq", "estimator", "k_mean", "sink", "r", "r2", "r_within"]
    assert len(s) == 3 * 2 and set(s.estimator) == {"D1", "D3"}
    assert res.a.shape == (N_POS,) and res.mask.shape == (N_POS, N_POS)


def test_decompose_head_from_activation_cache_equals_tokens(llama):
    toks = _tokens(2)
    _, cache = llama.run_with_cache(toks)
    a = decompose_head(llama, toks, layer=0, head=1)
    b = decompose_head(llama, cache, layer=0, head=1)
    torch.testing.assert_close(a.W, b.W, rtol=1e-5, atol=1e-5)
    pd.testing.assert_frame_equal(a.scores, b.scores, rtol=1e-4)


def test_every_head_of_a_layer_from_one_forward(llama):
    """decompose_heads: the maps and scores of decompose_head for each head, from ONE forward pass (counted by a
    hook on block 0) instead of one per head."""
    toks, ref = _tokens(2), _tokens(3, seed=5)
    spec, _ = probe_hooks(llama)
    decompose_head(llama, toks, layer=1, head=0, k_mean="global", reference=ref)  # warm-up (the hook probe)

    def forwards(fn):
        calls = []
        with llama.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: calls.append(1))]):
            out = fn()
        return out, len(calls)

    every, n_all = forwards(lambda: decompose_heads(llama, toks, layer=1, k_mean="global", reference=ref, seq=1))
    one, n_one = forwards(lambda: decompose_head(llama, toks, layer=1, head=0, k_mean="global", reference=ref, seq=1))
    assert n_one >= 1 and n_all == n_one  # every head costs what one head costs (the capture and the k̄ pass)
    assert list(every) == list(range(spec.n_heads))
    for h in (0, spec.n_heads - 1):
        one = decompose_head(llama, toks, layer=1, head=h, k_mean="global", reference=ref, seq=1)
        torch.testing.assert_close(every[h].W, one.W)
        torch.testing.assert_close(every[h].f, one.f)
        pd.testing.assert_frame_equal(every[h].scores, one.scores)
    assert list(decompose_heads(llama, toks, layer=0, heads=[2, 0])) == [2, 0]
    with pytest.raises(ValueError, match="distinct heads"):
        decompose_heads(llama, toks, layer=0, heads=[1, 1])
    with pytest.raises(ValueError, match="head"):
        decompose_heads(llama, toks, layer=0, heads=[99])


def test_decompose_head_k_mean_kinds(llama):
    toks, ref = _tokens(2), _tokens(3, seed=5)
    with pytest.raises(ValueError, match="reference"):
        decompose_head(llama, toks, layer=0, head=0, k_mean="global")
    glob = decompose_head(llama, toks, layer=0, head=0, k_mean="global", reference=ref)
    assert glob.k_mean_kind == "global" and set(glob.scores.k_mean) == {"global"}
    from posgen_tl.hooks.edits import key_means

    given = decompose_head(llama, toks, layer=0, head=0, k_mean=key_means(llama, ref, [0])[0])
    torch.testing.assert_close(given.f, glob.f)
    with pytest.raises(ValueError, match="k_mean"):
        decompose_head(llama, toks, layer=0, head=0, k_mean="mean")
    with pytest.raises(ValueError, match="head"):
        decompose_head(llama, toks, layer=0, head=99)


def test_constant_keys_make_d3_exact():
    """A model whose pre-rotation keys are the same for every token: f + g = W exactly."""
    model = tm.hf_llama()[0]
    spec, info = probe_hooks(model)
    hook = (info.name(0, info.k_hook), lambda k, hook: k[:, :1].expand_as(k).clone())
    with model.hooks(fwd_hooks=[hook]):
        k0 = capture_qk(model, _tokens(1), [0])[0].k[0, 0]  # the one key every token carries
        res = decompose_head(model, _tokens(1), layer=0, head=0, sink=0, k_mean=k0)
        per_seq = decompose_head(model, _tokens(1), layer=0, head=0, sink=0)
    assert float(res.remainder.abs().max()) < 1e-9 * float(res.W.abs().max() + 1)
    assert res.score("D3", "r") == pytest.approx(1.0, abs=1e-9)
    assert per_seq.score("D3", "r") == pytest.approx(1.0, abs=1e-5)  # its own mean: equal up to float32 rounding


def test_phase_angles_frame(llama):
    toks = _tokens(2)
    df = phase_angles(llama, toks, layer=0, head=1, band=0)
    assert list(df.columns) == ["model", "twin", "layer", "which", "head", "band", "seq", "pos", "phase"]
    assert len(df) == 2 * (N_POS - 1) and df["phase"].between(-np.pi, np.pi).all()
    cap = capture_qk(llama, toks, [0])[0]
    z = torch.complex(cap.k[0, 1, 1, 0].double(), cap.k[0, 1, 1, 8].double())  # half-split band 0 of d_head 16
    assert df["phase"].iloc[0] == pytest.approx(float(torch.angle(z)))
    both = phase_angles_with_twin(llama, toks, layer=0, head=1, band=0, twin=tm.hf_llama(seed=3)[0])
    assert list(both["twin"].unique()) == ["trained", "random"]


# ----------------------------------------------------------------------------- the figure contract


def _frames(llama):
    from posgen_tl.experiments.decomposition import decompose_with_twin

    toks = _tokens(4)
    dec = decompose_with_twin(llama, toks[:3], reference=toks[3:], batch_size=2, bound_rows=4, progress=False,
                              twin=tm.hf_llama(seed=3)[0])
    return {
        "head_maps": (decompose_head(llama, toks[:1], layer=1, head=0),),
        "r_by_layer": (dec,),
        "phase_histogram": (phase_angles_with_twin(llama, toks[:2], 0, 0, 0, twin=tm.hf_llama(seed=3)[0]),),
    }


def test_every_plot_returns_a_closed_figure(llama):
    from matplotlib.figure import Figure

    plt.close("all")
    for name, args in _frames(llama).items():
        fig = getattr(plot, name)(*args)
        assert isinstance(fig, Figure), name
        assert plt.get_fignums() == [], f"plot.{name} left a figure open: Jupyter would show it twice"
        assert fig.canvas is not None and len(fig.axes) >= 2, name
    # every public plot function draws from data only: no model argument anywhere
    for name in plot.__all__:
        params = inspect.signature(getattr(plot, name)).parameters
        assert "tokens" not in params, name
        assert "model" not in params or "str" in str(params["model"].annotation), name  # a label, never a model


def test_plot_modules_pick_no_backend():
    import subprocess
    import sys

    code = ("import matplotlib; matplotlib.use('module://matplotlib_inline.backend_inline'); "
            "import posgen_tl, posgen_tl.plot, posgen_tl.experiments.head_maps; print(matplotlib.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert "inline" in out.stdout
