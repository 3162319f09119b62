"""Text → token sequences, deterministically.

Default corpus: the English reference prose that ships with every Python, the
standard library's ``pydoc_data.topics.topics`` (79 documents, ~465 KB), taken in
sorted key order. Also accepted: a path to a text file, a string, a list of strings,
or a token tensor ``[batch, pos]`` (used as is after validation).

BOS policy (see MODELS.md: ``bridge.to_tokens`` prepends a BOS that SmolLM2's own
tokenizer does not add): we tokenize with ``add_special_tokens=False`` and then, with
``bos="auto"``, prepend the BOS token exactly when the model's tokenizer adds one to
plain text by itself (Gemma3: yes; SmolLM2: no). ``bos=True``/``False`` forces it.
Every sequence then has exactly ``seq_len`` tokens, BOS included.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import torch
from jaxtyping import Int
from torch import Tensor

__all__ = [
    "default_texts",
    "default_names",
    "load_texts",
    "tokenize_corpus",
    "corpus_tokens",
    "CorpusError",
    "CorpusLike",
    "tokenizer_adds_bos",
    "NATIVE_BOS",
    "Windows",
    "document_windows",
    "split_documents",
    "reference_windows",
]

#: the tokenizer's own BOS policy, recorded by :func:`posgen_tl.io.models.load_model` before
#: TransformerLens wraps the tokenizer (the bridge's tokenizer prepends a BOS that e.g.
#: SmolLM2's own tokenizer does not add). Lives here so ``models`` imports ``corpus``, never back.
NATIVE_BOS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()

CorpusLike = Union[None, str, os.PathLike, Sequence[str], Tensor]


class CorpusError(ValueError):
    """The corpus is empty, too short, or of an unsupported kind (the message says which)."""


def default_texts() -> list[str]:
    """The standard library's pydoc topics (always present offline), in sorted key order."""
    from pydoc_data.topics import topics  # noqa: PLC0415

    return [topics[k] for k in sorted(topics)]


def default_names() -> list[str]:
    """Names of :func:`default_texts` (the pydoc topic keys, same order)."""
    from pydoc_data.topics import topics  # noqa: PLC0415

    return sorted(topics)


