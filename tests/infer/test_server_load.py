"""The server under load and failure: a full queue, clients that go away, a dead engine, SIGTERM, the CLI."""

import contextlib
import json
import socket
import sys
import threading
import time

import pytest
import torch

from meshlm.core.config import ModelConfig
from meshlm.data.tokenizers import get_tokenizer
from meshlm.infer.engine import Engine
from meshlm.infer.server import Server, build_app
from meshlm.models.gpt import GPT
from tests.infer.server_helpers import ServeProcess, free_port, http, save_gpt_checkpoint
from tests.interop.interop_helpers import one_error_line


@contextlib.contextmanager
def serve_in_thread(engine: Engine):
    """uvicorn in a thread over `engine` (the app's lifespan starts and drains the engine)."""
    import uvicorn

    server = Server(engine, None, engine.tokenizer, "tiny", engine.max_len)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)


def tiny_engine(max_seqs=1, max_queue=1) -> Engine:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layers=1, hidden_size=32, n_heads=4, seq_len=64, vocab_size=50257)).eval()
    return Engine(model, get_tokenizer("gpt2"), max_seqs=max_seqs, max_queue=max_queue)


def gate_steps(engine: Engine, gate: threading.Event, delay: float = 0.0):
    """Make each step's forward wait for `gate` (and sleep `delay`): the test decides when the engine moves."""
    forward = engine.runner.forward

    def gated(plan):
        gate.wait(30)
        time.sleep(delay)
        return forward(plan)

    engine.runner.forward = gated


def wait_until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_is_429_with_retry_after():
    engine = tiny_engine(max_seqs=1, max_queue=1)
    gate = threading.Event()
    gate_steps(engine, gate)
    body = {"prompt": "hello", "max_tokens": 5, "temperature": 0}
    results = {}

    def ask(name):
        results[name] = http("POST", url + "/v1/completions", body)

    with serve_in_thread(engine) as url:
        first = threading.Thread(target=ask, args=("running",))
        first.start()
        wait_until(lambda: engine.running == 1)
        second = threading.Thread(target=ask, args=("queued",))
        second.start()
        wait_until(lambda: engine.queue_length == 1)
        status, headers, text = http("POST", url + "/v1/completions", body)
        assert status == 429 and headers["retry-after"] == "1", text
        assert json.loads(text)["error"]["code"] == "queue_full"
        gate.set()
        first.join(30)
        second.join(30)
        assert results["running"][0] == 200 and results["queued"][0] == 200
        assert json.loads(results["running"][2])["choices"] == json.loads(results["queued"][2])["choices"]
        assert http("GET", url + "/health")[0] == 200


def test_a_client_leaving_mid_stream_frees_its_row():
    engine = tiny_engine(max_seqs=1, max_queue=4)
    gate = threading.Event()
    gate.set()
    gate_steps(engine, gate, delay=0.02)
    with serve_in_thread(engine) as url:
        port = int(url.rsplit(":", 1)[1])
        payload = json.dumps({"prompt": "hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                              "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        received = b""
        while b"data: " not in received:  # the stream has begun
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        wait_until(lambda: engine.running == 1)
        req = engine.active[0]
        sock.close()
        wait_until(lambda: req.finished)
        assert req.finish_reason == "abort" and len(req.output_ids) < 60
        wait_until(lambda: engine.running == 0)
        status, _, text = http("POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200, text  # the row is free for the next client


def test_a_failed_step_fails_its_requests_and_a_dead_engine_fails_health():
    """A model error while running requests fails those requests (a 500 each; issue 35: it once stopped the
    engine for every client); an error outside any request stops the engine: then /health is a 503."""
    engine = tiny_engine(max_seqs=2, max_queue=4)

    def broken(*args):
        raise RuntimeError("simulated device failure")

    engine.runner.forward = broken
    with serve_in_thread(engine) as url:
        assert http("GET", url + "/health")[0] == 200
        status, _, text = http("POST", url + "/v1/completions", {"prompt": "hello", "max_tokens": 5})
        error = json.loads(text)["error"]
        assert status == 500 and error["code"] == "generation_failed" and "simulated device failure" in error["message"]
        assert http("GET", url + "/health")[0] == 200 and engine.alive
        del engine.runner.forward  # the device recovers: the engine served on
        assert http("POST", url + "/v1/completions", {"prompt": "hello", "max_tokens": 5})[0] == 200
        engine.runner.idle = broken  # an error outside any request: the engine loop stops
        wait_until(lambda: not engine.alive)
        status, _, text = http("GET", url + "/health")
        assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead"
        status, _, text = http("POST", url + "/v1/completions", {"prompt": "hello", "max_tokens": 5})
        assert status == 503 and json.loads(text)["error"]["code"] == "engine_dead"
        assert http("GET", url + "/v1/models")[0] == 200  # the HTTP layer itself lives on


def test_sigterm_drains_open_requests_then_exits(tmp_path):
    ckpt = save_gpt_checkpoint(tmp_path / "ckpt")
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "1")
    body = {"prompt": "drain", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    results = [None] * 16

    def ask(i):
        results[i] = http("POST", server.url + "/v1/completions", body, timeout=120)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    pending = sum(r is None for r in results)
    assert server.stop(timeout=120) == 0, "".join(server.stderr)[-3000:]
    for t in threads:
        t.join(60)
    assert pending > 0  # SIGTERM came while requests were open
    assert [r[0] for r in results] == [200] * 16
    assert {json.loads(r[2])["usage"]["completion_tokens"] for r in results} == {60}
    with pytest.raises(OSError):
        http("GET", server.url + "/health", timeout=2)


def test_serve_without_fastapi_is_one_error_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    one_error_line(["serve", "--checkpoint", str(tmp_path)], "pip install 'meshlm[serve]'")


@pytest.mark.parametrize("argv,words", [
    (["--port", "70000"], ["--port"]),
    (["--max-seqs", "0"], ["--max-seqs"]),
    (["--train.lr=1"], ["--parallel.tp"]),
    (["--parallel.tp=x"], ["--parallel.tp"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--num-blocks", "0"], ["--num-blocks"]),
    (["--max-batched-tokens", "-1"], ["--max-batched-tokens"]),
    (["--speculative", "draft"], ["--draft-checkpoint"]),
    (["--speculative", "ngram", "--num-draft-tokens", "0"], ["--num-draft-tokens"]),
])
def test_serve_argument_errors(tmp_path, argv, words):
    one_error_line(["serve", "--checkpoint", str(tmp_path), *argv], *words)


def test_serve_kv_cache_bounds_are_checked(tmp_path):
    ckpt = save_gpt_checkpoint(tmp_path / "ckpt")  # learned positions, model.seq_len 64
    one_error_line(["serve", "--checkpoint", str(ckpt), "--max-len", "65"], "--max-len 65", "model.seq_len=64")
    one_error_line(["serve", "--checkpoint", str(ckpt), "--max-seqs", "100000000"], "KV cache", "--max-seqs")


def test_serve_missing_checkpoint(tmp_path):
    one_error_line(["serve", "--checkpoint", str(tmp_path / "none"), "--port", str(free_port())], "no checkpoint")


def test_importing_meshlm_does_not_import_the_server_dependencies():
    import subprocess

    code = ("import sys, meshlm, meshlm.cli, meshlm.infer.engine, meshlm.infer.server; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
