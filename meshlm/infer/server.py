"""`meshlm serve`: an OpenAI-compatible HTTP server over the inference engine (FastAPI + uvicorn).

Endpoints (docs/serving.md, `infer/routes.py`): POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), POST /v1/embeddings (BERT checkpoints), GET /v1/models, PUT /api
(Megatron's text-generation server), GET /health, GET /metrics (Prometheus text, `infer/metrics.py`); POST
/v1/responses (`infer/responses.py`); /tokenize, /detokenize and runtime LoRA loading (`infer/ops_routes.py`).
With `--adapter [NAME=]DIR` (repeated) each adapter is one more model next to the base, chosen per request by
`model` (`infer/adapters.py`).

Here: the server's state (`Server`), the app assembled over it (`build_app`: error handlers, the API key, the
engine's start and drain), the state of a checkpoint (`build_server`, also under tensor and pipeline
parallelism, where the ranks other than 0 are workers: `infer/runner.py`, `infer/pipeline_runner.py`) and `serve` (uvicorn). Requests are validated field by field
(`infer/protocol.py`: unknown fields and wrong types are errors); every error is OpenAI's JSON
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status, and never stops the server. fastapi
and uvicorn are the optional extra `meshlm[serve]`: nothing here imports them at module level, so
`import meshlm` stays lean. The command line is `meshlm/commands/serve.py`.
"""

import asyncio
import hmac
import os
import re
import sys
import threading
import time

from meshlm.core.config import ConfigError
from meshlm.infer.metrics import Metrics
from meshlm.infer.protocol import MAX_BODY_BYTES, APIError, bad


