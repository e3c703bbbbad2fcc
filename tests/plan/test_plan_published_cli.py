"""The published layouts through the CLI, as a user types them (issue 35, item 12): each row of Narayanan et al.
2021, Table 1 (GPT, 1.7B to 1T parameters on A100-80GB) given as `--layout tp=..,pp=..,dp=..,recompute=full`
with no micro-batch size, interleaving, sequence parallelism or ZeRO stage: the planner completes the layout
with the fastest variant that fits, and its throughput (in the paper's FLOP count) is within 15% of the
published one. A layout whose given fields cannot fit is refused in one line with exit 2.

The published rows are restated once, in benchmarks/plan_validation.py (`NARAYANAN_TABLE_1`, with the
paper's FLOP formula `paper_flops`). In-process through `meshlm.cli.main`."""

from __future__ import annotations

import importlib
import json
import re

import pytest

from meshlm.cli import main
from tests.conftest import ROOT

TOLERANCE = 0.15


def _validation():
    """benchmarks/plan_validation.py (the published rows and the papers' FLOP count), imported by path."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("plan_validation")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def pv():
    return _validation()


def _model(heads: int, hidden: int, layers: int) -> list[str]:
    """The papers' GPT (sequence 2048, learned positions, LayerNorm, GeLU, tied embeddings: gpt2-1.3b's
    shape) at this size, their 51,200-token vocabulary and dropout 0.1."""
    return ["--config", "gpt2-1.3b", f"--model.n_layers={layers}", f"--model.hidden_size={hidden}",
            f"--model.n_heads={heads}", "--model.vocab_size=51200", "--model.dropout=0.1"]


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("row", _validation().NARAYANAN_TABLE_1, ids=lambda r: f"{r[0]:g}B")
def test_narayanan_2021_table_1_layouts_are_completed_to_fit_within_15_percent(capsys, pv, row):
    """`--runtime megatron-2021` describes the software the paper measured (16-bit weights with fp32 master
    copies, stored attention scores, the DP all-reduce after the backward); the layout's open fields are the
    search's to choose."""
    _size, heads, hidden, layers, tp, pp, gpus, batch, published = row
    dp = gpus // (tp * pp)
    rc, out, err = _plan(capsys, *_model(heads, hidden, layers), "--gpus", str(gpus), "--gpus-per-node", "8",
                         "--gpu", "a100-80gb", "--global-batch-size", str(batch), "--runtime", "megatron-2021",
                         "--layout", f"tp={tp},pp={pp},dp={dp},recompute=full", "--json")
    assert rc == 0, err
    (answer,) = json.loads(out)
    assert (answer["tp"], answer["pp"], answer["dp"], answer["recompute"]) == (tp, pp, dp, "full")
    assert answer["fits"] and answer["memory_gb"] <= 80
    tflops = pv.paper_flops(batch, layers, hidden, recompute="full") / answer["step_time_s"] / gpus / 1e12
    assert tflops == pytest.approx(published, rel=TOLERANCE), (answer, tflops)


ONE_T = [*_model(160, 25600, 128), "--gpus", "3072", "--gpus-per-node", "8", "--gpu", "a100-80gb",
         "--global-batch-size", "3072"]


def test_the_1t_layout_of_the_issue_is_completed_to_one_that_fits_on_meshlms_runtime(capsys, pv):
    """The issue's request: meshlm's own runtime, no mbs given. It answered with the config's micro-batch
    size and 238 GB per GPU; now the search picks the micro-batch size, the virtual stages, SP and ZeRO."""
    rc, out, err = _plan(capsys, *ONE_T, "--layout", "tp=8,pp=64,dp=6,recompute=full", "--json")
    assert rc == 0, err
    (answer,) = json.loads(out)
    assert answer["fits"] and answer["memory_gb"] <= 80
    assert (answer["tp"], answer["pp"], answer["dp"], answer["recompute"]) == (8, 64, 6, "full")
    tflops = pv.paper_flops(3072, 128, 25600, recompute="full") / answer["step_time_s"] / 3072 / 1e12
    assert tflops == pytest.approx(163, rel=TOLERANCE), (answer, tflops)
    # the table says which fields the search chose
    rc, out, err = _plan(capsys, *ONE_T, "--layout", "tp=8,pp=64,dp=6,recompute=full")
    assert rc == 0 and re.search(r"completed by the search: vpp, sp, mbs, zero", out), out


def test_given_fields_that_cannot_fit_are_refused_in_one_line_with_the_excess(capsys):
    """Every field given (the issue's micro-batch size 8 with full recomputation): nothing to complete, and it
    needs far more than 80 GiB."""
    layout = "tp=8,pp=64,dp=6,vpp=1,sp=false,mbs=8,recompute=full,zero=0"
    rc, out, err = _plan(capsys, *ONE_T, "--layout", layout)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    match = re.search(r"needs ([\d,.]+) GiB per GPU, ([\d,.]+) GiB more than the a100-80gb's 80 GiB", err)
    assert match, err
    need, over = (float(g.replace(",", "")) for g in match.groups())
    assert need > 80 and over == pytest.approx(need - 80, abs=0.1)
    assert f"--layout {layout!r}" in err
    # the given field that stops it: the micro-batch size left open, the search finds one that fits
    assert re.search(r"it fits with (\w+ or )*mbs( or \w+)* open", err), err


def test_a_partial_layout_whose_given_fields_cannot_fit_names_its_leanest_completion(capsys):
    rc, out, err = _plan(capsys, *ONE_T, "--layout", "tp=1,pp=1")
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert "--layout 'tp=1,pp=1'" in err and "leanest completion (tp=1,pp=1," in err and "GiB more than" in err, err


def test_explain_completes_a_partial_layout(capsys):
    rc, out, err = _plan(capsys, *ONE_T, "--explain", "tp=8,pp=64,dp=6,recompute=full")
    assert rc == 0, err
    assert re.search(r"GiB of 80 GiB: fits", out) and "layout tp=8,pp=64," in out, out


def test_every_runtime_choice_is_a_preset_of_the_cost_model():
    """commands/plan.py lists the --runtime choices without importing the planner (torch-free at import)."""
    from meshlm.commands.plan import RUNTIMES as CHOICES
    from meshlm.plan.cost import RUNTIMES

    assert list(CHOICES) == list(RUNTIMES)
