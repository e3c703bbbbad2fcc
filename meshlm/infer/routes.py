"""The HTTP routes of `meshlm serve` (docs/serving.md): POST /v1/completions, POST /v1/chat/completions (both
with `stream: true` as server-sent events), POST /v1/embeddings, GET /v1/models, PUT /api (Megatron's
text-generation server), GET /health and GET /metrics.

Each route is a function of the server state (`infer/server.py`'s `Server`) and the request's JSON body,
checked by `infer/protocol.py`; `add_routes` registers them on the app. Chat replies are read into content,
`reasoning_content` and `tool_calls` by `infer/replies.py` (tool parsers: `infer/tools.py`; reasoning:
`infer/reasoning.py`). fastapi (the optional extra `meshlm[serve]`) and the engine (torch) are imported when
a route runs, never at module level.
"""

import asyncio
import base64
import dataclasses
import json
import threading
import time
import uuid
import weakref

from meshlm.infer.metrics import prometheus
from meshlm.infer.protocol import (
    CHAT_SCHEMA,
    COMPLETION_SCHEMA,
    EMBEDDING_SCHEMA,
    MEGATRON_SCHEMA,
    APIError,
    bad,
    chat_logprobs,
    chat_messages,
    chat_template_of,
    chat_text,
    check_tool_choice,
    check_tools,
    choice_counts,
    completion_logprobs,
    include_usage,
    logit_bias_of,
    or_default,
    sampling_fields,
    usage,
    validate,
)


def add_routes(app, server) -> None:
    """Register every route of the API on the FastAPI `app`, answering from `server`."""
    from fastapi import Request as HTTPRequest
    from fastapi.responses import PlainTextResponse

    template = chat_template_of(server.tokenizer) if server.engine is not None else None  # a bad one: fails here

    @app.post("/v1/completions")
    async def completions_route(request: HTTPRequest):
        return await completions(server, await body_of(request, server.max_body_bytes), request)

    @app.post("/v1/chat/completions")
    async def chat_route(request: HTTPRequest):
        return await chat_completions(server, await body_of(request, server.max_body_bytes), template, request)

    @app.post("/v1/embeddings")
    async def embeddings_route(request: HTTPRequest):
        return await embeddings(server, await body_of(request, server.max_body_bytes))

    @app.get("/v1/models")
    async def models_route():
        return models(server)

    @app.put("/api")
    async def megatron_route(request: HTTPRequest):
        return await megatron(server, await body_of(request, server.max_body_bytes), request)

    @app.get("/health")
    async def health_route():
        return health(server)

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(prometheus(server), media_type="text/plain; version=0.0.4")


def too_large(limit: int) -> APIError:
    """The 413 of a request body over the server's `--max-body-bytes`."""
    return APIError(413, f"the request body is larger than this server's limit of {limit:,} bytes "
                    "(meshlm serve --max-body-bytes)", code="request_too_large")


def parse_json(raw: bytes):
    """`raw` as JSON: a 400 when it is not JSON or is nested too deeply to parse."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except ValueError as err:
        raise bad(f"the request body is not valid JSON ({err})") from None


async def body_of(request, limit: int):
    """The request's body as JSON: a 413 as soon as it is over `limit` bytes (nothing more is read; the
    declared Content-Length is checked before anything, by the app's middleware too), a 400 when it is not
    JSON. Parsed off the event loop, so a large body never holds up the other clients."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return await asyncio.to_thread(parse_json, b"".join(chunks))


def client_of(http_request) -> str | None:
    """Who sent `http_request`, for the fair share of the queue: the peer's address (its host, not its port:
    one client's many connections are one client). Not the API key: `--api-key` is one key that every client
    shares. Behind a proxy on this host uvicorn takes the address from X-Forwarded-For (its default
    `--forwarded-allow-ips`: 127.0.0.1)."""
    peer = getattr(http_request, "client", None) if http_request is not None else None
    return peer.host if peer is not None else "unknown"


