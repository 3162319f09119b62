"""Text → token sequences, deterministically.

Default corpus: the English reference prose that ships with every Python, the
standard library's ``pydoc_data.topics.topics`` (79 documents, ~465 KB), taken in
sorted key order. Also accepted: a path to a text file, a string, a list of strings,
or a token tensor ``[batch, pos]`` (used as is after validation).

BOS policy (``bridge.to_tokens`` prepends a BOS that SmolLM2's own
tokenizer does not add): we tokenize with ``add_special_tokens=False`` and then, with
``bos="auto"``, prepend the BOS token exactly when the model's tokenizer adds one to
plain text by itself (Gemma3: yes; SmolLM2: no). ``bos=True``/``False`` forces it.
Every sequence then has exactly ``seq_len`` tokens, BOS included.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

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
    "named_documents",
    "package_readmes",
    "stdlib_docstrings",
    "package_docstrings",
    "DOCSTRING_PACKAGES",
]

#: the tokenizer's own BOS policy, recorded by :func:`posgen_tl.io.models.load_model` before
#: TransformerLens wraps the tokenizer (the bridge's tokenizer prepends a BOS that e.g.
#: SmolLM2's own tokenizer does not add). Lives here so ``models`` imports ``corpus``, never back.
NATIVE_BOS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

CorpusLike = Union[None, str, os.PathLike, Sequence[str], Tensor]  # noqa: UP007


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


def _is_dir(source: str | os.PathLike) -> bool:
    """``source`` names an existing folder (a long text with spaces or newlines is text, never a path)."""
    s = os.fspath(source)
    if not s or len(s) > 1024 or "\n" in s:
        return False
    try:
        return Path(s).is_dir()
    except OSError:
        return False


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


def named_documents(source: CorpusLike) -> tuple[list[str], list[str]]:
    """Documents and their names: pydoc topic keys, file names of a folder, or ``doc{i}``."""
    if source is None:
        return default_texts(), default_names()
    if isinstance(source, (str, os.PathLike)) and _is_dir(source):
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


def package_readmes(dest: str | os.PathLike, *, min_chars: int = 3000, exclude: Sequence[str] = ("posgen_tl",)) -> list[dict]:
    """Write a second corpus of another genre: the long descriptions (README / PyPI page text:
    installation guides, feature lists, changelogs — Markdown and reStructuredText with code) of the
    Python distributions installed beside this package, one ``<name>.txt`` per distribution with at
    least ``min_chars`` characters, into ``dest`` (a folder :func:`named_documents` reads). The
    default corpus (the language reference of ``pydoc_data``) is formal reference prose; this one is
    what package authors write for users.

    Returns:
        One dict per written document: ``name, version, chars, sha256`` (the corpus' provenance —
        it depends on what is installed, so a run records it).

    Raises:
        CorpusError: fewer than 2 distributions qualify.
    """
    import hashlib  # noqa: PLC0415
    import importlib.metadata as md  # noqa: PLC0415

    out, seen = [], set()
    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    for dist in sorted(md.distributions(), key=lambda d: str(d.metadata.get("Name", "")).lower()):
        name = str(dist.metadata.get("Name") or "")
        key = name.lower().replace("-", "_")
        if not name or key in seen or key in {e.lower().replace("-", "_") for e in exclude}:
            continue
        seen.add(key)
        text = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = text if isinstance(text, str) and text.strip() else str(dist.metadata.get("Description") or "")
        if len(text) < min_chars:
            continue
        (folder / f"{key}.txt").write_text(text, encoding="utf-8")
        out.append(dict(name=name, version=str(dist.metadata.get("Version")), chars=len(text),
                        sha256=hashlib.sha256(text.encode()).hexdigest()))
    if len(out) < 2:
        raise CorpusError(f"only {len(out)} installed distributions have a description of ≥ {min_chars} characters")
    return out


#: parts of the standard library left out of :func:`stdlib_docstrings`: tests, GUI and tooling packages, vendored
#: or legacy trees (their text is not documentation of the library)
DOCSTRING_SKIP = ("test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo", "__pycache__", "lib2to3",
                  "tkinter", "ensurepip", "venv")


def module_docstrings(source: str) -> str:
    """The documentation text of one Python module's source: its docstring, then each public (not ``_``-prefixed)
    class and function — methods under their class — as ``name`` followed by its docstring, in source order,
    separated by blank lines; ``""`` when it has none. Read with :mod:`ast` (nothing is imported or run)."""
    import ast  # noqa: PLC0415

    tree = ast.parse(source)
    out = [d] if (d := ast.get_docstring(tree)) else []

    def walk(node: Any, prefix: str) -> None:
        for n in node.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_"):
                if d := ast.get_docstring(n):
                    out.append(f"{prefix}{n.name}\n{d}")
                if isinstance(n, ast.ClassDef):
                    walk(n, f"{prefix}{n.name}.")

    walk(tree, "")
    return "\n\n".join(out)


def stdlib_docstrings(dest: str | os.PathLike, *, min_chars: int = 1500, root: str | os.PathLike | None = None) -> list[dict]:
    """Write a third corpus: the docstrings of the Python standard library's modules (:func:`module_docstrings`:
    API documentation written by the library's authors — one document per module with at least ``min_chars``
    characters, ``<dotted.module.name>.txt``) into ``dest``. ``root``: the library's folder (default: this
    interpreter's). Tests, GUI/tooling packages and vendored trees (:data:`DOCSTRING_SKIP`) are left out.

    Returns:
        One dict per written document: ``name, chars, sha256`` and the interpreter's ``python`` version (the text
        depends on it, so a run records it).

    Raises:
        CorpusError: fewer than 2 modules qualify."""
    import platform  # noqa: PLC0415
    import sysconfig  # noqa: PLC0415

    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    out = _docstring_documents(base, sorted(base.rglob("*.py")), Path(dest), min_chars,
                               dict(python=platform.python_version()))
    if len(out) < 2:
        raise CorpusError(f"only {len(out)} standard-library modules under {base} have ≥ {min_chars} characters of "
                          "docstrings")
    return out


#: the packages of :func:`package_docstrings`: the scientific Python stack the project's lock pins
#: (constraints/tl4.txt), documented in prose by their authors (numpydoc)
DOCSTRING_PACKAGES = ("numpy", "scipy", "pandas", "networkx", "matplotlib")


def package_docstrings(dest: str | os.PathLike, packages: Sequence[str] = DOCSTRING_PACKAGES, *,
                       min_chars: int = 1500, root: str | os.PathLike | None = None) -> list[dict]:
    """Write a fourth corpus: the docstrings of installed packages' modules (:func:`module_docstrings`; one
    document per module with at least ``min_chars`` characters, ``<dotted.module.name>.txt``) into ``dest``.
    ``packages``: import names (default :data:`DOCSTRING_PACKAGES`); ``root``: the folder holding them (default:
    this environment's site-packages). Test trees and :data:`DOCSTRING_SKIP` are left out; a text that another
    module already gave (a re-export shim) is written once, under the first name in path order.

    Returns:
        One dict per written document: ``name, chars, sha256, package`` and the package's ``version`` as its
        ``*.dist-info`` under ``root`` says (``"unknown"`` without one; the text depends on it, so a run records it).

    Raises:
        CorpusError: a package is not installed under ``root``, or fewer than 2 modules qualify."""
    import importlib.metadata as md  # noqa: PLC0415
    import sysconfig  # noqa: PLC0415

    base = Path(root) if root is not None else Path(sysconfig.get_paths()["purelib"])
    out: list[dict] = []
    seen: set[str] = set()
    for pkg in packages:
        if not (base / pkg).is_dir():
            raise CorpusError(f"package {pkg!r} is not installed under {base}")
        dists = [d for d in md.distributions(path=[str(base)])
                 if str(d.metadata.get("Name", "")).lower().replace("-", "_") == pkg.lower()]
        version = str(dists[0].metadata.get("Version")) if dists else "unknown"
        files = [f for f in sorted((base / pkg).rglob("*.py"))
                 if not {"testing", "_testing"} & set(f.relative_to(base).parts)]
        got = _docstring_documents(base, files, Path(dest), min_chars, dict(package=pkg, version=version), seen)
        out += got
    if len(out) < 2:
        raise CorpusError(f"only {len(out)} modules of {', '.join(packages)} have ≥ {min_chars} characters of docstrings")
    return out


def _docstring_documents(base: Path, files: Sequence[Path], folder: Path, min_chars: int, fields: dict,
                         seen: set[str] | None = None) -> list[dict]:
    """Write :func:`module_docstrings` of each of ``files`` (under ``base``; :data:`DOCSTRING_SKIP` left out) with at
    least ``min_chars`` characters as ``<dotted name>.txt`` in ``folder``; with ``seen`` (a set of SHA-256) a text
    already in it is skipped and each written one added (without it nothing is deduplicated). Returns one ``dict(name, chars, sha256, **fields)`` per document."""
    import hashlib  # noqa: PLC0415

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for p in files:
        rel = p.relative_to(base)
        if any(part in DOCSTRING_SKIP for part in rel.parts):
            continue
        try:
            text = module_docstrings(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a file the parser cannot read is no document
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if len(text) < min_chars or (seen is not None and digest in seen):
            continue
        if seen is not None:
            seen.add(digest)
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
        out.append(dict(name=name, chars=len(text), sha256=digest, **fields))
    return out
