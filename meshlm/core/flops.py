"""FLOPs of a decoder transformer (Megatron's formula), free of torch: the planner and the trainer share it.

Model FLOPs per step (causal attention counted once; mixture-of-experts layers count their active weights,
`moe_active_mlp_weights`, in place of e·h·f; e = 3 with SwiGLU or GeGLU else 2; k head dim, a query heads,
g KV heads, f MLP width, T tokens, S2 = Σ s_i² = B·s²):
    F = 6·T·[L·(e·h·f + h·(k·a + 2·k·g) + k·a·h) + h·V] + 6·S2·L·k·a
A sliding-window layer (window W, `model.sliding_window`) counts the query-key pairs its band holds, s·w − w²/2
with w = min(s, W), in place of the causal s²/2 (`causal_pairs`): its scores cost 12·k·a·(s·w − w²/2).
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
    e = 3 if m.gated else 2  # SwiGLU, GeGLU: [gate; up] and proj
    h, f, k, a, g = m.hidden_size, m.ffn_size, m.head_dim, m.n_heads, m.kv_heads
    mlp = moe_active_mlp_weights(m) if m.is_moe_layer(layer) else e * h * f
    attention = mla_attention_weights(m) if m.attention == "mla" else h * (k * a + 2 * k * g) + k * a * h
    return 6.0 * (mlp + attention)


def moe_active_mlp_weights(m: ModelConfig) -> int:
    """The weights one token's matmuls use in a MoE layer: router E·h, top_k SwiGLU experts 3·h·F, the shared
    expert 3·h·S (and its gate, h)."""
    h, F = m.hidden_size, m.expert_size
    return m.moe_experts * h + (m.moe_top_k + m.moe_shared_experts) * 3 * h * F + (h if m.moe_shared_gate else 0)


def mtp_flops_per_token(m: ModelConfig) -> float:
    """Forward+backward matmul FLOPs per token of the `model.mtp_depth` multi-token prediction modules
    (models/mtp.py): each its block's (the last layer's kind, `layer_flops_per_token`), the 2h → h merge's
    6·2h·h and the shared head's 6·h·V once more; their attention scores are the last layer's (`mtp_score_flops`)."""
    h = m.hidden_size
    return m.mtp_depth * (layer_flops_per_token(m, m.n_layers - 1) + 6.0 * 2 * h * h + 6.0 * h * m.vocab_size)


def mtp_score_flops(m: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Forward+backward FLOPs of the MTP modules' attention scores on `batch` sequences: each module's block is of
    the last layer's kind, so it counts the last layer's pairs (its window's band when that layer is local)."""
    pairs = causal_pairs(seq_len or m.seq_len, m.layer_window(m.n_layers - 1))
    return m.mtp_depth * 12.0 * batch * pairs * score_width(m)


def causal_pairs(s: int, window: int = 0) -> float:
    """Query-key pairs a causal layer's scores need over a sequence of `s`, in the continuum convention of
    Megatron's count (s²/2 for a global layer, the diagonal's s/2 left out): with a window W > 0 each query sees
    min(i + 1, W) keys, s·w − w²/2 pairs with w = min(s, W) (exactly s·W − W·(W − 1)/2; W ≥ s gives s²/2)."""
    w = min(s, window) if window > 0 else s
    return s * w - w * w / 2.0


def attention_score_flops(m: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Forward+backward FLOPs of every layer's attention scores (QKᵀ and ·V) on `batch` sequences: per layer
    12·k·a·causal_pairs(s, its window) per sequence, 6·s²·k·a for a global layer as in `model_flops`'s formula."""
    s = seq_len or m.seq_len
    windows = {}  # window → layers with it (0: global)
    for i in range(m.n_layers):
        w = m.layer_window(i)
        windows[w] = windows.get(w, 0) + 1
    pairs = sum(n * causal_pairs(s, w) for w, n in windows.items())
    return 12.0 * batch * pairs * score_width(m)


def model_flops(m: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Model FLOPs of one training step on `batch` full-length sequences (forward + backward); with
    `model.mtp_depth`, its modules' (`mtp_flops_per_token`, and each module's attention scores as the last layer's,
    `mtp_score_flops`)."""
    s = seq_len or m.seq_len
    tokens = batch * s
    dense = tokens * (m.n_layers * layer_flops_per_token(m) + 6.0 * m.hidden_size * m.vocab_size)
    scores = attention_score_flops(m, batch, s)
    mtp = tokens * mtp_flops_per_token(m) + mtp_score_flops(m, batch, s) if m.mtp_depth else 0.0
    return dense + scores + mtp


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
    return layers + head + attention_score_flops(m, batch, s)


def recompute_flops(m: ModelConfig, batch: int, recompute: str, seq_len: int | None = None,
                    layers: int | None = None) -> float:
    """Extra forward FLOPs done again by activation recomputation (for HFU), over `layers` recomputed
    layers (default every layer; `core.layout.recomputed_layers` counts them)."""
    s = seq_len or m.seq_len
    n = m.n_layers if layers is None else layers
    scores = attention_score_flops(m, batch, s) / m.n_layers / 3  # a layer's forward scores (the mean layer)
    if recompute == "full":
        return n * (batch * s * layer_flops_per_token(m) / 3 + scores)
    if recompute == "selective":  # the attention core only: QKᵀ and ·V, causal counted once
        return n * scores
    return 0.0


def stage_costs(m: ModelConfig) -> tuple[float, float]:
    """(first, last) pipeline stage's extra work in layer-equivalents of forward+backward FLOPs per token.

    One layer: its matmuls plus causal attention scores, 6·s·k·a. First stage: the embedding lookups are
    gathers, no FLOPs: 0. Last stage: the LM head, 6·h·V (the final norm and the cross-entropy are
    O(h + V), negligible). E.g. gpt2-1.3b: the head ≈ 2 layers. The MTP modules (`model.mtp_depth`) run on the last
    stage beside the head they share: each a layer, its merge and the head once more (`mtp_flops_per_token`).
    """
    layer = layer_flops_per_token(m) + attention_score_flops(m, 1) / (m.n_layers * m.seq_len)
    mtp = mtp_flops_per_token(m) + mtp_score_flops(m, 1) / m.seq_len
    return 0.0, (6.0 * m.hidden_size * m.vocab_size + mtp) / layer


def rank_attention_flops(m: ModelConfig, micro_batch: int, seq_len: int | None = None, tp: int = 1,
                         cp: int = 1) -> float:
    """Forward+backward FLOPs of one layer's attention scores (QKᵀ and ·V, causal counted once as in
    `model_flops`) on one rank of a micro-batch: 6·b·s²·k·a / (tp·cp). Under context parallelism the causal
    load balance (rank i holds chunks i and 2·cp−1−i of 2·cp) gives every rank the same 1/cp of them: its
    s/cp queries meet, over the cp ring steps, an equal share of the unmasked keys."""
    s = seq_len or m.seq_len
    return attention_score_flops(m, micro_batch, s) / m.n_layers / (tp * cp)
