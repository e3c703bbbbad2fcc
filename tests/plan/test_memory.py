"""plan.memory: parameter counts, model-state bytes, Korthikanti's Table 2, and our activation formula
against the bytes the code saves (tp=1 here; tp=2 in tests/parallel/test_recompute_tp.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from meshlm.core.config import ModelConfig, build, load_config
from meshlm.core.memory import (
    KORTHIKANTI_DTYPES,
    activation_dtypes,
    activation_terms,
    korthikanti_bytes,
    layer_activation_bytes,
    model_state_bytes,
    model_state_bytes_per_param,
    narayanan_parameter_count,
    parameter_count,
    pipeline_activation_factor,
)
from meshlm.families.registry import spec_of
from meshlm.models.activations import measure_saved_activations
from meshlm.models.gpt import GPT
from meshlm.parallel.recompute import apply_recompute

MEGATRON_TABLE = [((2304, 24, 24), 1.7), ((3072, 32, 30), 3.6), ((4096, 32, 36), 7.5), ((6144, 48, 40), 18.4),
                  ((8192, 64, 48), 39.1), ((10240, 80, 60), 76.1), ((12288, 96, 80), 145.6),
                  ((16384, 128, 96), 310.1), ((20480, 128, 105), 529.6), ((25600, 160, 128), 1008.0)]


@pytest.mark.parametrize("shape,published", MEGATRON_TABLE, ids=[f"{p}B" for _, p in MEGATRON_TABLE])
def test_narayanan_formula_gives_megatrons_published_sizes(shape, published):
    h, a, L = shape
    exact = parameter_count(ModelConfig(n_layers=L, hidden_size=h, n_heads=a, seq_len=2048, vocab_size=51200))
    formula = narayanan_parameter_count(h, L, 51200, 2048)
    assert round(formula / 1e9, 1) == published
    assert exact == pytest.approx(formula + 2 * h, abs=1e-3 * h)  # the formula leaves out the final LayerNorm


@pytest.mark.parametrize("name,changes", [("gpt-tiny", []), ("llama-tiny", []), ("gpt2-124m", []),
                                           ("gpt-tiny", ["--model.bias=false", "--model.tie_embeddings=false"]),
                                           ("llama-tiny", ["--model.norm=layernorm", "--model.n_kv_heads=1"]),
                                           ("llama-tiny", ["--model.qk_norm=true", "--model.head_size=48"]),
                                           ("gpt-moe-tiny", ["--model.qk_norm=true"])])
def test_parameter_count_equals_the_model(name, changes):
    m = load_config(name, changes).model
    assert parameter_count(m) == GPT(m).num_params()


def test_model_state_bytes_per_parameter():
    assert sum(model_state_bytes_per_param("mixed").values()) == 18
    assert sum(model_state_bytes_per_param("fp32").values()) == 16
    for d in (2, 4, 8):
        assert sum(model_state_bytes_per_param("mixed", d, distributed_optimizer=True).values()) == 6 + 12 / d
        assert sum(model_state_bytes_per_param("fp32", d, distributed_optimizer=True).values()) == 8 + 8 / d
    assert model_state_bytes(1000, "mixed")["total"] == 18_000


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_our_terms_under_the_papers_assumptions_give_table_2(t, sp, recompute):
    """16-bit everywhere, 1-byte masks, statistics ignored, materialised scores (under SP the column-parallel
    linears keep the sequence shard, as the paper assumes): our term-by-term sum is the paper's closed form."""
    s, b, h, a = 2048, 4, 4096, 32
    m = ModelConfig(n_layers=1, hidden_size=h, n_heads=a, seq_len=s, dropout=0.1)
    ours = activation_terms(m, b, t, sp, recompute, KORTHIKANTI_DTYPES, "math")
    assert sum(ours.values()) == pytest.approx(korthikanti_bytes(s, b, h, a, t, sp, recompute), rel=1e-12)


def test_korthikanti_closed_forms():
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert korthikanti_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert korthikanti_bytes(s, b, h, a, 8, True, "selective") == sbh * 34 / 8
    assert korthikanti_bytes(s, b, h, a, 8, False, "selective") == sbh * (10 + 24 / 8)
    assert korthikanti_bytes(s, b, h, a, 8, False, "full") == 2 * sbh


def test_pipeline_factor():
    assert pipeline_activation_factor(4, 8) == 4 and pipeline_activation_factor(4, 2) == 2
    assert pipeline_activation_factor(4, 8, vpp=2) == pytest.approx(4 * (1 + 3 / 8))


LLAMA = {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False}
QWEN3 = {**LLAMA, "qk_norm": True, "head_size": 24}
SHAPES = [  # (model changes, micro-batch, precision, recompute)
    ({}, 2, "fp32", "none"),
    ({"dropout": 0.1}, 2, "fp32", "none"),  # math SDPA: s×s scores, float masks
    ({"dropout": 0.1}, 2, "fp32", "selective"),
    ({"dropout": 0.1}, 1, "fp32", "none"),  # b = 1: the math kernel's v is a view of qkv
    ({"dropout": 0.1, "n_heads": 2, "n_kv_heads": 1}, 3, "bf16", "none"),
    ({**LLAMA}, 2, "fp32", "none"),
    ({**LLAMA, "dropout": 0.1}, 2, "bf16", "selective"),
    ({**LLAMA, "ffn_hidden_size": 96}, 3, "bf16", "full"),
    ({**QWEN3}, 2, "fp32", "none"),  # Qwen3's q/k norms before RoPE, heads of 24 over a width of 64
    ({**QWEN3}, 2, "bf16", "none"),
    ({**QWEN3, "dropout": 0.1}, 2, "fp32", "selective"),
    ({**QWEN3, "dropout": 0.1}, 1, "bf16", "none"),
]


