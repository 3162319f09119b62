"""The Config machinery every experiment shares (posgen_tl.experiments.base)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd
import pytest

from posgen_tl.experiments import base, registry


@dataclass(frozen=True)
class Demo(base.Config):
    NAME: ClassVar[str] = "demo"
    n_ref: int = base.option(4, "reference windows", "int", quick=2, full=8)
    layers: Any = base.option("all", "layers", "layers", quick="every5")
    fracs: tuple[float, ...] = base.option((0.0, 0.1), "fractions", "floats")
    pairs: tuple[tuple[str, str], ...] = base.option((), "pairs", "pairs")


def test_presets_and_text():
    assert Demo.preset("quick").n_ref == 2 and Demo.preset("quick").n_seq == 2 and Demo.preset("full").n_ref == 8
    c = Demo.from_text({"layers": "10-12,20", "fracs": "0,0.5", "pairs": "d3:all,d3:20-29"}, "full", seed=3)
    assert c.layers == (10, 11, 12, 20) and c.fracs == (0.0, 0.5) and c.seed == 3 and c.n_ref == 8
    assert c.pairs == (("d3", "all"), ("d3", "20–29"))
    assert Demo.from_text({"layers": "middle"}).layers == "middle"
    assert Demo.from_text({"corpus": "none"}).corpus is None


@pytest.mark.parametrize("params,match", [({"n_ref": "0"}, "not positive"), ({"layers": "ten"}, "layers='ten'"),
                                          ({"layers": "19-10"}, "backwards"), ({"twin": "maybe"}, "boolean"),
                                          ({"pairs": "d3"}, "source:group"), ({"nope": "1"}, "unknown parameter 'nope' for demo"),
                                          ({"fracs": ","}, "empty list")])
def test_bad_text_names_key_and_kind(params, match):
    with pytest.raises(ValueError, match=match):
        Demo.from_text(params)


def test_replace_checks_names_and_preset_names():
    with pytest.raises(ValueError, match="demo has no option nref; accepted: .*n_ref"):
        Demo().replace(nref=3)
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        Demo.preset("fast")
    with pytest.raises(TypeError, match="expected a"):
        base.config_of(Demo, base.Config(), {})
    assert base.config_of(Demo, None, {"n_ref": 6}).n_ref == 6


def test_resolve_layers():
    assert base.resolve_layers("all", 4) == [0, 1, 2, 3] and base.resolve_layers(None, 2) == [0, 1]
    assert base.resolve_layers("every5", 12) == [0, 5, 10, 11]
    assert base.resolve_layers("every10", 30) == [0, 10, 20, 29] and base.resolve_layers("every1", 3) == [0, 1, 2]
    assert base.parse_value("layers", "Every10") == "every10" and base.parse_value("layers", "3,4") == (3, 4)
    for bad in ("every0", "everyx", "sometimes"):
        with pytest.raises(ValueError):
            base.resolve_layers(base.parse_value("layers", bad), 30)
    assert base.resolve_layers("middle", 30) == list(range(10, 20))
    assert base.resolve_layers((3, 1, 3), 4) == [1, 3]
    with pytest.raises(ValueError, match=r"layers \[7\] do not exist in a 4-layer model"):
        base.resolve_layers((7,), 4)


def test_describe_lists_every_option_with_presets():
    text = Demo.describe()
    assert "--n-ref (int; default 4; quick 2; full 8)  reference windows" in text
    assert "--fracs (floats; default 0.0,0.1)" in text and "--seed (count; default 0)" in text
    assert base.parse_assignments(["n-ref=8", "layers=10-12"]) == {"layers": "10-12", "n_ref": "8"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        base.parse_assignments(["layers"])
    with pytest.raises(ValueError, match="twice"):
        base.parse_assignments(["a=1", "a=2"])


@pytest.mark.parametrize("study", registry.ORDER)
def test_only_a_corpus_or_model_refusal_skips_a_stage(study, tmp_path, monkeypatch):
    """A corpus that cannot give the windows (CorpusError) or a model the library refuses (CaptureError) skips
    the stage: a Result with no tables whose status names the reason, which survives save/load and renders as a
    skipped section with a hint that fits it; any other error — a bug, a bad option, even a plain ValueError —
    propagates and gives no Result."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.io.corpus import CorpusError

    mod = registry.experiment(study)

    def corpus_fails(*a, **k):
        raise CorpusError("need at least 2 documents to split analysed/reference, got 1")

    monkeypatch.setattr(mod, "run", corpus_fails)
    res = registry.run_or_skip(study, None, mod.Config())
    assert res.tables == {} and res.skipped.endswith("skipped: need at least 2 documents to split analysed/reference, "
                                                     "got 1"), res.meta
    registry.save(study, res, tmp_path)
    back = registry.load(study, tmp_path)
    assert back.skipped == res.skipped and back.config == res.config
    sec = mod.render(back)  # what a reader sees: the reason, and a hint about the corpus
    assert "need at least 2 documents" in sec.verdict and "corpus of several documents" in sec.paragraphs[0]
    from posgen_tl.report.html import QUESTIONS

    assert [f.verdict for f in sec.findings] == (["not testable"] if study in QUESTIONS else [])

    def model_refuses(*a, **k):
        raise CaptureError("gptj: hook_attn_scores holds 'post_softmax' values, not pre-softmax logits; logit "
                           "substitution is impossible on this model")

    monkeypatch.setattr(mod, "run", model_refuses)
    sec = mod.render(registry.run_or_skip(study, None, mod.Config()))
    assert "post_softmax" in sec.verdict and "cannot be analysed this way" in sec.paragraphs[0]

    def bug(*a, **k):
        raise ValueError("x has shape (3, 32, 1, 16); expected [batch, pos, 4, 16]")

    monkeypatch.setattr(mod, "run", bug)
    with pytest.raises(ValueError, match="expected"):
        registry.run_or_skip(study, None, mod.Config())


