"""benchmarks/tp_comm.py counts what Megatron's theory predicts, with SP's backward re-gathers (tp=2, a small shape)."""

from __future__ import annotations

import argparse
import importlib

from tests.conftest import ROOT


def test_tp_comm_counts_match_megatron_theory(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # importable by name in the spawned workers too
    tp_comm = importlib.import_module("tp_comm")
    args = argparse.Namespace(batch=2, seq=8, hidden=16, heads=4, vocab=50)
    bsh, t = 2 * 8 * 16, 2
    rows = tp_comm.measure(t, args)
    for sp, per_layer, phases, _, _ in rows:
        # SP: 2 all-gathers forward (qkv, fc inputs), 2 reduce-scatters (proj outputs); backward swaps them and
        # re-gathers the shards qkv and fc kept for their weight gradients: 2 more all-gathers
        expected = {"all-gather": 6, "reduce-scatter": 4} if sp else {"all-reduce": 4}
        assert {k: n for k, (n, _, _) in per_layer.items() if n} == expected
        backward = {"all-gather": 4, "reduce-scatter": 2} if sp else {"all-reduce": 2}
        assert {k: n for k, (n, _, _) in phases["backward"].items() if n} == backward
        assert all(e == n * bsh for n, e, _ in per_layer.values())
        assert sum(s for _, _, s in per_layer.values()) == (10 if sp else 8) * (t - 1) / t * bsh * 4
