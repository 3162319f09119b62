"""One definition per experiment: the library call, ``posgen-tl study NAME`` and the report stage
resolve to the same Config; every experiment samples the same windows and groups layers the same
way; a study writes what a reader needs to reproduce it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import tiny_models as tm  # noqa: E402
import torch  # noqa: E402

import posgen_tl  # noqa: E402
from posgen_tl.cli import build_parser, main, study_config  # noqa: E402
from posgen_tl.experiments import registry  # noqa: E402
from posgen_tl.report.run import ReportSettings  # noqa: E402

PKG = Path(posgen_tl.__file__).parent


@pytest.fixture(scope="module")
def tiny():
    return tm.hf_llama(n_layers=3)[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(f"t{int(i)}" for i in torch.randint(3, 99, (70,), generator=g)) for _ in range(12)]
    root = tmp_path_factory.mktemp("corpus")
    (root / "words.txt").write_text("\n\n".join(docs))  # one text file: one document
    folder = root / "docs"  # a folder of files: one document each
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"d{i:02d}.txt").write_text(d)
    return {"file": str(root / "words.txt"), "folder": str(folder)}


# ----------------------------------------------------------------------------- one config, every door


def _cli_config(argv):
    return study_config(build_parser().parse_args(argv))


@pytest.mark.parametrize("name", registry.ORDER)
def test_library_study_and_report_resolve_the_same_config(name):
    mod = registry.experiment(name)
    library = mod.Config()  # what run(model) / pg.<recipe>(model) uses: base.config_of(Config, None, {})
    study, preset, params = _cli_config(["study", name])
    assert (preset, params) == ("default", {})
    assert study == library
    if name in registry.REPORT:
        assert ReportSettings().configs()[name] == library
    # the same with a preset and an option, through each door's own syntax
    opt = next(o for o in mod.Config.options() if o.name == "seed")
    quick = mod.Config.preset("quick").replace(seed=3)
    assert _cli_config(["study", name, "--quick", f"--{opt.name}", "3"])[0] == quick
    if name in registry.REPORT:
        assert ReportSettings(preset="quick", params={f"{name}.seed": "3"}).configs()[name] == quick


def test_no_recipe_restates_a_default():
    """Functions that take a ``cfg`` never also declare one of its options as a parameter with a
    default of its own (the six-places-disagree bug): options live in the Config only. A parameter
    may share an option's name only with the default ``None``, meaning "the Config's value"."""
    offenders = []
    for name in registry.ORDER:
        mod = registry.experiment(name)
        options = {o.name for o in mod.Config.options()} - {"twin"}
        for fname, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__:
                continue
            params = inspect.signature(fn).parameters
            if "cfg" not in params:
                continue
            clash = [p for p in params if p in options and params[p].default is not inspect.Parameter.empty
                     and params[p].default is not None]
            offenders += [f"{name}.{fname}({p}=…)" for p in clash]
    assert not offenders, offenders


def test_study_list_prints_every_option_with_its_help(capsys):
    assert main(["study", "list"]) == 0
    listed = capsys.readouterr().out
    for name in registry.ORDER:
        mod = registry.experiment(name)
        assert f"{name:15s} {mod.ABOUT}" in listed
        for o in mod.Config.options():
            assert f"--{o.name.replace('_', '-')} ({o.kind}; default" in listed and o.help in listed, (name, o.name)


def test_each_study_subcommand_shows_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["study", "causal", "--help"])
    out = capsys.readouterr().out
    assert "--controls" in out and "--match-steps" in out and "quick 2" in out
    assert "An interrupted run continues from OUT/.partial" in " ".join(out.split())


