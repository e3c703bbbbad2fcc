"""Serving plan: tensor parallelism and batch size for a model on a GPU type (arithmetic, no tensors).

A replica of `tp` GPUs serves `batch` requests at a time, each a prompt of P tokens and O generated ones
(static batching: the batch is prefilled together, then decoded together):

* prefill (time to first token) is bound by FLOPs: 2 FLOPs per parameter per token plus attention's
  2·P²·k·a per layer per sequence (causal, counted once), at the calibrated GEMM efficiency, plus two
  all-reduces per layer of the batch's activations;
* decode (time per output token) is bound by memory bandwidth: every step reads the weights and the
  batch's whole KV cache, at `hbm_efficiency` of the datasheet bandwidth, or by its FLOPs when the batch
  is large; plus two small all-reduces per layer, which are latency-bound;
* memory: 16-bit weights split over tp, the KV cache of `batch` requests of P + O tokens, by the serving
  engine's own formula (`core/kv_cache.py`: a key and a value per KV head and layer, split over tp and
  replicated once tp exceeds the KV heads; under MLA the latent and RoPE key, kv_lora_rank + qk_rope_head_dim
  per layer, whole on every tp rank; with every layer local, at most the window's blocks of positions), the
  prefill's activations and the reserve. Decode reads that cache; its attention FLOPs count the positions
  the layers read (at most the window) and, under MLA, the absorbed form's widths (models/mla.py).

Throughput of a replica: batch·O / (TTFT + O·TPOT); per GPU: divided by tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.core.kv_cache import sequence_cache_bytes
from meshlm.core.layout import check_tensor_parallel
from meshlm.core.mla import score_width
from meshlm.plan.cost import GIB, Calibration, _parameter_split, all_reduce_time, for_gpu, gemm_efficiency

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BLOCK_SIZE = 16  # the engine's default KV block (meshlm serve --block-size)


def decode_score_width(m: ModelConfig) -> float:
    """n·k of a decoding query's attention FLOPs (4·k·n per key and layer: scores and values): for MLA in the
    absorbed form (models/mla.py) the scores are r + d_r wide and the values r, per head."""
    if m.attention != "mla":
        return score_width(m)
    return m.n_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim) / 2


@dataclass
class Serving:
    tp: int
    batch: int
    memory_bytes: float
    kv_per_request_bytes: float
    ttft_s: float
    tpot_s: float
    tokens_per_s: float  # one replica, generated tokens
    fits: bool
    meets: bool  # the latency targets

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.tp

    def to_dict(self) -> dict:
        return {"tp": self.tp, "batch": self.batch, "memory_gb": round(self.memory_bytes / GIB, 3),
                "kv_cache_per_request_mb": round(self.kv_per_request_bytes / 2 ** 20, 3),
                "ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "fits": self.fits, "meets_targets": self.meets}


def serving_estimate(m: ModelConfig, gpu, tp: int, batch: int, prompt: int, output: int, gpus_per_node: int,
                     elem_bytes: int = 2, cal: Calibration | None = None, ttft_s: float | None = None,
                     tpot_s: float | None = None) -> Serving:
    cal = for_gpu(cal or Calibration(), gpu)
    per_layer, outside, word = _parameter_split(m)
    params = m.n_layers * per_layer + outside
    peak, hbm = gpu.tflops * 1e12, gpu.hbm_gbps * 1e9 * cal.hbm_efficiency
    gbps, lat = (gpu.intra_gbps, gpu.intra_latency_us) if tp <= gpus_per_node else (gpu.inter_gbps, gpu.inter_latency_us)
    eff = gemm_efficiency(m.hidden_size / tp, cal)
    kv_split = 1 if m.attention == "mla" else min(tp, m.kv_heads)  # the latent is whole on every rank
    kv_request = sequence_cache_bytes(m, prompt + output, elem_bytes, BLOCK_SIZE)  # what the engine's pool holds
    weights = params * elem_bytes / tp
    # -- prefill: the batch's prompts at once
    tokens = batch * prompt
    flops = 2.0 * (params - word) * tokens + 2.0 * tokens * m.hidden_size * m.vocab_size \
        + 2.0 * batch * prompt * prompt * score_width(m) * m.n_layers
    comm = 2 * m.n_layers * all_reduce_time(tokens * m.hidden_size * elem_bytes, tp, gbps, lat, cal.link_efficiency)
    forward_ops = m.n_layers * cal.layer_ops / 3 * gpu.op_overhead_us * 1e-6  # a forward launches ~⅓ of the ops
    ttft = flops / tp / (peak * eff) + comm + forward_ops
    # -- decode: one token for each request, reading the weights and the cache at the mean context length
    context = prompt + output / 2
    kv_read = batch * sequence_cache_bytes(m, int(context), elem_bytes, BLOCK_SIZE) / kv_split
    read = sum(min(context, m.layer_window(i) or context) for i in range(m.n_layers))  # keys a query reads
    step_flops = 2.0 * params * batch / tp + 4.0 * batch * read * decode_score_width(m) / tp
    compute = step_flops / (peak * gemm_efficiency(min(batch, m.hidden_size / tp), cal))
    tpot = max((weights + kv_read) / hbm, compute) \
        + 2 * m.n_layers * all_reduce_time(batch * m.hidden_size * elem_bytes, tp, gbps, lat, cal.link_efficiency) \
        + forward_ops
    activations = tokens * (2 * m.hidden_size + 2 * m.ffn_size / tp + m.vocab_size / tp) * elem_bytes
    memory = weights + batch * kv_request / kv_split + activations + cal.reserve_gib * GIB
    tput = batch * output / (ttft + output * tpot)
    fits = memory <= gpu.memory_gib * GIB
    meets = (ttft_s is None or ttft <= ttft_s) and (tpot_s is None or tpot <= tpot_s)
    return Serving(tp, batch, memory, kv_request, ttft, tpot, tput, fits, meets)


def plan_serving(m: ModelConfig, gpu, gpus_per_node: int, prompt: int, output: int, ttft_s: float | None = None,
                 tpot_s: float | None = None, elem_bytes: int = 2, cal: Calibration | None = None,
                 max_tp: int | None = None) -> tuple[list[Serving], list[tuple[int, str]]]:
    """Every (tp, batch) that fits in memory, the ones meeting the targets first, each group by throughput
    per GPU; and the tp sizes the model's shapes refuse, with the reason."""
    if prompt + output > m.seq_len and m.position == "learned":
        raise ConfigError(f"--prompt-tokens {prompt} + --output-tokens {output} exceeds the model's context "
                          f"model.seq_len={m.seq_len} (learned positions); shorten them or raise model.seq_len")
    rows, refused = [], []
    limit = max_tp or gpus_per_node
    for tp in [d for d in (1, 2, 4, 8, 16, 32, 64) if d <= limit]:
        try:
            check_tensor_parallel(m, tp, False)
        except ConfigError as err:
            refused.append((tp, str(err)))
            continue
        for batch in BATCHES:
            est = serving_estimate(m, gpu, tp, batch, prompt, output, gpus_per_node, elem_bytes, cal, ttft_s, tpot_s)
            if est.fits:
                rows.append(est)
    rows.sort(key=lambda r: (not r.meets, -r.tokens_per_s_per_gpu))
    return rows, refused
