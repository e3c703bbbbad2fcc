"""`torchrun … meshlm align --method grpo` under tp = 2 (each rank's engine in lockstep, log-probs from the
vocab-split logits), pp = 2 (rank 0's engine over the pipeline runner; a stage-by-stage forward and backward)
and dp = 2 with ZeRO-1 (each rank a half of the step's groups; dapo's token-level normalisation over both ranks,
the KL to a frozen reference, two passes per batch, and the run stopped after step 2 and resumed) equals one
process: the same rollouts (rewards), per-step loss and gradient norm, and final weights within 1e-5.

fp32 (the engine and the trainer's log-probs are fp32). The learning rate is small on purpose: AdamW's first
updates are g / (|g| + 1e-8), so an element whose gradient is within rounding of 1e-8 moves by a fraction of
lr that fp32 rounding decides (measured: one element of 50k moving 0.13·lr apart under tp); at lr 5e-5 that
stays under 1e-5 while every weight still moves 1.5e-4 over the three steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

from meshlm.cli import main
from tests.checkpoint_helpers import load_run
from tests.tune.tune_helpers import GPT2, run, save_base, write_jsonl

TOL = 1e-5
STEPS = 3
COMMON = ["--reward", "tests.tune.grpo_rewards:spaces", "--max-completion-length", "8", "--prompts-per-step", "2",
          "--num-generations", "4", "--top-k", "4", "--lr", "5e-5"]
DAPO = ["--loss-type", "dapo", "--epsilon-high", "0.28", "--beta", "0.04", "--num-iterations", "2"]
LAYOUTS = {"tp2": (["--parallel.tp=2"], "grpo"), "pp2": (["--parallel.pp=2"], "grpo"),
           "dp2_zero1_dapo_resumed": (["--parallel.dp=2", "--parallel.zero=1"], "dapo")}


def grpo_args(root, out, variant: str, steps: int = STEPS) -> list[str]:
    return ["align", "--method", "grpo", "--checkpoint", str(root / "base"), "--train", str(root / "p.jsonl"),
            "--out", str(out), "--steps", str(steps), *COMMON, *(DAPO if variant == "dapo" else [])]


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_parallel")
    save_base(root / "base", {**GPT2, "seq_len": 48})
    write_jsonl(root / "p.jsonl", [{"prompt": f"say {w}:"} for w in ("red", "blue", "green", "gold")])
    for variant in ("grpo", "dapo"):  # the one-process references
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(grpo_args(root, root / f"one_{variant}", variant)) == 0
    return root


def torchrun(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "meshlm", *args, "--parallel.timeout_s=60"], capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(root, layout):
    flags, variant = LAYOUTS[layout]
    out, one = root / layout, root / f"one_{variant}"
    if layout.endswith("resumed"):  # two steps, then the same --out again: resumed from grpo_state.pt
        torchrun([*grpo_args(root, out, variant, steps=2), *flags])
        assert json.loads((out / "grpo.json").read_text())["steps"] == 2
    torchrun([*grpo_args(root, out, variant), *flags])
    ref, got = rows(one), rows(out)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    keys = ["reward", "reward_std", "loss", "completion_tokens", "clip_ratio/region_mean"]
    keys += ["kl"] if variant == "dapo" else []
    for a, b in zip(ref, got):
        for key in keys:
            assert b[key] == pytest.approx(a[key], abs=TOL), (key, a[key], b[key])
        # one process's norm is torch's clip_grad_norm_ (fp32 vector_norm, ~4e-6 relative off here); the layouts'
        # the float64 sum of squares of `parallel/grads.py`
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=TOL), (a["grad_norm"], b["grad_norm"])
        assert b["logprob_mismatch_max"] < 1e-5
    assert len({r["reward"] for r in ref}) == STEPS and ref[0]["grad_norm"] > 0.1  # real, changing signal
    if variant == "dapo":
        assert ref[-1]["kl"] > 0  # the reference is a frozen copy: the policy has moved away from it
    trained, base = load_run(str(one))[0], load_run(str(root / "base"))[0]
    parallel = dict(load_run(str(out))[0].named_parameters())
    with torch.no_grad():
        for name, p in trained.named_parameters():
            assert float((parallel[name] - p).abs().max()) <= TOL, name
        moved = min(float((p - base.get_parameter(n)).abs().max()) for n, p in trained.named_parameters())
    assert moved > 10 * TOL  # every tensor trained well past the tolerance


BAD = {"sp": (["--parallel.sp=true"], "not '--parallel.sp=true'"),
       "zero3": (["--parallel.zero=3"], "--parallel.zero=3 is not supported by GRPO"),
       "lora": (["--parallel.zero=1", "--adapter", "lora"], "--adapter lora runs GRPO in one process only")}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_layout_is_one_line_exit_2_nothing_written(root, tmp_path, case):
    extra, message = BAD[case]
    out = tmp_path / "out"
    code, stdout, err = run(*grpo_args(root, out, "grpo", steps=1), *extra)
    assert code == 2, (stdout, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
