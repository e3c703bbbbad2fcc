"""FLOPs of a decoder transformer (Megatron's formula), free of torch: the planner and the trainer share it.

Model FLOPs per step (causal attention counted once; mixture-of-experts layers count their active weights,
`moe_active_mlp_weights`, in place of e·h·f; e = 3 with SwiGLU else 2; k head dim, a query heads,
g KV heads, f MLP width, T tokens, S2 = Σ s_i² = B·s²):
    F = 6·T·[L·(e·h·f + h·(k·a + 2·k·g) + k·a·h) + h·V] + 6·S2·L·k·a
Multi-head latent attention (`core/mla.py`) counts its own weights in place of the h·(k·a + 2·k·g) + k·a·h
and its score width in place of k·a. MFU = F / (time · peak). HFU adds the forward FLOPs that recomputation
does again. Context parallelism leaves F as it is and gives each of its cp ranks 1/cp of it
(`rank_attention_flops`).
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.core.mla import mla_attention_weights, score_width


def layer_flops_per_token(m: ModelConfig, layer: int | None = None) -> float:
    """Forward+backward FLOPs per token of one layer's matmuls (no attention scores, no head): of layer
    `layer`, or (None) the mean over the layers. A mixture-of-experts layer counts its ACTIVE weights:
    the router (E·h), top_k experts and the shared expert (`moe_active_mlp_weights`)."""
    if layer is None:
        return sum(layer_flops_per_token(m, i) for i in range(m.n_layers)) / m.n_layers
    e = 3 if m.activation == "swiglu" else 2
    h, f, k, a, g = m.hidden_size, m.ffn_size, m.head_dim, m.n_heads, m.kv_heads
    mlp = moe_active_mlp_weights(m) if m.is_moe_layer(layer) else e * h * f
    attention = mla_attention_weights(m) if m.attention == "mla" else h * (k * a + 2 * k * g) + k * a * h
    return 6.0 * (mlp + attention)


def moe_active_mlp_weights(m: ModelConfig) -> int:
    """The weights one token's matmuls use in a MoE layer: router E·h, top_k SwiGLU experts 3·h·F, the shared
    expert 3·h·S (and its gate, h)."""
    h, F = m.hidden_size, m.expert_size
    return m.moe_experts * h + (m.moe_top_k + m.moe_shared_experts) * 3 * h * F + (h if m.moe_shared_gate else 0)


def model_flops(m: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Model FLOPs of one training step on `batch` full-length sequences (forward + backward)."""
    s = seq_len or m.seq_len
    tokens = batch * s
    dense = tokens * (m.n_layers * layer_flops_per_token(m) + 6.0 * m.hidden_size * m.vocab_size)
    attention = 6.0 * batch * s * s * m.n_layers * score_width(m)
    return dense + attention


def finetune_flops(m: ModelConfig, batch: int, seq_len: int | None = None, loss_fraction: float = 1.0,
                   frozen: bool = False) -> float:
    """Model FLOPs of a fine-tuning step: the loss covers `loss_fraction` of the row tokens (the answers; the
    prompt and the padding have no target), so the output layer is needed on that share of the tokens only;
    with `frozen` weights (prompt tuning, p-tuning, LoRA) backward computes the activations' gradients but
    no weight gradient, 4 of the 6 FLOPs per weight and token (the adapters' own matmuls are left out:
    they are ~1% of a layer's). Attention scores have no weights: their 6·s²·k·a stays."""
    s = seq_len or m.seq_len
    tokens, per_weight = batch * s, (4.0 if frozen else 6.0) / 6.0
    layers = tokens * m.n_layers * layer_flops_per_token(m) * per_weight
    head = tokens * loss_fraction * 6.0 * m.hidden_size * m.vocab_size * per_weight
    return layers + head + 6.0 * batch * s * s * m.n_layers * score_width(m)


def recompute_flops(m: ModelConfig, batch: int, recompute: str, seq_len: int | None = None,
                    layers: int | None = None) -> float:
    """Extra forward FLOPs done again by activation recomputation (for HFU), over `layers` recomputed
    layers (default every layer; `core.layout.recomputed_layers` counts them)."""
    s = seq_len or m.seq_len
    n = m.n_layers if layers is None else layers
    if recompute == "full":
        per_layer = batch * s * layer_flops_per_token(m) / 3 + 2.0 * batch * s * s * score_width(m)
        return n * per_layer
    if recompute == "selective":  # the attention core only: QKᵀ and ·V, causal counted once
        return n * 2.0 * batch * s * s * score_width(m)
    return 0.0


def stage_costs(m: ModelConfig) -> tuple[float, float]:
    """(first, last) pipeline stage's extra work in layer-equivalents of forward+backward FLOPs per token.

    One layer: its matmuls plus causal attention scores, 6·s·k·a. First stage: the embedding lookups are
    gathers, no FLOPs: 0. Last stage: the LM head, 6·h·V (the final norm and the cross-entropy are
    O(h + V), negligible). E.g. gpt2-1.3b: the head ≈ 2 layers.
    """
    layer = layer_flops_per_token(m) + 6.0 * m.seq_len * score_width(m)
    return 0.0, 6.0 * m.hidden_size * m.vocab_size / layer


def rank_attention_flops(m: ModelConfig, micro_batch: int, seq_len: int | None = None, tp: int = 1,
                         cp: int = 1) -> float:
    """Forward+backward FLOPs of one layer's attention scores (QKᵀ and ·V, causal counted once as in
    `model_flops`) on one rank of a micro-batch: 6·b·s²·k·a / (tp·cp). Under context parallelism the causal
    load balance (rank i holds chunks i and 2·cp−1−i of 2·cp) gives every rank the same 1/cp of them: its
    s/cp queries meet, over the cp ring steps, an equal share of the unmasked keys."""
    s = seq_len or m.seq_len
    return 6.0 * micro_batch * s * s * score_width(m) / (tp * cp)
