"""The OpenAI API's completeness on a real `meshlm serve` (the official openai client and raw HTTP): `n` and
`best_of`, `logit_bias`, `response_format` (guided decoding), `seed`, `usage` (also streamed with n > 1), and
clients that go away (their engine requests are cancelled). Each test runs twice: the engine in the server's
process, and in a process of its own (`--engine-process`), against the same in-process reference."""

import json
import socket
import sys
import threading
import time

import httpx
import openai
import pytest

from meshlm.infer.engine import Engine, SamplingParams
from tests.checkpoint_helpers import load_run
from tests.infer.server_helpers import ServeProcess, http, save_gpt_checkpoint

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "size"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module", params=[["--no-engine-process"], ["--engine-process"]], ids=["one process", "engine process"])
def gpt(tmp_path_factory, request):
    """(server, model, tokenizer): a tiny random GPT with a context of 1024 (long enough to disconnect in the
    middle of a request) served with 8 rows, its engine in the server's process or in one of its own."""
    ckpt = save_gpt_checkpoint(tmp_path_factory.mktemp("api") / "tiny-gpt", seq_len=1024)
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "8", "--max-queue", "64", *request.param)
    model, tokenizer, _ = load_run(str(ckpt))
    yield server, model, tokenizer
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def in_process(model, tokenizer, prompt: str, params: list[SamplingParams]):
    """The requests of `params` on `prompt`, run by an engine in this process."""
    return Engine(model, tokenizer, max_seqs=8, max_len=128).generate([tokenizer.encode(prompt)] * len(params),
                                                                      params)


def error(status, body) -> dict:
    assert status == 400, (status, body)
    return json.loads(body)["error"]


# ---- n and best_of -------------------------------------------------------------------------------------------------
def test_n_choices_use_seed_plus_i_and_repeat_exactly(gpt):
    server, model, tokenizer = gpt
    c = client(server)
    out = c.completions.create(model="tiny-gpt", prompt="Once upon", max_tokens=8, n=3, seed=5, temperature=1.0)
    expected = in_process(model, tokenizer, "Once upon", [SamplingParams(max_tokens=8, seed=5 + i) for i in range(3)])
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [r.text for r in expected]
    assert len({ch.text for ch in out.choices}) > 1  # the choices differ
    again = c.completions.create(model="tiny-gpt", prompt="Once upon", max_tokens=8, n=3, seed=5, temperature=1.0)
    assert [ch.text for ch in again.choices] == [ch.text for ch in out.choices]
    # usage: the prompt once per prompt (as OpenAI and vLLM), the output tokens of every choice
    assert out.usage.prompt_tokens == len(tokenizer.encode("Once upon"))
    assert out.usage.completion_tokens == sum(len(r.output_ids) for r in expected)
    two = c.completions.create(model="tiny-gpt", prompt=["a b", "Hello"], max_tokens=4, n=2, seed=1)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in two.choices[2:]] == [r.text for r in in_process(
        model, tokenizer, "Hello", [SamplingParams(max_tokens=4, seed=1 + i) for i in range(2)])]
    assert two.usage.prompt_tokens == len(tokenizer.encode("a b")) + len(tokenizer.encode("Hello"))


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(gpt):
    server, model, tokenizer = gpt
    out = client(server).completions.create(model="tiny-gpt", prompt="The sea", max_tokens=6, n=2, best_of=5,
                                            seed=11, temperature=1.0)
    cands = in_process(model, tokenizer, "The sea",
                       [SamplingParams(max_tokens=6, seed=11 + i, logprobs=0) for i in range(5)])
    ranked = sorted(cands, key=lambda r: -sum(t.logprob for t in r.output))
    assert [ch.text for ch in out.choices] == [r.text for r in ranked[:2]]
    assert all(ch.logprobs is None for ch in out.choices)  # not asked for
    assert out.usage.completion_tokens == sum(len(r.output_ids) for r in cands)  # every candidate was generated
    with_lp = client(server).completions.create(model="tiny-gpt", prompt="The sea", max_tokens=6, n=2, best_of=5,
                                                seed=11, temperature=1.0, logprobs=1)
    assert [sum(ch.logprobs.token_logprobs) for ch in with_lp.choices] == pytest.approx(
        [sum(t.logprob for t in r.output) for r in ranked[:2]], abs=1e-4)


