"""Local-window layers in the formulas (issue 46, item 6): a sliding-window layer's attention scores count the
query-key pairs its band holds, in the causal convention the FLOPs formula already uses (s²/2 for a global layer),
the planner prices and stores each kind of layer (local or global, MoE or dense) by its own terms, and
`meshlm bench memory` measures 1.000 of the formula for a windowed model and for latent attention."""

from __future__ import annotations

import pytest

from meshlm.core.config import load_config
from meshlm.core.flops import attention_score_flops, causal_pairs, model_flops, recompute_flops
from meshlm.core.memory import activation_dtypes, layer_activation_bytes
from meshlm.models.layers import visible_keys
from meshlm.plan.catalog import get_gpu
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.search import evaluate
from tests.conftest import run_cli

LLAMA = ["--model.n_layers=4", "--model.hidden_size=64", "--model.n_heads=4", "--model.seq_len=64"]


@pytest.mark.parametrize("s, window", [(64, 8), (64, 1), (64, 63), (64, 64), (64, 100), (7, 3), (64, 0)])
def test_causal_pairs_are_the_band_masks_pairs_in_the_causal_convention(s, window):
    """The model's own mask (`visible_keys`) holds Σ min(i + 1, W) pairs; the FLOPs count leaves out half the
    diagonal band's width, as its s²/2 does for a global layer (s(s + 1)/2 pairs)."""
    mask = visible_keys(s, s, True, None, window, "cpu")
    held = int(mask.sum())
    width = min(s, window) if window else s
    assert causal_pairs(s, window) == held - width / 2


def test_a_windowed_models_flops_drop_by_the_pairs_its_local_layers_skip():
    """Gemma-3-like: window 8 over 64 tokens on layers 0 and 2 (pattern 2); each local layer computes
    64·8 − 8²/2 = 480 pairs of the 64²/2 = 2048 a global layer does."""
    plain = load_config("llama-tiny", LLAMA).model
    local = load_config("llama-tiny", [*LLAMA, "--model.sliding_window=8", "--model.window_pattern=2"]).model
    every = load_config("llama-tiny", [*LLAMA, "--model.sliding_window=8"]).model
    k_a = 64  # head dim 16 × 4 heads
    B = 3
    skipped = 12 * B * k_a * (2048 - 480)
    assert model_flops(plain, B) - model_flops(local, B) == pytest.approx(2 * skipped, rel=1e-12)
    assert model_flops(plain, B) - model_flops(every, B) == pytest.approx(4 * skipped, rel=1e-12)
    assert attention_score_flops(plain, B) == pytest.approx(6 * B * 64 * 64 * 4 * k_a, rel=1e-12)  # 6·B·s²·L·k·a
    # selective recomputation replays the scores' forward: a third of them
    assert recompute_flops(local, B, "selective") == pytest.approx(attention_score_flops(local, B) / 3, rel=1e-12)
    # a window as long as the sequence is a global layer
    wide = load_config("llama-tiny", [*LLAMA, "--model.sliding_window=64"]).model
    assert model_flops(wide, B) == pytest.approx(model_flops(plain, B), rel=1e-12)


def _estimate(overrides: list[str], cand: Candidate | None = None):
    cfg = load_config("llama-tiny", [*overrides, "--train.global_batch_size=8"])
    return evaluate(cfg, cand or Candidate(1, 1, 8), Cluster(get_gpu("h100-80gb"), 8, 8), 8, Options()), cfg


BIG = ["--model.n_layers=8", "--model.hidden_size=1024", "--model.n_heads=8", "--model.seq_len=8192"]
WINDOWED = [*BIG, "--model.sliding_window=1024", "--model.window_pattern=4"]  # layers 3 and 7 global


def _estimate(config: str, overrides: list[str]):
    cfg = load_config(config, [*overrides, "--train.global_batch_size=8", "--train.micro_batch_size=1"])
    return evaluate(cfg, Candidate(1, 1, 8, zero=1), Cluster(get_gpu("h100-80gb"), 8, 8), 8, Options()), cfg


def test_the_planner_prices_local_layers_by_their_pairs():
    (plain, _), (local, _) = _estimate("llama-tiny", BIG), _estimate("llama-tiny", WINDOWED)
    ratio = (6 * (8192 * 1024 - 1024 ** 2 / 2) + 2 * 8192 ** 2 / 2) / (8 * 8192 ** 2 / 2)
    assert local.time["attention"] == pytest.approx(plain.time["attention"] * ratio, rel=1e-9)


@pytest.mark.parametrize("config, overrides", [("llama-tiny", WINDOWED),
                                               ("gpt-moe-tiny", [*BIG, "--model.moe_first_dense=2"])],
                         ids=["window", "moe-first-dense"])
def test_the_planner_stores_each_kind_of_layer_as_bench_memory_counts_it(config, overrides):
    """One micro-batch in flight (no pipeline): the layers' activations are `layer_activation_bytes`, which
    `meshlm bench memory` holds to the measured bytes layer by layer (a local layer keeps its band mask, an MoE
    layer its experts' rows, a dense one its MLP)."""
    est, cfg = _estimate(config, overrides)
    want = sum(layer_activation_bytes(cfg, dtypes=activation_dtypes("bf16", "cuda"), backend="flash"))
    assert est.memory["activations"] == pytest.approx(want, rel=1e-12)


WINDOW_MODEL = ["--config", "llama-tiny", "--model.n_layers=2", "--model.sliding_window=16", "--model.window_pattern=2"]
# latent attention with a dense first layer and an MoE layer behind DeepSeek-V3's router (sigmoid scores, the
# aux loss off, group-limited routing): the router's saved tensors included
MLA_MODEL = ["--config", "deepseek-v3", "--model.n_layers=2", "--model.hidden_size=32", "--model.n_heads=4",
             "--model.q_lora_rank=16", "--model.kv_lora_rank=8", "--model.qk_nope_head_dim=8",
             "--model.qk_rope_head_dim=4", "--model.v_head_dim=8", "--model.moe_experts=8", "--model.moe_groups=2",
             "--model.moe_topk_groups=1", "--model.moe_top_k=2", "--model.moe_first_dense=1",
             "--model.moe_expert_hidden=16", "--model.ffn_hidden_size=48", "--model.vocab_size=512",
             "--model.seq_len=64", "--model.mtp_depth=0"]


@pytest.mark.parametrize("model, precision", [(WINDOW_MODEL, "fp32"), (WINDOW_MODEL, "bf16"), (MLA_MODEL, "fp32")],
                         ids=["window-fp32", "window-bf16", "mla-moe-fp32"])
def test_bench_memory_measures_the_formula_for_windows_and_latent_attention(model, precision):
    proc = run_cli("bench", "memory", *model, "--train.micro_batch_size=2", "--train.global_batch_size=2",
                   f"--train.precision={precision}", "--train.device=cpu")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ")]
    ratios = [float(row[4]) for row in rows if row[1].strip() in ("0", "1", "all")]
    assert len(ratios) == 3 and all(r == 1.0 for r in ratios), proc.stdout  # layers 0, 1 and all
