"""Memory formulas, the seed of the auto-configurator: model states and activations per layer.

Model states (docs/formulas.md): bytes per parameter for weights, gradients and Adam states (or, under
`optim.name=muon`, Muon's one buffer on the hidden matrices), with and without the distributed optimizer
(ZeRO-1). Activations: Korthikanti et al. 2022, Table 2 (`korthikanti_bytes`, verbatim) and *our* variant
(`activation_terms`), derived term by term from what meshlm's code saves for backward, so that the measured bytes (`meshlm.models.activations`, `meshlm bench memory`,
`benchmarks/activation_memory.py`) can be held to it. docs/memory.md walks through the derivation.

Notation: s sequence length, b micro-batch size, h hidden size, a heads, g KV heads, k = h/a head dim,
f MLP width, t tensor-parallel size, c context-parallel size; per tp rank a_t = a/t query heads, g_t = g/t KV
heads (1 when t > g: KV heads are then replicated), f_t = f/t. Context parallelism gives each rank s/c of
the sequence (two chunks of s/(2c), the causal load balance), so every per-token term counts s/c tokens; the
ring attention saves no s×s scores (docs/memory.md, "Context parallelism"). Under sequence parallelism the
residual stream holds s·b/(c·t) tokens per rank, else s·b/c.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshlm.core.config import Config, ModelConfig
from meshlm.core.layout import full_recompute_chunks
from meshlm.core.mla import mla_activation_terms, mla_attention_parameters

# ---- model states --------------------------------------------------------------------------------------


def parameter_count(m: ModelConfig) -> int:
    """Exact parameter count of `meshlm.models.gpt.GPT(m)` (tied head counted once), from the config; its
    multi-token prediction modules included (`mtp_parameters`)."""
    h, k, f = m.hidden_size, m.head_dim, m.ffn_size
    norm = (2 * h if m.bias else h) if m.norm == "layernorm" else h
    qkv = h * k * (m.n_heads + 2 * m.kv_heads) + (k * (m.n_heads + 2 * m.kv_heads) if m.bias else 0)
    proj = k * m.n_heads * h + (h if m.bias else 0)
    fc_out = 2 * f if m.gated else f
    mlp = h * fc_out + (fc_out if m.bias else 0) + f * h + (h if m.bias else 0)
    layer = 2 * norm + qkv + proj + mlp + (2 * k if m.qk_norm else 0)  # Qwen3's q and k norms: head_dim each
    layer += 2 * norm if m.sandwich_norm else 0  # Gemma's norms on the attention's and the MLP's outputs
    layer += m.n_heads if m.attention_sinks else 0  # gpt-oss's sink logits: one per head
    if m.attention == "mla":  # DeepSeek's latent attention in place of qkv and proj (core/mla.py)
        layer += mla_attention_parameters(m) - qkv - proj
    embed = m.vocab_size * h + (m.seq_len * h if m.position == "learned" else 0)
    head = 0 if m.tie_embeddings else m.vocab_size * h
    n_moe = m.moe_layers()
    return m.n_layers * layer + n_moe * (moe_mlp_parameters(m) - mlp) + embed + norm + head + mtp_parameters(m)


def moe_mlp_parameters(m: ModelConfig, active: bool = False) -> int:
    """Parameters of one MoE layer's MLP (`models/moe.py`): router E·h, E SwiGLU experts of width F (3·h·F
    each), the shared expert (3·h·S) and its gate (h); with moe_bias the router's E and each expert's 2F + h biases.
    `active`: those one token uses (top_k experts)."""
    h, F, E = m.hidden_size, m.expert_size, m.moe_experts
    shared = 3 * h * m.moe_shared_experts * F + (h if m.moe_shared_gate else 0)
    expert = 3 * h * F + ((2 * F + h) if m.moe_bias else 0)
    return E * h + (E if m.moe_bias else 0) + (m.moe_top_k if active else E) * expert + shared


def active_parameter_count(m: ModelConfig) -> int:
    """The parameters one token's computation uses (a mixture of experts' "active" size): `parameter_count`
    less each MoE layer's unrouted experts (E − top_k of them) and less the input embedding table, of which a
    token reads one row (the head's V·h is counted: it is a matmul; a tied table is the head). DeepSeek-V3:
    36.6B of 671B (37.6B with the embedding table; the report says 37B). The main model's: no MTP modules."""
    m = replace(m, mtp_depth=0)
    inactive = m.moe_layers() * (moe_mlp_parameters(m) - moe_mlp_parameters(m, active=True))
    lookup = (0 if m.tie_embeddings else m.vocab_size * m.hidden_size) \
        + (m.seq_len * m.hidden_size if m.position == "learned" else 0)  # learned positions: a lookup too
    return parameter_count(m) - inactive - lookup


def mtp_parameters(m: ModelConfig) -> int:
    """Parameters of the `model.mtp_depth` multi-token prediction modules (models/mtp.py): each a block of the last
    layer's kind (its count in `parameter_count`: the model less the model without its last layer), the 2h → h
    merge and three norms (enorm, hnorm, its output norm); the embedding and the head are the model's own. DeepSeek-
    V3's one module: 11.7B (the report's 14B counts its own copies of the embedding and the head, 2 × 0.93B)."""
    if not m.mtp_depth:
        return 0
    main = replace(m, mtp_depth=0)
    block = parameter_count(main) - parameter_count(replace(main, n_layers=m.n_layers - 1))
    h = m.hidden_size
    norm = (2 * h if m.bias else h) if m.norm == "layernorm" else h
    return m.mtp_depth * (block + 2 * h * h + 3 * norm)


def narayanan_parameter_count(h: int, n_layers: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021: P = 12·L·h²·(1 + 13/(12h) + (V + s)/(12·L·h)) (GPT-2 shapes, f = 4h, tied)."""
    return 12 * n_layers * h ** 2 * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * n_layers * h))


def model_state_bytes_per_param(scheme: str, dp: int = 1, distributed_optimizer: bool = False,
                                muon_share: float = 0.0) -> dict[str, float]:
    """Bytes per parameter of weights, gradients and optimizer states on one data-parallel rank.

    * `mixed` (Megatron's bf16/fp16 with Adam): 16-bit weights 2 + fp32 gradients 4 + fp32 master weights 4
      + Adam m 4 + v 4 = 18; the distributed optimizer (ZeRO-1) shards master weights and Adam over d ranks:
      6 + 12/d.
    * `fp32`: weights 4 + gradients 4 + Adam 8 = 16; ZeRO-1: 8 + 8/d. meshlm's bf16 is autocast over fp32
      weights (no separate master copy), so its states are this scheme too, plus the transient 16-bit casts
      of the weights that autocast makes during the forward (`ActivationReport.param_copy_bytes`).

    `muon_share`: the share of parameters that `optim.name=muon` steps with Muon (the hidden matrices;
    `families.registry.muon_share(cfg)`, 0 for any other optimizer) keeps one fp32 buffer instead of Adam's two, 4·(2 − share) B for the states
    (fp32: 16 − 4·share).
    """
    d = dp if distributed_optimizer else 1
    states = 4.0 * (2.0 - muon_share)  # fp32 optimizer states per parameter: Adam's 8 B, Muon's 4
    if scheme == "mixed":
        return {"weights": 2.0, "grads": 4.0, "optimizer": (4.0 + states) / d}
    if scheme == "fp32":
        return {"weights": 4.0, "grads": 4.0, "optimizer": states / d}
    raise ValueError(f"unknown state scheme {scheme!r}; use 'mixed' or 'fp32'")


def model_state_bytes(n_params: int, scheme: str, dp: int = 1, distributed_optimizer: bool = False,
                      muon_share: float = 0.0) -> dict[str, float]:
    per = model_state_bytes_per_param(scheme, dp, distributed_optimizer, muon_share)
    out = {k: v * n_params for k, v in per.items()}
    out["total"] = sum(out.values())
    return out


# ---- activations: the paper ----------------------------------------------------------------------------


def korthikanti_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer (16-bit, with dropout).

    none: s·b·h·(34 + 5·a·s/h) at t=1, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with TP, s·b·h·(34/t + 5·a·s/(h·t))
    with TP+SP; selective drops the 5·a·s/h scores term; full keeps the layer input only, 2·s·b·h (/t with
    SP, where the stored input is the sequence shard).
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return sbh * ((34 / t if sp else 10 + 24 / t) + scores)


# ---- activations: ours ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per element of each kind of tensor saved for backward (docs/memory.md, "Element sizes").

    residual: the residual stream (layer input, norm inputs): fp32 under autocast too, since the
        embedding and the residual adds stay in the weights' fp32.
    compute: what the matmuls read and write (linear inputs, q/k/v, attention output, MLP intermediates).
    math: the math SDPA backend's operands and s×s tensors (CPU's math kernel upcasts 16-bit to fp32).
    bool_masks: dropout keeps a 1-byte bool mask (CUDA's fused native_dropout) rather than a mask in the
        dropped tensor's own dtype (CPU's at::dropout multiplies by a float mask and saves it).
    stats: norm statistics and the flash logsumexp, fp32 (Korthikanti ignores them: 0).
    """

    residual: int
    compute: int
    math: int
    bool_masks: bool
    stats: int = 4


# The paper's accounting: everything 16-bit, 1-byte masks, small statistics ignored.
KORTHIKANTI_DTYPES = ActivationDtypes(residual=2, compute=2, math=2, bool_masks=True, stats=0)


def activation_dtypes(precision: str, device_type: str, hidden_size: int | None = None) -> ActivationDtypes:
    """What meshlm saves: fp32 everywhere, or autocast (bf16/fp16) over fp32 weights. `auto` is resolved as
    the trainer resolves it on this host (a 16-bit format on a CUDA device)."""
    cuda = device_type == "cuda"
    if precision == "auto":
        import torch

        from meshlm.core.precision import resolve_precision

        precision = "bf16" if cuda else resolve_precision(precision, torch.device("cpu"), hidden_size)[0]
    if precision == "fp32":
        return ActivationDtypes(residual=4, compute=4, math=4, bool_masks=cuda)
    return ActivationDtypes(residual=4, compute=2, math=2 if cuda else 4, bool_masks=cuda)


def attention_backend(device_type: str, dropout: float) -> str:
    """The SDPA kernel that runs: `flash` saves q, k, v, the output and a logsumexp (no s×s tensor);
    `math` materialises the scores. On CPU, PyTorch's flash kernel takes no dropout, so dropout > 0 falls
    back to math; on CUDA the flash/memory-efficient kernels take dropout (they save an RNG seed, not a
    mask)."""
    return "math" if device_type != "cuda" and dropout > 0 else "flash"


@dataclass(frozen=True)
class LayerShape:
    """Per-rank sizes of one transformer layer for a micro-batch. `s` is this rank's share of the sequence:
    the whole sequence, or s/cp under context parallelism (`cp` > 1: the ring attention)."""

    s: int
    b: int
    h: int
    k: int
    a_t: int  # query heads on this rank
    g_t: int  # KV heads on this rank
    f_t: int  # MLP width on this rank
    tokens_residual: int  # tokens in this rank's residual stream: s·b, or s·b/t under SP
    cp: int = 1  # context-parallel ranks the sequence is split over

    @classmethod
    def of(cls, m: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False, seq_len: int | None = None,
           cp: int = 1):
        s = (seq_len or m.seq_len) // cp
        g = m.kv_heads
        return cls(s=s, b=micro_batch, h=m.hidden_size, k=m.head_dim, a_t=m.n_heads // tp,
                   g_t=g // tp if g >= tp else 1, f_t=m.ffn_size // tp,
                   tokens_residual=s * micro_batch // (tp if sp else 1), cp=cp)

    @property
    def tokens(self) -> int:
        return self.s * self.b


def _norm_terms(m: ModelConfig, sh: LayerShape, dt: ActivationDtypes, which: str,
                in_bytes: int | None = None) -> dict[str, float]:
    """A norm over the residual stream's tokens (`in_bytes`: the bytes of its input's elements, when not the fp32
    stream's: the sandwich norms on the attention's and the MLP's outputs). RMSNorm keeps its input in fp32 (the
    stream itself, or the fp32 copy of a 16-bit input); LayerNorm's kernel keeps the input as given (measured on
    CPU's autocast)."""
    r = sh.tokens_residual
    if m.norm == "layernorm":  # fused kernel: input, mean and rstd
        return {f"{which} input": r * sh.h * (in_bytes or dt.residual), f"{which} mean, rstd": 2 * r * dt.stats}
    terms = {f"{which} input": r * sh.h * dt.residual}
    if m.norm_unit_offset:  # Gemma's: the fp32 normalised x times the new (1 + w), cast back after
        terms[f"{which} rsqrt"] = r * dt.stats
        terms[f"{which} normalised x (fp32)"] = r * sh.h * dt.residual
        terms[f"{which} (1 + w)"] = sh.h * dt.stats
    else:  # RMSNorm in plain ops: x·rsqrt(...) then w·(...) keep rsqrt and the normalised x (in x's dtype) too
        terms[f"{which} rsqrt"] = r * dt.stats
        terms[f"{which} normalised x"] = r * sh.h * (in_bytes or dt.residual)
    return terms


def _mask(elements: float, dtype_bytes: int, dt: ActivationDtypes) -> float:
    return elements * (1 if dt.bool_masks else dtype_bytes)


def _attention_terms(m: ModelConfig, sh: LayerShape, dt: ActivationDtypes, backend: str, selective: bool,
                     dropout: bool, local: bool = False) -> dict[str, float]:
    n, k, c = sh.tokens, sh.k, dt.compute
    qkv_heads = sh.a_t + 2 * sh.g_t
    terms = {}
    if m.qk_norm:  # Qwen3's RMSNorm over each q and k head, in fp32 (as the layer norms): its rsqrt, the normalised
        heads = sh.a_t + sh.g_t  # q and k in the compute dtype, and with 16-bit compute the input's fp32 copy;
        terms["q, k norms: rsqrt"] = n * heads * dt.stats  # RoPE after them saves only its cos/sin tables
        if m.norm_unit_offset:  # Gemma's: normalised in fp32, times the new (1 + w) of each norm
            terms["q, k norms: normalised q, k (fp32)"] = n * k * heads * dt.residual
            terms["q, k norms: (1 + w)"] = 2 * k * dt.stats
        else:
            terms["q, k norms: normalised q, k"] = n * k * heads * c
        if c < 4:
            terms["q, k norms: fp32 copy of q, k"] = n * k * heads * 4
    if m.attention_sinks and not selective and sh.cp == 1:  # gpt-oss's explicit softmax (`Attention.sink_attention`)
        return {**terms, **_sink_terms(sh, dt, dropout)}
    ring = sh.cp > 1  # the ring attention saves what a flash kernel saves, whatever runs each block
    if selective or backend == "flash" or ring:  # q, k, v as they enter the core: views of the qkv output
        terms["qkv output (q, k, v views)"] = n * k * qkv_heads * c
        if m.position == "rope":  # RoPE makes new q and k; v stays a view that keeps all of qkv alive
            terms["q, k after RoPE"] = n * k * (sh.a_t + sh.g_t) * c
        if not selective:
            terms["logsumexp (ring)" if ring else "logsumexp (flash)"] = sh.b * sh.a_t * sh.s * dt.stats
    else:  # math backend: its own q·√scale and k·√scale (GQA-expanded), v as (b·a_t, s, k), s×s tensors
        scores = sh.b * sh.a_t * sh.s * sh.s
        terms["q, k copies (math SDPA)"] = 2 * n * k * sh.a_t * dt.math
        # v reshaped to (b·a_t, s, k) is a view of the qkv output when b or a_t is 1, with nothing to expand
        # (GQA) or upcast (CPU's math kernel computes 16-bit in fp32); otherwise a copy.
        if (sh.b == 1 or sh.a_t == 1) and sh.g_t == sh.a_t and dt.math == dt.compute:
            terms["qkv output (v view, math SDPA)"] = n * k * qkv_heads * c
        else:
            terms["v copy (math SDPA)"] = n * k * sh.a_t * dt.math
            if m.qk_norm and c >= 4:  # the q/k norms keep their input, views of the fp32 qkv output
                terms["qkv output (q, k views, the q/k norms' input)"] = n * k * qkv_heads * c
        terms["softmax output"] = scores * dt.math
        if dropout:
            terms["attention dropout mask"] = _mask(scores, dt.math, dt)
            terms["dropped probabilities"] = scores * dt.math
    if local and backend == "flash" and not selective and not ring:  # SDPA makes the band an additive mask
        terms["sliding-window mask (additive)"] = sh.s * sh.s * c
    terms["attention output (proj input)"] = n * k * sh.a_t * c
    return terms


def _sink_terms(sh: LayerShape, dt: ActivationDtypes, dropout: bool) -> dict[str, float]:
    """Attention with sink logits, in plain ops: the batched matmuls keep their own (b·a_t, s, k) copies of q,
    the GQA-expanded k and v (q's is a view of q after RoPE), the (s, s) bool mask, the softmax output with
    the sink column (s + 1 wide), and with dropout its mask and the dropped probabilities; no s×s score
    tensor, no qkv output."""
    n, k, c, scores = sh.tokens, sh.k, dt.compute, sh.b * sh.a_t * sh.s * sh.s
    terms = {"q after RoPE, k copy (sinks)": 2 * n * k * sh.a_t * c, "mask (bool, sinks)": sh.s * sh.s,
             "softmax output with the sink column": sh.b * sh.a_t * sh.s * (sh.s + 1) * c}
    if (sh.b == 1 or sh.a_t == 1) and sh.g_t == sh.a_t:  # v reshaped for the matmul stays a view of qkv's output
        terms["qkv output (v view, sinks)"] = n * k * (sh.a_t + 2 * sh.g_t) * c
    else:
        terms["v copy (sinks)"] = n * k * sh.a_t * c
    if dropout:
        terms["attention dropout mask"] = _mask(scores, c, dt)
        terms["dropped probabilities"] = scores * c
    terms["attention output (proj input)"] = n * k * sh.a_t * c
    return terms


def _mlp_terms(m: ModelConfig, sh: LayerShape, dt: ActivationDtypes) -> dict[str, float]:
    n, f, c = sh.tokens, sh.f_t, dt.compute
    if m.gated:  # SiLU (GeGLU: GeLU) saves the gate, a view of the whole [gate; up] fc output
        act = "SiLU" if m.activation == "swiglu" else "GeLU"
        return {"fc output [gate; up]": n * 2 * f * c, f"{act}(gate)": n * f * c,
                f"{act}(gate)·up (proj input)": n * f * c}
    return {"fc output (GeLU input)": n * f * c, "GeLU output (proj input)": n * f * c}


def _moe_terms(m: ModelConfig, sh: LayerShape, dt: ActivationDtypes) -> dict[str, float]:
    """A mixture-of-experts MLP (`models/moe.py`), counted at A = n·k assignments (exact dropless, whatever
    the balance; an upper bound with capacity). The router in fp32 (autocast off): its input (the norm's output,
    fp32 at least), its probabilities (softmax output or sigmoid scores), the renormalised top-k weights and
    their sum, the z-loss's logits and logsumexp and the aux loss's expert shares when they are on; per
    assignment the gathered input row, the expert's activation (SwiGLU: [gate; up], SiLU(gate), the proj input;
    gpt-oss's clamped SwiGLU three more: `_expert_activation`), the expert output (the weighting's input; the
    weighted sum saves only its index, `moe.add_rows`), the sorted weight and the int64 indices (top-k, sort order,
    sorted token ids); the shared expert as a dense SwiGLU (and its gate), each 16-bit linear casting its own copy
    of the fp32 input under autocast."""
    # the layer's tokens are the residual stream's: under sequence parallelism the MoE routes its shard (parallel/expert.py)
    n, c, E, k, F, h = sh.tokens_residual, dt.compute, m.moe_experts, m.moe_top_k, m.expert_size, sh.h
    A = n * k
    terms = {"router input (fp32)": n * h * max(dt.residual, 4),
             "router probabilities (fp32)": n * E * 4, "expert input rows (gathered)": A * h * c,
             **_expert_activation(m, A, c), "expert output (weighting input)": A * h * c,
             "sorted weights (fp32)": A * 4, "indices (int64): top-k, sort order, sorted tokens": (n * k + 2 * A) * 8}
    if m.moe_norm_topk:
        terms["top-k weights, their sum (fp32)"] = (A + n) * 4
    if m.moe_aux_loss > 0:  # (the sigmoid router's selection, group limits included, saves nothing: no grad)
        terms["aux loss: expert shares" + (", score sums" if m.moe_router == "sigmoid" else "")] = \
            E * 4 + (n * 4 if m.moe_router == "sigmoid" else 0)
    if m.moe_z_loss > 0:
        terms["z-loss logits, logsumexp (fp32)"] = n * (E + 1) * 4
    if m.moe_capacity_factor > 0:
        terms["kept assignments (bool mask)"] = A
    S = m.moe_shared_experts * F
    cast = n * h * c if c < max(dt.residual, 4) else 0  # a 16-bit linear's own copy of its input
    if S:
        terms["shared expert input (16-bit copy), [gate; up], SiLU, proj input"] = cast + n * 4 * S * c
        if m.moe_shared_gate:
            terms["shared gate input (16-bit copy), sigmoid, shared output"] = cast + n * (1 + h) * c
    return terms


def _expert_activation(m: ModelConfig, A: float, c: int) -> dict[str, float]:
    """What a routed expert's activation saves for A assignments of width F: SwiGLU's [gate; up] (2F; SiLU saves
    the gate, a view), SiLU(gate) and the product (the proj input); gpt-oss's clamped SwiGLU (gate ≤ limit,
    up in ±limit, (up + 1)·gate·σ(α·gate)) keeps [gate; up] (the clamps' inputs), the clamped gate, up + 1,
    σ(α·gate), (up + 1)·gate and the proj input: 7F against 4F. Biases save nothing."""
    F = m.expert_size
    if m.moe_activation == "swiglu_clamped":
        return {"expert fc output [gate; up], clamped gate, up + 1, sigmoid, (up + 1)·gate, proj input": A * 7 * F * c}
    return {"expert fc output [gate; up], SiLU(gate), proj input": A * 4 * F * c}


def activation_terms(m: ModelConfig, micro_batch: int, tp: int = 1, sp: bool = False, recompute: str = "none",
                     dtypes: ActivationDtypes | None = None, backend: str | None = None,
                     seq_len: int | None = None, cp: int = 1, moe: bool = False,
                     local: bool = False) -> dict[str, float]:
    """Bytes saved for backward by one transformer layer on one tp rank, by term (docs/memory.md).

    `recompute='full'` gives a layer that starts a checkpoint region (its input only); a layer inside a
    region but not first saves nothing, a layer outside any region the `none` terms (`layer_activation_bytes`).
    The inputs of qkv and fc are the residual stream's tokens: under SP the column-parallel linears keep
    the sequence shard and all-gather it again in backward (`parallel.tensor._GatherSeqLinear`, as Megatron).
    `cp` > 1 (context parallelism): every term counts this rank's s/cp tokens, and the attention core is the
    ring, which saves the local q, k, v, its output and one logsumexp per query, never the s×s scores (it
    recomputes each ring step's block in backward, as Megatron's does): the bytes are exactly 1/cp of the
    flash kernel's at cp = 1. `moe`: the layer's MLP is a mixture of experts (`_moe_terms`). `local`: the layer
    attends over a sliding window (its band mask); `model.attention_sinks`: `_sink_terms` in place of SDPA's.
    """
    dt = dtypes or activation_dtypes("fp32", "cpu")
    backend = backend or attention_backend("cpu", m.dropout)
    sh = LayerShape.of(m, micro_batch, tp, sp, seq_len, cp)
    residual = sh.tokens_residual * sh.h
    if recompute == "full":
        return {"layer input (checkpoint)": residual * dt.residual}
    dropout = m.dropout > 0
    linear_in = residual * dt.compute  # replicated (TP: a view of the norm output), or the SP shard
    # Residual dropout acts on the row-parallel output: the linear's dtype, except that with tp > 1 the
    # bias is added after the reduction, outside autocast's linear, and promotes it to the fp32 weights'.
    proj_out = dt.residual if tp > 1 and m.bias else dt.compute
    terms = _norm_terms(m, sh, dt, "norm1")
    if m.attention == "mla":
        terms.update(mla_activation_terms(m, sh.tokens, sh.b, sh.s, sh.a_t, dt, backend, recompute == "selective",
                                          dropout))
    else:
        terms["qkv input"] = linear_in
        terms.update(_attention_terms(m, sh, dt, backend, recompute == "selective", dropout, local))
    if dropout:
        terms["attention residual dropout mask"] = _mask(residual, proj_out, dt)
    if m.sandwich_norm:
        terms.update(_norm_terms(m, sh, dt, "post-attention norm", proj_out))
    terms.update(_norm_terms(m, sh, dt, "norm2"))
    if moe:  # the router's fp32 input in place of a 16-bit linear's
        terms.update(_moe_terms(m, sh, dt))
    else:
        terms["fc input"] = linear_in
        terms.update(_mlp_terms(m, sh, dt))
    if dropout and not moe:
        terms["MLP residual dropout mask"] = _mask(residual, proj_out, dt)
    if m.sandwich_norm:
        terms.update(_norm_terms(m, sh, dt, "post-MLP norm", proj_out))
    return terms


def layer_activation_bytes(cfg: Config, micro_batch: int | None = None, n_layers: int | None = None,
                           dtypes: ActivationDtypes | None = None, backend: str | None = None,
                           device_type: str = "cpu") -> list[float]:
    """Bytes saved for backward by each layer of a stage of `n_layers` (default all) under `cfg`."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n = n_layers or m.n_layers
    kw = {"micro_batch": micro_batch or t.micro_batch_size, "tp": p.tp, "sp": p.sp, "cp": p.cp,
          "dtypes": dtypes or activation_dtypes(t.precision, device_type, m.hidden_size),
          "backend": backend or attention_backend(device_type, m.dropout)}
    kinds = [(m.is_moe_layer(i), m.layer_window(i) > 0) for i in range(n)]  # a stage's layers as the model's first n
    if t.recompute != "full":
        return [sum(activation_terms(m, recompute=t.recompute, moe=e, local=w, **kw).values()) for e, w in kinds]
    out = [sum(activation_terms(m, recompute="none", moe=e, local=w, **kw).values()) for e, w in kinds]
    region_input = sum(activation_terms(m, recompute="full", **kw).values())
    for chunk in full_recompute_chunks(n, t.recompute_method, t.recompute_num_layers):
        out[chunk[0]] = region_input
        for i in chunk[1:]:
            out[i] = 0.0
    return out


def mtp_activation_terms(m: ModelConfig, micro_batch: int, depth: int = 1, tp: int = 1, sp: bool = False,
                         recompute: str = "none", dtypes: ActivationDtypes | None = None, backend: str | None = None,
                         seq_len: int | None = None, cp: int = 1, head_keeps_h: bool = False) -> dict[str, float]:
    """Bytes saved for backward by multi-token prediction module `depth` (1..D; models/mtp.py) on one tp rank: its
    forward, as `meshlm bench memory`'s "mtp k" row counts it (the embedding lookup of its tokens, its output norm
    and the shared head run outside it, like the main model's final norm and head).

    * enorm over the embeddings e (fp32, the table's dtype): as a layer's norm, its input included;
    * hnorm over h, the previous depth's stream: its input is first kept here only at depth 1, and only when the
      head did not keep the main model's normed output itself (`head_keeps_h`: the unfused head under tp > 1 in
      fp32; the fused head keeps its finished gradients, a 16-bit linear its own copy); at depth ≥ 2 h is the
      previous module's block output, which that module's output norm keeps;
    * the merge's input, the two normed halves side by side: `2·n·h·c`;
    * the block, of the last layer's kind (MoE, window; `activation_terms`); its stream is the main model's dtype
      (the merge output cast back), so it saves what the last layer saves. `recompute`: the block's mode (`full`:
      it is its own checkpoint region, its input alone saved)."""
    dt = dtypes or activation_dtypes("fp32", "cpu")
    sh = LayerShape.of(m, micro_batch, tp, sp, seq_len, cp)
    last = m.n_layers - 1
    enorm, hnorm = _norm_terms(m, sh, dt, "enorm"), _norm_terms(m, sh, dt, "hnorm")
    if depth > 1 or head_keeps_h:
        del hnorm["hnorm input"]
    terms = {**enorm, **hnorm, "merge input [enorm(e); hnorm(h)]": sh.tokens_residual * 2 * sh.h * dt.compute}
    block = activation_terms(m, micro_batch, tp, sp, recompute, dt, backend, seq_len, cp, moe=m.is_moe_layer(last),
                             local=m.layer_window(last) > 0)
    terms.update({f"block: {name}": value for name, value in block.items()})
    return terms


def mtp_activation_bytes(cfg: Config, micro_batch: int | None = None, dtypes: ActivationDtypes | None = None,
                         backend: str | None = None, device_type: str = "cpu") -> list[float]:
    """Bytes saved for backward by each of the `model.mtp_depth` modules under `cfg` (`mtp_activation_terms`): the
    block recomputed as `parallel.recompute` does it (selective: its attention core; full: its own region when
    every layer is, `recompute_num_layers` 0, else stored); the model computes its own loss (trainer.py), fused at
    tp = 1, so the head keeps the main output h only under tp > 1 and in fp32."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    dt = dtypes or activation_dtypes(t.precision, device_type, m.hidden_size)
    mode = t.recompute if t.recompute != "full" or not t.recompute_num_layers else "none"
    head_keeps_h = p.tp > 1 and dt.compute >= dt.residual
    return [sum(mtp_activation_terms(m, micro_batch or t.micro_batch_size, k, p.tp, p.sp, mode, dt,
                                     backend or attention_backend(device_type, m.dropout), cp=p.cp,
                                     head_keeps_h=head_keeps_h).values()) for k in range(1, m.mtp_depth + 1)]


def pipeline_activation_factor(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Micro-batches' worth of activations the first stage holds: min(p, m) in 1F1B, times
    (1 + (p − 1)/(p·v)) when interleaved over v virtual stages (Korthikanti et al. 2022, §4.2.3)."""
    held = min(pp, micro_batches)
    return held * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else float(held)


# ---- context parallelism: the ring's transient buffers, a rank's activations ----------------------------


def ring_buffer_bytes(m: ModelConfig, micro_batch: int, tp: int = 1, cp: int = 1,
                      dtypes: ActivationDtypes | None = None, backend: str | None = None,
                      seq_len: int | None = None) -> dict[str, float]:
    """The ring attention's transient memory on one rank while one layer's attention runs (cp > 1; else {}):
    not saved for backward, so counted once per rank, not per layer or micro-batch.

    * KV blocks in flight: the block being computed on and the one being received, each K and V of this
      rank's s/cp tokens and g_t KV heads (only the KV heads travel under GQA): 2 · 2·b·(s/cp)·g_t·k·c; in
      backward dK and dV travel with them, twice that: `4·b·(s/cp)·g_t·k·c` forward, `8·…` backward (the peak).
    * With the math kernel (which materialises scores), the one (s/cp) × (s/cp) block being computed:
      `b·a_t·(s/cp)²` elements of the softmax (and, with dropout, its mask and the dropped probabilities).
    """
    if cp <= 1:
        return {}
    dt = dtypes or activation_dtypes("fp32", "cpu")
    backend = backend or attention_backend("cpu", m.dropout)
    sh = LayerShape.of(m, micro_batch, tp, False, seq_len, cp)
    block = 2 * sh.b * sh.s * sh.g_t * sh.k * dt.compute  # one rank's K and V
    out = {"ring KV blocks in flight (K, V, dK, dV)": 2 * 2 * block}
    if backend == "math":
        scores = sh.b * sh.a_t * sh.s * sh.s
        per = dt.math + ((_mask(1, dt.math, dt) + dt.math) if m.dropout > 0 else 0)
        out["ring score block in flight"] = scores * per
    return out


def ring_send_bytes(m: ModelConfig, micro_batch: int, tp: int = 1, cp: int = 1, dtypes: ActivationDtypes | None = None,
                    seq_len: int | None = None) -> dict[str, float]:
    """Bytes one rank sends around the cp ring for one layer and one micro-batch (docs/memory.md, "Context
    parallelism"), as `parallel/context.py` sends them: in forward cp − 1 blocks of K and V, `block` =
    2·(s/cp)·b·g_t·k·c bytes each; in backward the same cp − 1 blocks of K and V again and cp blocks of
    their gradients dK, dV (each rank's accumulated sum travels one hop per ring step, and a last hop brings
    every rank its own keys' gradients), accumulated and sent in fp32 at least: `grad_block` =
    2·(s/cp)·b·g_t·k·max(c, 4)."""
    if cp <= 1:
        return {"forward": 0.0, "backward": 0.0, "block": 0.0, "grad_block": 0.0}
    dt = dtypes or activation_dtypes("fp32", "cpu")
    sh = LayerShape.of(m, micro_batch, tp, False, seq_len, cp)
    block = 2.0 * sh.s * sh.b * sh.g_t * sh.k * dt.compute
    grad_block = block * max(dt.compute, 4) / dt.compute
    return {"forward": (cp - 1) * block, "backward": (cp - 1) * block + cp * grad_block, "block": block,
            "grad_block": grad_block}


def activation_bytes_per_rank(m: ModelConfig, micro_batch: int, n_layers: int, tp: int = 1, sp: bool = False,
                              recompute: str = "none", dtypes: ActivationDtypes | None = None,
                              backend: str | None = None, seq_len: int | None = None,
                              cp: int = 1) -> dict[str, float]:
    """One micro-batch's activations on one rank of `n_layers` layers (full: every layer its own checkpoint
    region), the formula a context-parallel benchmark compares measured bytes with: the layers' saved bytes
    (`activation_terms` at this rank's s/cp tokens), the ring's transient buffers (`ring_buffer_bytes`), and
    their total."""
    per_layer = sum(activation_terms(m, micro_batch, tp, sp, recompute, dtypes, backend, seq_len, cp).values())
    out = {"layers": n_layers * per_layer}
    out.update(ring_buffer_bytes(m, micro_batch, tp, cp, dtypes, backend, seq_len))
    out["total"] = sum(out.values())
    return out
