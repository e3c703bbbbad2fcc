"""plan.activations: what the saved-tensor counter counts, and `meshlm bench memory`."""

from __future__ import annotations

import torch
from torch import nn

from meshlm.core.config import build
from meshlm.models.activations import measure_model_activations, measure_saved_activations
from meshlm.models.gpt import GPT
from meshlm.models.loss import cross_entropy
from meshlm.parallel.rng import TPRNGTracker
from tests.conftest import run_cli


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        x = x * self.scale  # saves the buffer (not an activation), outside the layers
        for layer in self.layers:
            x = layer(x)  # the linear saves x (and its weight), tanh its output
        return x * x  # saves x twice: one storage, counted once


def test_counts_activations_once_per_storage_and_skips_parameters_and_buffers():
    model = TwoLayers()
    x = torch.randn(4, 8, requires_grad=True)
    report = measure_saved_activations(model, lambda: model(x).sum(), details=True)
    row = 4 * 8 * 4  # one (4, 8) fp32 tensor
    # layer 0: its input (x·scale) and tanh output; layer 1: tanh output (its input is layer 0's, counted there)
    assert report.per_layer == [2 * row, row]
    assert report.outside_bytes == 0  # x·x saves layer 1's tanh output again: not counted twice
    assert report.param_copy_bytes == 0
    assert all(nbytes == row for layer in report.details for _, _, nbytes in layer)


def test_a_view_counts_its_whole_storage_and_autocast_weight_copies_apart():
    lin = nn.Linear(16, 16)
    model = nn.Module()
    model.layers = nn.ModuleList([lin])
    x = torch.randn(4, 16, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x[:, :8].repeat(1, 2)).float().sum()

    report = measure_saved_activations(model, run)
    assert report.per_layer == [4 * 16 * 2]  # the bf16 cast of the input
    assert report.param_copy_bytes == 16 * 16 * 2  # the bf16 cast of the weight


def test_measuring_leaves_random_streams_and_training_unchanged():
    cfg = build({"model": {"vocab_size": 101, "n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16,
                           "dropout": 0.2}})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    tp_rng = TPRNGTracker(0, 0)
    before, tp_before = torch.get_rng_state(), tp_rng.get_state()["tp"]
    report = measure_model_activations(model, cross_entropy, 2, 16, 101, None, tp_rng)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(tp_rng.get_state()["tp"], tp_before)
    assert len(report.per_layer) == 2 and report.outside_bytes > 0
    assert not any(p.grad is not None for p in model.parameters())


def test_bench_memory_cli_prints_measured_beside_formula():
    proc = run_cli("bench", "memory", "--config", "llama-tiny", "--model.n_layers=2", "--model.dropout=0.1",
                   "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.recompute=selective")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "| all |" in out and "recompute selective" in out and "SDPA math backend" in out
    ratio = float(out.split("| all |")[1].split("|")[2])
    assert ratio == 1.0
    assert "Korthikanti et al. 2022 Table 2" in out and "model states on this rank" in out


def test_bench_memory_cli_reports_config_errors():
    proc = run_cli("bench", "memory", "--config", "gpt-tiny", "--train.recompute=everything")
    assert proc.returncode == 2 and "train.recompute='everything'" in proc.stderr