@pytest.mark.parametrize("body,param,says", [
    ({"prompt": "a", "n": 0}, "n", "1..128"), ({"prompt": "a", "n": 129}, "n", "1..128"),
    ({"prompt": "a", "n": 3, "best_of": 2}, "best_of", "n..20"), ({"prompt": "a", "best_of": 21}, "best_of", "n..20"),
    ({"prompt": "a", "best_of": 3, "stream": True}, "best_of", "stream"),
])
def test_bad_n_and_best_of_are_400s_naming_them(gpt, body, param, says):
    err = error(*http("POST", gpt[0].url + "/v1/completions", body)[::2])
    assert err["param"] == param and says in err["message"], err


def test_chat_n_choices_and_streamed_usage(gpt):
    server, _, _ = gpt
    c = client(server)
    messages = [{"role": "user", "content": "Say something."}]
    out = c.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=6, n=2, seed=3)
    assert [ch.index for ch in out.choices] == [0, 1]
    alone = [c.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=6, seed=3 + i)
             for i in range(2)]
    assert [ch.message.content for ch in out.choices] == [a.choices[0].message.content for a in alone]
    assert out.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    stream = list(c.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=6, n=2, seed=3,
                                            stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices and ch.choices[0].index == i)
        assert text == out.choices[i].message.content
    assert stream[-1].choices == [] and stream[-1].usage.model_dump() == out.usage.model_dump()
    streamed = list(c.completions.create(model="tiny-gpt", prompt="Hi", max_tokens=5, n=2, seed=4, stream=True,
                                         stream_options={"include_usage": True}))
    whole = c.completions.create(model="tiny-gpt", prompt="Hi", max_tokens=5, n=2, seed=4)
    for i in range(2):
        assert "".join(ch.choices[0].text for ch in streamed[:-1] if ch.choices[0].index == i) == whole.choices[i].text
    assert streamed[-1].usage.model_dump() == whole.usage.model_dump()


# ---- logit_bias ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(gpt, temperature):
    server, model, tokenizer = gpt
    c = client(server)
    x = tokenizer.encode(" x")[0]
    forced = c.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=6, temperature=temperature, seed=0,
                                  logit_bias={str(x): 100})
    assert forced.choices[0].text == " x" * 6
    chat = c.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                     temperature=temperature, seed=0, logit_bias={str(x): 100})
    assert chat.choices[0].message.content == " x" * 5
    plain = in_process(model, tokenizer, "Hello", [SamplingParams(max_tokens=6, temperature=temperature, seed=0)])[0]
    banned = {str(t): -100 for t in set(plain.output_ids)}
    out = c.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=6, temperature=temperature, seed=0,
                               logit_bias=banned, logprobs=0)
    ids = [tokenizer.encode(t)[0] for t in out.choices[0].logprobs.tokens]
    assert not set(ids) & set(plain.output_ids)


@pytest.mark.parametrize("bias,says", [({"x": 1}, "token ids"), ({"-1": 1}, "token ids"), ({"99999999": 1}, "token ids"),
                                       ({"5": 101}, "[-100, 100]"), ({"5": "1"}, "[-100, 100]"),
                                       ({"5": None}, "[-100, 100]"), ([1], "must be object")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_it(gpt, bias, says, path):
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}
    err = error(*http("POST", gpt[0].url + path, {**body, "logit_bias": bias})[::2])
    assert err["param"] == "logit_bias" and says in err["message"], err


# ---- response_format --------------------------------------------------------------------------------------------------
def follows(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"color", "size"} and value["color"] in ("red", "green", "blue")
            and isinstance(value["size"], int) and 0 <= value["size"] <= 9)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates_on_both_endpoints(gpt, temperature):
    c = client(gpt[0])
    for seed in range(3):
        out = c.completions.create(model="tiny-gpt", prompt="A thing:", max_tokens=40, temperature=temperature,
                                   seed=seed, extra_body={"response_format": FORMAT})
        assert out.choices[0].finish_reason == "stop" and follows(out.choices[0].text), out.choices[0].text
    chat = c.chat.completions.create(model="tiny-gpt", messages=[{"role": "user", "content": "Describe it."}],
                                     max_tokens=40, temperature=temperature, n=2, seed=9, response_format=FORMAT)
    for ch in chat.choices:
        assert ch.finish_reason == "stop" and follows(ch.message.content), ch.message.content


