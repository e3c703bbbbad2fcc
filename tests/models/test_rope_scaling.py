"""RoPE scaling for long-context extension (Llama 3 and YaRN): frequencies, logits and Hugging Face round trips.

transformers' own rope functions and LlamaForCausalLM are the reference: the inverse frequencies must match
theirs, and a tiny Llama with scaled RoPE, converted either way, gives the same logits within 1e-5 on a
sequence four times longer than the context it was "pretrained" with (so every scaled frequency matters).
"""

from __future__ import annotations

import pytest
import torch

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.interop import from_hf_llama, hf_config_dict, model_config_from_hf, to_hf_llama
from meshlm.models.gpt import GPT
from meshlm.models.layers import rope_frequencies, rope_tables

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

VOCAB, ORIGINAL, SEQ = 97, 16, 64

RULES = {
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "llama3_narrow": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0,
                      "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_betas_attention": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                             "attention_factor": 1.3, "original_max_position_embeddings": ORIGINAL},
}


def _hf_config(rule: str, theta: float = 500.0):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                    bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
                                    rope_parameters={**RULES[rule], "rope_theta": theta})


@pytest.mark.parametrize("rule", sorted(RULES))
def test_frequencies_equal_transformers(rule):
    hf_cfg = _hf_config(rule)
    expected, expected_factor = ROPE_INIT_FUNCTIONS[RULES[rule]["rope_type"]](hf_cfg, None)
    cfg = model_config_from_hf(hf_cfg.to_dict())
    got, factor = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    plain, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    assert not torch.allclose(got, plain)  # the rule changes the frequencies (the test can tell them apart)


@pytest.mark.parametrize("rule", sorted(RULES))
@torch.no_grad()
def test_scaled_llama_logits_match_transformers_both_ways(rule):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_hf_config(rule)).eval()
    for p in hf.parameters():
        p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = from_hf_llama(hf.config, hf.state_dict()).eval()
    assert model.cfg.rope_scaling == RULES[rule]["rope_type"] and model.cfg.rope_original_len == ORIGINAL
    assert (hf(idx).logits - model(idx)).abs().max().item() <= 1e-5
    # meshlm -> HF: the exported config rebuilds the same model in transformers
    back_cfg, back_state = to_hf_llama(model)
    again = transformers.LlamaForCausalLM(back_cfg).eval()
    again.load_state_dict(back_state)
    assert (again(idx).logits - model(idx)).abs().max().item() <= 1e-5
    assert model_config_from_hf(hf_config_dict(model.cfg)) == model.cfg


def test_scaling_changes_long_positions_and_yarn_scales_cos_sin():
    base = ModelConfig(vocab_size=VOCAB, n_layers=1, hidden_size=64, n_heads=4, seq_len=SEQ, position="rope")
    yarn = ModelConfig(**{**base.__dict__, "rope_scaling": "yarn", "rope_factor": 4.0,
                          "rope_original_len": ORIGINAL})
    cos0, _ = rope_tables(16, SEQ, 10000.0)
    cos1, _ = rope_tables(16, SEQ, 10000.0, scaling=yarn)
    factor = 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0
    # position 0 has angle 0 everywhere: cos is the attention factor, not 1
    torch.testing.assert_close(cos1[0], torch.full((16,), factor))
    assert not torch.allclose(cos1[SEQ - 1] / factor, cos0[SEQ - 1])
    torch.testing.assert_close(rope_tables(16, SEQ, 10000.0, scaling=base)[0], cos0)
    torch.manual_seed(0)
    a, b = GPT(base).eval(), GPT(yarn).eval()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, VOCAB, (1, SEQ))
    assert not torch.allclose(a(idx), b(idx))


@pytest.mark.parametrize("changes,message", [
    ({"rope_scaling": "yarn", "rope_original_len": 16, "position": "learned"}, r"set model\.position='rope'"),
    ({"rope_scaling": "llama3"}, r"needs model\.rope_original_len"),
    ({"rope_scaling": "dynamic"}, r"model\.rope_scaling='dynamic' is not one of"),
    ({"rope_scaling": "llama3", "rope_original_len": 16, "rope_factor": 0.5}, r"rope_factor=0\.5 must be at least 1"),
    ({"rope_scaling": "llama3", "rope_original_len": 16, "rope_low_freq_factor": 4.0}, r"0 < low < high"),
    ({"rope_scaling": "yarn", "rope_original_len": 16, "rope_beta_slow": 40.0}, r"0 < beta_slow < beta_fast"),
])
def test_bad_scaling_config_names_the_key(changes, message):
    values = {"vocab_size": VOCAB, "n_layers": 1, "hidden_size": 64, "n_heads": 4, "position": "rope", **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**values).validate()


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0}, r"mscale"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, r"truncate=false"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type='dynamic'"),
])
def test_unsupported_hf_rope_parameters_are_refused(rope, message):
    d = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
         "max_position_embeddings": SEQ, "rope_parameters": {**rope, "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(d)
