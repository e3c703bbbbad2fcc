"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3): attention through low-rank latents.

For each token x (hidden h), with n heads, d_n = qk_nope_head_dim, d_r = qk_rope_head_dim, d_v = v_head_dim:

    q   = W_q x                         (q_lora_rank 0)       or   W_uq · RMSNorm(W_dq x)        (n·(d_n + d_r))
    [c; k_r] = W_dkv x                   c: the kv latent (kv_lora_rank), k_r: ONE rope key (d_r) for all heads
    [k_n; v] = W_ukv · RMSNorm(c)        per head k_n (d_n) and v (d_v)
    q_h = [q_n; RoPE(q_r)],  k_h = [k_n; RoPE(k_r)]
    y   = W_o [softmax(q_h k_hᵀ · s) v_h]_h,   s = 1/√(d_n + d_r) · mscale²

mscale = 0.1 · rope_mscale_all_dim · ln(rope_factor) + 1 under YaRN (1 otherwise). The rope part of q and of
[c; k_r] comes out of the projections in DeepSeek's interleaved layout (pairs (0, 1), (2, 3), ...) when
`model.rope_interleave` (Hugging Face's default for V3): it is de-interleaved (evens, then odds) before the
rotate-half RoPE, which is how transformers computes it, so checkpoints convert without permuting rows.

Module names (read by parallel/, interop/ and the formulas): `q` (h → n·(d_n+d_r)) or `q_down` (h → q_lora_rank),
`q_norm`, `q_up` (q_lora_rank → n·(d_n+d_r)); `kv_down` (h → kv_lora_rank + d_r), `kv_norm`, `kv_up`
(kv_lora_rank → n·(d_n+d_v), per head [k_n; v]); `proj` (n·d_v → h). No biases. Tensor parallelism splits
heads (`families.styles.HeadParallelLatentAttention`): `q`/`q_up`/`kv_up` column-parallel, `proj` row-parallel,
the down projections and their norms replicated, every rank computing them whole (Megatron-Core's
"duplicated" down projections); under sequence parallelism the tokens are gathered once, before them.

Two forms, one module. The training form builds full per-head keys and values and hands them to any cache
(models/cache.py) as n_heads keys and values of width `head_dim` = max(d_n + d_r, d_v) (the narrower
zero-padded; zeros change neither q·k nor the output, which is cut back to d_v): training, `meshlm generate`'s
cache, the draft model's. A cache that says `latent` (the serving engine's pool, models/paged.py) gets the
absorbed form instead, and holds per token only ĉ = RMSNorm(c) and RoPE(k_r): kv_lora_rank + d_r elements
for all the heads (`latent_dim`), against 2·n·head_dim. With W_ukv's rows per head split as [W_uk_h; W_uv_h]:

    q_h·k_h = q_n,h·(W_uk_h ĉ) + q_r,h·k_r = (W_uk_hᵀ q_n,h)·ĉ + q_r,h·k_r = [W_uk_hᵀ q_n,h; q_r,h]·[ĉ; k_r]
    Σ_j p_j v_h,j = W_uv_h (Σ_j p_j ĉ_j)

