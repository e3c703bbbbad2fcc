"""Mixture of experts (models/moe.py): routing against per-token references, the auxiliary losses' values and
gradients, capacity dropping, the sigmoid router's bias, balancing, FLOPs/parameters, config checks, and a
`meshlm train` run."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from meshlm.core.config import ConfigError, ModelConfig, build
from meshlm.core.flops import model_flops
from meshlm.core.memory import parameter_count
from meshlm.models.gpt import GPT
from meshlm.models.moe import MoE, capacity_mask, route, set_aux_grad_scale, update_router_bias
from tests.conftest import run_cli


def moe_cfg(**kw) -> ModelConfig:
    values = {"vocab_size": 64, "n_layers": 2, "hidden_size": 16, "n_heads": 2, "seq_len": 8, "position": "rope",
              "norm": "rmsnorm", "activation": "swiglu", "bias": False, "moe_experts": 4, "moe_top_k": 2,
              "moe_expert_hidden": 8}
    values.update(kw)
    cfg = ModelConfig(**values)
    cfg.validate()
    return cfg


def random_moe(cfg: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        if m.router.score_bias is not None:
            m.router.score_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return m


@torch.no_grad()
def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: Σ_k w_k · expert_k(x) (+ the shared expert), written out without the layer's code."""
    cfg, out = m.cfg, []
    for row in x:
        logits = [float(w @ row) for w in m.router.weight.detach()]
        if cfg.moe_router == "softmax":
            total = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / total for v in logits]
            select = scores
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
            select = [s + float(b) for s, b in zip(scores, m.router.score_bias)]
        chosen = sorted(range(len(select)), key=lambda e: -select[e])[:cfg.moe_top_k]
        weights = [scores[e] for e in chosen]
        if cfg.moe_norm_topk:
            weights = [w / sum(weights) for w in weights]
        y = torch.zeros_like(row)
        for e, w in zip(chosen, weights):
            gate_w, up_w = m.experts.fc[e].split(cfg.expert_size)
            y += w * (m.experts.proj[e] @ (F.silu(gate_w @ row) * (up_w @ row)))
        if m.shared is not None:
            gate_w, up_w = m.shared.fc.weight.chunk(2)
            s = m.shared.proj.weight @ (F.silu(gate_w @ row) * (up_w @ row))
            y += torch.sigmoid(m.shared_gate.weight[0] @ row) * s if m.shared_gate is not None else s
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("kw", [{}, {"moe_router": "sigmoid"}, {"moe_norm_topk": False, "moe_top_k": 3},
                                {"moe_shared_experts": 2, "moe_shared_gate": True, "moe_router": "sigmoid"},
                                {"moe_shared_experts": 1, "moe_top_k": 1}])
def test_dropless_output_equals_per_token_reference(kw):
    m = random_moe(moe_cfg(**kw))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = m(x)
    torch.testing.assert_close(y.reshape(-1, 16), reference(m, x.reshape(-1, 16)), rtol=1e-5, atol=1e-5)


def test_aux_and_z_loss_equal_their_formulas():
    cfg = moe_cfg(moe_experts=3, moe_top_k=1)
    # Uniform logits: P_i = 1/3, f sums to 1, so aux = 3 · Σ f_i / 3 = 1; z = (log 3)² exactly.
    r = route(torch.zeros(4, 3), cfg)
    assert r.aux.item() == pytest.approx(1.0)
    assert r.z.item() == pytest.approx(math.log(3) ** 2)
    # Two tokens, by hand: logits (ln 2, 0, 0) and (0, 0, ln 3): probabilities (1/2, 1/4, 1/4), (1/5, 1/5, 3/5);
    # top-1 picks experts 0 and 2, f = (1/2, 0, 1/2); P = (7/20, 9/40, 17/40);
    # aux = 3 · (1/2 · 7/20 + 1/2 · 17/40) = 93/80; z = ((ln 4)² + (ln 5)²) / 2.
    logits = torch.tensor([[math.log(2), 0.0, 0.0], [0.0, 0.0, math.log(3)]])
    r = route(logits, cfg)
    assert r.aux.item() == pytest.approx(93 / 80)
    assert r.z.item() == pytest.approx((math.log(4) ** 2 + math.log(5) ** 2) / 2)
    assert r.counts.tolist() == [1.0, 0.0, 1.0]
    assert r.experts.tolist() == [0, 2]


