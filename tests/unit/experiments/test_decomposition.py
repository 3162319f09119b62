"""docs/method.md §2 runner: every number against the reference functions of posgen_tl.maths.decompose,
the D3 bound, a constant-key model (D3 exact), the random twin, determinism, figures."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import tiny_models as tm  # noqa: E402
import torch  # noqa: E402
from score_frames import assert_same_scores  # noqa: E402

from posgen_tl.experiments.decomposition import (  # noqa: E402
    decompose_model,
    decompose_with_twin,
    reference_key_means,
    summarize_decomposition,
)
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.stream import capture_qk
from posgen_tl.io.sampling import Windows, sample_windows  # noqa: E402
from posgen_tl.maths.decompose import causal_mask, d3_bound, d3_split, fit_additive, score_maps, sequence_key_mean  # noqa: E402
from posgen_tl.maths.groups import layer_group  # noqa: E402

COLUMNS = ["model", "twin", "k_mean", "layer", "layer_group", "kind", "head", "doc", "seq", "estimator",
           "sink_excluded", "r", "r2", "r_within", "d3_err_mean", "d3_bound_mean", "d3_bound_holds"]
N_POS, N_SEQ, N_REF = 24, 3, 2


def _tokens(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    return torch.randint(1, vocab, (N_SEQ + N_REF, N_POS), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["native", "hf_llama", "hf_gemma3"])
def tiny(request):
    if request.param == "native":
        return tm.native(n_ctx=64)
    return getattr(tm, request.param)()[0]


def _run(model, **kw):
    """The analysed rows of _tokens() with the last N_REF rows as the (explicit) reference."""
    kw = {"sink": 1, "batch_size": 2, "bound_rows": 8, "progress": False, **kw}
    toks = _tokens()
    return decompose_model(model, toks[:N_SEQ], reference=toks[N_SEQ:], **kw)


def test_columns_shape_and_layer_groups(tiny):
    spec, _ = probe_hooks(tiny)
    df = _run(tiny)
    assert list(df.columns) == COLUMNS
    assert len(df) == spec.n_layers * spec.n_heads * N_SEQ * 4 * 2  # D1, D2, D3 × 2 k̄ kinds
    assert set(df.estimator) == {"D1", "D2", "D3"} and set(df.sink_excluded) == {False, True}
    assert set(df[df.estimator == "D3"].k_mean) == {"global", "per_sequence"}
    assert set(df[df.estimator != "D3"].k_mean) == {"none"}
    assert (df.doc == df.seq).all()  # token-tensor rows: each row its own document
    assert set(df.seq) == set(range(N_SEQ)) and set(df.twin) == {"trained"}
    assert df[df.estimator != "D3"][["d3_err_mean", "d3_bound_mean", "d3_bound_holds"]].isna().all().all()
    assert df[df.estimator == "D3"]["d3_bound_mean"].notna().all()
    assert all(g == layer_group(l, spec.n_layers) for l, g in zip(df.layer, df.layer_group))  # noqa: E741
    assert set(_run(tiny, sink=0).sink_excluded) == {False}


@pytest.mark.parametrize("factored", [False, True], ids=["maps", "factored"])
def test_scores_match_reference_functions(tiny, factored, monkeypatch):
    """r, R², within-row r of D1/D2/D3 equal score_maps(W, fit_additive(W).fitted / d3_split f+g),
    D3 with the global k̄ (reference rows) and with each sequence's own sink-excluded mean key — from the maps (this
    CPU's path) and from their factors (a GPU's, :func:`posgen_tl.engine.decompose_maps.factored_moments`, forced)."""
    import posgen_tl.engine.decompose_maps as dmaps
    import posgen_tl.engine.decompose_scores as D

    calls: list = []
    real = dmaps.factored_moments
    monkeypatch.setattr(D, "factored_moments", lambda *a, **k: calls.append(1) or real(*a, **k))
    df = _run(tiny, factored=factored)
    assert bool(calls) == factored  # the path asked for was taken
    toks = _tokens()
    kms = reference_key_means(tiny, toks[-N_REF:], sink=1, progress=False)
    for layer, c in capture_qk(tiny, toks[:N_SEQ]).items():
        W = c.logits()
        d3 = d3_split(c.q, c.k, kms[layer].float(), c.positions, c.rope)
        own = c.k[:, 1:].double().mean(1)  # [batch, kv, d]: each sequence's own mean key
        d3s = d3_split(c.q, c.k, own, c.positions, c.rope)
        for sink in (0, 1):
            m = causal_mask(N_POS, sink=sink, sliding_window=c.rope.sliding_window)
            approx = {("D1", "none"): fit_additive(W, m, True).fitted, ("D2", "none"): fit_additive(W, m, False).fitted,
                      ("D3", "global"): d3.f + d3.g, ("D3", "per_sequence"): d3s.f + d3s.g}
            for (est, km), y in approx.items():
                want = score_maps(W, y, m)
                sub = df[(df.layer == layer) & (df.estimator == est) & (df.sink_excluded == bool(sink)) & (df.k_mean == km)]
                sub = sub.sort_values(["seq", "head"])
                for key, v in want.items():
                    np.testing.assert_allclose(sub[key].to_numpy(), v.numpy().reshape(-1), atol=2e-5,
                                               err_msg=f"{est}/{km} sink={sink} layer={layer} {key}")
        # the two k̄ kinds really differ (the test can tell them apart)
        assert not torch.allclose(d3.f, d3s.f)


def test_d3_bound_holds_and_matches_library(tiny):
    df = _run(tiny)
    d3 = df[df.estimator == "D3"]
    assert (d3.d3_bound_holds == 1.0).all()
    assert (d3.d3_err_mean <= d3.d3_bound_mean + 1e-12).all()
    assert (d3.d3_err_mean > 0).any()  # not trivially exact
    toks = _tokens()
    kms = reference_key_means(tiny, toks[-N_REF:], sink=1, progress=False)
    rows = torch.linspace(0, N_POS - 1, 8).round().long()
    for layer, c in capture_qk(tiny, toks[:N_SEQ]).items():
        for km, kbar in (("global", kms[layer]), ("per_sequence", sequence_key_mean(c.k, 1))):
            s = d3_split(c.q, c.k, kbar, c.positions, c.rope)
            err = (s.W - s.f - s.g)[:, :, rows].abs()
            bound = d3_bound(c.q, c.k, kbar, c.positions, c.rope, rows=rows)
            m = causal_mask(N_POS, sink=1, sliding_window=c.rope.sliding_window)[rows].double()
            sub = d3[(d3.layer == layer) & d3.sink_excluded & (d3.k_mean == km)].sort_values(["seq", "head"])
            # the check runs in float32 on the model's float32 q/k: within 1e-5 of the float64 reference (measured
            # ≤ 4e-7 on these models; float32 is enough here)
            np.testing.assert_allclose(sub.d3_err_mean, ((err * m).sum((-1, -2)) / m.sum()).reshape(-1), rtol=1e-5)
            np.testing.assert_allclose(sub.d3_bound_mean, ((bound * m).sum((-1, -2)) / m.sum()).reshape(-1), rtol=1e-5)


def _check_inputs(model, dtype=torch.float32):
    """A capture of _tokens()' first rows in ``dtype`` with the inputs of bound_checks: (c, k̄ per kind, rows,
    geometries)."""
    from posgen_tl.maths.moments import geometry

    toks = _tokens()
    c = capture_qk(model, toks[:N_SEQ])[0]
    c = c.__class__(**{**c.__dict__, "q": c.q.to(dtype), "k": c.k.to(dtype)}) if dtype != c.q.dtype else c
    rows = torch.linspace(0, N_POS - 1, 8).round().long()
    geoms = {s: geometry(N_POS, s, c.rope.sliding_window) for s in (0, 1)}
    return c, {"per_sequence": sequence_key_mean(c.k, 1)}, rows, geoms


def test_d3_bound_check_flags_entries_outside_the_bound(monkeypatch):
    """The check can fail: with the bound replaced by 0 only the entries whose |W − f − g| is within the rounding
    allowance hold — every j = i entry (exactly 0 there: the allowance covers float32 rounding) and few others."""
    import posgen_tl.engine.decompose_bound as db

    c, kbars, rows, geoms = _check_inputs(tm.native(n_ctx=64))
    honest = db.bound_checks(c, kbars, rows, geoms)[0]["per_sequence"]
    assert (honest[2] == 1.0).all()
    monkeypatch.setattr(db, "band_bound_rows", lambda qn, kn, phi, rows, *a, **kw: torch.zeros(
        qn.shape[0] * qn.shape[2], len(rows), kn.shape[1], dtype=kn.dtype))
    zero = db.bound_checks(c, kbars, rows, geoms)[0]["per_sequence"]
    diag = torch.stack([(g.mask_rows(rows) & (torch.arange(N_POS)[None, :] == rows[:, None])).sum() / g.mask_rows(rows).sum()
                        for g in geoms.values()]).double()
    held = zero[2]  # [maps, sinks]
    assert (held >= diag - 1e-12).all() and (held < diag + 0.05).all()
    assert (held < 1.0).all()
    torch.testing.assert_close(zero[0], honest[0])  # the error itself does not depend on the bound


def test_d3_bound_check_keeps_float64_captures_in_float64():
    """A float64 capture is checked in float64 (allowance 1e-10): its means equal the float64 reference to 1e-10,
    and W comes back in float64."""
    import posgen_tl.engine.decompose_bound as db
    from posgen_tl.maths.decompose import d3_bound, d3_split

    c, kbars, rows, geoms = _check_inputs(tm.native(n_ctx=64), torch.float64)
    checks, mu, w = db.bound_checks(c, kbars, rows, geoms)
    assert w.dtype == torch.float64 and db.bound_rtol(torch.float64, 16) == 1e-10
    s = d3_split(c.q, c.k, kbars["per_sequence"], c.positions, c.rope)
    err = (s.W - s.f - s.g)[:, :, rows].abs()
    bound = d3_bound(c.q, c.k, kbars["per_sequence"], c.positions, c.rope, rows=rows)
    for i, g in enumerate(geoms.values()):
        m = g.mask_rows(rows).double()
        for got, want in ((checks["per_sequence"][0, :, i], err), (checks["per_sequence"][1, :, i], bound)):
            torch.testing.assert_close(got, ((want * m).sum((-1, -2)) / m.sum()).reshape(-1), rtol=1e-10, atol=0)


@pytest.mark.parametrize("which", ["native", "hf_gemma3"])
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_d3_bound_check_means_match_float64_on_every_mask(which, precision, monkeypatch):
    """The check's masked means of a float32 capture: on the CPU at full float32 precision each row's masked sums in
    float32 (one product per row, the masks its columns) and the rows in float64; where reduced-precision products
    are allowed one float64 product. Either way within float32 rounding of the float64 reference, on each mask — the
    sink-kept and the sink-excluded, a sliding window's (Gemma3's layer 0) included — and the fraction within the
    bound exact (a count over a count)."""
    import posgen_tl.engine.decompose_bound as db

    model = tm.native(n_ctx=64) if which == "native" else tm.hf_gemma3()[0]
    c, kbars, rows, geoms = _check_inputs(model)
    paths: list[bool] = []
    real = db.full_precision_products
    monkeypatch.setattr(db, "full_precision_products", lambda dt: paths.append(real(dt)) or paths[-1])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        checks, mu, w = db.bound_checks(c, kbars, rows, geoms)
    finally:
        torch.set_float32_matmul_precision(before)
    assert paths == [precision == "highest"]
    kbar = kbars["per_sequence"].double()
    s = d3_split(c.q.double(), c.k.double(), kbar, c.positions, c.rope)
    err = (s.W - s.f - s.g)[:, :, rows].abs().reshape(-1, len(rows), N_POS)
    bound = d3_bound(c.q.double(), c.k.double(), kbar, c.positions, c.rope, rows=rows).reshape(-1, len(rows), N_POS)
    w64 = s.W[:, :, rows].reshape(-1, len(rows), N_POS)
    assert c.rope.sliding_window == (None if which == "native" else 4)
    for i, g in enumerate(geoms.values()):
        m = g.mask_rows(rows).double()

        def mean(x: torch.Tensor, m: torch.Tensor = m) -> torch.Tensor:
            return (x * m).sum((-1, -2)) / m.sum()

        torch.testing.assert_close(checks["per_sequence"][0, :, i], mean(err), rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(checks["per_sequence"][1, :, i], mean(bound), rtol=2e-5, atol=1e-7)
        torch.testing.assert_close(mu[:, i], mean(w64), rtol=1e-5, atol=1e-6)
        held = checks["per_sequence"][2, :, i] * m.sum()
        torch.testing.assert_close(held, held.round(), rtol=0, atol=1e-9)  # a whole number of entries


@pytest.mark.parametrize("which", ["native", "hf_llama"])
def test_constant_keys_make_d3_exact(which):
    model = tm.native(n_ctx=64) if which == "native" else tm.hf_llama()[0]
    spec, info = probe_hooks(model)
    const = torch.randn(spec.n_kv_heads, spec.d_head, generator=torch.Generator().manual_seed(3))

    def set_k(t, hook):
        return const.to(t.dtype).expand_as(t).clone()

    hooks = [(info.name(layer, info.k_hook), set_k) for layer in range(spec.n_layers)]
    df = _run(model, extra_hooks=hooks)
    d3 = df[df.estimator == "D3"]
    np.testing.assert_allclose(d3.r, 1.0, atol=1e-5)
    np.testing.assert_allclose(d3.r_within, 1.0, atol=1e-5)
    assert (d3.d3_err_mean < 1e-10).all() and (d3.d3_bound_mean < 1e-10).all()
    # the clean model is not exact: the test can fail
    clean = _run(model)
    assert (clean[clean.estimator == "D3"].r < 1 - 1e-4).any()


def test_twin_same_tokens_and_different_scores():
    model = tm.native(n_ctx=64)
    toks = _tokens()
    df = decompose_with_twin(model, toks[:N_SEQ], reference=toks[N_SEQ:], seed=1, batch_size=2, bound_rows=8,
                             progress=False)
    assert set(df.twin) == {"trained", "random"}
    key = ["layer", "head", "seq", "estimator", "k_mean", "sink_excluded"]
    tr = df[df.twin == "trained"].set_index(key).sort_index()
    rd = df[df.twin == "random"].set_index(key).sort_index()
    assert tr.index.equals(rd.index)
    assert df.model.nunique() == 1
    assert not np.allclose(tr.r.to_numpy(), rd.r.to_numpy())
    assert (df[df.estimator == "D3"].d3_bound_holds == 1.0).all()


def test_deterministic():
    model = tm.hf_llama()[0]
    pd.testing.assert_frame_equal(_run(model), _run(model))


def test_a_token_tensor_is_analysed_as_given():
    """Every row of a user's tensor is analysed (each its own document); a per-sequence k̄ needs no
    reference, a global one asks for it by name — the tensor is never split behind the user's back."""
    model = tm.hf_llama()[0]
    toks = _tokens()[:4]
    df = decompose_model(model, toks, k_mean="per_sequence", layers=[0], bound_rows=4, progress=False)
    assert sorted(df.seq.unique()) == [0, 1, 2, 3] and (df.doc == df.seq).all()
    with pytest.raises(ValueError, match="reference="):
        decompose_model(model, toks, k_mean="global", layers=[0], progress=False)