# ---- the server's state --------------------------------------------------------------------------------------
class Server:
    """What the endpoints share: the engine (a decoder) or the embedder (an encoder), the tokenizer, names."""

    def __init__(self, engine=None, embedder=None, tokenizer=None, model_name: str = "meshlm",
                 max_len: int = 0, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
        self.engine, self.embedder, self.tokenizer = engine, embedder, tokenizer
        self.model_name, self.max_len, self.api_key = model_name, max_len, api_key
        self.max_body_bytes = max_body_bytes  # a larger request body is a 413, refused before it is read
        self.created = int(time.time())
        self.metrics = Metrics()
        self.adapter_set = getattr(engine, "adapters", None)  # infer/adapters.AdapterSet, or None
        # runtime LoRA (`--allow-runtime-lora`, infer/ops_routes.py): the opened base checkpoint (the adapters'
        # fingerprint is checked against it), and the requests in flight per adapter index (an adapter in use
        # is not unloaded); `adapter_lock` orders a submit against an unload
        self.runtime_lora, self.checkpoint = False, None
        self.scorer = None  # infer/score.Scorer of a cross-encoder checkpoint (/v1/score, /rerank)
        self.adapter_lock = threading.Lock()
        self.in_flight: dict[int, int] = {}
        self.e2e = None
        if engine is not None:
            from meshlm.infer.engine import Histogram

            self.e2e = Histogram()  # seconds from arrival to the last token (vllm:e2e_request_latency_seconds)

    @property
    def adapters(self) -> list:
        """The adapters served now (`ServedAdapter`s; not the unloaded ones)."""
        return [] if self.adapter_set is None else [a for a in self.adapter_set.served if not a.removed]

    @property
    def names(self) -> list[str]:
        """The model name of each engine adapter index: the base, then its adapters (an adapter unloaded at
        runtime keeps its slot, so `names[index]` is the name of a request's index; `served_names` lists the
        models served now)."""
        served = self.adapter_set.served if self.adapter_set is not None else []
        return [self.model_name, *(a.name for a in served)]

    @property
    def served_names(self) -> list[str]:
        """Every model this server answers for now: the base, then its adapters."""
        return [self.model_name, *(a.name for a in self.adapters)]

    # ---- shared checks ----
    def adapter_index(self, name: str) -> int | None:
        """The engine's index of the served adapter `name` (None: no such adapter now)."""
        served = self.adapter_set.served if self.adapter_set is not None else []
        return next((k + 1 for k, a in enumerate(served) if a.name == name and not a.removed), None)

    def check_model(self, name: str | None) -> int:
        """The engine's adapter index of the request's `model` (0: the base, also when none is named)."""
        if name is None or name == self.model_name:
            return 0
        index = self.adapter_index(name)
        if index is None:
            served = ", ".join(repr(n) for n in self.served_names)
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return index

    def need(self, what: str):
        """A 400 unless this server has `what`: "engine" (generation) or "embedder" (embeddings)."""
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

    def submit_all(self, prompts: list[list[int]], params: list, on_update, adapter: int = 0,
                   names: dict[str, str] | None = None, client: str | None = None) -> list:
        """Queue one request's prompts (with the engine's adapter `adapter`) all together or none: a 400 when
        one is bad or when they are more than one client may ever queue, a 429 (retry later) when the queue,
        or `client`'s share of it, has too little room now (`Engine.submit_group`). `names`: the request's own
        name of an engine parameter that it calls otherwise (Megatron's `tokens_to_generate` for
        `max_tokens`, ...), for the errors. `client`: who sent it (`client_of`)."""
        from meshlm.infer.engine import EngineDead, InvalidRequest, QueueFull

        try:
            with self.adapter_lock:  # an unload waits until this request is counted (or is seen first)
                if adapter and self.adapter_set.served[adapter - 1].removed:
                    raise APIError(404, "the adapter this request names was unloaded; list /v1/models",
                                   param="model", code="model_not_found")
                reqs = self.engine.submit_group(list(zip(prompts, params)), self.tracked(on_update), adapter, client)
                self.in_flight[adapter] = self.in_flight.get(adapter, 0) + len(reqs)
                return reqs
        except InvalidRequest as err:
            own = (names or {}).get(err.param, err.param)
            message = re.sub(rf"(?<![\w']){err.param}(?![\w'])", own, str(err)) if err.param else str(err)
            raise bad(message, own) from None
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineDead as err:
            raise APIError(503, f"the engine has stopped ({err})", "server_error", code="engine_dead") from None

    def tracked(self, on_update):
        """`on_update` that also, once per request when it finishes, counts it out of `in_flight` and records
        its end-to-end latency (called on the engine's thread)."""
        def update(req):
            if req.finished and not getattr(req, "counted_out", False):
                req.counted_out = True
                with self.adapter_lock:
                    self.in_flight[req.adapter] -= 1
                if req.finished_at is not None:
                    self.e2e.observe(req.finished_at - req.arrival)
            if on_update is not None:
                on_update(req)
        return update


# ---- the app ---------------------------------------------------------------------------------------------------
class AuthAndCount:
    """The API key and the body's declared size checked before a route runs, and every answer counted by path and
    status (`/metrics`): a plain ASGI middleware, which hands each message of a streamed answer straight on.
    Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) relays a streamed body through a task and a
    memory stream, chunk by chunk: at 64 streaming clients that was most of the HTTP thread's time per token,
    taken from the engine thread (they share the interpreter). An answer whose route raised is counted as the
    500 the app returns."""

    def __init__(self, app, server: "Server", refuse):
        self.app, self.server, self.refuse = app, server, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(reversed(scope["headers"]))  # lower-case names (ASGI); a repeated header: its first value
        declared = headers.get(b"content-length", b"").decode("latin-1")
        key = self.server.api_key
        refused = None
        if key is not None and not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode()):
            refused = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               "authentication_error", code="invalid_api_key")
        elif declared.isdigit() and int(declared) > self.server.max_body_bytes:  # refused before a byte is read
            from meshlm.infer.routes import too_large

            refused = too_large(self.server.max_body_bytes)
        if refused is not None:
            await self.refuse(refused)(scope, receive, send)
            self.server.metrics.count(scope["path"], refused.status)
            return
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.server.metrics.count(scope["path"], status)


def build_app(server: Server):
    """The FastAPI app over `server` (the engine thread is started and drained by the app's lifespan)."""
    import contextlib

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from meshlm.infer.ops_routes import add_ops_routes
    from meshlm.infer.responses import add_responses_route
    from meshlm.infer.routes import add_routes

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

    app.add_middleware(AuthAndCount, server=server, refuse=error_response)
    add_routes(app, server)
    add_ops_routes(app, server)
    add_responses_route(app, server)
    return app


