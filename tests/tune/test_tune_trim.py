"""Tuning batches end at their last target (`TuneDataset.trim`, `tune.data.trim_multiple`): the width is
the longest row's last target rounded up to the layout's multiple, never past the row; under a pipeline
every batch keeps the row's length; and the trimmed batch gives the very loss and gradients of the full
one (float64: the positions cut off carry no target and, attention being causal, feed none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshlm.core.config import ParallelConfig, build
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from meshlm.tune.chat_data import chat_dataset
from meshlm.tune.data import trim_multiple
from tests.tune.test_chat_sft import SMALL_EOD, SMALL_VOCAB, synthetic_conversations
from tests.tune.tune_helpers import GPT2, LLAMA


def test_trim_multiple_follows_the_layout():
    assert trim_multiple(ParallelConfig()) == 16
    assert trim_multiple(ParallelConfig(tp=3, sp=True)) == 48  # lcm(16, 3·2)
    assert trim_multiple(ParallelConfig(cp=4)) == 16
    assert trim_multiple(ParallelConfig(tp=2, cp=2)) == 16
    assert trim_multiple(ParallelConfig(pp=2)) == 0  # the pipeline's shapes are fixed at its first step


def test_collate_cuts_after_the_last_target():
    convs = synthetic_conversations(6, 3, 20)
    data = chat_dataset(convs, 64, SMALL_EOD)
    rows = np.stack([data[i] for i in range(len(data))])
    full = data.collate(rows)
    assert full[0].shape == (6, 64)  # trim 0: the row's length
    data.trim = 16
    x, y = data.collate(rows)
    last = max(int(np.flatnonzero(data.targets[i] != IGNORE)[-1]) for i in range(len(data)))
    assert x.shape[1] == y.shape[1] == -(-(last + 1) // 16) * 16 < 64
    assert (full[1][:, x.shape[1]:] == IGNORE).all()
    assert torch.equal(x, full[0][:, :x.shape[1]]) and torch.equal(y, full[1][:, :y.shape[1]])
    data.trim = 100  # rounded up past the row: the row's length
    assert data.collate(rows)[0].shape[1] == 64


@pytest.mark.parametrize("family", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_trimmed_batch_has_the_full_batchs_loss_and_gradients(family):
    cfg = build({"model": {**family, "seq_len": 64, "family": "gpt", "vocab_size": SMALL_VOCAB}}).model
    torch.manual_seed(0)
    model = GPT(cfg).double()
    data = chat_dataset(synthetic_conversations(5, 7, 24), 64, SMALL_EOD)
    rows = np.stack([data[i] for i in range(len(data))])
    results = []
    for trim in (0, 16):
        data.trim = trim
        x, y = data.collate(rows)
        model.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        results.append((x.shape[1], loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (w_full, l_full, g_full), (w_cut, l_cut, g_cut) = results
    assert w_cut < w_full == 64
    torch.testing.assert_close(l_cut, l_full, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_cut, g_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