def test_capacity_drops_lowest_weights_deterministically():
    # Four tokens, top-1 over 2 experts, capacity ceil(1.0 · 4 · 1 / 2) = 2: expert 0 is everyone's choice with
    # weights 0.9, 0.6, 0.9, 0.9: it keeps the two highest, ties by token index: tokens 0 and 2.
    experts = torch.tensor([0, 0, 0, 0])
    weights = torch.tensor([0.9, 0.6, 0.9, 0.9])
    assert capacity_mask(experts, weights, 2, 2).tolist() == [True, False, True, False]
    # Mixed: expert 1 gets tokens 1 and 3 (capacity 1: the heavier, token 3; equal weights: token 1).
    assert capacity_mask(torch.tensor([0, 1, 0, 1]), torch.tensor([0.5, 0.7, 0.6, 0.8]), 2, 1).tolist() == \
        [False, False, True, True]
    assert capacity_mask(torch.tensor([0, 1, 0, 1]), torch.tensor([0.5, 0.7, 0.6, 0.7]), 2, 1).tolist() == \
        [False, True, True, False]
    # Through the layer: the dropped tokens get no routed output (no shared expert), the kept ones the reference.
    cfg = moe_cfg(moe_experts=2, moe_top_k=1, moe_capacity_factor=1.0, moe_norm_topk=False)
    m = random_moe(cfg)
    with torch.no_grad():
        m.router.weight.copy_(torch.tensor([[1.0] + [0.0] * 15, [0.0] * 16]))  # logit_0 = x[0], logit_1 = 0
        x = torch.zeros(1, 4, 16)
        x[0, :, 0] = torch.tensor([2.0, 1.0, 2.0, 2.0])  # all pick expert 0; weights 0.88, 0.73, 0.88, 0.88
        x[0, :, 1:] = torch.randn(4, 15, generator=torch.Generator().manual_seed(0))
        y = m(x)[0]
        again = m(x)[0]
    full = reference(m, x[0])
    torch.testing.assert_close(y[[0, 2]], full[[0, 2]], rtol=1e-5, atol=1e-5)
    assert y[[1, 3]].abs().max().item() == 0.0
    assert torch.equal(y, again)


def test_aux_losses_reach_gradients_and_leave_the_loss_unchanged():
    cfg = moe_cfg(moe_router="softmax", moe_aux_loss=0.0, moe_z_loss=0.0)
    with_aux = dataclasses.replace(cfg, moe_aux_loss=0.3, moe_z_loss=0.05)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    losses, grads, inputs = [], [], []
    for c in (cfg, with_aux):
        torch.manual_seed(0)
        model = GPT(c)
        set_aux_grad_scale(model, 0.5)  # as the trainer's loss scale / micro-batches
        model.layers[1].mlp.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach()))
        loss = model(ids, targets=ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.layers[1].mlp.router.weight.grad.clone())
    assert torch.equal(losses[0], losses[1])  # the returned LM loss is the same number
    # The extra router gradient is 0.5 · d(0.3·aux + 0.05·z)/dW_r of the formulas on that layer's input.
    torch.manual_seed(0)
    w = GPT(with_aux).layers[1].mlp.router.weight.detach().clone().requires_grad_(True)
    x = inputs[1].reshape(-1, 16)
    r = route(x @ w.t(), with_aux)
    (0.5 * (0.3 * r.aux + 0.05 * r.z)).backward()
    torch.testing.assert_close(grads[1] - grads[0], w.grad, rtol=1e-4, atol=1e-7)
    assert w.grad.abs().max().item() > 1e-4


