"""Formulas of multi-head latent attention (`model.attention='mla'`, models/mla.py): weights, parameters and the
bytes one layer's attention saves for backward. Torch-free; `core/flops.py` and `core/memory.py` call these where
an MLA model's attention differs from Megatron's multi-head attention.

With n heads, hidden h, query rank r_q (0: none), kv rank r, head widths d_n (no position), d_r (rope), d_v:
    weights = (h·r_q + r_q·n·(d_n+d_r)  or  h·n·(d_n+d_r)) + h·(r + d_r) + r·n·(d_n+d_v) + n·d_v·h
    parameters = weights + r_q + r (the two latent RMSNorms)
    attention scores per token pair, forward+backward: 6·n·(d_n+d_r + d_v)/2 (QKᵀ at d_n+d_r, ·V at d_v;
    Megatron's 6·k·a is the d_n+d_r = d_v = k case)
"""

from __future__ import annotations

from typing import Any

from meshlm.core.config import ModelConfig


def mla_attention_weights(m: ModelConfig) -> int:
    """The weights of one MLA block's linears (module doc): what one token's matmuls use."""
    h, n, rq, r = m.hidden_size, m.n_heads, m.q_lora_rank, m.kv_lora_rank
    qk, dr = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_rope_head_dim
    q = h * rq + rq * n * qk if rq else h * n * qk
    return q + h * (r + dr) + r * n * (m.qk_nope_head_dim + m.v_head_dim) + n * m.v_head_dim * h


def mla_attention_parameters(m: ModelConfig) -> int:
    return mla_attention_weights(m) + m.q_lora_rank + m.kv_lora_rank


def score_width(m: ModelConfig) -> float:
    """n·k of Megatron's attention-score FLOPs 6·s²·k·n (per layer and sequence): for MLA the mean of the
    QKᵀ width (d_n + d_r) and the ·V width (d_v), times the heads."""
    if m.attention != "mla":
        return m.head_dim * m.n_heads
    return m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2


def cached_width(m: ModelConfig) -> int:
    """Elements of one layer's keys (and as many of values) a cache holds per token: kv_heads·head_dim, or under
    MLA today n_heads·max(d_n + d_r, d_v), full per-head keys and values, the narrower zero-padded (models/mla.py;
    caching the kv latent instead, r + d_r per token, is issue 46's item 5)."""
    if m.attention != "mla":
        return m.kv_heads * m.head_dim
    return m.n_heads * max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)


def _latent_norm(name: str, n: int, width: int, input_width: int, dt: Any) -> dict[str, float]:
    """A latent RMSNorm (fp32 inside) and the up projection after it: the input (its fp32 copy under 16-bit
    compute; in fp32 the input itself, a view keeping all `input_width` columns of its base), the rsqrt, the
    normalised latent in the compute dtype, and the up projection's input (the weighted latent, cast)."""
    source = input_width if dt.compute == 4 else width
    return {f"{name} norm input (fp32)": n * source * 4, f"{name} norm rsqrt": n * dt.stats,
            f"{name} normalised latent": n * width * dt.compute, f"{name} up-projection input": n * width * dt.compute}


def mla_activation_terms(m: ModelConfig, tokens: int, b: int, s: int, heads: int, dt: Any, backend: str,
                         selective: bool, dropout: bool) -> dict[str, float]:
    """Bytes one MLA block saves for backward on one tp rank (`heads` of them), by term, from the down
    projections' input to the output projection's input. `tokens` = b·s, every token of the micro-batch: under
    sequence parallelism the gathered sequence is what the replicated down projections keep. The down
    projections read the normalised stream: one saved tensor in fp32, and under 16-bit compute each casts its
    own copy (2). The core runs on q, k, v zero-padded to w = max(d_n + d_r, d_v) per head (models/mla.py)."""
    w = max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    c, h = dt.compute, m.hidden_size
    terms = {"down projections' input": tokens * h * c * (1 if c == 4 else 2)}
    if m.q_lora_rank:
        terms.update(_latent_norm("q", tokens, m.q_lora_rank, m.q_lora_rank, dt))
    terms.update(_latent_norm("kv", tokens, m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim, dt))
    qkv = tokens * heads * w
    if selective or backend == "flash":
        terms["q, k, v (padded)"] = 3 * qkv * c
        if not selective:
            terms["logsumexp (flash)"] = b * heads * s * dt.stats
            terms["attention output (padded)"] = qkv * c
    else:  # math SDPA: its own scaled q and k, v as (b·n, s, w), the s×s probabilities
        scores = b * heads * s * s
        terms["q, k, v copies (math SDPA)"] = 3 * qkv * dt.math
        terms["softmax output"] = scores * dt.math
        if dropout:
            terms["attention dropout mask"] = scores * (1 if dt.bool_masks else dt.math)
            terms["dropped probabilities"] = scores * dt.math
    terms["attention output (proj input)"] = tokens * heads * m.v_head_dim * c
    return terms
