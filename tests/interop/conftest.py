"""Fixtures shared by the interop tests: transformers' own load of the SmolLM2 asset GGUF, the reference of
both test_gguf_read.py and test_gguf_write.py, loaded once per worker process (a session fixture: with
`--dist loadfile` a file's tests run on one worker, and two files on the same worker share it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory):
    """(model, tokenizer) that transformers builds from SmolLM2-135M-Instruct.Q4_1.gguf: it dequantizes the
    file itself (fp32, eval mode) and builds the tokenizer from the file's metadata, once per test run
    (tests/smollm2_reference.py: kept in the run's cache for tests/test_released_model.py and other workers).
    Read-only: tests must not change either."""
    from tests.conftest import session_cache_dir
    from tests.smollm2_reference import transformers_smollm2

    pytest.importorskip("transformers")
    return transformers_smollm2(session_cache_dir(tmp_path_factory))
