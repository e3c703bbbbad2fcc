"""Gemma 3's layer parts in the formulas (issue 46): the parameter count holds the sandwich norms, the FLOPs count
GeGLU's [gate; up] as SwiGLU's, and the bytes each layer saves for backward, measured by the pack hook, equal
`layer_activation_bytes` term for term: the (1 + w) norms keep their fp32 normalised input and the new (1 + w), the
sandwich norms the fp32 copy of the attention's and the MLP's outputs, GeGLU what SwiGLU keeps; `meshlm bench
memory` measures 1.000 of the formula."""

from __future__ import annotations

import dataclasses

import pytest

from meshlm.core.config import build
from meshlm.core.flops import model_flops
from meshlm.core.memory import parameter_count
from meshlm.models.gpt import GPT
from tests.interop.interop_helpers import run_main
from tests.plan.test_memory import assert_saved_bytes_equal_formula

GEMMA = {"n_kv_heads": 2, "head_size": 8, "position": "rope", "norm": "rmsnorm", "activation": "geglu", "bias": False,
         "qk_norm": True, "sliding_window": 5, "window_pattern": 2, "norm_unit_offset": True, "sandwich_norm": True,
         "embed_scale": True, "attn_scale_dim": 12.0, "rope_local_theta": 100.0}
SANDWICH_RMS = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "sandwich_norm": True}
SANDWICH_LN = {"sandwich_norm": True, "activation": "geglu"}  # GPT-2's LayerNorms with biases, sandwiched


@pytest.mark.parametrize("changes", [GEMMA, {**GEMMA, "tie_embeddings": False}, SANDWICH_RMS, SANDWICH_LN])
def test_parameter_count_counts_the_sandwich_norms(changes):
    m = build({"model": {"vocab_size": 101, "n_layers": 3, "hidden_size": 32, "n_heads": 4, **changes}}).model
    assert parameter_count(m) == GPT(m).num_params()
    plain = dataclasses.replace(m, sandwich_norm=False)
    norm = 2 * 32 if m.norm == "layernorm" else 32
    assert parameter_count(m) - parameter_count(plain) == 3 * 2 * norm


def test_geglu_flops_are_swiglus():
    m = build({"model": {"vocab_size": 101, "n_layers": 3, "hidden_size": 32, "n_heads": 4, **GEMMA}}).model
    swiglu, gelu = dataclasses.replace(m, activation="swiglu"), dataclasses.replace(m, activation="gelu")
    assert model_flops(m, 4) == model_flops(swiglu, 4)
    assert model_flops(m, 4) - model_flops(gelu, 4) == pytest.approx(6 * 4 * m.seq_len * 3 * 32 * m.ffn_size)


SHAPES = [  # (model changes, micro-batch, precision, recompute)
    (GEMMA, 2, "fp32", "none"),
    (GEMMA, 2, "bf16", "none"),
    (GEMMA, 2, "fp32", "selective"),
    (GEMMA, 1, "bf16", "full"),
    ({**GEMMA, "dropout": 0.1}, 2, "fp32", "none"),  # math SDPA: the q/k norms keep the fp32 qkv output
    ({**GEMMA, "dropout": 0.1}, 2, "bf16", "selective"),
    (SANDWICH_RMS, 2, "bf16", "none"),  # plain RMSNorm on a 16-bit input: its normalised x in 16 bits
    (SANDWICH_RMS, 2, "fp32", "none"),
    (SANDWICH_LN, 2, "bf16", "none"),
    ({**SANDWICH_LN, "dropout": 0.1}, 2, "fp32", "none"),
]


@pytest.mark.parametrize("changes,b,precision,recompute", SHAPES)
def test_measured_saved_bytes_equal_our_formula(changes, b, precision, recompute):
    assert_saved_bytes_equal_formula(changes, b, precision, recompute)


def test_bench_memory_measures_the_formula_for_gemma3():
    """`meshlm bench memory` (in this process: a subprocess would spend most of the test importing torch)."""
    keys = [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in GEMMA.items()]
    code, out, err = run_main(["bench", "memory", "--config", "llama-tiny", *keys, "--model.n_layers=2",
                               "--model.seq_len=32", "--train.micro_batch_size=2", "--train.global_batch_size=2",
                               "--train.precision=bf16", "--train.device=cpu"])
    assert code == 0, err
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ")]
    ratios = [float(row[4]) for row in rows if row[1].strip() in ("0", "1", "all")]
    assert len(ratios) == 3 and all(r == 1.0 for r in ratios), out  # layers 0 (local), 1 (global) and all
