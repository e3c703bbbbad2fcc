"""Every command of the README's Serving section, as typed (a small random checkpoint named gpt-tiny under
tmp_path, with two adapters tuned for a few steps as runs/plays-lora and runs/plays-prompt; free ports
instead of 8000 and 8001)."""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_shell
from tests.infer.server_helpers import free_port, http, save_gpt_checkpoint
from tests.test_readme_commands import _section_commands


def run_script(commands: list[str], tmp_path: Path) -> str:
    """`commands` (a server started with `&` ... `kill %1`) as one bash script on a free port (`run_shell`: no
    server outlives it); its stdout. A failure shows the commands traced (`set -x`) and the server's log."""
    bin_dir = str(Path(sys.executable).parent)
    port = str(free_port())
    lines = []
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        lines.append(line.replace("8000", port))
        if line.endswith("&"):  # wait until it answers (a user would wait a moment)
            lines.append(f"for i in $(seq 240); do curl -sf http://127.0.0.1:{port}/health >/dev/null && break; "
                         "sleep 0.5; done")
    proc = run_shell("set -ex\n" + "\n".join(lines) + "\nwait", 300)
    assert proc.returncode == 0, f"the script exited with {proc.returncode}; its trace and log:\n{proc.stderr[-4000:]}"
    return proc.stdout


def tune_adapters(tmp_path: Path) -> None:
    """runs/plays-lora and runs/plays-prompt on runs/gpt-tiny, as the README's tuning section makes them
    (here on a tiny task, four steps each)."""
    from tests.tune.tune_helpers import QUIET, repeat_rows, run, write_jsonl

    train = write_jsonl(tmp_path / "train.jsonl", repeat_rows(16, 1))
    for method in ("lora", "prompt"):
        code, _, err = run("tune", "--checkpoint", str(tmp_path / "runs" / "gpt-tiny"), "--method", method, "--train",
                           str(train), "--valid", str(train), "--out", str(tmp_path / "runs" / f"plays-{method}"),
                           "--max-length", "16", *QUIET, "--train.max_steps=4", "--optim.lr=3e-2",
                           "--tune.virtual_tokens=3")
        assert code == 0, err


def test_readme_serving_commands(tmp_path):
    save_gpt_checkpoint(tmp_path / "runs" / "gpt-tiny")  # 2 × 64, 64 positions, random weights
    commands = _section_commands("Serving")
    assert len(commands) == 12, commands
    first, last, adapters = commands[:6], commands[6], commands[7:]
    assert first[0].endswith("&") and first[-1] == "kill %1" and last.startswith("torchrun")
    assert adapters[0].endswith("&") and " --adapter " in adapters[0] and adapters[-1] == "kill %1"

    stdout = run_script(first, tmp_path)
    completion, end = json.JSONDecoder().raw_decode(stdout)  # curl prints no newline after it
    assert completion["object"] == "text_completion" and completion["usage"]["completion_tokens"] == 20
    # the openai client's chat call succeeded (an HTTP error would raise, and `set -e` fail the script)
    at = stdout.index('{"id":"chatcmpl', end)  # the response_format request: its reply is the schema's JSON
    guided, end = json.JSONDecoder().raw_decode(stdout, at)
    assert json.loads(guided["choices"][0]["message"]["content"])["color"] in ("red", "blue")
    out = stdout[end:].splitlines()
    metrics = {line.split()[0]: float(line.split()[1]) for line in out if line.startswith("meshlm_")}
    assert set(metrics) == {"meshlm_generation_tokens_total", "meshlm_queue_length",
                            "meshlm_time_to_first_token_seconds_count", "meshlm_prefix_cache_hit_rate",
                            "meshlm_spec_acceptance_rate"}
    assert metrics["meshlm_generation_tokens_total"] >= 21 and metrics["meshlm_queue_length"] == 0
    assert metrics["meshlm_time_to_first_token_seconds_count"] == 3
    assert 0 <= metrics["meshlm_prefix_cache_hit_rate"] < 1 and 0 <= metrics["meshlm_spec_acceptance_rate"] <= 1

    port = str(free_port())
    line = last.replace("runs/", f"{tmp_path}/runs/").replace("8001", port)
    line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
    log = tmp_path / "tp2.log"
    with log.open("w") as fh:
        server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the tp=2 server did not start:\n{log.read_text()[-3000:]}"
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
    finally:  # torchrun and both ranks (its process group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    tune_adapters(tmp_path)
    stdout = run_script(adapters, tmp_path)
    decoder = json.JSONDecoder()
    models, end = decoder.raw_decode(stdout)
    assert [(m["id"], m["parent"]) for m in models["data"]] == [("gpt-tiny", None), ("plays-lora", "gpt-tiny"),
                                                                 ("prompt", "gpt-tiny")]
    completion, end2 = decoder.raw_decode(stdout, end + len(stdout[end:]) - len(stdout[end:].lstrip()))
    assert completion["model"] == "plays-lora" and completion["usage"]["completion_tokens"] >= 1
    # the openai client's completion from the prompt adapter printed its text (an HTTP error would raise, and
    # `set -e` fail the script)
    assert stdout[end2:].endswith("\n")


@pytest.mark.slow  # imports SmolLM2's GGUF file once (about half a minute) and serves it
def test_readme_tool_calling_commands(tmp_path):
    """The README's Tool calling section as typed, on SmolLM2-135M-Instruct: a forced call of the named
    function (its arguments valid for the schema), then, after the tool message, a plain answer."""
    commands = [line.replace("8005", "8000") for line in _section_commands("Tool calling")]
    assert commands[1].endswith("&") and " --tool-parser hermes " in commands[1] and commands[-1] == "kill %1"
    call, answer = run_script(commands, tmp_path).splitlines()[-2:]
    finish, name, arguments = call.split(" ", 2)
    assert (finish, name) == ("tool_calls", "get_weather")
    city = json.loads(arguments)["city"]
    assert isinstance(city, str) and len(city) <= 20
    assert answer.strip() and "<tool_call>" not in answer
