"""The dose–response causal test (posgen_tl.experiments.causal, docs/method.md §5, §8 v3): the pilot sees
only the reference documents, every grid brackets its tuned strength, an interrupted run continues to the same
numbers, a result survives save/load, the family adjustment and the power plan are right."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm

from posgen_tl.engine import dose as dose_mod
from posgen_tl.experiments import causal as cd
from posgen_tl.io.sampling import sample_windows
from posgen_tl.stats.dose import iut_mde
from posgen_tl.stats.familywise import claim_adjust

OPTS = dict(n_seq=8, seq_len=20, target_len=5, fracs=(0.0, 0.3), groups=("1", "2"), controls=("C1", "C3"), n_ref=5,
            alpha=3.0, levels=(2e-5, 5e-5), batch_size=4, match_steps=2, progress=False)


def _corpus(n_docs=16, seed=0):
    return tm.token_corpus(n_docs, seed)


def _spy_dose_rows(monkeypatch, on_call):
    """Route every ``dose_rows`` call through ``on_call(phase, windows)`` (which may raise), ``phase`` being
    ``"pilot"`` inside the pilot's batches and ``"analysed"`` otherwise; returns nothing."""
    import posgen_tl.engine.pilot as pilot_mod

    state = {"phase": "analysed"}
    real_rows, real_batches = dose_mod.dose_rows, pilot_mod.dose_batches

    def in_pilot(*a, **k):
        state["phase"] = "pilot"
        try:
            return real_batches(*a, **k)
        finally:
            state["phase"] = "analysed"

    def spy(model, windows, *a, **k):
        on_call(state["phase"], windows)
        return real_rows(model, windows, *a, **k)

    monkeypatch.setattr(pilot_mod, "dose_batches", in_pilot)
    monkeypatch.setattr(dose_mod, "dose_rows", spy)


@pytest.fixture(scope="module")
def result(llama):
    return cd.run(llama, corpus=_corpus(), **OPTS)


def test_every_grid_brackets_its_tuned_strength(result):
    g = result["grids"]
    assert set(g["condition"]) == {"destroy", "C1", "C3"} and set(g["layers"]) == {"L1", "L2"}
    for r in g.itertuples():
        s = [float(x) for x in r.strengths.split(";")]
        assert s[0] == 0.0 and s == sorted(s)
        assert min(s[1:]) < r.tuned or r.tuned == 0  # a point below …
        assert max(s) > r.tuned or r.tuned == r.cap  # … and above, unless at the cap
        assert max(s) <= r.cap


def test_rows_cover_the_whole_grid_on_every_document(result):
    u = result["units"]
    grid = {(r.layers, r.condition): len(r.strengths.split(";")) for r in result["grids"].itertuples()}
    got = u.groupby(["layers", "condition"])["alpha"].nunique().to_dict()
    assert got == grid
    assert (u.groupby(["layers", "condition", "alpha"])["doc"].nunique() == u["doc"].nunique()).all()


def test_the_pilot_never_sees_the_analysed_documents(llama, monkeypatch):
    seen: dict[str, list[set]] = {"pilot": [], "analysed": []}
    _spy_dose_rows(monkeypatch, lambda phase, w: seen[phase].append(set(w.doc_ids.tolist())))
    ana, ref = sample_windows(llama, _corpus(), n_seq=8, seq_len=24, n_ref=5, seed=0)
    cd.run(llama, windows=(ana, ref), **{**OPTS, "groups": ("2",), "controls": ("C2",)})
    assert set().union(*seen["pilot"]) == set(ref.doc_ids.tolist())  # the pilot saw every reference document …
    assert not set().union(*seen["pilot"]) & set(ana.doc_ids.tolist())  # … and no analysed one
    assert all(s <= set(ana.doc_ids.tolist()) for s in seen["analysed"]) and len(seen["analysed"]) == 2


