"""gpt-oss to and from meshlm's GPT (interop/hf_gpt_oss.py, families/hf_gpt_oss.py; models/moe.py's biases and
clamped SwiGLU, the sinks and windows of models/layers.py).

Tiny gpt-oss models are built offline by `transformers` from `GptOssConfig` (3 layers alternating local and global
attention with a window of 4, shorter than the sequences here; 4 experts, 2 per token; YaRN with truncate=false),
every parameter perturbed and the experts' weights drawn wide enough that the SwiGLU clamps engage. They are saved
with `save_pretrained`, imported with `meshlm convert --from-hf`, compared with `transformers` (logits within 1e-5,
greedy generation through `generate`, the paged engine, `meshlm generate` and `meshlm serve`, token for token),
exported with `--to-hf` and loaded by `from_pretrained` with no missing or unexpected keys, to the very tensors
they started from.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from interop_helpers import (
    IdTokenizer,
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
from meshlm.infer.engine import CacheOptions, Engine
from meshlm.infer.sampling import SamplingParams
from meshlm.interop.hf import _from_hf_state, load_hf
from meshlm.interop.hf_config import hf_config_dict, model_config_from_hf
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT
from meshlm.models.layers import rope_frequencies
from tests.checkpoint_helpers import load_run
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
TOL = 1e-5
SEQ = 24
VOCAB = 50257  # the bundled gpt2 tokenizer's size: the imports record data.tokenizer=gpt2
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 8}
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
         "num_experts_per_tok": 2, "sliding_window": 4, "max_position_embeddings": SEQ, "tie_word_embeddings": False,
         "rope_parameters": YARN}


def gpt_oss(**overrides):
    torch.manual_seed(0)
    hf = perturbed(transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**SHAPE, **overrides})))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):  # wide enough that some gate/up values pass ±7
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))
    return hf.eval()


def _ids(seed: int = 1, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))




def _logits_with(model: GPT, ids: torch.Tensor, **changes) -> torch.Tensor:
    """`model`'s logits with config switches changed (same weights)."""
    other = GPT(dataclasses.replace(model.cfg, **changes))
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        return other.eval()(ids)


@pytest.mark.parametrize("variant", ["alternating_yarn_bias", "global_plain_rope_no_bias"])
def test_gpt_oss_converts_both_ways(variant, tmp_path):
    """gpt-oss's own shape (alternating windows, YaRN without truncation, q/k/v/o biases), and one with every layer
    global, plain RoPE and attention_bias=false."""
    overrides = {} if variant == "alternating_yarn_bias" else {
        "layer_types": ["full_attention"] * 3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "attention_bias": False}
    hf = gpt_oss(**overrides)
    hf.save_pretrained(str(tmp_path / "hf"))
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    model, _, cfg = load_run(str(tmp_path / "run"))
    m = cfg.model
    assert (m.moe_experts, m.moe_top_k, m.expert_size, m.moe_bias, m.moe_activation, m.attention_sinks, m.head_dim) \
        == (4, 2, 24, True, "swiglu_clamped", True, 8)
    windows = (4, 2, "yarn", False, True) if not overrides else (0, 0, "none", True, False)
    assert (m.sliding_window, m.window_pattern, m.rope_scaling, m.rope_truncate, m.bias) == windows
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
        ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
        back = load_whole(transformers.GptOssForCausalLM, tmp_path / "out")
        assert_same_state(back.state_dict(), hf.state_dict())
        assert torch.equal(back(ids).logits, want)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["layer_types"] == hf.config.layer_types


def test_each_gpt_oss_part_changes_the_logits(tmp_path):
    """The parts the match rests on are all in use here: the SwiGLU clamps, its (up + 1)·σ(alpha·gate) form, the
    sinks and the windows each move the logits when taken away (YaRN's untruncated ramp: the frequencies' test)."""
    hf = gpt_oss()
    model = _from_hf_state(model_config_from_hf(hf.config.to_dict()), hf.state_dict(), "gpt_oss").eval()
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        assert float((model(ids) - want).abs().max()) <= TOL
    for change in ({"moe_swiglu_limit": 1e6}, {"moe_activation": "swiglu"}, {"sliding_window": 0, "window_pattern": 0}):
        assert float((_logits_with(model, ids, **change) - want).abs().max()) > 1e-4, change
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.sinks.fill_(-1e4)  # exp(sink) ≈ 0: plain softmax
        assert float((model(ids) - want).abs().max()) > 1e-3


