"""The architecture matrix (issue #23): every cell exact against Hugging Face's own eager attention or
a named refusal — in float32, bfloat16 and float16, on every backend of the installed TransformerLens —
and the committed support table (docs/architectures.json) says exactly what this run measured.

CI runs this module in both environments (TL 4.3: the bridge; TL 3.9: the bridge and the
HookedTransformer). Regenerate the table after a change: ``python docs/gen_architectures.py --out
docs/architectures.md --json docs/architectures.json`` in each environment.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import arch_matrix as am
import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMITTED = am.load_json(DOCS / "architectures.json") or {"columns": {}, "archs": {}}
REGEN = "regenerate it: python docs/gen_architectures.py --out docs/architectures.md --json docs/architectures.json"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("arch-matrix")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one thread is 4× faster than two on a busy 2-core machine (no thread wake-ups)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


CELLS = [(a, b, d) for a in am.ARCHS for b in am.backends() for d in am.DTYPES]


@pytest.mark.parametrize("arch,backend,dtype", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_exact_or_a_named_refusal_and_matches_the_table(arch, backend, dtype, root):
    cell = am.run_cell(am.ARCHS[arch], backend, dtype, root)
    assert cell.ok, f"{arch} / {backend} / {dtype}: {cell.status}"
    if cell.status == "exact":
        tol = am.tolerances(am.DTYPES[dtype])
        assert cell.n_compared >= am.MIN_COMPARED
        assert cell.rot_err <= tol["rot"] and cell.score_err <= tol["score"] and cell.pattern_err <= tol["pattern"]
    else:  # a refusal names the model (its folder, or TransformerLens' name with its HF class) and what is missing
        assert arch in cell.status or am.ARCHS[arch].family in cell.status, cell.status
    col = am.column(backend)
    committed = COMMITTED["columns"].get(col, {}).get("cells", {}).get(arch, {}).get(dtype, {}).get("status")
    assert am.same_status(committed, cell.status), (
        f"docs/architectures.json is stale for {arch} / {col} / {dtype}: committed {committed!r}, measured "
        f"{cell.status!r}; {REGEN}")


def test_table_lists_exactly_the_matrix():
    assert list(COMMITTED["archs"]) == list(am.ARCHS), REGEN
    for b in am.backends():
        col = am.column(b)
        assert col in COMMITTED["columns"], f"no column {col!r} in docs/architectures.json; {REGEN}"
        assert set(COMMITTED["columns"][col]["cells"]) == set(am.ARCHS), REGEN
    md = (DOCS / "architectures.md").read_text()
    assert md == am.render_markdown(COMMITTED), f"docs/architectures.md was not rendered from the JSON; {REGEN}"
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert am.readme_claim(COMMITTED) in readme, (
        "the README's claim of supported architectures differs from docs/architectures.json; run "
        "python docs/gen_architectures.py --json docs/architectures.json --readme README.md --render-only")


def _fresh_cell(arch: str, root) -> am.Cell:
    """One float32 bridge cell from a freshly loaded model (so a monkeypatched library is what runs), with the
    library's gate opened (``unchecked``): these tests prove the REFERENCE — Hugging Face's own attention and
    the exactness table — catches a wrong spec, not only the gate in front of the analyses."""
    import warnings

    from posgen_tl.hooks.gate import UncheckedWarning

    am._MODELS.clear()
    am.UNCHECKED = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncheckedWarning)
            return am.run_cell(am.ARCHS[arch], "bridge", "float32", root)
    finally:
        am.UNCHECKED = False
        am._MODELS.clear()


def test_the_gate_refuses_a_wrong_window_before_any_reference(root, monkeypatch):
    """The same wrong spec as below with the gate closed: a named refusal, never a number."""
    import posgen_tl.io.spec as spec_mod

    monkeypatch.setattr(spec_mod, "_layer_window", lambda *a, **k: None)
    am._MODELS.clear()
    try:
        cell = am.run_cell(am.ARCHS["mistral"], "bridge", "float32", root)
    finally:
        am._MODELS.clear()
    assert cell.status.startswith("refused: mistral") and "layer 0 failed" in cell.status


def test_the_reference_is_sensitive_to_a_wrong_window(root, monkeypatch):
    """The matrix would catch today's bug: a Mistral spec without its config-only window is 'wrong'."""
    import posgen_tl.io.spec as spec_mod

    monkeypatch.setattr(spec_mod, "_layer_window", lambda *a, **k: None)
    cell = _fresh_cell("mistral", root)
    assert not cell.ok and ("mask" in cell.status or "failed" in cell.status), cell.status


