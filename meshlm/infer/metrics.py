"""The server's metrics: request counters kept by the HTTP middleware, and GET /metrics in Prometheus' text
format (the engine's counters, gauges and histograms are read at scrape time)."""

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
        metric("meshlm_kv_cache_bytes", "gauge", "bytes of the pre-allocated KV cache (the block pool)",
               [({}, eng.runner.cache_bytes())])
        pool = eng.pool
        metric("meshlm_kv_cache_blocks", "gauge", "blocks of the KV cache pool", [({}, pool.num_blocks)])
        metric("meshlm_kv_cache_blocks_used", "gauge", "blocks held by running requests", [({}, pool.used)])
        metric("meshlm_kv_cache_usage", "gauge", "share of the pool's blocks held by running requests",
               [({}, pool.used / pool.num_blocks)])
        metric("meshlm_kv_cache_block_size", "gauge", "positions per block", [({}, pool.block_size)])
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
            buckets, count, total = hist.snapshot()
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} histogram")
            for le, c in buckets:
                lines.append(f'{name}_bucket{{le="{"+Inf" if math.isinf(le) else repr(le)}"}} {c}')
            lines.append(f"{name}_sum {total}")
            lines.append(f"{name}_count {count}")
    return "\n".join(lines) + "\n"