def test_sigmoid_router_bias_follows_the_load():
    cfg = moe_cfg(moe_router="sigmoid", moe_bias_rate=0.01)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.train()
    model(torch.randint(0, 64, (2, 8)), targets=torch.randint(0, 64, (2, 8))).backward()
    counts = [layer.mlp.step_counts.clone() for layer in model.layers]
    update_router_bias(model)
    for layer, c in zip(model.layers, counts):
        expected = 0.01 * torch.sign(c.mean() - c)  # overloaded experts down, underloaded up
        assert torch.equal(layer.mlp.router.score_bias, expected)
        assert layer.mlp.step_counts is None
    assert "layers.0.mlp.router.score_bias" in model.state_dict()


def balancing_run(aux: float, steps: int = 40) -> torch.Tensor:
    """The share of routed assignments per expert after `steps` AdamW steps of one MoE layer (top-2 of 4) on a
    regression task, from a router skewed towards expert 0 (its row along the inputs' common offset, as hidden
    states have one)."""
    torch.manual_seed(0)
    m = MoE(moe_cfg(hidden_size=16, moe_aux_loss=aux, moe_expert_hidden=16))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    g = torch.Generator().manual_seed(1)
    offset = torch.randn(16, generator=g)
    x = torch.randn(1, 256, 16, generator=g) + 2 * offset
    y = torch.tanh(x @ (torch.randn(16, 16, generator=g) / 4))
    with torch.no_grad():
        m.router.weight[0] = 1.5 * offset / offset.norm()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        (m(x) - y).pow(2).mean().backward()
        opt.step()
    m.take_stats()
    m(x)
    counts = m.take_stats()["counts"]
    return counts / counts.sum()


def test_aux_loss_balances_and_without_it_the_router_collapses():
    E = 4
    balanced = balancing_run(aux=1.0)
    assert balanced.min().item() >= 0.5 / E and balanced.max().item() <= 1.5 / E, balanced
    collapsed = balancing_run(aux=0.0)
    assert collapsed.max().item() >= 0.45 and collapsed.min().item() <= 0.02, collapsed  # every token on expert 0


