"""The adapters' math on one process: LoRA's hooked update equals the unfused W + (α/r)·B·A written out
(outputs and the gradients of every A and B), and finite differences in float64; merged equals unmerged;
the virtual tokens equal embeddings replaced by hand (and their gradients, and finite differences for the
table and both p-tuning encoders); the base gets no gradient."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.func import functional_call

from meshlm.core.config import TuneConfig
from meshlm.families.gpt import GPT_SPEC
from meshlm.models.gpt import GPT
from meshlm.tune.adapters import apply_lora, apply_prompt
from meshlm.tune.lora import merge_lora
from tests.tune.tune_helpers import GPT2, LLAMA, base_config

ONE = SimpleNamespace(pp_rank=0, tp_rank=0, tp=1)
TARGETS = {"gpt2": (GPT2, ["q", "v", "o", "up", "down"]), "llama": (LLAMA, ["q", "k", "v", "o", "gate", "up", "down"]),
           "gpt2_fused": (GPT2, ["qkv", "fc"])}


def lora_model(model_cfg: dict, targets: list[str], dtype=torch.float32, seed: int = 0, b_std: float = 0.5):
    cfg = base_config("unused", model_cfg)
    cfg = replace(cfg, tune=TuneConfig(method="lora", base="x", lora_rank=4, lora_alpha=8.0, lora_targets=targets))
    torch.manual_seed(seed)
    model = GPT(cfg.model).to(dtype)
    apply_lora(model, GPT_SPEC, cfg, ONE, None)
    with torch.no_grad():  # B starts at zero (the update is zero): make it non-zero to test anything
        for name, p in model.named_parameters():
            if ".lora.B_" in name:
                p.normal_(0.0, b_std)
    return cfg, model


def unfused(model: GPT, scaling: float) -> dict[str, torch.Tensor]:
    """The plain model's parameters with every LoRA folded in by the written-out formula, as a function of
    the LoRA tensors (autograd flows to them)."""
    params = dict(model.named_parameters())
    out = {n: p for n, p in params.items() if ".lora." not in n}
    for name, module in model.named_modules():
        lora = getattr(module, "lora", None)
        if lora is None or not hasattr(module, "_lora_hook"):
            continue
        w = params[f"{name}.weight"]
        pieces, at = [], 0
        for b in sorted(lora.blocks, key=lambda b: b.lo):
            pieces.append(w[at:b.lo])
            pieces.append(w[b.lo:b.hi] + scaling * params[f"{name}.lora.B_{b.name}"] @ params[f"{name}.lora.A_{b.name}"])
            at = b.hi
        pieces.append(w[at:])
        out[f"{name}.weight"] = torch.cat(pieces)
    return out


def plain_forward(model: GPT, params: dict, ids: torch.Tensor) -> torch.Tensor:
    hooks = [m._lora_hook for m in model.modules() if hasattr(m, "_lora_hook")]
    for h in hooks:
        h.remove()
    try:
        return functional_call(model, params, (ids,), strict=False)
    finally:
        from meshlm.tune.lora import _hook

        for m in model.modules():
            if hasattr(m, "_lora_hook"):
                m._lora_hook = m.register_forward_hook(_hook)


def check_finite_differences(loss_fn, params: dict, seed: int, per_tensor: int) -> None:
    """Each tensor's gradient at `per_tensor` random elements equals central differences in float64
    (rounding ~1e-16·loss/eps, truncation ~eps²)."""
    grads = torch.autograd.grad(loss_fn(), list(params.values()))
    gen = torch.Generator().manual_seed(seed)
    eps = 1e-5
    with torch.no_grad():
        for (name, p), g in zip(params.items(), grads):
            for _ in range(per_tensor):
                i = int(torch.randint(0, p.numel(), (1,), generator=gen))
                old = p.view(-1)[i].item()
                p.view(-1)[i] = old + eps
                up = loss_fn().item()
                p.view(-1)[i] = old - eps
                down = loss_fn().item()
                p.view(-1)[i] = old
                assert (up - down) / (2 * eps) == pytest.approx(g.reshape(-1)[i].item(), rel=1e-5, abs=1e-8), name


@pytest.mark.parametrize("name", list(TARGETS))
def test_lora_equals_unfused_reference(name):
    model_cfg, targets = TARGETS[name]
    cfg, model = lora_model(model_cfg, targets)
    ids = torch.randint(0, 1000, (2, 12))
    y = torch.randint(0, 1000, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), y.flatten())
    lora = {n: p for n, p in model.named_parameters() if ".lora." in n}
    got = torch.autograd.grad(loss, list(lora.values()))
    ref_logits = plain_forward(model, unfused(model, cfg.tune.lora_alpha / cfg.tune.lora_rank), ids)
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), y.flatten())
    want = torch.autograd.grad(ref_loss, list(lora.values()))
    assert len(lora) == 2 * len(targets) * model_cfg["n_layers"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (n, _), g, w in zip(lora.items(), got, want):
        assert w.abs().max() > 0, n  # every A and B gets a gradient (B non-zero, so A's is too)
        # float32: the two orders of summation differ by rounding, relative to the gradient's scale
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()), msg=lambda m, n=n: f"{n}: {m}")


def test_lora_gradient_matches_finite_differences():
    _, model = lora_model(LLAMA, ["q", "v", "gate", "down"], dtype=torch.float64)
    ids = torch.randint(0, 1000, (1, 6))
    y = torch.randint(0, 1000, (1, 6))

    def loss_fn():
        return torch.nn.functional.cross_entropy(model(ids)[0], y[0])

    check_finite_differences(loss_fn, {n: p for n, p in model.named_parameters() if ".lora." in n}, 0, 2)


@pytest.mark.parametrize("name", list(TARGETS))
def test_merged_equals_unmerged(name):
    model_cfg, targets = TARGETS[name]
    _, model = lora_model(model_cfg, targets, b_std=0.05)  # an update of a trained adapter's size
    ids = torch.randint(0, 1000, (2, 10))
    with torch.no_grad():
        before = model(ids)
        assert (before - model.head(model.run_layers(model.embed(ids)))).abs().max() == 0
        for m in list(model.modules()):
            if hasattr(m, "_lora_hook"):
                merge_lora(m)
        after = model(ids)
    assert not any(".lora." in n for n, _ in model.named_parameters())
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def test_lora_base_gets_no_gradient_and_shapes():
    _, model = lora_model(GPT2, ["q", "v"])
    for n, p in model.named_parameters():
        p.requires_grad_(".lora." in n)
    model(torch.randint(0, 1000, (1, 5))).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora." not in n)
    qkv = model.layers[0].attn.qkv
    assert tuple(qkv.lora.A_q.shape) == (4, 32) and tuple(qkv.lora.B_q.shape) == (32, 4)


# ---- virtual tokens -------------------------------------------------------------------------------------------
def prompt_model(method: str, encoder: str = "mlp", tasks: int = 2, dtype=torch.float32):
    cfg = base_config("unused", GPT2)
    names = [f"t{i}" for i in range(tasks)]
    cfg = replace(cfg, tune=TuneConfig(method=method, base="x", virtual_tokens=3, tasks=names, encoder=encoder,
                                       encoder_hidden=16))
    torch.manual_seed(0)
    model = GPT(cfg.model).to(dtype)
    assert apply_prompt(model, GPT_SPEC, cfg, ONE)
    model.prompt.to(dtype)
    return model


def by_hand(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """The logits with the first positions' word embeddings replaced by hand by each row's task's prompt."""
    n = model.prompt.n
    words = torch.nn.functional.embedding(ids, model.tok_emb.weight)
    virtual = model.prompt.embeddings()[ids[:, 0]]
    x = torch.cat([virtual, words[:, n:]], dim=1) + model.pos_emb.weight[:ids.shape[1]]
    return model.head(model.run_layers(x))


