"""The activations a tuning run measures at its start (the log's "activations saved for backward" line) are
those of its rows (`--max-length`), not of the base's whole context: on SmolLM2-135M-Instruct (model.seq_len
8,192) the measurement was one forward of 9 GiB, six of a LoRA run's seven minutes, for rows of 256 tokens."""

from __future__ import annotations

import dataclasses
import re

from meshlm.core.memory import layer_activation_bytes
from tests.tune.test_chat_sft import chat_rows
from tests.tune.tune_helpers import LLAMA, QUIET, base_config, run, save_base, write_jsonl

UNITS = {"KiB": 2 ** 10, "MiB": 2 ** 20}


def test_tune_measures_activations_at_the_row_length(tmp_path):
    model = {**LLAMA, "seq_len": 1024}
    base = save_base(tmp_path / "base", model)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4, 1))
    code, out, err = run("tune", "--checkpoint", str(base), "--method", "lora", "--train", str(data), "--valid",
                         str(data), "--out", str(tmp_path / "run"), "--max-length", "64", "--train.max_steps=1",
                         "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.precision=fp32", *QUIET)
    assert code == 0, err
    found = re.search(r"= ([\d.]+) (KiB|MiB) in layers .*formula \(docs/memory.md\) ([\d.]+) (KiB|MiB) in layers, "
                      r"measured/formula ([\d.]+)", out)
    assert found, out
    measured, formula = (float(found[i]) * UNITS[found[i + 1]] for i in (1, 3))
    cfg = base_config(tmp_path / "base", {**model, "seq_len": 64})
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=2, precision="fp32"))
    at_rows = sum(layer_activation_bytes(cfg))
    assert abs(formula - at_rows) <= 0.01 * at_rows  # the formula at 64-token rows, not at 1,024 positions
    assert 0.5 < measured / at_rows < 2  # and what was measured is of that size (16× less than the context's)
