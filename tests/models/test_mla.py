"""Multi-head latent attention (models/mla.py, `model.attention='mla'`): the block against a hand computation, the
KV cache and packed documents against the plain forward, the config's refusals, and the planner's formulas
(parameters, FLOPs, saved activation bytes) against the model and the bytes autograd really saves.

transformers' DeepseekV3 is the other, independent reference (tests/interop/test_hf_deepseek_v3.py); tp/pp/dp
are in tests/parallel/test_mla_parallel_exact.py.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from meshlm.core.config import ConfigError, ModelConfig, build
from meshlm.core.flops import model_flops
from meshlm.core.memory import layer_activation_bytes, parameter_count
from meshlm.families.registry import spec_of
from meshlm.models.activations import measure_saved_activations
from meshlm.models.generate import generate
from meshlm.models.gpt import GPT
from meshlm.parallel.recompute import apply_recompute

MLA = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "attention": "mla",
       "q_lora_rank": 12, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


def tiny(**changes) -> ModelConfig:
    cfg = ModelConfig(**{"vocab_size": 61, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 24,
                         "tie_embeddings": False, **MLA, **changes})
    cfg.validate()
    return cfg


def _rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_attention(attn, x, theta):
    """The MLA formulas written out head by head (float64): latents, interleaved rope pairs rotated in place
    (pair j of the rope dims by angle pos·θ^(-2j/d_r)), softmax(q·k·s) over the causal keys, W_o."""
    n, dn, dr, dv = attn.n_heads, attn.nope_dim, attn.rope_dim, attn.v_dim
    T = x.shape[0]
    if attn.q_compressed:
        q = _rms(x @ attn.q_down.weight.T, attn.q_norm.weight) @ attn.q_up.weight.T  # (T, n·(d_n+d_r))
    else:
        q = x @ attn.q.weight.T
    down = x @ attn.kv_down.weight.T
    latent, k_r = down[:, :attn.kv_rank], down[:, attn.kv_rank:]
    kv = _rms(latent, attn.kv_norm.weight) @ attn.kv_up.weight.T
    freqs = theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs  # (T, dr/2)

    def rotate(v):  # interleaved pairs (2j, 2j+1)
        a, b = v[..., 0::2], v[..., 1::2]
        out = torch.empty_like(v)
        out[..., 0::2] = a * angle.cos() - b * angle.sin()
        out[..., 1::2] = a * angle.sin() + b * angle.cos()
        return out

    k_rope = rotate(k_r)
    outs = []
    for i in range(n):
        qi = q[:, i * (dn + dr):(i + 1) * (dn + dr)]
        kvi = kv[:, i * (dn + dv):(i + 1) * (dn + dv)]
        qh = torch.cat([qi[:, :dn], rotate(qi[:, dn:])], -1)
        kh = torch.cat([kvi[:, :dn], k_rope], -1)
        scores = qh @ kh.T * attn.scale
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(scores.softmax(-1) @ kvi[:, dn:])
    return torch.cat(outs, -1) @ attn.proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [12, 0])
def test_block_equals_the_formulas_written_out(q_lora_rank):
    torch.manual_seed(0)
    cfg = tiny(q_lora_rank=q_lora_rank)
    model = GPT(cfg).double().eval()
    attn = model.layers[0].attn
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(1, 10, 32, dtype=torch.float64)
        got = attn(x, model.rope(10))[0]
        want = _reference_attention(attn, x[0], cfg.rope_theta)
    assert float((got - want).abs().max()) < 1e-8  # the RoPE tables are computed in fp32, as Llama's
    assert attn.scale == (8 + 4) ** -0.5


def test_yarn_scales_the_softmax_by_mscale_squared():
    cfg = tiny(rope_scaling="yarn", rope_factor=4.0, rope_original_len=8, rope_mscale_all_dim=0.7)
    mscale = 0.1 * 0.7 * math.log(4.0) + 1
    assert GPT(cfg).layers[0].attn.scale == pytest.approx((8 + 4) ** -0.5 * mscale ** 2, rel=1e-15)


def test_kv_cache_and_packed_documents_equal_the_plain_forward():
    """Greedy decoding with the cache (full keys/values, padded to one width) equals decoding without; two
    packed documents equal each one alone."""
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(model, prompt, 8, temperature=0),
                       generate(model, prompt, 8, temperature=0, use_cache=False))
    a, b = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 9))
    ids = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    segments = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        packed = model(ids, positions=positions, segments=segments)
        assert torch.allclose(packed[:, :7], model(a), atol=1e-5)
        assert torch.allclose(packed[:, 7:], model(b), atol=1e-5)


@pytest.mark.parametrize("changes, words", [
    ({"kv_lora_rank": 0}, ["model.kv_lora_rank", "set it"]),
    ({"position": "learned"}, ["model.position='rope'"]),
    ({"qk_rope_head_dim": 5}, ["model.qk_rope_head_dim=5", "even"]),
    ({"bias": True}, ["model.bias=false"]),
    ({"n_kv_heads": 2}, ["model.n_kv_heads"]),
    ({"attention": "gqa"}, ["model.attention", "mha"]),
    ({"moe_experts": 8, "moe_groups": 4}, ["model.moe_groups=4", "moe_router='sigmoid'"]),
    ({"moe_experts": 8, "moe_router": "sigmoid", "moe_groups": 4, "moe_topk_groups": 5}, ["moe_topk_groups=5"]),
])
def test_config_refusals_name_the_key(changes, words):
    base = {"vocab_size": 61, "n_layers": 1, "hidden_size": 32, "n_heads": 4, "seq_len": 8, **MLA, **changes}
    with pytest.raises(ConfigError) as err:
        ModelConfig(**base).validate()
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_bert_refuses_latent_attention_when_built():
    from meshlm.models.bert import BERT

    cfg = ModelConfig(vocab_size=61, n_layers=1, hidden_size=32, n_heads=4, seq_len=8, **{
        **MLA, "family": "bert", "activation": "gelu_exact", "norm": "layernorm"})
    cfg.validate()  # the config alone is fine (it may not compare family names): the model says no
    with pytest.raises(ConfigError, match="model.attention='mla' is a decoder's .*model.family='bert'"):
        BERT(cfg)


def test_mla_is_accepted_under_context_parallelism():
    """The ring runs MLA (unpadded widths, MLA's scale): tests/parallel/test_mla_parallel_exact.py checks cp2."""
    cfg = build({"model": {**MLA, "n_layers": 1, "hidden_size": 32, "n_heads": 4, "seq_len": 16},
                 "parallel": {"cp": 2}})
    assert cfg.parallel.cp == 2 and cfg.model.attention == "mla"


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": 0}, {"moe_experts": 4, "moe_shared_experts": 1,
                                                                "moe_router": "sigmoid", "moe_first_dense": 1}])
