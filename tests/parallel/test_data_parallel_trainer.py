"""Every command of docs/parallel.md's "Data parallelism, ZeRO and the 3D layout" section, run as a user
runs it (torchrun, console scripts, on the bundled corpus) with a narrow model and few steps.

Checked against the single-process Trainer with the same global batch: ZeRO-3 (FSDP2) over dp = 2, and
tp2 × pp2 × dp2 for 2 steps resumed under dp = 4 with ZeRO-2 for 2 more, give the same per-step losses
(1e-5 relative) and final weights (1e-5); rank 0 alone logs, with the measured model-state memory; `meshlm
convert --to-single` writes a safetensors file that a plain `GPT` loads to the reference's logits, and
`meshlm generate` reads it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from meshlm.core.config import config_from_dict, load_config
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT
from meshlm.train.trainer import Trainer
from tests.cli_batch import run_meshlm_batch
from tests.conftest import ROOT

GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

DOC = ROOT / "docs" / "parallel.md"
SECTION = "## Data parallelism, ZeRO and the 3D layout"
BIN = Path(sys.executable).parent
TINY = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.eval_iters=1",
        "--train.log_every=1", "--train.peak_tflops=1", "--train.sample_tokens=0", "--train.progress=false",
        "--parallel.timeout_s=60"]
STEPS = {"100": 2, "200": 4}  # the documented run of 100 steps, continued to 200, becomes 2 + 2 steps
TIMEOUT_S = 180
TOL = 1e-5


def documented_commands() -> list[list[str]]:
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return [shlex.split(line.strip()) for line in section.splitlines() if re.match(r"\s{4,}(torchrun|meshlm) ", line)]


def _argv(argv: list[str]) -> list[str]:
    if argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        steps = [a for a in argv if a.startswith("--train.max_steps=")]
        argv = [a for a in argv if a not in steps]
        n = STEPS[steps[0].split("=")[1]] if steps else 2
        return [*argv, *TINY, f"--train.max_steps={n}"]
    if argv[1] == "generate":
        argv = [*argv, "--max-new-tokens", "5", "--seed", "1"]
    return [str(BIN / argv[0]) if (BIN / argv[0]).exists() else argv[0], *argv[1:]]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _reference(root: Path, argv: list[str], steps: int) -> Path:
    """The single-process Trainer with the command's non-parallel keys."""
    keys = [a for a in argv if a.startswith("--train.micro_batch_size")]
    out = root / f"ref-{'-'.join(keys)}-{steps}"
    if not out.exists():
        Trainer(load_config("gpt-tiny", [*keys, *TINY, f"--train.max_steps={steps}", f"--train.out_dir={out}"])).run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Each launch as typed; the `meshlm` commands after them (convert, then generate) in one interpreter
    (tests/cli_batch.py: meshlm.cli.main, what the console script calls, one start-up instead of two)."""
    root = tmp_path_factory.mktemp("dp_docs")
    results = []
    commands = documented_commands()
    launches = [argv for argv in commands if argv[0] == "torchrun"]
    assert commands[:len(launches)] == launches, "the meshlm commands come after the launches"
    for argv in launches:
        proc = subprocess.run(_argv(argv), cwd=root, check=False, capture_output=True, text=True, timeout=TIMEOUT_S)
        results.append({"argv": argv, "proc": proc})
    rest = commands[len(launches):]
    procs = run_meshlm_batch([_argv(argv)[1:] for argv in rest], cwd=root, timeout=TIMEOUT_S)
    results += [{"argv": argv, "proc": proc} for argv, proc in zip(rest, procs)]
    return {"root": root, "results": results}


def test_documented_commands_run(runs):
    kinds = [" ".join(r["argv"][:2]) for r in runs["results"]]
    assert kinds == ["torchrun --standalone"] * 3 + ["meshlm convert", "meshlm generate"]
    for r in runs["results"]:
        assert r["proc"].returncode == 0, f"{shlex.join(r['argv'])}\n{r['proc'].stderr[-3000:]}"
        if r["argv"][0] == "torchrun":
            assert r["proc"].stdout.count("layout:") == 1, "rank 0 alone logs"
            assert "model states, rank 0:" in r["proc"].stdout
    assert "8 processes = pp 2 × dp 2 × tp 2" in runs["results"][1]["proc"].stdout
    assert "resuming a checkpoint of layout" in runs["results"][2]["proc"].stdout
    assert "theory, ZeRO-2 over dp=4" in runs["results"][2]["proc"].stdout
    assert runs["results"][4]["proc"].stdout.startswith("ROMEO."), "generation from the converted file"


def _check_against(out: Path, ref: Path) -> None:
    got, want = _losses(out), _losses(ref)
    assert len(got) == len(want)
    assert max(abs(a - b) / b for a, b in zip(got, want)) <= TOL, (got, want)
    full = load_model_state(resolve_checkpoint(out), spec=GPT_SPEC)
    plain = load_model_state(resolve_checkpoint(ref), spec=GPT_SPEC)
    assert full.keys() == plain.keys()
    assert max(float((full[k] - v).abs().max()) for k, v in plain.items()) <= TOL


def test_zero3_over_two_ranks_matches_single_process(runs):
    first = runs["results"][0]
    assert "theory, ZeRO-3 over dp=2" in first["proc"].stdout
    _check_against(runs["root"] / "runs/zero3", _reference(runs["root"], first["argv"], 2))


def test_3d_run_resumed_under_dp4_zero2_matches_single_process(runs):
    argv = runs["results"][1]["argv"]
    _check_against(runs["root"] / "runs/3d", _reference(runs["root"], argv, 4))


def test_converted_single_file_gives_the_reference_logits(runs):
    root = runs["root"]
    ref = resolve_checkpoint(_reference(root, runs["results"][1]["argv"], 4))
    cfg = config_from_dict(json.loads((root / "runs/3d-single/config.json").read_text()))
    converted, reference = GPT(cfg.model).eval(), GPT(cfg.model).eval()
    converted.load_state_dict(load_model_state(root / "runs/3d-single", spec=GPT_SPEC))
    reference.load_state_dict(load_model_state(ref, spec=GPT_SPEC))
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = converted(ids), reference(ids)
    assert float((a - b).abs().max()) <= TOL * float(b.abs().max())


def test_readme_data_parallel_lines_are_documented_and_tested():
    """A README line that launches data parallelism or converts a parallel checkpoint to one file must be
    one of the commands above (so the tests run it; the Hugging Face conversions are run by
    tests/test_readme_commands.py)."""
    tested = {shlex.join(c) for c in documented_commands()}
    for line in (ROOT / "README.md").read_text().splitlines():
        line = line.strip().removeprefix(".venv/bin/")
        if (line.startswith("torchrun") and "--parallel.dp" in line) or (line.startswith("meshlm convert")
                                                                        and "--to-single" in line):
            assert shlex.join(shlex.split(line)) in tested, f"README line not run by the tests: {line}"
