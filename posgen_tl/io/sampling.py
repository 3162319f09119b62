"""THE analysed / reference split: token windows by document, one seed rule, document ids everywhere.

Every experiment takes its windows from here (:func:`sample_windows` for a text corpus,
:func:`resolve_windows` for whatever a user passes — corpus text, :class:`Windows`, or a token
tensor), so for the same corpus, sizes and seed every experiment analyses the SAME windows and
takes its global mean key k̄ from the SAME reference windows.

The rule (docs/method.md §2, §4, §8):

* documents are split, seeded, into an analysed set and a DISJOINT reference set
  (:func:`split_documents`: a quarter of the documents; the shortest ones with
  ``reference_docs="short"``, for long-window runs where every long document is needed);
* analysed windows: ``n_seq`` windows of ``seq_len`` tokens, one per document first (round-robin
  over the analysed documents in a seeded order, :func:`document_windows`); reference windows:
  ``n_ref`` windows of ``ref_seq_len`` tokens (default ``seq_len``) of the reference documents, cut
  with the SAME seed;
* every window carries its document id: the document is the statistical unit of every verdict.

A user's own token tensor is analysed as given (each row its own document) and never split: a
reference is needed only where a global k̄ is computed, and is then asked for by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posgen_tl.io.corpus import (
    NATIVE_BOS,
    CorpusError,
    CorpusLike,
    corpus_tokens,
    named_documents,
    tokenizer_adds_bos,
)

__all__ = [
    "Windows",
    "split_documents",
    "document_windows",
    "sample_windows",
    "resolve_windows",
    "as_windows",
    "check_disjoint",
    "consecutive_chunks",
    "sample_or_chunks",
    "tokens_fingerprint",
]


def tokens_fingerprint(tokens: Any) -> str:
    """SHA-1 of token ids (any integer tensor or nested list, read as int64): a run's record of exactly which tokens
    it used, and the key under which a result computed from them is kept."""
    import hashlib  # noqa: PLC0415

    t = torch.as_tensor(tokens)
    return hashlib.sha1(t.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()


@dataclass
class Windows:
    """Token windows cut from documents, each carrying the id of the document it came from.

    Attributes:
        tokens: ``[batch, pos]`` int64 token ids (BOS included where the policy adds one).
        doc_ids: ``[batch]`` int64 index of each window's document in the corpus' document list.
        starts: ``[batch]`` int64 token offset of the window's first body token in its document.
        doc_names: names of ALL documents of the corpus (``doc_names[doc_ids[i]]`` names window i).

    The statistical unit of every verdict is the window (sequence), clustered by ``doc_ids``
    (docs/method.md §8); every rows DataFrame carries the document id beside the sequence index.
    """

    tokens: Tensor
    doc_ids: Tensor
    starts: Tensor
    doc_names: list[str]

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        if self.doc_ids.shape != (n,) or self.starts.shape != (n,):
            raise CorpusError(
                f"Windows: doc_ids {tuple(self.doc_ids.shape)} / starts {tuple(self.starts.shape)} "
                f"do not match {n} token windows"
            )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        """Number of distinct documents among the windows."""
        return int(self.doc_ids.unique().numel())

    def subset(self, index: Sequence[int] | Tensor) -> Windows:
        """The windows at ``index`` (same document list)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return Windows(self.tokens[idx], self.doc_ids[idx], self.starts[idx], self.doc_names)

    def frame(self):
        """Tidy ``pandas.DataFrame``: ``seq, doc, doc_name, start`` (one row per window)."""
        import pandas as pd  # noqa: PLC0415

        d = self.doc_ids.tolist()
        return pd.DataFrame({"seq": range(len(self)), "doc": d, "doc_name": [self.doc_names[i] for i in d],
                             "start": self.starts.tolist()})


