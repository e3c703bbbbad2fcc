"""Serving under hostile input (issue 35): no request stops the server for the others.

One `meshlm serve` process (module-scoped) takes every request of a hostile set: extreme floats, NaN and
infinities (as JSON's NaN/Infinity tokens, which Python's json reads, and as strings), a body over the size
limit, deeply nested JSON, wrong types, negative and huge integers, empty and missing fields. After EACH one,
`/health` must answer 200 and a normal greedy request must still give the answer it gave before the set.
The command-line checks of `meshlm serve` are here too. docs/reliability.md lists the cases.
"""

from __future__ import annotations

import http.client as httpclient
import json

import pytest

from meshlm.cli import main
from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

LIMIT = 100_000  # the server's --max-body-bytes here (small, so that an over-limit body is quick to send)
NORMAL = {"prompt": "ROMEO. But soft", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, the normal request's answer before any hostile request)."""
    ckpt = save_gpt_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny-gpt")
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "4", "--max-body-bytes", str(LIMIT))
    status, _, body = http("POST", server.url + "/v1/completions", NORMAL)
    assert status == 200, body
    yield server, json.loads(body)["choices"][0]["text"]
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def raw(obj) -> bytes:
    """JSON as Python writes it: float nan/inf become the tokens NaN, Infinity, -Infinity."""
    return json.dumps(obj).encode()


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