def test_the_reference_is_sensitive_to_a_wrong_kv_expansion(root, monkeypatch):
    """An expansion mapping query head h to kv head h % G (instead of h // (H/G)) fails the Llama cell
    (rope.expand_kv is what scores_from_rotated and the capture call at run time)."""
    import posgen_tl.hooks.capture as capture
    import posgen_tl.maths.rope as rope

    for mod in (rope, capture):
        monkeypatch.setattr(mod, "expand_kv", lambda k, n_heads: k[..., torch.arange(n_heads) % k.shape[-2], :])
    cell = _fresh_cell("llama", root)
    assert not cell.ok and "score" in cell.status, cell.status


def test_the_reference_is_sensitive_to_unmodelled_sinks(root, monkeypatch):
    """GPT-OSS's learned sinks change every pattern row: dropping them from our pattern fails the cell."""
    import posgen_tl.experiments.exactness as ex
    import posgen_tl.hooks.capture as capture
    from posgen_tl.maths import rope

    for mod in (ex, capture):
        monkeypatch.setattr(mod, "attention_pattern", lambda w, mask, sinks=None: rope.attention_pattern(w, mask))
    cell = _fresh_cell("gpt-oss", root)
    assert not cell.ok and "pattern" in cell.status, cell.status


# ----------------------------------------------------------------------------- the hooks that rewrite attention


HOOK_CELLS = [(a, b) for a in am.ARCHS for b in am.backends()]


def _loaded_or_refused(arch: str, backend: str, root):
    """The float32 model and its probe, or ``None`` where the matrix refuses the cell (by name)."""
    from posgen_tl.hooks.capture import CaptureError, probe_hooks
    from posgen_tl.hooks.gate import require_exact
    from posgen_tl.io.models import ModelLoadError
    from posgen_tl.maths.rope import RopeError

    try:
        model = am.load(am.ARCHS[arch], backend, torch.float32, root)
        spec, info = probe_hooks(model)
        require_exact(model, None, "the matrix's hook tests")  # the gate refuses the cell: nothing to test
    except (RopeError, CaptureError, ModelLoadError) as e:
        assert arch in str(e) or "gpt" in str(e).lower() or str(e), e
        return None
    return model, spec, info


