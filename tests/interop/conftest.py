"""Fixtures shared by the interop tests: transformers' own load of the SmolLM2 asset GGUF, the reference of
both test_gguf_read.py and test_gguf_write.py, loaded once per worker process (a session fixture: with
`--dist loadfile` a file's tests run on one worker, and two files on the same worker share it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_transformers():
    """(model, tokenizer) that transformers builds from SmolLM2-135M-Instruct.Q4_1.gguf: it dequantizes the
    file itself (fp32, eval mode) and builds the tokenizer from the file's metadata. Read-only: tests must not
    change either."""
    import torch

    from meshlm.data.assets import smollm2_gguf

    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer
