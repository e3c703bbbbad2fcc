"""Mixed precision runs train (finite, decreasing-ish loss) and keeps fp32 master weights."""

import json
import math

import pytest
import torch

from meshlm.train.trainer import Trainer
from tests.conftest import tiny_config


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_master_weights(precision, tmp_path):
    trainer = Trainer(tiny_config(tmp_path, train={"precision": precision, "max_steps": 3}))
    trainer.run()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if json.loads(ln)["kind"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    if precision == "fp16":
        assert trainer.precision.scaler.is_enabled()
        assert trainer.precision.state_dict()["scale"] > 0


def test_bf16_loss_close_to_fp32(tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        t = Trainer(tiny_config(tmp_path / precision, train={"precision": precision, "max_steps": 2}))
        t.run()
        runs[precision] = [json.loads(ln)["loss"] for ln in (tmp_path / precision / "metrics.jsonl").read_text()
                           .splitlines() if json.loads(ln)["kind"] == "train"]
    for a, b in zip(runs["fp32"], runs["bf16"]):
        assert abs(a - b) / a < 0.02
