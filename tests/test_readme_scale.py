"""The README's sections on asynchronous checkpoints with Hugging Face saves and on clusters: their commands as
typed, narrowed to a few steps of a small shape (outputs under tmp_path)."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.test_readme_commands import SMALL, _section_commands


def _run(line: str, tmp_path: Path | None, extra: list[str] = ()) -> subprocess.CompletedProcess:
    line = line.split("#", 1)[0].replace(".venv/bin/", str(Path(sys.executable).parent) + "/")
    if tmp_path is not None:  # outputs under tmp_path
        line = line.replace(" runs/", f" {tmp_path}/runs/").replace("=runs/", f"={tmp_path}/runs/")
    return subprocess.run(["bash", "-c", line + " " + " ".join(map(shlex.quote, extra))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def test_readme_async_save_hf_command_writes_checkpoints_and_hf_directories(tmp_path):
    (line,) = _section_commands("Asynchronous checkpoints and Hugging Face saves")
    assert "--train.async_save=true" in line and "--train.save_hf=every" in line
    line = line.replace("max_steps=300", "max_steps=4").replace("save_every=100", "save_every=2")
    line = line.replace("save_hf_every=100", "save_hf_every=2")
    proc = _run(line, tmp_path, SMALL + ["--train.sample_tokens=0", "--train.progress=false"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "runs" / "gpt-tiny-hf"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000002", "step_0000004"]
    hf = sorted(p.name for p in (run / "hf_checkpoints").glob("step_*"))
    assert hf == ["step_0000002", "step_0000004"]
    latest = (run / "hf_checkpoints" / "latest").resolve()
    assert latest.name == "step_0000004"
    config = json.loads((latest / "config.json").read_text())
    assert (config["model_type"], config["n_layer"], config["n_embd"]) == ("gpt2", 2, 32)
    assert list(latest.glob("*.safetensors")) and (latest / "tokenizer.json").exists()


def test_readme_slurm_dry_run_prints_the_torchrun_it_would_start():
    (line,) = _section_commands("Clusters: Slurm, Kubernetes, restarts, stragglers")
    proc = _run(line, None)  # a dry run writes nothing
    assert proc.returncode == 0, proc.stderr
    srun = [ln for ln in proc.stdout.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1, proc.stdout
    words = shlex.split(srun[0])
    assert "--nodes=2" in words and "--ntasks-per-node=1" in words
    assert "--nnodes=2" in words and "--rdzv_endpoint=node01:29500" in words and "--rdzv_id=1" in words
    assert any(w.startswith("--max-restarts=") for w in words)
    assert words[words.index("-m") + 1:words.index("-m") + 3] == ["meshlm", "train"]
    assert "--train.out_dir=/shared/runs/gpt-small" in words and "--train.resume=auto" in words
    assert words[-2:] == ["--config", "gpt-small"]
