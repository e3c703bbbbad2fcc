"""The README's mixture-of-experts section, every command as typed, narrowed to a few steps (outputs under
tmp_path): the MoE config trains, trains again under torchrun with ep 2, and converts to a Mixtral directory
that transformers loads."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

from tests.cli_batch import run_meshlm_batch, shell_words
from tests.conftest import ROOT
from tests.test_readme_commands import _section_commands

NARROW = ["--model.n_layers=2", "--model.hidden_size=32", "--model.moe_expert_hidden=32", "--model.seq_len=32",
          "--train.max_steps=2", "--train.eval_iters=1", "--train.peak_tflops=1", "--train.progress=false",
          "--train.sample_tokens=0", "--parallel.timeout_s=120"]


def test_readme_moe_commands(tmp_path):
    commands = _section_commands("Mixture of experts")
    assert len(commands) == 3, commands
    bin_dir = str(Path(sys.executable).parent)
    typed = []
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        if line.startswith("torchrun"):
            line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
        if " train " in line:
            line += " " + " ".join(NARROW)
            if "--train.out_dir" not in line:
                line += f" --train.out_dir={tmp_path}/runs/gpt-moe-tiny"
        typed.append(line)
    # The torchrun launch (its own run directory), then the train and convert lines in one process
    # (tests/cli_batch.py).
    assert [line.startswith(f"{bin_dir}/meshlm ") for line in typed] == [True, False, True], typed
    launch = subprocess.run(["bash", "-c", typed[1]], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            check=False)
    first, last = run_meshlm_batch([shell_words(typed[i], ROOT)[1:] for i in (0, 2)], cwd=ROOT)
    outputs = []
    for line, proc in zip(typed, (first, launch, last)):
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
        outputs.append(proc.stdout + proc.stderr)
    for name in ("gpt-moe-tiny", "gpt-moe-tiny-ep2"):
        records = [json.loads(ln) for ln in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert train[-1]["step"] == 2 and len(train[-1]["moe_load_0"]) == 8, name
    assert "ep 2 (4 experts per rank, all-to-all)" in outputs[1], outputs[1][-2000:]
    config = json.loads((tmp_path / "runs" / "gpt-moe-tiny-hf" / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 8, 2)