@pytest.mark.parametrize("arch,backend", HOOK_CELLS, ids=["-".join(c) for c in HOOK_CELLS])
def test_logit_substitution_by_exact_logits_reproduces_the_model(arch, backend, root):
    """Every layer's scores replaced by our exact RoPE logits of the stashed pre-rotation q/k (every hook
    layout: per-head / flattened QK-norm, head-major, OLMo's clamp after the hook) gives the model's own
    logits; where hook_attn_scores are not pre-softmax logits, a CaptureError says substitution is impossible."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.hooks.logits import logit_substitution_hooks
    from posgen_tl.maths.approx_logits import exact_logits

    got = _loaded_or_refused(arch, backend, root)
    if got is None:
        pytest.skip("refused by the matrix")
    model, spec, info = got
    toks = am._tokens(am.SEQ_LEN)

    def every_entry(ctx):
        n = ctx.q.shape[1]
        return exact_logits(ctx.q, ctx.k, ctx.rope, ctx.positions, dtype=torch.float32), torch.ones(n, n, dtype=torch.bool)

    with torch.no_grad():
        ref = model(toks, return_type="logits")
        if info.scores_kind != "pre_softmax":
            with pytest.raises(CaptureError, match="pre-softmax"):
                logit_substitution_hooks(model, every_entry)
            return
        out = model.run_with_hooks(toks, return_type="logits", fwd_hooks=logit_substitution_hooks(model, every_entry))
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, f"{arch}/{backend}: substituted exact logits move the output by {err:.2e} (relative)"


@pytest.mark.parametrize("arch,backend", HOOK_CELLS, ids=["-".join(c) for c in HOOK_CELLS])
def test_key_edit_reaches_the_keys_the_model_rotates(arch, backend, root):
    """``enforce`` at α = 1 on every band of layer 1: the keys entering RoPE (read after the edit, in the
    hook's own layout) are k̄ on the rotary dimensions and untouched elsewhere — on every hook layout."""
    from posgen_tl.hooks.capture import pre_rotation_stash
    from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means

    got = _loaded_or_refused(arch, backend, root)
    if got is None:
        pytest.skip("refused by the matrix")
    model, spec, info = got
    toks = am._tokens(am.SEQ_LEN)
    layer, rope = 1, spec.layer(1)
    km = key_means(model, toks, layers=[layer])
    iv = Intervention("enforce", bands=list(range(rope.rotary_dim // 2)), layers=[layer], alpha=1.0)
    before, after = {}, {}
    with torch.no_grad():
        model.run_with_hooks(toks, return_type="logits", fwd_hooks=pre_rotation_stash(model, info, layer, spec.d_head, before))
        hooks = intervention_hooks(model, iv, km) + pre_rotation_stash(model, info, layer, spec.d_head, after)
        model.run_with_hooks(toks, return_type="logits", fwd_hooks=hooks)
    # the spec's head counts are those the model uses (Falcon's multi-query attention: 1 kv head)
    assert before["q"].shape[2] == spec.n_heads and before["k"].shape[2] == spec.n_kv_heads, (before["k"].shape, spec)
    r = rope.rotary_dim
    kbar = km[layer].float().reshape(-1, spec.d_head)  # [kv_head, d_head]
    want = kbar[..., :r].expand_as(after["k"][..., :r])
    if info.clip_qk is not None:
        want = want.clamp(-info.clip_qk, info.clip_qk)
    torch.testing.assert_close(after["k"][..., :r], want, rtol=1e-5, atol=1e-5 * float(kbar.abs().max()))
    assert torch.equal(after["k"][..., r:], before["k"][..., r:])  # partial rotary: the pass-through part is untouched
    assert torch.equal(after["q"], before["q"])  # a key edit leaves the queries alone
    assert not torch.allclose(after["k"], before["k"])  # and it did change the keys


@pytest.mark.parametrize("arch,backend", HOOK_CELLS, ids=["-".join(c) for c in HOOK_CELLS])
def test_repositioning_by_a_constant_shift_leaves_the_model_unchanged(arch, backend, root):
    """RoPE sees only i − j: re-positioning every token by +5 through the hooks changes no output (up to
    float rounding), on every hook layout; a model whose rotation cannot be reached exactly says so."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.hooks.positions import reposition_hooks

    got = _loaded_or_refused(arch, backend, root)
    if got is None:
        pytest.skip("refused by the matrix")
    model, spec, info = got
    toks = am._tokens(am.SEQ_LEN)
    ids = torch.arange(am.SEQ_LEN) + 5
    if not info.rot_fires and info.clip_qk is not None:
        with pytest.raises(CaptureError, match="clip_qkv"):
            reposition_hooks(model, ids)
        return
    with torch.no_grad():
        ref = model(toks, return_type="logits")
        out = model.run_with_hooks(toks, return_type="logits", fwd_hooks=reposition_hooks(model, ids))
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, f"{arch}/{backend}: a constant shift of the positions moves the output by {err:.2e} (relative)"
    # and the hooks do act: a non-constant map (two tokens swapped) changes the output
    ids2 = torch.arange(am.SEQ_LEN)
    ids2[[3, 9]] = ids2[[9, 3]]
    with torch.no_grad():
        moved = model.run_with_hooks(toks, return_type="logits", fwd_hooks=reposition_hooks(model, ids2))
    assert float((moved - ref).abs().max()) > 1e-4


@pytest.mark.parametrize("arch", list(am.ARCHS))
def test_feature_pattern_covers_every_head_of_the_spec(arch, root):
    """The feature-pattern tables (one forward pass per batch, statistics per band) have one row per
    (layer, query head) with its kv group, and per (layer, kv head, band) for the keys — GQA and
    multi-query attention included."""
    from posgen_tl.experiments.pattern import feature_pattern
    from posgen_tl.io.sampling import Windows

    got = _loaded_or_refused(arch, am.backends()[0], root)
    if got is None:
        pytest.skip("refused by the matrix")
    model, spec, _ = got
    g = torch.Generator().manual_seed(1)
    names = [f"d{i}" for i in range(9)]
    win = Windows(torch.randint(3, am.VOCAB, (4, am.SEQ_LEN), generator=g), torch.arange(4), torch.zeros(4, dtype=torch.long), names)
    ref = Windows(torch.randint(3, am.VOCAB, (3, am.SEQ_LEN), generator=g), torch.tensor([6, 7, 8]), torch.zeros(3, dtype=torch.long), names)
    pat = feature_pattern(model, win, reference=ref, batch_size=4, progress=False)
    heads = pat.heads[pat.heads["twin"] == "trained"] if "twin" in pat.heads else pat.heads
    assert len(heads) == spec.n_layers * spec.n_heads
    assert sorted(heads["kv_group"].unique()) == list(range(spec.n_kv_heads))
    keys = pat.bands[(pat.bands["which"] == "k")]
    assert set(keys["head"]) == set(range(spec.n_kv_heads))
    assert heads["logit_spread"].notna().all()


@pytest.mark.parametrize("arch,backend", HOOK_CELLS, ids=["-".join(c) for c in HOOK_CELLS])
def test_positions_past_the_context_reach_every_model(arch, backend, root):
    """The gap probe's position ids run past the trained context. RoPE sees only i − j, so shifting
    every id by 3·n_ctx changes no NLL — also on models that keep a fixed table of positions (GPT-J,
    CodeGen: ``embed_positions``) or take no ``position_ids`` (re-rotation hooks then)."""
    from posgen_tl.experiments.length import span_nll

    got = _loaded_or_refused(arch, backend, root)
    if got is None:
        pytest.skip("refused by the matrix")
    model, spec, _ = got
    toks = am._tokens(am.SEQ_LEN)
    far = torch.arange(am.SEQ_LEN) + 3 * spec.n_ctx
    if "dynamic_max_len" in spec.extra:  # dynamic NTK: the frequencies themselves change past the context
        from posgen_tl.experiments.length import gap_probe
        from posgen_tl.maths.rope import RopeError

        with pytest.raises(RopeError, match="dynamic NTK"):
            gap_probe(model, toks, gaps=(0.0, 1.0), prefix_len=8, suffix_len=8, skip=2, conditions=("vanilla",),
                      progress=False)
        return
    if "max_position" in spec.extra:  # a fixed position table: the capture says how to get there instead of crashing
        from posgen_tl.hooks.capture import CaptureError
        from posgen_tl.hooks.stream import capture_qk

        with pytest.raises(CaptureError, match="past the model's table"):
            capture_qk(model, toks, [0], position_ids=far)
    with torch.no_grad():
        near = span_nll(model, toks, 4)
        moved = span_nll(model, toks, 4, position_ids=far)
    torch.testing.assert_close(moved, near, rtol=1e-3, atol=5e-3)  # re-rotation at ~200 positions: float rounding


@pytest.mark.parametrize("arch,backend", HOOK_CELLS, ids=["-".join(c) for c in HOOK_CELLS])
def test_a_forward_resumed_at_a_block_reproduces_the_model(arch, backend, root):
    """Residual re-entry (what the causal and patching runs use to skip the unedited blocks): the forward
    resumed at block 1 from the residual recorded there gives the model's own logits, whether the blocks below
    are skipped (where the check allows it) or computed — on every architecture the matrix accepts."""
    from posgen_tl.hooks import reentry

    got = _loaded_or_refused(arch, backend, root)
    if got is None:
        pytest.skip("refused by the matrix")
    model = got[0]
    toks = am._tokens(am.SEQ_LEN)
    store: dict = {}
    with torch.no_grad():
        ref = model(toks, return_type="logits")
        reentry.skips_blocks(model)
        with model.hooks(fwd_hooks=reentry.resid_hooks([1], store)):
            model(toks, return_type="logits")
        out = reentry.forward_from(model, reentry.recorded(store)[1], 1, tokens=toks, return_type="logits")
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err < 1e-5, f"{arch}/{backend}: the resumed forward moves the output by {err:.2e} (relative)"


def test_a_status_agrees_up_to_the_noise_of_its_measured_number_only():
    base = ("refused: llama-bias: TransformerLens 3.9.0's HookedTransformer conversion of LlamaForCausalLM does not "
            "reproduce the HF model: logits differ by {} (max |logit| 7.97); use backend='bridge'")
    assert am.same_status(base.format("4.27"), base.format("4.3"))  # CI saw both on one machine
    assert not am.same_status(base.format("4.27"), base.format("6.1"))  # a real change of the measurement
    assert am.same_status(base.format("4.27"), base.format("4.27").replace("7.97", "7.98"))  # the HF scale is measured too
    assert not am.same_status(base.format("4.27"), base.format("4.27").replace("7.97", "9.5"))
    assert not am.same_status(base.format("4.27"), base.format("4.27").replace("3.9.0", "3.9.1"))  # other numbers exact
    assert not am.same_status(base.format("4.27"), "exact")
    assert not am.same_status(None, "exact")
    assert am.same_status("exact", "exact")
    rot = "our RoPE differs from the model's layer-0 hook_rot_q by {} (max |rot_q| 4.16); the RoPE variant"
    assert am.same_status(rot.format("0.163"), rot.format("0.165"))  # a subject of several words
    assert not am.same_status(rot.format("0.163"), rot.format("0.5"))
    assert not am.same_status("logits differ by 4.27.", "logits differ by each run")  # no crash on a word
    pattern = "layer 0 failed: attention pattern differs from hook_pattern by {} (learned attention sinks"
    assert am.same_status(pattern.format("0.894"), pattern.format("0.898"))
    assert not am.same_status(pattern.format("0.894"), pattern.format("0.1"))