# ---- running requests on the engine ----------------------------------------------------------------------------
def engine_failure(server, reqs: list) -> APIError | None:
    """The error of requests the engine failed, or None: a 503 when the engine has stopped, else a 500 for
    these requests alone (an error while running them; the engine serves the others on)."""
    errs = [r.error for r in reqs if r.finish_reason == "error"]
    if not errs:
        return None
    if server.engine.dead is not None:
        return APIError(503, f"the engine has stopped ({errs[0]})", "server_error", code="engine_dead")
    return APIError(500, f"generating this request failed ({errs[0]}); the server goes on", "server_error",
                    code="generation_failed")


def cancel_unfinished(server, reqs: list) -> None:
    """Cancel the requests not finished (their cache rows are freed)."""
    for r in reqs:
        if not r.finished:
            server.engine.cancel(r)


async def watch_disconnect(http_request, left: asyncio.Event, wake: asyncio.Event) -> None:
    """Set `left` (and `wake`) when the client of `http_request` disconnects: its body is read, so the next
    ASGI message is the disconnect (the task is cancelled once the answer is ready)."""
    while True:
        message = await http_request.receive()
        if message.get("type") == "http.disconnect":
            left.set()
            wake.set()
            return


class _Waker:
    """Sets asyncio events of one event loop from the engine's thread, with one `call_soon_threadsafe` for all
    the events woken before the loop runs: the engine notifies the requests of a step one after another (64 at
    64 clients), and each such call writes to the loop's self-pipe (a system call, made holding the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)  # the loops' table holds wakers weakly by loop: no cycle through it
        self.lock = threading.Lock()
        self.pending: list[asyncio.Event] = []

    def __call__(self, event: asyncio.Event) -> None:
        with self.lock:
            self.pending.append(event)
            if len(self.pending) > 1:  # a flush is already on its way and will set this one too
                return
        loop = self.loop()
        if loop is None:  # gone: nobody waits on its events
            with self.lock:
                self.pending.clear()
            return
        loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self.lock:
            events, self.pending = self.pending, []
        for event in events:
            event.set()


_WAKERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker]" = weakref.WeakKeyDictionary()
_WAKERS_LOCK = threading.Lock()


def waker(loop: asyncio.AbstractEventLoop) -> _Waker:
    """The running loop's `_Waker` (one per loop): `waker(loop)(event)` sets `event` from any thread."""
    with _WAKERS_LOCK:
        w = _WAKERS.get(loop)
        if w is None:
            w = _WAKERS[loop] = _Waker(loop)
        return w


async def run(server, reqs_of, stream: bool, chunks, final, usage_chunk=None, http_request=None):
    """Submit (via `reqs_of(on_update)`), then either stream `chunks(reqs, sent)` as SSE or return
    `final(reqs)`; a client that goes away cancels its requests (their rows are freed): a streamed one when
    its stream is closed, a whole one as soon as it disconnects (watched on `http_request`)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    wake, wake_up = asyncio.Event(), waker(asyncio.get_running_loop())

    def on_update(_req):
        wake_up(wake)

    reqs = reqs_of(on_update)
    if stream:
        return StreamingResponse(events(server, reqs, wake, chunks, usage_chunk), media_type="text/event-stream")
    left = asyncio.Event()
    watcher = asyncio.create_task(watch_disconnect(http_request, left, wake)) if http_request is not None else None
    try:
        while not all(r.finished for r in reqs) and not left.is_set():
            await wake.wait()
            wake.clear()
    finally:
        if watcher is not None:
            watcher.cancel()
        cancel_unfinished(server, reqs)
    if not all(r.finished for r in reqs):
        return JSONResponse({}, status_code=499)  # the client went away; nobody reads this
    err = engine_failure(server, reqs)
    if err is not None:
        raise err
    return JSONResponse(final(reqs))


async def events(server, reqs: list, wake: asyncio.Event, chunks, usage_chunk):
    """The server-sent events of streamed requests: `chunks(i, r, delta, new_tokens, finished=)` of each
    request's new text and tokens whenever the engine wakes us, the usage chunk, then `[DONE]`."""
    sent = [0] * len(reqs)  # characters streamed per request
    done = [False] * len(reqs)
    tokens = [0] * len(reqs)
    try:
        for chunk in chunks(None, None, None, None, first=True):
            yield f"data: {json.dumps(chunk)}\n\n"
        while not all(done):
            await wake.wait()
            wake.clear()
            err = engine_failure(server, reqs)
            if err is not None:
                yield f"data: {json.dumps(err.body())}\n\n"
                break
            for i, r in enumerate(reqs):
                if done[i]:
                    continue
                finished = r.finished
                upto = r.emitted
                delta = r.text[sent[i]:upto]
                new_tokens = r.output[tokens[i]:len(r.output)]
                if delta or new_tokens or finished:
                    for chunk in chunks(i, r, delta, new_tokens, finished=finished):
                        yield f"data: {json.dumps(chunk)}\n\n"
                sent[i], tokens[i] = upto, tokens[i] + len(new_tokens)
                done[i] = finished
        if usage_chunk is not None and all(done):  # stream_options.include_usage
            yield f"data: {json.dumps(usage_chunk(reqs))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        cancel_unfinished(server, reqs)


