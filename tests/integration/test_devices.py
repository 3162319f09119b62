"""Devices and big models: weights go where asked, ``device_map`` reaches HF accelerate, and
(with a GPU) every analysis runs on ``cuda`` with its results on the CPU, equal to a CPU run.

On a CPU-only machine the placement is checked on the ``meta`` device (no data, but a device
other than the CPU that tensors must really be moved to), and ``device_map="cpu"`` exercises
the accelerate path end to end. The GPU tests are skipped without a GPU.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import tiny_models as tm
import torch

from posgen_tl.io.models import ModelLoadError, _boot, load_model, random_twin

needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="needs HF accelerate (pip install 'posgen_tl[multigpu]')")


def needs_gpu(test):
    """The GPU tier (``python -m pytest -m gpu``): the ``gpu`` mark, and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")(test))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny HF Llama with its tokenizer saved as a local folder (what load_model reads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=128,
                      rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()  # never booted: a bridge rewires the module it wraps
    folder = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(str(folder))
    tm.tiny_tokenizer().save_pretrained(str(folder))
    return folder


def test_boot_moves_preloaded_weights_to_the_device():
    """The bridge keeps a pre-loaded hf_model where it is and only records ``device``: load_model
    must move the weights itself (before this fix a zoo model asked for 'cuda' stayed on the CPU)."""
    _, hf = tm.hf_llama(n_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _boot(hf, tm.tiny_tokenizer(), "tiny", "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert str(model.cfg.device) == "meta"


def test_random_twin_lands_on_the_models_device():
    _, hf = tm.hf_llama(n_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _boot(hf, tm.tiny_tokenizer(), "tiny", "meta")
        twin = random_twin(model, seed=0)
    assert {p.device.type for p in twin.parameters()} == {"meta"}


def test_a_hugging_face_model_in_memory_is_bridged_checked_and_analysable():
    """``load_model(hf_model, tokenizer=)``: an in-memory HF causal LM becomes a bridge whose logits are the HF
    model's own, whose exactness check passes on every layer, and whose tokenizer tokenizes text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posgen_tl.experiments.exactness import exactness_table
    from posgen_tl.io.corpus import corpus_tokens

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                      intermediate_size=64, vocab_size=100, max_position_embeddings=128,
                      rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    toks = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(toks).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(hf, tokenizer=tm.tiny_tokenizer())
    with torch.no_grad():
        got = model(toks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert exactness_table(model, toks)["passed"].all()
    assert corpus_tokens(model, None, seq_len=16, n_seq=2).shape == (2, 16)
    with pytest.raises(ModelLoadError, match="one device"):
        load_model(LlamaForCausalLM(cfg), device_map="cpu")


def test_device_and_device_map_are_exclusive(tiny_folder):
    with pytest.raises(ModelLoadError, match="not both"):
        load_model(str(tiny_folder), device="cpu", device_map="auto")


def test_device_map_without_accelerate_is_a_clear_error(tiny_folder, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    with pytest.raises(ModelLoadError, match=r"accelerate.*multigpu|multigpu.*accelerate"):
        load_model(str(tiny_folder), device_map="auto")


@pytest.fixture
def from_pretrained_calls(monkeypatch):
    """Record the keyword arguments of every ``AutoModelForCausalLM.from_pretrained`` call."""
    from transformers import AutoModelForCausalLM

    calls: list[dict] = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kw):
        calls.append(dict(kw))
        return real(cls, *args, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    return calls


@needs_accelerate
def test_device_map_reaches_accelerate_and_analyses_run(tiny_folder, from_pretrained_calls):
    """``device_map='cpu'`` + bfloat16 goes to ``from_pretrained(..., device_map=..., dtype=...)``
    (accelerate places the weights; the bridge leaves them there) and the analyses run on it."""
    from posgen_tl.experiments.decomposition import decompose_model
    from posgen_tl.experiments.pattern import feature_pattern

    model = load_model(str(tiny_folder), device_map="cpu", dtype=torch.bfloat16)
    assert from_pretrained_calls and from_pretrained_calls[-1]["device_map"] == "cpu"
    assert from_pretrained_calls[-1]["dtype"] == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    toks = torch.randint(3, 90, (3, 24), generator=torch.Generator().manual_seed(0))
    df = decompose_model(model, toks[:-1], reference=toks[-1:], batch_size=2, progress=False)
    assert len(df) and df["d3_bound_holds"].dropna().eq(1.0).all()
    pat = feature_pattern(model, toks, progress=False)
    assert pat.heads["pred_d3_err_per_sequence"].notna().all()


@pytest.mark.real
@needs_accelerate
def test_zoo_model_with_device_map(from_pretrained_calls):
    model = load_model("smollm2-135m", device_map="cpu")
    assert from_pretrained_calls[-1]["device_map"] == "cpu"
    from posgen_tl.hooks.stream import capture_qk

    caps = capture_qk(model, torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]), layers=[0, 29])
    assert set(caps) == {0, 29}


# ----------------------------------------------------------------------------- with a GPU


def _analyses(model, toks):
    from posgen_tl.engine.conditions import Condition, condition_rows
    from posgen_tl.experiments.decomposition import decompose_model
    from posgen_tl.experiments.pattern import feature_pattern
    from posgen_tl.hooks.edits import Intervention, key_means
    from posgen_tl.io.sampling import as_windows as _tensor_windows

    dec = decompose_model(model, toks[:-1], reference=toks[-1:], batch_size=2, progress=False)
    pat = feature_pattern(model, toks[:-1], progress=False)
    iv = Intervention("destroy", bands=[0, 1], layers=[1], alpha=0.5)
    km = key_means(model, toks[:-1, :-6])
    tol, _, _ = condition_rows(model, _tensor_windows(toks[:-1]), Condition("destroy", iv), k_means=km,
                               target_len=6, fracs=(0.0, 0.2), seeds=(0,))
    return dec, pat, tol


@needs_gpu
def test_every_analysis_on_cuda_matches_cpu():
    import pandas as pd

    torch.manual_seed(0)
    cpu_model = tm.hf_llama(n_layers=2)[0]
    toks = torch.randint(3, 90, (4, 24), generator=torch.Generator().manual_seed(0))
    want = _analyses(cpu_model, toks)
    torch.manual_seed(0)
    gpu_model = tm.hf_llama(n_layers=2)[0].to("cuda")
    got = _analyses(gpu_model, toks)  # tokens on the CPU: moved to the model's device by the library
    for g, w in ((got[0], want[0]), (got[1].heads, want[1].heads), (got[2], want[2])):
        num = [c for c in w.columns if pd.api.types.is_float_dtype(w[c])]
        pd.testing.assert_frame_equal(g[num], w[num], rtol=1e-3, atol=1e-4)
    assert all(v.device.type == "cpu" for v in got[1].k_means.values())


@needs_gpu
@pytest.mark.parametrize("which", ["hf_llama", "hf_gemma3"])
def test_the_decomposition_from_the_factors_on_cuda_matches_the_maps_on_the_cpu(which):
    """The factored moments (a GPU's path from 1 024 tokens, forced here at 24) on ``cuda`` against the CPU's maps:
    GQA, and Gemma3's sliding window and QK-norm."""
    from score_frames import assert_same_scores

    from posgen_tl.experiments.decomposition import decompose_model

    toks = torch.randint(3, 90, (4, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(reference=toks[-1:], sink=1, batch_size=2, bound_rows=8, progress=False)
    torch.manual_seed(0)
    want = decompose_model(getattr(tm, which)()[0], toks[:-1], factored=False, **kw)
    torch.manual_seed(0)
    got = decompose_model(getattr(tm, which)()[0].to("cuda"), toks[:-1], factored=True, **kw)
    assert_same_scores(want, got, rtol=1e-4, atol=1e-5)


@needs_gpu
@needs_accelerate
def test_device_map_auto_on_gpu(tiny_folder):
    from posgen_tl.experiments.pattern import feature_pattern

    model = load_model(str(tiny_folder), device_map="auto", dtype=torch.bfloat16)
    toks = torch.randint(3, 90, (2, 16))
    res = feature_pattern(model, toks, progress=False)
    assert res.heads["pred_d3_err_per_sequence"].notna().all()


#: the measurement tables of a report (per sequence / head / band): equal on every device to float tolerance.
#: Summaries derived from them (bootstrap CIs, permutation p) are not compared: a tie broken by a 1e-7
#: difference may move a rank-based p without anything being wrong.
MEASUREMENTS = ("decomposition.csv", "pattern_heads.csv", "pattern_bands.csv", "heads.csv", "heads_bands.csv",
                "tolerance_curves.csv", "causal_units.csv", "sufficiency_rows.csv",
                "length_gap_rows.csv")


def _tiny_report(root, device: str, seq_len: int = 64):
    """The quick report of a tiny HF Llama (initialiser range 0.25, so logits are O(1) and nothing ties) on
    ``device``, with the model loaded the way the CLI's ``--device`` loads it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posgen_tl.report.run import ReportSettings, run_report

    folder = root / "model"
    if not (folder / "config.json").exists():
        cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=3, intermediate_size=64, vocab_size=100, max_position_embeddings=256,
                          initializer_range=0.25, rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(str(folder))
        tm.tiny_tokenizer().save_pretrained(str(folder))
    out = root / f"out-{device}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = run_report(ReportSettings(model=str(folder), out=str(out), preset="quick",
                                       sizes=dict(seq_len=seq_len, n_seq=4), load={"device": device}))
    assert rc == 0
    return out


def _assert_same_measurements(a, b):
    import json

    import pandas as pd

    for name in MEASUREMENTS:
        x, y = pd.read_csv(a / name), pd.read_csv(b / name)
        assert list(x.columns) == list(y.columns) and len(x) == len(y), name
        num = [c for c in x.columns if pd.api.types.is_float_dtype(x[c])]
        assert num, name
        assert np.isfinite(x[num].to_numpy()).any(), f"{name}: no finite measurement to compare"
        pd.testing.assert_frame_equal(x[num], y[num], rtol=1e-3, atol=1e-4, obj=name)
    ra, rb = json.loads((a / "results.json").read_text()), json.loads((b / "results.json").read_text())
    return ra, rb


@needs_gpu
def test_every_study_of_the_report_runs_on_cuda_and_matches_the_cpu(tmp_path):
    """The GPU tier: the whole report (every study) with the model on ``cuda`` — tokens built on the CPU,
    moved by the library — gives the CPU's measurements, and records the device it ran on."""
    cpu = _tiny_report(tmp_path, "cpu")
    gpu = _tiny_report(tmp_path, "cuda")
    rc, rg = _assert_same_measurements(cpu, gpu)
    assert rc["device"] == "cpu" and rg["device"].startswith("cuda")


@pytest.mark.slow
def test_the_device_comparison_itself_can_fail(tmp_path):
    """The harness of the GPU tier, run on the CPU twice: equal runs pass; a run at another length (other
    numbers) fails — so the GPU tier compares something."""
    a = _tiny_report(tmp_path / "a", "cpu")
    b = _tiny_report(tmp_path / "b", "cpu")
    _assert_same_measurements(a, b)
    c = _tiny_report(tmp_path / "c", "cpu", seq_len=48)
    with pytest.raises(AssertionError):
        _assert_same_measurements(a, c)