@pytest.mark.parametrize("method,encoder", [("prompt", "mlp"), ("ptuning", "mlp"), ("ptuning", "lstm")])
def test_virtual_tokens_equal_replaced_embeddings(method, encoder):
    model = prompt_model(method, encoder)
    ids = torch.randint(0, 1000, (2, 9))
    ids[0, :3], ids[1, :3] = 0, 1  # the placeholders hold the task index
    trained = [p for p in model.prompt.parameters()]
    got = model(ids)
    want = by_hand(model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g1 = torch.autograd.grad(got.square().mean(), trained)
    g2 = torch.autograd.grad(by_hand(model, ids).square().mean(), trained)
    for a, b in zip(g1, g2):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b)
    # A decoding step past the virtual tokens is left alone; its first position is not a placeholder.
    caches = model.new_caches(2, 12)
    with torch.no_grad():
        model(ids, caches=caches, start=0)
        step = model(ids[:, -1:], caches=caches, start=9)
        whole = model(torch.cat([ids, ids[:, -1:]], 1))
    torch.testing.assert_close(step[:, -1], whole[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,encoder", [("prompt", "mlp"), ("ptuning", "mlp"), ("ptuning", "lstm")])
def test_virtual_token_gradient_matches_finite_differences(method, encoder):
    model = prompt_model(method, encoder, dtype=torch.float64)
    ids = torch.randint(0, 1000, (2, 7))
    ids[:, :3] = torch.tensor([[0], [1]])
    y = torch.randint(0, 1000, (2, 7))

    def loss_fn():
        return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), y.flatten())

    check_finite_differences(loss_fn, dict(model.prompt.named_parameters()), 1, 1)
