"""`meshlm convert --to-hf` of a tensor-parallel checkpoint (per-rank pieces, vocabulary padded for the
split): the Hugging Face model it writes equals the whole model built in one process from the same seed."""

from __future__ import annotations

import pytest
import torch
from interop_helpers import SHARDED_SEED, ok, save_sharded_checkpoint, sharded_config

from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.families.registry import get_spec

transformers = pytest.importorskip("transformers")
TOL = 1e-5


@pytest.mark.parametrize("family, cls", [("gpt", "GPT2LMHeadModel"), ("bert", "BertForMaskedLM")])
def test_tensor_parallel_checkpoint_to_hf(family, cls, tmp_path):
    save_sharded_checkpoint(family, tmp_path)
    source = resolve_checkpoint(tmp_path / "run")
    assert (source / "index.json").exists() and not (source / "model.pt").exists(), "a sharded checkpoint"
    ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "hf")])
    hf, info = getattr(transformers, cls).from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = sharded_config(family).model
    torch.manual_seed(SHARDED_SEED)
    whole = get_spec(family).model_class(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert float((hf.eval()(ids).logits - whole(ids)).abs().max()) <= TOL
