"""The exactness check never calls a non-finite value equal, and layer/head indices never wrap
(issue #32, items 6 and 7)."""

from __future__ import annotations

import math

import pytest
import tiny_models as tm
import torch
from hypothesis import given
from hypothesis import strategies as st

from posgen_tl.experiments.exactness import exactness_table, exceeds, verdict, worst
from posgen_tl.maths.rope import IndexRangeError

N_TOK = 12


@pytest.fixture(scope="module")
def llama():
    model, _ = tm.hf_llama(n_layers=3)
    return model


def _tokens():
    return torch.randint(3, 100, (2, N_TOK), generator=torch.Generator().manual_seed(0))


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=0, max_value=1e6))
def test_exceeds_is_false_only_for_a_finite_error_within_the_limit(err, limit):
    assert exceeds(err, limit) == (not (math.isfinite(err) and err <= limit))


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=6))
def test_worst_propagates_nan_wherever_it_is(errs):
    w = worst(*errs)
    assert math.isnan(w) if any(math.isnan(e) for e in errs) else w == max(errs)


def test_the_clean_model_passes(llama):
    ok, line = verdict(exactness_table(llama, _tokens()))
    assert ok, line


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", ["hook_attn_scores", "hook_pattern"])
def test_a_non_finite_score_or_pattern_fails_its_layer(llama, name, bad):
    """A NaN/inf planted at one visible entry of the last layer (row 5, key 2; an earlier layer would
    spread it into later activations, which the capture refuses): that layer fails and says why, the
    other layers pass, and the verdict is FAIL."""
    def plant(x, hook):
        x = x.clone()
        x[0, 0, 5, 2] = bad
        return x

    with llama.hooks(fwd_hooks=[(f"blocks.2.attn.{name}", plant)]):
        table = exactness_table(llama, _tokens())
    row = table.set_index("layer").loc[2]
    assert row["status"] == "failed", row.to_dict()
    assert "non-finite" in row["reason"] or "differs" in row["reason"], row["reason"]
    assert (table.set_index("layer").drop(index=2)["status"] == "passed").all()
    assert not verdict(table)[0]


@pytest.mark.parametrize("name", ["hook_rot_q", "hook_rot_k", "hook_q", "hook_k"])
def test_a_non_finite_q_or_k_is_refused_by_the_capture(llama, name):
    from posgen_tl.hooks.capture import CaptureError

    def plant(x, hook):
        x = x.clone()
        x.view(-1)[7] = math.nan
        return x

    with llama.hooks(fwd_hooks=[(f"blocks.1.attn.{name}", plant)]), pytest.raises(CaptureError, match="non-finite"):
        exactness_table(llama, _tokens())


@pytest.mark.parametrize("layers", [[3], [99], [-4], [0, 7]])
def test_a_layer_outside_the_model_is_a_named_error_never_wrapped(llama, layers):
    with pytest.raises(IndexRangeError, match=r"does not exist .*3 layers: valid indices 0 … 2"):
        exactness_table(llama, _tokens(), layers)


def test_negative_layers_count_from_the_end(llama):
    assert list(exactness_table(llama, _tokens(), [-1])["layer"]) == [2]


@pytest.mark.parametrize("layer,head", [(99, 0), (0, 4), (0, -5), (-4, 0)])
def test_decompose_head_names_the_valid_range(llama, layer, head):
    import posgen_tl as pg

    with pytest.raises(IndexRangeError, match="valid indices"):
        pg.decompose_head(llama, _tokens(), layer=layer, head=head)


def test_decompose_head_takes_the_last_layer_and_head_as_minus_one(llama):
    import posgen_tl as pg

    res = pg.decompose_head(llama, _tokens(), layer=-1, head=-1)
    assert (res.layer, res.head) == (2, 3)


def test_multi_stream_m_rope_position_ids_are_refused_by_name(llama):
    """``[3, batch, pos]`` ids (Qwen2-VL / Qwen3-VL / Qwen3.5 with images) used to die in a torch shape error."""
    from posgen_tl.hooks.capture import CaptureError
    from posgen_tl.hooks.logits import logit_substitution_hooks
    from posgen_tl.hooks.stream import capture_qk

    ids = torch.arange(N_TOK).expand(3, 2, -1)
    with pytest.raises(CaptureError, match="multi-stream M-RoPE ids"):
        capture_qk(llama, _tokens(), position_ids=ids)
    with pytest.raises(CaptureError, match="multi-stream M-RoPE ids"):
        logit_substitution_hooks(llama, None, position_ids=ids)
    with pytest.raises(ValueError, match=r"position_ids must be \[pos=12\] or \[batch=2, pos=12\]"):
        capture_qk(llama, _tokens(), position_ids=torch.arange(N_TOK + 1))
    one_stream = capture_qk(llama, _tokens(), position_ids=torch.arange(N_TOK)[None] + 5)  # [1, pos] for the batch
    assert int(one_stream[0].positions[1, 0]) == 5
