"""The target-span NLL reads only the span's logits (final residual → unembedding) — except where the model
soft-caps its output logits after the unembedding (Gemma2), where that shortcut would skip the cap: there the
full logits are computed. Checked against Hugging Face's own logits."""

from __future__ import annotations

import tiny_models as tm
import torch

import posgen_tl.patching as P
from posgen_tl.engine.swaps import nll_on_target
from posgen_tl.maths.perturb import nll_from_logits


def test_target_nll_keeps_gemma2s_final_logit_softcap():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       num_hidden_layers=2, vocab_size=100, max_position_embeddings=128, sliding_window=8,
                       final_logit_softcapping=0.5, query_pre_attn_scalar=16)
    cfg.architectures = ["Gemma2ForCausalLM"]
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.norm.weight.fill_(20.0)  # large logits, so that the cap of 0.5 changes them a lot
    model = tm._boot(hf)
    toks = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = nll_from_logits(hf(toks).logits.float(), toks)[:, -7:].mean(-1)  # predictions of the last 7 tokens
        uncapped = nll_from_logits(hf.lm_head(hf.model(toks).last_hidden_state).float(), toks)[:, -7:].mean(-1)
    assert (ref - uncapped).abs().max() > 1e-2  # the cap matters here (else the test compares nothing)
    got = nll_on_target(model, toks, target_len=7)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # through chunks of 6 (the window of 8 straddles them): the span's rows from the chunks' own capped logits
    torch.testing.assert_close(nll_on_target(model, toks, target_len=7, chunk=6), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(P.target_nll(toks, 7)(model(toks)), ref, rtol=1e-5, atol=1e-5)
