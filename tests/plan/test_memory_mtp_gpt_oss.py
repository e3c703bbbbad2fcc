"""`meshlm bench memory` holds the bytes saved for backward to the formula, 1.000 (issue 46, item 6), for three
blocks the other tests leave out:

* DeepSeek-V3's multi-token prediction modules (`model.mtp_depth`, models/mtp.py): each module gets its own row
  ("mtp k"), its norms, merge and block beside `core.memory.mtp_activation_bytes`;
* gpt-oss's experts, with biases and the clamped SwiGLU (`model.moe_bias`, `model.moe_activation`);
* a mixture of experts in bf16, which measured 1.36× its formula before: the experts' weight casts were counted
  as activations, the router ran in bf16 (its docs said fp32), and the weighted expert outputs were kept alive by
  `index_add_` (which saves its source for its shape only).

The reports are made in this process (`plan.bench.bench_memory`, one process: no torchrun), a few tenths of a
second each."""

from __future__ import annotations

import pytest
import torch

from meshlm.core.config import load_config
from meshlm.core.flops import (
    attention_score_flops,
    causal_pairs,
    layer_flops_per_token,
    model_flops,
    mtp_flops_per_token,
    stage_costs,
)
from meshlm.core.memory import (
    activation_dtypes,
    layer_activation_bytes,
    mtp_activation_bytes,
    mtp_activation_terms,
    parameter_count,
)
from meshlm.core.mla import score_width
from meshlm.models.gpt import GPT
from meshlm.models.moe import MoE, moe_layers
from meshlm.plan.bench import bench_memory
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.search import evaluate

TINY = ["--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.seq_len=32", "--model.vocab_size=512", "--train.micro_batch_size=2", "--train.global_batch_size=2",
        "--train.device=cpu"]
MOE = [*TINY, "--model.moe_experts=4", "--model.moe_expert_hidden=24"]
# gpt-oss's shape as `interop/hf_gpt_oss.py` maps it: q/k/v/o biases, sinks, alternating windows, biased experts
# behind the softmax router renormalised over the top k, the clamped SwiGLU, no z-loss
GPT_OSS = [*MOE, "--model.moe_bias=true", "--model.moe_activation=swiglu_clamped", "--model.attention_sinks=true",
           "--model.bias=true", "--model.sliding_window=8", "--model.window_pattern=2", "--model.moe_z_loss=0"]
# DeepSeek-V3 in miniature: latent attention, a dense first layer, an MoE layer behind the group-limited sigmoid
# router with a shared expert, and its MTP modules
DEEPSEEK = ["--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4", "--model.q_lora_rank=16",
            "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8", "--model.qk_rope_head_dim=4",
            "--model.v_head_dim=8", "--model.moe_experts=8", "--model.moe_groups=2", "--model.moe_topk_groups=1",
            "--model.moe_top_k=2", "--model.moe_first_dense=1", "--model.moe_expert_hidden=16",
            "--model.ffn_hidden_size=48", "--model.vocab_size=512", "--model.seq_len=32",
            "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.device=cpu"]


def _ratios(config: str, overrides: list[str]) -> dict[str, float]:
    """{row label: measured / formula} of `meshlm bench memory`'s table (the layers, "mtp k", "all")."""
    torch.manual_seed(0)
    report = bench_memory(load_config(config, overrides))
    rows = [line.split("|") for line in report.splitlines() if line.startswith("| ") and "measured" not in line]
    return {row[1].strip(): float(row[4]) for row in rows}


def _assert_exact(ratios: dict[str, float], rows: int) -> None:
    assert len(ratios) == rows + 1 and all(r == 1.0 for r in ratios.values()), ratios


@pytest.mark.parametrize("overrides", [[*MOE, "--train.precision=bf16"],
                                       [*MOE, "--train.precision=bf16", "--model.moe_router=sigmoid",
                                        "--model.moe_shared_experts=1", "--model.moe_shared_gate=true"],
                                       [*MOE, "--train.precision=bf16", "--model.dropout=0.1"],
                                       [*MOE, "--train.precision=fp32", "--model.moe_capacity_factor=4.0"]],
                         ids=["bf16", "bf16-sigmoid-shared", "bf16-dropout", "fp32-capacity"])
def test_moe_in_bf16_measures_its_formula(overrides):
    _assert_exact(_ratios("gpt-moe-tiny", overrides), 2)


