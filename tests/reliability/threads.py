"""The reliability tests' shared fixture (a module, not a conftest.py: `from conftest import ...` elsewhere must
keep finding tests/conftest.py)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Two cores shared by several runs: one intra-op thread keeps a tiny step at ~0.1 s instead of ~1 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
