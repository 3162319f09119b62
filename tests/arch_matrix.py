"""The architecture matrix: tiny random-init Hugging Face models of every RoPE causal-LM family
TransformerLens boots, checked against Hugging Face's OWN eager attention — never against our hooks.

For one *cell* (architecture × backend × dtype):

1. a tiny config (2 layers, hidden 64, GQA where the architecture has it, biases / norm weights /
   sinks perturbed so they matter, initialiser range large enough that logits are O(1)) is
   instantiated under a fixed seed and saved with an offline byte-level tokenizer to a folder;
2. the folder is loaded the way a user would: ``posgen_tl.load_model(folder, dtype=, backend=)``;
3. the reference: the same folder loaded by ``transformers`` with ``attn_implementation="eager"``,
   its eager attention function wrapped (:class:`HFRecorder`) to record, per layer, the rotated
   query/key it computed, its ``scaling``, ``softcap``, the additive mask it applied, its learned
   sinks and the attention weights it returned;
4. compared: our rotation of the captured pre-rotation q/k (``posgen_tl.maths.rope.rotate``, from
   the spec) and the capture's ``rot_q``/``rot_k`` against HF's rotated q/k; the recomputed logits
   (``QKCapture.logits`` + soft-cap) against ``scaling·q·kᵀ`` of HF's tensors on the entries HF
   leaves unmasked; the spec's mask against HF's mask; our recomputed pattern
   (:func:`posgen_tl.maths.rope.attention_pattern`, sinks included) against HF's weights; and
   :func:`posgen_tl.experiments.exactness.exactness_table` must pass, having compared entries.

A cell is ``exact`` (every error within the dtype's tolerance), ``refused: <message>`` (our code
raised one of its named errors: the architecture is not supported, and says why), or anything
else — a wrong number or a raw exception — which fails the matrix tests.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: the columns of the generated table, in order (one per TransformerLens version × backend)
COLUMNS = ("bridge (TL 4.3)", "bridge (TL 3.9)", "HookedTransformer (TL 3.9)")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

N_LAYERS, HIDDEN, N_HEADS, N_KV, HEAD_DIM = 2, 64, 4, 2, 16
WINDOW = 5  # sliding windows shorter than the exactness probe (6 tokens) on purpose
SEQ_LEN = 24
#: a cell must compare at least this many unmasked score entries (all layers, heads, rows)
MIN_COMPARED = 64


# ----------------------------------------------------------------------------- tokenizer


_TOK_DIR: tempfile.TemporaryDirectory | None = None


@functools.lru_cache(maxsize=1)
def _tokenizer_folder() -> str:
    """An offline byte-level tokenizer (256 byte symbols + <s>, </s>, <pad>; no merges), saved once."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    global _TOK_DIR
    _TOK_DIR = tempfile.TemporaryDirectory(prefix="posgen-arch-tok-")  # removed when the process exits
    fast.save_pretrained(_TOK_DIR.name)
    return _TOK_DIR.name


VOCAB = 259


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_folder())


# ----------------------------------------------------------------------------- configs

_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=N_LAYERS, max_position_embeddings=64,
               initializer_range=0.25, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)


def _llama_like(cls_name: str, **kw) -> Any:
    import transformers

    base = dict(_COMMON, hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=N_HEADS,
                num_key_value_heads=N_KV, head_dim=HEAD_DIM)
    base.update(kw)
    return getattr(transformers, cls_name)(**base)


def _rope(rtype: str = "default", theta: float = 1000.0, **kw) -> dict:
    return dict(rope_type=rtype, rope_theta=theta, **kw)


