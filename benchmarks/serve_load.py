"""An OpenAI-client load generator for any OpenAI-compatible server (`meshlm serve`, `vllm serve`), used by
benchmarks/serve_vs_vllm.py and runnable on its own:

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME --tokenizer gpt2 \
        --workload shared-prefix --clients 16 --requests 32 --max-tokens 64
    python benchmarks/serve_load.py --smoke      # 4 short requests, 2 clients, to `meshlm serve` of a tiny
                                                 # random GPT started here (any --url is not used)

Each request is a streamed POST /v1/completions through the official `openai` AsyncOpenAI client, with the
prompt given as token ids (so both servers see the same tokens, whatever their tokenizers), greedy,
`ignore_eos` (in extra_body) and a fixed `max_tokens`, so every server generates exactly the same number of
tokens; `stream_options.include_usage` returns the count, which is checked. N clients (asyncio tasks) send the
requests of a fixed list back to back (a closed loop: a client sends its next request when its last one ends)
until the list is done. Per request: TTFT, from sending to the first streamed chunk that carries a choice;
TPOT, (last chunk - first chunk) / (output tokens - 1). Per run: output tokens/s and requests/s over the run's
wall time, TTFT and TPOT median and p99 over its requests (vLLM's `benchmark_serving` reports the same).

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
import random
import statistics
import sys
import time
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
    first_error: str = ""


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated (numpy's default); nan when empty."""
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, float, int]:
    """(start, first chunk, last chunk, output tokens) of one streamed completion."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            first = first if first is not None else now
            last = now
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return start, first, last, tokens


async def run_load(url: str, model: str, prompts: list[list[int]], clients: int, max_tokens: int,
                   api_key: str = "EMPTY", timeout_s: float = 1800.0) -> Result:
    """Send `prompts` through `clients` concurrent clients (closed loop) to the server at `url`."""
    import httpx
    from openai import AsyncOpenAI, OpenAIError

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))
    client = AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, http_client=http)
    todo = list(reversed(prompts))
    done: list[tuple[float, float, float, int]] = []
    errors: list[str] = []

    async def worker():
        while todo:
            prompt = todo.pop()
            try:
                done.append(await one_request(client, model, prompt, max_tokens))
            except (OpenAIError, httpx.HTTPError, OSError, RuntimeError) as err:  # counted and reported
                errors.append(f"{type(err).__name__}: {err}")

    try:
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    finally:
        await client.close()
    return summarize(clients, done, errors, wall, max_tokens)


def summarize(clients: int, done: list, errors: list[str], wall: float, max_tokens: int) -> Result:
    short = [t for *_, t in done if t != max_tokens]
    if short:  # both servers must generate exactly max_tokens (ignore_eos), or the comparison is void
        errors = errors + [f"{len(short)} requests returned {short[0]} tokens, not max_tokens={max_tokens}"]
    ttft = [f - s for s, f, _, _ in done]
    tpot = [(e - f) / (t - 1) for _, f, e, t in done if t > 1]
    out = sum(t for *_, t in done)
    return Result(clients, len(done), len(errors), wall, out, out / wall, len(done) / wall,
                  1e3 * statistics.median(ttft) if ttft else float("nan"), 1e3 * percentile(ttft, 0.99),
                  1e3 * statistics.median(tpot) if tpot else float("nan"), 1e3 * percentile(tpot, 0.99),
                  errors[0] if errors else "")


def warm_up(url: str, model: str, longest: int = 256, max_tokens: int = 8, api_key: str = "EMPTY") -> None:
    """A few requests of 8 tokens up to `longest`, alone and four at a time, so lazy initialisation (and any
    compilation for new shapes) is not timed. Their prompts repeat one token, unlike any workload's
    passages, so they put no workload prefix in a prefix cache."""
    sizes = sorted({8, max(8, longest // 2), max(8, longest)})
    asyncio.run(run_load(url, model, [[11] * n for n in sizes], 1, max_tokens, api_key))
    asyncio.run(run_load(url, model, [[13] * n for n in sizes + sizes[:1]], 4, max_tokens, api_key))


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
    warm_up(args.url, args.model, lengths.longest(), api_key=args.api_key)
    result = asyncio.run(run_load(args.url, args.model, prompts, args.clients, args.max_tokens, args.api_key))
    print(json.dumps(asdict(result), indent=2))


if __name__ == "__main__":
    main()
