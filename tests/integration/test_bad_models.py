"""What a new user meets with their own folder: the spec read from each architecture, and bad input —
a non-RoPE model (GPT-2), a folder without a tokenizer, an unsupported RoPE type, scores that cannot be
compared — each an error (or a non-zero `posgen-tl check`) that names the problem."""

from __future__ import annotations

import shutil
import warnings

import arch_matrix as am
import pytest
import torch

import posgen_tl as pg
from posgen_tl.cli import main
from posgen_tl.experiments.exactness import MIN_COMPARED_ENTRIES, exactness_table
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.io.models import ModelLoadError
from posgen_tl.maths.rope import RopeError


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bad-models")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _load(name, root, **kw):
    return pg.load_model(str(am.build_folder(am.ARCHS[name], root)), **kw)


# ----------------------------------------------------------------------------- the spec of each family


def test_windows_come_from_the_config_and_layer_types(root):
    for name in ("mistral", "mixtral", "phi3"):  # config.sliding_window only: every layer
        spec, _ = probe_hooks(_load(name, root))
        assert [lr.sliding_window for lr in spec.layers] == [am.WINDOW] * am.N_LAYERS, name
    spec, _ = probe_hooks(_load("qwen2", root))  # layer_types: max_window_layers=1 → layer 1 only
    assert [lr.sliding_window for lr in spec.layers] == [None, am.WINDOW]
    spec, _ = probe_hooks(_load("llama", root))
    assert [lr.sliding_window for lr in spec.layers] == [None, None]


def test_neox_gptj_olmo2_cohere_specs(root):
    spec, info = probe_hooks(_load("gpt-neox-0.25", root))
    assert spec.layers[0].rotary_dim == 4 and spec.layers[0].layout == "half" and not info.rot_fires
    assert info.table_source == "hook_cos/hook_sin"  # the rotation is checked against the model's own table
    spec, info = probe_hooks(_load("gptj", root))
    assert (spec.layers[0].rotary_dim, spec.layers[0].layout, spec.d_head) == (8, "adjacent", 16)
    assert info.table_source == "embed_positions" and "sin/cos table" in spec.source
    spec, info = probe_hooks(_load("olmo2", root))
    assert info.normed_layout == "flat" and info.q_hook == "hook_q_normed"
    from posgen_tl import compat

    if compat.has_hooked_transformer():  # TransformerLens 3.9's Cohere adapter lacks the QK-norm: refused, named
        with pytest.raises(ModelLoadError, match="CohereForCausalLM"):
            _load("cohere", root)
    else:
        spec, info = probe_hooks(_load("cohere", root))
        assert spec.layers[0].layout == "adjacent"  # interleaved pairs, read from the model's cos table
    spec, info = probe_hooks(_load("olmo", root))
    assert info.clip_qk == 4.0


def test_longrope_switches_factors_with_the_length(root):
    model = _load("phi3-longrope", root)
    spec, _ = probe_hooks(model)
    lr = spec.layers[0]
    assert lr.long_after == 16 and lr.long_inv_freq is not None
    assert lr.for_positions(torch.arange(16)).inv_freq is lr.inv_freq  # max id + 1 = 16: short factors
    assert torch.equal(lr.for_positions(torch.arange(17)).inv_freq, lr.long_inv_freq)
    for n, long in ((12, False), (24, True)):
        caps = pg.capture_qk(model, am._tokens(n)[:1], layers=[0])
        assert torch.equal(caps[0].rope.inv_freq, lr.long_inv_freq if long else lr.inv_freq)
        assert exactness_table(model, am._tokens(n))["passed"].all()


# ----------------------------------------------------------------------------- bad input


def _gpt2_folder(root):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = root / "gpt2"
    if not (folder / "config.json").exists():
        cfg = GPT2Config(vocab_size=am.VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
        cfg.architectures = ["GPT2LMHeadModel"]
        torch.manual_seed(0)
        GPT2LMHeadModel(cfg).save_pretrained(str(folder))
        am.tokenizer().save_pretrained(str(folder))
    return folder


def test_gpt2_is_refused_as_not_rope(root, capsys):
    model = pg.load_model(str(_gpt2_folder(root)))
    with pytest.raises(RopeError, match="not rotary"):
        exactness_table(model, am._tokens(8))
    rc = main(["check", "--model", str(_gpt2_folder(root))])
    err = capsys.readouterr().err
    assert rc == 2 and "not rotary" in err and "Traceback" not in err


def test_folder_without_tokenizer_is_named(root, tmp_path, capsys):
    folder = tmp_path / "no-tok"
    shutil.copytree(am.build_folder(am.ARCHS["llama"], root), folder)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        pg.load_model(str(folder))
    assert main(["check", "--model", str(folder)]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


def test_unsupported_rope_type_is_named(root):
    model = _load("llama-yarn", root)
    model.original_model.config.rope_parameters = dict(model.original_model.config.rope_parameters,
                                                       rope_type="mystery_scaling")
    with pytest.raises(RopeError, match="'mystery_scaling' is not supported.*LlamaForCausalLM|LlamaForCausalLM.*"
                                        "'mystery_scaling' is not supported"):
        pg.rope_spec(model)


# ----------------------------------------------------------------------------- `posgen-tl check`


def test_check_passes_on_a_windowed_folder_and_exercises_the_window(root, capsys):
    rc = main(["check", "--model", str(am.build_folder(am.ARCHS["mistral"], root)), "--seq-len", "32", "--n-seq", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out
    table = exactness_table(_load("mistral", root), am._tokens(32)[:1])
    full = 32 * 33 // 2 * am.N_HEADS
    assert (table["n_compared"] < full).all() and (table["mask_mismatch"] == 0).all()


def test_check_exits_nonzero_when_too_few_entries_are_compared(root, capsys):
    rc = main(["check", "--model", str(am.build_folder(am.ARCHS["llama"], root)), "--seq-len", "2", "--n-seq", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "not checked" in out and f"< {MIN_COMPARED_ENTRIES}" in out and "PASS" not in out


def test_check_exits_nonzero_when_scores_cannot_be_compared(root, monkeypatch, capsys):
    import dataclasses

    import posgen_tl.hooks.capture as cap

    model = _load("llama", root)
    spec, info = probe_hooks(model)
    monkeypatch.setitem(cap._PROBES, model, (spec, dataclasses.replace(info, scores_kind="unknown")))
    monkeypatch.setattr("posgen_tl.io.models.load_model", lambda *a, **k: model)
    rc = main(["check", "--model", "whatever", "--seq-len", "16", "--n-seq", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "no score was compared" in out and "not checked" in out


def test_check_fails_when_the_spec_misses_a_window(root, monkeypatch, capsys):
    """Today's bug, reproduced: a Mistral spec without its config-only window fails, it does not PASS."""
    import posgen_tl.io.spec as spec_mod

    monkeypatch.setattr(spec_mod, "_layer_window", lambda *a, **k: None)
    rc = main(["check", "--model", str(am.build_folder(am.ARCHS["mistral"], root)), "--seq-len", "16", "--n-seq", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "mask" in out and "PASS" not in out
