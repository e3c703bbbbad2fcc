"""The operations endpoints of `meshlm serve` (docs/serving.md, "Operations endpoints"), named and shaped as
vLLM's so that its clients and scripts work unchanged:

* POST /tokenize: `prompt` (text), or `messages` rendered by the checkpoint's chat template (with
  `add_generation_prompt`), → {"count", "max_model_len", "tokens"} (and "token_strs" with
  `return_token_strs`); POST /detokenize: `tokens` → {"prompt"}. The tokens are exactly those the server
  runs for that prompt in /v1/completions or /v1/chat/completions.
* POST /v1/load_lora_adapter (`lora_name`, `lora_path`) and POST /v1/unload_lora_adapter (`lora_name`):
  only with `meshlm serve --allow-runtime-lora` (else a 404, as vLLM answers without its runtime-LoRA
  setting), and behind `--api-key` like every route (the app's middleware: a 401 without it). A loaded
  adapter is read and checked as `serve --adapter` reads it (`tune.export.read_adapter`: the base's shapes
  and weights' fingerprint), is listed by /v1/models and usable as `model`. Unloading an adapter that
  requests are using is refused (409, retry once they finish): a running request never changes model.
* POST /v1/score (`text_1`, `text_2`: a text and texts, or two lists of one length) and POST /rerank
  (`query`, `documents`, `top_n`), also at /score and /v1/rerank: a cross-encoder's scores of the pairs
  (`infer/score.py`), served by a BERT checkpoint with a one-label classify head.
"""

import asyncio
import time
import uuid

from meshlm.infer.protocol import BOOL, INT, REQUIRED, STR, APIError, bad, validate

TOKENIZE_SCHEMA = {"model": ((STR, "null"), None), "prompt": ((STR,), None), "messages": (("list",), None),
                   "add_special_tokens": ((BOOL, "null"), None), "add_generation_prompt": ((BOOL, "null"), None),
                   "return_token_strs": ((BOOL, "null"), None)}
DETOKENIZE_SCHEMA = {"model": ((STR, "null"), None), "tokens": (("int_list",), REQUIRED)}
LOAD_SCHEMA = {"lora_name": ((STR,), REQUIRED), "lora_path": ((STR,), REQUIRED), "load_inplace": ((BOOL,), False)}
UNLOAD_SCHEMA = {"lora_name": ((STR,), REQUIRED), "lora_int_id": ((INT, "null"), None)}
SCORE_SCHEMA = {"model": ((STR, "null"), None), "text_1": ((STR, "string_list"), REQUIRED),
                "text_2": ((STR, "string_list"), REQUIRED), "encoding_format": ((STR, "null"), None),
                "user": ((STR, "null"), None)}
RERANK_SCHEMA = {"model": ((STR, "null"), None), "query": ((STR,), REQUIRED), "documents": (("string_list",), REQUIRED),
                 "top_n": ((INT, "null"), None), "return_documents": ((BOOL, "null"), None),
                 "user": ((STR, "null"), None)}