# ---- /v1/completions ---------------------------------------------------------------------------------------------
async def request_sampling(server, f: dict, default_max: int | None, logprobs: int | None, echo: bool = False):
    """(SamplingParams, n, best_of) of a validated request: its sampling fields (`protocol.sampling_fields`),
    `logit_bias` and `response_format` (its grammar compiled off the event loop); with best_of > n the
    candidates' log-probabilities are computed (they are ranked by them) even when the request does not ask."""
    from meshlm.infer.guided import compile_format
    from meshlm.infer.sampling import InvalidRequest, SamplingParams

    n, best_of = choice_counts(f)
    fields = sampling_fields(f, default_max, logprobs, echo)
    vocab = server.engine.model.cfg.vocab_size
    bias = logit_bias_of(f["logit_bias"], vocab)
    try:
        guide = await asyncio.to_thread(compile_format, server.tokenizer, vocab, f["response_format"])
    except InvalidRequest as err:
        raise bad(str(err), err.param) from None
    if guide is not None and f.get("ignore_eos"):
        raise bad("response_format ends the output with the end-of-document token once the JSON is complete; drop "
                  "ignore_eos", "response_format")
    if best_of > n and fields["logprobs"] is None:
        fields["logprobs"] = 0  # the candidates are ranked by their log-probabilities
    return SamplingParams(**fields, logit_bias=bias, guide=guide), n, best_of


def choice_params(sp, k: int) -> list:
    """The SamplingParams of k choices of one prompt: with a seed, choice i draws with seed + i (so that the
    choices differ, and a request repeats exactly)."""
    if sp.seed is None:
        return [sp] * k
    return [dataclasses.replace(sp, seed=sp.seed + i) for i in range(k)]


def best(cands: list, n: int) -> list:
    """The n candidates of highest cumulative log-probability of their output (ties: the first)."""
    if len(cands) == n:
        return cands
    return sorted(cands, key=lambda r: -sum(t.logprob or 0.0 for t in r.output))[:n]


async def completions(server, request_body, http_request=None):
    """POST /v1/completions: n choices per prompt (the best n of best_of candidates), streamed or whole;
    choice index = prompt index * n + choice."""
    f = validate(request_body, COMPLETION_SCHEMA)
    adapter = server.check_model(f["model"])
    model = server.names[adapter]
    server.need("engine")
    prompts = await asyncio.to_thread(server.prompts, f["prompt"])  # tokenized off the event loop
    echo = bool(f["echo"])
    sp, n, k = await request_sampling(server, f, 16, f["logprobs"], echo)
    want_logprobs = f["logprobs"] is not None
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    decode = server.tokenizer.decode
    echoed: set[int] = set()

    def choice(i, r, text, toks, finish, prompt_part=False):
        lp = None
        if want_logprobs:
            lp = completion_logprobs(r.prompt_tokens if prompt_part else toks,
                                     0 if prompt_part else len(decode(r.prompt_ids)) * echo, decode)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def body(choices, usage_=None):
        out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def chunks(i, r, delta, toks, first=False, finished=False):
        if first:
            return []
        out = []
        if echo and i not in echoed:  # the prompt first, as its own chunk
            echoed.add(i)
            out.append(body([choice(i, r, decode(r.prompt_ids), [], None, prompt_part=True)]))
        out.append(body([choice(i, r, delta, toks, r.finish_reason if finished else None)]))
        return out

    def final(reqs):
        chosen = [r for p in range(len(prompts)) for r in best(reqs[p * k:(p + 1) * k], n)]
        choices = []
        for i, r in enumerate(chosen):
            text = (decode(r.prompt_ids) if echo else "") + r.text
            c = choice(i, r, text, r.output, r.finish_reason)
            if echo and want_logprobs:
                c["logprobs"] = completion_logprobs(r.prompt_tokens + r.output, 0, decode)
            choices.append(c)
        return body(choices, usage(reqs, k))

    every = [ids for ids in prompts for _ in range(k)]
    params = choice_params(sp, k) * len(prompts)
    return await run(server, lambda cb: server.submit_all(every, params, cb, adapter, client=client_of(http_request)),
                     bool(f["stream"]), chunks, final, (lambda reqs: body([], usage(reqs, k))) if include_usage(f) else None, http_request)


