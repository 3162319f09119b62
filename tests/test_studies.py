"""`posgen-tl study NAME`: one recipe layer shared with the report. A study and the report stage
of the same name, on the same tiny model and corpus, write identical tables; the study's
markdown/JSON record what a reader needs to reproduce it."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tiny_models as tm  # noqa: E402
from posgen_tl.report import stages  # noqa: E402
from posgen_tl.report.context import Context, ReportConfig, Work  # noqa: E402
from posgen_tl.studies import STUDIES, register, run_study  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tm.hf_llama(n_layers=3)[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(f"t{int(i)}" for i in torch.randint(3, 99, (70,), generator=g)) for _ in range(12)]
    root = tmp_path_factory.mktemp("corpus")
    (root / "words.txt").write_text("\n\n".join(docs))  # one text file: one document
    folder = root / "docs"  # a folder of files: one document each (the causal study needs disjoint documents)
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"d{i:02d}.txt").write_text(d)
    return {"file": str(root / "words.txt"), "folder": str(folder)}


def _cfg(out, corpus, **kw):
    return ReportConfig(model="tiny", corpus=corpus, seq_len=32, n_seq=3, out=str(out), quick=True, seed=0, **kw)


def _report_stage(tiny, cfg, *names):
    ctx = Context(cfg, Work(Path(cfg.out), cfg), tiny, "tiny")
    for name in names:
        dict((n, f) for n, f, _ in stages.STAGES)[name](ctx)
    return ctx.work.dir


@pytest.mark.parametrize("name,needs,kind", [("decomposition", (), "file"), ("pattern", ("decomposition",), "file"),
                                             ("tolerance", (), "folder")])
def test_study_and_report_stage_write_identical_tables(tiny, corpus, tmp_path, name, needs, kind):
    torch.manual_seed(0)
    md = run_study(name, _cfg(tmp_path / "study", corpus[kind]), model=tiny, command=f"posgen-tl study {name} --quick")
    work = _report_stage(tiny, _cfg(tmp_path / "report", corpus[kind]), *needs, name)
    study_dir = md.parent
    csvs = sorted(p.name for p in work.glob("*.csv"))
    assert csvs, "the report stage wrote no table"
    for f in csvs:
        a, b = pd.read_csv(study_dir / f), pd.read_csv(work / f)
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=f)
    assert sorted(p.name for p in work.glob("*.png")) == sorted(p.name for p in study_dir.glob("*.png"))


def test_study_writes_markdown_and_json_a_reader_can_reproduce(tiny, corpus, tmp_path):
    md = run_study("decomposition", _cfg(tmp_path, corpus["file"]), model=tiny, command="posgen-tl study decomposition --quick")
    text = md.read_text()
    assert text.startswith("# posgen-tl study decomposition — tiny")
    assert "`posgen-tl study decomposition --quick`" in text and "git commit:" in text and "wall time:" in text
    assert "## Findings" in text and "decomposition: " in text and "n = 3" in text and "exploratory" in text
    assert "| layers | estimator |" in text  # the section's table, as markdown
    assert "![fig_decomposition_r.png](fig_decomposition_r.png)" in text
    meta = json.loads((tmp_path / "decomposition.json").read_text())
    assert meta["config"]["seq_len"] == 32 and meta["config"]["n_seq"] == 3 and meta["wall_seconds"] > 0
    assert meta["findings"][0]["question"] == "decomposition" and meta["findings"][0]["n"] == 3
    assert "decomposition.csv" in meta["files"] and "decomposition_summary.csv" in meta["files"]


def test_register_adds_a_recipe_in_one_line(tiny, corpus, tmp_path):
    def count_tokens(ctx):
        """Token count per sequence (a recipe in three lines)."""
        toks = ctx.tokens()
        ctx.work.save_df("counts.csv", pd.DataFrame({"seq": range(len(toks)), "n": toks.shape[1]}))

    register("count_tokens", count_tokens)
    try:
        md = run_study("count_tokens", _cfg(tmp_path, corpus["file"]), model=tiny)
        assert pd.read_csv(tmp_path / "counts.csv")["n"].tolist() == [32, 32, 32]
        assert "`counts.csv`" in md.read_text()
        with pytest.raises(KeyError, match="registered: exactness, decomposition"):
            run_study("nope", _cfg(tmp_path, corpus["file"]), model=tiny)
    finally:
        STUDIES.pop("count_tokens")


def test_cli_study_list_and_unknown_name(capsys):
    from posgen_tl.cli import main

    assert main(["study", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(n in listed for n in ("decomposition", "pattern", "tolerance", "heads", "length", "sufficiency"))
    assert "--param layers=" in listed and "--param controls=" in listed  # each study names its parameters
    for line in listed.strip().splitlines():  # every study says what it does
        if line.startswith(" "):
            continue
        name, _, about = line.strip().partition(" ")
        assert len(about.strip()) > 20, f"study {name!r} has no description"
    assert main(["study", "nope"]) == 2
    assert "unknown study 'nope'" in capsys.readouterr().err


def test_study_parameters_reach_the_recipe(tiny, corpus, tmp_path):
    """--param layers/controls/fracs/t12 change what the tolerance study runs, and are recorded."""
    torch.manual_seed(0)
    params = {"layers": "1", "controls": "C1", "fracs": "0,0.3", "t12": "false", "match_steps": "1", "n_ref": "2"}
    cfg = _cfg(tmp_path / "s", corpus["folder"], params=params)
    md = run_study("tolerance", cfg, model=tiny, command="posgen-tl study tolerance ...")
    out = md.parent
    meta = json.loads((out / "causal_meta.json").read_text())
    assert meta["layers"] == [1] and meta["controls"] == ["C1"] and list(meta["fracs"]) == [0.0, 0.3]
    assert not meta["t12"] and not (out / "tolerance_curves.csv").exists()  # T1/T2 not run
    rows = pd.read_csv(out / "causal_rows.csv")
    assert set(rows["intervention"]) == {"none", "destroy", "C1"} and set(rows["frac"]) == {0.0, 0.3}
    cfg_json = json.loads((out / "causal_config.json").read_text())
    assert cfg_json["layers"] == [1] and cfg_json["n_ref"] == 2
    rec = json.loads((out / "tolerance.json").read_text())
    assert rec["config"]["params"] == params  # the run records its parameters
    by_q = {f["question"]: f for f in rec["findings"]}
    assert by_q["tolerance"]["verdict"] == "not run" and by_q["causal"]["verdict"] != "not run"
    text = md.read_text()
    assert "Contrasts (one family; Holm)" in text and "T1 / T2" not in text


def test_study_parameters_bad_input(tiny, corpus, tmp_path, capsys):
    from posgen_tl.cli import main
    from posgen_tl.report.params import check_params, parse_param_args, stage_params

    assert parse_param_args(["n-ref=8", "layers=10-12,20"]) == {"layers": "10-12,20", "n_ref": "8"}
    assert stage_params({"layers": "10-12,20", "fracs": "0,0.5"}, "tolerance") == {"layers": [10, 11, 12, 20],
                                                                                    "fracs": [0.0, 0.5]}
    assert stage_params({"tolerance": "d3:all,d3:20–29"}, "sufficiency") == {"tolerance": [("d3", "all"), ("d3", "20–29")]}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_param_args(["layers"])
    with pytest.raises(ValueError, match="twice"):
        parse_param_args(["a=1", "a=2"])
    with pytest.raises(ValueError, match="unknown parameter 'gaps'.*accepted: .*controls"):
        check_params({"gaps": "0,1"}, ["tolerance"])
    with pytest.raises(ValueError, match="layers='ten'"):
        check_params({"layers": "ten"}, ["tolerance"])
    with pytest.raises(ValueError, match="backwards"):
        check_params({"layers": "19-10"}, ["tolerance"])
    with pytest.raises(ValueError, match="boolean"):
        check_params({"t12": "maybe"}, ["tolerance"])
    with pytest.raises(ValueError, match="unknown parameter"):  # the library path checks too, before any compute
        run_study("tolerance", _cfg(tmp_path / "x", corpus["folder"], params={"gap": "1"}), model=tiny)
    assert not (tmp_path / "x" / "tolerance.md").exists()
    assert main(["study", "heads", "--param", "controls=C1", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "unknown parameter 'controls' for heads" in err and "n_prompts" in err
    assert main(["report", "--param", "nope=1", "--out", str(tmp_path / "z")]) == 2
    assert "unknown parameter 'nope'" in capsys.readouterr().err


def test_causal_script_is_a_thin_wrapper_over_the_study_command(capsys, tmp_path):
    """scripts/causal_study.py only translates the README's sizes into `posgen-tl study tolerance`."""
    import importlib.util

    from posgen_tl.report.params import check_params, parse_param_args

    spec = importlib.util.spec_from_file_location("causal_script", Path(__file__).parent.parent / "scripts" / "causal_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", "gemma3-270m", "--n-seq", "32", "--layers", "6-11", "--tag", "g", "--out", str(tmp_path),
                     "--print"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    argv = line.split()
    assert argv[:4] == ["posgen-tl", "study", "tolerance", "--model"] and argv[4] == "gemma3-270m"
    assert argv[argv.index("--out") + 1] == str(tmp_path / "g") and argv[argv.index("--n-seq") + 1] == "32"
    params = parse_param_args([argv[i + 1] for i, x in enumerate(argv) if x == "--param"])
    check_params(params, ["tolerance"])  # every translated option is a declared study parameter
    assert params["layers"] == "6-11" and params["controls"] == "C1,C2,C3,C4" and params["causal"] == "true"
    assert params["t12"] == "false"
    q = tmp_path / "jobs.txt"
    q.write_text("# two studies\n--n-seq 64 --layers 20-29 --tag a\n--n-seq 64 --t12-only --tag b\n")
    assert mod.main(["--queue", str(q), "--print"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "causal=false" in lines[1] and "t12=true" in lines[1] and "layers=20-29" in lines[0]


@pytest.mark.parametrize("what,study,must", [
    ("gap", "length", {"window": "false", "gaps": "0,2"}),
    ("window", "length", {"gap": "false", "window_n_seq": "16", "window_seq_len": "2048"}),
    ("sufficiency", "sufficiency", {"tolerance": "d3:all", "target_len": "64"}),
    ("attention", "gap_attention", {"classes": "heads.csv", "gap": "2.0"}),
])
def test_length_script_is_a_thin_wrapper_over_study_commands(capsys, tmp_path, what, study, must):
    import importlib.util

    from posgen_tl.report.params import check_params, parse_param_args

    spec = importlib.util.spec_from_file_location("length_script", Path(__file__).parent.parent / "scripts" / "length_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    extra = {"gap": ["--gaps", "0,2"], "window": ["--seq-len", "2048"], "sufficiency": ["--tolerance", "d3:all"],
             "attention": ["--classes", "heads.csv"]}[what]
    assert mod.main([what, "--n-seq", "16", "--out", str(tmp_path), "--print", *extra]) == 0
    argv = capsys.readouterr().out.strip().split()
    assert argv[1:3] == ["study", study] and argv[argv.index("--n-seq") + 1] == "16"
    params = parse_param_args([argv[i + 1] for i, x in enumerate(argv) if x == "--param"])
    check_params(params, [study])  # every translated option is a declared parameter of that study
    assert must.items() <= params.items()
    assert study in STUDIES


def test_gap_attention_study_uses_the_taxonomy_table(tiny, corpus, tmp_path):
    heads = pd.DataFrame(dict(twin="trained", layer=[0, 0, 1, 1, 2, 2], head=[0, 1, 0, 1, 0, 1],
                              label=["positional", "symbolic"] * 3))
    heads.to_csv(tmp_path / "heads.csv", index=False)
    cfg = _cfg(tmp_path / "s", corpus["folder"], params={"n_ref": "2", "skip": "2",
                                                         "classes": str(tmp_path / "heads.csv")})
    md = run_study("gap_attention", cfg, model=tiny, command="posgen-tl study gap_attention ...")
    summ = pd.read_csv(md.parent / "gap_attention_summary.csv")
    assert (summ["classes"] == "taxonomy").all() and summ["n_heads_positional"].iloc[0] == 3
    assert "kl: positional − symbolic" in set(summ["estimator"])
    assert "Attention change under the gap" in md.read_text()


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script,study,args,must", [
    ("heads_results", "heads", ["--n-prompts", "32", "--region-len", "32", "--layers", "0,5-7", "--block", "2"],
     {"n_prompts": "32", "region_len": "32", "layers": "0,5-7", "block": "2", "n_query": "64", "min_score": "0.2"}),
    ("estimators_results", "pattern", ["--n-seq", "32", "--n-ref", "8", "--bound-rows", "16"],
     {"n_ref": "8", "bound_rows": "16", "batch_size": "4"}),
])
def test_heads_and_estimator_scripts_are_thin_wrappers(capsys, tmp_path, script, study, args, must):
    """scripts/heads_results.py and estimators_results.py only translate their options into one
    `posgen-tl study heads|pattern` command whose every --param the study declares."""
    from posgen_tl.report.params import check_params, parse_param_args

    assert _script(script).main(["--model", "gemma3-270m", "--seed", "3", "--out", str(tmp_path), "--tag", "t",
                                 "--print", *args]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    argv = line.split()
    assert argv[:3] == ["posgen-tl", "study", study] and argv[argv.index("--model") + 1] == "gemma3-270m"
    assert argv[argv.index("--seed") + 1] == "3"
    assert argv[argv.index("--out") + 1] == str(tmp_path / f"{study}_gemma3-270m_t")
    params = parse_param_args([argv[i + 1] for i, x in enumerate(argv) if x == "--param"])
    check_params(params, [study, *STUDIES[study].needs])
    assert must.items() <= params.items()


def test_heads_study_parameters_and_layer_third_table(tiny, corpus, tmp_path):
    """The heads study honours region_len / n_query / n_perm, records them, and its markdown carries the
    tables the old script printed (labels by layer third, Spearman agreement), counts adding up."""
    from posgen_tl.experiments.taxonomy import labels_by_layer_group

    params = {"n_prompts": "3", "n_ref": "2", "region_len": "8", "n_query": "6", "n_perm": "2", "min_score": "0.1",
              "layers": "0-2"}
    md = run_study("heads", _cfg(tmp_path / "h", corpus["folder"], params=params), model=tiny, command="posgen-tl study heads")
    out = md.parent
    meta = json.loads((out / "heads_meta.json").read_text())
    assert (meta["region_len"], meta["n_query"], meta["n_perm"], meta["min_score"]) == (8, 6, 2, 0.1)  # from the rows
    heads = pd.read_csv(out / "heads.csv")
    thirds = labels_by_layer_group(heads, meta["n_layers"])
    assert list(thirds["group"].astype(str).unique()) == ["early", "middle", "late"]  # 3 layers: one per third
    per_twin = thirds.drop(columns="group").groupby("twin").sum().sum(axis=1)
    assert per_twin.to_dict() == heads.groupby("twin").size().to_dict()  # every head counted once
    text = md.read_text()
    assert "Head labels by layer third" in text and "Spearman ρ of (positional − symbolic)" in text


def test_estimator_tables_read_a_pattern_study_folder(tiny, corpus, tmp_path, capsys, monkeypatch):
    """scripts/estimators_tables.py turns a `posgen-tl study pattern` folder into the README tables."""
    md = run_study("pattern", _cfg(tmp_path / "p", corpus["folder"], params={"n_ref": "2"}), model=tiny,
                   command="posgen-tl study pattern")
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "scripts"))
    tables = _script("estimators_tables")
    meta, dec, bands, heads = tables.load(str(md.parent))
    assert meta["n_ref"] == 2 and meta["n_docs_reference"] >= 1 and meta["bound_holds_min"] == 1.0
    assert len(bands) and set(bands["which"]) == {"q", "k"} and set(bands["twin"]) == {"trained", "random"}
    monkeypatch.setattr("sys.argv", ["estimators_tables.py", str(md.parent)])
    tables.main()
    text = capsys.readouterr().out
    for title in ("Decomposition, sink excluded", "Paired per-sequence contrasts", "Key ρ by band group",
                  "Pattern scores vs D3 within-row r"):
        assert title in text
    assert "| D3 | global |" in text