@pytest.mark.slow
def test_an_interrupted_run_continues_to_the_same_numbers(llama, tmp_path, monkeypatch):
    kw = {**OPTS, "groups": ("2",), "controls": ("C1", "C2")}
    whole = cd.run(llama, corpus=_corpus(), **kw)
    calls = {"analysed": 0, "pilot": 0, "die_at": 2}

    def count(phase, w):
        calls[phase] += 1
        if phase == "analysed" and calls["analysed"] == calls["die_at"]:  # batch 1 finished, batch 2 interrupted
            raise KeyboardInterrupt

    _spy_dose_rows(monkeypatch, count)
    with pytest.raises(KeyboardInterrupt):
        cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **kw)
    assert (tmp_path / "ck" / "pilot.json").exists() and len(list((tmp_path / "ck").glob("batch_*.csv"))) == 1
    calls.update(analysed=0, pilot=0, die_at=0)
    resumed = cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **kw)
    assert (calls["analysed"], calls["pilot"]) == (1, 0)  # only the missing batch ran: no pilot, no first batch
    for name in ("verdicts", "contrasts", "units"):
        pd.testing.assert_frame_equal(resumed[name], whole[name], check_exact=False, rtol=1e-9, atol=1e-12)


def test_a_checkpoint_of_another_design_is_refused(llama, tmp_path):
    kw = {**OPTS, "groups": ("2",), "controls": ("C2",), "n_seq": 4}
    cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **kw)
    with pytest.raises(ValueError, match="belongs to another run"):
        cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **{**kw, "alpha": 2.0})
    # the same design with another n keeps the pilot and drops the batches
    cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **{**kw, "n_seq": 6})
    assert len(list((tmp_path / "ck").glob("batch_*.csv"))) == 2


def test_save_load_render_round_trip(result, tmp_path):
    cd.save(result, tmp_path)
    back = cd.load(tmp_path)
    for name in result.tables:
        pd.testing.assert_frame_equal(back[name], result[name], check_dtype=False, check_exact=False, rtol=1e-12)
    sec, sec2 = cd.render(result), cd.render(back)
    assert sec.verdict == sec2.verdict and len(sec.figures) == 2  # one figure per entry
    v = result["verdicts"].iloc[0]
    # the headline's effect, interval and p are destroy − none's, side by side
    line = cd.headline(v)
    assert line.startswith(f"{v['layers']}: {v['verdict']} — destroy − none at common damage")
    assert f"p = {cd._fmt(v['p'])}" in line and f"[{cd._fmt(v['ci_low'])}, {cd._fmt(v['ci_high'])}]" in line
    assert sec.findings[0].p == pytest.approx(v["p"]) and sec.findings[0].effect == pytest.approx(v["estimate"])
    assert "left out" not in sec.paragraphs[0]  # nothing skipped, nothing said
    skipped = dataclasses.replace(result, config={**result.config, "skip": 192})
    assert "(the first 192 windows of the seeded order left out" in cd.render(skipped).paragraphs[0]


def test_a_headline_quotes_the_binding_contrast_with_its_own_p():
    """Where the intersection–union test ran, the headline's effect, interval and p are those of the contrast that
    decided (its largest p) — never destroy − none's tiny p beside a 'not detected'."""
    v = pd.Series(dict(layers="L20-29", verdict="not detected", estimate=0.00219, ci_low=0.00163, ci_high=0.00273,
                       p=4.06e-9, p_iut=0.833, binding="destroy − C3", n_docs=39, reason="largest p 0.833"))
    con = pd.DataFrame([dict(layers="L20-29", contrast="destroy − none", estimate=0.00219, ci_low=0.00163,
                             ci_high=0.00273, p=4.06e-9),
                        dict(layers="L20-29", contrast="destroy − C3", estimate=6.07e-5, ci_low=-4.82e-4,
                             ci_high=6.15e-4, p=0.833)])
    f = cd._finding(v, con)
    assert (f.effect, f.ci, f.p) == (6.07e-5, (-4.82e-4, 6.15e-4), 0.833) and f.verdict == "not detected"
    assert f.what.startswith("destroy − C3 at common damage") and f.what.endswith("L20-29 (nats × p)")
    g = cd._finding(pd.Series({**v.to_dict(), "verdict": "not testable", "binding": "", "p_iut": np.nan}), con)  # no test
    assert (g.effect, g.p) == (0.00219, 4.06e-9) and g.what.startswith("destroy − none")