def test_summary_groups():
    df = _run(tm.native(n_ctx=64, n_layers=3))
    s = summarize_decomposition(df)
    assert {"r_mean", "r_std", "r_within_mean", "r2_mean", "n", "d3_bound_holds_min"} <= set(s.columns)
    assert list(s.layer_group.unique()) == ["early", "middle", "late"]
    assert s.n.sum() == len(df)
    one = s[(s.estimator == "D1") & ~s.sink_excluded & (s.layer_group == "early")]
    assert set(s.k_mean) == {"none", "global", "per_sequence"}
    want = df[(df.estimator == "D1") & ~df.sink_excluded & (df.layer == 0)].r
    assert one.r_mean.item() == pytest.approx(want.mean()) and one.r_std.item() == pytest.approx(want.std())


def test_figures():
    from posgen_tl.plot.decomposition import plot_head_maps, plot_r_by_layer

    model = tm.hf_llama()[0]
    toks = _tokens()
    df = decompose_with_twin(model, toks[:N_SEQ], reference=toks[N_SEQ:], batch_size=2, bound_rows=8, progress=False)
    fig = plot_r_by_layer(df)
    axes = fig.get_axes()
    assert len(axes) == 2
    assert len(axes[0].get_lines()) == 8  # (D1, D2, D3 global, D3 per_sequence) × 2 twins
    assert {ln.get_linestyle() for ln in axes[0].get_lines()} == {"-", "--"}
    from posgen_tl.experiments.head_maps import decompose_head

    fig = plot_head_maps(decompose_head(model, _tokens()[:1], layer=1, head=2))
    assert len([a for a in fig.get_axes() if a.get_images()]) == 4
    img = fig.get_axes()[0].get_images()[0].get_array()
    assert np.isnan(np.asarray(img.filled(np.nan) if hasattr(img, "filled") else img)[0, 1])  # j > i blank


