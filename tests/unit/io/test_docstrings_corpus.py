"""The standard-library docstring corpus: documentation text read with ast (nothing imported), public names only,
in source order; tests and short modules left out; provenance recorded per document."""

from __future__ import annotations

import hashlib

import pytest

from posgen_tl.io.corpus import CorpusError, module_docstrings, named_documents, package_docstrings, stdlib_docstrings

SOURCE = '''"""Module doc."""
import sys
sys.exit("never run")


def public(x):
    """Does a thing."""


def _private():
    """Hidden."""


class Thing:
    """A thing."""

    def method(self):
        """Its method."""

    def _helper(self):
        """Hidden too."""


def undocumented():
    pass
'''


def test_module_docstrings_reads_public_docs_in_source_order_without_running_the_module():
    assert module_docstrings(SOURCE) == ("Module doc.\n\npublic\nDoes a thing.\n\nThing\nA thing.\n\n"
                                         "Thing.method\nIts method.")
    assert module_docstrings("x = 1\n") == ""


def test_stdlib_docstrings_writes_long_modules_with_their_provenance(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "test").mkdir()
    long = '"""' + "word " * 400 + '"""\n'
    (root / "alpha.py").write_text(long)
    (root / "pkg" / "__init__.py").write_text(long.replace("word", "term"))
    (root / "pkg" / "short.py").write_text('"""too short"""\n')
    (root / "test" / "test_alpha.py").write_text(long)  # tests are not documentation
    (root / "broken.py").write_text(long + "def (:\n")  # a file the parser cannot read is no document
    rec = stdlib_docstrings(tmp_path / "out", root=root)
    assert [r["name"] for r in rec] == ["alpha", "pkg"]
    for r in rec:
        text = (tmp_path / "out" / f"{r['name']}.txt").read_text()
        assert r["sha256"] == hashlib.sha256(text.encode()).hexdigest() and r["chars"] == len(text)
    docs, names = named_documents(str(tmp_path / "out"))
    assert len(docs) == 2 and docs[0].startswith("word")
    with pytest.raises(CorpusError, match="only 0 standard-library modules"):
        stdlib_docstrings(tmp_path / "none", root=root / "pkg", min_chars=10**6)


def test_package_docstrings_writes_each_text_once_with_the_package_and_its_version(tmp_path):
    root = tmp_path / "site"
    for pkg in ("numpy", "scipy"):
        (root / pkg / "testing").mkdir(parents=True)
        (root / pkg / "tests").mkdir()
    long = '"""' + "word " * 400 + '"""\n'
    (root / "numpy" / "linalg.py").write_text(long)
    (root / "numpy" / "shim.py").write_text(long)  # the same text again (a re-export shim): written once
    (root / "numpy" / "testing" / "helpers.py").write_text(long.replace("word", "help"))  # test helpers: left out
    (root / "numpy" / "tests" / "test_x.py").write_text(long.replace("word", "test"))
    (root / "scipy" / "__init__.py").write_text(long.replace("word", "sci"))
    (root / "numpy-9.1.dist-info").mkdir()
    (root / "numpy-9.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 9.1\n")
    rec = package_docstrings(tmp_path / "out", ("numpy", "scipy"), root=root)
    assert [(r["name"], r["package"]) for r in rec] == [("numpy.linalg", "numpy"), ("scipy", "scipy")]
    # the version of the tree that was read (its dist-info under root), not this environment's
    assert [r["version"] for r in rec] == ["9.1", "unknown"]
    for r in rec:
        text = (tmp_path / "out" / f"{r['name']}.txt").read_text()
        assert r["sha256"] == hashlib.sha256(text.encode()).hexdigest() and r["chars"] == len(text)
    with pytest.raises(CorpusError, match="package 'nopkg' is not installed"):
        package_docstrings(tmp_path / "x", ("nopkg",), root=root)
    with pytest.raises(CorpusError, match="only 0 modules of numpy"):
        package_docstrings(tmp_path / "y", ("numpy",), root=root, min_chars=10**6)
