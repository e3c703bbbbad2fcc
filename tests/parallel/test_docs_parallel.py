"""Every `$ ` command in docs/parallel.md, run as a user would (console scripts, in a fresh directory,
with a tiny model and 2 steps appended). The two-"node" command runs as two launchers at once, on a free
port instead of 29500 (other jobs on a shared machine may hold it)."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

DOC = ROOT / "docs" / "parallel.md"
BIN = Path(sys.executable).parent
TINY = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=32", "--train.micro_batch_size=2",
        "--train.global_batch_size=4", "--train.eval_iters=1", "--train.peak_tflops=1", "--train.max_steps=2",
        "--train.sample_tokens=0", "--train.progress=false", "--train.log_every=1", "--parallel.timeout_s=60"]
TIMEOUT_S = 150


def documented_commands() -> list[list[str]]:
    return [shlex.split(line[2:]) for line in DOC.read_text().splitlines() if line.startswith("$ ")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(argv: list[str], out_dir: str | None) -> list[str]:
    program = str(BIN / argv[0]) if (BIN / argv[0]).exists() else argv[0]
    extra = TINY + ([f"--train.out_dir={out_dir}"] if out_dir else []) if "train" in argv else []
    return [program, *argv[1:], *extra]


def _train_steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


def test_every_documented_parallel_command_works(tmp_path):
    commands = documented_commands()
    assert [(c[0], c[1]) for c in commands] == [("torchrun", "--standalone")] * 3 + [
        ("torchrun", "--nnodes=2"), ("meshlm", "generate")]
    for i, argv in enumerate(commands):
        out = None if i == 0 else f"runs/cmd{i}"  # the first trains into the config's runs/gpt-tiny
        if "--nnodes=2" in argv:
            argv = [a.replace("127.0.0.1:29500", f"127.0.0.1:{_free_port()}") for a in argv]
            nodes = [subprocess.Popen(_argv(argv, out), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for _ in range(2)]
            try:
                results = [(n.wait(timeout=TIMEOUT_S), *n.communicate()) for n in nodes]
            finally:
                for n in nodes:
                    n.kill()
        else:
            proc = subprocess.run(_argv(argv, out), cwd=tmp_path, check=False, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
            results = [(proc.returncode, proc.stdout, proc.stderr)]
        for code, _, err in results:
            assert code == 0, f"{shlex.join(argv)}\n{err[-3000:]}"
        if argv[0] == "torchrun":
            assert _train_steps(tmp_path / (out or "runs/gpt-tiny")) == [1, 2], shlex.join(argv)
            assert sum("layout:" in stdout for _, stdout, _ in results) == 1, "rank 0 alone logs"
        else:
            assert results[0][1].startswith("ROMEO."), "generation from the tensor-parallel checkpoint"
