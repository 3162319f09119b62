"""The tutorial notebooks run top to bottom on the default model (small sizes, POSGEN_NB_SMALL=1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("*.ipynb"))

pytestmark = [pytest.mark.real, pytest.mark.slow]


def test_three_notebooks_exist():
    assert NOTEBOOKS == ["01_quickstart.ipynb", "02_feature_pattern.ipynb", "03_patching_tolerance.ipynb"]


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


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, smollm2, kernel_name, monkeypatch):
    # smollm2 fixture: the weight cache is built once before the kernels start
    monkeypatch.setenv("POSGEN_NB_SMALL", "1")
    nb = nbformat.read(NB_DIR / name, as_version=4)
    client = NotebookClient(nb, timeout=900, kernel_name=kernel_name, resources={"metadata": {"path": str(NB_DIR)}})
    client.execute()  # raises CellExecutionError on any failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # every notebook produces at least one figure or table the reader can see
    rich = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.output_type in ("display_data", "execute_result")]
    assert len(rich) >= 2, name