def load_texts(source: CorpusLike) -> list[str]:
    """Turn ``source`` into a list of documents (see module docstring)."""
    if source is None:
        return default_texts()
    if isinstance(source, (os.PathLike, Path)) or (isinstance(source, str) and _looks_like_path(source)):
        path = Path(source)
        if not path.is_file():
            raise CorpusError(f"corpus file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"corpus file {path} is not UTF-8 text ({e})") from e
        docs = [text]
    elif isinstance(source, str):
        docs = [source]
    elif isinstance(source, Sequence) and all(isinstance(s, str) for s in source):
        docs = list(source)
    else:
        raise CorpusError(
            f"unsupported corpus of type {type(source).__name__}: give None (pydoc topics), a text file path, "
            "a string, a list of strings, or a token tensor"
        )
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise CorpusError("the corpus is empty (no non-whitespace text)")
    return docs


def _looks_like_path(text: str) -> bool:
    """A string is a file path if it names an existing file, or has no whitespace and a text-file suffix."""
    if not text or len(text) > 1024 or "\n" in text:
        return False
    try:
        if Path(text).is_file():
            return True
    except OSError:
        return False
    return not any(c.isspace() for c in text) and Path(text).suffix.lower() in (".txt", ".md", ".rst", ".text")


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer prepends its BOS token to plain text by itself."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def tokenize_corpus(
    tokenizer: Any,
    source: CorpusLike = None,
    *,
    seq_len: int = 512,
    n_seq: int | None = None,
    bos: bool | str = "auto",
    offset: int = 0,
) -> Int[Tensor, "batch pos"]:
    """Tokenize documents and cut them into ``n_seq`` contiguous sequences of ``seq_len``.

    Documents are joined with a blank line, tokenized once (``add_special_tokens=False``)
    and cut into consecutive, non-overlapping chunks starting at token ``offset``.
    Returns ``[n_seq, seq_len]`` int64 (all chunks that fit if ``n_seq`` is None).

    Raises:
        CorpusError: empty corpus, or fewer tokens than one (or ``n_seq``) sequence(s).
    """
    if seq_len < 2:
        raise CorpusError(f"seq_len must be at least 2, got {seq_len}")
    if isinstance(source, Tensor):
        t = source if source.ndim == 2 else source[None]
        if t.numel() == 0:
            raise CorpusError("the token tensor is empty")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise CorpusError(f"a token tensor must hold integer ids, got {t.dtype}")
        if t.shape[1] < seq_len:
            raise CorpusError(f"token sequences have {t.shape[1]} positions, fewer than seq_len={seq_len}")
        t = t[:, :seq_len].long()
        return t if n_seq is None else _take(t, n_seq, seq_len)
    if tokenizer is None:
        raise CorpusError("a tokenizer is needed to tokenize text (the model has none)")
    docs = load_texts(source)
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    add_bos = tokenizer_adds_bos(tokenizer) if bos == "auto" else bool(bos)
    body = seq_len - int(add_bos)
    ids = ids[offset:]
    n_avail = len(ids) // body
    if n_avail == 0:
        raise CorpusError(
            f"the corpus has {len(ids)} tokens (after offset {offset}), fewer than one sequence of {body}"
        )
    chunks = torch.tensor(ids[: n_avail * body], dtype=torch.long).view(n_avail, body)
    if add_bos:
        chunks = torch.cat([torch.full((n_avail, 1), int(tokenizer.bos_token_id)), chunks], dim=1)
    return chunks if n_seq is None else _take(chunks, n_seq, seq_len)


def _take(chunks: Tensor, n_seq: int, seq_len: int) -> Tensor:
    if n_seq < 1:
        raise CorpusError(f"n_seq must be at least 1, got {n_seq}")
    if chunks.shape[0] < n_seq:
        raise CorpusError(
            f"the corpus gives only {chunks.shape[0]} sequences of {seq_len} tokens; {n_seq} were asked for"
        )
    return chunks[:n_seq]


def corpus_tokens(
    model: Any,
    source: CorpusLike = None,
    *,
    seq_len: int = 512,
    n_seq: int | None = None,
    bos: bool | str = "auto",
    offset: int = 0,
) -> Int[Tensor, "batch pos"]:
    """:func:`tokenize_corpus` with the model's tokenizer and its *own* BOS policy.

    With ``bos="auto"`` the policy is the one of the tokenizer as the model was shipped
    (recorded by :func:`posgen_tl.load_model` before TransformerLens wraps it); for a
    model built elsewhere, the bridge tokenizer's behaviour is used.
    """
    tok = getattr(model, "tokenizer", None)
    if bos == "auto" and model in NATIVE_BOS:
        bos = NATIVE_BOS[model]
    n_ctx = int(getattr(getattr(model, "cfg", None), "n_ctx", 0) or 0)
    if n_ctx and seq_len > n_ctx:
        raise CorpusError(f"seq_len={seq_len} exceeds the model's context of {n_ctx} positions")
    return tokenize_corpus(tok, source, seq_len=seq_len, n_seq=n_seq, bos=bos, offset=offset)


# ----------------------------------------------------------------------------- document windows