@pytest.mark.parametrize("precision, recompute", [("fp32", "none"), ("bf16", "none"), ("fp32", "selective"),
                                                  ("bf16", "full")])
def test_gpt_oss_experts_measure_their_formula(precision, recompute):
    """Layer 0 local, layer 1 global, both MoE with biased experts and the clamped SwiGLU."""
    _assert_exact(_ratios("gpt-moe-tiny", [*GPT_OSS, f"--train.precision={precision}",
                                           f"--train.recompute={recompute}"]), 2)


@pytest.mark.parametrize("config, overrides", [
    ("llama-tiny", [*TINY, "--model.mtp_depth=1", "--train.precision=fp32"]),
    ("llama-tiny", [*TINY, "--model.mtp_depth=2", "--train.precision=bf16"]),
    ("llama-tiny", [*TINY, "--model.mtp_depth=2", "--train.precision=fp32", "--train.fused_loss=false"]),
    ("gpt-tiny", [*TINY, "--model.mtp_depth=2", "--model.dropout=0.1", "--train.precision=fp32"]),
    ("llama-tiny", [*TINY, "--model.mtp_depth=2", "--train.precision=bf16", "--train.recompute=selective"]),
    ("llama-tiny", [*TINY, "--model.mtp_depth=2", "--train.precision=fp32", "--train.recompute=full"]),
    ("llama-tiny", [*TINY, "--model.mtp_depth=1", "--train.precision=fp32", "--train.recompute=full",
                    "--train.recompute_method=block", "--train.recompute_num_layers=1"]),
    ("deepseek-v3", [*DEEPSEEK, "--model.mtp_depth=1", "--train.precision=fp32"]),
    ("deepseek-v3", [*DEEPSEEK, "--model.mtp_depth=2", "--train.precision=bf16"]),
    ("gpt-moe-tiny", [*GPT_OSS, "--model.mtp_depth=1", "--train.precision=bf16"]),
], ids=["dense-fp32", "dense-bf16-depth2", "unfused-head", "gpt2-dropout", "selective", "full", "full-block",
        "deepseek-fp32", "deepseek-bf16-depth2", "gpt-oss-mtp-bf16"])
def test_mtp_modules_measure_their_formula(config, overrides):
    ratios = _ratios(config, overrides)
    depth = int(next(o for o in overrides if o.startswith("--model.mtp_depth=")).split("=")[1])
    assert [k for k in ratios if k.startswith("mtp")] == [f"mtp {k}" for k in range(1, depth + 1)]
    _assert_exact(ratios, 2 + depth)


def test_mtp_formula_by_hand():
    """One fp32 module after a Llama-style layer, fused head: the enorm's input (the embeddings), rsqrt and
    normalised x, the hnorm's (its input the main model's normed output, which the fused head does not keep),
    the merge's 2h-wide input, then exactly what a layer of the model saves; the second module's hnorm input is
    the first one's block output, kept by that module's own output norm (outside the rows)."""
    cfg = load_config("llama-tiny", [*TINY, "--model.mtp_depth=2"])
    n, h = 2 * 32, 32
    norm = n * h * 4 + n * 4 + n * h * 4  # input, rsqrt, normalised x
    layer = layer_activation_bytes(cfg)[-1]
    first, second = mtp_activation_bytes(cfg)
    assert first == 2 * norm + n * 2 * h * 4 + layer
    assert second == first - n * h * 4
    # a head that keeps h itself (the unfused one under tp > 1, in fp32): no module keeps it again
    assert sum(mtp_activation_terms(cfg.model, 2, 1, head_keeps_h=True).values()) == second
    dt = activation_dtypes("bf16", "cpu")
    assert mtp_activation_bytes(cfg, dtypes=dt)[0] == 2 * norm + n * 2 * h * 2 + layer_activation_bytes(cfg, dtypes=dt)[-1]


