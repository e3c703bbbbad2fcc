"""`meshlm serve` as a real process on a loopback port, spoken to with the official openai client and raw HTTP."""

import json
import threading

import openai
import pytest
import torch
import torch.nn.functional as F

from meshlm.models.generate import generate
from tests.checkpoint_helpers import load_run
from tests.infer.server_helpers import ServeProcess, http, save_bert_checkpoint, save_gpt_checkpoint

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """(server, model, tokenizer): a tiny random GPT served with 8 cache rows and a queue of 64."""
    ckpt = save_gpt_checkpoint(tmp_path_factory.mktemp("gpt") / "tiny-gpt")
    server = ServeProcess("--checkpoint", str(ckpt), "--max-seqs", "8", "--max-queue", "64")
    model, tokenizer, _ = load_run(str(ckpt))
    yield server, model, tokenizer
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny random BERT served with an API key."""
    ckpt = save_bert_checkpoint(tmp_path_factory.mktemp("bert") / "tiny-bert")
    server = ServeProcess("--checkpoint", str(ckpt), api_key=KEY)
    yield server, ckpt
    assert server.stop() == 0, "".join(server.stderr)[-3000:]


def client(server, key="unused"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def greedy_alone(model, tokenizer, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt)
    out = generate(model, torch.tensor([ids]), n, temperature=0)[0, len(ids):].tolist()
    if tokenizer.eod_id in out:
        out = out[:out.index(tokenizer.eod_id)]
    return tokenizer.decode(out)


def test_models_and_completions_with_the_openai_client(gpt):
    server, model, tokenizer = gpt
    c = client(server)
    models = c.models.list().data
    assert [m.id for m in models] == ["tiny-gpt"]
    out = c.completions.create(model="tiny-gpt", prompt="ROMEO. But soft", max_tokens=12, temperature=0)
    assert out.choices[0].text == greedy_alone(model, tokenizer, "ROMEO. But soft", 12)
    assert out.usage.prompt_tokens == len(tokenizer.encode("ROMEO. But soft"))
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    two = c.completions.create(model="tiny-gpt", prompt=["a b c", "Hello"], max_tokens=5, temperature=0)
    assert [ch.text for ch in two.choices] == [greedy_alone(model, tokenizer, p, 5) for p in ("a b c", "Hello")]
    seeded = [c.completions.create(model="tiny-gpt", prompt="x", max_tokens=10, temperature=1.0, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_completion_logprobs_and_echo_equal_a_full_forward(gpt):
    server, model, tokenizer = gpt
    out = client(server).completions.create(model="tiny-gpt", prompt="To be or not", max_tokens=6, temperature=0,
                                            logprobs=3, echo=True)
    choice = out.choices[0]
    prompt_ids = tokenizer.encode("To be or not")
    lp = choice.logprobs
    ids = prompt_ids + [tokenizer.encode(t)[0] for t in lp.tokens[len(prompt_ids):]]
    assert choice.text == tokenizer.decode(ids)
    with torch.no_grad():
        full = F.log_softmax(model(torch.tensor([ids]))[0], -1)
    expected = full[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), expected, atol=1e-4, rtol=1e-4)
    for pos, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) == 3 and max(top.values()) == pytest.approx(float(full[pos].max()), abs=1e-4)


def test_scoring_a_prompt_with_echo_and_no_new_tokens(gpt):
    """What evaluation harnesses send for log-likelihoods: max_tokens 0, echo, logprobs 0."""
    server, model, tokenizer = gpt
    text = "Now is the winter of our discontent"
    status, _, body = http("POST", server.url + "/v1/completions",
                           {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    ids = tokenizer.encode(text)
    assert choice["text"] == text and choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    with torch.no_grad():
        full = F.log_softmax(model(torch.tensor([ids]))[0], -1)
    expected = full[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"][1:]), expected, atol=1e-4,
                               rtol=1e-4)
    assert json.loads(body)["usage"]["completion_tokens"] == 0


def test_streaming_completion_and_chat(gpt):
    server, model, tokenizer = gpt
    c = client(server)
    whole = c.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=10, temperature=0).choices[0].text
    chunks = list(c.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=10, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    counted = list(c.completions.create(model="tiny-gpt", prompt="Hello", max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    assert counted[-1].choices == [] and counted[-1].usage.completion_tokens == 10
    assert "".join(ch.choices[0].text for ch in counted[:-1]) == whole

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who are you?"}]
    reply = c.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=8, temperature=0)
    from meshlm.infer.protocol import CHAT_STOP, chat_prompt

    expected = greedy_alone(model, tokenizer, chat_prompt(messages), 8).split(CHAT_STOP)[0]
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == expected
    stream = list(c.chat.completions.create(model="tiny-gpt", messages=messages, max_tokens=8, temperature=0,
                                            stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == expected
    assert stream[-1].choices[0].finish_reason in ("length", "stop")
    status, headers, body = http("POST", server.url + "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 3, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_32_concurrent_clients_equal_each_request_alone(gpt):
    server, _, _ = gpt
    prompts = [f"Client {i} says: " + "la " * (i % 7) for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    results, errors = [None] * 32, []

    def ask(i):
        try:
            results[i] = client(server).completions.create(model="tiny-gpt", prompt=prompts[i], max_tokens=lengths[i],
                                                           temperature=0).choices[0].text
        except Exception as err:  # noqa: BLE001 -- reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    c = client(server)
    for i in range(32):
        alone = c.completions.create(model="tiny-gpt", prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        assert results[i] == alone.choices[0].text, i


def test_megatron_api(gpt):
    server, model, tokenizer = gpt
    status, _, body = http("PUT", server.url + "/api", {"prompts": ["Hello world", "The"], "tokens_to_generate": 5,
                                                        "top_k": 1, "logprobs": True})
    assert status == 200, body
    out = json.loads(body)
    assert out["text"] == [p + greedy_alone(model, tokenizer, p, 5) for p in ("Hello world", "The")]
    assert len(out["logprobs"][0]) == len(tokenizer.encode("Hello world")) - 1 + 5
    assert "".join(out["segments"][1]) == out["text"][1]


def error_of(status, body) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    return err


BAD = [
    ("malformed JSON", "/v1/completions", None, b'{"prompt": "a", '),
    ("not an object", "/v1/completions", [1, 2], None),
    ("unknown field", "/v1/completions", {"prompt": "a", "max_tokenz": 3}, None),
    ("wrong type", "/v1/completions", {"prompt": "a", "max_tokens": "3"}, None),
    ("wrong type bool", "/v1/completions", {"prompt": "a", "stream": "yes"}, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, None),
    ("prompt too long", "/v1/completions", {"prompt": "word " * 100, "max_tokens": 1}, None),
    ("max_tokens zero", "/v1/completions", {"prompt": "a", "max_tokens": 0}, None),
    ("max_tokens negative", "/v1/completions", {"prompt": "a", "max_tokens": -5}, None),
    ("max_tokens past context", "/v1/completions", {"prompt": "a", "max_tokens": 64}, None),
    ("temperature negative", "/v1/completions", {"prompt": "a", "temperature": -1}, None),
    ("top_p zero", "/v1/completions", {"prompt": "a", "top_p": 0}, None),
    ("n > 128", "/v1/completions", {"prompt": "a", "n": 129}, None),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999999]}, None),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None),
    ("chat no messages", "/v1/chat/completions", {"messages": []}, None),
    ("embeddings on a decoder", "/v1/embeddings", {"input": "x"}, None),
    ("megatron unknown field", "/api", {"prompts": ["a"], "beam": 2}, None),
    ("megatron wrong type", "/api", {"prompts": "a"}, None),
]


@pytest.mark.parametrize("name,path,body,raw", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_openai_error_and_the_server_lives(gpt, name, path, body, raw):
    server = gpt[0]
    method = "PUT" if path == "/api" else "POST"
    status, _, text = http(method, server.url + path, body, raw=raw)
    assert status == 400, (status, text)
    error_of(status, text)
    assert http("GET", server.url + "/health")[0] == 200


def test_unknown_model_route_and_method(gpt):
    server = gpt[0]
    status, _, text = http("POST", server.url + "/v1/completions", {"prompt": "a", "model": "gpt-4"})
    assert status == 404 and error_of(status, text)["code"] == "model_not_found"
    status, _, text = http("GET", server.url + "/v1/nothing")
    assert status == 404 and error_of(status, text)
    status, _, text = http("GET", server.url + "/v1/completions")
    assert status == 405 and error_of(status, text)


def test_metrics_count_requests_tokens_and_latency(gpt):
    server = gpt[0]
    client(server).completions.create(model="tiny-gpt", prompt="metrics", max_tokens=4, temperature=0)
    status, headers, text = http("GET", server.url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["meshlm_generation_tokens_total"] >= 4 and values["meshlm_prompt_tokens_total"] >= 1
    assert values["meshlm_queue_length"] == 0 and values["meshlm_engine_alive"] == 1
    assert values["meshlm_time_to_first_token_seconds_count"] >= 1
    assert values['meshlm_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        values["meshlm_time_to_first_token_seconds_count"]
    assert values["meshlm_time_per_output_token_seconds_count"] >= 1
    assert values['meshlm_http_requests_total{path="/v1/completions",code="200"}'] >= 1


def test_embeddings_with_the_openai_client_and_the_api_key(bert):
    server, ckpt = bert
    from meshlm.infer.embed import embed_ids, tokenize

    texts = ["A man is eating food.", "Two men pushed carts through the woods.", "short"]
    out = client(server, KEY).embeddings.create(model="tiny-bert", input=texts)  # the client asks for base64
    got = torch.tensor([d.embedding for d in out.data])
    model, tok, _ = load_run(str(ckpt))
    expected = embed_ids(model, tokenize(tok, texts, 32, 32, False), tok.special_ids["pad"], 32, "mean", True)
    torch.testing.assert_close(got, torch.from_numpy(expected), atol=1e-5, rtol=1e-5)
    floats = client(server, KEY).embeddings.create(model="tiny-bert", input="short", encoding_format="float")
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), got[2], atol=1e-5, rtol=1e-5)

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
                             ("POST", "/v1/embeddings")):
            status, _, text = http(method, server.url + path, {"input": "x"} if method == "POST" else None, headers)
            assert status == 401 and error_of(status, text)["type"] == "authentication_error", (headers, path)
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").embeddings.create(model="tiny-bert", input="x")
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, text = http("POST", server.url + "/v1/embeddings", {"input": "word " * 40}, auth)
    assert status == 400 and error_of(status, text)["param"] == "input"
    status, _, text = http("POST", server.url + "/v1/completions", {"prompt": "x"}, auth)
    assert status == 400 and "embeddings" in error_of(status, text)["message"]


def test_embedding_token_ids_out_of_range_are_a_400(bert):
    """Issue 35: ids outside the vocabulary once reached the embedding table (a 500)."""
    server, _ = bert
    auth = {"Authorization": f"Bearer {KEY}"}
    for ids in ([[-1, 5]], [[5, 30522]], [2 ** 40]):
        status, _, text = http("POST", server.url + "/v1/embeddings", {"input": ids}, auth)
        assert status == 400 and error_of(status, text)["param"] == "input", (ids, text)
    assert http("GET", server.url + "/health", headers=auth)[0] == 200


def test_a_failed_request_is_a_500_of_its_own_and_a_stopped_engine_a_503():
    """Issue 35: a request the engine failed while it serves on is that request's 500, not the 503 of a dead
    engine."""
    from types import SimpleNamespace

    from meshlm.infer.routes import engine_failure

    failed = SimpleNamespace(finish_reason="error", error="RuntimeError: boom")
    done = SimpleNamespace(finish_reason="length", error=None)
    alive = SimpleNamespace(engine=SimpleNamespace(dead=None))
    dead = SimpleNamespace(engine=SimpleNamespace(dead="RuntimeError: boom"))
    assert engine_failure(alive, [done]) is None
    err = engine_failure(alive, [done, failed])
    assert err.status == 500 and err.code == "generation_failed" and "boom" in err.message
    assert engine_failure(dead, [failed]).status == 503