@dataclass
class Windows:
    """Token windows cut from documents, each carrying the id of the document it came from.

    Attributes:
        tokens: ``[batch, pos]`` int64 token ids (BOS included where the policy adds one).
        doc_ids: ``[batch]`` int64 index of each window's document in the corpus' document list.
        starts: ``[batch]`` int64 token offset of the window's first body token in its document.
        doc_names: names of ALL documents of the corpus (``doc_names[doc_ids[i]]`` names window i).

    The statistical unit of every verdict is the window (sequence), clustered by ``doc_ids``
    (METHOD §8); every rows DataFrame carries the document id beside the sequence index.
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

    def subset(self, index: Sequence[int] | Tensor) -> "Windows":
        """The windows at ``index`` (same document list)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return Windows(self.tokens[idx], self.doc_ids[idx], self.starts[idx], self.doc_names)

    def frame(self):
        """Tidy ``pandas.DataFrame``: ``seq, doc, doc_name, start`` (one row per window)."""
        import pandas as pd  # noqa: PLC0415

        d = self.doc_ids.tolist()
        return pd.DataFrame({"seq": range(len(self)), "doc": d, "doc_name": [self.doc_names[i] for i in d],
                             "start": self.starts.tolist()})


def _named_docs(source: CorpusLike) -> tuple[list[str], list[str]]:
    """Documents and their names: pydoc topic keys, file names of a folder, or ``doc{i}``."""
    if source is None:
        return default_texts(), default_names()
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        files = sorted(p for p in Path(source).iterdir() if p.is_file() and p.suffix.lower() in (".txt", ".md", ".rst", ".text"))
        if not files:
            raise CorpusError(f"corpus folder {source} holds no .txt/.md/.rst files")
        docs, names = [], []
        for p in files:
            try:
                t = p.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise CorpusError(f"corpus file {p} is not UTF-8 text ({e})") from e
            if t.strip():
                docs.append(t)
                names.append(p.name)
        if not docs:
            raise CorpusError(f"the corpus folder {source} is empty (no non-whitespace text)")
        return docs, names
    docs = load_texts(source)
    return docs, [f"doc{i}" for i in range(len(docs))]


def split_documents(
    n_docs: int, *, reference: int | float = 0.25, seed: int = 0
) -> tuple[list[int], list[int]]:
    """Split document indices ``0..n_docs−1`` into ``(analysed, reference)``, disjoint, seeded.

    ``reference``: number of reference documents (int) or a fraction of them (float in (0, 1)).
    The reference set feeds the global mean key k̄ (METHOD §2); it never overlaps the analysed
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
    """Windows of ``seq_len`` tokens from MANY documents (METHOD §4 sampling), with document ids.

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
    texts, names = _named_docs(source)
    pick = list(range(len(texts))) if docs is None else sorted({int(d) for d in docs})
    if any(not 0 <= d < len(texts) for d in pick):
        raise CorpusError(f"document indices must lie in [0, {len(texts)}), got {pick}")
    bos = _resolve_bos(model, bos) if model is not None else bos
    add_bos = tokenizer_adds_bos(tok) if bos == "auto" else bool(bos)
    body = seq_len - int(add_bos)
    gen = torch.Generator().manual_seed(20_011 + int(seed))
    per_doc: dict[int, list[tuple[int, list[int]]]] = {}
    for d in pick:
        ids = tok(texts[d], add_special_tokens=False)["input_ids"]
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


def reference_windows(
    model: Any, source: CorpusLike = None, *, seq_len: int = 256, n_seq: int = 8, reference: int | float = 0.25,
    seed: int = 0, max_per_doc: int | None = None,
) -> tuple[Windows, Windows]:
    """``(analysed_pool, reference)``: windows from two DISJOINT document sets (:func:`split_documents`).

    ``reference`` has ``n_seq`` windows from the reference documents (for the global k̄);
    ``analysed_pool`` holds every window of the other documents (cut it with
    :meth:`Windows.subset` or pass ``docs=`` to :func:`document_windows` directly).
    """
    texts, _ = _named_docs(source)
    analysed, ref = split_documents(len(texts), reference=reference, seed=seed)
    ref_w = document_windows(model, source, seq_len=seq_len, n_seq=n_seq, docs=ref, seed=seed, max_per_doc=max_per_doc)
    pool = document_windows(model, source, seq_len=seq_len, n_seq=None, docs=analysed, seed=seed, max_per_doc=max_per_doc)
    return pool, ref_w
