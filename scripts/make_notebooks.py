"""Write the tutorial notebooks in notebooks/ (docs/notebooks/ links to them) from the cell sources (outputs empty).

    python scripts/make_notebooks.py

They use the public API only (``import posgen_tl as pg``: top-level names and the namespaces
``pg.plot``, ``pg.stats``, ``pg.analysis``, …); tests/test_notebooks.py executes them top to
bottom with small sizes (POSGEN_NB_SMALL=1) and requires every figure to render.

Notebook 4 ("longer texts") is generated when ``notebook_cells.length_nb(md, code, SETUP)``
exists.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "notebooks"

SETUP = '''import os
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
attention logits into a **positional** and a **semantic** term (docs/method.md §2) — beside the same
head of a randomly initialised twin, because a number only means something beside its twin."""),
        code(SETUP),
        md("## Load the model and read its RoPE from the model itself"),
        code('''model = pg.load_model("smollm2-135m")        # a TransformerBridge; weights cached after the first load
spec, hooks = pg.probe_hooks(model)
print(spec.n_layers, "layers,", spec.n_heads, "query heads,", spec.n_kv_heads, "kv heads, d_head", spec.d_head)
print("hooks:", hooks)
pg.rope_spec(model).describe()[0]'''),
        md("""`bridge.cfg.rotary_base` says 10000, but the model really uses 100000 — posgen_tl reads the
frequencies from the HF rotary module instead (`theta_fastest`, `theta_slowest` above)."""),
        code('''tokens = pg.corpus_tokens(model, seq_len=64 if SMALL else 256, n_seq=2)   # pydoc prose from the stdlib
print(tokens.shape, repr(model.tokenizer.decode(tokens[0, :20])))
pg.exactness_table(model, tokens, layers=[0, 15, 29])'''),
        md("""Errors are 0: rotating `hook_q` with our spec reproduces `hook_rot_q` bit for bit, and
`s · rot_q · rot_k` reproduces the model's own `hook_attn_scores`."""),
        md("""## One head, decomposed — two lines
`decompose_head` captures the layer, splits the logits `W = f + g + remainder` with the head's mean
pre-rotation key k̄ (here each sequence's own, first token excluded), fits D1's `a[i−j] + b[i] + c[j]`,
and scores both; `pg.plot.head_maps` draws the result (the paper's Figure-1 view)."""),
        code('''res = pg.decompose_head(model, tokens, layer=15, head=3)
pg.plot.head_maps(res)'''),
        code('''res.scores   # one row per sequence × estimator; r_within removes each row's mean (softmax ignores it)'''),
        md("""## The same head of the random twin
Same architecture, fresh weights (`pg.random_twin`). Its D1 fit is about as good — a free additive fit
fits almost anything — so only the *difference* to the twin says something about training:"""),
        code('''twin = pg.random_twin(model, seed=0)
twin_res = pg.decompose_head(twin, tokens, layer=15, head=3)
pg.plot.head_maps(twin_res)'''),
        md("""## Which k̄? (docs/method.md §2)
With each sequence's own k̄ the random twin fits D3 well too: random keys carry a large per-text
constant. One **global** k̄ from *other* documents separates them: the trained head has one
text-independent positional kernel. `pg.io.sampling.sample_windows` draws the reference from documents
disjoint from the analysed ones — the same windows every experiment uses."""),
        code('''windows, ref = pg.io.sampling.sample_windows(model, seq_len=tokens.shape[1], n_seq=2, n_ref=2)
analysed = windows.tokens
rows = []
for label, m in (("trained", model), ("random", twin)):
    for kind in ("per_sequence", "global"):
        r = pg.decompose_head(m, analysed, layer=15, head=3, k_mean=kind, reference=ref.tokens)
        rows.append(r.scores.assign(twin=label))
import pandas as pd
pd.concat(rows).query("estimator == 'D3'").groupby(["twin", "k_mean"])[["r", "r_within"]].mean().round(3)'''),
        md("""## The bound, checked
`|W − f − g|` never exceeds `s·Σ_m ‖q^(m)‖‖k^(m) − k̄^(m)‖·2|sin(Δθ_m/2)|` — an identity of the
algebra: that it holds proves the code consistent, not a fact about the model."""),
        code('''cap = pg.capture_qk(model, tokens[:1], layers=[15])[15]
k_bar = cap.k[0, 1:].mean(dim=0)                      # the per-sequence k̄ decompose_head used
bound = pg.maths.decompose.d3_bound(cap.q, cap.k, k_bar, cap.positions, cap.rope)[0, 3]
err = res.remainder.abs()
print("bound holds on every visible entry:", bool((err <= bound + 1e-9)[res.mask].all()),
      "| mean error", float(err[res.mask].mean()), "| mean bound", float(bound[res.mask].mean()))'''),
        md("""Next: notebook 2 measures *why* the split works (the feature pattern in the RoPE planes) for
every head, again beside the random twin."""),
    ]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import notebook_cells as cells  # noqa: PLC0415

    books = {
        "01_quickstart.ipynb": quickstart(),
        "02_feature_pattern.ipynb": cells.feature_pattern_nb(md, code, SETUP),
        "03_patching_tolerance.ipynb": cells.patching_nb(md, code, SETUP),
    }
    length_nb = getattr(cells, "length_nb", None)  # notebook 4, "longer texts", when it is supplied
    if length_nb is not None:
        books["04_longer_texts.ipynb"] = length_nb(md, code, SETUP)
    books["05_patching_positions.ipynb"] = cells.positions_patching_nb(md, code, SETUP)
    HERE.mkdir(exist_ok=True)
    for name, cells_ in books.items():
        nb = nbf.v4.new_notebook()
        nb.cells = cells_
        for i, c in enumerate(nb.cells):  # stable ids: a regeneration changes only what changed
            c["id"] = hashlib.sha1(f"{name}:{i}:{c['source']}".encode()).hexdigest()[:8]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbf.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