_LONG = dict(short_factor=[1.0, 1.3, 1.7, 2.2, 3.0, 4.0, 5.5, 7.0][: HEAD_DIM // 2],
             long_factor=[1.0, 2.0, 3.5, 6.0, 9.0, 14.0, 20.0, 31.0][: HEAD_DIM // 2],
             original_max_position_embeddings=16)


def _cfg_llama(rope: dict, **kw) -> Callable[[], Any]:
    return lambda: _llama_like("LlamaConfig", rope_parameters=rope, **kw)


@dataclass(frozen=True)
class Arch:
    """One architecture of the matrix: how to build its config, and what it exercises."""

    name: str
    family: str  # the HF architecture class, e.g. LlamaForCausalLM
    config: Callable[[], Any]
    about: str
    #: sequence lengths the cell runs (LongRoPE: one at or below, one above the original length)
    seq_lens: tuple[int, ...] = (SEQ_LEN,)


ARCHS: dict[str, Arch] = {a.name: a for a in [
    Arch("llama", "LlamaForCausalLM", _cfg_llama(_rope()), "GQA (Llama-2/3, SmolLM2 shape)"),
    Arch("llama-bias", "LlamaForCausalLM", _cfg_llama(_rope(), attention_bias=True, mlp_bias=True),
         "q/k/v/o and MLP biases"),
    Arch("llama-linear", "LlamaForCausalLM", _cfg_llama(_rope("linear", factor=4.0)), "linear RoPE scaling"),
    Arch("llama-dynamic", "LlamaForCausalLM", _cfg_llama(_rope("dynamic", factor=2.0)),
         "dynamic NTK (exact up to the original length)"),
    Arch("llama-yarn", "LlamaForCausalLM",
         _cfg_llama(_rope("yarn", factor=4.0, original_max_position_embeddings=16)), "YaRN (attention factor)"),
    Arch("llama-llama3", "LlamaForCausalLM",
         _cfg_llama(_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16)), "Llama-3 frequency scaling"),
    Arch("llama-longrope", "LlamaForCausalLM", _cfg_llama(_rope("longrope", **_LONG)),
         "LongRoPE: short factors up to 16 tokens, long factors beyond", seq_lens=(12, SEQ_LEN)),
    Arch("mistral", "MistralForCausalLM", lambda: _llama_like("MistralConfig", sliding_window=WINDOW,
                                                               rope_parameters=_rope()),
         "sliding window in config.sliding_window only"),
    Arch("mixtral", "MixtralForCausalLM",
         lambda: _llama_like("MixtralConfig", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                             rope_parameters=_rope()), "MoE, sliding window in the config"),
    Arch("qwen2", "Qwen2ForCausalLM",
         lambda: _llama_like("Qwen2Config", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                             rope_parameters=_rope()), "q/k/v biases; sliding layer via layer_types"),
    Arch("qwen3", "Qwen3ForCausalLM", lambda: _llama_like("Qwen3Config", rope_parameters=_rope()),
         "per-head QK-norm"),
    Arch("qwen3-moe", "Qwen3MoeForCausalLM",
         lambda: _llama_like("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             rope_parameters=_rope()), "QK-norm, MoE"),
    Arch("gpt-neox-0.25", "GPTNeoXForCausalLM",
         lambda: _neox(0.25), "rotary_pct 0.25, fused qkv, parallel residual"),
    Arch("gpt-neox-1.0", "GPTNeoXForCausalLM", lambda: _neox(1.0), "rotary_pct 1.0"),
    Arch("gptj", "GPTJForCausalLM", lambda: _gptj(), "interleaved pairs, rotary_dim 8 < head_dim 16, sin/cos table"),
    Arch("phi", "PhiForCausalLM",
         lambda: _llama_like("PhiConfig", rope_parameters=_rope(partial_rotary_factor=0.5), hidden_act="gelu_new"),
         "partial rotary 0.5, dense biases"),
    Arch("phi3", "Phi3ForCausalLM",
         lambda: _llama_like("Phi3Config", sliding_window=WINDOW, original_max_position_embeddings=64,
                             rope_parameters=_rope(partial_rotary_factor=0.5)),
         "fused qkv, partial rotary 0.5, sliding window in the config"),
    Arch("phi3-longrope", "Phi3ForCausalLM",
         lambda: _llama_like("Phi3Config", original_max_position_embeddings=16,
                             rope_parameters=_rope("longrope", **{k: v[: HEAD_DIM // 2] if isinstance(v, list) else v
                                                                 for k, v in _LONG.items()})),
         "LongRoPE (Phi-3.5 / Phi-4-mini)", seq_lens=(12, SEQ_LEN)),
    Arch("olmo", "OlmoForCausalLM", lambda: _llama_like("OlmoConfig", clip_qkv=4.0, rope_parameters=_rope()),
         "non-parametric LayerNorm, clip_qkv"),
    Arch("olmo2", "Olmo2ForCausalLM", lambda: _llama_like("Olmo2Config", rope_parameters=_rope()),
         "QK-norm over the flattened heads, post-norm blocks"),
    Arch("stablelm", "StableLmForCausalLM",
         lambda: _llama_like("StableLmConfig", use_qkv_bias=True, qk_layernorm=True,
                             rope_parameters=_rope(partial_rotary_factor=0.25)),
         "partial rotary 0.25, q/k/v bias, per-head LayerNorm QK-norm"),
    Arch("gemma", "GemmaForCausalLM", lambda: _llama_like("GemmaConfig", rope_parameters=_rope()), "Gemma 1"),
    Arch("gemma2", "Gemma2ForCausalLM",
         lambda: _llama_like("Gemma2Config", sliding_window=WINDOW, attn_logit_softcapping=3.0,
                             query_pre_attn_scalar=24, rope_parameters=_rope()),
         "logit soft-cap 3, sliding/global layers, query_pre_attn_scalar"),
    Arch("gemma3", "Gemma3ForCausalLM",
         lambda: _llama_like("Gemma3TextConfig", sliding_window=WINDOW, query_pre_attn_scalar=24,
                             layer_types=["sliding_attention", "full_attention"],
                             rope_parameters={"sliding_attention": _rope(theta=1e4),
                                              "full_attention": _rope(theta=1e6)}),
         "local/global RoPE bases, QK-norm, sliding layers"),
    Arch("granite", "GraniteForCausalLM",
         lambda: _llama_like("GraniteConfig", attention_multiplier=0.3, embedding_multiplier=2.0,
                             residual_multiplier=0.5, logits_scaling=2.0, attention_bias=True, rope_parameters=_rope()),
         "attention_multiplier as the score scale"),
    Arch("gpt-oss", "GptOssForCausalLM",
         lambda: _llama_like("GptOssConfig", sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                             layer_types=["sliding_attention", "full_attention"],
                             rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=16,
                                                   beta_fast=32.0, beta_slow=1.0, truncate=False)),
         "learned per-head attention sinks, YaRN, sliding/full layers, MoE"),
    # ---- more families TransformerLens boots (added after the list)
    Arch("starcoder2", "Starcoder2ForCausalLM",
         lambda: _llama_like("Starcoder2Config", sliding_window=WINDOW, use_bias=True, rope_parameters=_rope()),
         "sliding window in the config, biases, LayerNorm"),
    Arch("qwen2-moe", "Qwen2MoeForCausalLM",
         lambda: _llama_like("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, rope_parameters=_rope()), "q/k/v bias, MoE + shared expert"),
    Arch("olmoe", "OlmoeForCausalLM",
         lambda: _llama_like("OlmoeConfig", num_experts=4, num_experts_per_tok=2, clip_qkv=4.0, rope_parameters=_rope()),
         "flattened QK-norm then clip_qkv, MoE"),
    Arch("olmo3", "Olmo3ForCausalLM",
         lambda: _llama_like("Olmo3Config", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                             rope_parameters=_rope()), "flattened QK-norm, sliding/full layers"),
    Arch("granitemoe", "GraniteMoeForCausalLM",
         lambda: _llama_like("GraniteMoeConfig", num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.3,
                             rope_parameters=_rope()), "attention_multiplier, MoE"),
    Arch("smollm3", "SmolLM3ForCausalLM",
         lambda: _llama_like("SmolLM3Config", no_rope_layers=[1, 0], rope_parameters=_rope()),
         "a layer without RoPE (NoPE)"),
    Arch("glm", "GlmForCausalLM", lambda: _llama_like("GlmConfig", rope_parameters=_rope(partial_rotary_factor=0.5)),
         "partial rotary 0.5, interleaved pairs"),
    Arch("glm4", "Glm4ForCausalLM", lambda: _llama_like("Glm4Config", rope_parameters=_rope(partial_rotary_factor=0.5)),
         "partial rotary 0.5, interleaved pairs, sandwich norms"),
    Arch("exaone4", "Exaone4ForCausalLM",
         lambda: _llama_like("Exaone4Config", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                             rope_parameters=_rope()), "QK-norm, sliding/full layers"),
    Arch("seed-oss", "SeedOssForCausalLM", lambda: _llama_like("SeedOssConfig", rope_parameters=_rope()), "q/k/v bias"),
    Arch("apertus", "ApertusForCausalLM",
         lambda: _llama_like("ApertusConfig", rope_parameters=_rope("llama3", factor=8.0, low_freq_factor=1.0,
                                                                   high_freq_factor=4.0,
                                                                   original_max_position_embeddings=16)),
         "QK-norm, xIELU, Llama-3 scaling"),
    Arch("arcee", "ArceeForCausalLM", lambda: _llama_like("ArceeConfig", rope_parameters=_rope()), "ReLU² MLP"),
    Arch("nemotron", "NemotronForCausalLM",
         lambda: _llama_like("NemotronConfig", rope_parameters=_rope(partial_rotary_factor=0.5)),
         "partial rotary 0.5, LayerNorm1p"),
    Arch("hunyuan-dense", "HunYuanDenseV1ForCausalLM",
         lambda: _llama_like("HunYuanDenseV1Config", rope_parameters=_rope()), "QK-norm after RoPE"),
    Arch("falcon", "FalconForCausalLM", lambda: _falcon(), "multi-query, parallel attention, RoPE"),
    Arch("codegen", "CodeGenForCausalLM", lambda: _codegen(), "GPT-J-style sin/cos table, fused qkv"),
    Arch("llama4", "Llama4ForCausalLM",
         lambda: _llama_like("Llama4TextConfig", intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
                             no_rope_layers=[1, 0], attention_chunk_size=8, rope_parameters=_rope()),
         "chunked attention, a NoPE layer, L2 QK-norm, MoE"),
    Arch("deepseek-v3", "DeepseekV3ForCausalLM",
         lambda: _llama_like("DeepseekV3Config", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             first_k_dense_replace=1, n_group=1, topk_group=1, rope_parameters=_rope()),
         "multi-head latent attention (RoPE on part of q/k)"),
    Arch("cohere", "CohereForCausalLM",
         lambda: _llama_like("CohereConfig", use_qk_norm=True, logit_scale=0.5, rope_parameters=_rope()),
         "interleaved pairs, per-head LayerNorm QK-norm, parallel block"),
    # ---- families a user brings that are refused by name (issue #32): each message must be true
    Arch("gemma4", "Gemma4ForCausalLM",
         lambda: _llama_like("Gemma4TextConfig", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                             vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=32,
                             rope_parameters={"sliding_attention": _rope(), "full_attention": _rope(theta=1e6)}),
         "per-layer head_dim (global layers wider), per-layer inputs"),
    Arch("gemma4-uniform", "Gemma4ForCausalLM",
         lambda: _llama_like("Gemma4TextConfig", sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                             vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, global_head_dim=HEAD_DIM,
                             rope_parameters={"sliding_attention": _rope(), "full_attention": _rope(theta=1e6)}),
         "Gemma 4 with one head_dim: per-head q_norm after the q hook"),
    Arch("falcon-h1", "FalconH1ForCausalLM",
         lambda: _llama_like("FalconH1Config", mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                             mamba_chunk_size=8, key_multiplier=0.7, rope_parameters=_rope()),
         "a key multiplier inside attention (parallel Mamba mixer)"),
    Arch("nanochat", "NanoChatForCausalLM", lambda: _llama_like("NanoChatConfig", rope_parameters=_rope()),
         "rotate_half of the opposite sign (rotation by −θ)"),
    Arch("qwen3-next", "Qwen3NextForCausalLM",
         lambda: _llama_like("Qwen3NextConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters=_rope(partial_rotary_factor=0.25)),
         "hybrid: gated DeltaNet + attention layers"),
    Arch("qwen3.5", "Qwen3_5ForCausalLM",
         lambda: _llama_like("Qwen3_5TextConfig", linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4,
                             layer_types=["linear_attention", "full_attention"],
                             rope_parameters=_rope(partial_rotary_factor=0.25)),
         "hybrid: gated DeltaNet + attention layers (M-RoPE model, text only)"),
    Arch("lfm2", "Lfm2ForCausalLM", lambda: _llama_like("Lfm2Config", full_attn_idxs=[1], rope_parameters=_rope()),
         "hybrid: short convolutions + attention layers"),
    Arch("bamba", "BambaForCausalLM",
         lambda: _llama_like("BambaConfig", attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                             mamba_chunk_size=8, rope_parameters=_rope(partial_rotary_factor=0.5)),
         "hybrid: Mamba-2 + attention layers"),
    Arch("granite-hybrid", "GraniteMoeHybridForCausalLM",
         lambda: _llama_like("GraniteMoeHybridConfig", layer_types=["mamba", "attention"], num_local_experts=4,
                             num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_chunk_size=8, position_embedding_type="rope",
                             rope_parameters=_rope()),
         "hybrid: Mamba-2 + attention layers (Granite 4)"),
    Arch("olmo-hybrid", "OlmoHybridForCausalLM",
         lambda: _llama_like("OlmoHybridConfig", linear_num_key_heads=4, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=16,
                             layer_types=["linear_attention", "full_attention"], rope_parameters=_rope()),
         "hybrid: linear attention + attention layers"),
    Arch("recurrent-gemma", "RecurrentGemmaForCausalLM",
         lambda: _llama_like("RecurrentGemmaConfig", block_types=["recurrent", "attention"], attention_window_size=8,
                             lru_width=HIDDEN, rope_parameters=_rope(partial_rotary_factor=0.5)),
         "hybrid: RG-LRU recurrent + local attention layers"),
    Arch("zamba2", "Zamba2ForCausalLM",
         lambda: _llama_like("Zamba2Config", mamba_d_state=16, n_mamba_heads=2, mamba_headdim=32,
                             attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // N_HEADS,
                             use_mem_rope=True, layers_block_type=["mamba", "hybrid"], use_mamba_kernels=False,
                             rope_parameters=_rope()),
         "hybrid: Mamba-2 + shared attention blocks with RoPE (use_mem_rope)"),
]}


def _neox(pct: float) -> Any:
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(**dict(_COMMON, hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=N_HEADS,
                                rope_parameters=_rope(theta=10000.0, partial_rotary_factor=pct)))


def _falcon() -> Any:
    from transformers import FalconConfig

    return FalconConfig(**dict(_COMMON, hidden_size=HIDDEN, num_attention_heads=N_HEADS, alibi=False,
                               new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True,
                               rope_parameters=_rope()))


def _codegen() -> Any:
    from transformers import CodeGenConfig

    return CodeGenConfig(vocab_size=VOCAB, n_positions=64, n_ctx=64, n_embd=HIDDEN, n_layer=N_LAYERS, n_head=N_HEADS,
                         rotary_dim=8, initializer_range=0.25, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         tie_word_embeddings=False)


def _gptj() -> Any:
    from transformers import GPTJConfig

    return GPTJConfig(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=N_LAYERS, n_head=N_HEADS,
                      rotary_dim=8, n_inner=None, initializer_range=0.25, bos_token_id=0, eos_token_id=1,
                      pad_token_id=2, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- folders


def _perturb(hf: torch.nn.Module, seed: int) -> None:
    """Biases, norm weights and sinks are initialised to 0/1 by HF: draw them so they matter."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 1 or "sinks" in name:
                p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.3)


def build_folder(arch: Arch, root: Path, *, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """Instantiate ``arch`` (float32, seeded), perturb it, save model (+ tokenizer) to ``root/arch.name``."""
    from transformers import AutoModelForCausalLM

    folder = Path(root) / arch.name
    if (folder / "config.json").exists() and ((folder / "tokenizer.json").exists() or not with_tokenizer):
        return folder
    cfg = arch.config()
    cfg.architectures = [arch.family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _perturb(hf, seed)
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    if with_tokenizer:
        tokenizer().save_pretrained(str(folder))
    return folder


# ----------------------------------------------------------------------------- the HF reference


@dataclass
class HFLayer:
    """What HF's eager attention of one layer saw and returned (float32 copies)."""

    query: torch.Tensor  # [batch, head, pos, d_head], rotated (after QK-norm)
    key: torch.Tensor  # [batch, kv_head, pos, d_head], rotated
    scaling: float
    softcap: float | None
    mask: torch.Tensor | None  # additive [batch, 1, q, k] as HF applied it
    weights: torch.Tensor  # post-softmax [batch, head, q, k]
    sinks: torch.Tensor | None = None
    dtype: torch.dtype = torch.float32  # the model's dtype (q/k are exact float32 copies of it)
    score_dtype: torch.dtype = torch.float32  # the dtype HF computes its logits in

    def visible(self) -> torch.Tensor:
        """``[q, k]`` bool: the entries HF's mask leaves visible (batch 0; HF masks with ``-inf`` or its
        mask dtype's most negative value)."""
        n = self.query.shape[-2]
        if self.mask is None:
            raise AssertionError("HF applied no mask in eager mode; cannot tell which entries are visible")
        m = self.mask[0, 0, :, :n]
        return m > torch.finfo(self.dtype).min / 2

    def scores_as_hf(self) -> torch.Tensor:
        """HF's own logits, rounded as HF rounds them (matmul, scaling and soft-cap in its score dtype)."""
        dt = self.score_dtype
        q, k = self.query.to(dt), self.key.to(dt)
        rep = q.shape[1] // k.shape[1]
        k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(k.shape[0], -1, *k.shape[2:])
        w = torch.matmul(q, k.transpose(-1, -2)) * self.scaling
        if self.softcap:
            w = torch.tanh(w / self.softcap) * self.softcap
        return w.double()

    def scores(self) -> torch.Tensor:
        """``scaling · q · kᵀ`` (kv heads expanded the HF way), soft-capped as HF does; float64."""
        q, k = self.query.double(), self.key.double()
        rep = q.shape[1] // k.shape[1]
        k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(k.shape[0], -1, *k.shape[2:])  # HF repeat_kv
        w = q @ k.transpose(-1, -2) * self.scaling
        if self.softcap:
            w = torch.tanh(w / self.softcap) * self.softcap
        return w


class HFRecorder:
    """Wrap the eager attention of every layer of a HF model; ``layers[i]`` after a forward."""

    def __init__(self, hf: torch.nn.Module):
        self.hf = hf
        self.layers: dict[int, HFLayer] = {}
        self.attn = {}
        for _, mod in hf.named_modules():
            if type(mod).__name__.endswith("Attention") and hasattr(mod, "layer_idx") and mod.layer_idx is not None:
                self.attn[int(mod.layer_idx)] = mod
        if not self.attn:
            raise AssertionError(f"{type(hf).__name__}: no attention modules with a layer_idx")

    def _record(self, module, query, key, mask, weights, scaling, softcap, score_dtype=None) -> None:
        sinks = getattr(module, "sinks", None)
        self.layers[int(module.layer_idx)] = HFLayer(
            query.detach().float().clone(), key.detach().float().clone(), float(scaling),
            float(softcap) if softcap else None, None if mask is None else mask.detach().float().clone(),
            weights.detach().float().clone(), None if sinks is None else sinks.detach().float().clone(),
            dtype=query.dtype if mask is None else mask.dtype, score_dtype=score_dtype or query.dtype)

    def _inline(self, m, patched) -> list:
        """Falcon: the rotated q/k from its module's ``apply_rotary_pos_emb``, the mask from the forward's
        arguments, the weights from its output (``attention_scores`` after the softmax)."""
        mod = sys.modules[type(m).__module__]
        state: dict[str, Any] = {}
        if not any(obj is mod and name == "apply_rotary_pos_emb" for obj, name, _ in patched):
            orig = mod.apply_rotary_pos_emb

            def rotary(q, k, cos, sin, *a, __orig=orig, **kw):
                out = __orig(q, k, cos, sin, *a, **kw)
                if self._current is not None:
                    self._current["qk"] = (out[0], out[1])
                return out

            patched.append((mod, "apply_rotary_pos_emb", orig))
            mod.apply_rotary_pos_emb = rotary

        def pre(module, args, kwargs):
            self._current = state
            state["mask"] = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)

        def post(module, args, kwargs, out):
            self._current = None
            q, k = state.pop("qk")
            self._record(module, q, k, state.pop("mask"), out[1], module.head_dim ** -0.5, None)

        return [m.register_forward_pre_hook(pre, with_kwargs=True), m.register_forward_hook(post, with_kwargs=True)]

    _current: dict | None = None

    @contextlib.contextmanager
    def recording(self):
        mods = {sys.modules[type(m).__module__] for m in self.attn.values()}
        patched: list[tuple[Any, str, Any]] = []
        rec = self

        for mod in mods:
            orig = getattr(mod, "eager_attention_forward", None)
            if orig is None:
                continue
            sig = inspect.signature(orig)

            def wrapped(*args, __orig=orig, __sig=sig, **kwargs):
                out = __orig(*args, **kwargs)
                b = __sig.bind(*args, **kwargs)
                b.apply_defaults()
                a = b.arguments
                extra = a.get("kwargs", {}) or {}
                scaling = a.get("scaling", extra.get("scaling"))  # TL 3.9 wraps Gemma's with **kwargs
                module, query = a["module"], a["query"]
                if scaling is None:
                    scaling = query.shape[-1] ** -0.5
                softcap = a.get("softcap", extra.get("softcap"))
                rec._record(module, query, a["key"], a.get("attention_mask"), out[1], scaling, softcap)
                return out

            patched.append((mod, "eager_attention_forward", orig))
            mod.eager_attention_forward = wrapped
        handles = []
        for m in self.attn.values():
            if type(m).__name__ in ("GPTJAttention", "CodeGenAttention") and hasattr(m, "_attn"):
                # their own _attn method (transformers <= 5.23; 5.24 moved both to eager_attention_forward)
                orig = m._attn

                def own_attn(query, key, value, attention_mask=None, __m=m, __orig=orig):
                    out = __orig(query, key, value, attention_mask)
                    rec._record(__m, query, key, attention_mask, out[1], 1.0 / float(__m.scale_attn), None,
                                score_dtype=torch.float32)  # both compute their logits in float32
                    return out

                patched.append((m, "_attn", None))
                m._attn = own_attn
            elif type(m).__name__ == "FalconAttention":  # eager attention written inline in forward
                handles += self._inline(m, patched)
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            for obj, name, orig in patched:
                if orig is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, orig)


_HF: dict[tuple[str, torch.dtype], Any] = {}


def hf_reference(folder: Path, tokens: torch.Tensor, dtype: torch.dtype) -> dict[int, HFLayer]:
    """Run the folder's model in HF with eager attention (a separate copy from the one
    ``load_model`` wrapped); the recorded layers."""
    from transformers import AutoModelForCausalLM

    key = (str(folder), dtype)
    if key not in _HF:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _HF[key] = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                            attn_implementation="eager").eval()
    hf = _HF[key]
    rec = HFRecorder(hf)
    with torch.no_grad(), rec.recording():
        hf(tokens)
    missing = sorted(set(rec.attn) - set(rec.layers))
    if missing:
        raise AssertionError(f"HF eager attention of layers {missing} was not recorded")
    return rec.layers


# ----------------------------------------------------------------------------- one cell


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Relative rotation / score and absolute pattern tolerances: the library's, by model dtype."""
    from posgen_tl.experiments.exactness import tolerances as lib_tol

    return lib_tol(dtype)


@dataclass
class Cell:
    arch: str
    backend: str
    dtype: str
    status: str  # "exact", "refused: …", "wrong: …", "error: …"
    rot_err: float | None = None
    score_err: float | None = None
    pattern_err: float | None = None
    n_compared: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "exact" or self.status.startswith("refused: ")

    def as_json(self) -> dict:
        return dict(status=self.status, rot_err=self.rot_err, score_err=self.score_err,
                    pattern_err=self.pattern_err, n_compared=self.n_compared)


def _tokens(n: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, n), generator=g)


def run_cell(arch: Arch, backend: str, dtype_name: str, root: Path) -> Cell:
    """Load ``arch`` from its folder with ``backend``/``dtype`` and compare it with HF (see the module doc)."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.io.models import ModelLoadError
    from posgen_tl.maths.rope import RopeError

    t0 = time.time()
    cell = Cell(arch.name, backend, dtype_name, "error: not run")
    try:
        _compare(arch, backend, DTYPES[dtype_name], root, cell)
    except (RopeError, CaptureError, ModelLoadError) as e:
        cell.status = f"refused: {e}"
    except AssertionError as e:
        cell.status = f"wrong: {e}"
    except Exception as e:  # noqa: BLE001 — a raw exception is a failure of the cell, recorded as such
        cell.status = f"error: {type(e).__name__}: {e}"
    cell.seconds = time.time() - t0
    return cell


_MODELS: dict[tuple[str, str, str], Any] = {}
#: load models with the library's gate open (tests of the reference itself set it; never the matrix)
UNCHECKED = False


def load(arch: Arch, backend: str, dtype: torch.dtype, root: Path):
    import posgen_tl as pg

    key = (arch.name, backend, str(dtype))
    if key not in _MODELS:
        folder = build_folder(arch, root)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[key] = pg.load_model(str(folder), dtype=dtype, backend=backend, unchecked=UNCHECKED)
    return _MODELS[key]


def _compare(arch: Arch, backend: str, dtype: torch.dtype, root: Path, cell: Cell) -> None:
    from posgen_tl.experiments.exactness import exactness_table
    from posgen_tl.hooks.capture import probe_hooks
    from posgen_tl.hooks.stream import capture_qk
    from posgen_tl.maths.rope import attention_pattern, causal_mask, rotate

    model = load(arch, backend, dtype, root)
    folder = build_folder(arch, root)
    spec, info = probe_hooks(model)
    tol = tolerances(dtype)
    rot_err = score_err = pat_err = 0.0
    n_cmp = 0
    for n in arch.seq_lens:
        toks = _tokens(n)
        ref = hf_reference(folder, toks, dtype)
        caps = capture_qk(model, toks)
        table = exactness_table(model, toks)
        if not bool((table["status"] == "passed").all()):
            bad = table[table["status"] != "passed"].iloc[0]
            raise AssertionError(f"exactness_table at n={n}: layer {bad['layer']} {bad['status']}: {bad['reason']}")
        for layer, c in caps.items():
            r = ref[layer]
            hq, hk = r.query.transpose(1, 2), r.key.transpose(1, 2)  # [b, pos, head, d]
            ref_rot = max(hq.abs().max().item(), hk.abs().max().item())
            ours_q, ours_k = rotate(c.q, c.positions, c.rope), rotate(c.k, c.positions, c.rope)
            e = max((ours_q - hq).abs().max().item(), (ours_k - hk).abs().max().item(),
                    (c.rot_q - hq).abs().max().item(), (c.rot_k - hk).abs().max().item()) / ref_rot
            rot_err = max(rot_err, e)
            if e > tol["rot"]:
                raise AssertionError(f"layer {layer} n={n}: rotation differs from HF's by {e:.3g} (relative)")
            if abs(c.rope.score_scale - r.scaling) > 1e-6 * r.scaling:
                raise AssertionError(f"layer {layer}: score scale {c.rope.score_scale} vs HF {r.scaling}")
            cap = spec.extra.get("attn_logit_softcapping")
            if (cap or None) != r.softcap:
                raise AssertionError(f"layer {layer}: soft-cap {cap} vs HF {r.softcap}")
            vis_hf = r.visible()
            vis = causal_mask(n, sliding_window=c.rope.sliding_window)
            if not torch.equal(vis, vis_hf):
                raise AssertionError(
                    f"layer {layer} n={n}: our mask (window {c.rope.sliding_window}) differs from HF's in "
                    f"{int((vis != vis_hf).sum())} entries")
            w = c.logits().double()
            if cap:
                w = torch.tanh(w / cap) * cap
            wh = r.scores()
            se = (w - wh)[..., vis].abs().max().item() / wh[..., vis].abs().max().item()
            score_err = max(score_err, se)
            if se > tol["score"]:
                raise AssertionError(f"layer {layer} n={n}: scores differ from HF's by {se:.3g} (relative)")
            sinks = (spec.extra.get("attention_sinks") or {}).get(layer)
            # the mask and sinks, isolated: our mask and sinks on HF's own (dtype-rounded) logits
            p = attention_pattern(r.scores_as_hf(), vis, sinks)
            pe = (p - r.weights.double()).abs().max().item()
            pat_err = max(pat_err, pe)
            if pe > tol["pattern"]:
                raise AssertionError(f"layer {layer} n={n}: attention pattern differs from HF's by {pe:.3g}")
            n_cmp += int(vis.sum()) * w.shape[0] * w.shape[1]
    if n_cmp < MIN_COMPARED:
        raise AssertionError(f"only {n_cmp} score entries compared")
    cell.status = "exact"
    cell.rot_err, cell.score_err, cell.pattern_err, cell.n_compared = rot_err, score_err, pat_err, n_cmp


# ----------------------------------------------------------------------------- the whole matrix


def backends() -> list[str]:
    """The backends of the installed TransformerLens: the bridge, and the HookedTransformer on 3.x."""
    from posgen_tl import compat

    return ["bridge", "hooked"] if compat.has_hooked_transformer() else ["bridge"]


def column(backend: str) -> str:
    """The table column of ``backend`` under the installed TransformerLens (e.g. ``"bridge (TL 4.3)"``)."""
    from posgen_tl import compat

    major, minor, _ = compat.tl_version_tuple()
    return f"{'HookedTransformer' if backend == 'hooked' else 'bridge'} (TL {major}.{minor})"


def run_matrix(root: Path, archs=None, dtypes=None, progress: bool = False) -> list[Cell]:
    """Every cell of the installed environment (its backends × ``archs`` × ``dtypes``)."""
    out = []
    for name in archs or ARCHS:
        for backend in backends():
            for dt in dtypes or DTYPES:
                cell = run_cell(ARCHS[name], backend, dt, root)
                if progress:
                    print(f"{name:16s} {backend:7s} {dt:9s} {cell.seconds:5.1f}s {cell.status[:100]}", flush=True)
                out.append(cell)
    return out


def merge(existing: dict | None, cells: list[Cell]) -> dict:
    """The table's JSON with this environment's columns replaced by ``cells`` (other columns kept)."""
    import transformers

    from posgen_tl import compat

    data = copy.deepcopy(existing) if existing else {}
    data["about"] = ("generated by docs/gen_architectures.py from tests/arch_matrix.py: tiny random-init "
                     "HF models loaded with posgen_tl.load_model, compared with Hugging Face's own eager attention")
    data["archs"] = {a.name: {"family": a.family, "about": a.about} for a in ARCHS.values()}
    data.setdefault("columns", {})
    for backend in {c.backend for c in cells}:
        col = column(backend)
        data["columns"][col] = {"transformer_lens": compat.tl_version(), "transformers": transformers.__version__,
                                "torch": torch.__version__.split("+")[0],
                                "cells": {}}
    for c in cells:
        data["columns"][column(c.backend)]["cells"].setdefault(c.arch, {})[c.dtype] = c.as_json()
    data["columns"] = {k: data["columns"][k] for k in sorted(data["columns"], key=_col_order)}
    return data


def _col_order(col: str) -> tuple:
    return (COLUMNS.index(col) if col in COLUMNS else len(COLUMNS), col)


def _fmt(x: float | None) -> str:
    return "—" if x is None else ("0" if x == 0 else f"{x:.1e}")


def render_markdown(data: dict) -> str:
    """The support table (summary per architecture × backend, then every cell with its errors)."""
    cols = list(data["columns"])
    lines = [
        "# Supported architectures",
        "",
        "<!-- generated by `python docs/gen_architectures.py --out docs/architectures.md --json docs/architectures.json`;",
        "     do not edit by hand: tests/integration/test_architectures.py fails when a status here is stale -->",
        "",
        "Every RoPE architecture below was built as a tiny random-init Hugging Face model (2 layers, hidden 64,",
        "GQA where the family has it, biases / norm weights / sinks perturbed, an offline byte-level tokenizer),",
        "saved to a folder and loaded the way a user would: `posgen_tl.load_model(folder, dtype=..., backend=...)`.",
        "The reference is Hugging Face's **own eager attention** of the same folder (its rotated q/k, scaling,",
        "soft-cap, mask and attention weights, recorded by wrapping its attention function), not our hooks.",
        "",
        "A cell is **exact** when, on 2 sequences of 24 tokens (LongRoPE also at 12, below its switch length):",
        "our rotation of the captured q/k and the capture's rotated q/k equal HF's rotated q/k; our logits",
        "(soft-capped) equal `scaling·q·kᵀ` of HF's tensors on every entry HF's mask leaves visible; our mask",
        "(causal + sliding window) equals HF's; our pattern (mask and learned sinks on HF's own logits) equals",
        "HF's attention weights; and `posgen_tl.exactness_table` passes on every layer — each within the",
        "tolerance of the model dtype (float32: 1e-5; bfloat16 / float16: 8·eps = 6.2e-2 / 7.8e-3; rotation and",
        "logits relative to the largest value, pattern absolute). **refused** means `load_model` or the RoPE",
        "spec raised a named error (the message is in the detail table): the library will not analyse that",
        "model rather than give a wrong number. No cell may be anything else.",
        "",
        "On every float32 cell that is not refused, the same test module also checks the hooks that rewrite",
        "attention: every layer's scores replaced by our exact RoPE logits of the stashed pre-rotation q/k give",
        "the model's own output (relative 1e-4; models whose `hook_attn_scores` are not pre-softmax logits refuse",
        "substitution by name); an `enforce` edit at α = 1 on every band makes the keys that enter RoPE equal",
        "k̄ on the rotary dimensions and leaves the rest and the queries untouched; re-positioning every token by",
        "a constant shift through the hooks changes no output while swapping two positions does; and the feature",
        "pattern covers every (layer, query head) and kv head of the spec.",
        "",
        "Environments: " + "; ".join(
            f"{c}: transformer-lens {v['transformer_lens']}, transformers {v['transformers']}, torch {v['torch']}"
            for c, v in data["columns"].items()) + ".",
        "",
        "## Summary",
        "",
        "| architecture | HF class | what it exercises | " + " | ".join(cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for name, meta in data["archs"].items():
        row = [f"`{name}`", meta["family"], meta["about"]]
        for col in cols:
            cells = data["columns"][col]["cells"].get(name, {})
            kinds = {dt: ("exact" if c["status"] == "exact" else "refused") for dt, c in cells.items()}
            if not kinds:
                row.append("not run")
            elif len(set(kinds.values())) == 1:
                k = next(iter(kinds.values()))
                row.append("**exact** (fp32, bf16, fp16)" if k == "exact" and len(kinds) == 3 else k)
            else:
                row.append("; ".join(f"{k} {dt}" for dt, k in kinds.items()))
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Every cell", "",
              "| architecture | backend | dtype | status | max rotation err (rel.) | max score err (rel.) | "
              "max pattern err | compared entries |",
              "|---|---|---|---|---|---|---|---|"]
    for name in data["archs"]:
        for col in cols:
            for dt, c in data["columns"][col]["cells"].get(name, {}).items():
                status = c["status"].replace("|", "\\|").replace("\n", " ")
                lines.append(f"| `{name}` | {col} | {dt} | {status} | {_fmt(c['rot_err'])} | {_fmt(c['score_err'])} | "
                             f"{_fmt(c['pattern_err'])} | {c['n_compared']} |")
    return "\n".join(lines) + "\n"


def readme_claim(data: dict) -> str:
    """The README's one-paragraph claim of what is supported, rendered from the table's JSON (a test
    checks the README carries exactly this text)."""
    parts = []
    for col, v in data["columns"].items():
        exact, partial, refused = [], [], []
        for name in data["archs"]:
            cells = v["cells"].get(name, {})
            ok = [dt for dt, c in cells.items() if c["status"] == "exact"]
            (exact if len(ok) == len(cells) and cells else partial if ok else refused).append(
                f"{name} ({', '.join(ok)} only)" if ok and len(ok) < len(cells) else name)
        text = f"{col}: exact on {len(exact)} of {len(data['archs'])}"
        if exact and len(exact) < len(data["archs"]):
            text += f" ({', '.join(exact)})"
        if partial:
            text += f"; exact in some dtypes: {', '.join(partial)}"
        if refused:
            text += f"; refused (named error): {', '.join(refused)}"
        parts.append(text)
    return ("Supported architectures, as measured by the architecture matrix (tiny random-init models of each "
            "family checked against Hugging Face's own eager attention in float32, bfloat16 and float16; table: "
            "docs/architectures.md): " + "; ".join(parts) + ". Any other architecture is untested: "
            "`posgen-tl check --model <folder>` exits non-zero unless every layer compared its rotation, "
            "scores, mask and pattern with the model's own.")


def load_json(path: Path) -> dict | None:
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


#: a refusal may quote measurements ("logits differ by 4.27 (max |logit| 7.97)"); the last digits of such a number move with the
#: machine's bfloat16 kernels and thread count, so two statuses agree when their words and every other number are
#: equal and each measured number agrees within this relative tolerance.
MEASURED_RTOL = 0.1
_MEASURED = re.compile(r"(\bdiffers? (?:from [^()]*? )?by |max \|\w+\| )([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


def same_status(committed: str | None, measured: str) -> bool:
    """Whether the committed table's status says what this run measured (see :data:`MEASURED_RTOL`)."""
    if committed is None:
        return False
    a, b = _MEASURED.findall(committed), _MEASURED.findall(measured)
    if _MEASURED.sub(r"\1#", committed) != _MEASURED.sub(r"\1#", measured) or len(a) != len(b):
        return False
    return all(abs(float(x) - float(y)) <= MEASURED_RTOL * max(abs(float(x)), abs(float(y))) for (_, x), (_, y) in zip(a, b))
