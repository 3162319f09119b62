"""Random-init models of real shapes, for timing on a machine the real weights cannot reach (a lent GPU).

    from random_shapes import build
    model = build("smollm2-135m", device="cuda")                 # float32, SmolLM2-135M's exact configuration
    model = build("llama3-8b", device="cuda", dtype=torch.bfloat16)  # Llama-3-8B's configuration (rope scaling too)

In the suite: ``python benchmarks/suite.py --models random:smollm2-135m --device cuda``. A model name ``random:<shape>``
(optionally ``random:<shape>@<max positions>``, e.g. ``random:smollm2-135m@16384`` for a longer context) is built
here instead of loaded. The weights are Hugging Face's own initialisation (seed 0) of the architecture, booted into a
TransformerLens bridge by :func:`posgen_tl.load_model` as a loaded model is; timing and memory depend on the
shapes, not on the values. The tokenizer is SmolLM2's, read from the folder ``$POSGEN_TOKENIZER`` (default: the
package's weight cache of ``smollm2-135m``), and only tokenizes the corpus: token ids stay below every shape's vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: Hugging Face configurations of the real models (numbers from their published config.json files)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
}


def tokenizer_folder() -> Path:
    env = os.environ.get("POSGEN_TOKENIZER")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("posgen_tl")) / "models" / "smollm2-135m"


def parse(name: str) -> tuple[str, int | None]:
    """``random:<shape>[@<max positions>]`` → ``(shape, max_positions or None)``."""
    body = name.split(":", 1)[1]
    shape, _, ctx = body.partition("@")
    if shape not in SHAPES:
        raise SystemExit(f"{name!r}: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    return shape, int(ctx) if ctx else None


def build(name: str, device: str = "cpu", dtype: Any = None, seed: int = 0) -> Any:
    """The random-init bridge of shape ``name`` (``smollm2-135m``, ``llama3-8b``, or ``random:…``) on ``device``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from posgen_tl import load_model

    shape, ctx = parse(name if name.startswith("random:") else f"random:{name}")
    dtype = dtype or torch.float32
    cfg = LlamaConfig(**dict(SHAPES[shape], **({"max_position_embeddings": ctx} if ctx else {})))
    cfg.architectures = ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder()))
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # initialised where it runs: an 8B model never crosses the host
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    hf.config.name_or_path = f"{shape}-random-init"
    return load_model(hf, tokenizer=tok, device=device)