def test_json_object_is_an_object_even_against_the_bias(gpt):
    """The grammar's mask wins over logit_bias: a token pushed by +100 that the grammar refuses never comes."""
    server, _, tokenizer = gpt
    bias = {str(tokenizer.encode(t)[0]): 100 for t in ("[", "{", "}")}  # an array would come first unguided
    out = client(server).completions.create(model="tiny-gpt", prompt="JSON:", max_tokens=12, seed=0, logit_bias=bias,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text == "{}" and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt,says", [
    ({"type": "xml"}, "'json_schema'"), ("json", "must be object"), ({"type": "json_schema"}, "'name'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, "JSON Schema"),
    ({"type": "json_object", "schema": {}}, "response_format has unknown field 'schema'")])
def test_bad_response_format_is_a_400_naming_it(gpt, fmt, says):
    err = error(*http("POST", gpt[0].url + "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "a"}], "response_format": fmt})[::2])
    assert err["param"] == "response_format" and says in err["message"], err


def test_response_format_with_ignore_eos_is_a_400(gpt):
    err = error(*http("POST", gpt[0].url + "/v1/completions",
                      {"prompt": "a", "response_format": FORMAT, "ignore_eos": True})[::2])
    assert err["param"] == "response_format" and "ignore_eos" in err["message"], err


def test_response_format_without_xgrammar_names_the_extra(monkeypatch):
    from meshlm.infer import guided
    from meshlm.infer.sampling import InvalidRequest

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    with pytest.raises(InvalidRequest) as err:
        guided.compile_format(object(), 10, {"type": "json_object"})
    assert err.value.param == "response_format" and "pip install 'meshlm[guided]'" in str(err.value)
    assert guided.compile_format(object(), 10, {"type": "text"}) is None  # plain text needs nothing


# ---- seed, while other requests run ---------------------------------------------------------------------------------
def test_a_seeded_request_repeats_exactly_among_others(gpt):
    server, _, _ = gpt
    ask = {"model": "tiny-gpt", "prompt": "Seeded", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 42,
           "n": 2}
    alone = [ch.text for ch in client(server).completions.create(**ask).choices]
    assert alone[0] != alone[1]  # seed 42 and 43
    results, stop = [], threading.Event()

    def noise():
        c = client(server)
        while not stop.is_set():
            c.completions.create(model="tiny-gpt", prompt="noise " * 3, max_tokens=10, temperature=1.0)

    threads = [threading.Thread(target=noise) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            results.append([ch.text for ch in client(server).completions.create(**ask).choices])
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert results == [alone] * 3


# ---- clients that go away ----------------------------------------------------------------------------------------------
def metrics(server) -> dict:
    values = {}
    for line in http("GET", server.url + "/metrics")[2].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_idle(server) -> dict:
    for _ in range(600):
        m = metrics(server)
        if m["meshlm_running_requests"] == 0 and m["meshlm_queue_length"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError("the engine still runs requests whose clients went away")


LONG = {"prompt": "Go on", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}


def test_a_client_that_leaves_a_stream_cancels_its_requests(gpt):
    server = gpt[0]
    before = wait_idle(server)["meshlm_generation_tokens_total"]
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True, "n": 2},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    after = wait_idle(server)["meshlm_generation_tokens_total"]
    assert after - before < 2 * LONG["max_tokens"]  # cancelled, not run to the end


def test_a_non_streaming_client_that_goes_away_cancels_its_requests(gpt):
    server = gpt[0]
    before = wait_idle(server)["meshlm_generation_tokens_total"]
    body = json.dumps({**LONG, "n": 2}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(600):  # until the engine runs them
            if metrics(server)["meshlm_running_requests"] == 2:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the requests never ran")
    after = wait_idle(server)["meshlm_generation_tokens_total"]
    assert after - before < 2 * LONG["max_tokens"]
