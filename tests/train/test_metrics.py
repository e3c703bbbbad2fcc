import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.plan.flops import model_flops, recompute_flops
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
