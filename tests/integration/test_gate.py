"""The gate (issue #32): no public function that returns numbers about attention runs on layers whose
exactness check has not passed — proven on a model built to fail, for every name of ``pg.__all__``."""

from __future__ import annotations

import warnings

import arch_matrix as am
import pytest
import torch

import posgen_tl as pg
from posgen_tl.hooks.gate import UncheckedModelError, UncheckedWarning, check_result

N = 24


def _leak_mass(x, hook):
    """Attention mass the spec does not know about (like unmodelled learned sinks): layer 1's pattern × 0.9."""
    return x * 0.9


def _model_built_to_fail(root, unchecked=False):
    model = pg.load_model(str(am.build_folder(am.ARCHS["llama"], root)), unchecked=unchecked)
    model.hook_dict["blocks.1.attn.hook_pattern"].add_hook(_leak_mass, is_permanent=True)
    return model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def bad(root):
    return _model_built_to_fail(root)


def _toks():
    return am._tokens(N)


def _small(**kw):
    return dict(progress=False, **kw)


#: every callable of pg.__all__ that returns numbers about attention, and how to call it on layer 1
GATED = {
    "capture_qk": lambda m: pg.capture_qk(m, _toks()),
    "stream_qk": lambda m: pg.stream_qk(m, _toks(), lambda c: None),
    "decompose_head": lambda m: pg.decompose_head(m, _toks(), layer=1, head=0),
    "decompose_model": lambda m: pg.decompose_model(m, None, **_small()),
    "feature_pattern": lambda m: pg.feature_pattern(m, None, **_small()),
    "head_taxonomy": lambda m: pg.head_taxonomy(m, None, **_small()),
    "intervention_hooks": lambda m: pg.intervention_hooks(m, pg.Intervention("destroy", [0], layers=[1]),
                                                          {1: torch.zeros(2, 16)}),
    "key_means": lambda m: pg.key_means(m, _toks()),
    "causal_study": lambda m: pg.causal_study(m, None, **_small()),
    "sufficiency": lambda m: pg.sufficiency(m, None, **_small()),
    "gap_probe": lambda m: pg.gap_probe(m, None, **_small()),
    "run": lambda m: pg.run("sufficiency", m, None, **_small()),  # the one door: every experiment's run is gated
}
#: the rest of pg.__all__, and why each needs no gate
EXEMPT = {
    "load_model": "builds a model", "random_twin": "builds a model", "corpus_tokens": "text to token ids",
    "rope_spec": "the spec the check compares", "probe_hooks": "which hooks fire (the check's first step)",
    "exactness_table": "the check itself", "Intervention": "a description of an edit, no numbers",
    "nll_on_target": "the model's own loss; reads no q/k (hooks that rewrite attention are gated where built)",
    "transposition_curve": "the model's own loss under token swaps; reads no q/k",
    "RopeError": "an error", "CaptureError": "an error", "CorpusError": "an error", "ModelLoadError": "an error",
}


def test_every_public_callable_is_gated_or_exempt_with_a_reason():
    names = {n for n in pg.__all__ if not isinstance(getattr(pg, n), type(pg))}  # modules are namespaces
    assert not names - set(GATED) - set(EXEMPT), names - set(GATED) - set(EXEMPT)  # every public callable covered
    assert all(callable(getattr(pg, n)) for n in (*GATED, *EXEMPT))  # and every listed name is pg's (e.g. gap_probe)
    assert not set(GATED) & set(EXEMPT)


def test_the_model_built_to_fail_fails_its_check_on_layer_1_only(bad):
    table = check_result(bad).set_index("layer")
    assert table.loc[0, "status"] == "passed"
    assert table.loc[1, "status"] == "failed" and "attention pattern differs" in table.loc[1, "reason"]


@pytest.mark.parametrize("name", sorted(GATED))
def test_each_gated_function_refuses_the_failed_layer_by_name(bad, name):
    with pytest.raises(UncheckedModelError, match=r"refused — the exactness check did not pass .* layer 1 failed: "
                                                  r"attention pattern differs .* unchecked=True"):
        GATED[name](bad)


def test_layers_that_passed_stay_usable(bad):
    assert set(pg.capture_qk(bad, _toks(), [0])) == {0}
    res = pg.decompose_head(bad, _toks(), layer=0, head=1)
    assert res.layer == 0


def test_the_opt_out_warns_at_every_call_and_computes(root):
    model = _model_built_to_fail(root, unchecked=True)
    for _ in range(2):
        with pytest.warns(UncheckedWarning, match=r"UNCHECKED .*layer 1 failed"):
            caps = pg.capture_qk(model, _toks(), [1])
        assert set(caps) == {1}


def test_the_clean_model_passes_silently(root):
    model = pg.load_model(str(am.build_folder(am.ARCHS["llama"], root)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncheckedWarning)
        assert set(pg.capture_qk(model, _toks())) == {0, 1}
