import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.core.flops import model_flops, recompute_flops
from meshlm.train.metrics import measure_peak_tflops


def test_flops_match_megatron_closed_form_for_mha():
    """docs/formulas.md: for MHA with f = 4h, F = 72·B·s·L·h²·(1 + s/(12h) + V/(12·L·h))."""
    m = ModelConfig(n_layers=24, hidden_size=2048, n_heads=16, seq_len=2048, vocab_size=51200)
    B, s, L, h, V = 512, 2048, 24, 2048, 51200
    closed = 72 * B * s * L * h ** 2 * (1 + s / (12 * h) + V / (12 * L * h))
    assert model_flops(m, B) == pytest.approx(closed, rel=1e-12)


def test_flops_for_gqa_swiglu_term_by_term():
    m = ModelConfig(n_layers=2, hidden_size=64, n_heads=8, n_kv_heads=2, seq_len=16, vocab_size=100,
                    activation="swiglu", ffn_hidden_size=160)
    h, f, k, a, g, T = 64, 160, 8, 8, 2, 3 * 16
    expected = 6 * T * (2 * (3 * h * f + h * (k * a + 2 * k * g) + k * a * h) + h * 100) + 6 * 3 * 16 ** 2 * 2 * k * a
    assert model_flops(m, 3) == expected


def test_recompute_flops():
    m = ModelConfig(n_layers=2, hidden_size=64, n_heads=4, seq_len=16, vocab_size=100)
    assert recompute_flops(m, 2, "none") == 0
    sel = recompute_flops(m, 2, "selective")
    full = recompute_flops(m, 2, "full")
    assert sel == 2 * 2 * 2 * 16 ** 2 * 64  # L · 2·B·s²·h
    head = 6 * 2 * 16 * 64 * 100
    assert full == pytest.approx((model_flops(m, 2) - head) / 3)  # one more forward of every layer


def test_measured_peak_is_positive():
    assert measure_peak_tflops(torch.device("cpu"), torch.float32, seconds=0.05) > 0


def test_finetune_flops_term_by_term():
    from meshlm.core.flops import finetune_flops, layer_flops_per_token

    m = ModelConfig(vocab_size=1000, n_layers=3, hidden_size=64, n_heads=4, seq_len=32)
    assert finetune_flops(m, 5) == pytest.approx(model_flops(m, 5), rel=1e-12)  # pretraining: every target
    head = 6.0 * 5 * 32 * 64 * 1000
    assert model_flops(m, 5) - finetune_flops(m, 5, loss_fraction=0.25) == pytest.approx(0.75 * head, rel=1e-12)
    frozen = finetune_flops(m, 5, loss_fraction=0.25, frozen=True)
    attention = 6.0 * 5 * 32 * 32 * 3 * 16 * 4
    layers = 5 * 32 * 3 * layer_flops_per_token(m)
    assert frozen == pytest.approx(layers * 4 / 6 + 0.25 * head * 4 / 6 + attention, rel=1e-12)


def test_a_frozen_output_layer_on_a_few_targets_costs_what_finetune_flops_counts():
    """FLOPs counted by PyTorch in the fused head + loss, forward and backward: 4·h·V per kept row when the
    weight is frozen (logits and ∂h), 6·h·V when it trains."""
    from torch.utils.flop_counter import FlopCounterMode

    from meshlm.models.loss import IGNORE_INDEX, linear_cross_entropy

    h, V, N = 16, 50, 40
    targets = torch.randint(0, V, (N,))
    targets[:30] = IGNORE_INDEX
    for frozen, per_row, target_rows, rows in ((True, 4, True, 10), (False, 6, True, 10), (True, 4, False, N)):
        hidden = torch.randn(N, h, requires_grad=True)
        weight = torch.randn(V, h, requires_grad=not frozen)
        def addmm_(self_shape, a_shape, b_shape, *args, **kwargs):  # ∂W's in-place accumulation: not in
            return 2 * a_shape[0] * a_shape[1] * b_shape[1]  # PyTorch's table; an (m, k) @ (k, n) product

        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
            linear_cross_entropy(hidden, weight, targets, chunk=4, target_rows=target_rows).backward()
        assert counter.get_total_flops() == per_row * h * V * rows  # every row unless only targets' are asked
