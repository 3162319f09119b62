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


def test_the_gap_probes_span_nll_in_blocks_of_sequences_and_positions(monkeypatch):
    """``length.span_nll`` unembeds ``chunk`` positions and as many sequences as keep the logits within
    ``SPAN_LOGIT_BYTES``: the per-token NLL of one block of everything, each row scored against its own next token."""
    import posgen_tl.experiments.length as L

    model, _ = tm.hf_llama(n_layers=2, seed=1)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(3, 100, (5, 16), generator=g)
    whole = L.span_nll(model, toks, 6, 15)
    with torch.no_grad():
        full = torch.log_softmax(model(toks).double(), -1)
    ref = -full[:, 5:14].gather(-1, toks[:, 6:15, None])[..., 0]
    torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-5)
    blocks: list[tuple[int, int]] = []
    real = L.row_nll

    def spy(logits, targets, **k):
        blocks.append(tuple(logits.shape[:2]))
        return real(logits, targets, **k)

    monkeypatch.setattr(L, "row_nll", spy)
    monkeypatch.setattr(L, "SPAN_LOGIT_BYTES", 2 * 4 * 4 * model.cfg.d_vocab)  # two sequences of 4 positions at a time
    got = L.span_nll(model, toks, 6, 15, chunk=4)
    assert blocks == [(2, 4), (2, 4), (1, 4), (2, 4), (2, 4), (1, 4), (2, 1), (2, 1), (1, 1)]
    assert torch.equal(got, whole)  # each row's log-softmax is its own: the same numbers to the bit