def test_unreachable_levels_make_the_entry_not_testable(result):
    v = result["verdicts"]
    # levels of 2e-5 / 5e-5 nats are beyond what these controls reach on a random tiny model
    assert set(v["verdict"]) == {"not testable"} and v["unreachable"].str.len().gt(0).all()


def test_family_adjustment():
    adj, _ = claim_adjust([0.01, 0.04, np.nan], 3)  # a not-testable entry still counts in the family
    assert np.allclose(adj[:2], [0.03, 0.08]) and np.isnan(adj[2])  # 3 × 0.01, then 2 × 0.04
    adj, how = claim_adjust([0.01, 0.04], 2)
    assert how == "Holm over the 2 entries of this run" and np.allclose(adj, [0.02, 0.04])
    adj, how = claim_adjust([0.03, 0.01], 2)
    assert np.allclose(adj, [0.03, 0.02])  # step-down keeps the order
    adj, how = claim_adjust([0.01, 0.3], 4)
    assert how == "Bonferroni bound over the declared claim of 4 entries" and np.allclose(adj, [0.04, 1.0])
    with pytest.raises(ValueError, match="smaller than"):
        claim_adjust([0.1, 0.2, 0.3], 2)


def test_a_depends_above_the_family_level_is_not_detected():
    rows = [dict(layers="L1", verdict="depends", p_iut=0.03, p_test=0.03, reason="r"),
            dict(layers="L2", verdict="depends", p_iut=0.001, p_test=0.001, reason="r")]
    v = cd._verdicts(rows, cd.Config(), 4)
    assert list(v["verdict"]) == ["not detected", "depends"] and np.allclose(v["p_family"], [0.12, 0.004])
    assert "after the adjustment" in v.loc[0, "reason"]


def test_needed_n_is_the_smallest_n_that_reaches_the_effect():
    sds = [0.0015, 0.002, 0.0018]
    n = cd.needed_n(sds, 0.0011, alpha=0.0125)
    assert iut_mde(sds, n, alpha=0.0125) <= 0.0011 < iut_mde(sds, n - 1, alpha=0.0125)
    assert cd.needed_n([np.nan], 0.001, alpha=0.05) is None


@pytest.mark.parametrize("kw,match", [
    (dict(relative=(1.0, 2.0)), "below and above"),
    (dict(relative=(0.5, 2.0)), "the tuned strength \\(1\\)"),
    (dict(levels=(0.1, -1.0)), "levels must be positive"),
    (dict(effect=0.0), "effect must be"),
    (dict(n_seq=2), "at least 3 documents"),
    (dict(fracs=(0.1, 0.2)), "must include 0"),
    (dict(skip=-1), "skip=-1 must be at least 0"),
])
def test_bad_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        cd.Config(**kw).check()


