"""A model defined only in the test suite: a small post-LN bidirectional encoder, the model file of the toy
family (`toy_family.py` is its families/ module). Like `meshlm/models/gpt.py` it imports only torch and
meshlm's `core` and `models`.

Its attribute names share nothing with GPT's (`words`, `blocks`, `in_proj`, `out_proj`, `up`, `down`,
`ln1`, `ln2`, `out`), its attention is not causal, its norms come after the residual add, and its output
layer is not tied.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.models.init import InitRule, draw_base_seed, fill_


class ToyAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_heads, cfg.head_dim
        self.dropout = 0.0
        self.in_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def core(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)  # every token sees every token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.in_proj(x)  # (B, T, 3·nh·hs), T gathered under sequence parallelism
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.split(self.n_heads * self.head_dim, dim=-1))  # (B, nh, T, hs) each
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.out_proj(y)


class ToyBlock(nn.Module):
    """Post-LN: x = ln1(x + attn(x)); x = ln2(x + down(relu(up(x))))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = ToyAttention(cfg)
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.down(F.relu(self.up(x))))


class ToyEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.init_seed = draw_base_seed()
        with torch.random.fork_rng(devices=[]):
            self.words = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.blocks = nn.ModuleList(ToyBlock(cfg) for _ in range(cfg.n_layers))
            self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if not self.words.weight.is_meta:
            for name, p in self.named_parameters():
                fill_(p.data, init_rule(name, tuple(p.shape), cfg), self.init_seed, name, tuple(p.shape))

    def init_buffers(self, device=None) -> None:
        pass

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.words(ids)

    def run_layers(self, x: torch.Tensor, layer_ids=None) -> torch.Tensor:
        for i in range(len(self.blocks)) if layer_ids is None else layer_ids:
            x = self.blocks[i](x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_layers(self.embed(ids)))


def init_rule(name: str, shape: tuple, cfg: ModelConfig) -> InitRule:
    if len(shape) == 1:
        return InitRule("ones") if name.rsplit(".", 1)[0].split(".")[-1].startswith("ln") and \
            name.endswith("weight") else InitRule("zeros")
    return InitRule("normal", 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("out_proj.weight", "down.weight"))
                    else 0.02)
