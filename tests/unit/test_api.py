"""The public surface: a small top level, namespaces that resolve, no import cycles."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import posgen_tl as pg

PKG = Path(pg.__file__).parent
MODULES = sorted(  # every module file of the package, subpackages included
    ".".join(("posgen_tl", *f.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__")
    for f in PKG.rglob("*.py")
)


def test_top_level_is_small_and_resolves():
    assert len(pg.__all__) <= 30, pg.__all__
    assert len(set(pg.__all__)) == len(pg.__all__)
    for name in pg.__all__:
        assert getattr(pg, name) is not None, name
    for ns in ("io", "hooks", "maths", "stats", "experiments", "patching", "plot", "report", "compat"):
        assert getattr(pg, ns).__name__ == f"posgen_tl.{ns}"
    assert pg.plot.head_maps.__module__ == "posgen_tl.plot.decomposition"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pg.nope  # noqa: B018


def test_recipes_resolve_lazily():
    for name in ("causal_study", "sufficiency", "gap_probe"):
        assert callable(getattr(pg, name))
    assert pg.run.__module__ == "posgen_tl.experiments.registry" and "run" in pg.__all__  # the one door


def test_import_is_light():
    code = "import sys, posgen_tl; print(sorted(m for m in ('torch', 'transformer_lens', 'matplotlib', 'pandas') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=PKG.parent)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.strip() == "[]"


def test_rope_spec_is_the_function_after_its_module_is_imported():
    code = ("import posgen_tl as pg, posgen_tl.hooks.capture; from posgen_tl.io.spec import rope_spec; "
            "assert callable(pg.rope_spec) and pg.rope_spec is rope_spec; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-800:]


def test_nested_namespaces_resolve_in_a_fresh_interpreter():
    code = ("import posgen_tl as pg; pg.experiments.head_maps.decompose_head; pg.experiments.pattern.link_to_decomposition; "
            "pg.stats.curves.curve_summary; pg.io.sampling.sample_windows; pg.stats.dose_verdict; "
            "pg.hooks.edits.noop_hooks; pg.maths.decompose.d3_bound; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=PKG.parent)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-800:]


def test_one_mask_and_one_key_mean():
    from posgen_tl.experiments import decomposition, exactness
    from posgen_tl.hooks import edits
    from posgen_tl.maths import decompose, rope, taxonomy

    assert decompose.causal_mask is rope.causal_mask
    assert getattr(taxonomy, "causal_mask", rope.causal_mask) is rope.causal_mask  # no mask of its own
    assert not hasattr(exactness, "valid_mask")
    assert edits.key_means.func is edits.feature_means
    assert decomposition.reference_key_means is edits.reference_key_means  # one definition, importable from both
    assert "feature_means(" in inspect.getsource(edits.reference_key_means)  # and it delegates


#: one interpreter loads the heavy third-party libraries once, then each module is imported in a fork of it that has
#: no posgen_tl module yet — an import cycle or a hidden order dependence inside the package fails exactly as in a
#: fresh interpreter, at a fraction of a second per module instead of a torch import each
_FORK_IMPORTS = r"""
import importlib, json, os, sys, traceback
for lib in ("numpy", "pandas", "scipy.stats", "torch", "einops", "jaxtyping", "tqdm", "matplotlib", "transformers",
            "transformer_lens"):
    importlib.import_module(lib)
assert not [m for m in sys.modules if m.split(".")[0] == "posgen_tl"], "posgen_tl imported before the forks"
out = {}
for mod in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(mod)
            msg = ""
        except BaseException:
            msg = traceback.format_exc()[-800:] or "failed"
        os.write(w, msg.encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    out[mod] = b"".join(chunks).decode() or ("" if status == 0 else f"exit status {status}")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, str]:
    """``{module: ""}`` for each module that imports alone, else the traceback's tail."""
    import json

    out = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, json.dumps(MODULES)], capture_output=True, text=True,
                         timeout=600, cwd=PKG.parent)
    assert out.returncode == 0, out.stderr[-1500:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_alone(module, imported_alone):
    """An interpreter importing just this module (a fork with no posgen_tl module loaded): an import cycle or a
    hidden order dependence fails here."""
    assert imported_alone[module] == "", f"{module}: {imported_alone[module]}"


def test_a_module_that_cannot_import_alone_is_caught(tmp_path):
    """The forked import check fails on a real import cycle (two modules that need each other's names)."""
    import json

    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from cyc.a import A\nB = 2\n")
    code = _FORK_IMPORTS.replace('if m.split(".")[0] == "posgen_tl"', 'if m.split(".")[0] == "cyc"')
    out = subprocess.run([sys.executable, "-c", code, json.dumps(["cyc.a", "json"])], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ImportError" in res["cyc.a"] and "circular import" in res["cyc.a"]
    assert res["json"] == ""


def test_report_modules_have_no_cycle():
    import ast

    def deps(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return {m.removeprefix("posgen_tl.report.") for m in mods if m.startswith("posgen_tl.report.")}

    rep = PKG / "report"
    graph = {p.stem: deps(p) for p in rep.glob("*.py")}
    for a, bs in graph.items():
        for b in bs:
            assert a not in graph.get(b, set()), f"report.{a} ↔ report.{b}"
