"""meshlm's GPT against Hugging Face GPT-2 and Llama: same logits from converted weights, exact round trips.

The HF models are built offline from small configs. Every parameter is then perturbed with noise, so biases
are non-zero and norm weights differ from one: a mapping that drops, swaps or mis-transposes any tensor
changes the logits far beyond the 1e-5 tolerance (`test_swapped_k_and_v_is_detected` and
`test_every_tensor_moves_the_logits` check that the comparison is that sensitive).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.interop import (
    from_hf_gpt2,
    from_hf_llama,
    hf_config_dict,
    load_hf,
    model_config_from_hf,
    save_hf,
    to_hf_gpt2,
    to_hf_llama,
)
from meshlm.models.gpt import GPT

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB, SEQ = 97, 16


def _perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _hf_gpt2(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                  eos_token_id=None, **overrides)
    return _perturbed(transformers.GPT2LMHeadModel(cfg))


LLAMA_CASES = {
    "gqa_tied": {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "mha_untied": {"num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False,
                   "rope_theta": 500.0, "rms_norm_eps": 1e-5},
    "mha_bias_untied": {"num_attention_heads": 4, "tie_word_embeddings": False, "attention_bias": True,
                        "mlp_bias": True},
}


def _hf_llama(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None,
                                   **LLAMA_CASES[case])
    return _perturbed(transformers.LlamaForCausalLM(cfg))


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _max_diff(hf_model: torch.nn.Module, model: GPT) -> float:
    idx = _tokens()
    return (hf_model.eval()(idx).logits - model.eval()(idx)).abs().max().item()


def _assert_state_dicts_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert value.shape == b[key].shape and torch.equal(value, b[key]), key


# ------------------------------------------------------------------------------------------ HF -> meshlm

def test_gpt2_logits_match_hf():
    hf = _hf_gpt2()
    model = from_hf_gpt2(hf.config, hf.state_dict())
    assert model.cfg.position == "learned" and model.cfg.norm == "layernorm" and model.cfg.bias
    assert model.lm_head.weight is model.tok_emb.weight
    for attention in ("sdpa", "eager"):
        hf.set_attn_implementation(attention)
        assert _max_diff(hf, model) <= TOL, attention


def test_gpt2_untied_logits_match_hf():
    hf = _hf_gpt2(tie_word_embeddings=False, n_inner=96)
    model = from_hf_gpt2(hf.config.to_dict(), hf.state_dict())
    assert not model.cfg.tie_embeddings and model.cfg.ffn_size == 96
    assert _max_diff(hf, model) <= TOL


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_logits_match_hf(case):
    hf = _hf_llama(case)
    model = from_hf_llama(hf.config, hf.state_dict())
    hf_cfg = hf.config
    assert model.cfg.kv_heads == hf_cfg.num_key_value_heads
    assert model.cfg.tie_embeddings == hf_cfg.tie_word_embeddings
    assert model.cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    for attention in ("sdpa", "eager"):
        hf.set_attn_implementation(attention)
        assert _max_diff(hf, model) <= TOL, attention


def test_swapped_k_and_v_is_detected():
    """The tolerance is far below what a wrong mapping produces: swapping K and V moves the logits by > 1e-2."""
    hf = _hf_llama("gqa_tied")
    model = from_hf_llama(hf.config, hf.state_dict())
    q_rows, kv_rows = 4 * 16, 2 * 16
    with torch.no_grad():
        w = model.layers[0].attn.qkv.weight
        k, v = w[q_rows:q_rows + kv_rows].clone(), w[q_rows + kv_rows:].clone()
        w[q_rows:q_rows + kv_rows], w[q_rows + kv_rows:] = v, k
    assert _max_diff(hf, model) > 1e-2


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_tensor_moves_the_logits(arch):
    """A mis-mapped value in any tensor would fail the equivalence tests: each one changes the logits."""
    hf = _hf_gpt2() if arch == "gpt2" else _hf_llama("mha_bias_untied")
    convert = from_hf_gpt2 if arch == "gpt2" else from_hf_llama
    model = convert(hf.config, hf.state_dict())
    for name, param in model.named_parameters():
        with torch.no_grad():
            saved = param.clone()
            param.add_(0.05 * torch.randn_like(param))
            moved = _max_diff(hf, model)
            param.copy_(saved)
        assert moved > 1e3 * TOL, name
    assert _max_diff(hf, model) <= TOL


# ------------------------------------------------------------------------------------------ round trips

MESHLM_CASES = {
    "gpt2": ModelConfig(vocab_size=VOCAB, n_layers=2, hidden_size=64, n_heads=4, seq_len=SEQ),
    "llama_gqa": ModelConfig(vocab_size=VOCAB, n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, seq_len=SEQ,
                             position="rope", norm="rmsnorm", activation="swiglu", bias=False),
    "llama_untied": ModelConfig(vocab_size=VOCAB, n_layers=2, hidden_size=64, n_heads=4, seq_len=SEQ,
                                position="rope", norm="rmsnorm", activation="swiglu", bias=False,
                                tie_embeddings=False, ffn_hidden_size=96, rope_theta=1000.0, norm_eps=1e-6),
}


def _meshlm_model(case: str) -> GPT:
    torch.manual_seed(0)
    return _perturbed(GPT(MESHLM_CASES[case]))


@pytest.mark.parametrize("case", sorted(MESHLM_CASES))
def test_meshlm_to_hf_to_meshlm_is_identical(case):
    model = _meshlm_model(case)
    to_hf, from_hf, hf_cls = ((to_hf_gpt2, from_hf_gpt2, transformers.GPT2LMHeadModel) if case == "gpt2" else
                              (to_hf_llama, from_hf_llama, transformers.LlamaForCausalLM))
    hf_config, hf_state = to_hf(model)
    back = from_hf(hf_config, hf_state)
    assert back.cfg == model.cfg
    _assert_state_dicts_equal(back.state_dict(), model.state_dict())
    hf = hf_cls(hf_config)
    hf.load_state_dict(hf_state, strict=True)  # exactly HF's keys and shapes
    assert _max_diff(hf, model) <= TOL


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_to_meshlm_to_hf_is_identical(arch):
    hf = _hf_gpt2() if arch == "gpt2" else _hf_llama("gqa_tied")
    convert, back = (from_hf_gpt2, to_hf_gpt2) if arch == "gpt2" else (from_hf_llama, to_hf_llama)
    hf_config, hf_state = back(convert(hf.config, hf.state_dict()))
    _assert_state_dicts_equal(hf_state, hf.state_dict())
    assert model_config_from_hf(hf_config) == model_config_from_hf(hf.config)


@pytest.mark.parametrize("case", sorted(MESHLM_CASES))
def test_model_config_round_trips_through_hf_config(case):
    cfg = MESHLM_CASES[case]
    assert model_config_from_hf(hf_config_dict(cfg)) == cfg


# ------------------------------------------------------------------------------------------ files

@pytest.mark.parametrize("case", sorted(MESHLM_CASES))
def test_save_hf_loads_in_transformers_and_back(case, tmp_path):
    model = _meshlm_model(case)
    save_hf(model, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tied = hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    assert tied == model.cfg.tie_embeddings
    assert _max_diff(hf, model) <= TOL
    back = load_hf(tmp_path)
    assert back.cfg == model.cfg
    _assert_state_dicts_equal(back.state_dict(), model.state_dict())


def test_load_hf_reads_hub_style_gpt2_checkpoint(tmp_path):
    """Hub GPT-2 files have no `transformer.` prefix, no lm_head (tied) and carry causal-mask buffers."""
    from safetensors.torch import save_file

    hf = _hf_gpt2()
    state = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, SEQ, SEQ))
    save_file(state, str(tmp_path / "model.safetensors"))
    hf.config.to_json_file(str(tmp_path / "config.json"))
    assert _max_diff(hf, load_hf(tmp_path)) <= TOL


# ------------------------------------------------------------------------------------------ errors

def test_gpt2_cannot_hold_rope():
    with pytest.raises(ValueError, match=r"model\.position='rope'.*set model\.position='learned'"):
        to_hf_gpt2(_meshlm_model("llama_gqa"))


def test_unrepresentable_mix_is_rejected_on_save(tmp_path):
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=1, hidden_size=32, n_heads=4, seq_len=SEQ, position="rope")
    with pytest.raises(ValueError, match=r"model\.norm='layernorm'.*model\.activation='gelu'"):
        save_hf(GPT(cfg), tmp_path)


@pytest.mark.parametrize("field,value,message", [
    ("activation_function", "gelu", r"activation_function='gelu'.*use 'gelu_new'"),
    ("scale_attn_by_inverse_layer_idx", True, r"scale_attn_by_inverse_layer_idx"),
    ("attn_pdrop", 0.2, r"set the three equal"),
])
def test_unsupported_gpt2_config_is_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({"model_type": "gpt2", "n_embd": 64, "n_head": 4, field: value})


@pytest.mark.parametrize("field,value,message", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, r"rope_type='dynamic'"),
    ("hidden_act", "gelu", r"hidden_act='gelu'"),
    ("attention_bias", True, r"attention_bias=True, mlp_bias=False"),
])
def test_unsupported_llama_config_is_rejected(field, value, message):
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96}
    with pytest.raises(ValueError, match=message):
        model_config_from_hf({**base, field: value})


def test_wrong_model_type_and_incomplete_state_are_rejected():
    hf = _hf_gpt2()
    with pytest.raises(ValueError, match=r"use from_hf_gpt2"):
        from_hf_llama(hf.config, hf.state_dict())
    state = {k: v for k, v in hf.state_dict().items() if not k.startswith("transformer.h.1.")}
    with pytest.raises(ValueError, match=r"missing \['transformer\.h\.1\.ln_1\.weight'"):
        from_hf_gpt2(hf.config, state)


def test_interop_runs_without_transformers(tmp_path):
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch; from meshlm.core.config import ModelConfig; from meshlm.models.gpt import GPT\n"
        "from meshlm.interop import save_hf, load_hf\n"
        "m = GPT(ModelConfig(vocab_size=50, n_layers=1, hidden_size=32, n_heads=4, seq_len=8))\n"
        f"save_hf(m, {str(tmp_path)!r}); b = load_hf({str(tmp_path)!r})\n"
        "assert all(torch.equal(b.state_dict()[k], v) for k, v in m.state_dict().items())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
