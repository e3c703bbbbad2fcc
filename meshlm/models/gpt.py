"""GPT: GPT-2 or Llama style decoder, chosen by `ModelConfig` switches. Reads like nanoGPT.

`forward(idx)` returns logits, and the caller computes the loss, so tensor parallelism can swap in a
vocab-parallel cross-entropy without touching this file. `forward(idx, targets=y)` returns the mean loss
through the fused chunked head + cross-entropy (`models/loss.py`), which never builds the logits; it needs
the whole (tp=1) output layer.
"""

from __future__ import annotations

import torch
from torch import nn

from meshlm.config import ModelConfig
from meshlm.models.layers import Block, KVCache, init_weights, make_norm, rope_tables
from meshlm.models.loss import linear_cross_entropy


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_size) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init_weights(self, cfg.init_std, cfg.n_layers)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.rope_len = 0
        if cfg.position == "rope":
            self._build_rope(cfg.seq_len)

    def _build_rope(self, length: int, device=None) -> None:
        cos, sin = rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.rope_len = length

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def embed(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        x = self.tok_emb(idx)  # (B, T, h)
        if self.pos_emb is not None:
            pos = torch.arange(start, start + idx.shape[1], device=idx.device)
            x = x + self.pos_emb(pos)
        return self.drop(x)

    def rope(self, needed: int):
        if self.cfg.position != "rope":
            return None
        if needed > self.rope_len:
            self._build_rope(needed, self.rope_cos.device)
        return self.rope_cos, self.rope_sin

    def forward(self, idx: torch.Tensor, caches: list[KVCache] | None = None, start: int = 0,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids → logits (B, T, V); with targets (B, T), the mean cross-entropy instead.
        With `caches`, positions start at `start`."""
        T = idx.shape[1]
        if self.pos_emb is not None and start + T > self.cfg.seq_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.embed(idx, start)
        rope = self.rope(start + T)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, caches[i] if caches is not None else None, start)
        if targets is None:
            return self.lm_head(self.norm(x))
        if type(self.lm_head) is not nn.Linear:
            raise RuntimeError("forward(targets=...) fuses the whole output layer; with parallel.tp > 1 compute "
                               "the vocab-parallel loss on forward(idx)'s logits")
        return linear_cross_entropy(self.norm(x), self.lm_head.weight, targets)

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        p = self.tok_emb.weight
        return [KVCache(batch, layer.attn.n_kv_heads, max_len, layer.attn.head_dim, p.dtype, p.device)
                for layer in self.layers]