def test_a_result_answers_with_its_tables_as_attributes():
    from posgen_tl.experiments import exactness, tolerance
    from posgen_tl.experiments.base import Result

    t = pd.DataFrame({"a": [1]})
    r = Result({"summary": t})
    assert r.summary is t and r["summary"] is t
    with pytest.raises(AttributeError, match=r"no table or attribute 'rows'; its tables: \['summary'\]"):
        r.rows  # noqa: B018
    assert tolerance.Result({"curves": t, "tost": t}).rows is t  # the aliases of an experiment
    assert tolerance.Result({"curves": t, "tost": t}).equivalence is t
    assert exactness.Result({"layers": t}).table is t
    assert not hasattr(Result(), "__array__")  # dunder look-ups are never tables (numpy, pickle, copy)


def test_the_shared_twin_is_built_once_per_seed_and_an_experiment_gets_its_own_seeds(tmp_path):
    """A report builds the random twin once and hands it to every experiment; an experiment whose config has another
    seed (``--param NAME.seed=3``) gets the twin of THAT seed — the one its config records — not the run's."""
    import tiny_models as tm
    import torch

    from posgen_tl.io.models import random_twin
    from posgen_tl.report.context import Context, OutFolder

    model = tm.hf_llama()[0]
    ctx = Context(model, OutFolder(tmp_path), "tiny", seed=0)
    t0 = ctx.twin()
    assert ctx.twin(0) is t0 and ctx.twin() is t0  # built once
    t3 = ctx.twin(3)
    assert t3 is not t0 and ctx.twin(3) is t3
    fresh = random_twin(model, 3)
    for (n, p), (_, q) in zip(t3.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert not all(torch.equal(p, q) for p, q in zip(t0.parameters(), t3.parameters(), strict=True))
    assert base.twin_of(model, ctx.twin, 3) is t3 and base.twin_of(model, ctx.twin, 0) is t0
    assert base.twin_of(model, lambda: fresh, 0) is fresh  # a callable without parameters: called as is
    assert base.twin_of(model, fresh, 0) is fresh
