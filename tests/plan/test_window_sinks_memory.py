"""The planner's formulas for sliding-window and sink attention (issue 46): parameters (one sink logit per head
per layer) equal the model's count, and the bytes each layer saves for backward, measured by the pack hook, equal
`layer_activation_bytes` term for term (local and global layers apart; the sink path's explicit softmax)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshlm.core.config import build, load_config
from meshlm.core.memory import layer_activation_bytes, parameter_count
from meshlm.families.registry import spec_of
from meshlm.models.activations import measure_saved_activations
from meshlm.models.gpt import GPT
from meshlm.parallel.recompute import apply_recompute

LLAMA = {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False}
WINDOW = {**LLAMA, "sliding_window": 5, "window_pattern": 2}  # layer 0 local, layer 1 global
SINKS = {**LLAMA, "attention_sinks": True}


@pytest.mark.parametrize("changes", [["--model.attention_sinks=true"],
                                     ["--model.attention_sinks=true", "--model.sliding_window=8",
                                      "--model.window_pattern=2", "--model.n_kv_heads=1"]])
def test_parameter_count_counts_the_sinks(changes):
    m = load_config("llama-tiny", changes).model
    assert parameter_count(m) == GPT(m).num_params()
    plain = load_config("llama-tiny", [c for c in changes if "sinks" not in c]).model
    assert parameter_count(m) - parameter_count(plain) == m.n_layers * m.n_heads


SHAPES = [  # (model changes, micro-batch, precision, recompute)
    (WINDOW, 2, "fp32", "none"),
    (WINDOW, 2, "bf16", "none"),
    (WINDOW, 2, "fp32", "selective"),
    ({**WINDOW, "dropout": 0.1}, 2, "fp32", "none"),  # math SDPA: the band adds nothing saved
    (SINKS, 2, "fp32", "none"),
    (SINKS, 2, "bf16", "none"),
    ({**SINKS, "n_kv_heads": 4}, 1, "fp32", "none"),
    ({**SINKS, "dropout": 0.1}, 2, "fp32", "none"),
    ({**SINKS, **WINDOW, "dropout": 0.1}, 2, "fp32", "selective"),
]


@pytest.mark.parametrize("changes,b,precision,recompute", SHAPES)
def test_measured_saved_bytes_equal_our_formula(changes, b, precision, recompute):
    model = {"vocab_size": 101, "n_layers": 2, "hidden_size": 64, "n_heads": 4, "seq_len": 24, **changes}
    cfg = build({"model": model, "train": {"precision": precision, "recompute": recompute, "micro_batch_size": b,
                                           "global_batch_size": b}})
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    apply_recompute(gpt, cfg, spec=spec_of(gpt))
    ids = torch.randint(0, 101, (b, 24), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    def run():
        with autocast:
            return gpt(ids).float().sum()

    report = measure_saved_activations(gpt, run)
    assert report.per_layer == layer_activation_bytes(cfg)