@pytest.mark.parametrize("argv,needle", [
    (["study", "taxonomy", "--layers", "ten"], "layers='ten'"),
    (["study", "taxonomy", "--layers", "19-10"], "backwards"),
    (["study", "causal", "--n-seq", "2"], "causal: n_seq=2: a contrast needs at least 3 documents"),
    (["report", "--n-seq", "2"], "causal: n_seq=2: a contrast needs at least 3 documents"),
    (["study", "causal", "--relative", "1,2"], "the grid needs the tuned strength (1) and strengths below and above it"),
    (["study", "tolerance", "--quick", "--full"], "choose one preset"),
    (["report", "--param", "nope=1"], "no experiment of this run has an option 'nope'"),
    (["report", "--param", "heads.n_ref=2"], "unknown experiment 'heads'"),
    (["report", "--param", "causal.gaps=0,1"], "unknown parameter 'gaps' for causal"),
    (["report", "--param", "twin=maybe"], "boolean"),
])
def test_bad_options_are_one_line_errors(capsys, tmp_path, argv, needle):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unknown_keyword_in_a_library_call_names_the_options():
    from posgen_tl.experiments.causal import Config

    with pytest.raises(ValueError, match="causal has no option n_prompts; accepted: .*controls"):
        Config().replace(n_prompts=3)
    with pytest.raises(TypeError, match="expected a posgen_tl.experiments.causal.Config"):
        registry.experiment("causal").causal_study(None, None, registry.experiment("tolerance").Config())


# ----------------------------------------------------------------------------- one sampling, one grouping


def test_only_the_sampling_module_cuts_windows():
    """No module but io/sampling.py calls the window cutters or the document split."""
    cutters = {"document_windows", "split_documents", "consecutive_chunks"}
    found = []
    for f in PKG.rglob("*.py"):
        if f.name == "sampling.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if name in cutters:
                    found.append(f"{f.relative_to(PKG)}:{node.lineno} {name}")
    assert not found, found


def test_every_experiment_analyses_the_same_windows(tiny, corpus, tmp_path, monkeypatch):
    """Run every experiment that samples windows on one corpus and seed: the analysed windows
    (document, start) and the reference windows are identical sets across experiments."""
    from posgen_tl.io import sampling

    seen: dict[str, list] = {}
    real = sampling.sample_windows

    def spy(model, corpus=None, **kw):
        ana, ref = real(model, corpus, **kw)
        seen.setdefault(current["name"], []).append((ana, ref))
        return ana, ref

    monkeypatch.setattr(sampling, "sample_windows", spy)
    for mod_name in ("decomposition", "pattern", "taxonomy", "tolerance", "causal", "sufficiency"):
        monkeypatch.setattr(f"posgen_tl.experiments.{mod_name}.sample_windows", spy, raising=False)
    current = {}
    sizes = dict(n_seq=4, seq_len=32, corpus=corpus["folder"], seed=2)
    for name in ("decomposition", "taxonomy", "causal", "sufficiency"):
        current["name"] = name
        cfg = registry.make_config(name, "quick", {"n_ref": "2"} if name != "taxonomy" else {"n_ref": "2"}, sizes)
        registry.run(name, tiny, cfg, progress=False)
    keys = {}
    for name, calls in seen.items():
        ana, ref = calls[0]
        keys[name] = (tuple(zip(ana.doc_ids.tolist(), ana.starts.tolist())),
                      tuple(zip(ref.doc_ids.tolist(), ref.starts.tolist())) if ref is not None else None)
    assert set(keys) == {"decomposition", "taxonomy", "causal", "sufficiency"}
    analysed = {k[0] for k in keys.values()}
    assert len(analysed) == 1, keys
    refs = {k[1] for k in keys.values()}
    assert len(refs) == 1, keys  # the same reference windows (one seed rule: no seed + 1 anywhere)


@pytest.mark.parametrize("n_layers", [18, 24, 26, 28, 30, 32, 40, 80])
def test_one_layer_grouping_from_every_door(n_layers):
    from posgen_tl.experiments import base, sufficiency
    from posgen_tl.experiments.taxonomy import labels_by_layer_group
    from posgen_tl.maths.groups import layer_group, layer_groups

    groups = layer_groups(n_layers)
    assert sum(groups.values(), []) == list(range(n_layers))
    sizes = [len(g) for g in groups.values()]
    assert max(sizes) - min(sizes) <= 1  # thirds
    assert base.resolve_layers("middle", n_layers) == groups["middle"]  # the causal test's default edit set
    assert [v for k, v in sufficiency.layer_groups(n_layers).items() if k != "all"] == list(groups.values())
    assert all(layer_group(layer, n_layers) == g for g, ls in groups.items() for layer in ls)
    heads = pd.DataFrame(dict(twin="trained", layer=range(n_layers), head=0, label="positional"))
    per = labels_by_layer_group(heads, n_layers).set_index("group")["positional"]
    assert per.to_dict() == {g: len(ls) for g, ls in groups.items()}
    if n_layers == 32:  # Llama-3-8B, Mistral-7B: one answer, whatever the door
        assert groups == {"early": list(range(0, 11)), "middle": list(range(11, 22)), "late": list(range(22, 32))}