@pytest.mark.real
def test_real_smollm2(smollm2):
    from posgen_tl.io.corpus import corpus_tokens

    toks = corpus_tokens(smollm2, None, seq_len=64, n_seq=3)
    df = decompose_with_twin(smollm2, toks[:2], reference=toks[2:], layers=[0, 7, 14], batch_size=2, bound_rows=16,
                             progress=False)
    assert set(df.twin) == {"trained", "random"} and set(df.layer) == {0, 7, 14}
    assert len(df) == 2 * 3 * 9 * 2 * 4 * 2
    d3 = df[df.estimator == "D3"]
    assert d3.r.between(-1, 1).all() and d3.r_within.between(-1, 1).all()
    assert (d3.d3_bound_holds == 1.0).all()
    tr, rd = (d3[d3.twin == t].r.mean() for t in ("trained", "random"))
    assert tr != rd


def _docs(n_docs: int = 12, words: int = 80, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(t)}" for t in torch.randint(3, 100, (words,), generator=g)) for _ in range(n_docs)]


def test_global_k_mean_reference_documents_are_disjoint():
    """Text corpus: the reference windows (global k̄) come from documents no analysed window uses;
    overlapping windows are refused; the global k̄ equals the mean over the reference windows."""
    model = tm.hf_llama()[0]
    docs = _docs()
    df = decompose_model(model, docs, n_seq=6, seq_len=16, n_ref=3, layers=[0], batch_size=3, bound_rows=4,
                         progress=False)
    ana, ref = set(df.attrs["analysed_docs"]), set(df.attrs["reference_docs"])
    assert ana and ref and not (ana & ref)
    assert df.doc.nunique() == 6  # one window per document first (round-robin)
    windows, refw = sample_windows(model, docs, n_seq=6, seq_len=16, n_ref=3)
    assert isinstance(windows, Windows) and set(windows.doc_ids.tolist()).isdisjoint(refw.doc_ids.tolist())
    assert {windows.doc_names[i] for i in df.doc.unique()} == ana
    # the global k̄ really is the reference windows' mean key (sink excluded): recompute D3 with it
    kms = reference_key_means(model, refw.tokens, [0], sink=1, progress=False)
    c = capture_qk(model, windows.tokens, layers=[0])[0]
    s = d3_split(c.q, c.k, kms[0], c.positions, c.rope)
    m = causal_mask(16, sink=1)
    want = score_maps(c.logits(), s.f + s.g, m)["r"].numpy().reshape(-1)
    sub = df[(df.estimator == "D3") & (df.k_mean == "global") & df.sink_excluded].sort_values(["seq", "head"])
    np.testing.assert_allclose(sub.r, want, atol=2e-5)
    # a reference set that shares a document with the analysed windows is refused
    with pytest.raises(ValueError, match="share documents"):
        decompose_model(model, windows, reference=windows.subset([0]), n_seq=6, layers=[0], progress=False)
    with pytest.raises(ValueError, match="reference"):
        decompose_model(model, windows, k_mean="global", n_seq=6, layers=[0], progress=False)
    # per-sequence only needs no reference
    only = decompose_model(model, windows, k_mean="per_sequence", n_seq=6, layers=[0], bound_rows=4, progress=False)
    assert set(only[only.estimator == "D3"].k_mean) == {"per_sequence"}
    with pytest.raises(ValueError, match="k_mean"):
        decompose_model(model, windows, k_mean="sequence", layers=[0], progress=False)


