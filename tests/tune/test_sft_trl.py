"""The reference for chat fine-tuning: TRL's `SFTTrainer` with `assistant_only_loss=True` on the same tiny model
(exported by `meshlm convert --to-hf`), the same conversations and the same chat template (meshlm's builtin,
which has `{% generation %}` blocks). Per conversation, TRL's input ids are meshlm's row without its closing
end-of-document token and TRL's labels are meshlm's targets; the loss of one batch of all of them, as TRL's
`compute_loss` takes it from its own collator, equals meshlm's training loss on the same conversations, one
per row or packed (data.document_mask), within 1e-5. Importing TRL takes ~10 s of this test's time."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
import trl

from meshlm.models.loss import IGNORE_INDEX as IGNORE
from tests.tune.test_chat_sft import CHAT_MODEL, chat_rows, prepared
from tests.tune.tune_helpers import LLAMA, QUIET, run, save_base, write_jsonl

N = 10


def trl_batch(hf_dir, rows, template, out_dir):
    """TRL's trainer on the exported model, and its collated batch of every conversation in `rows`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokenizer.chat_template = template
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    args = trl.SFTConfig(output_dir=str(out_dir), assistant_only_loss=True, max_length=None, report_to=[],
                         use_cpu=True, per_device_train_batch_size=len(rows), bf16=False, fp16=False,
                         dataset_num_proc=None, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
    features = [trainer.train_dataset[i] for i in range(len(rows))]
    return trainer, trainer.data_collator(features)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_sft_loss_equals_trl(model, tmp_path):
    from meshlm.commands.train import build_trainer
    from meshlm.data.chat import BUILTIN_TEMPLATE

    base = save_base(tmp_path / "base", CHAT_MODEL if model == "gpt2" else {**LLAMA, "seq_len": 128}, seed=3)
    rows = chat_rows(N, 7)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    code, _, err = run("convert", "--checkpoint", str(base), "--to-hf", str(tmp_path / "hf"))
    assert code == 0, err
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer, batch = trl_batch(tmp_path / "hf", rows, BUILTIN_TEMPLATE, tmp_path / "trl")
        with torch.no_grad():
            want = float(trainer.compute_loss(trainer.model, dict(batch)))
    ids, labels = batch["input_ids"], batch["labels"]
    losses = {}
    for pack in (False, True):
        argv = ["tune", "--checkpoint", str(base), "--method", "full", "--train", str(data), "--valid", str(data),
                "--out", str(tmp_path / f"run{pack}"), *QUIET, "--train.precision=fp32", *(["--pack"] if pack else [])]
        cfg, tok, train, valid, _ = prepared(argv)
        if not pack:  # the same tokens and targets, conversation by conversation
            for k in range(N):
                n = int(batch["attention_mask"][k].sum())
                assert train.ids[k, :n].tolist() == ids[k, :n].tolist() and train.ids[k, n] == tok.eod_id
                assert train.targets[k, :n - 1].tolist() == labels[k, 1:n].tolist()
                assert (train.targets[k, n - 1:] == IGNORE).all()
        with contextlib.redirect_stdout(io.StringIO()):
            ours = build_trainer(cfg, datasets=(tok, train, valid))
        x, y = train.collate(np.stack([train[i] for i in range(len(train))]))  # every row: one batch
        with torch.no_grad():
            losses[pack] = float(ours.loss(x, y))
    assert losses[False] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert losses[True] == pytest.approx(want, rel=1e-5, abs=1e-5)
