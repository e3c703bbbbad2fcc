"""Hugging Face gpt-oss config.json <-> `ModelConfig` (the weights' names and layouts: `families/hf_gpt_oss.py`).

gpt-oss is a decoder of RMSNorm, grouped-query attention with biases on q/k/v/o, a learned sink logit per head,
local (sliding-window) layers alternating with global ones, YaRN RoPE, and a mixture of experts in every layer:
a router with a bias, a softmax over the top-k logits (= meshlm's softmax router renormalised over the top k),
experts with biases and a clamped SwiGLU. The map:

    gpt-oss                               meshlm model.
    attention_bias                        bias (q/k/v/o only: there are no dense MLPs, RMSNorm has no bias)
    head_dim                              head_size (0 when it is hidden_size / num_attention_heads)
    (always)                              attention_sinks = true
    sliding_window, layer_types           sliding_window, window_pattern (layer i global when (i + 1) % N == 0;
                                            0: every layer local; no 'sliding_attention' entry: sliding_window 0)
    rope_parameters (yarn, truncate)      rope_scaling='yarn', rope_factor, ..., rope_truncate
    num_local_experts                     moe_experts (moe_router='softmax', moe_norm_topk=true)
    num_experts_per_tok                   moe_top_k
    intermediate_size                     ffn_hidden_size (each expert's width)
    (always)                              moe_bias = true, moe_activation = 'swiglu_clamped'
    swiglu_limit, swiglu_alpha            moe_swiglu_limit, moe_swiglu_alpha
    router_aux_loss_coef                  moe_aux_loss

Refused with the field and the fix: MXFP4-quantized weights (`quantization_config`: dequantize first), a
`layer_types` list meshlm's window_pattern cannot say, sliding layers without a window, Llama-3 RoPE scaling
or DeepSeek's mscale. Exported, a model must have every switch above (and RoPE, MHA, no q/k norms, every layer
MoE, no shared expert, no capacity limit, no group routing, no routed scale).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshlm.core.config import ModelConfig
from meshlm.interop.hf_llama_config import _default_ffn, _fail, _rope_scaling_from_hf, rope_parameters_for_hf, unmet

GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM", "GptOssModel")
# transformers' GptOssConfig defaults (those read here)
_DEFAULTS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
             "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
             "num_experts_per_tok": 4, "sliding_window": 128, "max_position_embeddings": 131072,
             "rms_norm_eps": 1e-5, "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": True,
             "attention_dropout": 0.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
             "rope_theta": 150000.0}
_ROPE_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def window_pattern(layer_types: list[str] | None, n_layers: int, problems: list[str]) -> tuple[bool, int]:
    """(any layer local, meshlm's window_pattern) of HF `layer_types` (None: gpt-oss's default, alternating from a
    local layer 0): N when layer i is global exactly where (i + 1) % N == 0, 0 when every layer is local."""
    if layer_types is None:
        return True, 2
    local = [t == "sliding_attention" for t in layer_types]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown or len(local) != n_layers:
        problems.append(f"layer_types={layer_types!r}: give num_hidden_layers={n_layers} entries, each "
                        "'sliding_attention' or 'full_attention'")
        return False, 0
    if all(local) or not any(local):
        return any(local), 0
    for n in range(2, n_layers + 1):
        if local == [(i + 1) % n != 0 for i in range(n_layers)]:
            return True, n
    problems.append(f"layer_types={layer_types!r}: meshlm's global layers are every N-th (layer i global when "
                    "(i + 1) % N == 0, model.window_pattern=N); list them in that pattern")
    return True, 0


def _rope(g: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    rope = dict(g.get("rope_parameters") or g.get("rope_scaling") or _ROPE_DEFAULT)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    truncate = bool(rope.pop("truncate", True))
    out = _rope_scaling_from_hf(rope, rope_type, g["max_position_embeddings"], problems)
    if rope_type == "llama3":
        problems.append("rope_parameters.rope_type='llama3': gpt-oss scales with YaRN; use 'yarn' or 'default'")
    out["rope_theta"] = float(rope.get("rope_theta", g["rope_theta"]))
    return {**out, "rope_truncate": truncate} if rope_type == "yarn" else out


def model_config_from_gpt_oss(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a gpt-oss config.json dict (the map in the module doc)."""
    g = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if "num_experts" in d and "num_local_experts" not in d:
        g["num_local_experts"] = d["num_experts"]
    problems = []
    if d.get("quantization_config"):
        method = (d["quantization_config"] or {}).get("quant_method", "?")
        problems.append(f"quantization_config (quant_method={method!r}): meshlm reads unquantized weights; load the "
                        "model with transformers' Mxfp4Config(dequantize=True) and save_pretrained it first")
    n, heads, hidden = g["num_hidden_layers"], g["num_attention_heads"], g["hidden_size"]
    local, pattern = window_pattern(d.get("layer_types"), n, problems)
    window = int(d["sliding_window"] or 0) if "sliding_window" in d else int(g["sliding_window"])
    if local and not window:
        problems.append("layer_types names 'sliding_attention' layers but sliding_window is null; give the window")
    rope = _rope(g, problems)
    _fail(problems, "Hugging Face gpt-oss config")
    kv = g["num_key_value_heads"]
    cfg = ModelConfig(vocab_size=g["vocab_size"], n_layers=n, hidden_size=hidden, n_heads=heads,
                      n_kv_heads=None if kv in (None, heads) else kv, seq_len=g["max_position_embeddings"],
                      dropout=float(g["attention_dropout"]), position="rope", norm="rmsnorm", activation="swiglu",
                      bias=bool(g["attention_bias"]), tie_embeddings=bool(g["tie_word_embeddings"]),
                      norm_eps=g["rms_norm_eps"], init_std=g["initializer_range"],
                      head_size=0 if g["head_dim"] in (None, hidden / heads) else g["head_dim"],
                      attention_sinks=True,
                      sliding_window=window if local else 0, window_pattern=pattern if local else 0,
                      moe_experts=int(g["num_local_experts"]), moe_top_k=int(g["num_experts_per_tok"]),
                      moe_norm_topk=True, moe_aux_loss=float(g["router_aux_loss_coef"]), moe_bias=True,
                      moe_activation="swiglu_clamped", moe_swiglu_limit=float(g["swiglu_limit"]),
                      moe_swiglu_alpha=float(g["swiglu_alpha"]), **rope)
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, int(g["intermediate_size"])))  # each expert's width
    cfg.validate()
    return cfg


