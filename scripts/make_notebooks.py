"""Write the tutorial notebooks in notebooks/ (docs/notebooks/ links to them) from the cell sources.

    python scripts/make_notebooks.py            # write the sources (a notebook whose sources did not change keeps
                                                # its outputs)
    python scripts/make_notebooks.py --execute  # and run each one top to bottom, keeping its outputs (at the small
                                                # sizes with --small: POSGEN_NB_SMALL=1, as CI runs them)
    python scripts/make_notebooks.py --check    # exit 1 if a committed notebook's sources differ from these, or it
                                                # was not executed (the docs show the committed outputs)

Executed notebooks keep what a reader sees (results, tables, figures, printed text); the kernel's stderr (progress
bars, warnings) is dropped, and an output that names a path on this machine is an error.

They use the public API only (``import posgen_tl as pg``: top-level names and the namespaces
``pg.plot``, ``pg.stats``, ``pg.analysis``, …); tests/test_notebooks.py executes them top to
bottom with small sizes (POSGEN_NB_SMALL=1) and requires every figure to render.

Notebook 4 ("longer texts") is generated when ``notebook_cells.length_nb(md, code, SETUP)``
exists.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import nbformat as nbf

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "notebooks"

SETUP = '''import os
import torch
import posgen_tl as pg
torch.set_num_threads(2)
SMALL = os.environ.get("POSGEN_NB_SMALL") == "1"   # the small sizes of CI and of the committed outputs'''


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


def books() -> dict[str, list]:
    """``{file name: cells}`` of every tutorial notebook."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import notebook_cells as cells  # noqa: PLC0415

    out = {
        "01_quickstart.ipynb": quickstart(),
        "02_feature_pattern.ipynb": cells.feature_pattern_nb(md, code, SETUP),
        "03_patching_tolerance.ipynb": cells.patching_nb(md, code, SETUP),
    }
    length_nb = getattr(cells, "length_nb", None)  # notebook 4, "longer texts", when it is supplied
    if length_nb is not None:
        out["04_longer_texts.ipynb"] = length_nb(md, code, SETUP)
    out["05_patching_positions.ipynb"] = cells.positions_patching_nb(md, code, SETUP)
    return out


def build(name: str, cells_: list):
    """The notebook ``name`` with ``cells_`` (stable cell ids: a regeneration changes only what changed)."""
    nb = nbf.v4.new_notebook()
    nb.cells = cells_
    for i, c in enumerate(nb.cells):
        c["id"] = hashlib.sha1(f"{name}:{i}:{c['source']}".encode()).hexdigest()[:8]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


#: text in an output that would publish this machine's layout
MACHINE = re.compile(r"(/work/|/root/|/tmp/|/home/|site-packages)")


def execute(nb, name: str, small: bool = False):
    """Run ``nb`` top to bottom in a kernel of this interpreter (full sizes, or with ``small`` the CI sizes:
    POSGEN_NB_SMALL=1), drop the kernel's stderr, record the sizes in the notebook's metadata and return it.
    Raises RuntimeError when an output names a path on this machine."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    from nbclient import NotebookClient  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as root:
        spec = Path(root) / "kernels" / "posgen-nb"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "posgen-nb", "language": "python"}))
        env = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "PYTHONPATH", "POSGEN_NB_SMALL")}
        os.environ["JUPYTER_PATH"] = root
        os.environ["PYTHONPATH"] = str(ROOT)
        if small:
            os.environ["POSGEN_NB_SMALL"] = "1"
        else:
            os.environ.pop("POSGEN_NB_SMALL", None)
        try:
            NotebookClient(nb, timeout=3600, kernel_name="posgen-nb",
                           resources={"metadata": {"path": str(HERE)}}).execute()
        finally:
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.pop("widgets", None)
    nb.metadata["posgen_tl"] = {"executed_sizes": "small (POSGEN_NB_SMALL=1)" if small else "full"}
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        c.outputs = [o for o in c.outputs if not (o.output_type == "stream" and o.get("name") == "stderr")]
        c.metadata.pop("execution", None)
        for o in c.outputs:
            text = o.get("text", "") + "".join(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
            if MACHINE.search(text):
                raise RuntimeError(f"{name}: an output names a path on this machine: {MACHINE.search(text).group(0)!r} "
                                   f"in {text[:200]!r}")
    return nb


def stale() -> list[str]:
    """What is wrong with the committed notebooks: sources that differ from :func:`books`, code cells never
    executed (no execution count)."""
    out = []
    for name, cells_ in books().items():
        path = HERE / name
        if not path.exists():
            out.append(f"{name}: missing")
            continue
        old = nbf.read(path, as_version=4)
        if _sources(old) != _sources(build(name, cells_)):
            out.append(f"{name}: its cells differ from scripts/make_notebooks.py (run it with --execute)")
        elif any(c.cell_type == "code" and c.get("execution_count") is None for c in old.cells):
            out.append(f"{name}: not executed (python scripts/make_notebooks.py --execute)")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--check" in args:
        bad = stale()
        for b in bad:
            print(b)
        return 1 if bad else 0
    HERE.mkdir(exist_ok=True)
    only = [a for a in args if not a.startswith("--")]
    for name, cells_ in books().items():
        if only and not any(o in name for o in only):
            continue
        nb = build(name, cells_)
        path = HERE / name
        if "--execute" in args:
            nb = execute(nb, name, small="--small" in args)
        elif path.exists() and _sources(nbf.read(path, as_version=4)) == _sources(nb):
            print("unchanged", path)
            continue
        nbf.write(nb, path)
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