@pytest.mark.parametrize("block", [5, 8, 23])
def test_row_blocks_give_the_whole_maps_scores(tiny, block):
    """Query-row streaming (docs/performance.md: long texts in bounded memory) computes every score of the
    whole-map path — D1/D2 fits, D3 per k̄ kind, with and without the sink, the bound check — to float32
    summation order; blocks that do not divide n, and a one-row last block, included. Gemma3's sliding window
    (4 keys) crosses block edges."""
    whole = _run(tiny)
    streamed = _run(tiny, row_block=block)
    assert_same_scores(whole, streamed, rtol=1e-6)


@pytest.mark.parametrize("stack", [2, 64])
def test_layers_stacked_on_the_head_axis_give_each_layers_scores(tiny, stack, monkeypatch):
    """On a GPU the scoring stacks layers on the head axis (one set of kernels for many layers): forced here on the
    CPU, every score equals the one-layer-at-a-time run's (W recomputed instead of read from the score hook: float32
    rounding), with each row's layer and head where they belong — stacks of 2 (a partial last stack) and of every
    layer; Gemma3's local and global layers (other windows and frequencies) never share a stack."""
    from posgen_tl.engine import decompose_scores as D
    from posgen_tl.hooks import stacking as S

    one = _run(tiny)
    seen: list[tuple[int, ...]] = []
    real = S.stack_captures

    def spy(cs):
        seen.append(tuple(c.layer for c in cs))
        return real(cs)

    monkeypatch.setattr(D, "stack_size", lambda *a: stack)
    monkeypatch.setattr(S, "stack_captures", spy)
    stacked = _run(tiny)
    assert_same_scores(one, stacked, rtol=1e-5)  # stacks in row blocks (this CPU's path)
    monkeypatch.setattr(D, "rows_per_block", lambda *a: 0)
    assert_same_scores(one, _run(tiny), rtol=1e-5)  # stacks of whole maps (a GPU's path)
    spec, _ = probe_hooks(tiny)
    assert seen and all(1 < len(g) <= stack for g in seen)
    for g in seen:  # one rope and window per stack
        assert len({(spec.layer(i).sliding_window, spec.layer(i).kind) for i in g}) == 1


