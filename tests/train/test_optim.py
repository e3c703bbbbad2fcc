import math

import pytest
import torch

from meshlm.core.config import ModelConfig, OptimConfig
from meshlm.models.gpt import GPT
from meshlm.models.params import param_groups
from meshlm.train.optim import adamw_kernel, build_optimizer, lr_at


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


def test_adamw_is_fused_on_one_cpu_or_cuda_device_and_foreach_elsewhere():
    """The fused AdamW wherever torch has it for every parameter (all on the CPU, or all on CUDA: tests/cuda
    checks that side); the multi-tensor (foreach) one for meta or mixed devices; `fused` forces one."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, hidden_size=16, n_heads=2, seq_len=8, vocab_size=50))
    opt = build_optimizer(model, OptimConfig())
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    assert adamw_kernel(param_groups(model, 0.1)) == {"fused": True}
    assert adamw_kernel([{"params": [torch.zeros(2, device="meta")]}]) == {"foreach": True}
    assert adamw_kernel([{"params": [torch.zeros(2), torch.zeros(2, device="meta")]}]) == {"foreach": True}
    assert adamw_kernel([{"params": [torch.zeros(2, dtype=torch.long)]}]) == {"foreach": True}
    assert adamw_kernel([{"params": []}]) == {"foreach": True}
    assert build_optimizer(model, OptimConfig(), fused=True).defaults["fused"] is True
    assert build_optimizer(model, OptimConfig(), fused=False).defaults["foreach"] is True


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_fused_adamw_on_cpu_gives_the_foreach_update(dtype, tol):
    """Switching the CPU's kernel changes no numbers beyond rounding: five steps with weight decay groups."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, hidden_size=16, n_heads=2, seq_len=8, vocab_size=50)).to(dtype)
    other = GPT(ModelConfig(n_layers=1, hidden_size=16, n_heads=2, seq_len=8, vocab_size=50)).to(dtype)
    other.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    fused, foreach = build_optimizer(model, OptimConfig()), build_optimizer(other, OptimConfig(), fused=False)
    assert fused.defaults["fused"] is True and foreach.defaults["foreach"] is True
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, q in zip(model.parameters(), other.parameters()):
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
            q.grad = p.grad.clone()
        fused.step()
        foreach.step()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.allclose(p, q, rtol=tol, atol=tol), name
    assert all(not torch.equal(p, s) for p, s in zip(model.parameters(), start))  # the steps moved every weight