def test_flops_count_active_parameters_and_parameter_count_all():
    cfg = moe_cfg(n_layers=3, moe_every=2, moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_shared_gate=True)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert parameter_count(cfg) == GPT(cfg).num_params()
    dense = dataclasses.replace(cfg, moe_experts=0)
    h, F_ = 16, 8
    active = 8 * h + (2 + 1) * 3 * h * F_ + h  # router, top-2 experts, shared expert, its gate
    tokens = 4 * cfg.seq_len
    assert model_flops(cfg, 4) - model_flops(dense, 4) == pytest.approx(6 * tokens * (active - 3 * h * cfg.ffn_size))
    first_dense = moe_cfg(n_layers=3, moe_first_dense=1)
    assert [first_dense.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert parameter_count(first_dense) == GPT(first_dense).num_params()


@pytest.mark.parametrize("change, key", [({"moe_top_k": 5}, "model.moe_top_k"),
                                         ({"moe_experts": -1}, "model.moe_experts"),
                                         ({"moe_router": "relu"}, "model.moe_router"),
                                         ({"moe_every": 0}, "model.moe_every"),
                                         ({"moe_first_dense": 2}, "model.moe_experts"),
                                         ({"moe_shared_gate": True}, "model.moe_shared_gate"),
                                         ({"moe_capacity_factor": -1.0}, "model.moe_capacity_factor"),
                                         ({"moe_aux_loss": -0.1}, "model.moe_aux_loss")])
def test_bad_moe_keys_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        build({"model": {"n_layers": 2, "moe_experts": 4, **change}})
    assert "\n" not in str(err.value)


def test_bad_moe_key_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    r = run_cli("train", "--config", "configs/gpt-moe-tiny.toml", "--model.moe_top_k=9",
                f"--train.out_dir={tmp_path / 'run'}")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "model.moe_top_k=9" in r.stderr, r.stderr


def test_bert_refuses_moe():
    from meshlm.models.bert import BERT

    cfg = ModelConfig(family="bert", vocab_size=64, n_layers=1, hidden_size=16, n_heads=2, seq_len=8, moe_experts=4)
    with pytest.raises(ConfigError, match="model.moe_experts=4"):
        BERT(cfg)


def test_moe_gpt_trains_with_meshlm_train(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "--config", "configs/gpt-moe-tiny.toml", f"--train.out_dir={out}", "--model.n_layers=2",
                "--model.hidden_size=32", "--model.seq_len=32", "--model.moe_expert_hidden=32",
                "--model.moe_router=sigmoid", "--model.moe_shared_experts=1", "--model.moe_capacity_factor=1.25",
                "--train.max_steps=3", "--train.log_every=3", "--train.eval_every=0", "--train.sample_tokens=0",
                "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.progress=false",
                "--train.peak_tflops=1", "--train.precision=fp32", "--train.save_every=0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moe aux" in r.stdout
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert math.isfinite(rec["loss"])
    for i in range(2):
        assert len(rec[f"moe_load_{i}"]) == 8 and sum(rec[f"moe_load_{i}"]) == pytest.approx(1.0, abs=1e-4)
        assert 0.0 <= rec[f"moe_dropped_{i}"] < 1.0 and rec[f"moe_aux_{i}"] > 0 and rec[f"moe_z_{i}"] > 0
    assert rec["moe_max_load"] >= 1.0


@pytest.mark.parametrize("extra", [{}, {"moe_z_loss": 0.01},
                                   {"moe_router": "sigmoid", "moe_shared_experts": 1, "moe_shared_gate": True}])
def test_activation_formula_equals_measured_bytes(extra):
    from meshlm.core.memory import layer_activation_bytes
    from meshlm.models.activations import measure_model_activations

    model_keys = {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 32, "vocab_size": 128, "position": "rope",
                  "norm": "rmsnorm", "activation": "swiglu", "bias": False, "moe_experts": 8, "moe_top_k": 2,
                  "moe_expert_hidden": 48, "moe_every": 2, **extra}
    cfg = build({"model": model_keys, "train": {"micro_batch_size": 2, "precision": "fp32"}})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    measured = measure_model_activations(model, None, 2, 32, 128, fused_loss=True, layers=list(model.layers))
    assert measured.per_layer == [int(b) for b in layer_activation_bytes(cfg)]  # layer 1 is MoE, layer 0 dense


def _bias_and_metrics_over_dp(rank: int, world: int, out_dir: str):
    import torch.distributed as dist

    from meshlm.train.metrics import moe_metrics

    m = MoE(moe_cfg(moe_router="sigmoid", moe_bias_rate=0.01))
    m.router.reset_bias()
    counts = torch.tensor([[5.0, 1.0, 1.0, 1.0], [0.0, 1.0, 4.0, 3.0]][rank])  # each rank's step load differs
    m.step_counts = counts
    m.stats = {"counts": counts, "dropped": torch.tensor(0.0), "aux": torch.tensor(1.0), "z": torch.tensor(2.0),
               "tokens": torch.tensor(4.0)}
    m.update_bias([dist.group.WORLD])
    return m.router.score_bias.clone(), moe_metrics(m, [dist.group.WORLD])


def test_router_bias_and_metrics_use_the_global_load_over_dp(tmp_path):
    from tests.parallel.parallel_world import run_world

    results = run_world(_bias_and_metrics_over_dp, 2, tmp_path)
    # Summed load (5, 2, 5, 4), mean 4: the overloaded experts 0 and 2 go down, 1 up, 3 stays — on both ranks
    # (rank 0 alone, (5, 1, 1, 1), would raise experts 2 and 3).
    for bias, rec in results:
        assert torch.equal(bias, torch.tensor([-0.01, 0.01, -0.01, 0.0]))
        assert rec["moe_load_0"] == [0.3125, 0.125, 0.3125, 0.25]
        assert rec["moe_aux_0"] == pytest.approx(0.25) and rec["moe_max_load"] == pytest.approx(1.25)