# ---- /v1/chat/completions ------------------------------------------------------------------------------------------
def tool_family(server, template) -> str | None:
    """The server's tool parser family: `--tool-parser`, else the one its chat template asks for (found once)."""
    from meshlm.infer.tools import detect

    if getattr(server, "tool_parser", None):
        return server.tool_parser
    if "detected_tool_parser" not in vars(server):
        server.detected_tool_parser = detect(template)
    return server.detected_tool_parser


async def chat_sampling(server, f: dict, room: int, plan, stops: tuple[str, ...]):
    """(SamplingParams, n) of a validated chat request: the sampling fields, the template's stops, and the
    guide of a forced tool call (`ToolPlan.guide`) or of the thinking budget (`reasoning.ThinkingBudget`)."""
    from meshlm.infer.reasoning import ThinkingBudget
    from meshlm.infer.sampling import InvalidRequest

    top = f["top_logprobs"]
    if top is not None and not f["logprobs"]:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    sp, n, _ = await request_sampling(server, f, max(1, room), (top or 0) if f["logprobs"] else None)
    guide = None
    if plan.forced:
        if sp.guide is not None:
            raise bad("tool_choice 'required' or a named function forces the reply's format; drop response_format",
                      "tool_choice")
        try:
            guide = await asyncio.to_thread(plan.guide, server.tokenizer, server.engine.model.cfg.vocab_size)
        except InvalidRequest as err:
            raise bad(str(err), err.param) from None
    budget = or_default(f["max_thinking_tokens"], getattr(server, "max_thinking_tokens", None))
    reasoning = getattr(server, "reasoning_parser", None)
    if budget is not None:
        if budget < 0 or reasoning is None:
            raise bad("max_thinking_tokens must be >= 0 and needs a thinking model (meshlm serve --reasoning-parser)",
                      "max_thinking_tokens")
        if guide is None and sp.guide is None:  # a forced format leaves no room to think
            guide = ThinkingBudget(budget, server.tokenizer.encode("</think>"), server.tokenizer.decode,
                                   reasoning == "deepseek_r1")
    return dataclasses.replace(sp, stop=(*sp.stop, *stops, *plan.stops), guide=guide or sp.guide), n


def completion_limit(f: dict) -> dict[str, str]:
    """A validated chat request's `max_completion_tokens` (OpenAI's newer name) put in `max_tokens`; the
    request's own names of the engine's parameters, for its errors."""
    names = {"logprobs": "top_logprobs"}
    if f["max_completion_tokens"] is not None:
        if f["max_completion_tokens"] < 1:
            raise bad(f"max_completion_tokens must be >= 1, not {f['max_completion_tokens']}", "max_completion_tokens")
        f["max_tokens"] = f["max_completion_tokens"]
        names["max_tokens"] = "max_completion_tokens"
    return names


