"""The architecture matrix (issue #23): every cell exact against Hugging Face's own eager attention or
a named refusal — in float32, bfloat16 and float16, on every backend of the installed TransformerLens —
and the committed support table (docs/architectures.json) says exactly what this run measured.

CI runs this module in both environments (TL 4.3: the bridge; TL 3.9: the bridge and the
HookedTransformer). Regenerate the table after a change: ``python docs/gen_architectures.py --out
docs/architectures.md --json docs/architectures.json`` in each environment.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import arch_matrix as am

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMITTED = am.load_json(DOCS / "architectures.json") or {"columns": {}, "archs": {}}
REGEN = "regenerate it: python docs/gen_architectures.py --out docs/architectures.md --json docs/architectures.json"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("arch-matrix")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one thread is 4× faster than two on a busy 2-core machine (no thread wake-ups)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


CELLS = [(a, b, d) for a in am.ARCHS for b in am.backends() for d in am.DTYPES]


@pytest.mark.parametrize("arch,backend,dtype", CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_exact_or_a_named_refusal_and_matches_the_table(arch, backend, dtype, root):
    cell = am.run_cell(am.ARCHS[arch], backend, dtype, root)
    assert cell.ok, f"{arch} / {backend} / {dtype}: {cell.status}"
    if cell.status == "exact":
        tol = am.tolerances(am.DTYPES[dtype])
        assert cell.n_compared >= am.MIN_COMPARED
        assert cell.rot_err <= tol["rot"] and cell.score_err <= tol["score"] and cell.pattern_err <= tol["pattern"]
    else:  # a refusal names the model and what is missing
        assert arch in cell.status, cell.status
    col = am.column(backend)
    committed = COMMITTED["columns"].get(col, {}).get("cells", {}).get(arch, {}).get(dtype, {}).get("status")
    assert committed == cell.status, (
        f"docs/architectures.json is stale for {arch} / {col} / {dtype}: committed {committed!r}, measured "
        f"{cell.status!r}; {REGEN}")


def test_table_lists_exactly_the_matrix():
    assert list(COMMITTED["archs"]) == list(am.ARCHS), REGEN
    for b in am.backends():
        col = am.column(b)
        assert col in COMMITTED["columns"], f"no column {col!r} in docs/architectures.json; {REGEN}"
        assert set(COMMITTED["columns"][col]["cells"]) == set(am.ARCHS), REGEN
    md = (DOCS / "architectures.md").read_text()
    assert md == am.render_markdown(COMMITTED), f"docs/architectures.md was not rendered from the JSON; {REGEN}"
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert am.readme_claim(COMMITTED) in readme, (
        "the README's claim of supported architectures differs from docs/architectures.json; run "
        "python docs/gen_architectures.py --json docs/architectures.json --readme README.md --render-only")


def _fresh_cell(arch: str, root) -> am.Cell:
    """One float32 bridge cell from a freshly loaded model (so a monkeypatched library is what runs)."""
    am._MODELS.clear()
    try:
        return am.run_cell(am.ARCHS[arch], "bridge", "float32", root)
    finally:
        am._MODELS.clear()


def test_the_reference_is_sensitive_to_a_wrong_window(root, monkeypatch):
    """The matrix would catch today's bug: a Mistral spec without its config-only window is 'wrong'."""
    import posgen_tl.io.spec as spec_mod

    monkeypatch.setattr(spec_mod, "_layer_window", lambda *a, **k: None)
    cell = _fresh_cell("mistral", root)
    assert not cell.ok and ("mask" in cell.status or "failed" in cell.status), cell.status


def test_the_reference_is_sensitive_to_a_wrong_kv_expansion(root, monkeypatch):
    """An expansion mapping query head h to kv head h % G (instead of h // (H/G)) fails the Llama cell
    (rope.expand_kv is what scores_from_rotated and the capture call at run time)."""
    import posgen_tl.hooks.capture as capture
    import posgen_tl.maths.rope as rope

    for mod in (rope, capture):
        monkeypatch.setattr(mod, "expand_kv", lambda k, n_heads: k[..., torch.arange(n_heads) % k.shape[-2], :])
    cell = _fresh_cell("llama", root)
    assert not cell.ok and "score" in cell.status, cell.status


def test_the_reference_is_sensitive_to_unmodelled_sinks(root, monkeypatch):
    """GPT-OSS's learned sinks change every pattern row: dropping them from our pattern fails the cell."""
    import posgen_tl.experiments.exactness as ex
    import posgen_tl.hooks.capture as capture
    from posgen_tl.maths import rope

    for mod in (ex, capture):
        monkeypatch.setattr(mod, "attention_pattern", lambda w, mask, sinks=None: rope.attention_pattern(w, mask))
    cell = _fresh_cell("gpt-oss", root)
    assert not cell.ok and "pattern" in cell.status, cell.status
