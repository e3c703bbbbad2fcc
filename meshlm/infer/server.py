"""`meshlm serve`: an OpenAI-compatible HTTP server over the inference engine (FastAPI + uvicorn).

Endpoints (docs/serving.md): POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events), POST /v1/embeddings (BERT checkpoints), GET /v1/models, PUT /api (Megatron's
text-generation server), GET /health, GET /metrics (Prometheus text). With `--adapter [NAME=]DIR` (repeated)
each adapter is one more model next to the base, chosen per request by `model` (`infer/adapters.py`).

Requests are validated here, field by field (unknown fields and wrong types are errors); every error is
OpenAI's JSON `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status, and never stops the
server. fastapi and uvicorn are the optional extra `meshlm[serve]`: nothing here imports them at module
level, so `import meshlm` stays lean.
"""

import argparse
import asyncio
import base64
import hmac
import json
import math
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from meshlm.config import ConfigError

CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = "<|"  # a model that starts the next turn's tag has finished its own


def chat_prompt(messages: list[dict]) -> str:
    """The chat template: each message as `<|role|>` newline content newline, then `<|assistant|>` newline
    for the reply. The reply ends at the end-of-document token or when the model opens a tag (`<|`)."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


# ---- errors --------------------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ---- request validation --------------------------------------------------------------------------------------
INT, NUM, STR, BOOL = "integer", "number", "string", "boolean"


def _is(value, kind) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUM:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "string_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "int_list":
        return isinstance(value, list) and all(_is(v, INT) for v in value)
    if kind == "int_lists":
        return isinstance(value, list) and all(_is(v, "int_list") for v in value)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "list":
        return isinstance(value, list)
    raise AssertionError(kind)


def validate(body, schema: dict[str, tuple]) -> dict:
    """`body` checked against {field: (kinds, default)}: unknown fields and wrong types are 400s."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise bad(f"unknown field {unknown[0]!r}; this endpoint takes {', '.join(sorted(schema))}", unknown[0])
    out = {}
    for name, (kinds, default) in schema.items():
        if name not in body:
            if default is REQUIRED:
                raise bad(f"field {name!r} is required", name)
            out[name] = default
            continue
        value = body[name]
        if not any(_is(value, k) for k in kinds):
            raise bad(f"field {name!r} must be {' or '.join(k.replace('_', ' of ') for k in kinds)}, "
                      f"not {json.dumps(value)[:80]}", name)
        out[name] = value
    return out


REQUIRED = object()
PROMPT_KINDS = (STR, "string_list", "int_list", "int_lists")
SAMPLING_FIELDS = {
    "model": ((STR, "null"), None), "max_tokens": ((INT, "null"), None), "temperature": ((NUM, "null"), None),
    "top_p": ((NUM, "null"), None), "top_k": ((INT, "null"), None), "n": ((INT, "null"), None),
    "stream": ((BOOL, "null"), False), "stream_options": (("object", "null"), None),
    "stop": ((STR, "string_list", "null"), None), "seed": ((INT, "null"), None),
    "presence_penalty": ((NUM, "null"), None), "frequency_penalty": ((NUM, "null"), None),
    "repetition_penalty": ((NUM, "null"), None), "stop_token_ids": (("int_list", "null"), None),
    "ignore_eos": ((BOOL, "null"), None), "user": ((STR, "null"), None),
}
COMPLETION_SCHEMA = {**SAMPLING_FIELDS, "prompt": (PROMPT_KINDS, REQUIRED), "logprobs": ((INT, "null"), None),
                     "echo": ((BOOL, "null"), None), "best_of": ((INT, "null"), None)}
CHAT_SCHEMA = {**SAMPLING_FIELDS, "messages": (("list",), REQUIRED), "logprobs": ((BOOL, "null"), None),
               "top_logprobs": ((INT, "null"), None), "max_completion_tokens": ((INT, "null"), None)}
EMBEDDING_SCHEMA = {"model": ((STR, "null"), None), "input": (PROMPT_KINDS, REQUIRED),
                    "encoding_format": ((STR, "null"), None), "dimensions": ((INT, "null"), None),
                    "user": ((STR, "null"), None)}
