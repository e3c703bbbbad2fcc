"""The README's chat fine-tuning section, every command as typed, on a narrowed `make demo` base (a 2-layer
model of the demo config; outputs under tmp_path; the tuning run two steps)."""

import json
import subprocess
import sys
from pathlib import Path

from tests.cli_batch import run_meshlm_batch, shell_words
from tests.conftest import ROOT, run_shell
from tests.infer.server_helpers import free_port
from tests.test_readme_commands import _section_commands


def test_readme_chat_commands(tmp_path):
    commands = _section_commands("Chat fine-tuning")
    assert len(commands) == 5, commands
    base = ["--model.n_layers=2", "--model.hidden_size=32", "--model.seq_len=256", "--train.micro_batch_size=2",
            "--train.global_batch_size=2", "--train.eval_iters=1", "--train.peak_tflops=1", "--train.max_steps=1",
            "--train.progress=false", "--train.sample_tokens=0", "--train.time_budget_s=0",
            f"--train.out_dir={tmp_path}/runs/demo"]
    port = str(free_port())
    wait = f"for i in $(seq 120); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; sleep 0.5; done"
    serve = next(i for i, c in enumerate(commands) if c.endswith("&"))
    script = "\n".join([commands[serve], wait, *commands[serve + 1:]]).replace("8003", port)
    bin_dir = str(Path(sys.executable).parent)
    typed = []
    for line in [*commands[:serve], script]:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        line = line.replace("data/chat", f"{tmp_path}/data/chat")
        if " tune " in line:
            line += " --train.max_steps=2 --train.progress=false --train.eval_iters=1 --train.peak_tflops=1"
        typed.append(line)
    # The data script, then the base's training and the `meshlm tune` line in one process (tests/cli_batch.py),
    # then the serving script.
    assert len(typed) == 3 and "make_chat_task.py" in typed[0] and " tune " in typed[1], typed
    data = subprocess.run(["bash", "-c", typed[0]], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert data.returncode == 0, (typed[0], data.stderr[-2000:])
    trained, tuned = run_meshlm_batch([["train", "--config", "demo", *base], shell_words(typed[1], ROOT)[1:]],
                                      cwd=ROOT)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert tuned.returncode == 0, (typed[1], tuned.stderr[-2000:])
    served = run_shell(typed[2], 600)  # its server must not outlive it
    assert served.returncode == 0, (typed[2], served.stderr[-2000:])
    outputs = [data.stdout, tuned.stdout, served.stdout]
    data = tmp_path / "data" / "chat"
    assert {"chat_train.jsonl", "chat_valid.jsonl", "chat_test.jsonl", "pref_train.jsonl"} <= {
        p.name for p in data.iterdir()}
    run = tmp_path / "runs" / "chat-sft"
    info = json.loads((run / "tune.json").read_text())
    assert info["pack"] is True
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"][-1] == 2
    reply = json.loads(outputs[-1])
    assert reply["model"] == "chat-sft" and reply["object"] == "chat.completion"
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
