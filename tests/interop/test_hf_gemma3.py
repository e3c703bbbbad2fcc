"""Gemma 3's text model to and from meshlm's GPT (interop/hf_gemma3.py, families/hf_gemma3.py; the layer parts in
models/layers.py and models/gpt.py: (1 + w) RMSNorms, sandwich norms, scaled embeddings, query_pre_attn_scalar,
GeGLU, the local layers' own RoPE base).

Tiny `Gemma3ForCausalLM` models are built offline by `transformers` from `Gemma3TextConfig`: 4 layers alternating
local and global attention (sliding_window_pattern 2) with a window of 4, shorter than the sequences here, two KV
heads of 16 over a width of 32, query_pre_attn_scalar apart from head_dim, tied embeddings; every parameter
perturbed (so the norms' w are not 0). They are saved with `save_pretrained`, imported with `meshlm convert
--from-hf`, compared with `transformers` (logits within 1e-5, greedy generation through `generate`, the paged
engine, `meshlm generate` and `meshlm serve`, token for token), exported with `--to-hf` and loaded by
`from_pretrained` with no missing or unexpected keys, to the very tensors they started from.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from interop_helpers import (
    assert_generate_and_engine_equal_hf,
    assert_generate_and_serve_equal_hf,
    assert_same_state,
    load_whole,
    ok,
    one_error_line,
    perturbed,
)

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import ConfigError
from meshlm.core.memory import parameter_count
from meshlm.interop.hf import _from_hf_state, load_hf
from meshlm.interop.hf_config import hf_config_dict, model_config_from_hf
from meshlm.models.gpt import GPT
from meshlm.models.layers import rope_frequencies
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 24
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
         "sliding_window": 4, "sliding_window_pattern": 2, "max_position_embeddings": SEQ,
         "rope_theta": 1e6, "rope_local_base_freq": 1e4}
LINEAR = {"rope_type": "linear", "factor": 4.0}  # Gemma 3 4B's kind of scaling, on the global layers only


def gemma3(**overrides):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**{**SHAPE, **overrides})
    return perturbed(transformers.Gemma3ForCausalLM(config))


def _ids(seed: int = 1, n: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["plain_rope", "linear_scaling_untied"])
def test_gemma3_converts_both_ways(variant, tmp_path):
    """Gemma 3's own shape, and one with linear RoPE scaling on the global layers and an untied head."""
    overrides = {} if variant == "plain_rope" else {"rope_scaling": LINEAR, "tie_word_embeddings": False}
    hf = gemma3(**overrides)
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    m = cfg.model
    assert (m.activation, m.norm_unit_offset, m.sandwich_norm, m.embed_scale, m.qk_norm, m.attn_scale_dim) == \
        ("geglu", True, True, True, True, 24.0)
    assert (m.sliding_window, m.window_pattern, m.rope_theta, m.rope_local_theta, m.head_dim) == (4, 2, 1e6, 1e4, 16)
    assert (m.rope_scaling, m.rope_factor, m.tie_embeddings) == \
        (("none", 1.0, True) if not overrides else ("linear", 4.0, False))
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back = load_whole(transformers.Gemma3ForCausalLM, tmp_path / "out")
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["layer_types"] == hf.config.layer_types and written["model_type"] == "gemma3_text"
    assert model_config_from_hf(written) == m


def _logits_with(model: GPT, ids: torch.Tensor, **changes) -> torch.Tensor:
    """`model`'s logits with config switches changed (same weights)."""
    other = GPT(dataclasses.replace(model.cfg, **changes))
    other.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        return other.eval()(ids)


def test_each_gemma3_part_changes_the_logits():
    """The parts the match rests on are all in use: each moves the logits when taken away (the sandwich norms by
    replacing them with identities, the local RoPE base by the global one)."""
    hf = gemma3(vocab_size=101)
    model = _from_hf_state(model_config_from_hf(hf.config.to_dict()), hf.state_dict(), "gemma3_text").eval()
    ids = _ids(vocab=101)
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
    for change in ({"norm_unit_offset": False}, {"embed_scale": False}, {"attn_scale_dim": 0.0},
                   {"activation": "swiglu"}, {"rope_local_theta": 0.0}, {"sliding_window": 0, "window_pattern": 0,
                                                                          "rope_local_theta": 0.0}):
        assert float((_logits_with(model, ids, **change) - want).abs().max()) > 1e-3, change
    with torch.no_grad():
        for layer in model.layers:
            layer.post_attn_norm = layer.post_mlp_norm = None
        assert float((model(ids) - want).abs().max()) > 1e-3


def test_greedy_generation_equals_transformers_and_the_engine(tmp_path):
    """generate (KV cache) and the paged engine (blocks of 4, prefill chunks of 3; then two prompts sharing their
    first 8 tokens with the cached first one, so decoding rows share blocks) continue as transformers' greedy
    generate does, past the window."""
    hf = gemma3()
    hf.save_pretrained(str(tmp_path))
    prompt = _ids(2, 10)
    prompt[1, :8] = prompt[0, :8]
    assert_generate_and_engine_equal_hf(hf, load_hf(tmp_path).eval(), prompt)


