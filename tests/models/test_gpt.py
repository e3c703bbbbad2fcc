"""The plain GPT model: shapes, initialisation, tying, parameter count, causality, variants, dropout."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.models.gpt import GPT
from meshlm.models.layers import apply_rope, rope_tables

GPT2_STYLE = ModelConfig(vocab_size=101, n_layers=2, hidden_size=32, n_heads=4, seq_len=16)
LLAMA_STYLE = ModelConfig(vocab_size=101, n_layers=2, hidden_size=32, n_heads=4, n_kv_heads=2, seq_len=16,
                          position="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False)
STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE}


def _model(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def _tokens(cfg: ModelConfig, batch: int = 2, length: int | None = None, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length or cfg.seq_len), generator=gen)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_forward_returns_logits_per_position(style):
    cfg = STYLES[style]
    logits = _model(cfg)(_tokens(cfg, batch=3, length=7))
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_init_scales_output_projections_by_depth():
    """N(0, 0.02) weights, N(0, 0.02/√(2L)) for `*.proj.weight`, zero biases, unit norm weights."""
    cfg = ModelConfig(vocab_size=512, n_layers=4, hidden_size=256, n_heads=4, seq_len=64)
    model = _model(cfg)
    by_kind: dict[str, list[torch.Tensor]] = {"proj": [], "other": []}
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "norm" in name:
            assert torch.all(p == 1), name
        else:
            by_kind["proj" if name.endswith("proj.weight") else "other"].append(p.detach().flatten())
    expected = {"proj": cfg.init_std / math.sqrt(2 * cfg.n_layers), "other": cfg.init_std}
    for kind, tensors in by_kind.items():
        values = torch.cat(tensors)  # ≥ 2.6M samples: the std estimate is good to well under 1%
        assert abs(values.mean().item()) < 0.01 * expected[kind], kind
        assert values.std().item() == pytest.approx(expected[kind], rel=0.02), kind
    assert len(by_kind["proj"]) == 2 * cfg.n_layers


def test_tied_embeddings_share_storage():
    tied, untied = _model(GPT2_STYLE), _model(replace(GPT2_STYLE, tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    with torch.no_grad():
        tied.tok_emb.weight[0, 0] = 123.0
    assert tied.lm_head.weight[0, 0] == 123.0
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert untied.num_params() - tied.num_params() == GPT2_STYLE.vocab_size * GPT2_STYLE.hidden_size


def test_gpt2_124m_parameter_count():
    cfg = ModelConfig(n_layers=12, hidden_size=768, n_heads=12, seq_len=1024, vocab_size=50257)
    with torch.device("meta"):  # shapes only, no 0.5 GB of weights
        model = GPT(cfg)
    assert model.num_params() == 124_439_808
    assert model.num_params(exclude_embeddings=True) == 124_439_808 - 1024 * 768


@pytest.mark.parametrize("style", sorted(STYLES))
def test_future_tokens_do_not_change_earlier_logits(style):
    cfg = STYLES[style]
    model, idx = _model(cfg), _tokens(cfg)
    changed = idx.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_gqa_rope_swiglu_layout_and_forward():
    cfg = replace(LLAMA_STYLE, ffn_hidden_size=48)
    model = _model(cfg)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert attn.qkv.weight.shape == ((cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert mlp.fc.weight.shape == (2 * 48, cfg.hidden_size) and attn.qkv.bias is None
    assert model.pos_emb is None and model.rope_cos.shape == (cfg.seq_len, cfg.head_dim)
    logits = model(_tokens(cfg))
    assert logits.shape == (2, cfg.seq_len, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("style", sorted(STYLES))
def test_kv_cache_decoding_matches_full_forward(style):
    cfg = STYLES[style]
    model, idx = _model(cfg), _tokens(cfg, length=12)
    with torch.no_grad():
        full = model(idx)
        caches = model.new_caches(batch=2, max_len=12)
        steps = [model(idx[:, :5], caches, start=0)]
        steps += [model(idx[:, i:i + 1], caches, start=i) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
    """⟨R_m q, R_n k⟩ = ⟨R_{m+s} q, R_{n+s} k⟩: the rotation encodes the distance m - n."""
    cos, sin = rope_tables(head_dim=16, max_len=64, theta=10000.0)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16, generator=gen)  # each (B, nh, T, hs)

    def score(m: int, n: int) -> float:
        rq = apply_rope(q, cos[m:m + 1], sin[m:m + 1])
        rk = apply_rope(k, cos[n:n + 1], sin[n:n + 1])
        return (rq * rk).sum().item()

    assert score(7, 3) == pytest.approx(score(47, 43), abs=1e-5)
    by_distance = [score(20, 20 - d) for d in range(8)]
    assert max(by_distance) - min(by_distance) > 1e-2


@pytest.mark.parametrize("style", sorted(STYLES))
def test_dropout_is_random_in_train_and_off_in_eval(style):
    cfg = replace(STYLES[style], dropout=0.3)
    model, idx = _model(cfg), _tokens(cfg)
    reference = GPT(replace(cfg, dropout=0.0))
    reference.load_state_dict(model.state_dict())
    model.train()
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx))
        model.eval()
        first = model(idx)
        assert torch.equal(first, model(idx))
        torch.testing.assert_close(first, reference.eval()(idx), rtol=0, atol=0)