def test_stack_size_is_one_on_the_cpu_and_bounded_on_a_gpu(monkeypatch):
    from posgen_tl.hooks import stacking as S

    model = tm.hf_llama(n_layers=3)[0]
    assert S.stack_size(model, 4 * 512 * 512, 30) == 1
    monkeypatch.setattr(S, "model_device", lambda m: torch.device("meta"))  # not the CPU, not CUDA: the budget alone
    heads = probe_hooks(model)[0].n_heads
    assert S.stack_size(model, 4 * 512 * 512, 30) == min(30, S.STACK_ENTRIES // (4 * heads * 512 * 512))
    assert S.stack_size(model, 2**30, 30) == 1  # a map beyond the budget: still one layer, never zero


@pytest.mark.parametrize("factored", [False, True])
def test_a_stack_is_budgeted_by_its_largest_buffer(factored, monkeypatch):
    """The decomposition asks :func:`stack_size` for as many layers as keep ONE buffer per head within the budget: a
    logit map (``batch·n²``), or from the factors their largest tensor (``batch·n·largest_entries``) — not their peak
    (``row_entries``, about three times as much), with which the stacks were a third as tall as that budget allows."""
    from posgen_tl.engine import decompose_scores as D
    from posgen_tl.maths.factored import largest_entries, row_entries

    asked: list[int] = []
    real = D.stack_size
    monkeypatch.setattr(D, "stack_size", lambda model, per_head, n_layers: asked.append(per_head) or real(
        model, per_head, n_layers))
    model = tm.hf_llama(n_layers=2)[0]
    spec = probe_hooks(model)[0]
    _run(model, factored=factored, k_mean="per_sequence")
    widths = (N_POS, spec.d_head + 1, 2 * spec.d_head + 1, 1, spec.group_size)
    want = 2 * N_POS * (largest_entries(*widths) if factored else N_POS)  # _run's batch of 2
    assert asked and set(asked) == {want}
    if factored:
        assert 2 * largest_entries(*widths) <= row_entries(*widths)


def test_the_fits_wait_for_a_gpus_memory_and_for_the_cpus_batch(monkeypatch):
    """:func:`fit_batch`: on the CPU ``FIT_BATCH`` entries of fits wait to be solved together; on a GPU as many as keep
    the solve within 1/32 of the free memory (``FIT_BYTES`` per entry) — on an H200 the 2.2 million entries of
    SmolLM2 at 4 × 2 048 tokens in one solve —, never fewer than on the CPU, and the CPU's where free memory is not
    known."""
    from posgen_tl.engine import decompose_scores as D

    assert D.fit_batch(torch.device("cpu")) == D.FIT_BATCH
    monkeypatch.setattr(D, "free_bytes", lambda dev: 140 * 10**9)
    big = D.fit_batch(torch.device("cuda"))
    assert big == 140 * 10**9 // (32 * D.FIT_BYTES) and big > 30 * 9 * 4 * 2048
    monkeypatch.setattr(D, "free_bytes", lambda dev: 10**6)
    assert D.fit_batch(torch.device("cuda")) == D.FIT_BATCH
    assert D.fit_batch(torch.device("meta")) == D.FIT_BATCH
    # and the run waits for what fit_batch says of the sums' device (not for FIT_BATCH itself)
    calls: list[int] = []
    asked: list[str] = []
    real = D.join_sums
    monkeypatch.setattr(D, "join_sums", lambda parts: calls.append(len(parts)) or real(parts))
    monkeypatch.setattr(D, "FIT_BATCH", 1)  # were it read directly: a solve per capture
    monkeypatch.setattr(D, "fit_batch", lambda device: asked.append(device.type) or 10**9)
    model = tm.hf_llama(n_layers=2)[0]
    _run(model)
    batches = -(-N_SEQ // 2)  # _run's batch_size
    assert calls == [probe_hooks(model)[0].n_layers * batches] and set(asked) == {"cpu"}


@pytest.mark.parametrize("n", [128, 512])
@pytest.mark.parametrize("direct", [True, False])
def test_fit_bytes_bounds_what_solving_the_waiting_fits_holds(direct, n, monkeypatch):
    """``FIT_BYTES`` — what :func:`fit_batch` budgets a GPU's waiting fits by — is at least the bytes per entry (maps ×
    positions) that solving the waiting fits holds at its peak as a run's flush does (the parts joined into one copy,
    then solved and scored; the profiler's allocations and frees, in order), with the direct operators and by
    conjugate gradients, and not far above it."""
    from profiled import peak_bytes

    import posgen_tl.maths.moments as mo
    from posgen_tl.engine import decompose_scores as D

    maps = 6144 // n  # per part; four parts wait
    monkeypatch.setattr(mo, "_GEOMS", {})  # fresh geometries: no operator kept from another test
    monkeypatch.setattr(mo, "DIRECT_MAX", n if direct else 0)
    gen = torch.Generator().manual_seed(0)
    i = torch.arange(n, dtype=torch.float64)
    geoms = {s: mo.geometry(n, s, None) for s in (0, 1)}
    parts = []
    for _ in range(4):
        w = 0.3 * i[:, None] - 0.2 * i[None, :] + torch.randn(maps, n, n, generator=gen, dtype=torch.float64)
        parts.append(mo.sums_of(mo.Target(w, geoms[0], torch.full((maps,), 0.25, dtype=torch.float64), {}),
                                mo.fit_columns(geoms)))
        del w
    mo.all_fit_moments(parts[0], geoms)  # the direct operators built (once per mask, kept: not the waiting fits')
    peak, _ = peak_bytes(lambda: mo.all_fit_moments(mo.join_sums(parts), geoms))
    entries = 4 * maps * n
    assert (0.5 if direct else 0.8) * D.FIT_BYTES * entries <= peak <= D.FIT_BYTES * entries, peak / entries


def test_the_maps_are_scored_in_row_blocks_where_they_should(monkeypatch):
    """On the CPU every run takes the row-block path in cache-sized blocks (:func:`rows_per_block`), an explicit
    ``row_block`` as given; on a GPU whole maps up to STREAM_ABOVE tokens and STREAM_BLOCK rows beyond; cache-sized
    blocks keep a block's maps within hooks.stacking.CPU_BLOCK_BYTES (unless that is under MIN_BLOCK rows), evened out."""
    from posgen_tl.engine import decompose_maps as dmaps
    from posgen_tl.engine import decompose_scores as dm

    calls = []
    real = dmaps.streamed_moments
    monkeypatch.setattr(dmaps, "streamed_moments", lambda *a, **k: calls.append(k["block"]) or real(*a, **k))
    model = tm.hf_llama(n_layers=1)[0]
    _run(model)
    assert calls and set(calls) == {N_POS}  # 24 tokens: one block
    calls.clear()
    _run(model, row_block=7)
    assert calls and set(calls) == {7}
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert dm.rows_per_block(gpu, 36, 512) == 0 and dm.rows_per_block(gpu, 36, 2048) == 0
    assert dm.rows_per_block(gpu, 9, 4096) == dm.STREAM_BLOCK and dm.rows_per_block(gpu, 36, 512, 100) == 100
    from posgen_tl.hooks.stacking import CPU_BLOCK_BYTES, MIN_BLOCK

    for maps, n in ((36, 512), (9, 2048), (9, 16384), (4, 100), (300, 4096)):
        b = dm.rows_per_block(cpu, maps, n)
        want = max(MIN_BLOCK, CPU_BLOCK_BYTES // (4 * maps * n))
        assert 0 < b <= n and -(-n // b) == -(-n // want)  # as many blocks as the budget asks, evened out
        assert b == n or 4 * maps * b * n <= CPU_BLOCK_BYTES or b <= MIN_BLOCK
    assert dm.rows_per_block(cpu, 36, 512) == 74  # SmolLM2 at 4 × 512: 7 blocks


def test_the_moments_come_from_the_factors_on_a_gpu_from_factored_from_tokens():
    from posgen_tl.engine import decompose_scores as dm

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert not dm.use_factored(cpu, 16384) and not dm.use_factored(cpu, 512)
    assert dm.use_factored(gpu, dm.FACTORED_FROM) and dm.use_factored(gpu, 16384)
    assert not dm.use_factored(gpu, dm.FACTORED_FROM - 1) and dm.FACTORED_FROM == 1024


def test_whole_maps_and_row_blocks_give_the_same_scores(tiny, monkeypatch):
    """The whole-map path (a GPU's, below STREAM_ABOVE tokens) forced on the CPU scores as the row-block path does."""
    from posgen_tl.engine import decompose_scores as dm

    blocks = _run(tiny, row_block=5)
    monkeypatch.setattr(dm, "rows_per_block", lambda *a: 0)
    whole = _run(tiny)
    assert_same_scores(blocks, whole, rtol=1e-5)


def _spied(monkeypatch, use: bool) -> list:
    """Force (or forbid) W from the score hook and record what each layer's check returned."""
    import posgen_tl.engine.decompose_scores as D

    took: list = []
    real = D._hook_w
    monkeypatch.setattr(D, "scores_are_w", lambda model: use)
    monkeypatch.setattr(D, "_hook_w", lambda *a: took.append(real(*a)) or took[-1])
    return took


def test_w_from_the_score_hook_equals_the_recomputed_w(tiny, monkeypatch):
    """Where hook_attn_scores holds the logits (float32, pre-softmax, no soft-cap), every layer takes W from the
    forward instead of recomputing it, and every score equals the recomputed path's to float32 rounding; where it
    holds the pattern (the native bridge), forcing the hook path still recomputes W (each layer's check fails)."""
    import posgen_tl.engine.decompose_scores as D

    logits = probe_hooks(tiny)[1].scores_kind == "pre_softmax"
    assert D.scores_are_w(tiny) == logits  # the default path takes the hook exactly where it holds the logits
    took = _spied(monkeypatch, True)
    hook = _run(tiny)
    assert took and all((t is not None) == logits for t in took)  # from the hook on every layer and batch, or never
    took = _spied(monkeypatch, False)
    again = _run(tiny)
    assert not took
    cols = ["r", "r2", "r_within", "d3_err_mean", "d3_bound_mean", "d3_bound_holds"]
    np.testing.assert_allclose(hook[cols].to_numpy(), again[cols].to_numpy(), rtol=2e-5, atol=2e-6)
    assert hook.drop(columns=cols).equals(again.drop(columns=cols))


def test_scores_that_are_not_the_logits_are_recomputed(monkeypatch):
    """A hook that shifts hook_attn_scores (so the scores are no longer W) fails each layer's comparison on the
    bound rows: W is recomputed, and the numbers are those of the recomputed path."""
    model = tm.hf_llama()[0]
    spec, _ = probe_hooks(model)

    def shift(t, hook):
        return t + 0.5

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", shift) for layer in range(spec.n_layers)]
    took = _spied(monkeypatch, True)
    shifted = _run(model, extra_hooks=hooks)
    assert took and all(t is None for t in took)
    _spied(monkeypatch, False)
    plain = _run(model, extra_hooks=hooks)
    pd.testing.assert_frame_equal(shifted, plain)


def test_bound_check_rows_per_step_are_eight_on_the_cpu_and_all_on_a_gpu_within_a_gib():
    from posgen_tl.engine.decompose_bound import bound_chunk
    from posgen_tl.hooks.capture import QKCapture
    from posgen_tl.maths.rope import LayerRope

    rope = LayerRope(inv_freq=torch.ones(32), rotary_dim=64)

    def cap(b, n, kv, device):
        k = torch.empty(b, n, kv, 64, device=device)
        return QKCapture(layer=0, q=k, k=k, rot_q=k, rot_k=k, positions=torch.empty(0), rope=rope, rot_source="hook")

    assert bound_chunk(cap(4, 512, 3, "cpu"), 32) == 8
    assert bound_chunk(cap(4, 512, 3, "meta"), 32) == 32  # every checked row in one step
    big = bound_chunk(cap(4, 512, 90, "meta"), 32)  # 30 layers stacked: 2^27 entries allow 22 rows
    assert big == 2**27 // (4 * 90 * 512 * 32) == 22


def test_the_fits_of_every_layer_are_solved_together(tiny, monkeypatch):
    """The D1/D2 fits wait as O(n) sums and are solved in one call per mask family (Gemma3's sliding-window and
    global layers apart) instead of one per layer and batch; FIT_BATCH entries or more start a call early — and
    every score stays the same."""
    import posgen_tl.engine.decompose_scores as D

    calls: list[int] = []
    real = D.join_sums
    monkeypatch.setattr(D, "join_sums", lambda parts: calls.append(len(parts)) or real(parts))
    whole = _run(tiny)
    spec = probe_hooks(tiny)[0]
    windows = [spec.layer(i).sliding_window for i in range(spec.n_layers)]
    changes = sum(a != b for a, b in zip(windows, windows[1:]))
    batches = -(-N_SEQ // 2)  # _run's batch_size
    assert sum(calls) == spec.n_layers * batches  # every (layer, batch) solved, none twice
    assert len(calls) <= (1 + changes) * batches  # a call per run of layers with the same masks
    if not changes:
        assert calls == [spec.n_layers * batches]  # one call for the whole run
    calls.clear()
    monkeypatch.setattr(D, "FIT_BATCH", 1)  # one capture's sums already fill it: a call per (layer, batch)
    assert_same_scores(whole, _run(tiny), rtol=1e-9)
    assert calls == [1] * spec.n_layers * batches


def test_a_runs_scores_are_computed_once_per_mask_and_copied_to_the_host_once(tiny, monkeypatch):
    """Every (capture, sink, estimator) keeps its moments' few sums per map; the scores of the whole run are ONE
    ``scores_of_sums`` call per mask (sink kept / excluded; Gemma3's sliding-window layers have their own masks) and
    ONE copy to the host — and the rows are those of each capture scored alone (``FIT_BATCH`` = 1 solves and scores
    the fits capture by capture)."""
    import posgen_tl.engine.decompose_scores as D

    masks: list[int] = []
    real_scores = D.scores_of_sums
    monkeypatch.setattr(D, "scores_of_sums", lambda s, g: masks.append(id(g)) or real_scores(s, g))
    copies = []
    real_frames = D._Deferred.frames

    def frames(self, docs):
        copies.append(len(self.records))
        return real_frames(self, docs)

    monkeypatch.setattr(D._Deferred, "frames", frames)
    whole = _run(tiny)
    spec = probe_hooks(tiny)[0]
    families = len({spec.layer(i).sliding_window for i in range(spec.n_layers)})
    assert len(masks) == len(set(masks)) == 2 * families  # sink kept and excluded, per mask family
    batches = -(-N_SEQ // 2)
    # per capture: D3 of each k̄ kind on both masks, and D1/D2 on both masks
    assert copies == [spec.n_layers * batches * 2 * (2 + 2)]
    monkeypatch.setattr(D, "FIT_BATCH", 1)
    assert_same_scores(whole, _run(tiny), rtol=1e-12)
