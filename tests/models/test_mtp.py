"""Multi-token prediction (models/mtp.py, `model.mtp_depth`): the module losses and the training gradient against a
hand computation from the weights, the logged value, which tokens each depth sees, the block's kind, the config's
refusals.

The parallel layouts are in tests/parallel/test_mtp_parallel.py, the draft in tests/infer/test_mtp_draft.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ConfigError, ModelConfig, build
from meshlm.core.flops import attention_score_flops, model_flops
from meshlm.core.memory import parameter_count
from meshlm.models.gpt import GPT
from meshlm.models.loss import IGNORE_INDEX
from meshlm.models.mla import MultiHeadLatentAttention
from meshlm.models.moe import MoE
from meshlm.models.mtp import shifted


def tiny(**changes) -> ModelConfig:
    cfg = ModelConfig(**{"vocab_size": 53, "n_layers": 2, "hidden_size": 24, "n_heads": 4, "seq_len": 12,
                         "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
                         "tie_embeddings": False, "mtp_depth": 2, "mtp_loss_weight": 0.3, **changes})
    cfg.validate()
    return cfg


def _batch(rows: int, T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of a causal LM: y is x shifted by one (y_i = t_{i+1}), as the data pipeline makes them."""
    t = torch.randint(0, 53, (rows, T + 1))
    return t[:, :-1], t[:, 1:]