def add_ops_routes(app, server) -> None:
    """Register /tokenize, /detokenize, /v1/score, /rerank, /v1/load_lora_adapter and /v1/unload_lora_adapter
    on `app`."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import PlainTextResponse

    from meshlm.infer.routes import body_of

    @app.post("/tokenize")
    async def tokenize_route(request: HTTPRequest):
        return await asyncio.to_thread(tokenize, server, await body_of(request, server.max_body_bytes))

    @app.post("/detokenize")
    async def detokenize_route(request: HTTPRequest):
        return await asyncio.to_thread(detokenize, server, await body_of(request, server.max_body_bytes))

    async def score_route(request: HTTPRequest):
        return await asyncio.to_thread(score, server, await body_of(request, server.max_body_bytes))

    async def rerank_route(request: HTTPRequest):
        return await asyncio.to_thread(rerank, server, await body_of(request, server.max_body_bytes))

    for path in ("/score", "/v1/score"):
        app.post(path)(score_route)
    for path in ("/rerank", "/v1/rerank"):
        app.post(path)(rerank_route)

    @app.post("/v1/load_lora_adapter")
    async def load_route(request: HTTPRequest):
        body = await body_of(request, server.max_body_bytes)
        return PlainTextResponse(await asyncio.to_thread(load_lora, server, body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_route(request: HTTPRequest):
        body = await body_of(request, server.max_body_bytes)
        return PlainTextResponse(await asyncio.to_thread(unload_lora, server, body))


# ---- /tokenize, /detokenize --------------------------------------------------------------------------------------
def tokenize(server, request_body) -> dict:
    """POST /tokenize: the token ids of `prompt`, or of `messages` as the chat template renders them.
    `add_special_tokens` is taken for vLLM's clients; meshlm feeds a prompt as its tokenizer encodes it (no
    special token added, whatever the field says), so the ids here are the ids the server runs."""
    from meshlm.infer.protocol import chat_messages, chat_template_of

    f = validate(request_body, TOKENIZE_SCHEMA)
    server.check_model(f["model"])
    if (f["prompt"] is None) == (f["messages"] is None):
        raise bad("give exactly one of prompt (text) and messages (a chat)", "messages" if f["prompt"] is not None else "prompt")
    if f["prompt"] is not None:
        if f["add_generation_prompt"] is not None:
            raise bad("add_generation_prompt goes with messages, not prompt", "add_generation_prompt")
        text = f["prompt"]
    else:
        from meshlm.data.chat import render
        from meshlm.data.items import DataError

        server.need("engine")
        messages = chat_messages(f["messages"])
        try:
            text = render(chat_template_of(server.tokenizer), messages,
                          add_generation_prompt=f["add_generation_prompt"] is not False)
        except DataError as err:
            raise bad(str(err), "messages") from None
    ids = server.tokenizer.encode(text)
    out = {"count": len(ids), "max_model_len": server.max_len, "tokens": ids}
    if f["return_token_strs"]:
        out["token_strs"] = [server.tokenizer.decode([t]) for t in ids]
    return out


def detokenize(server, request_body) -> dict:
    """POST /detokenize: the text of token ids (each in the model's vocabulary)."""
    f = validate(request_body, DETOKENIZE_SCHEMA)
    server.check_model(f["model"])
    vocab = vocab_size(server)
    wrong = next((t for t in f["tokens"] if not 0 <= t < vocab), None)
    if wrong is not None:
        raise bad(f"tokens must be token ids in 0..{vocab - 1}, not {wrong}", "tokens")
    return {"prompt": server.tokenizer.decode(f["tokens"])}


def vocab_size(server) -> int:
    """The served model's vocabulary size (its logits), for a decoder or an encoder."""
    model = server.engine.model if server.engine is not None else server.embedder.model
    return model.cfg.vocab_size


# ---- runtime LoRA ----------------------------------------------------------------------------------------------
def check_runtime_lora(server) -> None:
    """A 404 unless the server was started with --allow-runtime-lora (vLLM has no such route then either)."""
    if not server.runtime_lora:
        raise APIError(404, "loading adapters at runtime is off on this server; start meshlm serve with "
                       "--allow-runtime-lora", "not_found_error", code="runtime_lora_disabled")


def load_lora(server, request_body) -> str:
    """POST /v1/load_lora_adapter: read `lora_path` as `serve --adapter` does (the base's shapes and
    fingerprint checked) and serve it as `lora_name` from now on. Runs off the event loop."""
    from meshlm.core.config import ConfigError
    from meshlm.tune.export import read_adapter

    check_runtime_lora(server)
    f = validate(request_body, LOAD_SCHEMA)
    name = f["lora_name"]
    if not name.strip() or name != name.strip():
        raise bad("lora_name must be a non-empty name without surrounding spaces", "lora_name")
    if name == server.model_name or server.adapter_index(name) is not None:
        raise bad(f"the model {name!r} is already served; unload it first or pick another lora_name", "lora_name")
    if f["load_inplace"]:
        raise bad("load_inplace is not supported; unload the adapter, then load it again", "load_inplace")
    try:
        adapter = read_adapter(f["lora_path"], server.checkpoint.config, server.checkpoint)
        server.adapter_set.load(name, adapter)
    except ConfigError as err:
        field = "lora_name" if "already served" in str(err) else "lora_path"
        raise bad(str(err).replace("--adapter ", "lora_path "), field) from None
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_lora(server, request_body) -> str:
    """POST /v1/unload_lora_adapter: stop serving `lora_name`; a 409 while requests use it (none is ever cut
    short or switched to another model), a 404 for a name not loaded. Runs off the event loop."""
    check_runtime_lora(server)
    f = validate(request_body, UNLOAD_SCHEMA)
    name = f["lora_name"]
    with server.adapter_lock:  # no request for it can be submitted between the check and the tombstone
        index = server.adapter_index(name)
        if index is None:
            raise APIError(404, f"the LoRA adapter {name!r} is not loaded (loaded: "
                           f"{', '.join(repr(a.name) for a in server.adapters) or 'none'})", "not_found_error",
                           param="lora_name", code="model_not_found")
        busy = server.in_flight.get(index, 0)
        if busy:
            raise APIError(409, f"the LoRA adapter {name!r} is in use by {busy} request(s); unload it once they "
                           "have finished", "conflict_error", param="lora_name", code="adapter_in_use")
        server.adapter_set.retire(index)
    server.adapter_set.unload(index)
    return f"Success: LoRA adapter '{name}' removed successfully."


# ---- /v1/score, /rerank ----------------------------------------------------------------------------------------
def scores(server, pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int]:
    """(the cross-encoder's score of each pair, tokens read); a 400 when this server has no cross-encoder."""
    from meshlm.infer.sampling import InvalidRequest

    if server.scorer is None:
        raise bad(f"{server.model_name!r} is not a cross-encoder: scores need a BERT checkpoint with a one-label "
                  "classify head (meshlm finetune --task classify --model.num_labels=1 on text pairs)", "model")
    if not pairs:
        raise bad(f"{param} is empty", param)
    try:
        return server.scorer.score(pairs, param)
    except InvalidRequest as err:
        raise bad(str(err), err.param) from None


def score(server, request_body) -> dict:
    """POST /v1/score: the score of (text_1, text_2), of text_1 with each of text_2, or of the pairs of two
    lists of one length (vLLM's pairing)."""
    f = validate(request_body, SCORE_SCHEMA)
    server.check_model(f["model"])
    one, two = f["text_1"], f["text_2"]
    if isinstance(one, list) and isinstance(two, str):
        raise bad("text_1 is a list and text_2 one text; give text_1 as one text (scored with each of text_2) or "
                  "two lists of one length", "text_1")
    if isinstance(one, list) and len(one) != len(two):
        raise bad(f"text_1 has {len(one)} texts and text_2 {len(two)}; two lists must be of one length", "text_2")
    if isinstance(one, str):
        one = [one] * (1 if isinstance(two, str) else len(two))
    two = [two] if isinstance(two, str) else two
    values, n = scores(server, list(zip(one, two)), "text_2")
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": f["model"] or server.model_name,
            "data": [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}


def rerank(server, request_body) -> dict:
    """POST /rerank: `documents` ordered by their score with `query`, best first (the `top_n` best)."""
    f = validate(request_body, RERANK_SCHEMA)
    server.check_model(f["model"])
    top = f["top_n"] if f["top_n"] is not None else len(f["documents"])
    if top < 0:
        raise bad(f"top_n must be >= 0 (0 or absent: every document), not {top}", "top_n")
    values, n = scores(server, [(f["query"], d) for d in f["documents"]], "documents")
    order = sorted(range(len(values)), key=lambda i: -values[i])[:top or len(values)]
    results = [{"index": i, "relevance_score": values[i]} for i in order]
    if f["return_documents"] is not False:
        for r in results:
            r["document"] = {"text": f["documents"][r["index"]]}
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": f["model"] or server.model_name,
            "usage": {"total_tokens": n}, "results": results}
