"""The trainer with multi-token prediction (`model.mtp_depth`, models/mtp.py): the model's own loss path is taken
whatever `train.fused_loss` says, and each logged step carries `mtp_loss_k` and `mtp_loss` beside the main loss."""

from __future__ import annotations

import json

from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config


def test_training_logs_the_mtp_losses_apart(tmp_path):
    cfg = tiny_config(tmp_path, model={"mtp_depth": 2}, train={"max_steps": 2, "fused_loss": False})
    trainer = Trainer(cfg)
    assert trainer.fused_loss  # the modules need the stream and the targets: the model's head_loss
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert len(steps) == 2
    for r in steps:
        assert r["mtp_loss"] == (r["mtp_loss_1"] + r["mtp_loss_2"]) / 2
        assert 9 < r["mtp_loss_1"] < 12 and 9 < r["loss"] < 12  # ln(50257) = 10.8 at the start
    assert trainer.model.mtp.take_stats() is None  # taken by the log
