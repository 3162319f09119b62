"""The corpora the results pages name: what each is (:data:`CORPORA`) and the provenance line of each recorded one
(:func:`corpus_lines`)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["CORPORA", "corpus_lines"]

#: what each corpus is, as the pages say it
CORPORA = {
    "pydoc": "the Python standard library's pydoc topics (the language reference: 79 documents of formal prose)",
    "readmes": "the long descriptions of the installed Python distributions (package READMEs: install guides, "
               "feature lists, changelogs — Markdown/reStructuredText with code). Chosen as the second corpus because "
               "its genre differs from the language reference's formal prose while it ships with every Python "
               "environment, so it is rebuilt offline by `posgen_tl.io.corpus.package_readmes` (each document's "
               "version and SHA-256 are recorded)",
    "docstrings": "the docstrings of the Python standard library's modules (API documentation: one document per module "
                  "with at least 1 500 characters, read from the source without importing it, tests and the tkinter and IDLE "
                  "packages left out; rebuilt offline by `posgen_tl.io.corpus.stdlib_docstrings`, each document's SHA-256 and the "
                  "Python version recorded). Documents none of the exploratory runs saw, for the one confirmatory causal "
                  "test, declared before it ran",
    "scidocs": "the docstrings of the scientific Python stack's modules — numpy, scipy, pandas, networkx and matplotlib at "
               "the versions the project's lock pins (API documentation in prose: one document per module with at least "
               "1 500 characters, each text once, test trees left out; rebuilt offline by "
               "`posgen_tl.io.corpus.package_docstrings`, each document's package, version and SHA-256 recorded). "
               "Fresh documents for the second confirmatory causal test (SmolLM2), declared after the first was found "
               "not powered and sized from its spread, and for the third (Gemma3), declared before its run",
    "scidocs-2": "the same scidocs documents, but the next 160 of the seeded order (none of the third confirmatory "
                 "test's 192, the same reference windows): fresh documents for the fourth confirmatory causal test "
                 "(Gemma3), declared after the third was found not testable, with common damage levels every control "
                 "reached on the third test's documents",
}


def corpus_lines(results: Path | None, corpora: set[str]) -> list[str]:
    """One sentence per recorded corpus (``<results>/corpora/<name>.json``) of ``corpora``: its documents, characters
    and where each document's version and SHA-256 are recorded."""
    if results is None:
        return []
    out = []
    for prov in sorted((Path(results) / "corpora").glob("*.json")):
        if prov.stem not in corpora:  # a corpus recorded for a run not published yet
            continue
        docs = json.loads(prov.read_text())
        root = Path(results).resolve()
        rel = (Path(root.name) / prov.resolve().relative_to(root)).as_posix()  # never a machine path
        out.append(f"The **{prov.stem}** corpus of these runs: {len(docs)} documents ({sum(d['chars'] for d in docs):,} "
                   f"characters), each named with its version and SHA-256 in `{rel}`.")
    return out + ([""] if out else [])
