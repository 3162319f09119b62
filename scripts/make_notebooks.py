"""Write the tutorial notebooks in notebooks/ from the cell sources below (outputs empty).

    python scripts/make_notebooks.py

They use the public API only; tests/test_notebooks.py executes them top to bottom with
small sizes (POSGEN_NB_SMALL=1).
"""

from __future__ import annotations

from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).resolve().parent.parent / "notebooks"

SETUP = '''import os
import matplotlib
import torch
import posgen_tl as pg
torch.set_num_threads(2)
SMALL = os.environ.get("POSGEN_NB_SMALL") == "1"   # CI runs the notebooks with small sizes'''


def md(s: str):
    return nbf.v4.new_markdown_cell(s.strip())


def code(s: str):
    return nbf.v4.new_code_cell(s.strip())


def quickstart():
    return [
        md("""
# 1 · Quickstart: rotated q/k from TransformerLens hooks, one head decomposed

This notebook loads the default model (SmolLM2-135M, shipped offline in a PyPI package),
checks that posgen_tl reads its rotated queries and keys *exactly*, and splits one head's
attention logits into a **positional** and a **semantic** term (METHOD.md §2)."""),
        code(SETUP),
        md("## Load the model and read its RoPE from the model itself"),
        code('''model = pg.load_model("smollm2-135m")        # a TransformerBridge; weights cached after the first load
spec, hooks = pg.probe_hooks(model)
print(spec.n_layers, "layers,", spec.n_heads, "query heads,", spec.n_kv_heads, "kv heads, d_head", spec.d_head)
print("hooks:", hooks)
pg.rope_spec(model).describe()[0]'''),
        md("""`bridge.cfg.rotary_base` says 10000, but the model really uses 100000 — posgen_tl reads the
frequencies from the HF rotary module instead (`theta_fastest`, `theta_slowest` above)."""),
        code('''tokens = pg.corpus_tokens(model, None, seq_len=64 if SMALL else 256, n_seq=2)   # pydoc prose from the stdlib
print(tokens.shape, repr(model.tokenizer.decode(tokens[0, :20])))
pg.exactness_table(model, tokens, layers=[0, 15, 29])'''),
        md("""Errors are 0: rotating `hook_q` with our spec reproduces `hook_rot_q` bit for bit, and
`s · rot_q · rot_k` reproduces the model's own `hook_attn_scores`."""),
        md("## Capture one layer and split a head"),
        code('''layer, head = 15, 3
cap = pg.capture_qk(model, tokens, layers=[layer])[layer]
# the head's mean pre-rotation key k̄ (sink token 0 excluded), from the same batch for this demo
k_mean = cap.k[:, 1:].mean(dim=(0, 1))                      # [kv_head, d_head]
d3 = pg.d3_split(cap.q, cap.k_expanded(), k_mean.repeat_interleave(spec.n_heads // spec.n_kv_heads, 0),
                 cap.positions, cap.rope)
n = tokens.shape[1]
mask = pg.causal_mask(n, sink=1)
W, f, g = d3.W[0, head], d3.f[0, head], d3.g[0, head]
pg.score_maps(W, f + g, mask)'''),
        code('''fit = pg.fit_additive(W, mask, three_axis=True)   # D1: a[i−j] + b[i] + c[j]
{"D1": {k: float(v) for k, v in pg.score_maps(W, fit.fitted, mask).items()},
 "D3": {k: float(v) for k, v in pg.score_maps(W, f + g, mask).items()}}'''),
        md("""`r_within` removes each row's mean from both sides first: softmax ignores row constants, so
it is the honest score. Now the maps side by side (the paper's Figure-1 view):"""),
        code('''import matplotlib.pyplot as plt
fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
for ax, (name, m) in zip(axes, [("logits W", W), ("positional f", f), ("semantic g", g), ("residual W−f−g", W - f - g)]):
    x = m.clone(); x[~pg.causal_mask(n)] = float("nan")
    im = ax.imshow(x.numpy(), cmap="RdBu_r"); ax.set_title(name); fig.colorbar(im, ax=ax, shrink=0.7)
fig.tight_layout()'''),
        md("""## The bound, checked
`|W − f − g|` never exceeds `s·Σ_m ‖q^(m)‖‖k^(m) − k̄^(m)‖·2|sin(Δθ_m/2)|`:"""),
        code('''bound = pg.d3_bound(cap.q, cap.k_expanded(), k_mean.repeat_interleave(3, 0), cap.positions, cap.rope)[0, head]
err = (W - f - g).abs()
print("bound holds everywhere:", bool((err <= bound + 1e-9).all()), "| mean error", float(err[mask].mean()), "| mean bound", float(bound[mask].mean()))'''),
        md("""Next: notebook 2 measures *why* the split works (the feature pattern in the RoPE planes) and
compares everything with a randomly initialised twin of the same model."""),
    ]


def main() -> None:
    HERE.mkdir(exist_ok=True)
    books = {"01_quickstart.ipynb": quickstart()}
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from notebook_cells import feature_pattern_nb, patching_nb  # noqa: PLC0415

    books["02_feature_pattern.ipynb"] = feature_pattern_nb(md, code, SETUP)
    books["03_patching_tolerance.ipynb"] = patching_nb(md, code, SETUP)
    for name, cells in books.items():
        nb = nbf.v4.new_notebook()
        nb.cells = cells
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbf.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