@pytest.mark.parametrize("refusal", ["corpus", "model"])
def test_a_corpus_or_model_refusal_is_a_skipped_result(refusal, monkeypatch, tmp_path):
    """A corpus that cannot give the windows, or a model the library refuses by name, gives a Result that says
    why (a skipped section, a 'not testable' headline), saved and loaded like any other; a plain ValueError
    propagates."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.io.corpus import CorpusError

    err = CorpusError("need at least 2 documents, got 1") if refusal == "corpus" else CaptureError("no hook_rot_k")
    monkeypatch.setattr(cd.base, "gate", lambda *a, **k: None)

    def refuse(*a, **k):
        raise err

    monkeypatch.setattr(cd, "sample_windows", refuse)
    monkeypatch.setattr("posgen_tl.hooks.capture.probe_hooks", lambda m: (type("S", (), {"n_layers": 3,
                                                                                          "model_name": "m"})(), None))
    res = cd.run_or_skip(None, cd.Config(), progress=False)
    assert res.meta["skipped"].endswith(str(err)) and not res.tables
    cd.save(res, tmp_path)
    sec = cd.render(cd.load(tmp_path))
    assert str(err) in sec.verdict and [f.verdict for f in sec.findings] == ["not testable"]
    assert ("corpus of several documents" in sec.paragraphs[0]) == (refusal == "corpus")

    def bad(*a, **k):
        raise ValueError("a bad option")

    monkeypatch.setattr(cd, "sample_windows", bad)
    with pytest.raises(ValueError, match="a bad option"):
        cd.run_or_skip(None, cd.Config(), progress=False)


def test_an_entry_without_levels_is_not_testable(result):
    """Destroy that damages no pilot document leaves no level to declare: the entry is 'not testable' with the
    reason, its contrast tables are empty but keep their columns (they save and load), and nothing is invented."""
    u = result["units"][result["units"]["layers"] == "L1"]
    row, con, con_u, cur = cd._entry_tables("L1", u, (), ["C1", "C3"], cd.Config(), 2)
    assert row["verdict"] == "not testable" and row["reason"] == cd.NO_LEVELS and np.isnan(row["p_iut"])
    assert con.empty and list(con.columns) == cd.CONTRAST_COLUMNS and cur.empty
    v = cd._verdicts([row], cd.Config(), 2)
    assert v.loc[0, "verdict"] == "not testable" and np.isnan(v.loc[0, "p_family"])


def test_the_claim_must_hold_the_run_and_names_its_groups():
    cfg = cd.Config(claim=("m:middle", "other:L6-11"))
    claim, whole = cfg.claim_entries("m", ["L10-19"], 30)
    assert claim == ["m:L10-19", "other:L6-11"] and not whole  # a larger family: the Bonferroni bound
    assert cd.Config().claim_entries("m", ["L10-19", "L20-29"], 30) == (["m:L10-19", "m:L20-29"], True)
    with pytest.raises(ValueError, match="not in the declared claim"):
        cd.Config(claim=("other:L6-11", "other:L12-17")).claim_entries("m", ["L10-19"], 30)
    with pytest.raises(ValueError, match="twice"):
        cd.Config(claim=("m:middle", "m:L10-19")).claim_entries("m", ["L10-19"], 30)
    with pytest.raises(ValueError, match="expected model:group"):
        cd.Config(claim=("middle",)).claim_entries("m", ["L10-19"], 30)


def test_resuming_at_the_first_edited_layer_changes_no_number(llama, monkeypatch):
    """The pilot's tuning and every edited pass resume at the condition's first edited layer from the unedited
    pass's residual there; with re-entry switched off (every block computed) the run gives the same grids,
    rows and verdicts up to float rounding."""
    import posgen_tl.engine.conditions as cond_mod
    import posgen_tl.engine.dose as dose_mod2
    import posgen_tl.engine.pilot as pilot_mod

    resumed = {"n": 0}
    real_nll = dose_mod2.nll_on_target

    def counted(*a, **k):
        resumed["n"] += k.get("resid_at") is not None
        return real_nll(*a, **k)

    for mod in (cond_mod, pilot_mod):
        monkeypatch.setattr(mod, "nll_on_target", counted)
    kw = {**OPTS, "controls": ("C1", "C2")}
    fast = cd.run(llama, corpus=_corpus(), **kw)
    assert resumed["n"] > 0
    resumed["n"] = 0
    for mod in (cond_mod, dose_mod2, pilot_mod):
        monkeypatch.setattr(mod, "first_edited", lambda c: None)
    full = cd.run(llama, corpus=_corpus(), **kw)
    assert resumed["n"] == 0  # nothing resumed: the reference computes every block
    pd.testing.assert_frame_equal(full["grids"], fast["grids"], check_exact=False, rtol=1e-5, atol=1e-7)
    for name in ("units", "contrasts", "verdicts"):
        pd.testing.assert_frame_equal(full[name], fast[name], check_exact=False, rtol=1e-5, atol=1e-6)


def test_an_interrupted_pilot_continues_from_its_tuning_and_finished_batches(llama, tmp_path, monkeypatch):
    import posgen_tl.engine.pilot as pilot_mod

    kw = {**OPTS, "groups": ("2",), "controls": ("C1", "C2")}  # 5 reference windows: 2 pilot batches of 4
    whole = cd.run(llama, corpus=_corpus(), **kw)
    calls = {"pilot": 0, "analysed": 0, "tune": 0, "die_at": 2}

    def count(phase, w):
        calls[phase] += 1
        if phase == "pilot" and calls["pilot"] == calls["die_at"]:
            raise KeyboardInterrupt

    _spy_dose_rows(monkeypatch, count)
    with pytest.raises(KeyboardInterrupt):
        cd.run(llama, corpus=_corpus(), checkpoint=tmp_path / "ck", **kw)
    ck = tmp_path / "ck"
    assert (ck / "pilot_tuned.json").exists() and not (ck / "pilot.json").exists()
    assert len(list(ck.glob("pilot_batch_*.csv"))) == 1
    real_tune = pilot_mod._tune

    def counted_tune(*a, **k):
        calls["tune"] += 1
        return real_tune(*a, **k)

    calls.update(pilot=0, analysed=0, die_at=0)
    monkeypatch.setattr(pilot_mod, "_tune", counted_tune)
    resumed = cd.run(llama, corpus=_corpus(), checkpoint=ck, **kw)
    assert (calls["pilot"], calls["tune"]) == (1, 0)  # only the missing pilot batch ran; the tuning was kept
    assert (ck / "pilot.json").exists() and not list(ck.glob("pilot_batch_*")) and not (ck / "pilot_tuned.json").exists()
    pd.testing.assert_frame_equal(resumed["grids"], whole["grids"], check_exact=False, rtol=1e-12)
    pd.testing.assert_frame_equal(resumed["pilot_units"], whole["pilot_units"], check_exact=False, rtol=1e-9, atol=1e-12)
    for name in ("verdicts", "contrasts", "units"):
        pd.testing.assert_frame_equal(resumed[name], whole[name], check_exact=False, rtol=1e-9, atol=1e-12)


def test_long_texts_run_the_whole_study_in_chunks_to_the_same_numbers(llama, result, monkeypatch):
    """Beyond CHUNK_ABOVE (lowered here to 16 of the 20 tokens) the pilot's tuning and every dose pass run a chunk of
    8 positions at a time through the model's cache — no whole forward keeps attention maps or residuals — and the
    study's grids, units, contrasts and verdicts are the whole run's up to float rounding."""
    import posgen_tl.engine.dose as dose_mod2
    import posgen_tl.hooks.chunked as ch

    monkeypatch.setattr(ch, "CHUNK_ABOVE", 16)
    monkeypatch.setattr(ch, "CHUNK", 8)
    ran = {"chunks": 0}
    real_chunks = ch.run_chunks

    def counted(*a, **k):
        ran["chunks"] += 1
        return real_chunks(*a, **k)

    import posgen_tl.hooks.positions as ps

    monkeypatch.setattr(ps, "run_chunks", counted)
    monkeypatch.setattr(dose_mod2, "_whole_batch", lambda *a, **k: pytest.fail("a dose batch ran whole"))
    long = cd.run(llama, corpus=_corpus(), **OPTS)
    assert ran["chunks"] > 0
    pd.testing.assert_frame_equal(long["grids"], result["grids"], check_exact=False, rtol=1e-5, atol=1e-6)
    for name in ("units", "contrasts", "verdicts"):
        pd.testing.assert_frame_equal(long[name], result[name], check_exact=False, rtol=1e-5, atol=1e-6)
