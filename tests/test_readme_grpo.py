"""The README's "Reinforcement learning (GRPO)" section as typed, as one shell script (its variable carries
over), on SmolLM2-135M-Instruct: outputs under a temporary directory, the run narrowed to one step of one
prompt with two completions of a few tokens. The GGUF's import is the session's cache's (tests/conftest.py's
`session_cache_dir`), shared with the other SmolLM2 tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_readme_commands import _section_commands

pytestmark = pytest.mark.slow
NARROW = {"--num-generations 4": "--num-generations 2", "--prompts-per-step 4": "--prompts-per-step 1",
          "--steps 30": "--steps 1", "--max-completion-length 48": "--max-completion-length 6"}


def test_readme_grpo_commands(tmp_path):
    commands = _section_commands("Reinforcement learning (GRPO)")
    assert len(commands) == 4, commands
    bin_dir = str(Path(sys.executable).parent)
    lines = ["set -e"]
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        line = line.replace("data/grpo", f"{tmp_path}/data/grpo")
        if "--data-only" in line:
            line += " --train 2 --test 2"
        if " align " in line:
            for typed, narrowed in NARROW.items():
                assert typed in line, typed
                line = line.replace(typed, narrowed)
        if " chat " in line:
            line = line.replace("--max-new-tokens 48", "--max-new-tokens 6")
        lines.append(line)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the session's $MESHLM_CACHE: SmolLM2 imported once per run
    proc = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "data" / "grpo" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(r["answer"], int) for r in rows)
    run_dir = tmp_path / "runs" / "smollm2-grpo"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1] and train[0]["completion_length"] <= 6
    assert "rewards/meshlm.tune.rewards:exact_number/mean" in train[0]
    assert json.loads((run_dir / "grpo.json").read_text())["group_size"] == 2
    assert "step 1: reward" in proc.stdout
