"""Mistral to and from meshlm's GPT (interop/hf_mistral.py; `model.sliding_window`), and the sliding-window and
sink attention core against transformers.

A tiny Mistral is built offline by `transformers` from its config class with a window of 4, shorter than every
sequence here, so the window changes the outputs; every parameter perturbed. It is saved with `save_pretrained`,
imported with `meshlm convert --from-hf`, compared with `transformers` (logits within 1e-5, greedy generation token
for token through `generate` and the paged engine: prompt + continuation longer than the window, chunked prefill
and shared prompt blocks included), exported with `--to-hf` and loaded back to the very tensors it started from.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from interop_helpers import (
    assert_generate_and_engine_equal_hf,
    assert_same_state,
    ok,
    one_error_line,
    perturbed,
)

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import ConfigError
from meshlm.interop.hf import load_hf
from meshlm.interop.hf_config import hf_config_dict, model_config_from_hf
from meshlm.models.gpt import GPT
from meshlm.models.layers import Attention
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 24
WINDOW = 4
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2


def mistral(**overrides):
    torch.manual_seed(0)
    values = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 48, "num_hidden_layers": 2, "max_position_embeddings": SEQ,
              "sliding_window": WINDOW, "tie_word_embeddings": False}
    config = transformers.MistralConfig(**{**values, **overrides})
    return perturbed(transformers.MistralForCausalLM(config).eval())


def _ids(seed: int = 1, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_mistral_converts_both_ways(tmp_path):
    hf = mistral()
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    assert (cfg.model.sliding_window, cfg.model.window_pattern, cfg.model.bias) == (WINDOW, 0, False)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        unwindowed = GPT(dataclasses.replace(cfg.model, sliding_window=0))
        unwindowed.load_state_dict(model.state_dict())
        assert float((unwindowed.eval()(ids) - want).abs().max()) > 1e-3  # the window matters at this length
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back, info = transformers.MistralForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert back.config.sliding_window == WINDOW
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back.eval()(ids).logits, want)


def test_greedy_generation_equals_transformers_and_the_engine(tmp_path):
    """generate (KV cache) and the paged engine (blocks of 4, prefill chunks of 3 tokens; then two prompts
    sharing their first 8 tokens with the cached first one, so decoding rows share blocks) continue as
    transformers' greedy generate does."""
    hf = mistral()
    hf.save_pretrained(str(tmp_path))
    prompt = _ids(2, 10)
    prompt[1, :8] = prompt[0, :8]
    assert_generate_and_engine_equal_hf(hf, load_hf(tmp_path).eval(), prompt)


def test_what_mistral_cannot_hold_is_refused(tmp_path):
    alternating = tiny_config(tmp_path, model={"position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                                               "bias": False, "sliding_window": 4, "window_pattern": 2})
    with pytest.raises(ConfigError, match="model.window_pattern=2"):
        hf_config_dict(alternating.model)
    with pytest.raises(ConfigError, match="model.sliding_window=4.*export it as 'mistral'"):
        hf_config_dict(dataclasses.replace(alternating.model, window_pattern=0), "llama")
    save_checkpoint(tmp_path / "run", 1, {"model": GPT(alternating.model).state_dict()}, alternating.to_dict())
    one_error_line(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")],
                   "model.window_pattern")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="layer_types"):
        model_config_from_hf({**mistral().config.to_dict(), "layer_types": ["full_attention"] * 2})
    none = model_config_from_hf({**mistral().config.to_dict(), "sliding_window": None})
    assert none.sliding_window == 0


def _reference_mask(T: int, window: int) -> torch.Tensor:
    """Additive (T, T) mask, by hand: causal, and key j visible to query i only when i - j < window."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & (i - j < window if window else True)
    return torch.zeros(T, T, dtype=torch.float64).masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("window", [0, 3])
def test_sink_attention_equals_gpt_oss(window, tmp_path):
    """Attention's core with sinks (and a window) equals transformers' gpt-oss eager attention, which adds the
    per-head sink logit to each softmax's denominator; float64. Decoding over a cache (one query, every key) and
    the packed-document mask give the rows of the whole-sequence result."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    cfg = tiny_config(tmp_path, model={"position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                                       "n_kv_heads": 2, "attention_sinks": True, "sliding_window": window}).model
    attn = Attention(cfg).double().eval()
    torch.nn.init.normal_(attn.sinks, std=2.0, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    B, T, hd = 2, 7, attn.head_dim
    q = torch.randn(B, 4, T, hd, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(B, 2, T, hd, dtype=torch.float64, generator=gen) for _ in range(2))
    attn.num_key_value_groups = 2  # what gpt-oss's eager path reads of its module
    want, _ = eager_attention_forward(attn, q, k, v, _reference_mask(T, window), scaling=hd ** -0.5, dropout=0.0)
    want = want.transpose(1, 2)  # (B, nh, T, hd)
    with torch.no_grad():
        assert float((attn.core(q, k, v, True) - want).abs().max()) <= 1e-12
        last = attn.core(q[:, :, -1:], k, v, False)  # decoding: the last query over the cache's keys
        assert float((last - want[:, :, -1:]).abs().max()) <= 1e-12
        causal = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None, None]
        assert float((attn.core(q, k, v, False, causal) - want).abs().max()) <= 1e-12
