"""scripts/run_studies.py writes the package-README corpus only as recorded: installed versions move, and a corpus
that silently differs from the one the published runs used would make new runs incomparable with them."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

import posgen_tl.io.corpus as corpus

_PATH = Path(__file__).resolve().parents[3] / "scripts" / "run_studies.py"
_spec = importlib.util.spec_from_file_location("posgen_run_studies", _PATH)
run_studies = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_studies)

DOCS = {"alpha": ("1.0", "a" * 3100), "beta": ("2.0", "b" * 3200)}


def _fake_readmes(docs):
    def write(dest, **_):
        Path(dest).mkdir(parents=True, exist_ok=True)
        out = []
        for name, (version, text) in docs.items():
            (Path(dest) / f"{name}.txt").write_text(text)
            out.append(dict(name=name, version=version, chars=len(text), sha256=hashlib.sha256(text.encode()).hexdigest()))
        return out
    return write


def test_a_first_corpus_is_recorded_and_an_equal_one_keeps_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_readmes", _fake_readmes(DOCS))
    record = tmp_path / "corpora" / "readmes.json"
    run_studies.write_readmes(tmp_path / "a", record)
    first = record.read_text()
    assert [d["name"] for d in json.loads(first)] == ["alpha", "beta"]
    run_studies.write_readmes(tmp_path / "b", record)
    assert record.read_text() == first and len(list((tmp_path / "b").glob("*.txt"))) == 2


def test_a_corpus_that_moved_is_refused_by_name_and_the_record_kept(tmp_path, monkeypatch):
    record = tmp_path / "readmes.json"
    monkeypatch.setattr(corpus, "package_readmes", _fake_readmes(DOCS))
    run_studies.write_readmes(tmp_path / "a", record)
    kept = record.read_text()
    moved = {**DOCS, "beta": ("2.1", "c" * 3300)}
    monkeypatch.setattr(corpus, "package_readmes", _fake_readmes(moved))
    with pytest.raises(SystemExit, match=r"1 document\(s\): beta \(recorded 2.0, installed 2.1\)"):
        run_studies.write_readmes(tmp_path / "b", record)
    assert record.read_text() == kept and not list((tmp_path / "b").glob("*.txt"))  # nothing half-written is used


def test_the_docstring_corpus_is_kept_only_as_recorded(tmp_path, monkeypatch):
    def fake(texts, python):
        def write(dest, **_):
            Path(dest).mkdir(parents=True, exist_ok=True)
            for name, text in texts.items():
                (Path(dest) / f"{name}.txt").write_text(text)
            return [dict(name=n, chars=len(t), sha256=hashlib.sha256(t.encode()).hexdigest(), python=python)
                    for n, t in texts.items()]
        return write

    record = tmp_path / "docstrings.json"
    monkeypatch.setattr(corpus, "stdlib_docstrings", fake({"heapq": "h" * 2000, "json": "j" * 2000}, "3.11.7"))
    run_studies.write_docstrings(tmp_path / "a", record)
    monkeypatch.setattr(corpus, "stdlib_docstrings", fake({"heapq": "h" * 2001, "json": "j" * 2000}, "3.12.1"))
    with pytest.raises(SystemExit, match=r"docstring corpus differs .* 1 document\(s\): heapq \(recorded 3.11.7, "
                                         r"installed 3.12.1\)"):
        run_studies.write_docstrings(tmp_path / "b", record)
    assert not list((tmp_path / "b").glob("*.txt"))


def test_the_confirmatory_causal_job_is_declared_with_one_entry_on_the_docstrings():
    name, args = next(j for j in run_studies.jobs("R") if j[0].endswith("docstrings/causal"))
    assert name == "smollm2-135m/docstrings/causal"
    assert args[args.index("--claim") + 1] == "smollm2-135m:L20-29" and args[args.index("--groups") + 1] == "late"
    assert args[args.index("--corpus") + 1] == "results/corpora/docstrings"


def test_the_second_confirmatory_job_is_sized_for_power_on_fresh_documents():
    name, args = next(j for j in run_studies.jobs("R") if j[0].endswith("scidocs/causal"))
    assert name == "smollm2-135m/scidocs/causal" and args[args.index("--corpus") + 1] == "results/corpora/scidocs"
    assert args[args.index("--claim") + 1] == "smollm2-135m:L20-29" and int(args[args.index("--n-seq") + 1]) == 256
    assert args[args.index("--groups") + 1] == "late" and "--full" in args


def test_the_fourth_confirmatory_job_skips_the_third_runs_documents_at_declared_levels():
    jobs = dict(run_studies.jobs("R"))
    third, fourth = jobs["gemma3-270m/scidocs/causal"], jobs["gemma3-270m/scidocs-2/causal"]
    assert fourth[fourth.index("--corpus") + 1] == third[third.index("--corpus") + 1] == "results/corpora/scidocs"
    # the same seed and reference windows; the analysed windows start where the third run's ended
    assert int(fourth[fourth.index("--skip") + 1]) == int(third[third.index("--n-seq") + 1]) == 192
    assert fourth[fourth.index("--levels") + 1] == "0.0025,0.005,0.0075" and "--levels" not in third
    assert fourth[fourth.index("--claim") + 1] == "gemma3-270m:L12-17" and "--seed" not in fourth


def test_the_scientific_docstring_corpus_is_kept_only_as_recorded(tmp_path, monkeypatch):
    def fake(version):
        def write(dest, **_):
            Path(dest).mkdir(parents=True, exist_ok=True)
            text = "n" * 2000 if version == "2.4.6" else "n" * 2001
            (Path(dest) / "numpy.linalg.txt").write_text(text)
            return [dict(name="numpy.linalg", chars=len(text), sha256=hashlib.sha256(text.encode()).hexdigest(),
                         package="numpy", version=version)]
        return write

    record = tmp_path / "scidocs.json"
    monkeypatch.setattr(corpus, "package_docstrings", fake("2.4.6"))
    run_studies.write_scidocs(tmp_path / "a", record)
    assert json.loads(record.read_text())[0]["version"] == "2.4.6"
    monkeypatch.setattr(corpus, "package_docstrings", fake("2.5.0"))
    with pytest.raises(SystemExit, match=r"scientific-stack docstring corpus differs .* numpy.linalg \(recorded "
                                         r"2.4.6, installed 2.5.0\)"):
        run_studies.write_scidocs(tmp_path / "b", record)
    assert not list((tmp_path / "b").glob("*.txt"))