MEGATRON_SCHEMA = {
    "prompts": (("string_list",), REQUIRED), "tokens_to_generate": ((INT,), 64), "temperature": ((NUM,), 1.0),
    "top_k": ((INT,), 0), "top_p": ((NUM,), 0.0), "top_p_decay": ((NUM,), 0.0), "top_p_bound": ((NUM,), 0.0),
    "logprobs": ((BOOL,), False), "add_BOS": ((BOOL,), False), "stop_on_double_eol": ((BOOL,), False),
    "stop_on_eol": ((BOOL,), False), "prevent_newline_after_colon": ((BOOL,), False),
    "random_seed": ((INT,), -1), "no_log": ((BOOL,), False), "beam_width": ((INT, "null"), None),
    "length_penalty": ((NUM,), 1.0), "stop_token": ((INT, "null"), None),
}


def _or(value, default):
    return default if value is None else value


# ---- the server's state --------------------------------------------------------------------------------------
@dataclass
class Metrics:
    """Counters for /metrics (the engine's histograms are read at scrape time)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1


class Server:
    """What the endpoints share: the engine (a decoder) or the embedder (an encoder), the tokenizer, names."""

    def __init__(self, engine=None, embedder=None, tokenizer=None, model_name: str = "meshlm",
                 max_len: int = 0, api_key: str | None = None):
        self.engine, self.embedder, self.tokenizer = engine, embedder, tokenizer
        self.model_name, self.max_len, self.api_key = model_name, max_len, api_key
        self.created = int(time.time())
        self.metrics = Metrics()
        adapters = getattr(engine, "adapters", None)
        self.adapters = adapters.served if adapters is not None else []  # index k: self.adapters[k - 1]

    @property
    def names(self) -> list[str]:
        """Every model this server answers for: the base, then its adapters."""
        return [self.model_name, *(a.name for a in self.adapters)]

    # ---- shared checks ----
    def check_model(self, name: str | None) -> int:
        """The engine's adapter index of the request's `model` (0: the base, also when none is named)."""
        names = self.names
        if name is None or name == self.model_name:
            return 0
        if name not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return names.index(name)

    def need(self, what: str):
        if what == "engine" and self.engine is None:
            raise bad(f"{self.model_name!r} is an encoder (BERT) checkpoint: it serves /v1/embeddings only")
        if what == "embedder" and self.embedder is None:
            raise bad(f"{self.model_name!r} is a decoder checkpoint: embeddings need a BERT checkpoint", "model")

    def prompts(self, prompt, param: str = "prompt") -> list[list[int]]:
        """A prompt field (text, texts, ids, lists of ids) → lists of token ids."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad(f"{param} is empty", param)
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def sampling(self, f: dict, default_max: int | None, logprobs: int | None, echo: bool = False):
        from meshlm.infer.engine import SamplingParams

        if _or(f.get("n"), 1) != 1 or _or(f.get("best_of"), 1) != 1:
            raise bad("n and best_of must be 1 (one choice per prompt)", "n")
        stop = f.get("stop")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if any(not s for s in stop):
            raise bad("stop strings must not be empty", "stop")
        max_tokens = f.get("max_tokens")
        if max_tokens is not None and max_tokens < (0 if echo else 1):
            raise bad(f"max_tokens must be >= 1, not {max_tokens}", "max_tokens")
        return SamplingParams(
            max_tokens=_or(max_tokens, default_max), temperature=float(_or(f.get("temperature"), 1.0)),
            top_k=_or(f.get("top_k"), 0), top_p=float(_or(f.get("top_p"), 1.0)), seed=f.get("seed"), stop=stop,
            stop_token_ids=tuple(_or(f.get("stop_token_ids"), ())), ignore_eos=bool(f.get("ignore_eos")),
            repetition_penalty=float(_or(f.get("repetition_penalty"), 1.0)),
            presence_penalty=float(_or(f.get("presence_penalty"), 0.0)),
            frequency_penalty=float(_or(f.get("frequency_penalty"), 0.0)), logprobs=logprobs, echo=echo)

    def submit_all(self, prompts: list[list[int]], params: list, on_update, adapter: int = 0) -> list:
        """Check every request first (nothing runs when one is bad), then submit them (with the engine's
        adapter `adapter`)."""
        from meshlm.infer.engine import EngineDead, InvalidRequest, QueueFull

        for ids, sp in zip(prompts, params):
            try:
                self.engine.check(ids, sp, adapter)
            except InvalidRequest as err:
                raise bad(str(err), err.param) from None
        reqs = []
        try:
            for ids, sp in zip(prompts, params):
                reqs.append(self.engine.submit(ids, sp, on_update, adapter))
        except QueueFull as err:
            for r in reqs:
                self.engine.cancel(r)
            raise APIError(429, f"the server is busy: {err}; retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDead as err:
            raise APIError(503, f"the engine has stopped ({err})", "server_error", code="engine_dead") from None
        return reqs


# ---- the response bodies ---------------------------------------------------------------------------------------
def completion_logprobs(tokens, offset: int, decode) -> dict:
    """The legacy completions' logprobs object of `tokens` (TokenInfo), text offsets from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(t.text)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append({decode([i]): lp for i, lp in t.top} if t.logprob is not None else None)
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def chat_logprobs(tokens, decode) -> dict:
    return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                         "top_logprobs": [{"token": decode(i), "logprob": lp, "bytes": list(decode(i).encode())}
                                          for i, lp in t.top]} for t in tokens]}


def include_usage(f: dict) -> bool:
    options = f.get("stream_options") or {}
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad(f"stream_options has unknown field {unknown[0]!r}", "stream_options")
    return bool(options.get("include_usage"))


def usage(reqs: list) -> dict:
    p = sum(len(r.prompt_ids) for r in reqs)
    c = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def prometheus(server: Server) -> str:
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
            lines.append(f"{name}{label} {value}")

    with server.metrics.lock:
        reqs = sorted(server.metrics.requests.items())
    metric("meshlm_http_requests_total", "counter", "HTTP requests by path and status code",
           [({"path": p, "code": c}, n) for (p, c), n in reqs])
    eng = server.engine
    metric("meshlm_engine_alive", "gauge", "1 while the engine loop runs",
           [({}, int(eng.alive if eng is not None else server.embedder is not None))])
    if eng is not None:
        s = eng.stats
        metric("meshlm_prompt_tokens_total", "counter", "prompt tokens prefilled", [({}, s["prompt_tokens"])])
        metric("meshlm_generation_tokens_total", "counter", "tokens generated", [({}, s["generation_tokens"])])
        metric("meshlm_requests_finished_total", "counter", "generation requests finished",
               [({}, s["requests_finished"])])
        metric("meshlm_queue_length", "gauge", "requests waiting for a cache row", [({}, eng.queue_length)])
        metric("meshlm_running_requests", "gauge", "requests in the running batch", [({}, eng.running)])
        metric("meshlm_decode_steps_total", "counter", "decode steps of the running batch", [({}, s["steps"])])
        metric("meshlm_mixed_decode_steps_total", "counter", "decode steps whose batch held rows of several "
               "models (the base and adapters)", [({}, s["mixed_steps"])])
        metric("meshlm_kv_cache_bytes", "gauge", "bytes of the pre-allocated KV cache",
               [({}, eng.runner.cache_bytes())])
        for name, hist, help_ in (("meshlm_time_to_first_token_seconds", eng.ttft, "time to first token"),
                                  ("meshlm_time_per_output_token_seconds", eng.tpot,
                                   "time per output token after the first")):
            buckets, count, total = hist.snapshot()
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            for le, c in buckets:
                lines.append(f'{name}_bucket{{le="{"+Inf" if math.isinf(le) else repr(le)}"}} {c}')
            lines.append(f"{name}_sum {total}")
            lines.append(f"{name}_count {count}")
    return "\n".join(lines) + "\n"


# ---- the app ---------------------------------------------------------------------------------------------------
def build_app(server: Server):
    """The FastAPI app over `server` (the engine thread is started and drained by the app's lifespan)."""
    import contextlib

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from meshlm.infer.engine import InvalidRequest, SamplingParams

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if server.engine is not None and server.engine.thread is None:
            server.engine.start()
        yield
        if server.engine is not None:  # SIGTERM: uvicorn has waited for the open requests; drain the rest
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="meshlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", kind))

    @app.exception_handler(Exception)
    async def _internal(request, err):
        return error_response(APIError(500, f"internal error: {type(err).__name__}: {err}", "server_error"))

    @app.middleware("http")
    async def _auth_and_count(request: HTTPRequest, call_next):
        given = request.headers.get("authorization", "").encode()
        if server.api_key is not None and not hmac.compare_digest(given, f"Bearer {server.api_key}".encode()):
            response = error_response(APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                               "authentication_error", code="invalid_api_key"))
        else:
            response = await call_next(request)
        server.metrics.count(request.url.path, response.status_code)
        return response

    async def body_of(request: HTTPRequest):
        raw = await request.body()
        try:
            return json.loads(raw)
        except ValueError as err:
            raise bad(f"the request body is not valid JSON ({err})") from None

    async def run(reqs_of, stream: bool, chunks, final, usage_chunk=None):
        """Submit (via `reqs_of(on_update)`), then either stream `chunks(reqs, sent)` as SSE or return
        `final(reqs)`; a client that goes away cancels its requests (their rows are freed)."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_update(_req):
            loop.call_soon_threadsafe(wake.set)

        reqs = reqs_of(on_update)

        async def wait_all():
            while not all(r.finished for r in reqs):
                await wake.wait()
                wake.clear()

        def failed():
            errs = [r.error for r in reqs if r.finish_reason == "error"]
            return APIError(503, f"the engine has stopped ({errs[0]})", "server_error", code="engine_dead") \
                if errs else None

        if not stream:
            try:
                await wait_all()
            finally:
                for r in reqs:
                    if not r.finished:
                        server.engine.cancel(r)
            err = failed()
            if err is not None:
                raise err
            return JSONResponse(final(reqs))

        async def events():
            sent = [0] * len(reqs)  # characters streamed per request
            done = [False] * len(reqs)
            tokens = [0] * len(reqs)
            try:
                for chunk in chunks(None, None, None, None, first=True):
                    yield f"data: {json.dumps(chunk)}\n\n"
                while not all(done):
                    await wake.wait()
                    wake.clear()
                    err = failed()
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
                for r in reqs:
                    if not r.finished:
                        server.engine.cancel(r)

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- /v1/completions ----
    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        f = validate(await body_of(request), COMPLETION_SCHEMA)
        adapter = server.check_model(f["model"])
        model = server.names[adapter]
        server.need("engine")
        prompts = server.prompts(f["prompt"])
        echo = bool(f["echo"])
        sp = server.sampling(f, 16, f["logprobs"], echo)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        decode = server.tokenizer.decode
        echoed: set[int] = set()

        def choice(i, r, text, toks, finish, prompt_part=False):
            lp = None
            if sp.logprobs is not None:
                lp = completion_logprobs(r.prompt_tokens if prompt_part else toks,
                                         0 if prompt_part else len(decode(r.prompt_ids)) * echo, decode)
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

        def body(choices, usage_=None):
            out = {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": choices}
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
            choices = []
            for i, r in enumerate(reqs):
                text = (decode(r.prompt_ids) if echo else "") + r.text
                c = choice(i, r, text, r.output, r.finish_reason)
                if echo and sp.logprobs is not None:
                    c["logprobs"] = completion_logprobs(r.prompt_tokens + r.output, 0, decode)
                choices.append(c)
            return body(choices, usage(reqs))

        return await run(lambda cb: server.submit_all(prompts, [sp] * len(prompts), cb, adapter), bool(f["stream"]),
                         chunks, final, (lambda reqs: body([], usage(reqs))) if include_usage(f) else None)

    # ---- /v1/chat/completions ----
    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        f = validate(await body_of(request), CHAT_SCHEMA)
        adapter = server.check_model(f["model"])
        model = server.names[adapter]
        server.need("engine")
        messages = []
        for i, m in enumerate(f["messages"]):
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
                raise bad(f"messages[{i}] must be an object with 'role' ({', '.join(CHAT_ROLES)}) and string "
                          "'content'", "messages")
            extra = sorted(set(m) - {"role", "content", "name"})
            if extra:
                raise bad(f"messages[{i}] has unknown field {extra[0]!r}", "messages")
            messages.append(m)
        if not messages:
            raise bad("messages is empty", "messages")
        ids = server.tokenizer.encode(chat_prompt(messages))
        if f["max_completion_tokens"] is not None:
            f["max_tokens"] = f["max_completion_tokens"]
        top = f["top_logprobs"]
        if top is not None and not f["logprobs"]:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        room = server.max_len - len(ids) - len(server.engine.head(adapter))  # the rest of the context
        sp = server.sampling(f, max(1, room), (top or 0) if f["logprobs"] else None)
        sp.stop = (*sp.stop, CHAT_STOP)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        decode = server.tokenizer.decode

        def chunk(delta, finish, toks=None):
            c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if toks and sp.logprobs is not None:
                c["logprobs"] = chat_logprobs(toks, lambda t: decode([t]))
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [c]}

        def chunks(i, r, delta, toks, first=False, finished=False):
            if first:
                return [chunk({"role": "assistant", "content": ""}, None)]
            out = [chunk({"content": delta}, None, toks)] if delta or (toks and sp.logprobs is not None) else []
            if finished:
                out.append(chunk({}, r.finish_reason))
            return out

        def final(reqs):
            r = reqs[0]
            c = {"index": 0, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
                 "logprobs": chat_logprobs(r.output, lambda t: decode([t])) if sp.logprobs is not None else None}
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [c], "usage": usage(reqs)}

        def usage_chunk(reqs):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": usage(reqs)}

        return await run(lambda cb: server.submit_all([ids], [sp], cb, adapter), bool(f["stream"]), chunks, final,
                         usage_chunk if include_usage(f) else None)

    # ---- /v1/embeddings ----
    @app.post("/v1/embeddings")
    async def embeddings(request: HTTPRequest):
        f = validate(await body_of(request), EMBEDDING_SCHEMA)
        server.check_model(f["model"])
        server.need("embedder")
        fmt = _or(f["encoding_format"], "float")
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

    # ---- /v1/models ----
    @app.get("/v1/models")
    async def models():
        def card(name, parent=None, root=None):
            return {"id": name, "object": "model", "created": server.created, "owned_by": "meshlm", "root": root,
                    "parent": parent, "max_model_len": server.max_len}

        return {"object": "list", "data": [card(server.model_name)] + [
            card(a.name, server.model_name, a.source) for a in server.adapters]}

    # ---- Megatron's PUT /api ----
    @app.put("/api")
    async def megatron(request: HTTPRequest):
        f = validate(await body_of(request), MEGATRON_SCHEMA)
        server.need("engine")
        if not f["prompts"]:
            raise bad("prompts is empty", "prompts")
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
        stop = ("\n\n",) if f["stop_on_double_eol"] else ("\n",) if f["stop_on_eol"] else ()
        eod = server.tokenizer.eod_id
        params = SamplingParams(
            max_tokens=f["tokens_to_generate"], temperature=float(f["temperature"]), top_k=f["top_k"],
            top_p=float(f["top_p"]) or 1.0, seed=f["random_seed"] if f["random_seed"] >= 0 else None, stop=stop,
            stop_token_ids=(f["stop_token"],) if f["stop_token"] is not None else (),
            logprobs=0 if f["logprobs"] else None, echo=bool(f["logprobs"]))
        prompts = [([eod] if f["add_BOS"] else []) + server.tokenizer.encode(p) for p in f["prompts"]]
        decode = server.tokenizer.decode

        def final(reqs):
            out = {"text": [decode(r.prompt_ids) + r.text for r in reqs],
                   "segments": [[decode([t]) for t in r.prompt_ids + r.output_ids] for r in reqs]}
            if f["logprobs"]:
                out["logprobs"] = [[t.logprob for t in r.prompt_tokens[1:] + r.output] for r in reqs]
            return out

        return await run(lambda cb: server.submit_all(prompts, [params] * len(prompts), cb), False, None, final)

    # ---- health and metrics ----
    @app.get("/health")
    async def health():
        if server.engine is not None and not server.engine.alive:
            raise APIError(503, f"the engine has stopped ({server.engine.dead or 'not running'})", "server_error",
                           code="engine_dead")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(server), media_type="text/plain; version=0.0.4")

    return app


# ---- the command ------------------------------------------------------------------------------------------------
def _import_serving():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"meshlm serve needs fastapi and uvicorn ({err.name} is not installed); "
                          "pip install 'meshlm[serve]'") from None


def _tp_of(overrides: list[str]) -> int:
    tp = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key != "--parallel.tp":
            raise ConfigError(f"serve takes only the override --parallel.tp=N (got {o!r}); see meshlm serve -h")
        try:
            tp = int(value)
        except ValueError:
            raise ConfigError(f"--parallel.tp={value!r} must be an integer >= 1") from None
        if tp < 1:
            raise ConfigError(f"--parallel.tp={tp} must be >= 1")
    return tp


def build_server(checkpoint: str, max_seqs: int = 32, max_len: int | None = None, max_queue: int = 256,
                 api_key: str | None = None, model_name: str | None = None, tp: int = 1,
                 adapters: list[str] | str | None = None) -> Server | None:
    """The server state for a checkpoint; under torchrun with tp > 1 only rank 0 gets one (the other ranks
    replay rank 0's engine steps here and return None when it stops). `adapters`: `--adapter` values
    (NAME=DIR or DIR), adapters of `meshlm tune` (or PEFT) tuned on the checkpoint, each served under its
    name next to the base (`infer/adapters.py`: LoRA unmerged per row, virtual tokens at prefill)."""
    import torch

    from meshlm.infer.engine import DistributedRunner, EmbeddingEngine, Engine, Runner, worker_loop
    from meshlm.infer.load import checkpoint_config, load_model_from_checkpoint, load_tensor_parallel

    name = model_name or os.path.basename(os.path.normpath(checkpoint))
    adapters = [adapters] if isinstance(adapters, str) else list(adapters or [])
    tuned = []
    if adapters:  # checked against the base before anything is loaded
        from meshlm.infer.adapters import parse_adapter_args
        from meshlm.tune.export import read_adapter

        named = parse_adapter_args(adapters, name)
        if tp > 1:
            raise ConfigError("--adapter serves in one process (each row's adapter over the whole model); drop "
                              "--parallel.tp")
        cfg = checkpoint_config(checkpoint)
        if cfg.model.family == "bert":
            raise ConfigError(f"--adapter: {checkpoint} is a BERT checkpoint, served for embeddings only; adapters "
                              "are served on GPT checkpoints")
        tuned = [(n, read_adapter(d, cfg, checkpoint)) for n, d in named]
    if tp > 1:
        model, tokenizer, cfg, dims = load_tensor_parallel(checkpoint, tp)
        length = max_len or cfg.model.seq_len
        runner_cls = Runner if dims.tp_rank != 0 else DistributedRunner
        runner = runner_cls(model, max_seqs, length, cfg.model.vocab_size, tp_group=dims.tp_group)
        if dims.tp_rank != 0:
            worker_loop(runner)
            return None
        engine = Engine(model, tokenizer, max_seqs, length, max_queue, runner=runner)
        return Server(engine, None, tokenizer, name, length, api_key)
    cfg = checkpoint_config(checkpoint)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.family == "bert":
        from meshlm.data.tokenizers import get_tokenizer
        from meshlm.interop.convert import load_checkpoint_model
        from meshlm.train.checkpoint import resolve_checkpoint

        model = load_checkpoint_model(resolve_checkpoint(checkpoint), cfg.model, device)
        tokenizer = get_tokenizer(cfg.data.tokenizer)
        return Server(None, EmbeddingEngine(model, tokenizer, max_seqs), tokenizer, name, cfg.model.seq_len, api_key)
    length = max_len or cfg.model.seq_len
    if cfg.model.position == "learned" and length > cfg.model.seq_len:
        raise ConfigError(f"--max-len {length} is more than the model's model.seq_len={cfg.model.seq_len} (learned "
                          "positions); lower it")
    from meshlm.plan.fit import check_fits, kv_cache_bytes, weights_bytes

    needed = {"weights": weights_bytes(cfg.model), "KV cache": kv_cache_bytes(cfg.model, max_seqs, length)}
    if tuned:
        needed["adapters"] = sum(t.numel() * 4 for _, a in tuned for t in a.tensors.values())
    check_fits(needed, f"serving {max_seqs} sequences of {length} tokens", "lower --max-seqs or --max-len", device)
    model, tokenizer, cfg = load_model_from_checkpoint(checkpoint, device, cfg)
    served = None
    if tuned:
        from meshlm.infer.adapters import AdapterSet

        served = AdapterSet(model, cfg, tuned)  # one copy of the base; each row runs its own adapter
    engine = Engine(model, tokenizer, max_seqs, length, max_queue, adapters=served)
    return Server(engine, None, tokenizer, name, engine.max_len, api_key)


def _draining_server_class():
    import contextlib

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, exiting with code 0 once SIGTERM/SIGINT has drained the open requests (uvicorn
        would raise the signal again, ending the process by it)."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()

    return DrainingServer


def _serve(args: argparse.Namespace, overrides: list[str]) -> int:
    tp = _tp_of(overrides)
    _import_serving()
    checks = [(0 <= args.port <= 65535, f"--port {args.port} must be in 0..65535"),
              (args.max_seqs >= 1, f"--max-seqs {args.max_seqs} must be >= 1"),
              (args.max_queue >= 1, f"--max-queue {args.max_queue} must be >= 1"),
              (args.max_len is None or args.max_len >= 2, f"--max-len {args.max_len} must be >= 2"),
              (args.api_key is None or args.api_key.strip() != "", "--api-key must not be empty")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    import uvicorn

    from meshlm.parallel import destroy

    _DrainingServer = _draining_server_class()
    server = None
    try:
        server = build_server(args.checkpoint, args.max_seqs, args.max_len, args.max_queue, args.api_key,
                              args.served_model_name, tp, args.adapter)
        if server is not None:
            also = f" with adapters {', '.join(repr(a.name) for a in server.adapters)}" if server.adapters else ""
            print(f"meshlm serve: {server.model_name!r}{also} on http://{args.host}:{args.port} "
                  f"({'embeddings' if server.engine is None else f'{args.max_seqs} sequences'})", file=sys.stderr,
                  flush=True)
            config = uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                                    timeout_graceful_shutdown=args.drain_timeout)
            _DrainingServer(config).run()
    finally:
        if server is not None and server.engine is not None and server.engine.thread is None:
            from meshlm.infer.engine import DistributedRunner

            if isinstance(server.engine.runner, DistributedRunner):  # never started: release the other ranks
                server.engine.runner.shutdown()
        destroy()
    return 0


def add_serve_command(sub) -> None:
    """Register `meshlm serve` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server for a checkpoint (needs meshlm[serve])")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint) or a step directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                                                              "checkpoint directory's name)")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences decoded together (rows of the KV cache)")
    p.add_argument("--max-len", type=int, default=None, help="positions per cache row, prompt and output "
                                                             "(default: model.seq_len)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a row; beyond: 429")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds SIGTERM waits for open requests")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--adapter", action="append", default=None, metavar="[NAME=]DIR", help="an adapter of meshlm "
                   "tune (or PEFT; LoRA or prompt tuning) tuned on --checkpoint, served as model NAME (default: DIR's "
                   "name) next to the base; repeat it for several, chosen per request by the model field")
    p.set_defaults(func=_serve)
