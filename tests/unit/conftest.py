"""Fixtures shared by the unit tests of the causal engine and the causal experiment."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch


@pytest.fixture(scope="module")
def llama():
    """A 3-layer tiny Hugging Face Llama (GQA), seeded: the model the causal engine and study tests run on."""
    torch.manual_seed(0)
    return tm.hf_llama(n_layers=3)[0]
