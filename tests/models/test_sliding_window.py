"""Sliding-window attention and sinks in meshlm's own paths (issue 46): packed documents (each document alone
sees the same window), a window at least as long as the sequence (global attention), the per-row KV cache that
batched serving and the draft model use, the layer pattern, and the config's one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.models.gpt import GPT

LLAMA = {"vocab_size": 97, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 32,
         "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False}


def _model(**changes) -> GPT:
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**LLAMA, **changes})).double().eval()
    with torch.no_grad():
        for layer in model.layers:
            if layer.attn.sinks is not None:
                layer.attn.sinks.normal_(0, 1)
    return model


@pytest.mark.parametrize("changes", [{"sliding_window": 3}, {"sliding_window": 3, "attention_sinks": True},
                                     {"sliding_window": 4, "window_pattern": 2}])
def test_packed_documents_see_their_own_window(changes):
    """Three documents packed in one row (positions restart, segments apart) give each document's logits as
    that document run alone: the band is combined with the document mask, never reaching across documents."""
    model = _model(**changes)
    lengths = [7, 2, 9]
    x = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = model(x, positions=positions, segments=segments)
        alone = torch.cat([model(part) for part in x.split(lengths, dim=1)], dim=1)
    assert float((packed - alone).abs().max()) < 1e-12


def test_a_window_as_long_as_the_sequence_is_global_attention_and_shorter_ones_differ():
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = _model()(x)
        assert torch.allclose(_model(sliding_window=12)(x), full, rtol=0, atol=1e-12)
        assert float((_model(sliding_window=11)(x) - full).abs().max()) > 1e-6


@pytest.mark.parametrize("changes", [{"sliding_window": 3}, {"sliding_window": 3, "attention_sinks": True,
                                                             "window_pattern": 2}])
def test_per_row_cache_decoding_equals_the_whole_forward(changes):
    """Rows at different positions (a (B,) tensor `start`, as batched serving and the draft model run) attend
    over the per-row cache with the band: each step's logits equal the whole sequence's at that position."""
    model = _model(**changes)
    x = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x)
        caches = model.new_caches(2, 16)
        model(x[:, :6], caches=caches, start=0)  # row 0 then goes on from position 4 (its keys from 4 hidden)
        for t in range(4, 8):  # row 1 two positions ahead
            rows = torch.tensor([t, t + 2])
            got = model(torch.stack([x[0, t:t + 1], x[1, t + 2:t + 3]]), caches=caches, start=rows)
            assert float((got[0, 0] - want[0, t]).abs().max()) < 1e-12
            assert float((got[1, 0] - want[1, t + 2]).abs().max()) < 1e-12


def test_the_pattern_picks_local_and_global_layers():
    gemma = ModelConfig(**{**LLAMA, "n_layers": 12, "sliding_window": 512, "window_pattern": 6})
    assert [gemma.layer_window(i) for i in range(12)] == ([512] * 5 + [0]) * 2
    oss = dataclasses.replace(gemma, window_pattern=2)
    assert [oss.layer_window(i) for i in range(4)] == [512, 0, 512, 0]
    assert [layer.attn.window for layer in GPT(dataclasses.replace(oss, n_layers=4)).layers] == [512, 0, 512, 0]


@pytest.mark.parametrize("changes, words", [({"sliding_window": -1}, "model.sliding_window=-1"),
                                            ({"window_pattern": 2}, "model.window_pattern=2"),
                                            ({"attention": "mla", "sliding_window": 4}, "model.attention='mla'")])
def test_bad_window_settings_are_refused_in_one_line(changes, words):
    with pytest.raises(ConfigError, match=words) as err:
        ModelConfig(**{**LLAMA, **changes}).validate()
    assert "\n" not in str(err.value)


def test_bert_refuses_windows_and_sinks():
    from meshlm.models.bert import BERT

    for changes in ({"sliding_window": 4}, {"attention_sinks": True}):
        cfg = ModelConfig(family="bert", vocab_size=97, n_layers=1, hidden_size=32, n_heads=4, seq_len=16, **changes)
        cfg.validate()
        with pytest.raises(ConfigError, match="for the GPT family only"):
            BERT(cfg)


def test_the_paged_engine_decodes_windows_and_sinks_as_the_whole_forward():
    """Greedy tokens of the paged engine (blocks of 4, prefill chunks of 3, two prompts sharing their first 8
    tokens, so decoding rows share blocks and skip the cascade) for a model with alternating windows and sinks:
    each is the argmax of the whole-sequence forward at its position (teacher-forced check, no cache)."""
    from meshlm.infer.engine import CacheOptions, Engine
    from meshlm.infer.sampling import SamplingParams

    model = _model(sliding_window=3, window_pattern=2, attention_sinks=True).float()
    prompt = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    prompt[1, :8] = prompt[0, :8]

    class Ids:
        eod_id = None

        def decode(self, ids):
            return " ".join(map(str, ids))

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = Engine(model, Ids(), max_seqs=2, options=CacheOptions(block_size=4, max_batched_tokens=3))
    engine.generate([prompt[0].tolist()], sp)  # its prompt's blocks stay cached: the next two rows share them
    for row, req in zip(prompt, engine.generate([row.tolist() for row in prompt], sp)):
        tokens = torch.tensor(row.tolist() + req.output_ids)[None]
        with torch.no_grad():
            want = model(tokens[:, :-1]).argmax(-1)[0, 9:]
        assert req.output_ids == want.tolist()