# ---- the server of a checkpoint ----------------------------------------------------------------------------------
def require_serving_dependencies() -> None:
    """ConfigError unless fastapi and uvicorn (the extra `meshlm[serve]`) are installed."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"meshlm serve needs fastapi and uvicorn ({err.name} is not installed); "
                          "pip install 'meshlm[serve]'") from None


def _read_adapters(checkpoint, adapters: list[str], name: str, tp: int) -> list:
    """[(name, tune.export.Adapter)] of the `--adapter` values, checked against the opened base `checkpoint`
    before anything is loaded."""
    from meshlm.families.registry import get_spec
    from meshlm.infer.adapters import parse_adapter_args
    from meshlm.tune.export import read_adapter

    named = parse_adapter_args(adapters, name)
    if tp > 1:
        raise ConfigError("--adapter serves in one process (each row's adapter over the whole model); drop "
                          "--parallel.tp")
    cfg = checkpoint.config
    if not get_spec(cfg.model.family).decoder:
        raise ConfigError(f"--adapter: {checkpoint.given} is a BERT checkpoint, served for embeddings only; adapters "
                          "are served on GPT checkpoints")
    return [(n, read_adapter(d, cfg, checkpoint)) for n, d in named]


def _tensor_parallel_model(checkpoint, tp: int, timeout_s: float = 300, pp: int = 1, pipeline: bool = False):
    """(this rank's part of the model in eval mode, tokenizer, config, ParallelDims) under torchrun with `tp`
    × `pp` ranks (the world is tp × pp), from the opened `checkpoint` of any layout; with `pipeline`, the
    `Parallelized` whole (its `pipeline`: this rank's stage) in place of the model."""
    import torch

    from meshlm.checkpoint.load import load_parallel
    from meshlm.core.config import config_from_dict
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.parallel import init_distributed
    from meshlm.parallel.rng import TPRNGTracker

    saved = checkpoint.config
    spec = get_spec(saved.model.family)
    if not spec.decoder:
        raise ConfigError(f"--parallel.tp={tp} --parallel.pp={pp} serves GPT checkpoints; {checkpoint.given} is "
                          f"model.family={saved.model.family!r}")
    values = saved.to_dict()
    values["parallel"] = {**values["parallel"], "tp": tp, "pp": pp, "dp": 0, "sp": False, "vpp": 1, "pp_layers": [],
                          "zero": 0, "timeout_s": timeout_s}
    values["model"] = {**values["model"], "dropout": 0.0}
    cfg = config_from_dict(values)
    dims = init_distributed(cfg.parallel, torch.device("cpu") if not torch.cuda.is_available() else None)
    if dims.world_size != tp * pp:
        raise ConfigError(f"--parallel.tp={tp} --parallel.pp={pp} serves on exactly tp × pp ranks; this world has "
                          f"{dims.world_size} (torchrun --nproc-per-node {tp * pp})")
    torch.manual_seed(0)
    par = load_parallel(checkpoint, spec, cfg, dims, rng=TPRNGTracker(0, dims.tp_rank))
    return par if pipeline else par.model, get_tokenizer(cfg.data.tokenizer), cfg, dims


def _tensor_parallel_server(checkpoint, max_seqs: int, max_len: int | None, max_queue: int,
                            api_key: str | None, name: str, tp: int, options) -> Server | None:
    """Rank 0's server over this rank's part of the model; the other ranks run the worker loop (replaying
    rank 0's engine steps) and return None when it stops."""
    from meshlm.core.kv_cache import kv_groups
    from meshlm.infer.engine import DistributedRunner, Engine, Runner, worker_loop

    model, tokenizer, cfg, dims = _tensor_parallel_model(checkpoint, tp)
    length = max_len or cfg.model.seq_len
    runner_cls = Runner if dims.tp_rank != 0 else DistributedRunner
    window = kv_groups(cfg.model)[1]  # local layers mixed with global ones: their own pool, on every rank alike
    runner = runner_cls(model, options.blocks_for(max_seqs, length), options.block_size, cfg.model.vocab_size,
                        tp_group=dims.tp_group,
                        local_blocks=options.local_blocks_for(max_seqs, length, window) if window else 0)
    if dims.tp_rank != 0:
        worker_loop(runner)
        return None
    engine = Engine(model, tokenizer, max_seqs, length, max_queue, runner=runner, options=options,
                    speculator=make_speculator(options, model, tokenizer, max_seqs, length))
    return Server(engine, None, tokenizer, name, length, api_key)


def _pipeline_server(checkpoint, max_seqs: int, max_len: int | None, max_queue: int, api_key: str | None,
                     name: str, tp: int, pp: int, options) -> Server | None:
    """Pipeline parallelism (× tensor parallelism): each rank holds its stage's layers and their KV cache
    (`infer/pipeline_runner.py`); rank 0 (the first stage) runs the engine and gets the server, the other
    ranks run each step's part of their stage and return None when rank 0 stops."""
    from meshlm.core.kv_cache import kv_groups
    from meshlm.infer.engine import Engine
    from meshlm.infer.pipeline_runner import PipelineRunner
    from meshlm.infer.runner import worker_loop

    par, tokenizer, cfg, dims = _tensor_parallel_model(checkpoint, tp, pp=pp, pipeline=True)
    length = max_len or cfg.model.seq_len
    window = kv_groups(cfg.model)[1]  # local layers mixed with global ones: their own pool, on every stage
    runner = PipelineRunner(par.model, par.pipeline, options.blocks_for(max_seqs, length), options.block_size,
                            cfg.model.vocab_size, tp_group=dims.tp_group if tp > 1 else None,
                            local_blocks=options.local_blocks_for(max_seqs, length, window) if window else 0)
    if dims.rank != 0:
        worker_loop(runner)
        return None
    engine = Engine(par.model, tokenizer, max_seqs, length, max_queue, runner=runner, options=options,
                    speculator=make_speculator(options, par.model, tokenizer, max_seqs, length))
    return Server(engine, None, tokenizer, name, length, api_key)


def check_pipeline_serving(pp: int, adapters, runtime_lora: bool, quantize, options) -> None:
    """ConfigError, before anything is loaded, for what `--parallel.pp` does not serve: adapters (runtime ones
    too), quantized weights and a draft model (n-gram speculation runs on rank 0 alone and is served)."""
    refused = [(adapters, "--adapter"), (runtime_lora, "--allow-runtime-lora"), (quantize is not None, "--quantize"),
               (options.speculative == "draft", "--speculative draft"), (options.speculative == "mtp", "--speculative mtp")]
    for given, flag in refused:
        if given:
            raise ConfigError(f"{flag} serves without pipeline parallelism; drop --parallel.pp={pp} or {flag}")


def _embedding_server(checkpoint, spec, device: str, max_seqs: int, api_key: str | None, name: str,
                      dtype: str = "fp32") -> Server:
    """The server of an encoder checkpoint (opened): /v1/embeddings, and /v1/score and /rerank for a
    cross-encoder (`infer/score.py`)."""
    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.infer.engine import EmbeddingEngine
    from meshlm.infer.score import Scorer, is_cross_encoder

    cfg = checkpoint.config
    model = cast_parameters(load_model(checkpoint, spec, device), dtype)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    server = Server(None, EmbeddingEngine(model, tokenizer, max_seqs), tokenizer, name, cfg.model.seq_len, api_key)
    if is_cross_encoder(cfg.model):  # a one-label classify head: /v1/score and /rerank too
        server.scorer = Scorer(model, tokenizer, max_seqs)
    return server


def build_server(checkpoint: str, max_seqs: int = 32, max_len: int | None = None, max_queue: int = 256,
                 api_key: str | None = None, model_name: str | None = None, tp: int = 1,
                 adapters: list[str] | str | None = None, options=None, runtime_lora: bool = False,
                 quantize=None, pp: int = 1, dtype: str = "fp32", engine_process: bool | None = False) -> Server | None:
    """The server state for a checkpoint (opened once here: `interop.checkpoints.open_checkpoint`, so a `.gguf`
    file serves too; or a `Checkpoint` opened already); under torchrun with tp > 1 only rank 0 gets one (the other
    ranks replay rank 0's engine steps here and return None when it stops). `adapters`: `--adapter` values
    (NAME=DIR or DIR), adapters of `meshlm tune` (or PEFT) tuned on the checkpoint, each served under its
    name next to the base (`infer/adapters.py`: LoRA unmerged per row, virtual tokens at prefill).
    `runtime_lora`: LoRA adapters may also be loaded and unloaded while it serves (`infer/ops_routes.py`).
    `quantize`: `infer.quantize.QuantizeOptions`, the blocks' linears packed to int8/int4 after loading.
    `pp` > 1: pipeline parallelism under torchrun (`infer/pipeline_runner.py`), rank 0 serving. `dtype`: the
    weights, activations and KV cache in "fp32", "bf16" or "fp16" (`core.precision.cast_parameters`).
    `engine_process`: the engine runs in a process of its own (`infer/engine_process.py`; None: wherever it can)."""
    import torch

    from meshlm.checkpoint.load import Checkpoint, load_model
    from meshlm.core.fit import check_fits
    from meshlm.core.kv_cache import cache_bytes_per_token, kv_groups
    from meshlm.core.precision import DTYPES, cast_parameters, serving_dtype_note
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.infer.engine import CacheOptions, Engine
    from meshlm.infer.engine_process import wants_engine_process
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.train.fit import weights_bytes

    options = options or CacheOptions()
    adapters = [adapters] if isinstance(adapters, str) else list(adapters or [])
    if pp > 1:
        check_pipeline_serving(pp, adapters, runtime_lora, quantize, options)
    # resolved and verified once; the adapters and loaders take it
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    name = model_name or os.path.basename(os.path.normpath(checkpoint.given))
    cfg = checkpoint.config
    spec = get_spec(cfg.model.family)
    engine_process = wants_engine_process(engine_process, tp, pp, runtime_lora, spec.decoder,
                                          checkpoint.given)
    tuned = _read_adapters(checkpoint, adapters, name, tp) if adapters else []
    if runtime_lora and (tp > 1 or not spec.decoder):
        raise ConfigError("--allow-runtime-lora serves LoRA adapters on a GPT checkpoint in one process; drop it"
                          + (" or --parallel.tp" if tp > 1 else f" ({checkpoint.given} is a BERT checkpoint)"))
    if quantize is not None:
        quantize.check_serving(checkpoint.given, spec.decoder, tp, runtime_lora)
    check_dtype(dtype, tp, pp, runtime_lora)
    if spec.decoder:
        check_pool(options, max_len or cfg.model.seq_len, kv_groups(cfg.model)[0])
    if engine_process:
        return _engine_process_server(checkpoint, max_seqs, max_len, max_queue, api_key, name, options, quantize,
                                      dtype, adapters)
    if pp > 1:
        return _pipeline_server(checkpoint, max_seqs, max_len, max_queue, api_key, name, tp, pp, options)
    if tp > 1:
        return _tensor_parallel_server(checkpoint, max_seqs, max_len, max_queue, api_key, name, tp, options)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if note := serving_dtype_note(dtype, torch.device(device)):
        print(f"meshlm serve: note: {note}", file=sys.stderr, flush=True)
    if not spec.decoder:
        return _embedding_server(checkpoint, spec, device, max_seqs, api_key, name, dtype)
    length = max_len or cfg.model.seq_len
    if cfg.model.position == "learned" and length > cfg.model.seq_len:
        raise ConfigError(f"--max-len {length} is more than the model's model.seq_len={cfg.model.seq_len} (learned "
                          "positions); lower it")
    blocks = options.blocks_for(max_seqs, length)
    element = DTYPES[dtype].itemsize  # the pool takes the weights' dtype: the engine's formula (core/kv_cache.py)
    needed = {"weights": weights_bytes(cfg.model),
              "KV cache": cache_bytes_per_token(cfg.model, element) * blocks * options.block_size}
    if tuned:
        needed["adapters"] = sum(t.numel() * 4 for _, a in tuned for t in a.tensors.values())
    check_fits(needed, f"serving {max_seqs} sequences of {length} tokens ({blocks} KV blocks of "
               f"{options.block_size})", "lower --max-seqs, --max-len or --num-blocks", device)
    model, tokenizer = cast_parameters(load_model(checkpoint, spec, device), dtype), get_tokenizer(cfg.data.tokenizer)
    served = _adapter_set(model, cfg, tuned, runtime_lora, dtype) if tuned or runtime_lora else None
    if quantize is not None:  # after the adapters: their hooks move onto the quantized linears
        print(f"meshlm serve: {quantize.apply(model).line()}", file=sys.stderr, flush=True)
    engine = Engine(model, tokenizer, max_seqs, length, max_queue, adapters=served, options=options,
                    speculator=make_speculator(options, model, tokenizer, max_seqs, length))
    server = Server(engine, None, tokenizer, name, engine.max_len, api_key)
    server.runtime_lora, server.checkpoint = runtime_lora, checkpoint
    return server


def _adapter_set(model, cfg, tuned: list, runtime_lora: bool, dtype: str):
    """The `AdapterSet` of the adapters given at start (and room for run-time ones) over `model`, in its dtype."""
    from meshlm.core.precision import cast_parameters
    from meshlm.infer.adapters import AdapterSet

    served = AdapterSet(model, cfg, tuned, runtime_lora)  # one copy of the base; each row runs its own adapter
    for lora in (lora for a in served.served for lora in a.loras):
        cast_parameters(lora, dtype)  # detached from the model: in the base's dtype too
    return served


def _engine_process_server(checkpoint, max_seqs: int, max_len: int | None, max_queue: int, api_key: str | None,
                           name: str, options, quantize, dtype: str, adapters: list[str]) -> Server:
    """The server of an engine in a child process (`infer/engine_process.py`): the child loads the opened
    checkpoint and the `--adapter` values as this function would in one process (they were checked here
    first); here only its tokenizer."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.infer.engine_process import EngineClient

    build = {"checkpoint": checkpoint, "max_seqs": max_seqs, "max_len": max_len, "model_name": name,
             "options": options, "quantize": quantize, "dtype": dtype, "adapters": adapters}
    engine = EngineClient.launch(build_server, build, max_queue)
    tokenizer = get_tokenizer(checkpoint.config.data.tokenizer)
    server = Server(engine, None, tokenizer, name, engine.max_len, api_key)
    server.checkpoint = checkpoint
    return server


def check_dtype(dtype: str, tp: int, pp: int, runtime_lora: bool) -> None:
    """ConfigError, before anything is loaded, for what a 16-bit `--dtype` does not serve yet: tensor or pipeline
    parallelism (no test compares it across layouts) and adapters loaded at run time (they come in fp32)."""
    if dtype != "fp32" and (tp > 1 or pp > 1):
        raise ConfigError(f"--dtype {dtype} serves in one process for now; drop --parallel.tp / --parallel.pp, or "
                          "serve --dtype fp32")
    if runtime_lora and dtype != "fp32":
        raise ConfigError(f"--allow-runtime-lora loads adapters in fp32 while serving; with --dtype {dtype} give the "
                          "adapters at start (--adapter) instead, or serve --dtype fp32")


def check_pool(options, max_len: int, window: int = 0) -> None:
    """ConfigError when `--num-blocks` cannot hold one sequence of `max_len` positions (with every layer local, of
    its longest step and the `window` before it: `core/kv_cache.blocks_needed`): every request that needs more
    would be refused (a server that starts but can never answer a long request)."""
    from meshlm.core.kv_cache import blocks_needed

    need = blocks_needed(max_len, options.block_size, window, options.max_batched_tokens)
    if options.num_blocks is not None and options.num_blocks < need:
        raise ConfigError(f"--num-blocks {options.num_blocks} holds {options.num_blocks * options.block_size} "
                          f"positions, fewer than one --max-len {max_len} sequence needs ({need} blocks of "
                          f"--block-size {options.block_size}); raise --num-blocks to at least {need} or lower "
                          "--max-len")


def make_speculator(options, model, tokenizer, max_seqs: int, max_len: int):
    """The engine's speculative proposer for `options.speculative` (None: none)."""
    if options.speculative is None:
        return None
    from meshlm.infer.speculative import DraftModel, Speculator

    if options.speculative == "ngram":
        return Speculator("ngram")
    if options.speculative == "mtp":  # the served model's own multi-token prediction modules (infer/mtp_draft.py)
        from torch import nn

        from meshlm.infer.mtp_draft import MTPDraft

        if getattr(model, "mtp", None) is None or type(model.lm_head) is not nn.Linear:
            raise ConfigError("--speculative mtp needs a model with multi-token prediction modules (model.mtp_depth "
                              "> 0), whole on one process; use --speculative ngram or draft")
        return Speculator("mtp", MTPDraft(model, model.cfg.vocab_size))
    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint

    drafted = open_checkpoint(options.draft_checkpoint)
    device = next(model.parameters()).device
    draft = load_model(drafted, get_spec(drafted.config.model.family), device)
    cast_parameters(draft, next(model.parameters()).dtype)  # the served model's precision (--dtype)
    draft_tokenizer = get_tokenizer(drafted.config.data.tokenizer)
    mine, theirs = getattr(tokenizer, "identity", None), getattr(draft_tokenizer, "identity", None)
    if draft.cfg.vocab_size != model.cfg.vocab_size or (mine and theirs and mine["sha256"] != theirs["sha256"]):
        raise ConfigError(f"--draft-checkpoint {options.draft_checkpoint}: its tokenizer ({theirs or '?'}, "
                          f"{draft.cfg.vocab_size} ids) is not the served model's ({mine or '?'}, "
                          f"{model.cfg.vocab_size} ids); a draft model must share the tokenizer")
    return Speculator("draft", DraftModel(draft.eval(), max_seqs, max_len, model.cfg.vocab_size))


# ---- serving ---------------------------------------------------------------------------------------------------
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


def serve(checkpoint: str, host: str = "127.0.0.1", port: int = 8000, max_seqs: int = 32, max_len: int | None = None,
          max_queue: int = 256, api_key: str | None = None, model_name: str | None = None, tp: int = 1,
          adapters: list[str] | None = None, log_level: str = "warning", drain_timeout: float = 60.0,
          max_body_bytes: int = MAX_BODY_BYTES, options=None, runtime_lora: bool = False, quantize=None,
          replies: dict | None = None, pp: int = 1, dtype: str = "fp32", engine_process: bool | None = None) -> int:
    """Serve `checkpoint` on http://host:port until SIGTERM/SIGINT (which drains the open requests for up to
    `drain_timeout` seconds); under torchrun with tp or pp > 1 the ranks other than 0 are the workers. A request
    body over `max_body_bytes` is a 413. `replies`: how chat replies are read (`tool_parser`,
    `reasoning_parser`, `max_thinking_tokens`; `infer/routes.py`), set on the server. `engine_process`: the
    engine in a process of its own (`infer/engine_process.py`; None: wherever it can). Returns 0."""
    import uvicorn

    from meshlm.parallel import destroy

    draining_server = _draining_server_class()
    server = None
    try:
        server = build_server(checkpoint, max_seqs, max_len, max_queue, api_key, model_name, tp, adapters, options,
                              runtime_lora, quantize, pp=pp, dtype=dtype, engine_process=engine_process)
        if server is not None:
            server.max_body_bytes = max_body_bytes
            for key, value in (replies or {}).items():
                setattr(server, key, value)
            also = f" with adapters {', '.join(repr(a.name) for a in server.adapters)}" if server.adapters else ""
            compiled = getattr(getattr(server.engine, "runner", None), "compile_s", 0.0)
            also += f", step compiled in {compiled:.1f} s" if compiled else ""
            runner = getattr(server.engine, "runner", None)  # the pool's bytes per position (core/kv_cache.py)
            also += f", KV cache {runner.cache_bytes_per_token():,} bytes/token" if runner is not None else ""
            print(f"meshlm serve: {server.model_name!r}{also} on http://{host}:{port} "
                  f"({'embeddings' if server.engine is None else f'{max_seqs} sequences'})", file=sys.stderr,
                  flush=True)
            config = uvicorn.Config(build_app(server), host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=drain_timeout)
            draining_server(config).run()
    finally:
        if server is not None and server.engine is not None and server.engine.thread is None:
            from meshlm.infer.engine import DistributedRunner

            if isinstance(server.engine.runner, DistributedRunner):  # never started: release the other ranks
                server.engine.runner.shutdown()
        destroy()
    return 0
