"""CLI: check on tiny + real model, and a fuzz pass over bad arguments (no traceback reaches the user)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posgen_tl.cli import build_parser, main


def test_check_default_model_passes(capsys, smollm2):
    rc = main(["check", "--model", "smollm2-135m", "--seq-len", "32", "--n-seq", "1", "--layers", "0,14-15,29"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "PASS" in out and "hook_rot_q/k fire" in out and "pre_softmax" in out
    assert "heads=9  kv_heads=3" in out


def test_check_unknown_model_is_one_line_error(capsys):
    rc = main(["check", "--model", "definitely-not-a-model"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown model 'definitely-not-a-model'" in err and "Traceback" not in err


@pytest.mark.parametrize("exc,rc,traceback_shown", [
    (TypeError("unsupported operand"), 3, True),  # a bug: its traceback, then a line saying so
    (KeyError("layers"), 3, True),
    ("capture", 2, False),  # a named refusal: one line
    (ValueError("n_seq must be positive"), 2, False),
])
def test_a_bug_shows_its_traceback_and_a_refusal_one_line(monkeypatch, capsys, exc, rc, traceback_shown):
    import posgen_tl.cli as cli
    from posgen_tl.hooks.capture import CaptureError

    err_obj = CaptureError("layer 3: no hook_rot_k") if exc == "capture" else exc

    def boom(*a, **k):
        raise err_obj

    monkeypatch.setattr(cli, "_cmd_check", boom)
    assert main(["check", "--model", "smollm2-135m"]) == rc
    err = capsys.readouterr().err
    assert ("Traceback (most recent call last)" in err) == traceback_shown
    assert ("internal error" in err) == traceback_shown and str(err_obj) in err
    if not traceback_shown:
        assert err.strip().count("\n") == 0 and err.startswith("posgen-tl: error: ")


def test_check_fails_nonzero_when_a_check_fails(monkeypatch, capsys, smollm2):
    import posgen_tl.experiments.exactness as ex

    real = ex.exactness_table

    def broken(*a, **k):
        df = real(*a, **k)
        df.loc[0, ["status", "reason", "passed"]] = ["failed", "scores differ (injected)", False]
        return df

    monkeypatch.setattr(ex, "exactness_table", broken)
    rc = main(["check", "--seq-len", "16", "--n-seq", "1", "--layers", "0"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL (0 layer(s) not checked, 1 failed)" in out
    assert "layer 0: failed: scores differ (injected)" in out


@pytest.mark.parametrize("layers", ["99", "30", "0,30"])
def test_check_a_layer_outside_the_model_is_exit_2_naming_the_range(capsys, smollm2, layers):
    """``--layers 99`` on the 30-layer SmolLM2 used to check layer 9 (99 mod 30) and print PASS."""
    rc = main(["check", "--seq-len", "16", "--n-seq", "1", "--layers", layers])
    cap = capsys.readouterr()
    assert rc == 2, cap.out
    assert "does not exist" in cap.err and "valid indices 0 … 29" in cap.err and "PASS" not in cap.out


def test_check_states_its_defaults_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = capsys.readouterr().out
    for needle in ("default: smollm2-135m", "--device", "--dtype", "exit 0 only if every layer passed",
                   "tokens per compared sequence"):
        assert needle in out, needle


def test_every_option_of_every_command_has_help_text():
    """What `--help` shows a user: no option of any command or study without a sentence."""
    import argparse

    from posgen_tl.cli import build_parser

    missing = []

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, [*path, name])
            elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                missing.append(f"{' '.join(path)} {'/'.join(a.option_strings) or a.dest}")

    walk(build_parser(), ["posgen-tl"])
    assert not missing, missing


_words = st.sampled_from(["check", "report", "study", "list", "decomposition", "--model", "--seq-len", "--n-seq", "--layers", "--out", "--quick", "-x",
                          "0", "-3", "abc", "1,2", "5-", "--corpus", "", "--seed", "1e9", "x" * 50])


@settings(max_examples=60, deadline=None)
@given(st.lists(_words, max_size=6))
def test_fuzz_arguments_never_traceback(argv):
    """Bad argument vectors exit 2 with a usage line (argparse) — parsing only, no model loads."""
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as e:
        assert e.code in (0, 2)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["check", "--seq-len", "0"], "positive integer"),
        (["check", "--layers", "a,b"], "layers must look like"),
        (["report", "--n-seq", "-2"], "positive integer"),
        (["frobnicate"], "invalid choice"),
        (["study", "decomposition", "--n-seq", "0"], "n_seq='0' (decomposition): 0 is not positive"),
        (["study"], "required: NAME"),
        (["study", "nope"], "invalid choice: 'nope'"),
        ([], "required"),
    ],
)
def test_bad_arguments_say_what_to_change(argv, needle, capsys):
    """In process (the same ``main`` the console script calls): exit status 2 and a message naming the problem."""
    from posgen_tl.cli import main

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err and "Traceback" not in err


def test_the_console_command_exits_2_on_bad_arguments():
    """The real process: ``python -m posgen_tl.cli`` with a bad value exits 2 with one clear line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "posgen_tl.cli", "study", "decomposition", "--n-seq", "0"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "n_seq='0' (decomposition): 0 is not positive" in r.stderr and "Traceback" not in r.stderr