def test_parameter_count_and_flops_follow_the_model(changes):
    cfg = tiny(**changes)
    assert parameter_count(cfg) == GPT(cfg).num_params()
    # by hand: attention weights + dense MLP (3·h·f) per token and layer, 6 per weight, + the head; scores
    h, n, s = 32, 4, 24
    q = 32 * 12 + 12 * n * 12 if cfg.q_lora_rank else 32 * n * 12
    attention = q + 32 * (8 + 4) + 8 * n * (8 + 6) + n * 6 * 32
    dense = tiny(**{**changes, "moe_experts": 0, "moe_shared_experts": 0, "moe_router": "softmax",
                    "moe_first_dense": 0})
    per_token = 6 * (2 * (attention + 3 * h * dense.ffn_size) + h * 61)
    assert model_flops(dense, 3) == pytest.approx(3 * s * per_token + 6 * 3 * s * s * 2 * n * (12 + 6) / 2, rel=1e-12)


SHAPES = [  # (model changes, micro-batch, precision, recompute)
    ({}, 2, "fp32", "none"),
    ({}, 2, "bf16", "none"),
    ({"q_lora_rank": 0, "v_head_dim": 16}, 2, "fp32", "none"),  # values wider than q/k: q and k padded
    ({"dropout": 0.1}, 2, "fp32", "none"),  # math SDPA: s×s scores and masks
    ({"dropout": 0.1}, 1, "bf16", "selective"),
    ({"q_lora_rank": 0}, 3, "bf16", "selective"),
    ({}, 2, "bf16", "full"),
]


@pytest.mark.parametrize("changes,b,precision,recompute", SHAPES)
def test_measured_saved_bytes_equal_our_formula(changes, b, precision, recompute):
    model = {"vocab_size": 101, "n_layers": 2, "hidden_size": 64, "n_heads": 4, "seq_len": 24, **MLA, **changes}
    cfg = build({"model": model, "train": {"precision": precision, "recompute": recompute, "micro_batch_size": b,
                                           "global_batch_size": b}})
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    apply_recompute(gpt, cfg, spec=spec_of(gpt))
    ids = torch.randint(0, 101, (b, 24), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def run():
        with autocast:
            return gpt(ids).float().sum()

    report = measure_saved_activations(gpt, run)
    assert report.per_layer == layer_activation_bytes(cfg)


def test_paged_pool_bytes_per_token_equal_the_formula():
    """The serving engine's block pool holds MLA's latent and RoPE key per token and layer (kv_lora_rank +
    qk_rope_head_dim = 8 + 4, whatever the value width), not full per-head keys and values: its bytes equal
    `core.kv_cache`'s formula and the hand count 2 layers × 12 positions × 12 × 4 bytes."""
    from meshlm.core.kv_cache import cache_bytes_per_token
    from meshlm.models.paged import PagedKV

    for changes in ({}, {"v_head_dim": 16}):
        cfg = tiny(**changes)
        pool = PagedKV(GPT(cfg), num_blocks=3, block_size=4)
        assert pool.nbytes() == 12 * cache_bytes_per_token(cfg, 4) == 2 * 12 * (8 + 4) * 4
