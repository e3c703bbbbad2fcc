"""Transformer building blocks: norms, rotary positions, attention (SDPA, GQA, KV cache), MLP.

Single-device modules only. Parallelism is applied from outside (`meshlm.parallel`), which relies on the
layout documented here: the fused projections are stacked blocks along the output dimension,
`qkv.weight = [W_q; W_k; W_v]` and, for SwiGLU, `fc.weight = [W_gate; W_up]`, so a column-parallel split
takes the same slice of every block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.models.cache import AttentionCache


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w (Zhang & Sennrich 2019), computed in fp32 as Llama does: the normalised x
    cast back to x's dtype, then times w. `unit_offset` (Gemma, `model.norm_unit_offset`): times (1 + w), w starting
    at 0, in fp32, and only the product cast back."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.to(x.dtype))).to(dtype)
        return self.weight * x.to(dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_unit_offset)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)


def rope_frequencies(head_dim: int, theta: float, scaling: ModelConfig | None = None,
                     device=None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (head_dim / 2 of them) and the factor applied to cos and sin.

    `scaling` (a ModelConfig) selects a long-context rule by `rope_scaling`: `linear` (every frequency divided by
    the factor: positions interpolated; Gemma 3's global layers), `llama3` (Llama 3.1: wavelengths
    longer than original_len / low_freq_factor are divided by the factor, shorter than original_len /
    high_freq_factor are kept, blended linearly between) or `yarn` (Peng et al. 2023, "NTK-by-parts": dimensions
    that turn fewer than beta_slow times over the original context are interpolated, more than beta_fast times
    kept, a linear ramp between; cos/sin scaled by the attention factor, by default 0.1 ln(factor) + 1)."""
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    rule = scaling.rope_scaling if scaling is not None else "none"
    if rule == "none":
        return base, 1.0
    if rule == "linear":
        return base / scaling.rope_factor, 1.0
    if rule == "llama3":
        return _llama3_frequencies(base, scaling), 1.0
    return _yarn_frequencies(base, head_dim, theta, scaling), yarn_attention_factor(scaling)