_texts = st.one_of(st.text(max_size=200), st.lists(st.text(max_size=50), max_size=5),
                   st.sampled_from(["", "   ", "\n\n", "t3 t4 t5 t6 t7 t8 t9 t10 t11 t12", "nonexistent.txt", "a.md"]))


@settings(max_examples=80, deadline=None)
@given(_texts, st.integers(-3, 12), st.one_of(st.none(), st.integers(-2, 4)), st.sampled_from([True, False, "auto"]))
def test_fuzz_corpus_loader(text, seq_len, n_seq, bos):
    """The corpus loader either returns a valid [n, seq_len] int64 tensor or raises CorpusError — nothing else."""
    import tiny_models as tm

    from posgen_tl.io.corpus import CorpusError, tokenize_corpus

    tok = _TOK.setdefault("tok", tm.tiny_tokenizer())
    try:
        out = tokenize_corpus(tok, text, seq_len=seq_len, n_seq=n_seq, bos=bos)
    except CorpusError as e:
        assert str(e)
        return
    assert out.dtype.is_floating_point is False and out.ndim == 2 and out.shape[1] == seq_len
    assert n_seq is None or out.shape[0] == n_seq


_TOK: dict = {}


@pytest.mark.parametrize("command", ["study", "report"])
def test_bad_out_or_corpus_fails_before_a_model_loads(command, tmp_path, capsys, monkeypatch):
    """An unwritable --out, a file where a folder should be, a missing, empty or binary corpus: exit 2 with one line
    naming it — before any model is loaded (load_model would fail the test) — and nothing left behind."""
    import os

    import posgen_tl.io.models as models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(models, "load_model", no_load)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    afile = tmp_path / "afile"
    afile.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 50)
    head = ["study", "tolerance"] if command == "study" else ["report"]
    cases = [(["--out", str(afile)], "exists and is not a folder"),
             (["--out", str(tmp_path / "new"), "--corpus", str(tmp_path / "nope")], "no such file or folder"),
             (["--out", str(tmp_path / "new"), "--corpus", str(empty)], "holds no .txt/.md/.rst files"),
             (["--out", str(tmp_path / "new"), "--corpus", str(binary)], "is not UTF-8 text")]
    if os.geteuid() != 0:  # root writes anywhere: the read-only folder is only a test for users
        cases.append((["--out", str(ro / "sub")], "cannot write in"))
    for extra, needle in cases:
        assert main([*head, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and err.startswith("posgen-tl: error: ") and err.strip().count("\n") == 0, err
    assert not (tmp_path / "new").exists()  # a refused run creates no folder


def test_a_failed_study_leaves_no_empty_folder(tmp_path, monkeypatch):
    from posgen_tl.experiments import registry

    def fails(*a, **k):
        raise RuntimeError("the model could not be loaded (injected)")

    monkeypatch.setattr("posgen_tl.io.models.load_model", fails)
    out = tmp_path / "s" / "tolerance"
    with pytest.raises(RuntimeError, match="injected"):
        registry.run_study("tolerance", registry.make_config("tolerance"), out, model="smollm2-135m")
    assert not out.exists()
