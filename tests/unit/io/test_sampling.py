"""THE analysed / reference split (posgen_tl.io.sampling): disjoint documents, one seed rule, ids travel."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

from posgen_tl.io.corpus import CorpusError
from posgen_tl.io.sampling import (
    Windows,
    as_windows,
    check_disjoint,
    consecutive_chunks,
    resolve_windows,
    sample_or_chunks,
    sample_windows,
    split_documents,
)


def _docs(n_docs=16, words=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(t)}" for t in torch.randint(3, 99, (words,), generator=g)) for _ in range(n_docs)]


@pytest.fixture(scope="module")
def model():
    return tm.hf_llama(n_layers=1)[0]


def test_split_is_disjoint_seeded_and_a_quarter():
    a, r = split_documents(20, seed=3)
    assert not set(a) & set(r) and sorted(a + r) == list(range(20)) and len(r) == 5
    assert (a, r) == split_documents(20, seed=3) and (a, r) != split_documents(20, seed=4)
    with pytest.raises(CorpusError, match="at least 2 documents"):
        split_documents(1)


def test_sample_windows_one_rule(model):
    ana, ref = sample_windows(model, _docs(), n_seq=6, seq_len=16, n_ref=3, seed=1)
    assert len(ana) == 6 and len(ref) == 3 and ana.n_docs == 6  # one window per document first
    check_disjoint(ana, ref)
    # the same call is the same windows; the reference uses the SAME seed as the analysed windows
    again, ref2 = sample_windows(model, _docs(), n_seq=6, seq_len=16, n_ref=3, seed=1)
    assert torch.equal(again.tokens, ana.tokens) and torch.equal(ref.tokens, ref2.tokens)
    alone, none = sample_windows(model, _docs(), n_seq=6, seq_len=16, seed=1)
    assert none is None and torch.equal(alone.tokens, ana.tokens)  # asking for a reference changes nothing analysed
    # a longer request extends the same list (round-robin over documents): prefixes agree
    more, _ = sample_windows(model, _docs(), n_seq=10, seq_len=16, n_ref=3, seed=1)
    assert torch.equal(more.tokens[:6], ana.tokens)


def test_skip_gives_fresh_documents_and_the_same_reference(model):
    first, ref = sample_windows(model, _docs(), n_seq=4, seq_len=16, n_ref=3, seed=1)
    fresh, ref2 = sample_windows(model, _docs(), n_seq=5, seq_len=16, n_ref=3, seed=1, skip=4)
    assert torch.equal(ref.tokens, ref2.tokens)  # the same reference windows (the same pilot)
    assert not set(first.doc_ids.tolist()) & set(fresh.doc_ids.tolist()) and len(fresh) == 5
    both, _ = sample_windows(model, _docs(), n_seq=9, seq_len=16, n_ref=3, seed=1)
    assert torch.equal(both.tokens[4:], fresh.tokens)  # the continuation of the same seeded order
    # 12 analysed documents: 10 + 4 windows would take second windows of documents among the skipped
    with pytest.raises(CorpusError, match="both among the skipped and the kept"):
        sample_windows(model, _docs(), n_seq=10, seq_len=16, seed=1, skip=4)
    with pytest.raises(CorpusError, match="skip must be at least 0"):
        sample_windows(model, _docs(), n_seq=2, seq_len=16, skip=-1)


def test_short_reference_documents(model):
    docs = _docs(12, words=80) + _docs(4, words=5, seed=9)  # four documents too short for an analysed window
    ana, ref = sample_windows(model, docs, n_seq=None, seq_len=32, n_ref=2, ref_seq_len=4, reference_docs="short")
    assert set(ref.doc_ids.tolist()) <= {12, 13, 14, 15} and not set(ana.doc_ids.tolist()) & {12, 13, 14, 15}
    with pytest.raises(ValueError, match="quarter' or 'short"):
        sample_windows(model, docs, n_seq=2, seq_len=8, reference_docs="longest")


def test_resolve_windows_analyses_a_tensor_as_given(model):
    toks = torch.randint(1, 50, (4, 12))
    ana, ref = resolve_windows(model, toks, n_seq=2, seq_len=12)
    assert torch.equal(ana.tokens, toks) and ref is None and ana.doc_ids.tolist() == [0, 1, 2, 3]
    ana, ref = resolve_windows(model, toks, toks[:1] + 1, n_seq=2, seq_len=12)
    assert ref.doc_names == ["ref_row0"]
    w, _ = sample_windows(model, _docs(), n_seq=4, seq_len=16, seed=0)
    with pytest.raises(ValueError, match="share documents"):
        resolve_windows(model, w, w.subset([1]), n_seq=4, seq_len=16)


def test_one_text_falls_back_to_chunks_and_says_so(model):
    ana, ref, note = sample_or_chunks(model, " ".join(_docs(1, words=400)), n_seq=3, seq_len=16, n_ref=2)
    assert len(ana) == 3 and len(ref) == 2 and "could not be split by document" in note
    a2, r2 = consecutive_chunks(model, " ".join(_docs(1, words=400)), n_seq=3, seq_len=16, n_ref=2)
    assert torch.equal(a2.tokens, ana.tokens) and torch.equal(r2.tokens, ref.tokens)
    ana, ref, note = sample_or_chunks(model, _docs(), n_seq=3, seq_len=16, n_ref=2)
    assert "OTHER documents" in note and isinstance(ana, Windows)


def test_too_few_windows_is_a_corpus_error(model):
    with pytest.raises(CorpusError, match="windows of 16 tokens"):
        sample_windows(model, _docs(4, words=20), n_seq=50, seq_len=16)
    assert as_windows(torch.zeros(3, dtype=torch.long)).tokens.shape == (1, 3)
