"""`meshlm serve --engine-process`: the engine in a process of its own (`infer/engine_process.py`), `meshlm
serve`'s default wherever it can. What it answers is checked against the engine in one process by
tests/infer/test_server_api.py and, with adapters given at start, by tests/infer/test_server_adapters.py (each
of their tests runs both ways), and every other test that starts `meshlm serve` without run-time adapters or
parallelism runs through it (forced tool calls, whose grammars are compiled again in the child:
tests/infer/test_server_tools.py). Here, what only a second process can do: be killed, drain on
SIGTERM and leave nothing behind, hold the queue's bounds from the server's side, refuse what it does not
serve, and relay the engine's counters."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.infer.server_helpers import ServeProcess, http, save_bert_checkpoint, save_gpt_checkpoint
from tests.interop.interop_helpers import one_error_line


def engine_pid(server: ServeProcess) -> int:
    """The engine process: the server's one child."""
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited


def metrics(server: ServeProcess) -> dict:
    out = {}
    for line in http("GET", server.url + "/metrics")[2].splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_until(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def ask_in_thread(url: str, body: dict, results: list, i: int) -> threading.Thread:
    def ask():
        try:
            results[i] = http("POST", url + "/v1/completions", body, timeout=120)
        except OSError as err:  # the server went away
            results[i] = (None, {}, str(err))

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_gpt_checkpoint(tmp_path_factory.mktemp("engine-process") / "tiny-gpt", seq_len=1024)


def test_sigterm_drains_through_the_engine_process_and_leaves_none(ckpt):
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "2", "--engine-process")
    child = engine_pid(server)
    body = {"prompt": "drain", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    results = [None] * 6
    threads = [ask_in_thread(server.url, body, results, i) for i in range(6)]
    wait_until(lambda: metrics(server)["meshlm_running_requests"] == 2)
    assert server.stop(timeout=120) == 0, "".join(server.stderr)[-3000:]
    for t in threads:
        t.join(60)
    assert [r[0] for r in results] == [200] * 6, results
    assert {json.loads(r[2])["usage"]["completion_tokens"] for r in results} == {40}
    wait_until(lambda: not alive(child), timeout=10)


def test_a_server_killed_outright_leaves_no_engine_behind(ckpt):
    """SIGKILL gives the server no time to drain: its engine process sees the pipe close, mid-request, and exits."""
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "2")  # the default: an engine process
    child = engine_pid(server)
    results = [None]
    thread = ask_in_thread(server.url, {"prompt": "a", "max_tokens": 900, "temperature": 0, "ignore_eos": True},
                           results, 0)
    wait_until(lambda: metrics(server)["meshlm_running_requests"] == 1)
    server.proc.kill()
    server.proc.wait(30)
    wait_until(lambda: not alive(child), timeout=30)
    thread.join(30)
    assert results[0][0] is None, results[0]  # the request died with its server


def test_the_engines_counters_and_histograms_reach_metrics(ckpt):
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "4", "--engine-process")
    try:
        before = metrics(server)
        assert before["meshlm_engine_alive"] == 1 and before["meshlm_generation_tokens_total"] == 0
        assert before["meshlm_time_to_first_token_seconds_count"] == 0  # the child's empty histograms, buckets too
        assert 'meshlm_time_to_first_token_seconds_bucket{le="+Inf"} 0' in http("GET", server.url + "/metrics")[2]
        assert before["meshlm_kv_cache_blocks"] == 4 * 1024 // 16 and before["meshlm_kv_cache_bytes"] > 0
        outs = [json.loads(http("POST", server.url + "/v1/completions",
                                {"prompt": f"count {i}", "max_tokens": 5 + i, "temperature": 0,
                                 "ignore_eos": True})[2]) for i in range(3)]
        after = metrics(server)  # read after the answers: the step that finished them carried the counters
        assert after["meshlm_generation_tokens_total"] == sum(o["usage"]["completion_tokens"] for o in outs) == 18
        assert after["meshlm_prompt_tokens_total"] == sum(o["usage"]["prompt_tokens"] for o in outs)
        assert after["meshlm_requests_finished_total"] == 3
        assert after["meshlm_time_to_first_token_seconds_count"] == 3
        assert after["meshlm_running_requests"] == 0 and after["meshlm_kv_cache_blocks_used"] == 0
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]


def test_the_queue_bound_holds_on_the_servers_side(ckpt):
    """--max-queue 2 (one client: a share of 1): one request runs, one waits in the engine process (one row),
    a third is a 429 from the server, which never asked the engine."""
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "1", "--max-queue", "2", "--engine-process")
    try:
        long = {"prompt": "a", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        results = [None] * 2
        first = ask_in_thread(server.url, long, results, 0)
        wait_until(lambda: metrics(server)["meshlm_running_requests"] == 1)
        second = ask_in_thread(server.url, {**long, "max_tokens": 3}, results, 1)
        wait_until(lambda: metrics(server)["meshlm_queue_length"] == 1)
        status, headers, text = http("POST", server.url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
        assert status == 429 and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", text
        assert json.loads(text)["error"]["code"] == "queue_full"
        assert results[0] is None  # the long one was still running
        first.join(120)
        second.join(120)
        assert [r[0] for r in results] == [200, 200]
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]


def test_a_killed_engine_process_fails_its_requests_and_health(ckpt):
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "2", "--engine-process")
    try:
        results = [None]
        thread = ask_in_thread(server.url, {"prompt": "a", "max_tokens": 900, "temperature": 0, "ignore_eos": True},
                               results, 0)
        wait_until(lambda: metrics(server)["meshlm_running_requests"] == 1)
        os.kill(engine_pid(server), signal.SIGKILL)
        thread.join(60)
        status, _, text = results[0]
        error = json.loads(text)["error"]
        assert status == 503 and error["code"] == "engine_dead" and "engine process exited" in error["message"], text
        assert http("GET", server.url + "/health")[0] == 503
        status, _, text = http("POST", server.url + "/v1/completions", {"prompt": "b", "max_tokens": 2})
        assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead", text
        assert http("GET", server.url + "/v1/models")[0] == 200  # the HTTP side lives on
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]


def test_runtime_adapters_with_the_engine_process_are_one_error_line(ckpt):
    """Adapters given at start are served by the engine process (tests/infer/test_server_adapters.py); adapters
    loaded while serving are not yet."""
    one_error_line(["serve", "--checkpoint", str(ckpt), "--engine-process", "--allow-runtime-lora"],
                   "--engine-process", "--allow-runtime-lora")


def test_an_encoder_with_the_engine_process_is_one_error_line(tmp_path):
    bert = save_bert_checkpoint(tmp_path / "bert")
    one_error_line(["serve", "--checkpoint", str(bert), "--engine-process"], "--engine-process", "encoder")


def test_a_checkpoint_the_engine_process_cannot_hold_is_one_error_line(ckpt):
    """The child's ConfigError (here: learned positions shorter than --max-len) reaches the command's one line."""
    one_error_line(["serve", "--checkpoint", str(ckpt), "--engine-process", "--max-len", "2048"], "--max-len 2048")

