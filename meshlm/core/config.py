"""One config, validated per concern.

Frozen dataclasses per section (`model`, `train`, `optim`, `data`, `parallel`), loaded from a TOML file
under `configs/` and overridden with `--section.key=value` on the command line. Every section validates
itself and raises `ConfigError` naming the key and the fix; the CLI prints that one line and exits 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tempfile
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from meshlm.core.errors import ConfigError
from meshlm.core.layout import check_config, divisors  # the layout rules live there, once (torch-free)

# The evaluation sets meshlm ships (built by `eval/sets.py`), by name → the task that scores them; named here so
# that `train.eval_tasks` is validated with the rest of the config.
EVAL_SETS = {"shakespeare-cloze": "cloze", "shakespeare-choice": "choice"}
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # the repository's configs/
DEFAULT_CONFIG = "gpt-tiny"


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choices(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")


INT_MAX = 2 ** 63 - 1  # torch and numpy hold counts in int64
SEED_MAX = 2 ** 32 - 1  # numpy's seeds are 32-bit


def _default(obj: object, key: str) -> Any:
    return next(f.default for f in fields(obj) if f.name == key)


def _positive(section: str, obj: object, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        _check(value > 0, f"{section}.{key}={value} must be positive; e.g. {section}.{key}={_default(obj, key)} "
                          "(the default)")


def _non_negative(section: str, obj: object, *keys: str, zero: str = "0 disables") -> None:
    for key in keys:
        value = getattr(obj, key)
        _check(value >= 0, f"{section}.{key}={value} must be >= 0 ({zero})")


def _non_empty(section: str, obj: object, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        _check(value.strip() != "", f"{section}.{key}={value!r} is empty; give a value (or leave the key out "
                                    "for the default)")


def check_output_dir(key: str, path: str) -> None:
    """`path` is, or can become, a writable directory: not a file, below no file, in a writable parent."""
    target = Path(path).expanduser()
    _check(not target.exists() or target.is_dir(),
           f"{key}={path!r} is an existing file, not a directory; choose a directory path")
    parent = target
    while not parent.exists():
        parent = parent.parent
    _check(parent.is_dir(), f"{key}={path!r} lies below the file {str(parent)!r}; choose a directory path")
    _check(os.access(parent, os.W_OK | os.X_OK),
           f"{key}={path!r} cannot be created or written ({str(parent)!r} is not writable); choose another path")
    if parent != target:  # access() can say yes where mkdir fails (/proc, /sys, read-only mounts, root): try it
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".meshlm-probe-", dir=parent))
        except OSError as err:
            raise ConfigError(f"{key}={path!r} cannot be created ({err.strerror or err} in {str(parent)!r}); choose "
                              "another path") from None


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of the transformer (GPT-2 style by default, Llama style by switches).

    `family` names the model family (`meshlm.families.registry`): its model class and how it is parallelised."""

    family: str = "gpt"
    vocab_size: int = 50257
    n_layers: int = 4
    hidden_size: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: multi-head attention (= n_heads)
    ffn_hidden_size: int | None = None  # None: 4h for GeLU, Llama's 8h/3 rounded to 64 for SwiGLU
    seq_len: int = 128
    dropout: float = 0.0
    position: str = "learned"  # learned | rope
    norm: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu (tanh approximation, GPT-2) | gelu_exact (erf, BERT) | swiglu | geglu (Gemma)
    bias: bool = True
    # Qwen3: an RMSNorm over each head's queries and another over its keys (head_dim wide, weights shared by the
    # heads, eps norm_eps), after the projection and before RoPE (models/layers.py `Attention`). rmsnorm models only.
    qk_norm: bool = False
    # The width of each attention head; 0: hidden_size / n_heads. Qwen3 sets it apart (Qwen3-0.6B: hidden 1024,
    # 16 heads of 128): q, k, v are n_heads·head_size (n_kv_heads·head_size) wide, the output projection maps
    # n_heads·head_size back to hidden_size.
    head_size: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; models/mla.py): attention = mha (models/layers.py `Attention`)
    # | mla. MLA compresses queries through a q_lora_rank latent (0: a plain query projection, as DeepSeek-V2-Lite)
    # and keys/values through a kv_lora_rank latent; each head's query/key is qk_nope_head_dim wide without
    # position plus qk_rope_head_dim with RoPE (the rope key shared by all heads), its value v_head_dim wide.
    # rope_interleave: the rope dims come out of the projections in DeepSeek's interleaved pairs (HF's default).
    # rope_mscale_all_dim: YaRN's mscale_all_dim; with model.rope_scaling='yarn' the softmax scale is multiplied
    # by (0.1 · rope_mscale_all_dim · ln(rope_factor) + 1)².
    attention: str = "mha"
    # Sliding-window attention (Mistral, Gemma 3, gpt-oss): sliding_window = W > 0 makes a local layer's query at
    # position i see keys i - W + 1 .. i (W keys, itself included; transformers' Mistral), 0: every layer global.
    # window_pattern = N > 0: layer i (from 0) is global when (i + 1) % N == 0, local otherwise (Gemma 3: 6, five
    # local to one global; gpt-oss: 2, alternating from a local layer 0); 0: every layer local (Mistral).
    # attention_sinks (gpt-oss): a learned logit per head added to each softmax's denominator (a key with no value).
    sliding_window: int = 0
    window_pattern: int = 0
    attention_sinks: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    rope_mscale_all_dim: float = 0.0
    # DeepSeek-V3's multi-token prediction (models/mtp.py): mtp_depth modules after the last layer, module k
    # (1..D) predicting the token k + 1 ahead; λ/D × the sum of their cross-entropies joins the training loss's
    # gradient (λ = mtp_loss_weight; the logged loss stays the main one, `mtp_loss` is logged apart). 0: none.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # Gemma 3's layer (GPT family; models/layers.py, docs/architecture.md): norm_unit_offset makes every RMSNorm scale
    # by (1 + w) (weights start at 0), computed in fp32 and cast back; sandwich_norm adds a norm on the attention's
    # and the MLP's outputs before each residual add (post_attn_norm, post_mlp_norm); embed_scale multiplies the
    # token embeddings by √hidden_size (rounded to their dtype); attn_scale_dim d makes the softmax scale 1/√d
    # (Gemma's query_pre_attn_scalar; 0: 1/√head_dim); rope_local_theta > 0 is the RoPE base of the local
    # (sliding-window) layers, which then rotate without rope_scaling (0: every layer rope_theta and its scaling).
    norm_unit_offset: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    attn_scale_dim: float = 0.0
    rope_local_theta: float = 0.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # RoPE scaling for long-context extension (docs/long_context.md): none | llama3 | yarn. `rope_factor` is the
    # extension factor s, `rope_original_len` the context the model was pretrained with (Hugging Face's
    # original_max_position_embeddings); Llama 3 blends by wavelength between the low/high frequency factors,
    # YaRN ramps between beta_fast and beta_slow rotations and scales cos/sin by `rope_attention_factor`
    # (0: YaRN's 0.1 ln(s) + 1).
    rope_scaling: str = "none"  # none | linear (positions / rope_factor; Gemma 3's global layers) | llama3 | yarn
    rope_factor: float = 1.0
    rope_original_len: int = 0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True  # YaRN's ramp ends rounded to whole dims (the paper); false: kept fractional (gpt-oss)
    init_std: float = 0.02
    # Mixture of experts (GPT family only; models/moe.py, docs/moe.md). 0 experts: dense. Layer i (from 0) is MoE
    # when i >= moe_first_dense and (i + 1) % moe_every == 0; its MLP is a router over moe_experts SwiGLU experts
    # (moe_expert_hidden wide, 0: ffn_size), moe_top_k per token, plus moe_shared_experts × that width of shared
    # expert (optionally sigmoid-gated). Router softmax (Mixtral) or sigmoid + a per-expert selection bias updated
    # by moe_bias_rate after each step (DeepSeek-V3). Losses: moe_aux_loss × E·Σ f_i·P_i, moe_z_loss × z-loss.
    # moe_capacity_factor 0: dropless; > 0: each expert takes at most ceil(cf·tokens·top_k/E) assignments.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_first_dense: int = 0
    moe_expert_hidden: int = 0
    moe_shared_experts: int = 0
    moe_shared_gate: bool = False
    moe_router: str = "softmax"  # softmax | sigmoid
    moe_norm_topk: bool = True
    moe_aux_loss: float = 0.01
    moe_z_loss: float = 0.0
    moe_capacity_factor: float = 0.0
    moe_bias_rate: float = 1e-3
    moe_routed_scale: float = 1.0  # the routed experts' weights × this (DeepSeek-V3's routed_scaling_factor)
    # DeepSeek-V3's group-limited routing (sigmoid router): the experts form moe_groups equal groups, each scored by
    # the sum of its two best selection scores; a token picks its top_k among the moe_topk_groups best groups only.
    moe_groups: int = 1
    moe_topk_groups: int = 1
    # gpt-oss's experts: moe_bias adds a bias to the router's logits and to each routed expert's two projections;
    # moe_activation 'swiglu' (silu(gate)·up) or 'swiglu_clamped': gate ≤ limit, -limit ≤ up ≤ limit, then
    # (up + 1)·gate·sigmoid(alpha·gate), with limit moe_swiglu_limit and alpha moe_swiglu_alpha (routed experts only).
    moe_bias: bool = False
    moe_activation: str = "swiglu"  # swiglu | swiglu_clamped
    moe_swiglu_limit: float = 7.0
    moe_swiglu_alpha: float = 1.702
    # BERT family only (models/bert.py):
    type_vocab_size: int = 2  # token-type (segment) embeddings
    bert_head: str = "pretrain"  # pretrain (MLM + sentence order) | mlm | classify | span | tokens | encoder
    num_labels: int = 2  # classify / tokens heads: classes (classify with 1: regression)
    pooling: str = "cls"  # sentence embeddings (`meshlm embed`): cls (the pooler's input token) | mean
    normalize_embeddings: bool = False  # `meshlm embed`: unit-length vectors

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """Each attention head's width: model.head_size, or hidden_size / n_heads when that is 0."""
        return self.head_size or self.hidden_size // self.n_heads

    @property
    def gated(self) -> bool:
        """The MLP is gated, fc = [W_gate; W_up]: SwiGLU (silu(gate)·up) or GeGLU (gelu_tanh(gate)·up)."""
        return self.activation in ("swiglu", "geglu")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.gated:
            return 64 * ((8 * self.hidden_size // 3 + 63) // 64)
        return 4 * self.hidden_size

    def validate(self) -> None:
        _positive("model", self, "vocab_size", "n_layers", "hidden_size", "n_heads", "seq_len", "norm_eps",
                  "rope_theta", "init_std")
        _check(self.ffn_hidden_size is None or self.ffn_hidden_size > 0,
               f"model.ffn_hidden_size={self.ffn_hidden_size} must be positive; or leave it out for the default "
               "(4 × hidden_size for gelu, about 8/3 × hidden_size for swiglu)")
        _check(self.norm_eps < 1, f"model.norm_eps={self.norm_eps} must be below 1 (typically 1e-5 or 1e-6)")
        _check(self.init_std <= 1, f"model.init_std={self.init_std} must be at most 1 (typically 0.02)")
        _non_negative("model", self, "head_size", zero="0 gives hidden_size / n_heads")
        _check(self.head_size > 0 or self.hidden_size % self.n_heads == 0,
               f"model.hidden_size={self.hidden_size} is not divisible by model.n_heads={self.n_heads}; "
               f"choose n_heads among {divisors(self.hidden_size)} (or set model.head_size)")
        _check(self.n_kv_heads is None or (self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0),
               f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")
        _choices("model.position", self.position, ("learned", "rope"))
        _choices("model.norm", self.norm, ("layernorm", "rmsnorm"))
        _choices("model.activation", self.activation, ("gelu", "gelu_exact", "swiglu", "geglu"))
        _positive("model", self, "type_vocab_size", "num_labels")
        _choices("model.bert_head", self.bert_head, ("pretrain", "mlm", "classify", "span", "tokens", "encoder"))
        _choices("model.pooling", self.pooling, ("cls", "mean"))
        _check(self.position != "rope" or self.attention == "mla" or self.head_dim % 2 == 0,
               f"model.position='rope' needs an even head dim, got {self.head_dim}; change model.n_heads (or model.head_size)")
        self._validate_mla()
        self._validate_qk_norm()
        self._validate_window()
        self._validate_rope_scaling()
        self._validate_gemma()
        self._validate_moe()
        _non_negative("model", self, "mtp_depth", zero="0 turns multi-token prediction off")
        _check(self.mtp_loss_weight >= 0, f"model.mtp_loss_weight={self.mtp_loss_weight} must be at least 0 "
               "(DeepSeek-V3: 0.3, then 0.1); set a non-negative weight")

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: each head's (MLA: its qk_rope_head_dim part)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def _validate_mla(self) -> None:
        _choices("model.attention", self.attention, ("mha", "mla"))
        _non_negative("model", self, "q_lora_rank", "rope_mscale_all_dim", zero="0 turns it off")
        _non_negative("model", self, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention == "mha":
            return
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check(getattr(self, key) > 0, f"model.attention='mla' needs model.{key} > 0 (DeepSeek-V3: "
                   "kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128); set it")
        _check(self.position == "rope", f"model.attention='mla' rotates its decoupled rope key, but "
               f"model.position={self.position!r}; set model.position='rope'")
        _check(self.qk_rope_head_dim % 2 == 0, f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even "
               "(RoPE rotates pairs)")
        _check(not self.qk_norm and self.n_kv_heads in (None, self.n_heads) and not self.head_size,
               "model.attention='mla' has its own head widths and one key/value per head; leave model.qk_norm, "
               "model.n_kv_heads and model.head_size unset")
        _check(not self.bias, "model.attention='mla' has no biases (DeepSeek's attention_bias=false); set model.bias=false")

    def _validate_qk_norm(self) -> None:
        _check(not self.qk_norm or self.norm == "rmsnorm", f"model.qk_norm=true normalises heads with RMSNorm "
               f"(Qwen3), but model.norm={self.norm!r}; set model.norm='rmsnorm' or model.qk_norm=false")

    def _validate_window(self) -> None:
        _non_negative("model", self, "sliding_window", "window_pattern", zero="0 turns it off")
        _check(not self.window_pattern or self.sliding_window, f"model.window_pattern={self.window_pattern} says "
               "which layers are local, but model.sliding_window=0; set the window or window_pattern=0")
        if self.sliding_window or self.attention_sinks:  # (BERT refuses them when built, models/bert.py)
            _check(self.attention == "mha", "model.sliding_window and model.attention_sinks are for Attention, but "
                   f"model.attention={self.attention!r}; set model.sliding_window=0, model.attention_sinks=false")

    def _validate_gemma(self) -> None:
        _non_negative("model", self, "attn_scale_dim", zero="0 gives 1/√head_dim")
        _non_negative("model", self, "rope_local_theta", zero="0 gives every layer model.rope_theta")
        _check(not self.norm_unit_offset or self.norm == "rmsnorm", "model.norm_unit_offset=true scales RMSNorm "
               f"by (1 + w) (Gemma), but model.norm={self.norm!r}; set model.norm='rmsnorm' or model.norm_unit_offset=false")
        if self.attention == "mla":
            _check(not self.norm_unit_offset and not self.attn_scale_dim, "model.norm_unit_offset and "
                   "model.attn_scale_dim are for Attention (Gemma), but model.attention='mla' has its own norms and "
                   "scale; set model.norm_unit_offset=false, model.attn_scale_dim=0")
        if self.rope_local_theta:
            _check(self.position == "rope" and self.sliding_window > 0, f"model.rope_local_theta="
                   f"{self.rope_local_theta} is the RoPE base of the local layers, but model.position="
                   f"{self.position!r}, model.sliding_window={self.sliding_window}; set model.position='rope' and "
                   "model.sliding_window, or model.rope_local_theta=0")

    def layer_window(self, i: int) -> int:
        """The sliding window of layer i (from 0): `sliding_window` for a local layer, 0 for a global one."""
        if not self.sliding_window or (self.window_pattern and (i + 1) % self.window_pattern == 0):
            return 0
        return self.sliding_window

    @property
    def expert_size(self) -> int:
        """One routed expert's SwiGLU width (moe_expert_hidden, 0: ffn_size)."""
        return self.moe_expert_hidden or self.ffn_size

    def moe_layers(self, n: int | None = None) -> int:
        """How many of the first n layers (default all) are MoE, in closed form (no loop over the layers: a
        config with a billion layers is refused by the memory check, not counted one by one)."""
        n = self.n_layers if n is None else n
        if self.moe_experts == 0 or n <= self.moe_first_dense:
            return 0
        return n // self.moe_every - self.moe_first_dense // self.moe_every

    def is_moe_layer(self, i: int) -> bool:
        """Layer i (from 0) is a mixture of experts (Qwen2-MoE's decoder_sparse_step, DeepSeek's first_k_dense)."""
        return self.moe_experts > 0 and i >= self.moe_first_dense and (i + 1) % self.moe_every == 0

    def _validate_moe(self) -> None:
        _non_negative("model", self, "moe_experts", "moe_first_dense", "moe_expert_hidden", "moe_shared_experts",
                      "moe_aux_loss", "moe_z_loss", "moe_capacity_factor", "moe_bias_rate", zero="0 turns it off")
        _positive("model", self, "moe_top_k", "moe_every", "moe_routed_scale", "moe_groups", "moe_topk_groups")
        _choices("model.moe_router", self.moe_router, ("softmax", "sigmoid"))
        _choices("model.moe_activation", self.moe_activation, ("swiglu", "swiglu_clamped"))
        _positive("model", self, "moe_swiglu_limit", "moe_swiglu_alpha")
        if self.moe_experts == 0:
            _check(not self.moe_bias and self.moe_activation == "swiglu", "model.moe_bias and model.moe_activation "
                   "are for the experts, but model.moe_experts=0; set model.moe_bias=false, model.moe_activation='swiglu'")
            return
        _check(self.moe_activation == "swiglu" or not self.moe_shared_experts, "model.moe_activation='swiglu_clamped' "
               "is for the routed experts (gpt-oss has no shared expert); set model.moe_shared_experts=0")
        self._validate_moe_groups()
        E = self.moe_experts
        _check(self.moe_top_k <= E, f"model.moe_top_k={self.moe_top_k} exceeds model.moe_experts={E} (each token "
               f"picks top_k distinct experts); set model.moe_top_k <= {E}")
        _check(self.moe_layers() > 0,
               f"model.moe_experts={E} but no layer is MoE (model.moe_first_dense={self.moe_first_dense}, "
               f"model.moe_every={self.moe_every}, model.n_layers={self.n_layers}); lower moe_first_dense or moe_every")
        _check(not self.moe_shared_gate or self.moe_shared_experts > 0,
               "model.moe_shared_gate=true gates the shared expert, but model.moe_shared_experts=0; set "
               "model.moe_shared_experts=1 or model.moe_shared_gate=false")
        _check(self.moe_capacity_factor == 0 or self.moe_capacity_factor >= 1.0 / E,
               f"model.moe_capacity_factor={self.moe_capacity_factor} leaves experts no room; use 0 (dropless) or "
               "a factor around 1.0-2.0")

    def _validate_moe_groups(self) -> None:
        G, E = self.moe_groups, self.moe_experts
        if G == 1:
            return
        _check(self.moe_router == "sigmoid", f"model.moe_groups={G} limits the sigmoid router's choice (DeepSeek-V3); "
               "set model.moe_router='sigmoid' or model.moe_groups=1")
        _check(E % G == 0 and E // G >= 2, f"model.moe_groups={G} must split model.moe_experts={E} into equal "
               f"groups of at least 2; choose among {[d for d in range(1, E // 2 + 1) if E % d == 0]}")
        _check(self.moe_topk_groups <= G and self.moe_top_k <= self.moe_topk_groups * E // G,
               f"model.moe_topk_groups={self.moe_topk_groups} must be at most model.moe_groups={G} and hold "
               f"model.moe_top_k={self.moe_top_k} experts; raise it")

    def _validate_rope_scaling(self) -> None:
        _choices("model.rope_scaling", self.rope_scaling, ("none", "linear", "llama3", "yarn"))
        _check(self.rope_factor >= 1, f"model.rope_factor={self.rope_factor} must be at least 1 (the context "
               "extension factor, e.g. 8 for Llama 3.1)")
        _check(self.rope_original_len >= 0, f"model.rope_original_len={self.rope_original_len} must be the "
               "context length the model was pretrained with (e.g. 8192), or 0 without scaling")
        _positive("model", self, "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow")
        _check(self.rope_attention_factor >= 0, f"model.rope_attention_factor={self.rope_attention_factor} must "
               "be positive, or 0 for YaRN's 0.1 ln(rope_factor) + 1")
        _check(self.rope_truncate or self.rope_scaling == "yarn", "model.rope_truncate=false keeps YaRN's ramp ends "
               "fractional (gpt-oss); set model.rope_scaling='yarn' or model.rope_truncate=true")
        if self.rope_scaling == "none":
            return
        name = f"model.rope_scaling={self.rope_scaling!r}"
        _check(self.position == "rope", f"{name} scales rotary positions; set model.position='rope' or "
               "model.rope_scaling='none'")
        _check(self.rope_original_len > 0 or self.rope_scaling == "linear", f"{name} needs model.rope_original_len, "
               "the context length the model was pretrained with (e.g. 8192 for Llama 3)")
        if self.rope_scaling == "llama3":
            _check(self.rope_low_freq_factor < self.rope_high_freq_factor,
                   f"model.rope_low_freq_factor={self.rope_low_freq_factor} and model.rope_high_freq_factor="
                   f"{self.rope_high_freq_factor} need 0 < low < high (Llama 3: 1 and 4)")
        else:
            _check(self.rope_beta_slow < self.rope_beta_fast,
                   f"model.rope_beta_slow={self.rope_beta_slow} and model.rope_beta_fast={self.rope_beta_fast} "
                   "need 0 < beta_slow < beta_fast (YaRN: 1 and 32)")

@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 300  # with train.time_budget_s: the cap (the data are prepared for this many steps)
    # > 0: seconds for the whole command (set-up, steps, final evaluation, checkpoint, sample); the run times its
    # first steps, then fits the step count and the learning-rate schedule to it (train/budget.py). 0: no budget.
    time_budget_s: float = 0.0
    # On a CPU: torch threads follow the CPUs other processes leave free (train/threads.py, docs/threads.md).
    adapt_threads: bool = True
    # Bit-identical repeats (docs/parallel.md "Deterministic mode"): deterministic algorithms, the torch thread count
    # pinned (and kept by a resumed run), the thread governor off, CUDA's cuBLAS workspace fixed. Off: the default.
    deterministic: bool = False
    micro_batch_size: int = 8
    global_batch_size: int = 8
    seed: int = 1234
    # auto | fp32 | bf16 | fp16. auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with
    # AVX512-BF16 or AMX-BF16) and the shape is large enough to gain from it, fp32 elsewhere
    # (core/precision.py `resolve_precision`); the run prints and records what it resolved to.
    precision: str = "auto"
    out_dir: str = "runs/gpt-tiny"
    save_every: int = 0  # 0: only at the end
    eval_every: int = 0  # 0: only at the end
    eval_iters: int = 10
    resume: str = "auto"  # auto | never | <checkpoint path>
    log_every: int = 10
    # Every this many steps (0: never) the ranks compare their compute time per step; ranks slower than
    # straggler_ratio × their peers' median are named in the log and metrics.jsonl (train/stragglers.py).
    straggler_every: int = 50
    straggler_ratio: float = 1.5
    peak_tflops: float = 0.0  # 0: measure with a short matmul at start
    device: str = "auto"  # auto | cpu | cuda
    compile: bool = False
    # Chunked head + cross-entropy without the (tokens, vocab) logits (tp=1): true, false, or auto (where it is
    # measured faster for the shape and device: models/loss.py `fused_head_wins`).
    fused_loss: bool | str = "auto"
    recompute: str = "none"  # none | selective (attention core) | full (whole layers); see docs/memory.md
    recompute_method: str = "uniform"  # full only: uniform (chunks of recompute_num_layers) | block (first N)
    recompute_num_layers: int = 0  # full only: chunk size (uniform) or layers recomputed (block); 0: every layer
    progress: bool = True
    keep_last: int = 3  # checkpoints kept (the newest valid ones); 0 keeps all
    # Checkpoints of train.save_every copied to host memory at the step, then written and published by one
    # background thread while training goes on (checkpoint/background.py, docs/reliability.md).
    async_save: bool = False
    max_bad_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradient norm
    sample_tokens: int = 0  # >0: print a sample of this many tokens at the end
    sample_prompt: str = "\n"
    init_from: str = ""  # a checkpoint whose matching weights start a fresh run (fine-tuning); "": the seed
    # Evaluation tasks run at each evaluation (meshlm/eval, docs/eval.md): shipped sets (shakespeare-cloze,
    # shakespeare-choice) or KIND:FILE with KIND perplexity, cloze or choice; logged as val_<name>_<metric>.
    eval_tasks: list[str] = field(default_factory=list)
    # A Hugging Face directory written from each published checkpoint (meshlm/interop/during_training.py,
    # docs/hf.md): "" never, "end" the run's last checkpoint, "every" the checkpoints of every
    # train.save_hf_every steps and the last one; into OUT_DIR/hf_checkpoints/step_XXXXXXX.
    save_hf: str = ""
    save_hf_every: int = 0

    def validate(self) -> None:
        _positive("train", self, "max_steps", "micro_batch_size", "global_batch_size", "log_every", "eval_iters")
        _non_negative("train", self, "save_every", "eval_every", "sample_tokens", "straggler_every")
        _check(math.isfinite(self.straggler_ratio) and self.straggler_ratio > 1,
               f"train.straggler_ratio={self.straggler_ratio} must be a number > 1 (a rank this many times slower "
               "than its peers' median is named); e.g. train.straggler_ratio=1.5")
        _check(math.isfinite(self.time_budget_s) and self.time_budget_s >= 0,
               f"train.time_budget_s={self.time_budget_s} must be a number of seconds > 0 (e.g. 1200 for 20 "
               "minutes), or 0 for no budget")
        _check(0 <= self.seed <= SEED_MAX, f"train.seed={self.seed} must be in 0..{SEED_MAX}; e.g. train.seed=1234")
        _check(not (self.deterministic and self.time_budget_s > 0),
               f"train.deterministic=true repeats a run bit for bit, but train.time_budget_s={self.time_budget_s:g} "
               "sets the step count from measured step times; set train.time_budget_s=0 (and train.max_steps) or "
               "train.deterministic=false")
        _non_empty("train", self, "out_dir", "resume")
        _check(self.global_batch_size % self.micro_batch_size == 0,
               f"train.global_batch_size={self.global_batch_size} is not a multiple of "
               f"train.micro_batch_size={self.micro_batch_size}; set it to "
               f"{max(1, self.global_batch_size // self.micro_batch_size) * self.micro_batch_size}")
        _check(self.keep_last >= 0, f"train.keep_last={self.keep_last} must be >= 0 (0 keeps every checkpoint)")
        _check(self.max_bad_steps > 0, f"train.max_bad_steps={self.max_bad_steps} must be positive (the number of "
               "non-finite steps in a row that stops the run); set it to 5")
        self._check_eval_tasks()
        self._check_save_hf()
        _choices("train.precision", self.precision, ("auto", "fp32", "bf16", "fp16"))
        _check(self.fused_loss in (True, False, "auto"),
               f"train.fused_loss={self.fused_loss!r} is not one of true, false, auto; pick one of them")
        _choices("train.device", self.device, ("auto", "cpu", "cuda"))
        _non_negative("train", self, "peak_tflops", zero="0 measures it at start")
        _choices("train.recompute", self.recompute, ("none", "selective", "full"))
        _choices("train.recompute_method", self.recompute_method, ("uniform", "block"))
        _check(self.recompute_num_layers >= 0,
               f"train.recompute_num_layers={self.recompute_num_layers} must be >= 0 (0: every layer)")
        _check(self.recompute == "full" or self.recompute_num_layers == 0,
               f"train.recompute_num_layers={self.recompute_num_layers} only applies to train.recompute='full' "
               f"(got {self.recompute!r}); drop it or set train.recompute=full")
        _check(self.recompute == "full" or self.recompute_method == "uniform",
               f"train.recompute_method={self.recompute_method!r} only applies to train.recompute='full' "
               f"(got {self.recompute!r}); drop it or set train.recompute=full")

    def _check_save_hf(self) -> None:
        _check(self.save_hf in ("", "end", "every"), f"train.save_hf={self.save_hf!r} is not one of '' (off), end "
               "(the last checkpoint), every (with train.save_hf_every=N); e.g. train.save_hf=end")
        every = self.save_hf_every
        if self.save_hf != "every":
            _check(every == 0, f"train.save_hf_every={every} only applies to train.save_hf='every' (got "
                   f"{self.save_hf!r}); drop it or set train.save_hf=every")
            return
        _check(self.save_every > 0, "train.save_hf='every' converts the checkpoints of train.save_every, which is 0 "
               "(a checkpoint only at the end); set train.save_every (e.g. 100) or train.save_hf=end")
        _check(every > 0 and every % self.save_every == 0,
               f"train.save_hf_every={every} must be a positive multiple of train.save_every={self.save_every} (a "
               f"Hugging Face directory is written from a checkpoint); e.g. train.save_hf_every={self.save_every}")

    def _check_eval_tasks(self) -> None:
        kinds = ("perplexity", "cloze", "choice")
        for task in self.eval_tasks:
            kind, _, path = task.partition(":")
            _check(task in EVAL_SETS or (kind in kinds and path.strip() != ""),
                   f"train.eval_tasks entry {task!r} is neither a shipped set ({', '.join(EVAL_SETS)}) nor KIND:FILE with "
                   f"KIND one of {', '.join(kinds)}; e.g. train.eval_tasks=['shakespeare-cloze', 'choice:my.jsonl']")


@dataclass(frozen=True)
class OptimConfig:
    # adamw | lamb (LAMB: layer-wise trust ratios for large batches) | muon (Muon on the hidden layers' matrices,
    # AdamW on the rest); docs/optim.md
    name: str = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 20
    decay: str = "cosine"  # cosine | linear | constant | wsd
    decay_steps: int = 0  # 0: train.max_steps
    wsd_decay_fraction: float = 0.2  # WSD: share of the steps spent in the final decay
    muon_momentum: float = 0.95  # optim.name=muon: the momentum of Muon's (Nesterov) buffer

    def validate(self) -> None:
        _choices("optim.name", self.name, ("adamw", "lamb", "muon"))
        _check(0 <= self.muon_momentum < 1, f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)")
        _positive("optim", self, "lr", "eps")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        _non_negative("optim", self, "weight_decay", zero="0 disables")
        for key in ("beta1", "beta2"):
            _check(0 <= getattr(self, key) < 1, f"optim.{key}={getattr(self, key)} must be in [0, 1)")
        _non_negative("optim", self, "grad_clip", "warmup_steps")
        _non_negative("optim", self, "decay_steps", zero="0: train.max_steps")
        _choices("optim.decay", self.decay, ("cosine", "linear", "constant", "wsd"))
        _check(0 < self.wsd_decay_fraction <= 1,
               f"optim.wsd_decay_fraction={self.wsd_decay_fraction} must be in (0, 1]")


@dataclass(frozen=True)
class DataConfig:
    # prepared prefixes (PREFIX.bin/.idx) or text (.txt/.jsonl/.gz, dirs, globs), optionally weighted:
    # ["0.7", "a", "0.3", "b"]; empty: the bundled Shakespeare corpus. See docs/data.md.
    paths: list[str] = field(default_factory=list)
    tokenizer: str = "gpt2"  # gpt2 | bert | path to a tokenizer.json (or its dir) | SentencePiece .model
    split: str = "95,5,0"  # train, validation, test shares, by document
    cache_dir: str = ""  # "": $MESHLM_CACHE or ~/.cache/meshlm (prepared text and sample indices)
    json_key: str = "text"  # the field holding the text in .jsonl data.paths
    allow_binary: bool = False  # true: text data.paths that look binary (NUL bytes, invalid UTF-8) are used anyway
    # true: a row packing several documents attends only within each and restarts positions at each
    # (Megatron's reset attention mask and position ids; docs/long_context.md). Decoder families only.
    document_mask: bool = False

    @property
    def split_weights(self) -> tuple[float, float, float]:
        parts = [float(p) for p in self.split.split(",")]
        parts += [0.0] * (3 - len(parts))
        total = sum(parts)
        return parts[0] / total, parts[1] / total, parts[2] / total

    def validate(self) -> None:
        try:
            parts = [float(p) for p in self.split.split(",")]
        except ValueError:
            parts = []
        _check(0 < len(parts) <= 3 and all(0 <= p < math.inf for p in parts) and sum(parts) > 0 and parts[0] > 0,
               f"data.split={self.split!r} must be up to three non-negative weights 'train,valid,test' "
               "with a positive train share, e.g. '98,1,1'")
        _non_empty("data", self, "tokenizer", "json_key")
        _check(isinstance(self.document_mask, bool), f"data.document_mask={self.document_mask!r} must be true or false")
        for path in self.paths:
            _check(path.strip() != "", f"data.paths={self.paths!r} holds an empty path; remove it or name a file")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 0  # 0: world_size / (tp * pp)
    sp: bool = False
    vpp: int = 1
    timeout_s: float = 600.0
    heartbeat_s: float = 120.0  # a peer silent this long (stopped, frozen, gone) stops the job; 0: off
    pp_layers: list[int] = field(default_factory=list)  # layers per (virtual) stage; []: balanced automatically
    zero: int = 0  # 0: replicated optimizer | 1: states sharded over dp | 2: + gradients | 3: + weights (FSDP2)
    bucket_mb: float = 25.0  # data parallel: gradients reduced in buckets of about this size, during backward
    cp: int = 1  # context parallel: each row's tokens split over cp ranks, attention as a ring (docs/long_context.md)
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep of the dp × cp ranks (docs/parallel.md)

    def validate(self) -> None:
        for key in ("tp", "pp", "vpp", "cp", "ep"):
            _check(getattr(self, key) >= 1, f"parallel.{key}={getattr(self, key)} must be >= 1")
        _check(self.vpp == 1 or self.pp > 1, f"parallel.vpp={self.vpp} needs parallel.pp > 1; set parallel.pp")
        _check(not self.pp_layers or (len(self.pp_layers) == self.pp * self.vpp and min(self.pp_layers) >= 1),
               f"parallel.pp_layers={self.pp_layers} must give one count >= 1 per stage: parallel.pp × "
               f"parallel.vpp = {self.pp * self.vpp} entries")
        _check(self.dp >= 0, f"parallel.dp={self.dp} must be >= 1 (or 0 to fill the world)")
        _check(not self.sp or self.tp > 1, "parallel.sp=true needs parallel.tp > 1; set parallel.tp or drop sp")
        _check(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be positive")
        _check(self.heartbeat_s >= 0, f"parallel.heartbeat_s={self.heartbeat_s} must be >= 0 (seconds a peer may be "
               "silent before the job stops; 0 turns the heartbeat off); e.g. 120")
        _check(self.zero in (0, 1, 2, 3), f"parallel.zero={self.zero} is not a ZeRO stage; use 0 (off), 1 (optimizer "
               "states sharded over dp), 2 (and gradients) or 3 (and weights, FSDP2)")
        _check(self.bucket_mb > 0, f"parallel.bucket_mb={self.bucket_mb} must be positive (MiB per gradient bucket)")


LORA_TARGETS = ("q", "k", "v", "qkv", "o", "up", "gate", "fc", "down")
# Multi-head latent attention's linears (model.attention='mla'), by Hugging Face DeepSeek-V3's module names
MLA_LORA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


@dataclass(frozen=True)
class TuneConfig:
    """Adapting a frozen model (`meshlm tune`, docs/tune.md): the base's weights stay as they are; only the
    adapter (virtual-token embeddings, a prompt encoder, or LoRA matrices) and new task heads train."""

    method: str = "none"  # none | prompt (Lester et al.) | ptuning (prompt encoder, Liu et al.) | lora (Hu et al.)
    base: str = ""  # the frozen base checkpoint (a run dir or a step dir); required unless method=none
    virtual_tokens: int = 10  # prompt / ptuning: learned tokens before each input
    tasks: list[str] = field(default_factory=list)  # prompt / ptuning: one virtual prompt per task; []: one
    prompt_init: str = "vocab"  # prompt: vocab (embeddings of random vocabulary tokens) | text | random
    prompt_init_text: str = ""  # prompt_init=text: its tokens' embeddings, repeated to virtual_tokens
    encoder: str = "mlp"  # ptuning: mlp | lstm (bidirectional, then an MLP)
    encoder_hidden: int = 0  # ptuning: the encoder's hidden width; 0: model.hidden_size
    lora_rank: int = 8
    lora_alpha: float = 16.0  # the update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the input of A
    lora_targets: list[str] = field(default_factory=lambda: ["q", "v"])  # q k v qkv o up gate fc down

    def validate(self) -> None:
        _choices("tune.method", self.method, ("none", "prompt", "ptuning", "lora"))
        _choices("tune.prompt_init", self.prompt_init, ("vocab", "text", "random"))
        _choices("tune.encoder", self.encoder, ("mlp", "lstm"))
        _positive("tune", self, "virtual_tokens", "lora_rank", "lora_alpha")
        _check(self.encoder_hidden >= 0, f"tune.encoder_hidden={self.encoder_hidden} must be >= 0 (0: model.hidden_size)")
        _check(0.0 <= self.lora_dropout < 1.0, f"tune.lora_dropout={self.lora_dropout} must be in [0, 1)")
        _check(self.method == "none" or self.base.strip() != "",
               f"tune.method={self.method!r} needs tune.base, the frozen base checkpoint; e.g. tune.base=runs/gpt-tiny")
        _check(self.prompt_init != "text" or self.prompt_init_text.strip() != "",
               "tune.prompt_init='text' needs tune.prompt_init_text (the words whose embeddings start the prompt)")
        _check(bool(self.lora_targets), f"tune.lora_targets is empty; name some of {', '.join(LORA_TARGETS)}")
        for name in self.lora_targets:
            _check(name in LORA_TARGETS + MLA_LORA_TARGETS, f"tune.lora_targets holds {name!r}, not a LoRA target; "
                   f"choose from {', '.join(LORA_TARGETS)} (q/k/v: rows of the fused attention input, qkv: all of it, "
                   "o: the attention output, up/gate: the MLP input (SwiGLU's halves), fc: the whole MLP input, down: "
                   f"its output), or under model.attention='mla' {', '.join(MLA_LORA_TARGETS)} (DeepSeek-V3's names)")
        _check(len(set(self.lora_targets)) == len(self.lora_targets), f"tune.lora_targets={self.lora_targets} names a target twice")
        for name in self.tasks:
            _check(name.strip() != "", f"tune.tasks={self.tasks!r} holds an empty task name")
        _check(len(set(self.tasks)) == len(self.tasks), f"tune.tasks={self.tasks} names a task twice")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)

    def validate(self) -> Config:
        for f in fields(self):
            getattr(self, f.name).validate()
        check_config(self)
        return self

    def check_paths(self) -> Config:
        """The directories a training run writes can be written (checked by `meshlm train`, not by
        `validate`: a checkpoint's config is read again where its out_dir may not exist)."""
        check_output_dir("train.out_dir", self.train.out_dir)
        for task in self.train.eval_tasks:  # KIND:FILE entries name a file to read at each evaluation
            path = task.partition(":")[2]
            _check(not path or Path(path).is_file(), f"train.eval_tasks entry {task!r}: {path!r} does not exist or "
                   "is not a file; give the task's .jsonl (or text) file")
        if self.data.cache_dir:
            check_output_dir("data.cache_dir", self.data.cache_dir)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTION_TYPES = {"model": ModelConfig, "train": TrainConfig, "optim": OptimConfig, "data": DataConfig,
                  "parallel": ParallelConfig, "tune": TuneConfig}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check one value against its field's type, and that it is a sane value of that type: a finite float,
    an int within int64, a string without NUL characters, a list of plain values."""
    value = _coerce_type(key, value, annotation)
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, float):
            _check(math.isfinite(item), f"{key}={value!r} is not a finite number; give a finite value")
        elif isinstance(item, int) and not isinstance(item, bool):
            _check(-INT_MAX <= item <= INT_MAX, f"{key}={value!r} is out of range; use a value below 2**63")
        elif isinstance(item, str):
            _check("\x00" not in item, f"{key}={value!r} contains a NUL character; remove it")
    return value


def _coerce_type(key: str, value: Any, annotation: Any) -> Any:
    kinds = annotation if isinstance(annotation, tuple) else (annotation,)
    if value is None and type(None) in kinds:
        return None
    for kind in kinds:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
        if typing.get_origin(kind) is list and isinstance(value, list):
            item = typing.get_args(kind)[0]
            if item is int:  # list[int]: ints only (a bool or a string is a mistake)
                if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                    return list(value)
                continue
            if all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
                return [str(v) for v in value]  # list[str]; a number is a blend weight (data.paths)
            continue
    names = " or ".join("null" if k is type(None) else str(k) if typing.get_origin(k) else k.__name__
                        for k in kinds)
    hint = _CHOICES.get(key)
    raise ConfigError(f"{key}={value!r} has the wrong type: expected {names}" + (f"; one of {hint}" if hint else ""))


# string keys that take one of a few words: named when a value of another type is given (`save_hf=true`)
_CHOICES = {"train.save_hf": "'' (off), end (the last checkpoint), every (with train.save_hf_every=N), e.g. "
                             "train.save_hf=end"}


def _field_types(section: type) -> dict[str, tuple]:
    out = {}
    for name, hint in typing.get_type_hints(section).items():
        args = typing.get_args(hint)
        origin = typing.get_origin(hint)
        if origin is list:
            out[name] = (hint,)  # list[str] or list[int]
        elif args:
            out[name] = tuple(args)
        else:
            out[name] = (hint,)
    return out


def _parse_cli_value(text: str) -> Any:
    """`--train.lr=3e-4` → 3e-4; values are read as TOML, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        lowered = text.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
        return text


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(sorted(known))}"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def build(values: dict[str, dict[str, Any]]) -> Config:
    """Build a validated Config from nested {section: {key: value}}."""
    sections = {}
    all_keys = [f"{s}.{f.name}" for s, t in _SECTION_TYPES.items() for f in fields(t)]
    for name, body in values.items():
        if name not in _SECTION_TYPES:
            raise _unknown(name, list(_SECTION_TYPES))
        if not isinstance(body, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {body!r}")
        types = _field_types(_SECTION_TYPES[name])
        kwargs = {}
        for key, value in body.items():
            if key not in types:
                raise _unknown(f"{name}.{key}", all_keys)
            kwargs[key] = _coerce(f"{name}.{key}", value, types[key])
        sections[name] = _SECTION_TYPES[name](**kwargs)
    return Config(**sections).validate()


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass a path to a .toml file or "
                              f"one of the bundled names: {', '.join(bundled_configs())}")
        return path
    bundled = CONFIG_DIR / f"{name_or_path}.toml"
    if not bundled.exists():
        raise ConfigError(f"no bundled config named {name_or_path!r}; choose one of "
                          f"{', '.join(bundled_configs())} or pass a path to a .toml file")
    return bundled


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def load_toml(path: Path) -> dict[str, dict[str, Any]]:
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass a .toml file or a bundled name")
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML ({err}); fix the syntax") from None
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} cannot be read ({err.strerror or err}); fix its "
                          "permissions or pass another file") from None


def apply_overrides(values: dict[str, dict[str, Any]], overrides: list[str]) -> dict[str, dict[str, Any]]:
    """Apply `--section.key=value` (or `section.key=value`) strings to nested values."""
    merged = {k: dict(v) for k, v in values.items()}
    for item in overrides:
        text = item.removeprefix("--")
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} is not of the form --section.key=value, "
                              "e.g. --train.max_steps=100")
        key, raw = text.split("=", 1)
        section, name = key.split(".", 1)
        merged.setdefault(section, {})[name] = _parse_cli_value(raw)
    return merged


def load_config(name_or_path: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> Config:
    values = load_toml(resolve_config_path(name_or_path))
    return build(apply_overrides(values, overrides or []))


def config_from_dict(values: dict[str, dict[str, Any]]) -> Config:
    """Rebuild a Config saved with `Config.to_dict()` (checkpoints store the resolved config)."""
    return build(values)

