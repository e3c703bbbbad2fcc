"""`meshlm plan`: the ranked JSON, one layout, its terms, the written config, serving, and bad input (exit 2,
one line). In-process through `meshlm.cli.main` (fast), and once through the console script."""

from __future__ import annotations

import json
import math
import re

import pytest

from meshlm.cli import main
from meshlm.core.config import load_config
from meshlm.plan.catalog import CATALOG, get_gpu
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.report import parse_layout
from meshlm.plan.search import evaluate
from tests.conftest import run_cli

KEYS = {"tp", "pp", "vpp", "dp", "cp", "sp", "micro_batch_size", "recompute", "zero", "memory_gb", "step_time_s",
        "tokens_per_s", "tflops_per_gpu", "mfu"}
CLUSTER = ["--config", "gpt2-1.3b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100-80gb",
           "--global-batch-size", "256"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_lists_ranked_layouts_that_fit(capsys):
    rc, out, _ = _run(capsys, *CLUSTER, "--json", "--top", "5")
    assert rc == 0
    rows = json.loads(out)
    assert len(rows) == 5 and all(KEYS <= set(r) for r in rows)
    speeds = [r["tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    for r in rows:
        assert r["tp"] * r["cp"] * r["pp"] * r["dp"] == 16 and 0 < r["memory_gb"] <= 80 and 0 < r["mfu"] < 1
        # tokens/s and TFLOP/s per GPU follow from the step time
        assert r["tokens_per_s"] == pytest.approx(256 * 2048 / r["step_time_s"])
    layouts = {(r["tp"], r["cp"], r["pp"], r["dp"], r["sp"], r["recompute"]) for r in rows}
    assert len(layouts) == 5, "the table shows the best variant of each distinct layout"


def test_layout_evaluates_one_layout_as_the_search_does(capsys):
    text = "tp=2,pp=2,dp=4,vpp=1,sp=true,mbs=2,recompute=selective,zero=1"
    rc, out, _ = _run(capsys, *CLUSTER, "--layout", text, "--json")
    assert rc == 0
    (row,) = json.loads(out)
    assert (row["tp"], row["pp"], row["dp"], row["sp"], row["micro_batch_size"], row["recompute"], row["zero"]) == \
        (2, 2, 4, True, 2, "selective", 1)
    # tp and pp given: cp is 1 unless given, and dp fills the world
    assert parse_layout(text, 16) == {"tp": 2, "pp": 2, "dp": 4, "cp": 1, "vpp": 1, "sp": True, "micro_batch_size": 2,
                                      "recompute": ("selective", 0), "zero": 1}
    cfg = load_config("gpt2-1.3b", ["--train.global_batch_size=256"])
    est = evaluate(cfg, Candidate(2, 2, 4, 1, True, 2, "selective", 0, 1), Cluster(get_gpu("a100-80gb"), 16, 8), 256,
                   Options())
    assert row["step_time_s"] == pytest.approx(est.step_time_s) and row["memory_gb"] == pytest.approx(
        est.memory_bytes / 2 ** 30, abs=1e-3)


def test_gpu_gather_cost_reprices_sequence_parallel_layouts(capsys):
    """`--gpu-gather-cost 1` (gloo's measured ratio) makes an SP layout's collectives slower; a layout
    without SP or ZeRO gathers does not move."""
    def step(layout: str, *extra: str) -> float:
        rc, out, _ = _run(capsys, *CLUSTER, "--layout", layout, "--json", *extra)
        assert rc == 0
        return json.loads(out)[0]["step_time_s"]

    sp = "tp=2,pp=2,dp=4,vpp=1,sp=true,mbs=2,recompute=selective,zero=0"
    plain = "tp=2,pp=2,dp=4,vpp=1,sp=false,mbs=2,recompute=none,zero=0"
    assert step(sp, "--gpu-gather-cost", "1.0") > step(sp)
    assert step(plain, "--gpu-gather-cost", "1.0") == pytest.approx(step(plain))


def test_gloo_collectives_benchmark_prints_every_probe_size(monkeypatch, capsys):
    """benchmarks/gloo_collectives.py: one run of the probe `--gpu this` uses, a row per size and the fit."""
    import importlib
    import sys

    from meshlm.plan.catalog import LINK_PROBE_NUMELS
    from tests.conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["gloo_collectives.py", "--runs", "1"])
    importlib.import_module("gloo_collectives").main()
    out = capsys.readouterr().out
    assert len(re.findall(r"^\| 1 \| ", out, re.MULTILINE)) == len(LINK_PROBE_NUMELS)
    assert re.search(r"gather_cost \d+\.\d\d \(a ring: 0\.50\)", out), out


def test_explain_prints_terms_that_add_up(capsys):
    rc, out, _ = _run(capsys, *CLUSTER, "--explain", "tp=2,pp=4,dp=2,vpp=2,mbs=1,recompute=full")
    assert rc == 0
    terms = {}
    for line in out.split("time per step")[1].splitlines()[1:]:
        match = re.match(r"^\s+(.+?)\s+([\d.]+) s(\s+[\d.]+%)?$", line)
        if match:
            terms[match.group(1)] = float(match.group(2))
    step = terms.pop("step")
    assert sum(terms.values()) == pytest.approx(step, rel=1e-4)
    assert terms["pipeline bubble"] > 0 and terms["recompute (extra forward)"] > 0 and terms["TP collectives"] > 0
    assert "activations" in out and "optimizer states" in out


def test_write_config_round_trips(capsys, tmp_path):
    path = tmp_path / "best.toml"
    rc, out, err = _run(capsys, *CLUSTER, "--write-config", str(path), "--json", "--top", "1")
    assert rc == 0 and "wrote" in err
    best = json.loads(out)[0]
    cfg = load_config(str(path))
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.cp, cfg.train.micro_batch_size,
            cfg.parallel.zero) == (best["tp"], best["pp"], best["dp"], best["cp"], best["micro_batch_size"], best["zero"])
    assert cfg.train.global_batch_size == 256 and cfg.model.hidden_size == 2048


def test_inference_meets_the_latency_target(capsys):
    rc, out, _ = _run(capsys, "--config", "gpt2-1.3b", "--gpu", "h100-80gb", "--inference", "--tpot-ms", "5",
                      "--json")
    assert rc == 0
    rows = json.loads(out)
    meeting = [r for r in rows if r["meets_targets"]]
    assert meeting and all(r["tpot_ms"] <= 5 for r in meeting)
    assert meeting[0]["tokens_per_s_per_gpu"] == max(r["tokens_per_s_per_gpu"] for r in meeting)
    assert all(r["memory_gb"] <= 80 and r["kv_cache_per_request_mb"] > 0 for r in rows)


@pytest.mark.parametrize("args,needle", [
    (["--gpu", "a300"], "a100-80gb, a100-40gb"),
    (["--gpus", "12"], "--gpus-per-node 8"),
    (["--config", "gpt-tiny", "--gpus", "5", "--gpus-per-node", "8", "--model.n_layers=4", "--global-batch-size", "8"],
     "--gpus 4 or 6 would factor"),
    (["--gpus", "8", "--gpu", "v100-32gb", "--model.n_layers=400", "--model.hidden_size=8192", "--model.n_heads=64"],
     "GPUs of this type would fit it"),
    (["--layout", "tp=2,pp=2,dp=3"], "the world has 8 processes; set parallel.dp=2"),
    (["--layout", "tp=2,banana=1"], "is not key=value"),
    (["--gpu-gather-cost", "0"], "--gpu-gather-cost=0.0 must be positive"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    base = ["--config", "gpt2-1.3b", "--gpus", "8"]
    rc, out, err = _run(capsys, *base, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_console_script_exit_code_and_catalog():
    proc = run_cli("plan", "--config", "gpt-tiny", "--gpu", "nope")
    assert proc.returncode == 2 and all(name in proc.stderr for name in CATALOG)


def test_trials_on_this_machine_measure_the_top_layouts_and_rerank_them():
    """`--gpu this --gpus 2 --trial 2`: this machine measured (matmul rate, op overhead; the gloo link given,
    which skips its probe: test_gloo_collectives_benchmark_prints_every_probe_size runs that), the search over
    2 processes, then the top 2 layouts run for real with torchrun, 2 steps each (the second timed); the JSON
    rows carry both times and come back sorted by the measured one."""
    proc = run_cli("plan", "--config", "gpt-tiny", "--model.n_layers=2", "--model.seq_len=64", "--gpus", "2",
                   "--gpus-per-node", "2", "--gpu", "this", "--gpu-intra-gbps", "2", "--gpu-intra-latency-us", "50",
                   "--global-batch-size", "8", "--trial", "2", "--steps", "2", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) >= 2
    measured = [r["measured_step_time_s"] for r in rows[:2]]
    assert all(math.isfinite(m) and m > 0 for m in measured), measured  # both ran (a failed trial is inf)
    assert measured == sorted(measured)
    assert all(r["tp"] * r["pp"] * r["dp"] == 2 and r["step_time_s"] > 0 for r in rows[:2])


def test_every_gpu_flag_overrides_a_catalog_field():
    """The --gpu-NAME options (commands/plan.py) are plan.catalog.OVERRIDABLE's fields, in its order, which
    `run_plan` reads back by name (--gpu-memory-gb: memory_gib)."""
    from meshlm.commands.plan import GPU_FIELDS
    from meshlm.plan.catalog import OVERRIDABLE

    assert [n.replace("-", "_").replace("memory_gb", "memory_gib") for n, _ in GPU_FIELDS] == list(OVERRIDABLE)
