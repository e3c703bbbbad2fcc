import math

import pytest
import torch

from meshlm.config import ModelConfig, OptimConfig
from meshlm.models.gpt import GPT
from meshlm.train.optim import adamw_kernel, build_optimizer, lr_at, param_groups


def test_warmup_is_linear_to_peak():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr_at(s, cfg, 100) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])


def test_cosine_decays_from_peak_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine")
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)  # halfway: (1 + cos(pi/2)) / 2
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)


def test_linear_constant_and_wsd():
    lin = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear")
    assert lr_at(50, lin, 100) == pytest.approx(0.5)
    const = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=5, decay="constant")
    assert lr_at(99, const, 100) == 1.0
    wsd = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="wsd", wsd_decay_fraction=0.2)
    assert lr_at(79, wsd, 100) == 1.0 and lr_at(90, wsd, 100) == pytest.approx(0.5)
    assert lr_at(100, wsd, 100) == pytest.approx(0.0)


def test_decay_steps_overrides_max_steps():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay="linear", decay_steps=10)
    assert lr_at(5, cfg, 1000) == pytest.approx(0.5) and lr_at(20, cfg, 1000) == 0.0


def test_no_weight_decay_on_norms_biases_embeddings():
    model = GPT(ModelConfig(n_layers=2, hidden_size=16, n_heads=2, seq_len=8, vocab_size=50))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert "tok_emb.weight" in not_decayed and "pos_emb.weight" in not_decayed
    assert all(n.endswith("weight") and "norm" not in n and "emb" not in n for n in decayed)
    assert "layers.0.attn.qkv.weight" in decayed and "layers.1.norm2.bias" in not_decayed
    total = sum(p.numel() for p in decay["params"] + no_decay["params"])
    assert total == model.num_params()  # tied lm_head counted once
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert isinstance(build_optimizer(model, OptimConfig()).param_groups[0]["lr"], float)


def test_cosine_midpoint_formula():
    cfg = OptimConfig(lr=2.0, min_lr=0.0, warmup_steps=0)
    assert lr_at(25, cfg, 100) == pytest.approx(1.0 + math.cos(math.pi / 4))


def test_cpu_keeps_foreach_adamw_and_fused_is_cuda_only():
    """On CPU the optimizer is the multi-tensor (foreach) AdamW, as before; fused only when every parameter
    is on CUDA (tests/cuda checks that side, and that both kernels give the same update); `fused` forces one."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, hidden_size=16, n_heads=2, seq_len=8, vocab_size=50))
    opt = build_optimizer(model, OptimConfig())
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    assert adamw_kernel(param_groups(model, 0.1)) == {"foreach": True}
    assert adamw_kernel([{"params": [torch.zeros(2, device="meta")]}]) == {"foreach": True}
    assert adamw_kernel([{"params": []}]) == {"foreach": True}
    assert build_optimizer(model, OptimConfig(), fused=True).defaults["fused"] is True
    assert build_optimizer(model, OptimConfig(), fused=False).defaults["foreach"] is True
