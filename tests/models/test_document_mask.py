"""Packed documents (`data.document_mask`): positions restart and attention stays within each document.

The check of the issue: a packed row's per-token losses equal those of its documents run one by one
(float64, learned positions and RoPE, grouped-query attention), and nothing changes without the switch.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ModelConfig
from meshlm.data.documents import document_positions
from meshlm.models.gpt import GPT
from meshlm.models.layers import document_causal_mask

EOD = 100
GPT2_STYLE = ModelConfig(vocab_size=101, n_layers=2, hidden_size=32, n_heads=4, seq_len=24)
LLAMA_STYLE = ModelConfig(vocab_size=101, n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=24,
                          position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _docs(lengths: list[int], seed: int = 3) -> list[torch.Tensor]:
    """Documents of these lengths, each ending with EOD (the last one may be cut before its EOD)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(0, EOD, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]


def test_document_positions_follow_megatron():
    """The end-of-document token ends its document; the next token is position 0 of the next one."""
    ids = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9],
                        [1, 2, 3, 4, 5, 6, 7, 8]])
    positions, segments = document_positions(ids, EOD)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert segments.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert positions.dtype == segments.dtype == torch.int64


def test_document_causal_mask_by_row_index_or_document_position():
    """Key j is visible to query i iff j <= i and both are in one document; chunks of a row (as a
    context-parallel ring pairs them) give the matching blocks of the whole mask."""
    ids = torch.tensor([[5, 6, EOD, 7, EOD, 8, 9, 1]])
    positions, segments = document_positions(ids, EOD)
    rows = torch.arange(8).expand(1, 8)
    whole = document_causal_mask(rows, rows, segments, segments)
    assert whole.shape == (1, 1, 8, 8)
    expect = torch.zeros(8, 8, dtype=torch.bool)
    for i in range(8):
        for j in range(8):
            expect[i, j] = j <= i and segments[0, j] == segments[0, i]
    assert torch.equal(whole[0, 0], expect)
    assert torch.equal(document_causal_mask(positions, positions, segments, segments), whole)
    q, k = slice(4, 8), slice(0, 4)  # a (query chunk, key chunk) pair by global indices
    assert torch.equal(document_causal_mask(rows[:, q], rows[:, k], segments[:, q], segments[:, k]),
                       whole[..., q, k])
    plain = document_causal_mask(torch.arange(8), torch.arange(8))
    assert plain.shape == (1, 1, 8, 8) and torch.equal(plain[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())


@pytest.mark.parametrize("style", sorted(STYLES))
def test_packed_row_equals_documents_one_by_one(style, float64):
    """Per-token log-probabilities of a packed row (three documents, the last cut) equal each document's run
    alone, to float64 rounding; GQA for the llama style."""
    cfg = STYLES[style]
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    docs = _docs([7, 5, 14])
    row = torch.cat(docs)[:cfg.seq_len + 1]
    x, y = row[:-1][None], row[1:][None]
    positions, segments = document_positions(x, EOD)
    packed = F.log_softmax(model(x, positions=positions, segments=segments), -1)
    packed = packed[0].gather(-1, y[0][:, None])[:, 0]
    alone, start = [], 0
    for doc in docs:
        n = min(len(doc), cfg.seq_len - start)
        logits = model(doc[None, :n])[0]
        targets = row[start + 1:start + n + 1]
        alone.append(F.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0])
        start += n
    alone = torch.cat(alone)
    assert alone.shape == packed.shape == (cfg.seq_len,)
    assert torch.allclose(packed, alone, rtol=0, atol=1e-12), (packed - alone).abs().max()
    plain = F.log_softmax(model(x), -1)[0].gather(-1, y[0][:, None])[:, 0]
    assert (plain[7:] - alone[7:]).abs().max() > 1e-3  # without the switch the documents see each other


@pytest.mark.parametrize("style", sorted(STYLES))
def test_one_document_row_matches_the_plain_forward(style, float64):
    """A row without an end-of-document token is one document: bit-identical logits and fused loss to the
    plain forward (positions 0..T-1; the boolean mask is the causal one)."""
    cfg = STYLES[style]
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, EOD, (2, cfg.seq_len), generator=g)
    y = torch.randint(0, EOD, (2, cfg.seq_len), generator=g)
    positions, segments = document_positions(x, EOD)
    assert torch.allclose(model(x, positions=positions, segments=segments), model(x), rtol=0, atol=1e-13)
    assert torch.allclose(model(x, targets=y, positions=positions, segments=segments), model(x, targets=y),
                          rtol=0, atol=1e-13)
    assert torch.equal(model(x, positions=positions), model(x))  # positions alone: causal, same positions


def test_positions_and_segments_refuse_the_kv_cache():
    model = GPT(replace(GPT2_STYLE)).eval()
    x = torch.randint(0, EOD, (1, 4))
    positions, segments = document_positions(x, EOD)
    with pytest.raises(ValueError, match="KV cache"):
        model(x, caches=model.new_caches(1, 8), positions=positions, segments=segments)


# ---- the trainer ------------------------------------------------------------------------------------------
def _short_documents(path, n: int = 60):
    """A .jsonl corpus of short documents, so that a 32-token row packs several."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w") as fh:
        for i in range(n):
            text = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 5))
            fh.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_trainer_passes_documents_to_the_model(tmp_path, style):
    """data.document_mask=true: the trainer's micro-batch loss is the model's on per-document positions and
    segments (not the plain one), and a short run with evaluation finishes."""
    from meshlm.train.trainer import Trainer
    from tests.conftest import tiny_config

    corpus = str(_short_documents(tmp_path / "docs.jsonl"))
    model = {} if style == "gpt2" else {"position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                                        "n_kv_heads": 2, "bias": False}
    cfg = tiny_config(tmp_path / "out", data={"paths": [corpus], "split": "80,20", "document_mask": True,
                                              "cache_dir": str(tmp_path / "cache")},
                      model=model, train={"max_steps": 2, "eval_every": 2})
    trainer = Trainer(cfg, progress=False)
    x, y = trainer.loader.next()
    eod = trainer.tokenizer.eod_id
    assert int((x == eod).sum(-1).min()) >= 2  # every row packs several documents
    positions, segments = document_positions(x, eod)
    with torch.no_grad():
        got = trainer.loss(x, y)
        want = trainer.model(x, targets=y, positions=positions, segments=segments)
        plain = trainer.model(x, targets=y)
    assert torch.equal(got, want) and abs(float(got) - float(plain)) > 1e-4
    result = trainer.run()
    assert result["step"] == 2 and math.isfinite(result["val_loss"])


def test_bert_refuses_document_mask(tmp_path):
    from meshlm.core.config import ConfigError
    from meshlm.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, model={"family": "bert", "vocab_size": 30522}, data={"tokenizer": "bert",
                                                                                    "document_mask": True})
    with pytest.raises(ConfigError, match=r"data.document_mask=true is not supported by model.family='bert'"):
        Trainer(cfg, progress=False)
