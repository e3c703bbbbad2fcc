"""The memory check before a tuning run counts the activations of its rows (`--max-length`), not of the base's
whole context: SmolLM2-135M-Instruct (model.seq_len 8,192) was refused LoRA on rows of 200 tokens, its
estimate 54 GiB for what takes under 5."""

from __future__ import annotations

import dataclasses

from meshlm.core.fit import machine_memory
from meshlm.train.fit import training_bytes
from tests.tune.test_chat_sft import chat_rows
from tests.tune.tune_helpers import LLAMA, QUIET, base_config, run, save_base, write_jsonl


def test_tune_checks_memory_at_the_row_length(tmp_path):
    seq_len = 2 ** 16
    while True:  # a context whose activations at micro-batch 8 exceed this machine's memory
        cfg = base_config(tmp_path / "base", {**LLAMA, "seq_len": seq_len})
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=8, global_batch_size=8))
        if sum(training_bytes(cfg).values()) > machine_memory()[0]:
            break
        seq_len *= 2
    base = save_base(tmp_path / "base", {**LLAMA, "seq_len": seq_len})
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8, 1))
    code, _, err = run("tune", "--checkpoint", str(base), "--method", "lora", "--train", str(data), "--valid",
                       str(data), "--out", str(tmp_path / "run"), "--max-length", "160", "--train.max_steps=1",
                       "--train.micro_batch_size=8", "--train.global_batch_size=8", *QUIET)
    assert code == 0, err
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()
