"""GPT: GPT-2 or Llama style decoder, chosen by `ModelConfig` switches. Reads like nanoGPT.

`forward(idx)` returns logits, and the caller computes the loss, so tensor parallelism can swap in a
vocab-parallel cross-entropy without touching this file. `forward(idx, targets=y)` returns the mean loss
through the fused chunked head + cross-entropy (`models/loss.py`), which never builds the logits; it needs
the whole (tp=1) output layer. The forward is three steps, `embed` → `run_layers` → `head` (or
`head_loss`), which the pipeline stages call on their part of the model (`families/spec.py`).

Initialisation is per parameter and seeded (`models/init.py`): `GPT(cfg)` draws one base seed from the
global generator and fills every parameter from it, so a model built on the meta device and materialised
shard by shard on several ranks (`parallel.build_model`) holds exactly the slices of this one.
At the bottom, `GPT_SPEC` tells the rest of meshlm how this family is parallelised and trained.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.models.init import InitRule, draw_base_seed, init_parameters
from meshlm.models.layers import Block, KVCache, document_causal_mask, make_norm, positions_of, rope_tables
from meshlm.models.loss import linear_cross_entropy, linear_cross_entropy_sum
from meshlm.models.mla import MultiHeadLatentAttention
from meshlm.models.moe import MoE
from meshlm.models.mtp import MultiTokenPrediction


class GPT(nn.Module):
    """Besides the family protocol (`families/spec.py`), two switches a trainer or tuner sets:

    * `loss_on_target_rows` (default False): `head_loss` runs the output layer on the rows whose target is
      not ignored only (fine-tuning rows, mostly prompt and padding); the loss is the same;
    * `prompt`: a submodule slot, empty by default; a module put there (`add_module("prompt", m)`, e.g.
      `meshlm tune`'s virtual tokens) is called by `embed` as `m(idx, token_embeddings, start)` and returns
      the token embeddings to use, before positions are added and dropout drawn.
    """

    loss_on_target_rows: bool

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.init_seed = draw_base_seed()  # the one draw from the global generator (also on the meta device)
        with torch.random.fork_rng(devices=[]):  # the modules' own default init must not move the generator
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_size) if cfg.position == "learned" else None
            self.drop = nn.Dropout(cfg.dropout)
            self.layers = nn.ModuleList(Block(cfg, MoE(cfg) if cfg.is_moe_layer(i) else None, i,
                                              MultiHeadLatentAttention(cfg) if cfg.attention == "mla" else None)
                                        for i in range(cfg.n_layers))  # MoE layers: models/moe.py
            self.norm = make_norm(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            # DeepSeek-V3's multi-token prediction modules (models/mtp.py): training only, and serving's draft
            self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_depth else None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.register_module("prompt", None)  # empty: no virtual tokens (see the class doc)
        self.loss_on_target_rows = False
        self.logits_loss = None  # tensor parallelism's vocab-parallel cross-entropy on split logits (`head_loss`)
        # first-stage modules the last pipeline stage also reads: the embedding the MTP modules share
        self.head_reads = ("tok_emb",) if cfg.mtp_depth else ()
        self.rope_len = 0
        self.init_buffers()
        if not self.tok_emb.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter from `init_seed` by `init_rule` (the same values any shard of it would get)."""
        init_parameters(self, init_rule)

    def init_buffers(self, device: torch.device | None = None) -> None:
        """The RoPE tables (not saved in checkpoints), on `device` (default: the parameters'); the sigmoid
        routers' selection bias starts at 0."""
        for layer in self.layers:
            if isinstance(getattr(layer, "mlp", None), MoE):  # (a pipeline stage holds None for others' layers)
                layer.mlp.router.reset_bias()
        if self.cfg.position == "rope":
            device = device or next(self.parameters()).device
            self._build_rope(max(self.cfg.seq_len, self.rope_len), device)

    def _build_rope(self, length: int, device=None) -> None:
        cos, sin = rope_tables(self.cfg.rope_dim, length, self.cfg.rope_theta, device, scaling=self.cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.cfg.rope_local_theta:  # Gemma 3: the local layers' own base, without the global layers' scaling
            cos, sin = rope_tables(self.cfg.rope_dim, length, self.cfg.rope_local_theta, device)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        self.rope_len = length

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    def embed(self, idx: torch.Tensor, start: int = 0, *, positions: torch.Tensor | None = None,
              segments: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings. `positions` (B, T): each token's position (packed
        documents: in its document), in place of start, start + 1, …; `segments` is accepted for a uniform
        call and unused here."""
        x = self.tok_emb(idx)  # (B, T, h), or (B, T/t, h) under sequence parallelism
        if self.prompt is not None:  # virtual tokens in place of their placeholders' embeddings
            x = self.prompt(idx, x, start)
        if self.cfg.embed_scale:  # Gemma: × √hidden_size, the factor rounded to the embeddings' dtype first
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype, device=x.device)
        if self.pos_emb is not None:
            if positions is None:
                positions = positions_of(start, idx.shape[1], idx.device)  # start: int, or (B,) per row
            x = x + self.pos_emb(positions)  # (T,) or (B, T); under SP each rank looks up its part
        return self.drop(x)

    def rope(self, needed: int):
        """The RoPE tables the layers take, (cos, sin), with the local layers' (cos, sin) after them when
        `model.rope_local_theta` sets their own base (`Attention.local_rope`); None without RoPE."""
        if self.cfg.position != "rope":
            return None
        if needed > self.rope_len:
            self._build_rope(needed, self.rope_cos.device)
        if self.cfg.rope_local_theta:
            return self.rope_cos, self.rope_sin, self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def run_layers(self, x: torch.Tensor, layer_ids=None, caches: list[KVCache] | None = None, start: int = 0,
                   rope=None, *, positions: torch.Tensor | None = None,
                   segments: torch.Tensor | None = None) -> torch.Tensor:
        """The residual stream through layers `layer_ids` (default: all), positions from `start`, or per
        token (`positions` (B, T), RoPE only) with attention within documents (`segments` (B, T): the mask
        is built once here and shared by the layers)."""
        rope = rope if rope is not None else self.rope(self.rope_len)
        mask = None  # packed documents: one mask for every layer (Attention refuses them with a KV cache)
        if segments is not None:
            index = positions if positions is not None else torch.arange(segments.shape[-1], device=segments.device)
            mask = document_causal_mask(index, index, segments, segments)  # (B, 1, T, T)
        for i in range(len(self.layers)) if layer_ids is None else layer_ids:
            x = self.layers[i](x, rope, caches[i] if caches is not None else None, start, positions=positions,
                               segments=segments, mask=mask)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, V), or (B, T, V/t) under tensor parallelism

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of `head(x)` without building the logits (the whole output layer; under tensor
        parallelism, with `logits_loss` set, on the split logits). In training with multi-token prediction its
        gradient also carries λ/D Σ CE_k (value: the main loss; `models/mtp.py`)."""
        h = self.norm(x)
        if self.mtp is None or not self.training:
            return self.normed_loss(h, targets)
        rope = self.rope(self.rope_len)
        if isinstance(self.lm_head, nn.Linear):  # the whole head: the main loss and every depth's in one fused call, which
            states, goals = self.mtp.states(h, targets, self.tok_emb, rope)  # keeps one weight gradient, not 1 + D
            D = len(self.mtp)
            total, values = linear_cross_entropy_sum([h, *states], self.lm_head.weight, [targets, *goals],
                                                     [1.0] + [self.mtp.loss_weight / D] * D, self.loss_on_target_rows)
            self.mtp.record(list(values[1:]))
            return (total - total.detach()) + values[0]  # the gradient of main + λ/D Σ CE_k, the value of main
        loss = self.normed_loss(h, targets)
        losses = self.mtp.losses(h, targets, self.tok_emb, self.normed_loss, rope)
        self.mtp.record(losses)
        return self.mtp.objective(loss, losses)

    def normed_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The output layer's mean cross-entropy on normed states h (B, T, h): fused for the whole layer, else
        `logits_loss` on its split logits (set by tensor parallelism for the model's own loss path)."""
        if isinstance(self.lm_head, nn.Linear):  # (a serving subclass too: infer/rows.py's, the same product)
            return linear_cross_entropy(h, self.lm_head.weight, targets, target_rows=self.loss_on_target_rows)
        if self.logits_loss is None:
            raise RuntimeError("forward(targets=...) fuses the whole output layer; with parallel.tp > 1 compute "
                               "the vocab-parallel loss on forward(idx)'s logits")
        return self.logits_loss(self.lm_head(h), targets)

    def forward(self, idx: torch.Tensor, caches: list[KVCache] | None = None, start: int = 0,
                targets: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """idx: (B, T) token ids → logits (B, T, V); with targets (B, T), the mean cross-entropy instead.
        With `caches`, positions start at `start`: an int, or a (B,) tensor of per-row positions (serving).
        Packed documents (no cache): `positions` (B, T) int64, each token's position in its document, and
        `segments` (B, T), its document's id in the row (`data.documents.document_positions`)."""
        T = idx.shape[1]
        end = (int(start.max()) if isinstance(start, torch.Tensor) else start) + T
        if self.pos_emb is not None and end > self.cfg.seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.run_layers(self.embed(idx, start, positions=positions), None, caches, start, self.rope(end),
                            positions=positions, segments=segments)
        return self.head(x) if targets is None else self.head_loss(x, targets)

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        p = self.tok_emb.weight
        return [KVCache(batch, layer.attn.n_kv_heads, max_len, layer.attn.head_dim, p.dtype, p.device)
                for layer in self.layers]


def init_rule(name: str, shape: tuple, cfg: ModelConfig) -> InitRule:
    """GPT-2/Megatron init: N(0, std) everywhere, output projections N(0, std/√(2L)) (the experts' `proj` too),
    biases 0 (the experts' stacked `fc_bias`/`proj_bias` too), norms 1 (0 with `model.norm_unit_offset`: Gemma's
    norms scale by 1 + w); MoE routers N(0, std)."""
    if len(shape) == 1 or name.endswith("_bias"):
        unit = "norm" in name and name.endswith("weight") and not cfg.norm_unit_offset
        return InitRule("ones") if unit else InitRule("zeros")
    if name.endswith(("proj.weight", "experts.proj")):
        return InitRule("normal", cfg.init_std / math.sqrt(2 * cfg.n_layers))
    return InitRule("normal", cfg.init_std)