def split_documents(
    n_docs: int, *, reference: int | float = 0.25, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Split document indices ``0..n_docs−1`` into ``(analysed, reference)``, disjoint, seeded.

    ``reference``: number of reference documents (int) or a fraction of them (float in (0, 1)).
    The reference set feeds the global mean key k̄ (docs/method.md §2); it never overlaps the analysed
    documents, so no analysed token enters its own k̄.
    """
    if n_docs < 2:
        raise CorpusError(f"need at least 2 documents to split analysed/reference, got {n_docs}")
    n_ref = round(reference * n_docs) if isinstance(reference, float) else int(reference)
    if not 1 <= n_ref < n_docs:
        raise CorpusError(f"reference={reference!r} gives {n_ref} of {n_docs} documents; need 1..{n_docs - 1}")
    perm = torch.randperm(n_docs, generator=torch.Generator().manual_seed(10_007 + int(seed))).tolist()
    return sorted(perm[n_ref:]), sorted(perm[:n_ref])


def _resolve_bos(model: Any, bos: bool | str) -> bool | str:
    return NATIVE_BOS[model] if bos == "auto" and model in NATIVE_BOS else bos


def document_windows(
    model: Any,
    source: CorpusLike = None,
    *,
    seq_len: int = 256,
    n_seq: int | None = None,
    docs: Sequence[int] | None = None,
    max_per_doc: int | None = None,
    seed: int = 0,
    bos: bool | str = "auto",
    tokenizer: Any = None,
) -> Windows:
    """Windows of ``seq_len`` tokens from MANY documents (docs/method.md §4 sampling), with document ids.

    Each document is tokenized alone (``add_special_tokens=False``; BOS as in
    :func:`tokenize_corpus`). A document of ``L`` body tokens holds ``⌊L/body⌋`` disjoint
    windows; ``min(that, max_per_doc)`` of them are kept, consecutive, starting at a seeded
    random offset. Windows are then taken round-robin over the documents in a seeded order —
    first one window from every document, then second windows, … — until ``n_seq``: as many
    distinct documents as the corpus allows, and never two overlapping windows.

    Args:
        docs: restrict to these document indices (e.g. the analysed half of
            :func:`split_documents`); ``None`` = all.
        n_seq: number of windows (``None`` = all available).

    Returns:
        :class:`Windows` (tokens ``[n_seq, seq_len]``, ``doc_ids``, ``starts``, ``doc_names``).

    Raises:
        CorpusError: too few tokens for ``n_seq`` windows (the message says how many exist).
    """
    if seq_len < 2:
        raise CorpusError(f"seq_len must be at least 2, got {seq_len}")
    if max_per_doc is not None and max_per_doc < 1:
        raise CorpusError(f"max_per_doc must be at least 1, got {max_per_doc}")
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tok is None:
        raise CorpusError("a tokenizer is needed to cut documents into windows (the model has none)")
    n_ctx = int(getattr(getattr(model, "cfg", None), "n_ctx", 0) or 0) if model is not None else 0
    if n_ctx and seq_len > n_ctx:
        raise CorpusError(f"seq_len={seq_len} exceeds the model's context of {n_ctx} positions")
    texts, names = named_documents(source)
    pick = list(range(len(texts))) if docs is None else sorted({int(d) for d in docs})
    if any(not 0 <= d < len(texts) for d in pick):
        raise CorpusError(f"document indices must lie in [0, {len(texts)}), got {pick}")
    bos = _resolve_bos(model, bos) if model is not None else bos
    add_bos = tokenizer_adds_bos(tok) if bos == "auto" else bool(bos)
    body = seq_len - int(add_bos)
    gen = torch.Generator().manual_seed(20_011 + int(seed))
    per_doc: dict[int, list[tuple[int, list[int]]]] = {}
    encoded = tok([texts[d] for d in pick], add_special_tokens=False)["input_ids"] if pick else []  # one batched call
    for d, ids in zip(pick, encoded):
        k = len(ids) // body
        if max_per_doc is not None:
            k = min(k, max_per_doc)
        if k == 0:
            continue
        slack = len(ids) - k * body
        off = int(torch.randint(0, slack + 1, (1,), generator=gen))
        per_doc[d] = [(off + j * body, ids[off + j * body : off + (j + 1) * body]) for j in range(k)]
    order = [pick_d for pick_d in (list(per_doc)[i] for i in torch.randperm(len(per_doc), generator=gen).tolist())]
    chosen: list[tuple[int, int, list[int]]] = []
    depth = 0
    while order and (n_seq is None or len(chosen) < n_seq):
        added = False
        for d in order:
            if depth < len(per_doc[d]) and (n_seq is None or len(chosen) < n_seq):
                start, ids = per_doc[d][depth]
                chosen.append((d, start, ids))
                added = True
        if not added:
            break
        depth += 1
    total = sum(len(v) for v in per_doc.values())
    if not chosen or (n_seq is not None and len(chosen) < n_seq):
        raise CorpusError(
            f"the corpus gives only {total} windows of {seq_len} tokens from {len(per_doc)} of {len(pick)} "
            f"documents; {n_seq} were asked for (lower seq_len or n_seq, or raise max_per_doc)"
        )
    toks = torch.tensor([ids for _, _, ids in chosen], dtype=torch.long)
    if add_bos:
        toks = torch.cat([torch.full((len(chosen), 1), int(tok.bos_token_id)), toks], dim=1)
    return Windows(toks, torch.tensor([d for d, _, _ in chosen]), torch.tensor([s for _, s, _ in chosen]), names)


def sample_windows(
    model: Any, corpus: CorpusLike = None, *, n_seq: int | None, seq_len: int, n_ref: int = 0, seed: int = 0,
    ref_seq_len: int | None = None, max_per_doc: int | None = None, reference_docs: str = "quarter",
    skip: int = 0,
) -> tuple[Windows, Windows | None]:  # fmt: skip
    """``(analysed, reference)`` windows from DISJOINT document sets — the one sampling rule.

    Args:
        n_seq: analysed windows (one per document first; ``None``: every window the analysed documents
            hold). ``n_ref``: reference windows (0: none).
        ref_seq_len: tokens per reference window (default ``seq_len``).
        max_per_doc: at most this many windows of one analysed document (default: as many as fit).
        reference_docs: ``"quarter"`` (a seeded quarter of the documents) or ``"short"`` (the
            documents too short for an analysed window, when at least two are; else a quarter).
        skip: leave out the first ``skip`` analysed windows of the seeded order (one per document first):
            with the same seed, the windows of a new run on documents none of an earlier run's first ``skip``
            windows came from (checked), its reference windows the same.

    Returns:
        ``analysed`` (``[n_seq, seq_len]``) and ``reference`` (``[n_ref, ref_seq_len]``, ``None``
        when ``n_ref == 0``) :class:`Windows`; their documents never overlap (checked).

    Raises:
        CorpusError: fewer than 2 documents, too few windows (the message says how many exist), or ``skip``
            windows that share a document with the kept ones.
    """
    if skip < 0:
        raise CorpusError(f"skip must be at least 0, got {skip}")
    texts, _ = named_documents(corpus)
    if reference_docs == "short":
        tok = model.tokenizer
        short = [i for i, t in enumerate(texts) if len(tok(t, add_special_tokens=False)["input_ids"]) < seq_len]
        ana_docs, ref_docs = ([i for i in range(len(texts)) if i not in set(short)], short) if len(short) >= 2 \
            else split_documents(len(texts), seed=seed)
    elif reference_docs == "quarter":
        ana_docs, ref_docs = split_documents(len(texts), seed=seed)
    else:
        raise ValueError(f"reference_docs must be 'quarter' or 'short', got {reference_docs!r}")
    if not ana_docs:
        raise CorpusError(f"no document of the corpus holds {seq_len} tokens")
    ana = document_windows(model, corpus, seq_len=seq_len, n_seq=None if n_seq is None else n_seq + skip,
                           docs=ana_docs, seed=seed, max_per_doc=max_per_doc)
    if skip:
        left, ana = ana.subset(range(skip)), ana.subset(range(skip, len(ana)))
        if not len(ana):
            raise CorpusError(f"skip={skip} leaves no analysed window")
        shared = set(left.doc_ids.tolist()) & set(ana.doc_ids.tolist())
        if shared:
            raise CorpusError(f"skip={skip}: {len(shared)} documents give windows both among the skipped and the "
                              f"kept ones (the corpus has too few documents for {len(ana)} fresh ones)")
    ref = None
    if n_ref:
        ref = document_windows(model, corpus, seq_len=ref_seq_len or seq_len, n_seq=n_ref, docs=ref_docs, seed=seed)
        check_disjoint(ana, ref)
    return ana, ref


def as_windows(tokens: Tensor, prefix: str = "row") -> Windows:
    """A token tensor ``[batch, pos]`` (or ``[pos]``) as Windows, row ``i`` its own document ``f"{prefix}{i}"``."""
    t = tokens[None] if tokens.ndim == 1 else tokens
    n = t.shape[0]
    return Windows(t, torch.arange(n), torch.zeros(n, dtype=torch.long), [f"{prefix}{i}" for i in range(n)])


def check_disjoint(analysed: Windows, reference: Windows) -> None:
    """Raise ValueError if an analysed window and a reference window come from the same document."""
    names_a = {analysed.doc_names[i] for i in analysed.doc_ids.tolist()}
    names_r = {reference.doc_names[i] for i in reference.doc_ids.tolist()}
    shared = names_a & names_r
    if shared:
        raise ValueError(f"the reference windows share documents with the analysed ones ({sorted(shared)[:5]}); "
                         "the global k̄ must come from OTHER documents (posgen_tl.io.sampling.split_documents)")


def resolve_windows(
    model: Any, corpus: CorpusLike | Windows = None, reference: Windows | Tensor | None = None, *,
    n_seq: int, seq_len: int, n_ref: int = 0, seed: int = 0,
) -> tuple[Windows, Windows | None]:  # fmt: skip
    """``(analysed, reference)`` for whatever an experiment was given:

    * corpus text (``None`` = pydoc topics, a file, a folder, strings): :func:`sample_windows`
      (``n_seq`` windows of ``seq_len`` tokens; ``n_ref`` reference windows, unless ``reference`` is given);
    * :class:`Windows`: analysed as given (all of them); ``reference`` checked disjoint;
    * a token tensor: analysed as given (every row, each its own document); ``reference`` (a
      tensor or Windows) only if given — never carved out of the analysed rows.

    Raises:
        ValueError: the reference shares documents with the analysed windows.
    """
    if isinstance(reference, Tensor):
        reference = as_windows(reference, prefix="ref_row")
    if isinstance(corpus, Windows):
        analysed = corpus
    elif isinstance(corpus, Tensor):
        analysed = as_windows(corpus)
    else:
        analysed, ref = sample_windows(model, corpus, n_seq=n_seq, seq_len=seq_len, n_ref=0 if reference is not None
                                       else n_ref, seed=seed)
        reference = ref if reference is None else reference
    if isinstance(reference, Windows):
        check_disjoint(analysed, reference)
    return analysed, reference


def consecutive_chunks(model: Any, corpus: CorpusLike, *, n_seq: int, seq_len: int, n_ref: int) -> tuple[Windows, Windows]:
    """For a corpus that cannot be split by document (one text): ``n_seq`` consecutive chunks
    analysed and the ``n_ref`` chunks after them as the reference — disjoint in position, NOT in
    document (say so wherever it is used)."""
    toks = corpus_tokens(model, corpus, seq_len=seq_len, n_seq=n_seq + n_ref)
    return as_windows(toks[:n_seq]), as_windows(toks[n_seq:], prefix="ref_row")


def sample_or_chunks(model: Any, corpus: CorpusLike, *, n_seq: int, seq_len: int, n_ref: int,
                     seed: int = 0) -> tuple[Windows, Windows, str]:
    """:func:`sample_windows`, or — for a corpus that cannot be split by document (one text) —
    :func:`consecutive_chunks`; returns ``(analysed, reference, note)``, the note saying which."""
    try:
        ana, ref = sample_windows(model, corpus, n_seq=n_seq, seq_len=seq_len, n_ref=n_ref, seed=seed)
        assert ref is not None
        return ana, ref, (f"{len(ana)} windows from {ana.n_docs} documents; global k̄ from {len(ref)} windows of "
                          f"{ref.n_docs} OTHER documents.")
    except CorpusError as e:
        ana, ref = consecutive_chunks(model, corpus, n_seq=n_seq, seq_len=seq_len, n_ref=n_ref)
        return ana, ref, (f"The corpus could not be split by document ({e}); global k̄ from the last {n_ref} "
                          "consecutive chunks (disjoint positions of the same text, not other documents).")