async def chat_completions(server, request_body, template=None, http_request=None):
    """POST /v1/chat/completions: the assistant's reply to `messages` (text or text parts, tool results, earlier
    tool calls), rendered by the checkpoint's chat template (`template`, a `data.chat.ChatTemplate`;
    `protocol.chat_template_of` when None) with the request's `tools`, ended at the template's end of turn
    (`data.chat.stop_strings`) or the end-of-document token, and read into content, reasoning_content and
    tool_calls (`infer/replies.py`)."""
    from meshlm.infer.replies import ReplyReader, ToolPlan

    f = validate(request_body, CHAT_SCHEMA)
    adapter = server.check_model(f["model"])
    model = server.names[adapter]
    server.need("engine")
    template = template or chat_template_of(server.tokenizer)
    messages, tools = chat_messages(f["messages"]), check_tools(f["tools"])
    choice = check_tool_choice(f["tool_choice"], tools)
    try:
        plan = ToolPlan.of(tools, choice, tool_family(server, template), f["parallel_tool_calls"])
    except ValueError as err:
        raise bad(str(err), "tools") from None
    text, stops = chat_text(template, messages, tools)
    ids = await asyncio.to_thread(server.tokenizer.encode, text)  # off the event loop
    names = completion_limit(f)
    room = server.max_len - len(ids) - len(server.engine.head(adapter))  # the rest of the context
    sp, n = await chat_sampling(server, f, room, plan, stops)
    readers = [ReplyReader(getattr(server, "reasoning_parser", None), plan) for _ in range(n)]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    decode = server.tokenizer.decode

    def chunk(i, delta, finish, toks=None):
        c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if toks and sp.logprobs is not None:
            c["logprobs"] = chat_logprobs(toks, lambda t: decode([t]))
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [c]}

    def chunks(i, r, delta, toks, first=False, finished=False):
        if first:
            return [chunk(j, {"role": "assistant", "content": ""}, None) for j in range(n)]
        fields = readers[i].feed(delta)
        out = [chunk(i, fields, None, toks)] if fields or (toks and sp.logprobs is not None) else []
        if finished:
            rest = readers[i].finish()
            if rest:
                out.append(chunk(i, rest, None))
            out.append(chunk(i, {}, readers[i].finish_reason(r.finish_reason)))
        return out

    def final(reqs):
        choices = []
        for i, r in enumerate(reqs):
            reader = ReplyReader(getattr(server, "reasoning_parser", None), plan)
            choices.append({"index": i, "message": reader.message(r.text),
                            "finish_reason": reader.finish_reason(r.finish_reason),
                            "logprobs": chat_logprobs(r.output, lambda t: decode([t])) if sp.logprobs is not None
                            else None})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(reqs, n)}

    def usage_chunk(reqs):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [], "usage": usage(reqs, n)}

    return await run(server, lambda cb: server.submit_all([ids] * n, choice_params(sp, n), cb, adapter, names,
                                                         client_of(http_request)),
                     bool(f["stream"]), chunks, final, usage_chunk if include_usage(f) else None, http_request)