def test_generate_and_serve_equal_transformers_greedy(tmp_path):
    """`meshlm generate` (one sequence, KV cache) and `meshlm serve` (the paged engine, two prompts batched) give
    transformers' greedy tokens for an imported Gemma 3, past its window of 4."""
    assert_generate_and_serve_equal_hf(gemma3(bos_token_id=50256, eos_token_id=50256, pad_token_id=50256), tmp_path)


def test_linear_rope_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.Gemma3TextConfig(**{**SHAPE, "rope_scaling": LINEAR})
    want, factor = ROPE_INIT_FUNCTIONS["linear"](hf, layer_type="full_attention")
    cfg = model_config_from_hf(hf.to_dict())
    got, ours = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0) and ours == factor == 1.0


def test_gemma3_1b_config_reads_and_writes_back():
    """Gemma-3-1B's shape (no weights built): the keys it maps to, and the config.json meshlm writes reads back to
    the same ModelConfig; transformers 4.x's form (sliding_window_pattern, rope_local_base_freq, no layer_types)
    reads the same."""
    hf = transformers.Gemma3TextConfig(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                       head_dim=256, sliding_window=512, max_position_embeddings=32768)
    cfg = model_config_from_hf(hf.to_dict())
    assert (cfg.hidden_size, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_size, cfg.attn_scale_dim) == \
        (1152, 4, 1, 256, 6912, 0.0)
    assert (cfg.sliding_window, cfg.window_pattern, cfg.rope_theta, cfg.rope_local_theta, cfg.norm_eps) == \
        (512, 6, 1e6, 1e4, 1e-6)
    assert parameter_count(cfg) == 999_885_952  # google/gemma-3-1b-pt's count
    written = hf_config_dict(cfg)
    assert model_config_from_hf(written) == cfg and written["layer_types"] == hf.layer_types
    old = {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
    assert model_config_from_hf({**old, "sliding_window_pattern": 6}) == cfg


def test_parameter_count_formula_equals_the_model():
    cfg = model_config_from_hf(gemma3(tie_word_embeddings=False).config.to_dict())
    assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


@pytest.mark.parametrize("changes, words", [
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping=30.0", "set final_logit_softcapping=null"]),
    ({"attn_logit_softcapping": 50.0}, ["attn_logit_softcapping=50.0"]),
    ({"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ({"attention_bias": True}, ["attention_bias"]),
    ({"hidden_activation": "gelu"}, ["hidden_activation='gelu'", "gelu_pytorch_tanh"]),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, ["sliding_attention"]),
    ({"model_type": "gemma3"}, ["model_type='gemma3'", "gemma3_text"]),
])
def test_what_meshlm_cannot_read_is_refused(changes, words, tmp_path):
    config = {**gemma3().config.to_dict(), "architectures": ["Gemma3ForCausalLM"], **changes}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    one_error_line(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")], *words)
    assert not (tmp_path / "run").exists()


def test_what_gemma3_cannot_hold_is_refused(tmp_path):
    cfg = model_config_from_hf(gemma3().config.to_dict())
    with pytest.raises(ConfigError, match=r"model.activation='swiglu'.*model.sandwich_norm=False"):
        hf_config_dict(dataclasses.replace(cfg, sandwich_norm=False, activation="swiglu"))
    with pytest.raises(ConfigError, match="Gemma's layer parts cannot be written as Hugging Face llama"):
        hf_config_dict(cfg, "llama")
    llama = tiny_config(tmp_path, model={"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False})
    with pytest.raises(ConfigError, match=r"model.activation='swiglu' \(set model.activation='geglu'\)"):
        hf_config_dict(llama.model, "gemma3_text")
    geglu = tiny_config(tmp_path, model={"position": "rope", "norm": "rmsnorm", "activation": "geglu", "bias": False})
    save_checkpoint(tmp_path / "ck", 1, {"model": GPT(geglu.model).state_dict()}, geglu.to_dict())
    one_error_line(["convert", "--checkpoint", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "out")],
                   "model.norm_unit_offset", "model.sandwich_norm", "model.qk_norm")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, words", [
    ({"norm_unit_offset": True}, "model.norm_unit_offset=true"),
    ({"attn_scale_dim": -1.0}, "model.attn_scale_dim"),
    ({"rope_local_theta": 1e4}, "model.rope_local_theta"),
    ({"rope_local_theta": -5.0}, "model.rope_local_theta"),
    ({"activation": "reglu"}, "model.activation"),
])
def test_bad_gemma_keys_are_one_line_errors(model, words, tmp_path):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as err:
        tiny_config(tmp_path, model=model)
    assert "\n" not in str(err.value)