def assert_saved_bytes_equal_formula(changes: dict, b: int, precision: str, recompute: str):
    """A 2-layer model of `changes` (sequences of 24) under `precision` and `recompute`: the bytes each layer saves
    for backward, measured by the pack hook, equal `layer_activation_bytes`; returns the measurement."""
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
    return report


@pytest.mark.parametrize("changes,b,precision,recompute", SHAPES)
def test_measured_saved_bytes_equal_our_formula(changes, b, precision, recompute):
    report = assert_saved_bytes_equal_formula(changes, b, precision, recompute)
    assert (report.param_copy_bytes > 0) == (precision == "bf16")


def test_cpu_and_cuda_element_sizes():
    assert activation_dtypes("fp32", "cpu") == activation_dtypes("fp32", "cpu")
    bf16_cpu, bf16_cuda = activation_dtypes("bf16", "cpu"), activation_dtypes("bf16", "cuda")
    assert (bf16_cpu.residual, bf16_cpu.compute, bf16_cpu.math, bf16_cpu.bool_masks) == (4, 2, 4, False)
    assert (bf16_cuda.residual, bf16_cuda.compute, bf16_cuda.math, bf16_cuda.bool_masks) == (4, 2, 2, True)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                                       "bias": False, "tie_embeddings": False}], ids=["gpt2", "llama"])
def test_predicted_model_states_follow_optim_name_and_match_the_measured_bytes(optim, extra):
    """The planner's model states (`model_state_bytes_per_param` with the config, as `meshlm plan`, the
    fit check and `meshlm bench memory` take them) against the bytes allocated after a real optimizer step
    in one process, within the 3% of the dp tests (tests/parallel/test_data_parallel.py)."""
    from meshlm.families.registry import muon_share
    from meshlm.models.params import param_groups
    from meshlm.plan.bench import bench_memory
    from tests.train.test_muon import one_step_model_states

    cfg, sync, opt = one_step_model_states(optim, **extra)
    b = sync.state_bytes(opt)
    measured = (b["params"] + b["grads"] + b["optim"]) / b["n_params"]
    predicted = model_state_bytes_per_param("fp32", muon_share=muon_share(cfg))
    assert abs(sum(predicted.values()) - measured) <= 0.03 * measured, (predicted, measured)
    assert predicted["optimizer"] * b["n_params"] == pytest.approx(b["optim"], rel=0.03)
    groups = param_groups(sync.model, 0.0, muon=True)  # the optimizer's own grouping, on the trained model
    share = sum(p.numel() for p in groups[0]["params"]) / sum(p.numel() for g in groups for p in g["params"])
    assert muon_share(cfg) == (pytest.approx(share, rel=1e-12) if optim == "muon" else 0.0)
    if optim == "muon":
        assert sum(predicted.values()) < 14, "most of this model is hidden matrices: well below Adam's 16"
    # `meshlm bench memory` prints the same prediction for this config
    line = next(ln for ln in bench_memory(cfg).splitlines() if ln.startswith("model states on this rank"))
    assert f"× {sum(predicted.values()):.2f} B" in line and ("Muon" in line) == (optim == "muon"), line


@pytest.mark.parametrize("layers", [1, 3, 48])
def test_muon_fraction_of_deep_models_is_the_optimizers_grouping(layers):
    """`muon_share` extrapolates from one and two layers: exact at any depth (gpt2-1.3b's shape)."""
    from meshlm.families.registry import muon_share
    from meshlm.models.params import param_groups

    cfg = build({"model": {"n_layers": layers, "hidden_size": 256, "n_heads": 4, "seq_len": 64, "vocab_size": 1000},
                 "optim": {"name": "muon"}})
    with torch.device("meta"):
        groups = param_groups(GPT(cfg.model), 0.0, muon=True)
    sizes = [sum(p.numel() for p in g["params"]) for g in groups]
    assert muon_share(cfg) == pytest.approx(sizes[0] / sum(sizes), rel=1e-12)


def test_plan_and_fit_check_count_muons_one_buffer():
    """`meshlm plan`'s memory (plan.cost) and the start-of-training fit check (plan.fit): Muon's optimizer
    states are 4·(2 − share) B per parameter, Adam's 8."""
    from meshlm.families.registry import muon_share
    from meshlm.plan.catalog import get_gpu
    from meshlm.plan.cost import Candidate, Cluster, Options
    from meshlm.plan.search import evaluate
    from meshlm.train.fit import training_bytes

    def cfg(optim):
        return build({"model": {"n_layers": 24, "hidden_size": 2048, "n_heads": 16, "seq_len": 2048,
                                "vocab_size": 51200}, "optim": {"name": optim},
                      "train": {"precision": "bf16", "global_batch_size": 64}})

    adam, muon = cfg("adamw"), cfg("muon")
    share = muon_share(muon)
    assert 0.9 < share < 1.0  # the layers' matrices are most of a 1.3B model
    cluster = Cluster(get_gpu("a100-80gb"), 8, 8)
    est = {c.optim.name: evaluate(c, Candidate(1, 1, 8), cluster, 64, Options()) for c in (adam, muon)}
    assert est["muon"].memory["optimizer states"] == pytest.approx(
        est["adamw"].memory["optimizer states"] * (2 - share) / 2, rel=1e-12)
    assert est["muon"].memory["weights"] == est["adamw"].memory["weights"]
    fit = {c.optim.name: training_bytes(c, world_size=1) for c in (adam, muon)}
    assert fit["muon"]["optimizer"] == pytest.approx(fit["adamw"]["optimizer"] * (2 - share) / 2, rel=1e-12)