# ---- /v1/embeddings ----------------------------------------------------------------------------------------------
async def embeddings(server, request_body):
    """POST /v1/embeddings: one vector per input (float lists, or base64 of little-endian float32)."""
    from meshlm.infer.engine import InvalidRequest

    f = validate(request_body, EMBEDDING_SCHEMA)
    server.check_model(f["model"])
    server.need("embedder")
    fmt = or_default(f["encoding_format"], "float")
    if fmt not in ("float", "base64"):
        raise bad(f"encoding_format must be 'float' or 'base64', not {fmt!r}", "encoding_format")
    hidden = server.embedder.model.cfg.hidden_size
    if f["dimensions"] is not None and f["dimensions"] != hidden:
        raise bad(f"dimensions must be the model's {hidden} (no truncation)", "dimensions")
    inputs = f["input"]
    inputs = [inputs] if isinstance(inputs, str) or (inputs and all(isinstance(x, int) for x in inputs)) \
        else inputs
    if not inputs:
        raise bad("input is empty", "input")
    try:
        vectors, n_tokens = await asyncio.to_thread(server.embedder.embed, inputs)
    except InvalidRequest as err:
        raise bad(str(err), err.param) from None
    import numpy as np

    def encode(v):
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if fmt == "base64" else v

    return {"object": "list", "model": server.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


# ---- /v1/models, /health -----------------------------------------------------------------------------------------
def models(server) -> dict:
    """GET /v1/models: the base model, then its adapters (each with the base as parent)."""
    def card(name, parent=None, root=None):
        return {"id": name, "object": "model", "created": server.created, "owned_by": "meshlm", "root": root,
                "parent": parent, "max_model_len": server.max_len}

    return {"object": "list", "data": [card(server.model_name)] + [
        card(a.name, server.model_name, a.source) for a in server.adapters]}


def health(server) -> dict:
    """GET /health: ok while the engine runs (a 503 once it has stopped)."""
    if server.engine is not None and not server.engine.alive:
        raise APIError(503, f"the engine has stopped ({server.engine.dead or 'not running'})", "server_error",
                       code="engine_dead")
    return {"status": "ok"}


# ---- Megatron's PUT /api -----------------------------------------------------------------------------------------
def check_megatron(f: dict, vocab_size: int) -> None:
    """The checks of a validated Megatron request beyond its fields' types (as Megatron's server makes them)."""
    if not f["prompts"]:
        raise bad("prompts is empty", "prompts")
    if f["random_seed"] is not None and not 0 <= f["random_seed"] < 2 ** 63:
        raise bad(f"random_seed must be in 0..2^63-1 (leave it out for a random one), not {f['random_seed']}",
                  "random_seed")
    for name in ("top_p_decay", "top_p_bound"):
        if not 0 <= f[name] <= 1:
            raise bad(f"{name} must be in [0, 1], not {f[name]}", name)
    if f["stop_token"] is not None and not 0 <= f["stop_token"] < vocab_size:
        raise bad(f"stop_token must be a token id in 0..{vocab_size - 1}, not {f['stop_token']}", "stop_token")
    if f["beam_width"] is not None:
        raise bad("beam search (beam_width) is not supported", "beam_width")
    if not 0 <= f["tokens_to_generate"]:
        raise bad("tokens_to_generate must be >= 0", "tokens_to_generate")
    if not 0 <= f["top_p"] <= 1:
        raise bad("top_p must be in [0, 1] (0: off)", "top_p")
    if f["top_k"] > 0 and f["top_p"] > 0:
        raise bad("top_k and top_p cannot both be set", "top_p")
    if f["tokens_to_generate"] == 0 and not f["logprobs"]:
        raise bad("tokens_to_generate=0 scores the prompts: set logprobs true", "logprobs")


async def megatron(server, request_body, http_request=None):
    """PUT /api: Megatron's text-generation server (texts, segments and, with `logprobs`, the prompts' scores)."""
    from meshlm.infer.engine import SamplingParams

    f = validate(request_body, MEGATRON_SCHEMA)
    server.need("engine")
    check_megatron(f, server.engine.model.cfg.vocab_size)
    stop = ("\n\n",) if f["stop_on_double_eol"] else ("\n",) if f["stop_on_eol"] else ()
    eod = server.tokenizer.eod_id
    params = SamplingParams(
        max_tokens=f["tokens_to_generate"], temperature=float(f["temperature"]), top_k=f["top_k"],
        top_p=float(f["top_p"]) or 1.0, seed=f["random_seed"], stop=stop,
        stop_token_ids=(f["stop_token"],) if f["stop_token"] is not None else (),
        logprobs=0 if f["logprobs"] else None, echo=bool(f["logprobs"]))
    prompts = await asyncio.to_thread(lambda: [([eod] if f["add_BOS"] else []) + server.tokenizer.encode(p)
                                               for p in f["prompts"]])  # off the event loop
    decode = server.tokenizer.decode

    def final(reqs):
        out = {"text": [decode(r.prompt_ids) + r.text for r in reqs],
               "segments": [[decode([t]) for t in r.prompt_ids + r.output_ids] for r in reqs]}
        if f["logprobs"]:
            out["logprobs"] = [[t.logprob for t in r.prompt_tokens[1:] + r.output] for r in reqs]
        return out

    names = {"max_tokens": "tokens_to_generate", "seed": "random_seed", "stop_token_ids": "stop_token"}
    return await run(server, lambda cb: server.submit_all(prompts, [params] * len(prompts), cb, names=names,
                                                         client=client_of(http_request)), False,
                     None, final)