def _llama3_frequencies(base: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    wavelength = 2 * math.pi / base
    # 0 where the wavelength exceeds original_len / low (interpolate fully), 1 below original_len / high (keep)
    keep = (cfg.rope_original_len / wavelength - cfg.rope_low_freq_factor) / \
        (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    keep = keep.clamp(0.0, 1.0)
    return (1 - keep) * base / cfg.rope_factor + keep * base


def _yarn_frequencies(base: torch.Tensor, head_dim: int, theta: float, cfg: ModelConfig) -> torch.Tensor:
    def dim_for(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times over the context
        return head_dim * math.log(cfg.rope_original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(cfg.rope_beta_fast), dim_for(cfg.rope_beta_slow)
    if cfg.rope_truncate:  # whole dimensions, as the paper; gpt-oss keeps the fractional ends
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=base.device) - low) / span).clamp(0.0, 1.0)
    return base / cfg.rope_factor * ramp + base * (1 - ramp)


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """YaRN's scale on cos/sin (so on attention logits, squared): the configured one, or 0.1 ln(s) + 1."""
    if cfg.rope_attention_factor > 0:
        return cfg.rope_attention_factor
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * math.log(cfg.rope_factor) + 1.0


def rope_tables(head_dim: int, max_len: int, theta: float, device=None,
                scaling: ModelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_len, head_dim) in the rotate-half layout used by Llama; `scaling` as in
    `rope_frequencies`. On the meta device (a model built to be given a checkpoint's weights, whose tables
    `init_buffers` makes again on the real device) they are shapes only: torch's meta arange would import its
    compiler stack."""
    if torch.empty(0, device=device).is_meta:
        return torch.empty(max_len, head_dim, device="meta"), torch.empty(max_len, head_dim, device="meta")
    inv_freq, factor = rope_frequencies(head_dim, theta, scaling, device)
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    if factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * factor, emb.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, nh, T, hs); cos/sin: (T, hs). Rotates pairs (i, i + hs/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache(nn.Module, AttentionCache):
    """Pre-allocated keys/values for incremental decoding: (B, n_kv_heads, max_len, hs) (`models.generate`)."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values at positions `start`..; return the cached ones up to the last written.
        `start` is an int (every row alike) or a (B,) tensor of per-row positions (the first B rows)."""
        if isinstance(start, torch.Tensor):
            return write_rows(self.k, self.v, start, k, v)
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def update_and_attend(self, q, k, v, start, core, mask=None) -> torch.Tensor:
        """`AttentionCache`: per-row positions (a tensor `start`) as `attend_rows`; an int `start`: the prompt
        (causal, from position 0) or one new token a row, which attends to every cached position."""
        if isinstance(start, torch.Tensor):
            return attend_rows(self.k, self.v, q, k, v, start, core)
        T = q.shape[2]
        k, v = self.update(start, k, v)
        if T > 1 and start > 0:
            raise ValueError("a multi-token chunk after the prompt is not supported with the KV cache")
        return core(q, k, v, T > 1, None) if mask is None else core(q, k, v, False, mask)


def write_rows(cache_k: torch.Tensor, cache_v: torch.Tensor, start: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row positions: row b's T new keys/values go to positions start[b]..start[b]+T-1 of cache row b
    (rows 0..B-1 of (S, nkv, L, hs) buffers); returns rows 0..B-1 up to the furthest position written."""
    B, _, T, _ = k.shape
    pos = start[:, None] + torch.arange(T, device=start.device)  # (B, T)
    rows = torch.arange(B, device=start.device)[:, None].expand(B, T)
    cache_k[rows, :, pos] = k.transpose(1, 2).to(cache_k.dtype)  # indexed (B, T, nkv, hs)
    cache_v[rows, :, pos] = v.transpose(1, 2).to(cache_v.dtype)
    end = int(pos.max()) + 1
    return cache_k[:B, :, :end], cache_v[:B, :, :end]


def attend_rows(cache_k: torch.Tensor, cache_v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                start: torch.Tensor, core) -> torch.Tensor:
    """Per-row positions over rows 0..B-1 of (S, nkv, L, hs) buffers: `write_rows`, then `core` over each row's
    keys up to its query's position (the mask hides the rows' unused tails)."""
    k, v = write_rows(cache_k, cache_v, start, k, v)
    pos = positions_of(start, q.shape[2], q.device)  # key j is visible to query (b, t) when j <= pos[b, t]
    keys = torch.arange(k.shape[2], device=q.device)
    return core(q, k, v, False, (keys <= pos[..., None]).unsqueeze(1))  # mask (B, 1, T, K)


def positions_of(start, T: int, device) -> torch.Tensor:
    """(B, T) per-row positions for a tensor `start` (B,), or (T,) for an int."""
    if isinstance(start, torch.Tensor):
        return start[:, None] + torch.arange(T, device=device)
    return torch.arange(start, start + T, device=device)


def document_causal_mask(q_index: torch.Tensor, k_index: torch.Tensor, q_segments: torch.Tensor | None = None,
                         k_segments: torch.Tensor | None = None) -> torch.Tensor:
    """The attention mask of packed documents (Megatron's reset attention mask), True = attend: key j is
    visible to query i iff k_index[j] <= q_index[i] and, with segments, k_segments[j] == q_segments[i].

    q_index (B, Tq) / k_index (B, Tk) (or (Tq,) / (Tk,), alike for every row): an index that grows by one
    along the row within a document: the token's place in the whole row (global token index), or its
    position in its document (`document_positions`); the two give the same mask when the segments are
    given, since a document is a contiguous run of its row. q_segments (B, Tq) / k_segments (B, Tk): the
    document id of each token in its row (None: one document, plain causal). Written for any (query chunk,
    key chunk) pair of one row, so a context-parallel ring can build each block's mask; a query row may then
    see no key at all (all False), which the caller must handle. Returns (B, 1, Tq, Tk) bool (or (1, 1, Tq, Tk)
    for 1-D indices without segments), broadcast over heads."""
    mask = k_index.unsqueeze(-2) <= q_index.unsqueeze(-1)  # (B, Tq, Tk) or (Tq, Tk)
    if q_segments is not None:
        mask = mask & (k_segments.unsqueeze(-2) == q_segments.unsqueeze(-1))
    while mask.dim() < 3:
        mask = mask.unsqueeze(0)
    return mask.unsqueeze(1)


def visible_keys(T: int, K: int, causal: bool, mask: torch.Tensor | None, window: int,
                 device) -> torch.Tensor | None:
    """The bool mask (True = attend) of T queries over K keys with a sliding `window` (0: none), for a core
    that cannot use SDPA's causal fast path. `mask` None: the queries are the last T of the K positions (a
    prompt, `causal`, or decoding steps over a cache); causal or windowed, that mask is built here (None for
    plain attention to every key). A given `mask` must be causal in key index (key j visible only when it is at
    or before the query, as the caches' and the packed documents' masks are, with contiguous documents): then
    key j is outside the window exactly when key j + W is still visible, so the band is mask & ~(mask shifted
    by W)."""
    if mask is None:
        if not causal and not window:
            return None
        query = torch.arange(K - T, K, device=device)[:, None]
        keys = torch.arange(K, device=device)[None, :]
        mask = keys <= query
        if window:
            mask = mask & (keys > query - window)
        return mask[None, None]  # (1, 1, T, K)
    if not window:
        return mask
    later = F.pad(mask[..., window:], (0, min(window, mask.shape[-1])), value=False)
    return mask & ~later


def rope_at(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin at per-token `positions` (B, T) → (B, 1, T, hs) each, broadcast over heads."""
    return rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; the core runs in `scaled_dot_product_attention`.

    `n_heads`/`n_kv_heads` are the heads this module holds (tensor parallelism lowers them per rank).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.window = cfg.layer_window(layer)  # 0: global; W: the last W keys
        # the softmax scale when not 1/√head_dim (Gemma's query_pre_attn_scalar); the paged and ring cores read it too
        self.scale = cfg.attn_scale_dim ** -0.5 if cfg.attn_scale_dim else None
        # a local layer of a model with its own local RoPE base (Gemma 3) rotates by the model's second tables
        self.local_rope = bool(self.window) and cfg.rope_local_theta > 0
        # gpt-oss's sink logits, one per head (under tp each rank holds its heads' entries, parallel/styles.py)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None
        self.head_offset = 0  # under tp: the first head this rank computes (the sinks it reads)
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.bias)
        self.proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        # Qwen3's per-head norms over head_dim (weights shared by all heads; under tp each rank holds them whole)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, cfg.norm_unit_offset) if cfg.qk_norm else None

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(QKᵀ·scale)·V (scale 1/√d unless `self.scale`): the memory-heavy, cheap part that selective
        recomputation redoes. `mask`
        (bool, True = attend, broadcast to (B, nh, T, T)) is an encoder's padding mask (`causal` False). A local
        layer (`window`) narrows the causal mask to its band (`visible_keys`); with sinks the softmax is explicit."""
        p = self.dropout if self.training else 0.0
        if self.window or self.sinks is not None:  # a band mask, or sinks: an explicit mask (no causal fast path)
            mask = visible_keys(q.shape[2], k.shape[2], causal, mask, self.window, q.device)
            if self.sinks is not None:
                return self.sink_attention(q, k, v, mask, p)
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                              enable_gqa=self.n_kv_heads != self.n_heads, scale=self.scale)

    def sink_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       p: float) -> torch.Tensor:
        """Softmax attention whose denominator also holds exp(sink) of the head's learned sink logit (gpt-oss):
        a virtual key every query sees, with no value, so a query may put weight on nothing. Explicit (SDPA has
        no such term): scores, the sink as one more column, softmax, the column dropped."""
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)  # (B, nh, T, K)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        sink = self.sinks[self.head_offset:self.head_offset + self.n_heads].to(scores.dtype)
        sink = sink.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(F.dropout(weights, p), v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: AttentionCache | None = None, start: int = 0, mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Causal (a decoder) unless `mask` is given: attention over the keys it allows (an encoder's padding
        mask, or a precomputed `document_causal_mask`).

        Packed documents (training and evaluation, no cache): `positions` (B, T) int64 index the RoPE tables
        per token (each document's from 0); `segments` (B, T) make attention `document_causal_mask(positions,
        positions, segments, segments)` (built here unless `mask` brings it). Both None: as before."""
        if (positions is not None or segments is not None) and cache is not None:
            raise ValueError("positions/segments are for a training or evaluation forward, not the KV cache")
        qkv = self.qkv(x)  # (B, T, (nh + 2·nkv)·hs); T from here: a sequence-parallel qkv gathers the tokens
        B, T, _ = qkv.shape
        q, k, v = qkv.split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:  # per head, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        per_row = isinstance(start, torch.Tensor)  # per-row positions (batched serving): (B,) tensor
        if rope is not None:
            rope = rope[2:] if self.local_rope else rope[:2]  # (cos, sin[, local cos, local sin]): `GPT.rope`
            if positions is not None:
                cos, sin = rope_at(rope, positions)
            elif per_row:
                pos = positions_of(start, T, x.device)
                cos, sin = rope[0][pos].unsqueeze(1), rope[1][pos].unsqueeze(1)  # (B, 1, T, hs)
            else:
                cos, sin = rope[0][start:start + T], rope[1][start:start + T]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if segments is not None and mask is None:
            index = positions if positions is not None else torch.arange(T, device=x.device)
            mask = document_causal_mask(index, index, segments, segments)
        if cache is not None:  # any cache (models/cache.py): it stores k, v and attends over all it holds
            y = cache.update_and_attend(q, k, v, start, self.core, mask)  # (B, nh, T, hs)
        elif per_row:
            raise ValueError("per-row positions need a KV cache")
        else:
            y = self.core(q, k, v, mask is None, mask)  # causal unless a mask is given; (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, nh·hs)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """GeLU: proj(gelu(fc x)) (tanh approximation, or exact with `gelu_exact`); SwiGLU:
    proj(silu(x W_gate) ⊙ x W_up) with fc = [W_gate; W_up]; GeGLU (Gemma) the same with gelu (tanh) for silu."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.gated  # fc = [W_gate; W_up] (SwiGLU, or GeGLU with `geglu`)
        self.geglu = cfg.activation == "geglu"
        self.approximate = "none" if cfg.activation == "gelu_exact" else "tanh"
        ffn = cfg.ffn_size
        self.fc = nn.Linear(cfg.hidden_size, 2 * ffn if self.swiglu else ffn, bias=cfg.bias)
        self.proj = nn.Linear(ffn, cfg.hidden_size, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = (F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)) * up
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)). `mlp`: another module in the
    MLP's place (a mixture of experts, `models/moe.py`); None: the dense `MLP`. `attn`: another attention in
    `Attention`'s place (DeepSeek's latent attention, `models/mla.py`, which the model chooses); None: `Attention`.
    `model.sandwich_norm` (Gemma 2/3): x + post_attn_norm(attn(norm1(x))), then x + post_mlp_norm(mlp(norm2(x)))."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None, layer: int = 0, attn: nn.Module | None = None):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = attn if attn is not None else Attention(cfg, layer)
        self.post_attn_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.norm2 = make_norm(cfg)
        self.mlp = mlp if mlp is not None else MLP(cfg)
        self.post_mlp_norm = make_norm(cfg) if cfg.sandwich_norm else None

    def forward(self, x: torch.Tensor, rope=None, cache: AttentionCache | None = None, start: int = 0, *,
                positions: torch.Tensor | None = None, segments: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Packed documents: `positions`, `segments` and the precomputed `mask` as in `Attention.forward`."""
        y = self.attn(self.norm1(x), rope, cache, start, mask, positions=positions, segments=segments)
        x = x + (y if self.post_attn_norm is None else self.post_attn_norm(y))
        y = self.mlp(self.norm2(x))
        return x + (y if self.post_mlp_norm is None else self.post_mlp_norm(y))


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """LoRA targets of these layers (`tune/lora.py`): name → (the linears' path pattern, the rows of their
    whole weight it updates; None: every row). `q`/`k`/`v` are row blocks of the fused `attn.qkv`;
    `gate`/`up` SwiGLU's halves of `mlp.fc` (with GeLU, `up` is the whole `mlp.fc`)."""
    q, kv, ffn = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn_size
    out = {"q": ("layers.*.attn.qkv", (0, q)), "k": ("layers.*.attn.qkv", (q, q + kv)),
           "v": ("layers.*.attn.qkv", (q + kv, q + 2 * kv)), "qkv": ("layers.*.attn.qkv", None),
           "o": ("layers.*.attn.proj", None), "fc": ("layers.*.mlp.fc", None), "down": ("layers.*.mlp.proj", None)}
    if cfg.gated:
        out.update(gate=("layers.*.mlp.fc", (0, ffn)), up=("layers.*.mlp.fc", (ffn, 2 * ffn)))
    else:
        out["up"] = ("layers.*.mlp.fc", None)
    return out
