"""Every experiment that keeps a checkpoint continues an interrupted run to the same numbers: a run interrupted
after its first kept piece, started again on the same folder, computes only the missing pieces and gives the
tables of an uninterrupted run; a folder of another design is refused by name. (The causal and patching studies
have their own tests of this: tests/unit/experiments/test_causal.py, test_patching.py.)"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import tiny_models as tm
import torch

from posgen_tl.experiments import registry
from posgen_tl.io import checkpoint as ck_mod

SIZES = {
    # two batches per model: the trained model's and the random twin's, each kept per batch
    "decomposition": ("quick", dict(n_seq=4, seq_len=24, n_ref=2, batch_size=2)),
    # each model's tables (pattern: bands and heads of one computation; taxonomy: its rows)
    "pattern": ("quick", dict(n_seq=3, seq_len=24, n_ref=2)),
    "taxonomy": ("quick", dict(n_seq=3, seq_len=24, n_ref=2)),
    "tolerance": ("quick", dict(n_seq=4, seq_len=24, batch_size=2, fracs=(0.0, 0.2), seeds=(0,), twin_seeds=(0,))),
    "sufficiency": ("quick", dict(n_seq=3, seq_len=24, n_ref=2)),
    # the gap probe (3 gaps × 3 conditions) and window removal (4 conditions) of a tiny sliding-window model
    "length": ("quick", dict(n_seq=3, seq_len=24, n_ref=2, gaps=(0.0, 1.0, 2.0), window_seq_len=16, window_n_seq=3,
                             bucket=4)),
    # one kept batch per sequence (the two passes, G = 0 and G = gap, of each)
    "gap_attention": ("quick", dict(n_seq=3, seq_len=24, n_ref=2)),
}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    folder = tmp_path_factory.mktemp("docs")
    for i in range(10):
        (folder / f"d{i}.txt").write_text(" ".join(f"w{int(t)}" for t in torch.randint(0, 90, (80,), generator=g)))
    for i in range(3):  # short documents: window removal's k̄ reference
        (folder / f"s{i}.txt").write_text(" ".join(["t5"] * 5))
    return {"llama": tm.hf_llama(n_layers=2)[0], "gemma3": tm.hf_gemma3()[0]}, str(folder)


def test_the_generic_checkpoint_is_used_by_these_experiments():
    assert {n for n in registry.ORDER if registry.resumable(n)} >= {"causal", "patching", *SIZES}


#: where each run is interrupted: after this many kept pieces (decomposition: in the trained model's batches, and in
#: the random twin's; pattern: between two tables of one computation, and after the trained model's; length: in the gap probe, and after window removal's first condition, whose kept per-token NLL
#: the later conditions reuse)
STOPS = [("decomposition", 1), ("decomposition", 3), ("pattern", 1), ("pattern", 2), ("taxonomy", 1), ("tolerance", 1), ("sufficiency", 1), ("length", 1), ("length", 8),
         ("gap_attention", 1)]


@pytest.mark.parametrize("name, stop", STOPS)
def test_an_interrupted_run_continues_to_the_same_numbers(name, stop, setting, tmp_path, monkeypatch):
    models, corpus = setting
    model = models["gemma3" if name == "length" else "llama"]
    preset, opts = SIZES[name]
    cfg = dataclasses.replace(registry.make_config(name, preset), **opts, corpus=corpus)
    whole = registry.run(name, model, cfg, progress=False)

    real, computed = ck_mod.Pieces.rows, []

    def interrupted(self, piece, compute):
        def counted():
            if len(computed) == stop:
                raise KeyboardInterrupt
            computed.append(piece)
            return compute()
        return real(self, piece, counted)

    monkeypatch.setattr(ck_mod.Pieces, "rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.run(name, model, cfg, checkpoint=tmp_path / "ck", progress=False)
    kept = (tmp_path / "ck").rglob("*.csv")
    assert sorted(p.stem for p in kept) == sorted(computed) and len(computed) == stop  # finished pieces kept

    again: list[str] = []
    monkeypatch.setattr(ck_mod.Pieces, "rows", lambda self, piece, compute: real(
        self, piece, lambda: (again.append(piece), compute())[1]))
    resumed = registry.run(name, model, cfg, checkpoint=tmp_path / "ck", progress=False)
    assert not set(computed) & set(again) and len(again) >= 1  # kept pieces read back, the rest computed
    if name == "length":
        assert "window_rows" in whole.tables and (stop < 8 or computed[-1] == "window_window")
    for t in whole.tables:
        pd.testing.assert_frame_equal(resumed[t], whole[t], check_exact=False, rtol=1e-12, atol=1e-15)

    other = dataclasses.replace(cfg, seed=1)
    with pytest.raises(ValueError, match=f"another {name} design"):
        registry.run(name, model, other, checkpoint=tmp_path / "ck", progress=False)


def test_a_checkpoint_tells_apart_what_changes_the_numbers(setting, tmp_path):
    """Same tokens under other document ids (the swaps are seeded per document), another twin, or the same layer
    groups in another order (pieces are numbered by position) are other designs: refused, never reused."""
    from posgen_tl.experiments import base, sufficiency
    from posgen_tl.io.models import random_twin
    from posgen_tl.io.sampling import sample_windows

    models, corpus = setting
    model = models["llama"]
    cfg = dataclasses.replace(registry.make_config("tolerance", "quick"), **SIZES["tolerance"][1], corpus=corpus)
    win = sample_windows(model, corpus, n_seq=4, seq_len=24, seed=0)[0]
    base.pieces(tmp_path / "a", "tolerance", cfg, model, win)
    other_ids = dataclasses.replace(win, doc_ids=win.doc_ids + 100)
    with pytest.raises(ValueError, match="another tolerance design"):
        base.pieces(tmp_path / "a", "tolerance", cfg, model, other_ids)
    registry.run("tolerance", model, cfg, checkpoint=tmp_path / "t", twin=random_twin(model, 0), progress=False)
    with pytest.raises(ValueError, match="another tolerance design"):
        registry.run("tolerance", model, cfg, checkpoint=tmp_path / "t", twin=random_twin(model, 1), progress=False)
    scfg = dataclasses.replace(registry.make_config("sufficiency", "quick"), **SIZES["sufficiency"][1], corpus=corpus)
    groups = {"a": [0], "b": [1]}
    sufficiency.run(model, scfg, groups=groups, checkpoint=tmp_path / "s", progress=False)
    with pytest.raises(ValueError, match="another sufficiency design"):
        sufficiency.run(model, scfg, groups=dict(reversed(groups.items())), checkpoint=tmp_path / "s", progress=False)


def test_a_decomposition_checkpoint_tells_apart_twins_and_given_means(setting, tmp_path):
    """The random twin's batches are kept under its own weights' digest, and a given k̄ under its values: another twin
    or other means are another design (refused by name), never reused."""
    from posgen_tl.experiments import decomposition
    from posgen_tl.io.models import random_twin
    from posgen_tl.io.sampling import sample_windows

    models, corpus = setting
    model = models["llama"]
    cfg = dataclasses.replace(registry.make_config("decomposition", "quick"), **SIZES["decomposition"][1], corpus=corpus)
    registry.run("decomposition", model, cfg, checkpoint=tmp_path / "d", twin=random_twin(model, 0), progress=False)
    with pytest.raises(ValueError, match="another decomposition design"):
        registry.run("decomposition", model, cfg, checkpoint=tmp_path / "d", twin=random_twin(model, 1), progress=False)
    win = sample_windows(model, corpus, n_seq=2, seq_len=24, seed=0)[0]
    km = {layer: torch.randn(1, 16, generator=torch.Generator().manual_seed(layer)) for layer in range(2)}
    d = model.cfg.d_head
    km = {layer: v[:, :d].expand(model.cfg.n_key_value_heads or model.cfg.n_heads, d) for layer, v in km.items()}
    first = decomposition.decompose_model(model, win, cfg, k_mean=km, checkpoint=tmp_path / "g", progress=False)
    again = decomposition.decompose_model(model, win, cfg, k_mean=km, checkpoint=tmp_path / "g", progress=False)
    pd.testing.assert_frame_equal(first, again)
    with pytest.raises(ValueError, match="another decomposition design"):
        decomposition.decompose_model(model, win, cfg, k_mean={k: v * 2 for k, v in km.items()},
                                      checkpoint=tmp_path / "g", progress=False)


def test_pieces_of_another_release_are_refused_and_the_refusal_says_why(tmp_path, monkeypatch):
    import posgen_tl._version as version

    fp = {"config": {"n_seq": 4}, "model": "m"}
    kept = ck_mod.Pieces(tmp_path, fp, "demo")
    kept.rows("a", lambda: pd.DataFrame({"x": [0.1]}))
    assert ck_mod.Pieces(tmp_path, fp, "demo").get("a")["x"].tolist() == [0.1]  # same design and release: read back
    assert ck_mod.Pieces(tmp_path, fp, "demo").get("b") is None and ck_mod.Pieces(None, fp, "demo").get("a") is None
    monkeypatch.setattr(version, "__version__", "9.9.9")
    with pytest.raises(ValueError, match=r"another demo design \(it was computed by posgen_tl 0"):
        ck_mod.Pieces(tmp_path, fp, "demo")
    with pytest.raises(ValueError, match=r"another demo design \(config, model or windows differ\)"):
        ck_mod.Pieces(tmp_path, {**fp, "model": "other"}, "demo")
    import json

    (tmp_path / "fingerprint.json").write_text(json.dumps(fp))  # written before versions were recorded
    with pytest.raises(ValueError, match="computed by an earlier build, which recorded no version"):
        ck_mod.Pieces(tmp_path, fp, "demo")