def check_gpt_oss_representable(cfg: ModelConfig) -> None:
    """ConfigError naming every switch of `cfg` that Hugging Face gpt-oss cannot hold."""
    need = {"position": "rope", "norm": "rmsnorm", "attention": "mha", "qk_norm": False, "attention_sinks": True,
            "moe_every": 1, "moe_first_dense": 0, "moe_shared_experts": 0, "moe_router": "softmax",
            "moe_norm_topk": True, "moe_capacity_factor": 0.0, "moe_groups": 1, "moe_routed_scale": 1.0,
            "moe_bias": True, "moe_activation": "swiglu_clamped"}
    problems = unmet(cfg, need)
    if not cfg.moe_experts:
        problems.append("model.moe_experts=0 (gpt-oss's every layer is a mixture of experts)")
    if cfg.rope_scaling == "llama3":
        problems.append("model.rope_scaling='llama3' (gpt-oss scales with YaRN; use 'yarn' or 'none')")
    _fail(problems, "meshlm model as Hugging Face gpt_oss")


def gpt_oss_config_dict(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the gpt-oss model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_gpt_oss_representable(cfg)
    rope = rope_parameters_for_hf(cfg)
    if cfg.rope_scaling == "yarn":
        rope["truncate"] = cfg.rope_truncate
    layer_types = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layers)]
    return {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **common,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.expert_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope, "attention_bias": cfg.bias, "attention_dropout": cfg.dropout,
            # every layer global: transformers still builds a window mask, so a window it never applies
            "sliding_window": cfg.sliding_window or cfg.seq_len, "layer_types": layer_types,
            "num_local_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "swiglu_limit": cfg.moe_swiglu_limit, "swiglu_alpha": cfg.moe_swiglu_alpha,
            "router_aux_loss_coef": cfg.moe_aux_loss, "output_router_logits": False}