# ----------------------------------------------------------------------------- studies


def test_study_and_report_stage_write_identical_tables(tiny, corpus, tmp_path, monkeypatch):
    from posgen_tl.hooks import edits

    passes: list[str] = []  # the k̄ passes (feature_means' streamed forwards), by who ran them
    real = edits.stream_qk
    monkeypatch.setattr(edits, "stream_qk", lambda *a, **kw: (passes.append(who[0]), real(*a, **kw))[1])
    torch.manual_seed(0)
    sizes = dict(n_seq=3, seq_len=32, corpus=corpus["file"], seed=0)
    who = ["study"]
    cfg = registry.make_config("pattern", "quick", {}, sizes)
    md = registry.run_study("pattern", cfg, tmp_path / "study", model=tiny, preset="quick",
                            command="posgen-tl study pattern --quick")
    settings = ReportSettings(model=tiny, out=str(tmp_path / "report"), preset="quick", sizes=sizes,
                              experiments=("decomposition", "pattern"))
    from posgen_tl.report.run import run_report

    who[0] = "report"
    assert run_report(settings) == 0
    # decomposition computes the global k̄ of the model and of its twin, and one layer's for the head maps; pattern,
    # in the study as in the report, takes the two global ones computed on the same reference windows
    # (edits.shared_means) instead of two passes of its own — and its tables are the same as the study's, below
    assert passes.count("study") == 3 and passes.count("report") == 3, passes
    work = tmp_path / "report" / ".work"
    csvs = sorted(p.name for p in work.glob("*.csv"))
    assert "pattern_heads.csv" in csvs and "decomposition.csv" in csvs
    for f in csvs:
        pd.testing.assert_frame_equal(pd.read_csv(md.parent / f), pd.read_csv(work / f), check_exact=True, obj=f)
    figs = sorted(p.name for p in md.parent.glob("*.png"))  # the study writes its sections' figures beside them
    assert figs == [f"fig_decomposition_{i}.png" for i in range(2)] + [f"fig_pattern_{i}.png" for i in range(4)], figs


def test_study_writes_markdown_and_json_a_reader_can_reproduce(tiny, corpus, tmp_path):
    cfg = registry.make_config("decomposition", "quick", {}, dict(n_seq=3, seq_len=32, corpus=corpus["file"]))
    md = registry.run_study("decomposition", cfg, tmp_path, model=tiny, preset="quick",
                            command="posgen-tl study decomposition --quick")
    text = md.read_text()
    assert text.startswith("# posgen-tl study decomposition — tiny")
    assert "`posgen-tl study decomposition --quick`" in text and "git commit:" in text and "wall time:" in text
    assert "## Findings" in text and "decomposition: " in text and "n = 3" in text and "exploratory" in text
    assert "| layers | estimator |" in text  # the section's table, as markdown
    assert "![fig_decomposition_0.png](fig_decomposition_0.png)" in text
    meta = json.loads((tmp_path / "decomposition.json").read_text())
    assert meta["config"] == cfg.as_dict() and meta["preset"] == "quick" and meta["wall_seconds"] > 0
    assert meta["findings"][0]["question"] == "decomposition" and meta["findings"][0]["n"] == 3
    assert "decomposition.csv" in meta["files"] and "decomposition_summary.csv" in meta["files"]