def test_greedy_generation_equals_transformers_and_the_engine(tmp_path):
    """generate (KV cache) and the paged engine (blocks of 4, prefill chunks of 3; then two prompts sharing their
    first 8 tokens with the cached first one) continue as transformers' greedy generate does, past the window."""
    hf = gpt_oss()
    hf.save_pretrained(str(tmp_path))
    model = load_hf(tmp_path).eval()
    prompt = _ids(2, 10)
    prompt[1, :8] = prompt[0, :8]
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = generate(model, prompt, 12, temperature=0)
    assert torch.equal(ours, theirs)
    assert len(set(ours[:, 10:].flatten().tolist())) > 4  # a continuation, not one token repeated
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for options in (CacheOptions(), CacheOptions(block_size=4, max_batched_tokens=3)):
        engine = Engine(model, IdTokenizer(), max_seqs=2, options=options)
        assert engine.generate([prompt[0].tolist()], sp)[0].output_ids == theirs[0, 10:].tolist()
        reqs = engine.generate([row.tolist() for row in prompt], sp)
        assert [r.output_ids for r in reqs] == theirs[:, 10:].tolist()


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_frequencies_equal_transformers(truncate):
    """meshlm's YaRN inverse frequencies and cos/sin factor equal transformers' with and without truncation, at
    gpt-oss's own RoPE (head_dim 64, theta 150,000, factor 32 over 4,096 positions)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 4096}
    hf = transformers.GptOssConfig(**{**SHAPE, "head_dim": 64, "max_position_embeddings": 131072,
                                      "rope_parameters": rope})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = model_config_from_hf(hf.to_dict())
    assert cfg.rope_truncate is truncate
    got, ours = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and abs(ours - factor) < 1e-12
    other, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, dataclasses.replace(cfg, rope_truncate=not truncate))
    assert float(((other - want) / want).abs().max()) > 1e-3  # the flag matters at this shape


def test_layer_types_map_to_window_pattern():
    def read(types, window=4):
        return model_config_from_hf({**gpt_oss().config.to_dict(), "num_hidden_layers": 6, "layer_types": types,
                                     "sliding_window": window})

    s, f = "sliding_attention", "full_attention"
    assert (read([s] * 6).sliding_window, read([s] * 6).window_pattern) == (4, 0)
    assert read([s, s, f] * 2).window_pattern == 3
    cfg = read([s, s, f] * 2)
    assert ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(6)] == [s, s, f] * 2
    assert hf_config_dict(cfg)["layer_types"] == [s, s, f] * 2
    with pytest.raises(ConfigError, match="layer_types.*every N-th"):
        read([f, s, s, s, s, s])
    with pytest.raises(ConfigError, match="sliding_window is null"):
        read([s, f] * 3, None)


def test_parameter_count_formula_equals_the_model():
    cfg = model_config_from_hf(gpt_oss().config.to_dict())
    assert parameter_count(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_what_gpt_oss_cannot_hold_is_refused(tmp_path):
    path = tmp_path / "mxfp4"
    path.mkdir()
    config = {**gpt_oss().config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))
    one_error_line(["convert", "--from-hf", str(path), "--out", str(tmp_path / "run")], "quantization_config",
                   "dequantize")
    assert not (tmp_path / "run").exists()
    cfg = model_config_from_hf(gpt_oss().config.to_dict())
    with pytest.raises(ConfigError, match=r"model.moe_bias=False.*model.moe_activation='swiglu'"):
        hf_config_dict(dataclasses.replace(cfg, moe_bias=False, moe_activation="swiglu"), "gpt_oss")
    with pytest.raises(ConfigError, match="cannot be written as Hugging Face mixtral.*'gpt_oss'"):
        hf_config_dict(cfg, "mixtral")
    plain = tiny_config(tmp_path, model={"position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                                         "moe_experts": 4, "moe_bias": True, "moe_shared_experts": 1})
    save_checkpoint(tmp_path / "ck", 1, {"model": GPT(plain.model).state_dict()}, plain.to_dict())
    one_error_line(["convert", "--checkpoint", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "out")],
                   "model.attention_sinks", "model.moe_shared_experts")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, words", [
    ({"moe_activation": "gelu"}, "model.moe_activation"),
    ({"moe_bias": True}, "model.moe_experts=0"),
    ({"moe_experts": 4, "moe_swiglu_limit": 0}, "model.moe_swiglu_limit"),
    ({"moe_experts": 4, "moe_shared_experts": 1, "moe_activation": "swiglu_clamped"}, "model.moe_shared_experts=0"),
    ({"rope_truncate": False}, "model.rope_truncate"),
])
def test_bad_gpt_oss_keys_are_one_line_errors(model, words, tmp_path):
    base = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu"}
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")) as err:
        tiny_config(tmp_path, model={**base, **model})
    assert "\n" not in str(err.value)


def test_generate_and_serve_equal_transformers_greedy(tmp_path):
    """`meshlm generate` (one sequence, KV cache) and `meshlm serve` (the paged engine, two prompts batched) give
    transformers' greedy tokens for an imported gpt-oss, past its window of 4."""
    assert_generate_and_serve_equal_hf(gpt_oss(bos_token_id=50256, eos_token_id=50256), tmp_path)


def test_gpt_oss_20b_config_reads_and_writes_back():
    """gpt-oss-20b's shape (transformers' defaults with its 24 layers and 32 experts; no weights built): the keys
    it maps to, and the config.json meshlm writes reads back to the same ModelConfig."""
    hf = transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    cfg = model_config_from_hf(hf.to_dict())
    assert (cfg.hidden_size, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.expert_size, cfg.moe_experts,
            cfg.moe_top_k) == (2880, 64, 8, 64, 2880, 32, 4)
    assert (cfg.sliding_window, cfg.window_pattern, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor,
            cfg.rope_original_len, cfg.rope_truncate) == (128, 2, 150000.0, "yarn", 32.0, 4096, False)
    assert (cfg.bias, cfg.attention_sinks, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha) == (True, True, 7.0, 1.702)
    written = hf_config_dict(cfg)
    assert model_config_from_hf(written) == cfg
    assert written["layer_types"] == hf.layer_types and written["rope_parameters"]["truncate"] is False