@pytest.mark.parametrize("pattern", [2, 0], ids=["last-global", "last-local"])
def test_mtp_flops_count_the_last_layers_window(pattern):
    """The module's block is of the last layer's kind: its scores count that layer's pairs (a local last layer's
    band, not the mean layer's), in the step's FLOPs and in the last pipeline stage's cost; its parameters are
    the model's count."""
    over = [*TINY, "--model.sliding_window=8", f"--model.window_pattern={pattern}"]
    m = load_config("llama-tiny", [*over, "--model.mtp_depth=2"]).model
    plain = load_config("llama-tiny", over).model
    assert parameter_count(m) == GPT(m).num_params()
    s, B, w = m.seq_len, 3, score_width(m)
    last = 12.0 * causal_pairs(s, m.layer_window(m.n_layers - 1)) * w  # one sequence's scores in the last layer
    assert model_flops(m, B) - model_flops(plain, B) == pytest.approx(B * s * mtp_flops_per_token(m) + 2 * B * last,
                                                                      rel=1e-12)
    layer = layer_flops_per_token(m) + attention_score_flops(m, 1) / (m.n_layers * s)
    want = (6.0 * m.hidden_size * m.vocab_size + mtp_flops_per_token(m) + 2 * last / s) / layer
    assert stage_costs(m)[1] == pytest.approx(want, rel=1e-12)


def test_the_moe_router_runs_in_fp32_under_autocast():
    cfg = load_config("gpt-moe-tiny", MOE).model
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.router.weight)
    x = torch.randn(5, cfg.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.router(x).dtype == torch.float32


@pytest.mark.parametrize("recompute, num_layers", [("none", 0), ("selective", 0), ("full", 0), ("full", 1)])
@pytest.mark.parametrize("config, overrides", [("llama-tiny", [*TINY, "--model.mtp_depth=2"]),
                                               ("deepseek-v3", [*DEEPSEEK, "--model.mtp_depth=1"])],
                         ids=["dense-depth2", "deepseek"])
def test_the_planner_stores_the_mtp_modules_as_bench_memory_counts_them(config, overrides, recompute, num_layers):
    """One stage, one micro-batch in flight: the modules add their own bytes (`mtp_activation_bytes`, which bench
    memory holds to the measured bytes), not one mean layer each; recomputed whole when every layer is."""
    def estimate(*more):
        cfg = load_config(config, [*overrides, *more, "--train.global_batch_size=8", "--train.micro_batch_size=1",
                                   f"--train.recompute={recompute}", f"--train.recompute_num_layers={num_layers}",
                                   *(["--train.recompute_method=block"] if num_layers else [])])  # the planner's N
        cand = Candidate(1, 1, 8, zero=1, recompute=recompute, recompute_num_layers=num_layers)
        return evaluate(cfg, cand, Cluster(get_gpu("h100-80gb"), 8, 8), 8, Options()).memory, cfg

    (memory, cfg), (plain, _) = estimate(), estimate("--model.mtp_depth=0")
    got, without = memory["activations"], plain["activations"]
    modules = mtp_activation_bytes(cfg, dtypes=activation_dtypes("bf16", "cuda"), backend="flash")
    assert got - without == pytest.approx(sum(modules), rel=1e-12)
    # the fused head + loss keeps its finished gradients: the weight's once (one call for every depth, models/gpt.py),
    # the stream's for each depth
    m = cfg.model
    head = 4.0 * m.hidden_size * m.vocab_size
    stream = 4.0 * m.hidden_size * m.seq_len
    assert (plain["logits (last stage)"], memory["logits (last stage)"]) == (head + stream,
                                                                              head + (1 + m.mtp_depth) * stream)
    if config == "llama-tiny":  # every layer alike: the planner's mean layer is each layer
        layers = layer_activation_bytes(cfg, dtypes=activation_dtypes("bf16", "cuda"), backend="flash")
        assert got == pytest.approx(sum(layers) + sum(modules), rel=1e-12)


def test_the_fit_check_counts_the_mtp_modules():
    from meshlm.train.fit import training_bytes

    cfg = load_config("llama-tiny", [*TINY, "--model.mtp_depth=2"])
    want = sum(layer_activation_bytes(cfg)) + sum(mtp_activation_bytes(cfg))
    assert training_bytes(cfg, world_size=1)["activations"] == pytest.approx(want, rel=1e-12)


def test_the_training_log_measures_the_mtp_modules_and_leaves_no_statistics(tmp_path, capsys):
    """The line the trainer logs at the start counts the modules as rows beside their formula, and the measurement's
    forward leaves no routing statistics (metrics, the sigmoid router's bias update) and no MTP losses behind."""
    from meshlm.train.trainer import Trainer
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, model={"mtp_depth": 2, "moe_experts": 4, "moe_expert_hidden": 16,
                                       "moe_router": "sigmoid", "moe_aux_loss": 0.0}, train={"precision": "bf16"})
    trainer = Trainer(cfg)
    trainer._log_activations()
    line = [x for x in capsys.readouterr().out.splitlines() if "activations saved for backward" in x]
    assert len(line) == 1 and line[0].endswith("measured/formula 1.000"), line
    assert trainer.model.mtp.recorded == 0
    assert all(layer.stats is None and layer.step_counts is None for _, layer in moe_layers(trainer.model))