def _norm(x, norm, eps):
    """RMSNorm, or LayerNorm (GPT-2 style models), written out from the norm's weights."""
    if isinstance(norm, torch.nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
        return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) + norm.bias
    return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_losses(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Main CE and CE_k written out from the weights: the sequence t = x followed by y's last token; module k at
    position i (i + k + 1 ≤ T) merges RMSNorm(Emb(t_{i+k})) and RMSNorm(h^{k-1}_i) through W_k, runs its block
    on those positions only, and scores t_{i+k+1} with its norm and the shared head."""
    eps, W_out = model.cfg.norm_eps, model.lm_head.weight
    T = x.shape[1]
    t = torch.cat((x, y[:, -1:]), dim=1)  # (B, T + 1): t_0 … t_T
    h = _norm(model.run_layers(model.embed(x)), model.norm, eps)  # h^0: the normed main output
    main = F.cross_entropy((h @ W_out.T).flatten(0, 1), y.flatten())
    losses = []
    for k, module in enumerate(model.mtp, start=1):
        n = T - k  # positions with a target
        e = model.tok_emb.weight[t[:, k:k + n]]  # Emb(t_{i+k}), (B, n, h)
        merged = torch.cat((_norm(e, module.enorm, eps), _norm(h[:, :n], module.hnorm, eps)), -1)
        h = module.block(merged @ module.merge.weight.T, model.rope(T))  # (B, n, h)
        logits = _norm(h, module.norm, eps) @ W_out.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), t[:, k + 1:k + 1 + n].flatten()))
    return main, losses


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "mtp_depth": 1},
                                     {"position": "learned", "norm": "layernorm", "activation": "gelu",
                                      "bias": True, "mtp_depth": 3}])
def test_mtp_losses_and_gradients_match_hand_reference(changes):
    torch.manual_seed(0)
    model = GPT(tiny(**changes)).double().train()
    x, y = _batch(3)
    loss = model(x, targets=y)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    sums, calls = model.mtp.take_stats()
    model.zero_grad()
    main, losses = _reference_losses(model, x, y)
    D, lam = model.cfg.mtp_depth, model.cfg.mtp_loss_weight
    (main + lam / D * sum(losses)).backward()
    assert calls == 1 and len(losses) == D
    torch.testing.assert_close(sums, torch.stack(losses).detach().float(), rtol=1e-6, atol=1e-6)
    assert loss.item() == pytest.approx(main.item(), rel=1e-12)  # the value logged is the main loss
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)
        assert p.grad.abs().sum() > 0 or "bias" in n, n  # every MTP weight gets a gradient


def test_eval_mode_loss_skips_the_modules():
    torch.manual_seed(1)
    model = GPT(tiny()).double().eval()
    x, y = _batch(2)
    with torch.no_grad():
        loss = model(x, targets=y)
    assert model.mtp.take_stats() is None
    assert loss.item() == pytest.approx(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item(), rel=1e-12)


def test_shifted_tokens_and_targets_ignore_the_tail_and_ignored_inputs():
    y = torch.tensor([[10, 11, IGNORE_INDEX, 13, 14]])
    tokens, goal = shifted(y, 1)
    assert tokens.tolist() == [[10, 11, 0, 13, 14]] and goal.tolist() == [[11, -100, -100, 14, -100]]
    tokens, goal = shifted(y, 2)
    assert tokens.tolist() == [[11, 0, 13, 14, 0]] and goal.tolist() == [[-100, -100, 14, -100, -100]]


def test_block_is_of_the_last_layers_kind():
    moe = GPT(tiny(moe_experts=4, moe_top_k=2, moe_first_dense=1, mtp_depth=1))
    assert isinstance(moe.mtp[0].block.mlp, MoE)
    mla = GPT(tiny(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6))
    assert isinstance(mla.mtp[1].block.attn, MultiHeadLatentAttention)
    window = GPT(tiny(sliding_window=3, window_pattern=2))  # layer 1 (the last) is global under pattern 2
    assert window.mtp[0].block.attn.window == 0 and window.layers[0].attn.window == 3


def test_mla_moe_model_trains_through_the_modules():
    torch.manual_seed(2)
    cfg = tiny(attention="mla", kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
               moe_experts=4, moe_top_k=2, moe_router="sigmoid", moe_aux_loss=0.0, mtp_depth=1)
    model = GPT(cfg).double().train()
    x, y = _batch(2)
    model(x, targets=y).backward()
    _, losses = _reference_losses(model, x, y)
    torch.testing.assert_close(model.mtp.take_stats()[0], torch.stack(losses).detach().float())
    from meshlm.train.metrics import moe_metrics

    rec = moe_metrics(model)  # the module's MoE block is logged under its own name, not a layer's
    assert {"moe_load_0", "moe_load_1", "moe_load_mtp0"} <= set(rec)


@pytest.mark.parametrize("section,changes,match", [("parallel", {"cp": 2}, "parallel.cp=2"),
                                                   ("data", {"document_mask": True}, "data.document_mask")])
def test_layouts_the_modules_do_not_support_are_refused(section, changes, match):
    model = dataclasses.asdict(tiny(seq_len=16))
    with pytest.raises(ConfigError, match=match):
        build({"model": model, section: changes})
    build({"model": {**model, "mtp_depth": 0}, section: changes})  # without modules: accepted


def test_an_encoder_refuses_the_modules():
    from meshlm.models.bert import BERT

    cfg = ModelConfig(family="bert", n_layers=1, hidden_size=16, n_heads=2, seq_len=8, vocab_size=30, mtp_depth=1)
    cfg.validate()  # the config is the family's to judge (only families/ and their models know family names)
    with pytest.raises(ConfigError, match="model.mtp_depth=1 is for decoders"):
        BERT(cfg)


@pytest.mark.parametrize("key,value", [("mtp_depth", -1), ("mtp_loss_weight", -0.1)])
def test_config_refuses_bad_values_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"model.{key}"):
        tiny(**{key: value})


def _matmul_flops(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs PyTorch counts in a training step's forward and backward, attention cores left out."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_(self_shape, a_shape, b_shape, *args, **kwargs):  # the fused head's ∂W accumulation
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        model(x, targets=y).backward()
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))


@pytest.mark.parametrize("changes", [{}, {"position": "learned", "norm": "layernorm", "activation": "gelu",
                                          "bias": True, "tie_embeddings": True, "mtp_depth": 1},
                                     {"attention": "mla", "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                      "qk_rope_head_dim": 4, "v_head_dim": 6, "moe_experts": 4, "moe_top_k": 2,
                                      "moe_first_dense": 1}])
def test_parameter_count_and_flops_count_the_modules(changes):
    """The planner's formulas (core/memory.py, core/flops.py) against the model: its parameters, and the matmul
    FLOPs PyTorch counts in a step with the modules less those without them."""
    cfg = tiny(**changes)
    torch.manual_seed(3)
    model, plain = GPT(cfg).train(), GPT(tiny(**{**changes, "mtp_depth": 0})).train()
    assert parameter_count(cfg) == model.num_params() and parameter_count(plain.cfg) == plain.num_params()
    if cfg.moe_experts:
        return  # (the FLOPs of a MoE layer depend on the routing: the formula counts top_k experts a token)
    x, y = _batch(2)
    measured = _matmul_flops(model, x, y) - _matmul_flops(plain, x, y)
    scores = attention_score_flops(cfg, 2) * cfg.mtp_depth / cfg.n_layers
    assert measured == pytest.approx(model_flops(cfg, 2) - model_flops(plain.cfg, 2) - scores, rel=1e-12)


def _saved_bytes_in_modules(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes autograd saves for backward inside the MTP modules' losses (from a leaf h^0)."""
    h = model.norm(model.run_layers(model.embed(x))).detach().requires_grad_()
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = model.mtp.losses(h, y, model.tok_emb, model.normed_loss, model.rope(x.shape[1]))
    sum(losses).backward()
    return total[0]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_wraps_the_module_blocks_and_keeps_the_gradients(mode):
    """`train.recompute` (parallel/recompute.py) recomputes the MTP blocks as it does every layer (the planner
    counts them so): the same gradients, fewer bytes saved inside the modules."""
    from meshlm.core.config import build
    from meshlm.families.registry import get_spec
    from meshlm.parallel.recompute import apply_recompute

    models = []
    for recompute in ("none", mode):
        torch.manual_seed(5)
        model = GPT(tiny(dropout=0.0)).double().train()
        cfg = build({"model": dataclasses.asdict(model.cfg), "train": {"recompute": recompute}})
        apply_recompute(model, cfg, spec=get_spec("gpt"))
        models.append(model)
    x, y = _batch(2)
    for model in models:
        model(x, targets=y).backward()
    for (n, p), (_, q) in zip(*(m.named_parameters() for m in models)):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=n)
    plain, recomputed = (_saved_bytes_in_modules(m, x, y) for m in models)
    assert recomputed < plain
