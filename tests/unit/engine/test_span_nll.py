"""The target span's NLL unembedded a few sequences at a time (``swaps._span_nll``): the numbers of one unembedding of
every sequence, with at most ``SPAN_LOGIT_BYTES`` of logits made at once."""

from __future__ import annotations

import tiny_models as tm
import torch

import posgen_tl.engine.swaps as sw
from posgen_tl.maths.perturb import nll_from_logits


def test_the_span_nll_in_blocks_equals_one_unembedding_and_bounds_the_logits(monkeypatch):
    model, _ = tm.hf_llama(n_layers=2, seed=1)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, 100, (7, 20), generator=g)
    span = 5
    whole = sw.nll_on_target(model, toks, target_len=span, batch_size=7)
    # the reference: every sequence's logits at once, from the model's own full forward
    with torch.no_grad():
        logits = model(toks)[:, -span - 1 :]
    ref = nll_from_logits(logits, toks[:, -span - 1 :]).mean(-1)
    torch.testing.assert_close(whole, ref, rtol=1e-6, atol=1e-6)
    per_seq = 4 * span * model.cfg.d_vocab
    monkeypatch.setattr(sw, "SPAN_LOGIT_BYTES", 3 * per_seq)  # three sequences' logits at a time
    rows: list[int] = []
    real = sw.row_nll

    def spy(logits, targets, **k):  # each block's logits, as the unembedding made them
        rows.append(logits.shape[0])
        return real(logits, targets, **k)

    monkeypatch.setattr(sw, "row_nll", spy)
    blocks = sw.nll_on_target(model, toks, target_len=span, batch_size=7)
    assert rows == [3, 3, 1]
    torch.testing.assert_close(blocks, whole, rtol=1e-6, atol=1e-6)
    assert (whole - whole.mean()).abs().max() > 1e-3  # the sequences differ: a mix-up of rows would show
