"""`train.init_from`: a fresh run starts from another checkpoint's matching weights (fine-tuning)."""

from __future__ import annotations

import pytest
import torch

from meshlm.checkpoint.single import latest_checkpoint, load_model_state
from meshlm.core.config import ConfigError
from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config


def test_init_from_copies_the_weights_and_starts_fresh(tmp_path):
    base = Trainer(tiny_config(tmp_path / "base", train={"max_steps": 2}))
    base.run()
    saved = load_model_state(latest_checkpoint(tmp_path / "base"))
    fresh = Trainer(tiny_config(tmp_path / "fresh"))  # the seed's weights
    tuned = Trainer(tiny_config(tmp_path / "tuned", train={"init_from": str(tmp_path / "base")}))
    assert tuned.step == 0 and not tuned.optimizer.state  # a new run: step 0, no Adam state
    state = tuned.model.state_dict()
    assert set(state) == set(saved)
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
        assert not torch.equal(fresh.model.state_dict()[name], value) or value.dim() == 1, name


def test_init_from_keeps_new_tensors_seeded(tmp_path):
    """A head the checkpoint lacks keeps the seed's init; the shared tensors come from the checkpoint."""
    Trainer(tiny_config(tmp_path / "base", train={"max_steps": 1})).run()
    untied = {"tie_embeddings": False}
    fresh = Trainer(tiny_config(tmp_path / "fresh", model=untied))
    tuned = Trainer(tiny_config(tmp_path / "tuned", model=untied, train={"init_from": str(tmp_path / "base")}))
    saved = load_model_state(latest_checkpoint(tmp_path / "base"))
    state = tuned.model.state_dict()
    # the tied checkpoint stores one embedding; the untied model's lm_head is its own tensor
    assert torch.equal(state["tok_emb.weight"], saved["tok_emb.weight"])
    assert torch.equal(state["layers.1.mlp.fc.weight"], saved["layers.1.mlp.fc.weight"])
    assert torch.equal(state["lm_head.weight"], fresh.model.state_dict()["lm_head.weight"])


def test_init_from_another_shape_is_refused(tmp_path):
    Trainer(tiny_config(tmp_path / "base", train={"max_steps": 1})).run()
    with pytest.raises(ConfigError, match="train.init_from"):
        Trainer(tiny_config(tmp_path / "other", model={"hidden_size": 48, "n_layers": 1, "seq_len": 16},
                            train={"init_from": str(tmp_path / "base")}))
