"""The experiment protocol, asserted for every registered experiment: a Config, a Result, a pure
``run(model, cfg, …) -> Result``, ``render(result)``, typed upstream inputs; no experiment imports another;
every door gives what ``run`` gives."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pandas as pd
import pytest
import tiny_models as tm
import torch
from fake_libc import BACK, KEEP, FakeLibc

from posgen_tl.experiments import base, registry

EXPERIMENTS = Path(base.__file__).parent


@pytest.mark.parametrize("name", registry.ORDER)
def test_every_experiment_has_the_protocol(name):
    mod = registry.experiment(name)
    assert issubclass(mod.Config, base.Config) and mod.Config.NAME == name
    assert issubclass(mod.Result, base.Result)
    params = list(inspect.signature(mod.run).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "cfg"], name
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params[2:]), name  # inputs by name only
    assert list(inspect.signature(mod.render).parameters) == ["result"], name
    assert set(mod.NEEDS) <= set(registry.ORDER) and name not in mod.NEEDS
    assert ("upstream" in inspect.signature(mod.run).parameters) == bool(mod.NEEDS), name  # NEEDS arrive as arguments
    assert not hasattr(mod, "compute"), name  # no second way to run
    for fn in (mod.run, mod.render):  # no context object: everything arrives as a named argument
        names = {n.id for n in ast.walk(ast.parse(inspect.getsource(fn))) if isinstance(n, ast.Name)}
        assert "ctx" not in names, (name, fn.__name__)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


@pytest.mark.parametrize("name", registry.ORDER)
def test_no_experiment_imports_another(name):
    others = {f"posgen_tl.experiments.{n}" for n in registry.ORDER if n != name}
    assert not (_imports(EXPERIMENTS / f"{name}.py") & others), name


def test_library_study_and_saved_result_are_one_run(tmp_path):
    """pg.run (the library), a study folder read back (study, pages) and the report's call give the same
    tables, bit for bit, on a tiny model."""
    model = tm.hf_llama(n_layers=2)[0]
    g = torch.Generator().manual_seed(0)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(10):
        (folder / f"d{i}.txt").write_text(" ".join(f"w{int(t)}" for t in torch.randint(3, 99, (60,), generator=g)))
    cfg = registry.make_config("sufficiency", "quick", {"n_ref": "2"}, dict(n_seq=3, seq_len=24, corpus=str(folder)))
    lib = registry.run("sufficiency", model, cfg, progress=False)
    md = registry.run_study("sufficiency", cfg, tmp_path / "s", model=model, command="posgen-tl study sufficiency")
    study = registry.load("sufficiency", md.parent)
    via_report = registry.run_or_skip("sufficiency", model, cfg, progress=False)
    assert set(lib.tables) == set(study.tables) == set(via_report.tables) == {"rows", "summary", "equivalence"}
    for t in lib.tables:
        pd.testing.assert_frame_equal(study.tables[t], lib.tables[t].reset_index(drop=True), check_dtype=False, obj=t)
        pd.testing.assert_frame_equal(via_report.tables[t], lib.tables[t], obj=t)
    assert study.config == lib.config == cfg.as_dict() and study.meta["n_seq"] == 3


def test_run_runs_what_an_experiment_needs_first():
    """pg.run("pattern", …) without an upstream decomposition runs it (same windows, the options both share);
    the module's own run refuses by name rather than link to nothing."""
    model = tm.hf_llama(n_layers=2)[0]
    cfg = registry.make_config("pattern", "quick", {"n_ref": "1"}, dict(n_seq=2, seq_len=24))
    with pytest.raises(ValueError, match="upstream=\\{'decomposition'"):
        registry.experiment("pattern").run(model, cfg, progress=False)
    res = registry.run("pattern", model, cfg, progress=False)
    assert set(res.tables["link"]["twin"]) == {"trained", "random"} and len(res.tables["link_summary"])


@pytest.mark.parametrize("name", registry.ORDER)
def test_every_run_is_wrapped_to_share_the_heap_between_its_passes(name):
    """Each experiment's run is base.shares_heap's wrapper around the module's own function (the same code object
    as any function shares_heap wraps), so every door — library, study, report, notebooks — gets it."""
    run = registry.experiment(name).run
    assert run.__code__ is base.shares_heap(lambda model: None).__code__, name
    assert run.__wrapped__.__module__ == registry.experiment(name).__name__


def test_a_run_of_many_passes_sets_the_heap_once_and_trims_once(monkeypatch):
    """On the CPU a run's passes (the sufficiency study: a reference pass, clean and substituted forwards) neither
    restore glibc's settings nor trim at their ends while the resident memory stays within the margin: one setting
    at the run's start, one restore and trim at its end. A plain function outside a run: per pass, as before. On a
    GPU model the wrapper changes nothing."""
    from posgen_tl.hooks import heap

    lib = FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", lib)
    monkeypatch.setattr(heap, "resident_bytes", lambda: 2**30)  # no growth: no pass trims past the margin
    keep, back = KEEP, BACK
    model = tm.hf_llama(n_layers=2)[0]
    cfg = registry.make_config("sufficiency", "quick", {"n_ref": "1"}, dict(n_seq=2, seq_len=24))
    registry.experiment("sufficiency").run(model, cfg, progress=False)
    assert lib.calls == keep + back
    lib.calls.clear()
    registry.experiment("sufficiency").run.__wrapped__(model, cfg, progress=False)  # the function unwrapped
    assert lib.calls.count(("trim", 0)) > 1 and lib.calls[: len(keep + back)] == keep + back
    lib.calls.clear()
    monkeypatch.setattr("posgen_tl.hooks.capture.model_device", lambda m: torch.device("cuda"))
    seen = []
    base.shares_heap(lambda model: seen.append(heap._DEPTH[0]))(model)
    assert seen == [0] and lib.calls == []
