"""The fourth reliability round's serving cases (issue 48, item 4; docs/reliability.md, "Round 4").

One client could starve the server: a completion with more prompts than `--max-queue` was a 429 after its first
prompts had filled the queue, so another client's ordinary requests failed too. Now one request's prompts are
queued all or none, more than one client may ever queue is a 400 (never a retryable 429), and each client (the
peer address) holds at most half of the queue. Clients are told apart by binding the test's sockets to
127.0.0.1 and 127.0.0.2 (both loopback on Linux). Also: `stream_options` without `stream`, `max_tokens` 10^12,
and `meshlm serve --num-blocks 1`.
"""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from tests.infer.server_helpers import save_gpt_checkpoint
from tests.infer.test_server_load import gate_steps, serve_in_thread, tiny_engine, wait_until
from tests.interop.interop_helpers import one_error_line

ORDINARY = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


def post(url: str, body: dict, source: str = "127.0.0.1", path: str = "/v1/completions") -> tuple[int, dict]:
    """(status, JSON body) of a POST sent from the loopback address `source` (the client the server sees)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def in_thread(results: list, *args) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(post(*args)), daemon=True)
    thread.start()
    return thread


def test_more_prompts_than_one_client_may_queue_is_a_400_and_queues_nothing():
    """400 prompts against a queue of 8 (issue 48: a 429 after 256 of them were queued), and 5 (more than a
    client's half of it): 400 naming `prompt` and --max-queue, nothing queued; the server serves on."""
    engine = tiny_engine(max_seqs=1, max_queue=8)
    with serve_in_thread(engine) as url:
        for count in (400, 9, 5):
            status, body = post(url, {"prompt": ["x"] * count, "max_tokens": 1})
            assert status == 400, body
            assert body["error"]["param"] == "prompt" and "--max-queue 8" in body["error"]["message"]
            assert engine.next_id == 0 and engine.queue_length == 0  # not one of them was queued
        status, body = post(url, {**ORDINARY, "prompt": ["x"] * 4})  # a client's share: accepted
        assert status == 200 and len(body["choices"]) == 4


def test_a_request_larger_than_the_room_left_is_a_429_and_queues_nothing():
    """A queue of 4 (2 per client), one row, steps held: the room left decides, and nothing of a refused request
    enters the queue (it used to queue the prompts that fit, then cancel them: they held their places)."""
    engine = tiny_engine(max_seqs=1, max_queue=4)
    gate = threading.Event()
    gate_steps(engine, gate)
    results: list = []
    with serve_in_thread(engine) as url:
        threads = [in_thread(results, url, ORDINARY, "127.0.0.2")]
        wait_until(lambda: engine.running == 1)
        threads.append(in_thread(results, url, {**ORDINARY, "prompt": ["a", "b"]}, "127.0.0.2"))
        wait_until(lambda: engine.queue_length == 2)
        threads.append(in_thread(results, url, ORDINARY, "127.0.0.1"))
        wait_until(lambda: engine.queue_length == 3)
        for prompts, source, why in ((["c", "d"], "127.0.0.1", "room for 1 of this request's 2"),  # 1 place left
                                     (["c"], "127.0.0.2", "this client has 2 requests waiting")):  # its share: full
            status, body = post(url, {**ORDINARY, "prompt": prompts}, source)
            assert status == 429 and body["error"]["code"] == "queue_full" and why in body["error"]["message"], body
            assert engine.queue_length == 3 and engine.next_id == 4
        gate.set()
        for t in threads:
            t.join(60)
    assert sorted(status for status, _ in results) == [200, 200, 200]


def test_one_client_cannot_take_the_whole_queue():
    """127.0.0.1 sends requests until it is refused: it holds half the queue (4 of 8), and 127.0.0.2's request
    is still queued and answered (before, the first client filled all 8 places and the second got a 429)."""
    engine = tiny_engine(max_seqs=1, max_queue=8)
    gate = threading.Event()
    gate_steps(engine, gate)
    results: list = []
    with serve_in_thread(engine) as url:
        threads = []
        for i in range(9):
            threads.append(in_thread(results, url, ORDINARY, "127.0.0.1"))
            wait_until(lambda n=i + 1: len(results) + engine.queue_length + engine.running == n)
        assert engine.running == 1 and engine.queue_length == 4
        assert [(status, body["error"]["code"]) for status, body in results] == [(429, "queue_full")] * 4
        other: list = []
        threads.append(in_thread(other, url, ORDINARY, "127.0.0.2"))
        wait_until(lambda: engine.queue_length == 5)
        gate.set()
        for t in threads:
            t.join(60)
    assert other[0][0] == 200 and other[0][1]["choices"][0]["text"] == results[-1][1]["choices"][0]["text"]


def test_ordinary_requests_succeed_while_another_client_loops_oversized_requests():
    """The issue's probe: one client loops requests of more prompts than the queue holds while another sends
    ordinary requests: every ordinary one is answered (34 of 39 were 429s), every oversized one is a 400."""
    engine = tiny_engine(max_seqs=2, max_queue=8)
    stop, flood = threading.Event(), []

    def loop():
        while not stop.is_set():
            flood.append(post(url, {"prompt": ["x"] * 9, "max_tokens": 1}, "127.0.0.1")[0])

    with serve_in_thread(engine) as url:
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            wait_until(lambda: len(flood) >= 3)
            statuses = [post(url, ORDINARY, "127.0.0.2")[0] for _ in range(10)]
        finally:
            stop.set()
            thread.join(60)
    assert statuses == [200] * 10 and flood and set(flood) == {400}


def test_stream_options_without_stream_and_a_huge_max_tokens_are_400s_naming_the_field():
    """OpenAI answers `stream_options` without `stream: true` with a 400; max_tokens 10^12 names the model's
    context (it said "raise --num-blocks", which no pool could satisfy)."""
    engine = tiny_engine(max_seqs=1, max_queue=4)  # model.seq_len 64
    with serve_in_thread(engine) as url:
        for path, body in (("/v1/completions", ORDINARY),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})):
            status, out = post(url, {**body, "stream_options": {"include_usage": True}}, path=path)
            assert status == 400 and out["error"]["param"] == "stream_options", out
            assert "stream" in out["error"]["message"]
            status, out = post(url, {**body, "stream": False, "stream_options": None}, path=path)
            assert status == 200, out
        status, out = post(url, {**ORDINARY, "max_tokens": 10 ** 12})
        message = out["error"]["message"]
        assert status == 400 and out["error"]["param"] == "max_tokens", out
        assert "context of 64 tokens" in message and "num-blocks" not in message
        assert engine.next_id == 2


@pytest.mark.parametrize("argv,words", [
    (["--num-blocks", "1"], ["--num-blocks 1", "--max-len 64", "4 blocks", "at least 4"]),
    (["--num-blocks", "3", "--block-size", "8", "--max-len", "32"], ["--num-blocks 3", "--max-len 32", "at least 4"]),
])
def test_serve_refuses_a_pool_smaller_than_one_sequence(tmp_path, argv, words):
    """`meshlm serve --num-blocks 1` started silently, and every request longer than 16 positions was then
    refused; now one line names both numbers and the fix, before the model is loaded."""
    ckpt = save_gpt_checkpoint(tmp_path / "ckpt")  # model.seq_len 64, block size 16
    one_error_line(["serve", "--checkpoint", str(ckpt), *argv], *words)
