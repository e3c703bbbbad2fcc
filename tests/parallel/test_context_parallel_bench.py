"""benchmarks/context_parallel.py's measurement at a tiny size (seq 256, cp 2): the activations a cp rank saves
against the formula at s/cp tokens, the bytes it sends around the ring against `ring_send_bytes` (exactly:
they are deterministic), and `meshlm bench memory` under cp (`plan.bench.bench_memory`, rank 0's report)."""

from __future__ import annotations

import importlib
import sys

import pytest
from parallel_world import run_world

from tests.conftest import ROOT

SEQ = 256


def _bench():
    return importlib.import_module("context_parallel")


def _cp_world(rank: int, world: int, out_dir: str) -> dict:
    from meshlm.plan.bench import bench_memory

    bench = _bench()
    row = bench.measure_rank(bench.bench_config(SEQ, world))
    return {"row": row, "report": bench_memory(bench.bench_config(SEQ, world))}


def test_cp_bench_measures_per_rank_activations_and_exact_ring_traffic(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmark and its `world` module, by name
    monkeypatch.delitem(sys.modules, "context_parallel", raising=False)
    bench = _bench()
    one = bench.measure_rank(bench.bench_config(SEQ, 1))  # cp = 1 in this process (no process group)
    assert one["measured"] == one["formula"]  # no positions passed, the flash kernel's terms: exact
    assert one["sent_forward"] == one["sent_backward"] == 0
    results = run_world(_cp_world, 2, tmp_path)
    block = 2 * (SEQ // 2) * 1 * 2 * 32 * 4  # K and V of a rank's 128 tokens, 2 KV heads of 32, fp32
    for rank, result in enumerate(results):
        row = result["row"]
        assert row["rank"] == rank and row["layers"] == 2
        # Band: the formula at s/cp tokens, plus what it leaves out under cp: every layer gathers the RoPE
        # cos and sin at the rank's positions, 2·b·(s/cp)·k·4 bytes (2.2% of a layer at this width)
        assert 1.0 <= row["measured"] / row["formula"] <= 1.03
        assert 0.5 <= row["measured"] / one["measured"] <= 0.515  # 1/cp of one process's layers
        # Sent per layer, to the byte: forward 1 K/V block; backward 1 K/V block and 2 dK/dV blocks (fp32)
        assert (row["sent_forward"], row["sends_forward"]) == (row["ring_forward"], 1) == (block, 1)
        assert (row["sent_backward"], row["sends_backward"]) == (row["ring_backward"], 3) == (3 * block, 3)
        assert row["loss"] == pytest.approx(one["loss"], rel=1e-5)  # the same rows' mean loss
    report = results[0]["report"]
    assert "cp=2" in report and "ring attention" in report and results[1]["report"] == ""
    per_rank = [line for line in report.splitlines() if line.startswith(("| 0 | ", "| 1 | ")) and "1/cp" in line]
    assert len(per_rank) == 2
    for line in per_rank:
        ratio = float(line.split("|")[4])
        assert 1.0 <= ratio <= 1.03
    assert f"sent per layer and micro-batch {block:,} bytes forward" in report
    assert f"{3 * block:,} backward" in report
