"""The tutorial notebooks run top to bottom on the default model (small sizes, POSGEN_NB_SMALL=1),
and every figure a reader is meant to see renders — exactly once — as an image/png output."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))


def test_the_tutorial_notebooks_exist():
    assert NOTEBOOKS[:3] == ["01_quickstart.ipynb", "02_feature_pattern.ipynb", "03_patching_tolerance.ipynb"]


def _ends_in_plot(source: str) -> bool:
    """The cell's last statement is an expression calling ``pg.plot.<name>(...)`` (its value is the figure)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return False
    f = body[-1].value.func
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) and f.value.attr == "plot"


def _pngs(cell) -> list[str]:
    """The image/png payloads a reader sees in a cell (a text/plain "<Figure size …>" is not one)."""
    return [o["data"]["image/png"] for o in cell.get("outputs", [])
            if o["output_type"] in ("display_data", "execute_result") and "image/png" in o.get("data", {})]


def test_plot_cell_detection():
    assert _ends_in_plot("res = pg.decompose_head(model, tokens, layer=15, head=3)\npg.plot.head_maps(res)")
    assert _ends_in_plot("pg.plot.band_heatmaps(\n    pat.bands,\n    which='k')")
    assert not _ends_in_plot("fig = pg.plot.head_maps(res)") and not _ends_in_plot("res.scores")
    shown = {"outputs": [{"output_type": "execute_result", "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}}]}
    assert _pngs(shown) == []  # the repr of a figure is not a figure


def test_notebooks_use_the_public_api_only():
    import posgen_tl as pg

    for name in NOTEBOOKS:
        nb = nbformat.read(NB_DIR / name, as_version=4)
        src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "from posgen_tl." not in src and "import posgen_tl." not in src, name
        for node in ast.walk(ast.parse(src)):  # pg.<name>: a top-level name or a namespace, nothing private
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pg":
                assert not node.attr.startswith("_") and node.attr in dir(pg), (name, node.attr)
    quick = nbformat.read(NB_DIR / "01_quickstart.ipynb", as_version=4)
    two = [c.source for c in quick.cells if c.cell_type == "code" and "pg.decompose_head(model, tokens" in c.source]
    assert two and two[0].strip().count("\n") == 1 and _ends_in_plot(two[0])  # decompose + show in two lines


def test_committed_notebooks_are_current_and_executed():
    """The notebooks in the repository are the generator's cells, executed at full size (their outputs are what
    the docs show): a changed cell or a never-run notebook is stale."""
    sys.path.insert(0, str(NB_DIR.parent / "scripts"))
    import make_notebooks

    assert make_notebooks.stale() == []
    for name in NOTEBOOKS:
        nb = nbformat.read(NB_DIR / name, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert sum(len(_pngs(c)) for c in code) >= 1, f"{name}: no figure in the committed outputs"
        for c in code:
            for o in c.get("outputs", []):
                text = o.get("text", "") + "".join(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
                assert not make_notebooks.MACHINE.search(text), f"{name}: an output names a machine path"
                assert o.get("name") != "stderr", f"{name}: a stderr stream (progress bar, warning) was kept"


def test_stale_notebooks_are_found(tmp_path, monkeypatch):
    sys.path.insert(0, str(NB_DIR.parent / "scripts"))
    import make_notebooks

    monkeypatch.setattr(make_notebooks, "HERE", tmp_path)
    assert all(x.endswith("missing") for x in make_notebooks.stale())
    assert make_notebooks.main([]) == 0  # the sources, never executed
    assert all("not executed" in x for x in make_notebooks.stale())
    nb = nbformat.read(tmp_path / NOTEBOOKS[0], as_version=4)
    nb.cells[1].source += "\n# edited by hand"
    nbformat.write(nb, tmp_path / NOTEBOOKS[0])
    assert "its cells differ" in make_notebooks.stale()[0]


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec for *this* interpreter (not whatever 'python3' resolves to on the machine)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "posgen-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "posgen-test", "language": "python"}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(root) + (os.pathsep + old if old else "")
    yield "posgen-test"
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_and_shows_its_figures(name, smollm2, kernel_name, monkeypatch):
    # smollm2 fixture: the weight cache is built once before the kernels start
    monkeypatch.setenv("POSGEN_NB_SMALL", "1")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's own default (inline), as for a user
    old = os.environ.get("PYTHONPATH")  # the kernel imports THIS checkout's posgen_tl, not another install
    monkeypatch.setenv("PYTHONPATH", str(NB_DIR.parent) + (os.pathsep + old if old else ""))
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name=kernel_name, resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()  # raises CellExecutionError on any failing cell
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not [o for c in code for o in c.get("outputs", []) if o.output_type == "error"]
    streams = "".join(o.get("text", "") for c in code for o in c.get("outputs", []) if o.output_type == "stream")
    assert "IProgress not found" not in streams and "TqdmWarning" not in streams, f"{name}: tqdm warns a reader"
    assert sum(len(_pngs(c)) for c in code) >= 1, f"{name}: no figure rendered"
    for i, c in enumerate(code):
        pngs = _pngs(c)
        assert len(pngs) == len(set(pngs)), f"{name} cell {i}: a figure is shown twice"
        if _ends_in_plot(c.source):
            assert len(pngs) == 1, f"{name} cell {i} ends in a plot call but shows {len(pngs)} figures:\n{c.source}"