TP_CASES = {"gpt-oss-sp-mtp-bf16": ("gpt-moe-tiny", [*GPT_OSS, "--train.precision=bf16", "--parallel.sp=true",
                                                      "--model.mtp_depth=1"]),
            "dense-mtp-fp32": ("llama-tiny", [*TINY, "--train.precision=fp32", "--model.mtp_depth=2"])}


def _tp_world(rank: int, world: int, out_dir: str) -> dict[str, str]:
    return {name: bench_memory(load_config(config, [*overrides, "--parallel.tp=2"]))
            for name, (config, overrides) in TP_CASES.items()}


def test_tensor_and_sequence_parallel_ranks_measure_their_formula(tmp_path):
    """tp = 2: the MoE layer routes the rank's sequence shard under SP (its terms count the stream's tokens), and the
    unfused vocab-parallel head keeps the main output itself in fp32 (the first MTP module does not keep it again)."""
    from tests.parallel.parallel_world import run_world

    reports = run_world(_tp_world, 2, tmp_path)[0]
    for name, (_, overrides) in TP_CASES.items():
        rows = [line.split("|") for line in reports[name].splitlines() if line.startswith("| ") and "measured" not in line]
        ratios = {row[1].strip(): float(row[4]) for row in rows}
        depth = int(overrides[-1].split("=")[1])
        _assert_exact(ratios, 2 + depth)


@pytest.mark.parametrize("target_rows", [False, True])
def test_one_fused_head_call_for_every_depth_keeps_one_weight_gradient(target_rows):
    """`linear_cross_entropy_sum` (the MTP model's head, models/gpt.py) equals the weighted sum of separate fused calls,
    value and gradients, and keeps one (V, h) weight gradient for backward where the separate calls kept one each."""
    from meshlm.models.loss import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_sum

    gen = torch.Generator().manual_seed(0)
    V, H, scales = 40, 8, [1.0, 0.15, 0.15]
    hs = [torch.randn(2, 6, H, generator=gen, dtype=torch.float64, requires_grad=True) for _ in scales]
    w = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    ts = [torch.randint(0, V, (2, 6), generator=gen) for _ in scales]
    for k, t in enumerate(ts):
        t[:, 6 - k:] = IGNORE_INDEX  # depth k's tail has no target
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        total, values = linear_cross_entropy_sum(hs, w, ts, scales, target_rows=target_rows)
    assert saved.count((V, H)) == 1
    total.backward()
    got = [h.grad.clone() for h in hs] + [w.grad.clone()]
    for x in (*hs, w):
        x.grad = None
    separate = [linear_cross_entropy(h, w, t, target_rows=target_rows) for h, t in zip(hs, ts)]
    sum(s * x for s, x in zip(scales, separate)).backward()
    torch.testing.assert_close(values, torch.stack(separate).detach(), rtol=1e-12, atol=0)
    assert total.item() == pytest.approx(sum(s * x.item() for s, x in zip(scales, separate)), rel=1e-12)
    for a, b in zip(got, [h.grad for h in hs] + [w.grad]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("recompute, method, num_layers, recomputed", [
    ("selective", "uniform", 0, 2 + 2), ("full", "uniform", 0, 2 + 2), ("full", "uniform", 1, 2),
    ("full", "block", 1, 1), ("none", "uniform", 0, 0)])
def test_hardware_flops_count_the_recomputed_mtp_blocks(recompute, method, num_layers, recomputed):
    """`parallel.recompute` recomputes the modules' blocks when every layer is recomputed (selective, or full with
    recompute_num_layers 0): HFU counts them as layers."""
    from meshlm.core.layout import recomputed_layers

    cfg = load_config("llama-tiny", [*TINY, "--model.mtp_depth=2", f"--train.recompute={recompute}",
                                     f"--train.recompute_method={method}", f"--train.recompute_num_layers={num_layers}"])
    assert recomputed_layers(cfg) == recomputed
