"""The results pages are regenerated from the study folders they cite, never edited by hand, and
``results/`` holds only what a page cites."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from posgen_tl.report import claim, pages

ROOT = Path(__file__).resolve().parents[2]
RESULTS, DOCS, README = ROOT / "results", ROOT / "docs", ROOT / "README.md"


@pytest.mark.slow  # renders every committed study: ~35 s
def test_committed_pages_equal_their_regeneration():
    bad = pages.stale(RESULTS, DOCS, README)
    assert not bad, ("stale results pages; run python -m posgen_tl.report.pages --results results --docs docs\n"
                     + "\n".join(bad))


def test_results_folder_holds_only_what_a_page_cites():
    tracked = set(subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    manifest = set((RESULTS / "MANIFEST.txt").read_text().split())
    assert manifest, "empty manifest"
    assert tracked - {"results/MANIFEST.txt"} == manifest, (
        f"tracked but not cited: {sorted(tracked - manifest - {'results/MANIFEST.txt'})[:10]}; "
        f"cited but not tracked: {sorted(manifest - tracked)[:10]}")
    assert not any(p.endswith((".log", ".running")) or "partial" in p for p in tracked)


def test_every_study_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (DOCS / "results").glob("*.md"):
        assert f"results/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_a_changed_table_makes_its_page_stale(tmp_path):
    """Every measured value of a study's tables shifted by one: the regenerated page differs from the written one
    (the page is built from those tables, not from anything else)."""
    runs = [r for r in pages.find_runs(RESULTS) if r.study == "tolerance"] or pages.find_runs(RESULTS)
    if not runs:
        pytest.skip("no study folders committed")
    run = runs[0]
    res, docs = tmp_path / "results", tmp_path / "docs"
    dst = res / run.model / run.corpus / run.study
    shutil.copytree(run.folder, dst)
    pages.write_pages(res, docs)
    assert pages.stale(res, docs) == []
    for p in sorted(dst.glob("*.csv")):
        if not p.stat().st_size:
            continue
        df = pd.read_csv(p)
        for c in ("estimate",):  # the summaries' estimates (the per-sequence rows are checked by the curves code)
            if c in df.columns:
                df[c] = df[c] + 1.0
        df.to_csv(p, index=False)
    bad = pages.stale(res, docs)
    assert bad and any(f"{run.study}.md" in b for b in bad), bad


def test_fill_block_replaces_only_between_its_markers():
    text = "a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "new 1\nnew 2") == "a\n<!-- x:start -->\nnew 1\nnew 2\n<!-- x:end -->\nb\n"
    assert pages.fill_block(text, "x", "") == "a\n<!-- x:start -->\n<!-- x:end -->\nb\n"
    with pytest.raises(ValueError, match="y:start"):
        pages.fill_block(text, "y", "z")


def _headlines(**cols):
    n = len(cols["corpus"])
    base = dict(question=["causal"] * n, model=["m"] * n, what=["w"] * n, n=[40] * n, exploratory=[False] * n)
    return pd.DataFrame({**base, **cols})


def test_agreement_says_yes_only_for_the_same_verdict_and_names_an_exploratory_run():
    same = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "depends"]))
    assert same["replicated"].tolist() == ["yes"]
    assert same.loc[0, "readmes"] == "depends (n = 40)"
    small = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "no evidence"],
                                       n=[40, 12], exploratory=[False, True]))
    assert small["replicated"].tolist() == ["not replicated (the readmes run is exploratory)"]
    assert small.loc[0, "readmes"] == "no evidence (n = 12, exploratory)"
    bad = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "no evidence"]))
    assert bad["replicated"].tolist() == ["NO — the corpora disagree"]
    assert pages.agreement(_headlines(corpus=["pydoc"], verdict=["depends"])).empty  # one corpus: nothing to compare
    tiny = pages.agreement(_headlines(corpus=["pydoc", "readmes"], verdict=["depends", "depends"], n=[12, 12],
                                      exploratory=[True, True]))
    assert tiny["replicated"].tolist() == ["same verdict; not a replication (pydoc and readmes: fewer than 32 documents)"]


CLAIM = ("smollm2-135m:L1", "smollm2-135m:L2", "gemma3-270m:L1", "gemma3-270m:L2")


@pytest.fixture(scope="module")
def dose_result():
    """A small dose–response Result (a tiny model's; its verdict rows are rewritten by each test)."""
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models as tm

    from posgen_tl.experiments import causal as cd

    torch.manual_seed(0)
    return cd.run(tm.hf_llama(n_layers=3)[0], corpus=tm.token_corpus(16), n_seq=6, seq_len=20, target_len=5, fracs=(0.0, 0.3),
                  groups=("1", "2"), controls=("C1",), n_ref=5, alpha=3.0, levels=(2e-5,), match_steps=1,
                  progress=False)


def _dose_run(result, folder: Path, model: str, p_iut: dict[str, float], claim: tuple[str, ...] = CLAIM) -> None:
    """``result`` saved as the causal_dose run of ``model`` in ``folder``, each entry's verdict set to 'depends' with
    the intersection–union p given (an entry missing from ``p_iut`` stays as measured; ``claim``: the declared
    family; entries of the run outside it are dropped)."""
    import dataclasses as dc
    import json

    from posgen_tl.experiments import causal as cd

    v, con = result["verdicts"].copy(), result["contrasts"].copy()
    for layers, p in p_iut.items():
        v.loc[v["layers"] == layers, ["verdict", "p_iut", "p_test", "iut_rejects", "binding", "reason"]] = [
            "depends", p, p, True, "destroy − C1", f"destroy − none and destroy − every control reject (largest p {p})"]
        # the binding contrast's own row: its p is the intersection–union p
        con.loc[(con["layers"] == layers) & (con["contrast"] == "destroy − C1"), ["estimate", "ci_low", "ci_high", "p"]] = [
            0.004, 0.001, 0.007, p]
    mine = {e.split(":", 1)[1] for e in claim if e.startswith(f"{model}:")}
    v = v[v["layers"].isin(mine)].reset_index(drop=True)
    res = dc.replace(result, tables={**result.tables, "verdicts": v, "contrasts": con}, meta={**result.meta, "model": model,
                                                                           "claim": list(claim)},
                     config={**result.config, "claim": list(claim)})
    folder.mkdir(parents=True)
    files = [p.name for p in cd.save(res, folder)]
    meta = dict(study="causal", model=model, preset="default", command="posgen-tl study causal …",
                git_commit="0" * 40, config=res.config, wall_seconds=1.0, files=files)
    (folder / "causal.json").write_text(json.dumps(meta))


def test_causal_headline_quotes_the_claim_table_not_its_run(tmp_path, dose_result):
    """An entry's headline verdict is the claim's (Holm over the WHOLE declared claim), its effect, interval and p
    those of destroy − none, with the intersection–union and family p labelled beside them."""
    res = tmp_path / "results"
    _dose_run(dose_result, res / "smollm2-135m" / "pydoc" / "causal", "smollm2-135m", {"L1": 0.001, "L2": 0.02})
    _dose_run(dose_result, res / "gemma3-270m" / "pydoc" / "causal", "gemma3-270m", {"L1": 0.004})
    runs = pages.find_runs(res)
    table, method = pages.claim_table(runs, "pydoc")
    assert method.startswith("Holm over the 4 entries")
    assert table.loc["smollm2-135m:L1", "p_family"] == pytest.approx(4 * 0.001)
    assert table.loc["gemma3-270m:L1", "p_family"] == pytest.approx(3 * 0.004)
    assert table.loc["smollm2-135m:L2", "p_family"] == pytest.approx(2 * 0.02)
    assert table.loc["smollm2-135m:L2", "verdict"] == "depends (exploratory)"  # 0.04 < 0.05, 6 documents
    assert table.loc["gemma3-270m:L2", "verdict"].startswith(str(dose_result["verdicts"].iloc[1]["verdict"]))
    head = pages._headline_frame(runs)
    row = head[(head["model"] == "smollm2-135m") & head["what"].str.contains("L2")].iloc[0]
    # one contrast per line: the binding contrast's own effect, interval and p (never destroy − none's p beside it)
    assert (row["p"], row["effect"], row["ci_low"], row["ci_high"]) == (0.02, 0.004, 0.001, 0.007)
    assert row["what"].startswith("destroy − C1 at common damage") and row["verdict"] == "depends"
    text = pages.readme_headlines(runs)
    assert "[causal](docs/results/causal.md)" in text
    # the sentence names every entry run with its verdict in a few words; each entry's table row gives the contrast
    # that decided, its interval and ITS p (the intersection–union p), with the adjustment over the claim beside it
    first = text.splitlines()[0]
    assert "Per entry: " in first and "smollm2-135m L2 depends (exploratory) on pydoc" in first
    assert "gemma3-270m L2 " in first and "destroy − none (nats × p)" not in first
    row = next(x for x in text.splitlines() if x.startswith("| [Does tolerance depend on the pattern? — smollm2-135m L2]"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["destroy − C1 at common damage (nats × p): 0.004 [0.001, 0.007]",
                          "0.02 (its test); 0.04 (Holm over 4)", "6"]
    assert cells[1].startswith("depends (exploratory)")  # (its power beside it where the run has an MDE)


def test_claim_discussion_says_where_the_claim_holds_from_both_corpora(tmp_path, dose_result):
    """An entry holds only where both corpora's claim tables say 'depends'; a second corpus that disagrees
    withdraws it."""
    res = tmp_path / "results"
    for corpus in ("pydoc", "readmes"):
        _dose_run(dose_result, res / "smollm2-135m" / corpus / "causal", "smollm2-135m", {"L1": 0.001})
    text = "\n".join(pages.claim_discussion(pages.find_runs(res)))
    line = next(x for x in text.splitlines() if x.startswith("- **smollm2-135m, layers L1**"))
    assert "the claim holds here" in line
    assert "the claim holds (both corpora) for smollm2-135m:L1" in text
    assert "not run yet: gemma3-270m:L1, gemma3-270m:L2" in text and "- **gemma3-270m, layers L1** — not run yet." in text
    # an entry with one verdict on both corpora is said once, its numbers per corpus where they differ
    same = pages.readme_headlines(pages.find_runs(res)).splitlines()[0]
    assert "smollm2-135m L1 depends (exploratory) on pydoc and readmes" in same
    shutil.rmtree(res / "smollm2-135m" / "readmes")
    _dose_run(dose_result, res / "smollm2-135m" / "readmes" / "causal", "smollm2-135m", {"L1": 0.5})
    text = "\n".join(pages.claim_discussion(pages.find_runs(res)))
    assert "- **smollm2-135m, layers L1** — the corpora disagree: not claimed." in text
    # the headline counts the entries that could be claimed (both corpora run) apart from those run on one
    answer = pages.readme_headlines(pages.find_runs(res)).splitlines()[0]
    assert "(2 of 4 entries run on both so far, 0 on one)" in answer  # smollm2-135m L1, L2; gemma3 not run
    # verdicts differ: said per corpus
    assert "smollm2-135m L1 depends (exploratory) on pydoc, not detected (exploratory) on readmes" in answer
    # the table's second-corpus cell compares the entries' verdicts (their deciding contrasts may differ)
    row = next(x for x in pages.readme_headlines(pages.find_runs(res)).splitlines() if x.startswith("| [Does tolerance "))
    assert "NO — the corpora disagree" in row.rsplit("|", 2)[-2]  # L1 disagrees (L2 agrees)
    shutil.rmtree(res / "smollm2-135m" / "readmes")
    answer = pages.readme_headlines(pages.find_runs(res)).splitlines()[0]
    assert "(0 of 4 entries run on both so far, 2 on one)" in answer


def test_withdrawn_runs_print_no_number_and_give_no_headline():
    old = pages.withdrawn_runs(RESULTS, "causal")
    if not old:
        pytest.skip("no withdrawn runs committed")
    text, figs = pages.study_page("causal", [], old)
    assert pages.WITHDRAWN["causal"][1] in text and not figs
    part = text.split("## Earlier runs (v2, withdrawn)", 1)[1]
    assert "<details" in part.split("|", 1)[0]  # collapsed: the reader sees why they were withdrawn, not the runs
    tables = [x for x in part.splitlines() if x.startswith("| ")]
    assert tables and all(x.count("|") == 4 for x in tables)  # layers, verdict word, documents: nothing else
    causal = [r for r in pages.find_runs(RESULTS) if r.study == "causal"]  # (the claim table reads only these)
    v3 = [(r, f) for r, f in pages._findings(causal) if r.study == "causal"]
    assert all(not str(r.folder).split("results", 1)[1].startswith("/v2") for r, _ in v3)  # headlines: v3 runs only
    assert all(f"`results/v2/{r.model}/{r.corpus}/causal/`" in text for r in old)


def test_the_causal_page_shows_at_most_250_lines_with_its_details_collapsed():
    """The committed causal page: what a reader sees without opening a collapsed block stays short."""
    text = (ROOT / "docs" / "results" / "causal.md").read_text()
    depth, shown = 0, 0
    for line in text.splitlines():
        depth += line.count("<details") - line.count("</details>")
        shown += depth == 0
    assert depth == 0, "an unclosed <details> block"
    assert shown <= 250, f"{shown} lines of docs/results/causal.md are visible with every block collapsed"


def _table_headers(md: str) -> list[list[str]]:
    """The header cells of every markdown table in ``md`` (a header row is the line above a ``|---|`` rule)."""
    lines = md.splitlines()
    return [[c.strip() for c in lines[i - 1].strip("|").split("|")]
            for i, x in enumerate(lines) if i and x.startswith("|---")]


def test_every_results_page_answers_before_any_table_and_heads_columns_with_words():
    """What a reader sees first: the question, then the answer sentence, both above the first table; no table on
    any results page is headed by a code identifier (``ci_low``, ``p_kind``)."""
    import re

    for page in sorted((DOCS / "results").glob("*.md")):
        text = page.read_text()
        first_table = text.find("\n|")
        q, a = text.find("**Question.**"), text.find("**Answer.**") if page.stem != "index" else text.find("**Does ")
        assert 0 < q < first_table or page.stem == "index", page.name
        assert 0 < a < first_table, f"{page.name}: the answer is not above the first table"
        for head in _table_headers(text):
            ident = [h for h in head if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", h)]
            assert not ident, f"{page.name}: column headers {ident} are code identifiers"


def test_answer_sentence_is_derived_from_the_verdicts(monkeypatch):
    """The answer counts the runs per verdict, gives the range of effects and where their intervals lie, and says
    'exploratory' when runs rest on fewer than 32 documents — from the findings alone."""
    from posgen_tl.report.html import Finding

    runs = [pages.Run("tolerance", m, c, Path("."), {}) for m in ("a", "b") for c in ("pydoc", "readmes")]
    fs = {("a", "pydoc"): Finding("tolerance", "NLL rises with swaps", 0.02, "AUC (u)", (0.01, 0.03), 0.001, 40),
          ("a", "readmes"): Finding("tolerance", "NLL rises with swaps", 0.04, "AUC (u)", (0.02, 0.05), 0.001, 40),
          ("b", "pydoc"): Finding("tolerance", "no evidence", 0.001, "AUC (u)", (-0.01, 0.02), 0.4, 12),
          ("b", "readmes"): Finding("tolerance", "NLL rises with swaps", 0.03, "AUC (u)", (0.01, 0.05), 0.01, 40)}
    monkeypatch.setattr(pages, "_findings", lambda rs: [(r, fs[(r.model, r.corpus)]) for r in rs])
    text = pages.answer_sentence("tolerance", runs)
    assert text.startswith("NLL rises with swaps in 3 of 4 runs (a · pydoc, a · readmes, b · readmes); no evidence "
                           "in 1 of 4 runs (b · pydoc): AUC (u) 0.001 to 0.04, 3 of 4 95 % intervals exclude 0.")
    assert "Exploratory: b · pydoc rests on fewer than 32 documents (n = 12 documents)" in text
    fs[("b", "pydoc")] = Finding("tolerance", "NLL rises with swaps", 0.01, "AUC (u)", (0.005, 0.02), 0.01, 40)
    text = pages.answer_sentence("tolerance", runs)
    assert text == "NLL rises with swaps in all 4 runs: AUC (u) 0.01 to 0.04, every 95 % interval above 0."
    tables = pages.answer_table("tolerance", runs)
    assert [w for w, _ in tables] == ["AUC (u)"]
    t = tables[0][1]
    assert list(t.columns) == ["run", "answer", "effect", "95 % interval", "p", "n", "second corpus"]
    assert t.loc[0, "95 % interval"] == "[0.01, 0.03]" and t.loc[0, "n"] == "40 documents"
    assert t.loc[0, "second corpus"] == "yes"


def test_an_entry_rejected_before_the_family_adjustment_is_not_called_undetectable():
    """Every contrast rejecting at the test's level while the family adjustment does not: the sentence says exactly
    that (with both p), never 'not detectably more than a control' (whose interval may well exclude 0)."""
    import pandas as pd

    from posgen_tl.report import claim

    row = pd.Series(dict(verdict="not detected", estimate=0.00155, ci_low=0.00115, ci_high=0.00196, mde=0.0015,
                         p_iut=0.0484, reason="destroy − none and destroy − every control … reject", iut_rejects=True,
                         binding="destroy − C4", binding_estimate=0.000816, binding_ci_low=6.55e-06,
                         binding_ci_high=0.00158, p_family=0.194))
    text = claim._entry_clauses("gemma3-270m:L12-17", {"readmes": row})
    assert "not detectably" not in text
    assert "destroy − every control at common damage reject in one direction at level 0.05 (weakest: destroy − C4 " \
           "0.000816" in text
    assert "p 0.0484), but not after the adjustment for the claim's entries (p 0.194)" in text
    no_rejection = pd.Series({**row.to_dict(), "iut_rejects": False, "p_iut": 0.3})
    assert "not detectably more than a control" in claim._entry_clauses("gemma3-270m:L12-17", {"readmes": no_rejection})


def test_a_confirmatory_test_is_read_on_its_own_beside_the_exploratory_claim(tmp_path, dose_result):
    """A corpus whose run declares another claim (one entry, fresh documents) is not a third 'corpus' of the
    exploratory claim: the primary answer counts pydoc and readmes only and adds one sentence for the confirmatory
    test — its verdict over its own family and whether it was powered; the discussion gives it its own section."""
    res = tmp_path / "results"
    for corpus in ("pydoc", "readmes"):
        _dose_run(dose_result, res / "smollm2-135m" / corpus / "causal", "smollm2-135m", {"L1": 0.5})
    _dose_run(dose_result, res / "smollm2-135m" / "docstrings" / "causal", "smollm2-135m", {"L2": 0.03},
              claim=("smollm2-135m:L2",))
    runs = pages.find_runs(res)
    exploratory, confirmatory = claim.claim_tables(runs)
    assert set(exploratory) == {"pydoc", "readmes"} and list(confirmatory) == ["docstrings"]
    assert confirmatory["docstrings"].loc["smollm2-135m:L2", "p_family"] == pytest.approx(0.03)  # its own family
    answer = pages.readme_headlines(runs).splitlines()[0]
    assert "(2 of 4 entries run on both so far, 0 on one)" in answer  # the docstrings run is not a third corpus
    conf = answer[answer.index("Confirmatory test"):]
    mde = claim.sig3(confirmatory["docstrings"].loc["smollm2-135m:L2", "mde"])
    b = confirmatory["docstrings"].loc["smollm2-135m:L2"]
    assert conf == ("Confirmatory test of smollm2-135m L2 on 6 fresh documents (docstrings, declared before its run): "
                    f"depends (fewer than 32 documents) — {b['binding']} at common damage "
                    f"{claim.sig3(b['binding_estimate'])} [{claim.sig3(b['binding_ci_low'])}, "
                    f"{claim.sig3(b['binding_ci_high'])}] nats × p, p {claim.sig3(b['p_iut'])} (the largest of its "
                    f"intersection–union test), NOT powered (the whole test's MDE {mde} vs the effect of interest 0.001 "
                    "nats × p).")
    # an exploratory-sized confirmatory "depends", or an unpowered one, never leads the answer
    assert answer.startswith("**Does position tolerance depend on the key pattern in the fast RoPE bands?** Not "
                             "established")
    # a powered confirmatory "depends" at 32+ documents leads it, with its deciding contrast and its size
    import unittest.mock as um
    t = confirmatory["docstrings"].copy()
    t.loc["smollm2-135m:L2", ["verdict", "mde", "binding_estimate"]] = ["depends", 0.0005, 0.0004]
    with um.patch.object(claim, "claim_tables", lambda runs: (exploratory, {"docstrings": t})):
        q, ans = claim.primary_claim(runs)
    assert ans.startswith("Yes for smollm2-135m L2 in a powered confirmatory test on fresh documents; not established "
                          "elsewhere: no entry of the exploratory claim shows a dependence on both corpora (2 of 4 "
                          "entries run on both so far, 0 on one)")
    assert "(docstrings, declared before its run): depends — " in ans
    assert "(the largest of its intersection–union test; smaller than the effect of interest 0.001 nats × p), " \
           "powered (the whole test's MDE 0.0005" in ans
    # the answer names each entry's verdict per corpus in a few words; the numbers are in the discussion
    assert " Per entry: smollm2-135m L1 " in answer and "destroy − none (nats × p)" not in answer
    text = "\n".join(pages.claim_discussion(runs))
    assert "### The confirmatory test" in text and text.count("Confirmatory test (its own family") == 1
    assert "run on 6 documents no exploratory run saw (docstrings): smollm2-135m L2 (docstrings): depends " \
           "(exploratory) — " in text and "NOT powered for the smallest effect of interest 0.001 nats × p" in text
    # the exploratory claim is the one declared on the most corpora, whatever the corpora's names
    shutil.rmtree(res / "smollm2-135m" / "pydoc")
    _dose_run(dose_result, res / "smollm2-135m" / "zeta" / "causal", "smollm2-135m", {"L1": 0.5})
    exploratory, confirmatory = claim.claim_tables(pages.find_runs(res))
    assert set(exploratory) == {"readmes", "zeta"} and list(confirmatory) == ["docstrings"]


def test_two_confirmatory_tests_on_one_corpus_are_each_their_own_family(tmp_path, dose_result):
    """Two models' confirmatory runs on the same fresh corpus, each declaring its own one-entry claim, are two
    families: each entry's p over its claim is its own p (Holm over 1), both get a headline row and a sentence; claims
    that overlap without being the same give no family verdict."""
    res = tmp_path / "results"
    for corpus in ("pydoc", "readmes"):
        _dose_run(dose_result, res / "smollm2-135m" / corpus / "causal", "smollm2-135m", {"L1": 0.5})
    _dose_run(dose_result, res / "smollm2-135m" / "fresh" / "causal", "smollm2-135m", {"L2": 0.03},
              claim=("smollm2-135m:L2",))
    _dose_run(dose_result, res / "gemma3-270m" / "fresh" / "causal", "gemma3-270m", {"L1": 0.02},
              claim=("gemma3-270m:L1",))
    runs = pages.find_runs(res)
    table, method = claim.claim_table(runs, "fresh")
    assert list(table.index) == ["gemma3-270m:L1", "smollm2-135m:L2"] or \
        list(table.index) == ["smollm2-135m:L2", "gemma3-270m:L1"]
    assert table.loc["smollm2-135m:L2", "p_family"] == pytest.approx(0.03)  # not Holm over 2
    assert table.loc["gemma3-270m:L1", "p_family"] == pytest.approx(0.02)
    assert set(table["family_size"]) == {1}
    assert "smollm2-135m:L2: Holm over the 1 entries" in method and "gemma3-270m:L1: Holm over the 1 entries" in method
    exploratory, confirmatory = claim.claim_tables(runs)
    assert set(exploratory) == {"pydoc", "readmes"} and list(confirmatory) == ["fresh"]
    rows = {r["entry"]: r for r in claim.headline_rows(runs) if r["corpus"] == "fresh"}
    assert set(rows) == {"smollm2-135m:L2", "gemma3-270m:L1"}
    assert rows["gemma3-270m:L1"]["p"].endswith("(Holm over 1)")
    sentences = claim.confirmations(runs, short=True)
    assert len(sentences) == 2 and any(x.startswith("Confirmatory test of gemma3-270m L1 on 6 fresh documents (fresh")
                                       for x in sentences)
    # a confirmatory entry that is not testable gives its reason, never "powered"
    t = claim.claim_tables(runs)[1]["fresh"]
    t.loc["gemma3-270m:L1", ["verdict", "reason"]] = ["not testable", "unreachable at the declared damage levels: C3 "
                                                      "(60%) of documents bracket every level (needs 75%); no control"]
    import unittest.mock as um
    with um.patch.object(claim, "claim_tables", lambda runs: ({}, {"fresh": t})):
        said = [x for x in claim.confirmations(runs, short=True) + claim.confirmations(runs) if "gemma3" in x]
    assert len(said) == 2 and all("not testable — unreachable at the declared damage levels: C3 (60%) of documents "
                                  "bracket every level (needs 75%)." in x and "powered" not in x for x in said)
    # an overlapping but different claim on the same corpus: no family verdict
    _dose_run(dose_result, res / "gemma3-270m" / "fresh2" / "causal", "gemma3-270m", {"L1": 0.02},
              claim=("gemma3-270m:L1",))
    _dose_run(dose_result, res / "smollm2-135m" / "fresh2" / "causal", "smollm2-135m", {"L2": 0.03},
              claim=("smollm2-135m:L2", "gemma3-270m:L1"))
    table, method = claim.claim_table(pages.find_runs(res), "fresh2")
    assert table is None and method.startswith("The runs declare different claims")
    # a corpus holding the exploratory claim AND a disjoint confirmatory one: split per claim, not per corpus
    shutil.rmtree(res / "gemma3-270m" / "fresh2")
    shutil.rmtree(res / "smollm2-135m" / "fresh2")
    _dose_run(dose_result, res / "other-model" / "readmes" / "causal", "other-model", {"L1": 0.02},
              claim=("other-model:L1",))
    exploratory, confirmatory = claim.claim_tables(pages.find_runs(res))
    assert set(exploratory) == {"pydoc", "readmes"} and set(confirmatory) == {"fresh", "readmes"}
    assert list(confirmatory["readmes"].index) == ["other-model:L1"]
    assert "other-model:L1" not in exploratory["readmes"].index and "smollm2-135m:L1" in exploratory["readmes"].index
    rows = claim.headline_rows(pages.find_runs(res))
    assert [r["second"] for r in rows if r["corpus"] == "readmes"] == ["confirmatory: fresh documents"]


def test_the_second_corpus_cell_of_the_claim_says_not_testable_and_exploratory(monkeypatch):
    """Verdicts compared per entry: an untestable corpus is named (never 'yes' or 'disagree'), same verdicts of a
    run under 32 documents are not a replication, different tested verdicts disagree."""
    import pandas as pd

    from posgen_tl.report import claim

    t = {"pydoc": pd.DataFrame({"verdict": ["not testable", "not testable", "not detected", "not detected",
                                            "depends"]}, index=list("abcde")),
         "readmes": pd.DataFrame({"verdict": ["not testable", "not detected", "not detected (exploratory)",
                                              "not detected", "not run"]}, index=list("abcde"))}
    monkeypatch.setattr(claim, "claim_tables", lambda runs: (t, {}))
    assert claim.claim_agreement([]) == {"a": "not testable on pydoc and readmes", "b": "not testable on pydoc",
                                         "c": "same verdict; not a replication (fewer than 32 documents)", "d": "yes",
                                         "e": "one corpus only"}
    t["readmes"].loc["d", "verdict"] = "depends"
    assert claim.claim_agreement([])["d"] == "NO — the corpora disagree"


def test_an_entry_whose_contrasts_point_different_ways_shows_its_tests_p_not_the_contrasts(monkeypatch):
    """The README row prints the entry's TEST p (1 when its contrasts point different ways) and says why beside the
    binding contrast's interval; a confirmatory row never calls a small run 'exploratory'."""
    import pandas as pd

    from posgen_tl.report import claim

    base = dict(binding="destroy − C4", binding_estimate=0.00113, binding_ci_low=0.000261, binding_ci_high=0.002,
                n_docs=37, estimate=0.0025, ci_low=0.00133, ci_high=0.00366, mde=0.002, effect=0.001)
    t = pd.DataFrame([dict(base, verdict="not detected", p_iut=0.0182, p_test=1.0, p_family=1.0,
                           reason="the contrasts do not share one direction"),
                      dict(base, verdict="depends", p_iut=0.001, p_test=0.001, p_family=0.002, reason="largest p")],
                     index=["g:L6-11", "g:L12-17"])
    c = pd.DataFrame([dict(base, verdict="depends (exploratory)", p_iut=0.01, p_test=0.01, p_family=0.01, n_docs=20,
                           reason="largest p")], index=["s:L20-29"])
    monkeypatch.setattr(claim, "claim_tables", lambda runs: ({"pydoc": t}, {"fresh": c}))
    split, fine, conf = claim.headline_rows([])
    assert split["p"] == "1 (its test); 1 (Holm over 2)" and "0.0182 (its test)" not in split["p"]
    assert split["effect"].endswith("the contrasts point different ways, so the test's p is 1 (this contrast's own "
                                    "p 0.0182)")
    assert fine["p"] == "0.001 (its test); 0.002 (Holm over 2)" and "point different ways" not in fine["effect"]
    assert conf["answer"] == "depends (fewer than 32 documents); MDE 0.002 > 0.001: not powered"
    assert conf["second"] == "confirmatory: fresh documents"
    c.loc["s:L20-29", "mde"] = 0.0008
    assert claim.headline_rows([])[2]["answer"].endswith("; MDE 0.0008 ≤ 0.001: powered")