C, CHAT, API, RESP = "/v1/completions", "/v1/chat/completions", "/api", "/v1/responses"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAN, INF = float("nan"), float("inf")
# (name, path, body bytes, the status expected, the param the error names (or None))
HOSTILE = [
    # extreme floats: the tiny temperatures once stopped the engine for everyone (division overflow, NaN)
    ("temperature 1e-300", C, raw({**NORMAL, "temperature": 1e-300}), 200, None),
    ("temperature 1e-38", C, raw({**NORMAL, "temperature": 1e-38}), 200, None),
    ("temperature 5e-324", C, raw({**NORMAL, "temperature": 5e-324}), 200, None),
    ("temperature 1e-300 top_p top_k", C, raw({**NORMAL, "temperature": 1e-300, "top_p": 0.5, "top_k": 3}), 200,
     None),
    ("temperature 1e308", C, raw({**NORMAL, "temperature": 1e308}), 200, None),
    ("temperature -0.0", C, raw({**NORMAL, "temperature": -0.0}), 200, None),
    ("top_p 1e-300", C, raw({**NORMAL, "temperature": 1.0, "top_p": 1e-300}), 200, None),
    ("repetition_penalty 1e-300", C, raw({**NORMAL, "temperature": 0.5, "repetition_penalty": 1e-300}), 200, None),
    ("repetition_penalty 1e308", C, raw({**NORMAL, "temperature": 0.5, "repetition_penalty": 1e308}), 200, None),
    ("chat temperature 1e-300", CHAT, raw({"messages": MSG, "max_tokens": 4, "temperature": 1e-300}), 200, None),
    ("megatron temperature 1e-300", API, raw({"prompts": ["a"], "tokens_to_generate": 4, "temperature": 1e-300}),
     200, None),
    ("temperature NaN", C, raw({**NORMAL, "temperature": NAN}), 400, "temperature"),
    ("temperature Infinity", C, raw({**NORMAL, "temperature": INF}), 400, "temperature"),
    ("temperature -Infinity", C, raw({**NORMAL, "temperature": -INF}), 400, "temperature"),
    ("temperature 'NaN' string", C, raw({**NORMAL, "temperature": "NaN"}), 400, "temperature"),
    ("temperature 'Infinity' string", C, raw({**NORMAL, "temperature": "Infinity"}), 400, "temperature"),
    ("temperature 1e400 (inf)", C, b'{"prompt": "a", "temperature": 1e400}', 400, "temperature"),
    ("temperature 400-digit integer", C, b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", 400,
     "temperature"),
    ("temperature negative", C, raw({**NORMAL, "temperature": -1e-300}), 400, "temperature"),
    ("top_p NaN", C, raw({**NORMAL, "top_p": NAN}), 400, "top_p"),
    ("top_p above 1", C, raw({**NORMAL, "top_p": 1.0000001}), 400, "top_p"),
    ("top_p -0.0", C, raw({**NORMAL, "top_p": -0.0}), 400, "top_p"),
    ("top_k negative", C, raw({**NORMAL, "top_k": -1}), 400, "top_k"),
    ("top_k float", C, raw({**NORMAL, "top_k": 2.5}), 400, "top_k"),
    ("presence_penalty 1e308", C, raw({**NORMAL, "presence_penalty": 1e308}), 400, "presence_penalty"),
    ("frequency_penalty Infinity", C, raw({**NORMAL, "frequency_penalty": INF}), 400, "frequency_penalty"),
    ("repetition_penalty 0", C, raw({**NORMAL, "repetition_penalty": 0}), 400, "repetition_penalty"),
    ("repetition_penalty NaN", C, raw({**NORMAL, "repetition_penalty": NAN}), 400, "repetition_penalty"),
    # negative, zero and huge integers
    ("max_tokens huge", C, raw({**NORMAL, "max_tokens": 10 ** 30}), 400, "max_tokens"),
    ("max_tokens 2^63", C, raw({**NORMAL, "max_tokens": 2 ** 63}), 400, "max_tokens"),
    ("max_tokens negative", C, raw({**NORMAL, "max_tokens": -1}), 400, "max_tokens"),
    ("max_tokens 1e308 float", C, raw({**NORMAL, "max_tokens": 1e308}), 400, "max_tokens"),
    ("5000-digit integer", C, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("seed negative", C, raw({**NORMAL, "seed": -1}), 400, "seed"),
    ("seed 2^64", C, raw({**NORMAL, "seed": 2 ** 64}), 400, "seed"),
    ("n zero", C, raw({**NORMAL, "n": 0}), 400, "n"),
    ("n huge", C, raw({**NORMAL, "n": 10 ** 30}), 400, "n"),
    ("logprobs negative", C, raw({**NORMAL, "logprobs": -1}), 400, "logprobs"),
    ("logprobs huge", C, raw({**NORMAL, "logprobs": 10 ** 30}), 400, "logprobs"),
    ("stop_token_ids -1", C, raw({**NORMAL, "stop_token_ids": [-1]}), 400, "stop_token_ids"),
    ("stop_token_ids vocab size", C, raw({**NORMAL, "stop_token_ids": [50257]}), 400, "stop_token_ids"),
    ("stop_token_ids huge", C, raw({**NORMAL, "stop_token_ids": [10 ** 30]}), 400, "stop_token_ids"),
    ("stop_token_ids float", C, raw({**NORMAL, "stop_token_ids": [1.5]}), 400, "stop_token_ids"),
    ("prompt ids negative", C, raw({**NORMAL, "prompt": [-1]}), 400, "prompt"),
    ("prompt ids huge", C, raw({**NORMAL, "prompt": [[1, 2 ** 64]]}), 400, "prompt"),
    # wrong types, empty and missing fields
    ("prompt missing", C, raw({"max_tokens": 3}), 400, "prompt"),
    ("prompt null", C, raw({"prompt": None}), 400, "prompt"),
    ("prompt empty", C, raw({"prompt": ""}), 400, "prompt"),
    ("prompt empty list", C, raw({"prompt": []}), 400, "prompt"),
    ("prompt empty id list", C, raw({"prompt": [[]]}), 400, "prompt"),
    ("prompt number", C, raw({"prompt": 1e308}), 400, "prompt"),
    ("prompt object", C, raw({"prompt": {"a": 1}}), 400, "prompt"),
    ("stream string", C, raw({**NORMAL, "stream": "yes"}), 400, "stream"),
    ("stream_options.include_usage string", C, raw({**NORMAL, "stream": True,
                                                           "stream_options": {"include_usage": "no"}}), 400,
     "stream_options"),
    ("model number", C, raw({**NORMAL, "model": 5}), 400, "model"),
    ("echo number", C, raw({**NORMAL, "echo": 1}), 400, "echo"),
    ("stop empty string", C, raw({**NORMAL, "stop": [""]}), 400, "stop"),
    ("chat messages string", CHAT, raw({"messages": "hi"}), 400, "messages"),
    ("chat message content number", CHAT, raw({"messages": [{"role": "user", "content": 1e308}]}), 400,
     "messages"),
    ("chat message name number", CHAT, raw({"messages": [{"role": "user", "content": "a", "name": 5}]}), 400,
     "messages"),
    ("chat top_logprobs huge", CHAT, raw({"messages": MSG, "logprobs": True, "top_logprobs": 10 ** 30}), 400,
     "top_logprobs"),
    ("chat max_completion_tokens negative", CHAT, raw({"messages": MSG, "max_completion_tokens": -5}), 400,
     "max_completion_tokens"),
    ("megatron random_seed negative", API, raw({"prompts": ["a"], "random_seed": -1}), 400, "random_seed"),
    ("megatron random_seed 2^64", API, raw({"prompts": ["a"], "random_seed": 2 ** 64}), 400, "random_seed"),
    ("megatron stop_token -1", API, raw({"prompts": ["a"], "stop_token": -1}), 400, "stop_token"),
    ("megatron top_p_decay negative", API, raw({"prompts": ["a"], "top_p": 0.5, "top_p_decay": -1}), 400,
     "top_p_decay"),
    ("megatron top_p_bound 2", API, raw({"prompts": ["a"], "top_p": 0.5, "top_p_bound": 2}), 400, "top_p_bound"),
    ("megatron tokens_to_generate huge", API, raw({"prompts": ["a"], "tokens_to_generate": 10 ** 30}), 400,
     "tokens_to_generate"),
    ("megatron temperature NaN", API, raw({"prompts": ["a"], "temperature": NAN}), 400, "temperature"),
    ("megatron prompts empty", API, raw({"prompts": []}), 400, "prompts"),
    # bodies that are not a request: nested, not JSON, not an object, too large
    ("nested array 40000 deep", C, nested(40_000).encode(), 400, None),
    ("nested object 15000 deep", C, ('{"a":' * 15_000 + "1" + "}" * 15_000).encode(), 400, None),
    ("nested field 900 deep", C, ('{"prompt": "a", "max_tokens": ' + nested(900) + "}").encode(), 400,
     "max_tokens"),
    ("nested prompt 900 deep", C, ('{"prompt": ' + nested(900) + "}").encode(), 400, "prompt"),
    ("nested chat message 900 deep", CHAT, ('{"messages": ' + nested(900, '{"role": "user"}') + "}").encode(), 400,
     "messages"),
    ("body NaN", C, b"NaN", 400, None),
    ("body null", C, b"null", 400, None),
    ("body empty", C, b"", 400, None),
    ("body not UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("body truncated", C, b'{"prompt": "a", ', 400, None),
    ("body over the limit", C, raw({"prompt": "word " * (LIMIT // 5 + 10)}), 413, None),
    # tools, tool_choice and messages of the agent-facing API (issue 44)
    ("tools not a list", CHAT, raw({"messages": MSG, "tools": "weather"}), 400, "tools"),
    ("tool without a name", CHAT, raw({"messages": MSG, "tools": [{"type": "function", "function": {
        "parameters": {"type": "object"}}}]}), 400, "tools"),
    ("tool parameters not an object", CHAT, raw({"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": [1, 2]}}]}), 400, "tools"),
    ("tool parameters 900 deep", CHAT, ('{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
                                        '"function", "function": {"name": "f", "parameters": ' +
                                        nested(900, "{}") + "}}]}").encode(), 400, "tools"),
    ("tool_choice unknown word", CHAT, raw({"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}), 400,
     "tool_choice"),
    ("tool_choice unknown function", CHAT, raw({"messages": MSG, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}), 400, "tool_choice"),
    ("tool_choice without tools", CHAT, raw({"messages": MSG, "tool_choice": "required"}), 400, "tool_choice"),
    ("tool message without tool_call_id", CHAT, raw({"messages": [*MSG, {"role": "tool", "content": "sunny"}]}), 400,
     "messages"),
    ("assistant tool_calls arguments not JSON", CHAT, raw({"messages": [*MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}), 400, "messages"),
    ("content part an image", CHAT, raw({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400, "messages"),
    ("content part without text", CHAT, raw({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), 400,
     "messages"),
    # the Responses API and the operations endpoints
    ("responses input a number", RESP, raw({"input": 5}), 400, "input"),
    ("responses previous_response_id", RESP, raw({"input": "hi", "previous_response_id": "resp_1"}), 400,
     "previous_response_id"),
    ("responses max_output_tokens 0", RESP, raw({"input": "hi", "max_output_tokens": 0}), 400, "max_output_tokens"),
    ("responses temperature NaN", RESP, raw({"input": "hi", "temperature": NAN}), 400, "temperature"),
    ("responses input item unknown type", RESP, raw({"input": [{"type": "telepathy", "content": "x"}]}), 400,
     "input"),
    ("tokenize neither prompt nor messages", "/tokenize", raw({}), 400, "prompt"),
    ("detokenize a negative id", "/detokenize", raw({"tokens": [-1]}), 400, "tokens"),
    ("detokenize an id past the vocabulary", "/detokenize", raw({"tokens": [10 ** 12]}), 400, "tokens"),
]


def check_still_serving(server, normal: str) -> None:
    assert http("GET", server.url + "/health")[0] == 200
    status, _, body = http("POST", server.url + "/v1/completions", NORMAL)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["text"] == normal


@pytest.mark.parametrize("name,path,body,expected,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_is_answered_and_the_server_serves_on(served, name, path, body, expected, param):
    server, normal = served
    status, _, text = http("PUT" if path == API else "POST", server.url + path, raw=body)
    assert status == expected, (status, text[:500])
    if expected != 200:
        error = json.loads(text)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", error
        assert error["param"] == param, error
    elif "temperature" in name and "1e-300" in name and path == C and "top_p" not in name:
        assert json.loads(text)["choices"][0]["text"] == normal  # a vanishing temperature decodes greedily
    check_still_serving(server, normal)


def test_a_declared_50_mb_body_is_refused_before_it_is_read(served):
    """The client declares 50 MB and sends a little of it: the 413 comes at once (nothing more is read)."""
    server, normal = served
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(50 * 2 ** 20))
    conn.endheaders(b'{"prompt": "' + b"x" * 1000)
    response = conn.getresponse()
    assert response.status == 413
    error = json.loads(response.read())["error"]
    assert "--max-body-bytes" in error["message"] and error["code"] == "request_too_large"
    conn.close()
    check_still_serving(server, normal)


def test_a_chunked_body_over_the_limit_is_refused(served):
    """Without a Content-Length (chunked transfer), reading stops at the limit."""
    server, normal = served
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = [b'{"prompt": "'] + [b"y" * 10_000] * (LIMIT // 10_000 + 2) + [b'"}']
    conn.request("POST", "/v1/completions", body=iter(chunks), headers={"Content-Type": "application/json"},
                 encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413, response.read()[:300]
    conn.close()
    check_still_serving(server, normal)


@pytest.mark.parametrize("flags", [["--drain-timeout", "-1"], ["--drain-timeout", "nan"], ["--host", "256.1.1.1"],
                                   ["--host", "1.2.3.4.5"], ["--max-body-bytes", "0"]], ids=" ".join)
def test_serve_refuses_a_negative_drain_timeout_and_a_bad_host(tmp_path, capsys, flags):
    """One line `error: ...` naming the flag, exit 2, before anything is loaded or `serving on` is printed."""
    code = main(["serve", "--checkpoint", str(tmp_path / "none"), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flags[0] in lines[0], err
    assert "http://" not in err