so attention runs as multi-query attention of n heads of width r + d_r over ONE cached key [ĉ; k_r] whose first
r columns are also the value, and W_uv_h is applied to each head's output afterwards (`_absorbed`). Every
step, prefill chunks included, uses this form (DeepSeek-V2's and vLLM's decode path; vLLM prefills through the
up-projected form instead, which spends fewer FLOPs on long chunks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import MLA_LORA_TARGETS, ModelConfig
from meshlm.models.cache import AttentionCache
from meshlm.models.layers import RMSNorm, apply_rope, document_causal_mask, positions_of, rope_at
from meshlm.models.layers import lora_targets as attention_lora_targets

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm use RMSNorm's default, not rms_norm_eps


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/√(d_n + d_r), times YaRN's mscale² when rope_scaling is yarn and rope_mscale_all_dim is set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim and cfg.rope_factor > 1:
        mscale = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
        scale *= mscale * mscale
    return scale


# LoRA targets on MLA's linears, named as Hugging Face DeepSeek-V3's modules (so PEFT's target_modules read alike)
MLA_LORA_MODULES = dict(zip(MLA_LORA_TARGETS, ("q", "q_down", "q_up", "kv_down", "kv_up")))


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """A GPT layer's LoRA targets (`tune/lora.py`; name → (path pattern, rows or None: all)): those of
    `layers.lora_targets`, and under `model.attention='mla'` MLA's linears in place of the fused qkv's q/k/v/qkv,
    which MLA does not have: `q_proj` (no q compression) or `q_a_proj`/`q_b_proj` (q_down/q_up), `kv_a_proj_with_mqa`
    (kv_down, latent and rope key) and `kv_b_proj` (kv_up); `o` stays the output projection, the MLP's names the
    MLP's."""
    targets = attention_lora_targets(cfg)
    if cfg.attention != "mla":
        return targets
    for name in ("q", "k", "v", "qkv"):
        del targets[name]
    present = {"q_a_proj", "q_b_proj"} if cfg.q_lora_rank > 0 else {"q_proj"}
    for name, module in MLA_LORA_MODULES.items():
        if name.startswith("kv") or name in present:
            targets[name] = (f"layers.*.attn.{module}", None)
    return targets


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) in pairs (x0, x1), (x2, x3), ... → (x0, x2, ..., x1, x3, ...): the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """MLA (module doc). `n_heads` is the heads this module holds (tensor parallelism lowers it per rank);
    `n_kv_heads` (= n_heads) and `head_dim` describe what it hands a KV cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, n = cfg.hidden_size, cfg.n_heads
        self.n_heads, self.n_kv_heads = n, n
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        self.head_dim = max(self.qk_dim, self.v_dim)  # the width a cache stores per head
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        self.latent_dim = self.kv_rank + self.rope_dim  # what a latent cache stores per token (all heads)
        self.q_compressed = cfg.q_lora_rank > 0
        if self.q_compressed:
            self.q_down = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_up = nn.Linear(cfg.q_lora_rank, n * self.qk_dim, bias=False)
        else:
            self.q = nn.Linear(h, n * self.qk_dim, bias=False)
        self.kv_down = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, n * (self.nope_dim + self.v_dim), bias=False)
        self.proj = nn.Linear(n * self.v_dim, h, bias=False)
        # Identities in one process; tensor parallelism swaps in its operators (parallel/styles.py): under sequence
        # parallelism the tokens are gathered before the replicated down projections, and the shared rope key,
        # used by this rank's heads only, gets its gradient summed over tp (Megatron's `f`).
        self.gather_input = nn.Identity()
        self.rope_key_region = nn.Identity()
        self.scale = mla_softmax_scale(cfg)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q kᵀ · s) v over (B, nh, T, head_dim) tensors (padded widths contribute zeros)."""
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                              scale=self.scale)

    def _queries_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, d_n+d_r) with its rope part last, k_n (B, nh, T, d_n), k_r (B, 1, T, d_r), v (B, nh, T, d_v);
        the rope parts de-interleaved, not yet rotated."""
        x = self.gather_input(x)  # (B, T, h): under sequence parallelism, the whole sequence
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_compressed else self.q(x)  # (B, T, nh·(d_n+d_r))
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.qk_dim).transpose(1, 2)  # (B, nh, T, d_n+d_r)
        latent, k_r = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, r), (B, T, d_r)
        kv = self.kv_up(self.kv_norm(latent)).view(B, T, self.n_heads, self.nope_dim + self.v_dim)
        k_n, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)  # (B, nh, T, d_n), (B, nh, T, d_v)
        k_r = self.rope_key_region(k_r).view(B, 1, T, self.rope_dim)  # (B, 1, T, d_r): one rope key for every head
        if self.interleave:
            q = torch.cat((q[..., :self.nope_dim], deinterleave(q[..., self.nope_dim:])), dim=-1)
            k_r = deinterleave(k_r)
        return q, k_n, k_r, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: AttentionCache | None = None, start: int = 0, mask: torch.Tensor | None = None, *,
                positions: torch.Tensor | None = None, segments: torch.Tensor | None = None) -> torch.Tensor:
        """As `layers.Attention.forward` (causal unless `mask`; packed documents by `positions`/`segments`;
        any cache), with `rope` tables qk_rope_head_dim wide."""
        if (positions is not None or segments is not None) and cache is not None:
            raise ValueError("positions/segments are for a training or evaluation forward, not the KV cache")
        if cache is not None and getattr(cache, "latent", False):
            return self._absorbed(x, rope, cache, start, mask)
        q, k_n, k_r, v = self._queries_keys_values(x)
        B, _, T, _ = q.shape
        per_row = isinstance(start, torch.Tensor)
        if positions is not None:
            cos, sin = rope_at(rope, positions)
        elif per_row:
            cos, sin = rope_at(rope, positions_of(start, T, x.device))
        else:
            cos, sin = rope[0][start:start + T], rope[1][start:start + T]
        q = torch.cat((q[..., :self.nope_dim], apply_rope(q[..., self.nope_dim:], cos, sin)), dim=-1)
        k_r = apply_rope(k_r, cos, sin).expand(B, self.n_heads, T, self.rope_dim)
        k = torch.cat((k_n, k_r), dim=-1)  # (B, nh, T, d_n+d_r)
        q, k, v = (F.pad(t, (0, self.head_dim - t.shape[-1])) for t in (q, k, v))  # (B, nh, T, head_dim)
        if segments is not None and mask is None:
            index = positions if positions is not None else torch.arange(T, device=x.device)
            mask = document_causal_mask(index, index, segments, segments)
        if cache is not None:
            y = cache.update_and_attend(q, k, v, start, self.core, mask)
        elif per_row:
            raise ValueError("per-row positions need a KV cache")
        else:
            y = self.core(q, k, v, mask is None, mask)  # (B, nh, T, head_dim)
        y = y[..., :self.v_dim].transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)  # (B, T, nh·d_v)
        return self.resid_dropout(self.proj(y))

    def latent_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
        """The absorbed form's attention: q (B, nh, T, r + d_r) over one latent key k (B, 1, L, r + d_r) and value
        v (B, 1, L, r) → (B, nh, T, r), at MLA's softmax scale (not 1/√(r + d_r)). Every head reads the same key,
        so the heads run as nh·T queries of one head: on the CPU SDPA's `enable_gqa` with one KV head was ~8×
        slower at 16 heads × 1,024 positions (benchmarks/mla_decode.py)."""
        B, nh, T, D = q.shape
        L = k.shape[2]
        if causal:  # query t sits at position L - T + t
            mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
        if mask is not None:
            mask = mask.expand(B, nh, T, L).reshape(B, 1, nh * T, L)
        y = F.scaled_dot_product_attention(q.reshape(B, 1, nh * T, D), k, v, attn_mask=mask, scale=self.scale)
        return y.view(B, nh, T, v.shape[-1])  # (B, nh, T, r)

    def _absorbed(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache, start,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """The forward through a latent cache (module doc): the cache stores [ĉ; RoPE(k_r)] (B, 1, T, r + d_r) and
        attends with the absorbed queries [W_ukᵀ q_n; RoPE(q_r)]; W_uv maps each head's latent output to d_v."""
        x = self.gather_input(x)  # (B, T, h)
        q = self.q_up(self.q_norm(self.q_down(x))) if self.q_compressed else self.q(x)  # (B, T, nh·(d_n+d_r))
        B, T, _ = q.shape
        q = q.view(B, T, self.n_heads, self.qk_dim).transpose(1, 2)  # (B, nh, T, d_n+d_r)
        q_n, q_r = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_r = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)  # (B, T, r), (B, T, d_r)
        k_r = k_r.view(B, 1, T, self.rope_dim)
        if self.interleave:
            q_r, k_r = deinterleave(q_r), deinterleave(k_r)
        if isinstance(start, torch.Tensor):
            cos, sin = rope_at(rope, positions_of(start, T, x.device))
        else:
            cos, sin = rope[0][start:start + T], rope[1][start:start + T]
        if hasattr(self.kv_up, "_lora_hook"):  # a training LoRA (tune/lora.py) on kv_up acts on its output only
            raise ValueError("an MLA layer's kv_up (kv_b_proj) carries a LoRA served unmerged, which the latent cache's "
                             "absorbed form cannot apply; merge that adapter into the checkpoint or drop kv_b_proj "
                             "from its targets")
        w = self.kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)  # per head [W_uk; W_uv]
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)  # (nh, d_n, r), (nh, d_v, r)
        q_latent = torch.matmul(q_n, w_uk.to(q.dtype))  # (B, nh, T, r): W_ukᵀ q_n per head
        q = torch.cat((q_latent, apply_rope(q_r, cos, sin)), dim=-1)  # (B, nh, T, r + d_r)
        key = torch.cat((self.kv_norm(latent).view(B, 1, T, self.kv_rank), apply_rope(k_r, cos, sin)), dim=-1)
        y = cache.update_and_attend(q, key, None, start, self.latent_core, mask)  # (B, nh, T, r)
        y = torch.matmul(y, w_uv.transpose(1, 2).to(y.dtype))  # (B, nh, T, d_v)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)  # (B, T, nh·d_v)
        return self.resid_dropout(self.proj(y))
