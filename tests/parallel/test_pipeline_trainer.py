"""`torchrun … meshlm train --parallel.pp=…` as a user runs it: every command of docs/parallel.md's
"Pipeline parallelism" section (and any README line that launches a pipeline, which must be one of them),
on the bundled corpus with a narrow model and 2 steps appended.

Checked against the single-process Trainer with the same config: per-step losses and the evaluation loss
within 1e-5 relative, final weights within 1e-5 (read back whole from the stage files); rank 0 alone logs;
`meshlm generate` reads the checkpoint's pieces as one model; the run's checkpoint after step 1, resumed,
equals the straight run bit for bit, and resumes under another layout too (here one process).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from meshlm.core.config import load_config
from meshlm.families.registry import get_spec
from meshlm.train.trainer import Trainer
from tests.conftest import ROOT

DOC, README = ROOT / "docs" / "parallel.md", ROOT / "README.md"
GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

BIN = Path(sys.executable).parent
STEPS = 2
# Narrow and short, but the documented layers and batch shape (6 layers; micro-batches of 2 of 8).
TINY = ["--model.hidden_size=32", "--model.seq_len=32", "--train.eval_iters=2", "--train.eval_every=0",
        "--train.log_every=1", "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false",
        "--parallel.timeout_s=60"]
TIMEOUT_S = 150
TOL = 1e-5


def documented_commands() -> list[list[str]]:
    """The indented command lines of the "## Pipeline parallelism" section."""
    section = DOC.read_text().split("## Pipeline parallelism", 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line.strip()) for line in section.splitlines()
            if re.match(r"\s{4,}(torchrun|meshlm) ", line)]


def _run(argv: list[str], cwd: Path, extra: list[str]) -> subprocess.CompletedProcess:
    if argv[0] == "torchrun":  # the console script next to this interpreter, as `meshlm` below
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    elif (BIN / argv[0]).exists():
        argv = [str(BIN / argv[0]), *argv[1:]]
    return subprocess.run([*argv, *extra], cwd=cwd, check=False, capture_output=True, text=True, timeout=TIMEOUT_S)


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--") and "." in a.split("=", 1)[0]]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]


def _val_loss(out: Path) -> float:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"][-1][
        "val_loss"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every documented command, each into its own run directory (generate reads the first). The first also
    keeps a checkpoint after step 1, which the resume test below continues from."""
    root = tmp_path_factory.mktemp("pp_docs")
    results = {}
    for i, argv in enumerate(documented_commands()):
        if argv[0] == "torchrun":
            out = root / f"runs/cmd{i}"
            every = ["--train.save_every=1"] if i == 0 else []
            proc = _run(argv, root, [*TINY, f"--train.max_steps={STEPS}", f"--train.out_dir={out}", *every])
            results[i] = {"argv": argv, "proc": proc, "out": out}
        else:
            first = root / "runs/cmd0"
            argv = [a if a != "runs/gpt-tiny" else str(first) for a in argv]
            results[i] = {"argv": argv, "proc": _run([*argv, "--max-new-tokens", "5", "--seed", "1"], root, [])}
    return results


def test_documented_pipeline_commands_run(runs):
    kinds = [tuple(r["argv"][:1]) for r in runs.values()]
    assert kinds == [("torchrun",)] * 4 + [("meshlm",)], "the section documents 4 launches and one generate"
    for r in runs.values():
        assert r["proc"].returncode == 0, f"{shlex.join(r['argv'])}\n{r['proc'].stderr[-3000:]}"
        if r["argv"][0] == "torchrun":
            assert r["proc"].stdout.count("step      1 |") == 1, "rank 0 alone logs"
            assert r["proc"].stdout.count("pipeline:") == 1
            assert len(_losses(r["out"])) == STEPS
        else:
            assert r["proc"].stdout.startswith("ROMEO."), "generation from the pipeline checkpoint"
    assert "layers per stage [5, 1], 4 micro-batches per step, Schedule1F1B" in runs[0]["proc"].stdout
    assert "layers per stage [4, 2]" in runs[2]["proc"].stdout
    assert "ScheduleInterleaved1F1B" in runs[1]["proc"].stdout


def test_readme_pipeline_lines_are_documented_and_tested():
    tested = {shlex.join(c) for c in documented_commands()}
    for line in README.read_text().splitlines():
        if line.startswith("torchrun") and "--parallel.pp" in line:
            assert shlex.join(shlex.split(line)) in tested, f"README line not run by the tests: {line}"


@pytest.fixture(scope="module")
def references() -> dict:
    """The single-process run of each documented command's non-parallel keys (one Trainer per distinct set)."""
    return {}


def _reference(references: dict, argv: list[str], root: Path) -> Path:
    single = tuple(a for a in _overrides(argv) if not a.startswith("--parallel."))
    if single not in references:
        out = root / f"ref{len(references)}"
        Trainer(load_config("gpt-tiny", [*single, *TINY, f"--train.max_steps={STEPS}", f"--train.out_dir={out}"])).run()
        references[single] = out
    return references[single]


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_pipeline_training_matches_single_process(runs, references, tmp_path_factory, index):
    run = runs[index]
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    ref_out = _reference(references, run["argv"], tmp_path_factory.getbasetemp())
    got, want = _losses(run["out"]), _losses(ref_out)
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= TOL, (got, want)
    assert abs(_val_loss(run["out"]) - _val_loss(ref_out)) / _val_loss(ref_out) <= TOL
    full = load_model_state(resolve_checkpoint(run["out"]), spec=GPT_SPEC)
    plain = load_model_state(resolve_checkpoint(ref_out), spec=GPT_SPEC)
    assert full.keys() == plain.keys()
    assert max(float((full[k] - v).abs().max()) for k, v in plain.items()) <= TOL
    # A tied embedding is stored once (by the first stage); that its two copies stay bit-equal in training
    # is checked in test_pipeline_end_to_end.py.


def test_pipeline_checkpoint_resumes_exactly_and_under_another_layout(runs, tmp_path):
    """The straight run's checkpoint after step 1, alone in a new run directory, resumed by the same command to
    step 2: the same step-2 loss and weights, bit for bit. (One launch instead of a 1-step run and its resume:
    a run stopped at train.max_steps and resumed is checked the same way under tp=2 in test_torchrun.py.)"""
    straight = runs[0]
    split = tmp_path / "split"
    (split / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight["out"] / "checkpoints" / "step_0000001", split / "checkpoints" / "step_0000001")
    (split / "checkpoints" / "latest").write_text("step_0000001\n")
    proc = _run(straight["argv"], tmp_path, [*TINY, f"--train.max_steps={STEPS}", f"--train.out_dir={split}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {split / 'checkpoints' / 'step_0000001'} at step 1" in proc.stdout
    files = sorted(p.name for p in resolve_checkpoint(split).iterdir())
    assert files == ["config.json", "index.json", "manifest.json", "shards", "state.pt"]
    assert len(_losses(straight["out"])) == STEPS
    assert _losses(split) == _losses(straight["out"])[1:]
    a = load_model_state(resolve_checkpoint(straight["out"]), spec=GPT_SPEC)
    b = load_model_state(resolve_checkpoint(split), spec=GPT_SPEC)
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = Trainer(load_config("gpt-tiny", [*TINY, "--train.micro_batch_size=2", f"--train.max_steps={STEPS + 1}",
                                               f"--train.out_dir={split}"]))
    assert resumed.step == STEPS, "one process resumes the pp=2 checkpoint (tests/parallel/test_data_parallel*.py)"
