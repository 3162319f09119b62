"""Tiny random RoPE models (no download) covering the layouts and variants we claim."""

from __future__ import annotations

import numpy as np
import torch
import transformer_lens.model_bridge.sources.native  # noqa: F401  (registers boot_native)
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge


def native(rotary_dim: int = 6, n_heads: int = 4, n_kv: int = 2, d_head: int = 8, n_layers: int = 2,
           n_ctx: int = 64, seed: int = 0, positional: str = "rotary", rope_scaling=None):
    """TransformerLens-native bridge: adjacent pairs, GQA, partial rotary; hook_rot_* do not fire
    and hook_attn_scores holds post-softmax weights there (the fallback paths)."""
    cfg = TransformerBridgeConfig(
        d_model=n_heads * d_head, d_head=d_head, n_heads=n_heads, n_key_value_heads=n_kv,
        n_layers=n_layers, n_ctx=n_ctx, d_vocab=50, positional_embedding_type=positional,
        rotary_dim=rotary_dim if positional == "rotary" else None, normalization_type="RMS",
        d_mlp=4 * n_heads * d_head, act_fn="silu", seed=seed, gated_mlp=True,
    )
    if rope_scaling is not None:
        cfg.rope_scaling = rope_scaling
    return TransformerBridge.boot_native(cfg)


def hf_llama(n_heads: int = 4, n_kv: int = 2, head_dim: int = 16, n_layers: int = 2, rope=None, seed: int = 0):
    """A tiny HF Llama (half-split pairs, GQA) booted through boot_transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = rope or {"rope_theta": 1000.0, "rope_type": "default"}
    cfg = LlamaConfig(
        hidden_size=n_heads * head_dim, num_attention_heads=n_heads, num_key_value_heads=n_kv,
        head_dim=head_dim, num_hidden_layers=n_layers, intermediate_size=64, vocab_size=100,
        max_position_embeddings=128, rope_parameters=rope,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    return _boot(hf), hf


def hf_gemma3(seed: int = 0):
    """A tiny HF Gemma3 text model: local (window 4, base 1e4) and global (base 1e6) layers, QK-norm."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
        intermediate_size=64, vocab_size=100, max_position_embeddings=128, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    hf = Gemma3ForCausalLM(cfg).eval()
    # random init leaves the QK-norm weights at 0 (≡ 1 in Gemma's offset form): make them non-trivial
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.normal_(0, 0.5)
            layer.self_attn.k_norm.weight.normal_(0, 0.5)
    return _boot(hf), hf


#: per vocabulary size, the folder this process saved its tiny tokenizer in (removed when the process exits)
_TOKENIZER_DIRS: dict[int, str] = {}


def _tokenizer_dir(vocab_size: int) -> str:
    """The folder holding the tiny tokenizer of ``vocab_size`` words, written once per process."""
    if vocab_size not in _TOKENIZER_DIRS:
        import atexit
        import shutil
        import tempfile

        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({f"t{i}": i for i in range(3, vocab_size)})
        tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                       pad_token="</s>")
        folder = tempfile.mkdtemp(prefix="posgen-tiny-tok-")
        atexit.register(shutil.rmtree, folder, True)
        fast.save_pretrained(folder)
        _TOKENIZER_DIRS[vocab_size] = folder
    return _TOKENIZER_DIRS[vocab_size]


def tiny_tokenizer(vocab_size: int = 100):
    """An offline word-level tokenizer: tokens 't0'..'t{n}', whitespace split, BOS id 1 — a fresh object each call,
    loaded from one folder per vocabulary size and process (TransformerLens re-loads a tokenizer from its
    name_or_path, so it must be a real folder; it is removed when the process exits)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_dir(vocab_size))


def _boot(hf):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = TransformerBridge.boot_transformers("tiny", hf_model=hf, tokenizer=tiny_tokenizer(), device="cpu")
    return b.eval()


def hooked(seed: int = 0, randomize_norms: bool = True, cls=None, **overrides):
    """A tiny TransformerLens 3.x ``HookedTransformer`` from a ``HookedTransformerConfig`` (TL 3.x only).

    Defaults: half-split RoPE, 2 layers, 4 heads of 8 dims, RMS norm, gated SiLU MLP; ``overrides``
    go to the config (``rotary_adjacent_pairs``, ``n_key_value_heads``, ``rotary_dim``,
    ``use_qk_norm``, ``attn_types``/``window_size``/``rotary_base_local``, NTK-by-parts, YaRN, ...).
    With QK-norm the norm weights are drawn around 1 (random init leaves them at exactly 1).
    ``cls`` builds a subclass instead (e.g. SAELens' ``HookedSAETransformer``).
    """
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    base = dict(
        d_model=32, d_head=8, n_heads=4, n_layers=2, n_ctx=64, d_vocab=50, act_fn="silu",
        normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8, gated_mlp=True,
        d_mlp=64, seed=seed,
    )
    base.update(overrides)
    torch.manual_seed(seed)
    model = (cls or HookedTransformer)(HookedTransformerConfig(**base)).eval()
    if randomize_norms and model.cfg.use_qk_norm:
        with torch.no_grad():
            for blk in model.blocks:
                blk.attn.q_norm.w.normal_(1.0, 0.5)
                blk.attn.k_norm.w.normal_(1.0, 0.5)
    return model


def token_corpus(n_docs: int = 14, seed: int = 0) -> list[str]:
    """``n_docs`` documents of 40–89 random words ``t3`` … ``t98`` (in a tiny tokenizer's vocabulary), seeded."""
    g = np.random.default_rng(seed)
    return [" ".join(f"t{int(x)}" for x in g.integers(3, 99, int(g.integers(40, 90)))) for _ in range(n_docs)]


def sharpened(model, q: float = 8.0, unembed: float = 10.0):
    """``model`` with W_Q × ``q`` and the unembedding × ``unembed`` (in place; returned): sharp attention and an output
    that is not uniform — a random init barely uses positions, and a corruption must do measurable damage for a
    check to compare anything."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("q_proj" in name or name.endswith("W_Q")) and "bias" not in name:
                p.mul_(q)
            if "lm_head" in name or name.endswith("W_U"):
                p.mul_(unembed)
    return model
