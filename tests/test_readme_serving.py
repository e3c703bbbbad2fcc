"""Every command of the README's Serving section, as typed (a small random checkpoint named gpt-tiny under
tmp_path, free ports instead of 8000 and 8001)."""

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT
from tests.infer.server_helpers import free_port, http, save_gpt_checkpoint
from tests.test_readme_commands import _section_commands


def test_readme_serving_commands(tmp_path):
    save_gpt_checkpoint(tmp_path / "runs" / "gpt-tiny")  # 2 × 64, 64 positions, random weights
    bin_dir = str(Path(sys.executable).parent)
    commands = _section_commands("Serving")
    assert len(commands) == 6, commands
    first, last = commands[:5], commands[5]
    assert first[0].endswith("&") and first[-1] == "kill %1" and last.startswith("torchrun")

    port = str(free_port())
    lines = []
    for line in first:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        lines.append(line.replace("8000", port))
        if line.endswith("&"):  # wait until it answers (a user would wait a moment)
            lines.append(f"for i in $(seq 120); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; "
                         "sleep 0.5; done")
    proc = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(lines) + "\nwait"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    completion, end = json.JSONDecoder().raw_decode(proc.stdout)  # curl prints no newline after it
    out = proc.stdout[end:].splitlines()
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 20
    # the openai client's chat call succeeded (an HTTP error would raise, and `set -e` fail the script)
    metrics = {line.split()[0]: float(line.split()[1]) for line in out if line.startswith("meshlm_")}
    assert set(metrics) == {"meshlm_generation_tokens_total", "meshlm_queue_length",
                            "meshlm_time_to_first_token_seconds_count"}
    assert metrics["meshlm_generation_tokens_total"] >= 21 and metrics["meshlm_queue_length"] == 0
    assert metrics["meshlm_time_to_first_token_seconds_count"] == 2

    port = str(free_port())
    line = last.replace("runs/", f"{tmp_path}/runs/").replace("8001", port)
    line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
    server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the tp=2 server did not start"
            try:
                if http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        status, _, body = http("POST", f"http://127.0.0.1:{port}/v1/completions",
                               {"model": "gpt-tiny", "prompt": "ROMEO.", "max_tokens": 20, "temperature": 0})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == completion["choices"][0]["text"]  # tp=2 == tp=1
    finally:
        server.terminate()
        server.wait(60)
