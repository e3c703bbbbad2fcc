"""The server's metrics: request counters kept by the HTTP middleware, and GET /metrics in Prometheus' text
format (the engine's counters, gauges and histograms are read at scrape time).

Beside meshlm's own series (`meshlm_*`), the same measurements under vLLM's names and types, labelled
`model_name` (the served model's name), so that dashboards made for vLLM read this server unchanged:
gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and its older
name `vllm:gpu_cache_usage_perc` (a fraction: 1 is the whole pool); counters `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total` (in
tokens), `vllm:num_preemptions_total`; histograms `vllm:time_to_first_token_seconds`,
`vllm:time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds` (meshlm's buckets). Names and
types as vLLM's v1 Prometheus logger declares them (a counter's samples end in `_total`)."""

import math
import threading
from dataclasses import dataclass, field


@dataclass
class Metrics:
    """Counters for /metrics (the engine's histograms are read at scrape time)."""

    requests: dict[tuple[str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, path: str, status: int) -> None:
        with self.lock:
            self.requests[(path, status)] = self.requests.get((path, status), 0) + 1


def prometheus(server) -> str:
    """/metrics in Prometheus' text format: the request counters of `server.metrics`, the engine's counters,
    gauges and latency histograms (read now)."""
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
        metric("meshlm_split_steps_total", "counter", "steps of several requests whose forward failed and ran "
               "again one request at a time (each failure is a bug or a bad request: see the log)",
               [({}, s["split_steps"])])
        metric("meshlm_kv_cache_bytes", "gauge", "bytes of the pre-allocated KV cache (the block pool)",
               [({}, eng.runner.cache_bytes())])
        metric("meshlm_kv_cache_bytes_per_token", "gauge", "bytes of one position of every layer in the pool "
               "(MLA: its latent and RoPE key; others: a key and a value per KV head)",
               [({}, eng.runner.cache_bytes_per_token())])
        metric("meshlm_kv_cache_window_freed_blocks_total", "counter", "blocks given back as sequences passed "
               "every layer's sliding window", [({}, s.get("window_freed_blocks", 0))])
        pool = eng.pool
        metric("meshlm_kv_cache_blocks", "gauge", "blocks of the KV cache pool", [({}, pool.num_blocks)])
        metric("meshlm_kv_cache_blocks_used", "gauge", "blocks held by running requests", [({}, pool.used)])
        metric("meshlm_kv_cache_usage", "gauge", "share of the pool's blocks held by running requests",
               [({}, pool.used / pool.num_blocks)])
        metric("meshlm_kv_cache_block_size", "gauge", "positions per block", [({}, pool.block_size)])
        local = getattr(eng, "local_pool", None)  # the local (sliding-window) layers' own pool, when mixed
        if local is not None:
            metric("meshlm_kv_cache_local_blocks", "gauge", "blocks of the local layers' own pool",
                   [({}, local.num_blocks)])
            metric("meshlm_kv_cache_local_blocks_used", "gauge", "blocks of the local layers' pool held by "
                   "running requests", [({}, local.used)])
        metric("meshlm_preemptions_total", "counter", "requests preempted (blocks freed, recomputed later) when "
               "the pool ran short", [({}, s["preemptions"])])
        metric("meshlm_batched_tokens_total", "counter", "tokens run by the steps (decoding rows, prefill chunks, "
               "drafts)", [({}, s["batched_tokens"])])
        q, h = s["prefix_queried_tokens"], s["prefix_hit_tokens"]
        metric("meshlm_prefix_cache_queried_tokens_total", "counter", "prompt tokens looked up in the prefix cache",
               [({}, q)])
        metric("meshlm_prefix_cache_hit_tokens_total", "counter", "prompt tokens whose blocks the prefix cache "
               "held (not recomputed)", [({}, h)])
        metric("meshlm_prefix_cache_hit_rate", "gauge", "hit tokens / queried tokens since start",
               [({}, h / q if q else 0.0)])
        metric("meshlm_prefix_cache_evictions_total", "counter", "cached blocks reused for other tokens",
               [({}, pool.stats["evictions"])])
        d, a = s["draft_tokens"], s["accepted_tokens"]
        metric("meshlm_spec_draft_tokens_total", "counter", "speculative tokens proposed", [({}, d)])
        metric("meshlm_spec_accepted_tokens_total", "counter", "speculative tokens accepted", [({}, a)])
        metric("meshlm_spec_acceptance_rate", "gauge", "accepted / proposed speculative tokens since start",
               [({}, a / d if d else 0.0)])
        for name, hist, help_ in (("meshlm_time_to_first_token_seconds", eng.ttft, "time to first token"),
                                  ("meshlm_time_per_output_token_seconds", eng.tpot,
                                   "time per output token after the first")):
            histogram(lines, name, help_, hist, {})
        vllm_series(server, metric, lines)
    return "\n".join(lines) + "\n"


def histogram(lines: list[str], name: str, help_: str, hist, labels: dict) -> None:
    """A histogram (`engine.Histogram`: cumulative bucket counts, count, sum) in Prometheus' text format."""
    buckets, count, total = hist.snapshot()
    own = "".join(f'{k}="{v}",' for k, v in labels.items())
    plain = "{" + own.rstrip(",") + "}" if labels else ""
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for le, c in buckets:
        lines.append(f'{name}_bucket{{{own}le="{"+Inf" if math.isinf(le) else repr(le)}"}} {c}')
    lines.append(f"{name}_sum{plain} {total}")
    lines.append(f"{name}_count{plain} {count}")


def label_value(text: str) -> str:
    """`text` escaped for a Prometheus label value (backslash, double quote, newline)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def vllm_series(server, metric, lines: list[str]) -> None:
    """The engine's measurements under vLLM's metric names (see the module docstring)."""
    eng, pool, s = server.engine, server.engine.pool, server.engine.stats
    labels = {"model_name": label_value(server.model_name)}
    usage = pool.used / pool.num_blocks
    for name, kind, help_, value in (
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", eng.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", eng.queue_length),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage (vLLM's older name). 1 means 100 percent usage.",
             usage),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", s["prompt_tokens"]),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             s["generation_tokens"]),
            ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.",
             s["prefix_queried_tokens"]),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
             s["prefix_hit_tokens"]),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
             s["preemptions"])):
        metric(name, kind, help_, [(labels, value)])
    for name, hist, help_ in (
            ("vllm:time_to_first_token_seconds", eng.ttft, "Histogram of time to first token in seconds."),
            ("vllm:time_per_output_token_seconds", eng.tpot, "Histogram of time per output token in seconds."),
            ("vllm:e2e_request_latency_seconds", server.e2e, "Histogram of e2e request latency in seconds.")):
        histogram(lines, name, help_, hist, labels)