def test_study_options_reach_the_recipe(tiny, corpus, tmp_path, capsys):
    """--groups/--controls/--fracs change what the causal study runs, and are recorded."""
    torch.manual_seed(0)
    out = tmp_path / "s"
    assert main(["study", "causal", "--model", "tiny-hf-llama", "--out", str(out)]) == 2  # no such model: clean error
    capsys.readouterr()
    cfg, preset, params = _cli_config(["study", "causal", "--quick", "--groups", "1", "--controls", "C1", "--fracs",
                                       "0,0.3", "--match-steps", "1", "--n-ref", "2", "--n-seq", "4", "--seq-len",
                                       "32", "--corpus", corpus["folder"]])
    md = registry.run_study("causal", cfg, out, model=tiny, preset=preset, params=params, command="posgen-tl study causal …")
    rec = json.loads((out / "causal.json").read_text())
    conf = rec["config"]
    assert conf["groups"] == ["1"] and conf["controls"] == ["C1"] and conf["fracs"] == [0.0, 0.3]
    assert conf["n_ref"] == 2 and conf["match_steps"] == 1
    units = pd.read_csv(out / "causal_units.csv")
    assert set(units["condition"]) == {"destroy", "C1"} and set(units["layers"]) == {"L1"}
    grids = pd.read_csv(out / "causal_grids.csv")
    assert set(grids["condition"]) == {"destroy", "C1"} and (grids["strengths"].str.count(";") == 3).all()
    assert not (out / ".partial").exists()  # the checkpoint goes once the Result is saved
    assert "Verdict per entry" in md.read_text() and "fig_causal_0.png" in rec["files"]


def test_gap_attention_study_uses_the_taxonomy_table(tiny, corpus, tmp_path):
    heads = pd.DataFrame(dict(twin="trained", layer=[0, 0, 1, 1, 2, 2], head=[0, 1, 0, 1, 0, 1],
                              label=["positional", "symbolic"] * 3))
    heads.to_csv(tmp_path / "heads.csv", index=False)
    cfg = registry.make_config("gap_attention", "default", {"n_ref": "2", "skip": "2", "classes": str(tmp_path / "heads.csv")},
                               dict(n_seq=3, seq_len=32, corpus=corpus["folder"]))
    md = registry.run_study("gap_attention", cfg, tmp_path / "s", model=tiny, command="posgen-tl study gap_attention …")
    summ = pd.read_csv(md.parent / "gap_attention_summary.csv")
    assert (summ["classes"] == "taxonomy").all() and summ["n_heads_positional"].iloc[0] == 3
    assert "kl: positional − symbolic" in set(summ["estimator"])
    assert "Attention change under the gap" in md.read_text()


def test_taxonomy_study_options_and_layer_third_table(tiny, corpus, tmp_path):
    """The taxonomy study honours region_len / n_query / n_perm, records them, and its markdown carries
    the labels by layer third and the Spearman agreement, counts adding up."""
    from posgen_tl.experiments.taxonomy import labels_by_layer_group

    params = {"n_ref": "2", "region_len": "8", "n_query": "6", "n_perm": "2", "min_score": "0.1", "layers": "0-2"}
    cfg = registry.make_config("taxonomy", "default", params, dict(n_seq=3, seq_len=32, corpus=corpus["folder"]))
    md = registry.run_study("taxonomy", cfg, tmp_path / "h", model=tiny, command="posgen-tl study taxonomy")
    out = md.parent
    meta = registry.load("taxonomy", out).meta  # the meta the study saved with its Result
    assert (meta["region_len"], meta["n_query"], meta["n_perm"], meta["min_score"]) == (8, 6, 2, 0.1)
    heads = pd.read_csv(out / "heads.csv")
    thirds = labels_by_layer_group(heads, meta["n_layers"])
    assert list(thirds["group"].astype(str).unique()) == ["early", "middle", "late"]  # 3 layers: one per third
    per_twin = thirds.drop(columns="group").groupby("twin").sum().sum(axis=1)
    assert per_twin.to_dict() == heads.groupby("twin").size().to_dict()  # every head counted once
    text = md.read_text()
    assert "Head labels by layer third" in text and "Spearman ρ of (positional − symbolic)" in text


def test_configs_are_frozen_and_json_friendly():
    for name in registry.ORDER:
        cfg = registry.experiment(name).Config.preset("full")
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.seed = 1  # type: ignore[misc]
        assert json.loads(json.dumps(cfg.as_dict())) == cfg.as_dict()
