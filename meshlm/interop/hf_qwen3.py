"""Hugging Face Qwen3 and Qwen3-MoE config.json <-> `ModelConfig`.

Qwen3 is a Llama decoder with two additions meshlm has as switches: an RMSNorm over each head's queries and
keys before RoPE (`model.qk_norm`; HF `self_attn.q_norm`, `self_attn.k_norm`, head_dim wide) and a head width
apart from hidden_size / num_attention_heads (`model.head_size`; Qwen3-0.6B: hidden 1024, 16 heads of 128).
Qwen3-MoE adds Qwen2-MoE's experts without the shared one. The map (beyond Llama's, `hf_llama_config.py`):

    Qwen3 / Qwen3-MoE            meshlm model.
    (always)                     qk_norm = true
    head_dim                     head_size (0 when it is hidden_size / num_attention_heads)
    attention_bias               bias (false only: Qwen3's biases are on q/k/v/o, not the MLP)
    num_experts                  moe_experts                 (Qwen3-MoE, as the rest of this table)
    num_experts_per_tok          moe_top_k
    moe_intermediate_size        moe_expert_hidden
    intermediate_size            ffn_hidden_size (the dense layers')
    norm_topk_prob               moe_norm_topk
    decoder_sparse_step          moe_every
    mlp_only_layers = [0, k)     moe_first_dense = k
    router_aux_loss_coef         moe_aux_loss

Refused with the field and the fix: a sliding window in use (use_sliding_window=true, or a 'sliding_attention'
entry in layer_types); present but off, the window keys are accepted. Exported, a model must have RMSNorm, RoPE,
SwiGLU, no bias and, with experts, softmax routing without capacity limit and no shared expert.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.interop.hf_llama_config import _default_ffn, _fail, _first_dense, _llama_part, rope_parameters_for_hf, unmet

QWEN3_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
QWEN3_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3MoeModel")
# transformers' defaults where they differ from Llama's (`hf_llama_config._LLAMA_DEFAULTS`)
_QWEN3_DEFAULTS = {"vocab_size": 151936, "intermediate_size": 22016, "head_dim": 128, "max_position_embeddings": 32768,
                   "use_sliding_window": False, "attention_bias": False}
_QWEN3_MOE_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                       "num_key_value_heads": 4, "max_position_embeddings": 32768, "use_sliding_window": False,
                       "attention_bias": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                       "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
                       "router_aux_loss_coef": 0.001, "mlp_only_layers": []}


def _qwen3_attention(g: dict[str, Any], what: str) -> ModelConfig:
    """The Llama part of a Qwen3 config with its q/k norms; refuses a sliding window in use and biases."""
    problems = []
    if g.get("use_sliding_window"):
        problems.append(f"use_sliding_window=true (sliding_window={g.get('sliding_window')}): meshlm attends over "
                        "the whole context; set use_sliding_window=false")
    elif "sliding_attention" in (g.get("layer_types") or []):
        problems.append("layer_types names 'sliding_attention' layers: meshlm attends over the whole context; make "
                        "every entry 'full_attention'")
    if g.get("attention_bias"):
        problems.append("attention_bias=true: meshlm's Qwen3 has no q/k/v/o biases (released Qwen3 models have "
                        "none); set attention_bias=false")
    _fail(problems, what)
    return replace(_llama_part(g), qk_norm=True)


def model_config_from_qwen3(d: dict[str, Any]) -> ModelConfig:
    g = {**_QWEN3_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    cfg = _qwen3_attention(g, "Hugging Face Qwen3 config")
    cfg.validate()
    return cfg


def model_config_from_qwen3_moe(d: dict[str, Any]) -> ModelConfig:
    g = {**_QWEN3_MOE_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if "num_local_experts" in d and "num_experts" not in d:  # transformers 5's name for num_experts
        g["num_experts"] = d["num_local_experts"]
    problems = []
    experts, expert = int(g["num_experts"]), int(g["moe_intermediate_size"])
    if experts < 1:
        problems.append(f"num_experts={experts}: a dense Qwen3 model; convert it as model_type 'qwen3'")
    first = _first_dense(g, problems)
    _fail(problems, "Hugging Face Qwen3-MoE config")
    cfg = _qwen3_attention(g, "Hugging Face Qwen3-MoE config")
    cfg = replace(cfg, moe_experts=experts, moe_top_k=int(g["num_experts_per_tok"]),
                  moe_every=int(g["decoder_sparse_step"]), moe_first_dense=first,
                  moe_norm_topk=bool(g["norm_topk_prob"]), moe_aux_loss=float(g["router_aux_loss_coef"]))
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]))
    cfg = replace(cfg, moe_expert_hidden=0 if expert == cfg.ffn_size else expert)
    cfg.validate()
    return cfg


def check_qwen3_representable(cfg: ModelConfig, arch: str) -> None:
    """ConfigError naming every switch of `cfg` that Hugging Face Qwen3 (`arch` 'qwen3') or Qwen3-MoE
    ('qwen3_moe') cannot hold."""
    if cfg.qk_norm is False:
        raise ConfigError(f"a meshlm model with model.qk_norm=false cannot be written as Hugging Face {arch} (its "
                          "attention always normalises q and k); export it as 'llama' (or a MoE as 'mixtral' / "
                          "'qwen2_moe')")
    if bool(cfg.moe_experts) != (arch == "qwen3_moe"):
        raise ConfigError(f"a meshlm model with model.moe_experts={cfg.moe_experts} converts to "
                          f"{'qwen3_moe' if cfg.moe_experts else 'qwen3'}, not {arch}")
    need = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False}
    if cfg.moe_experts:
        need.update(moe_router="softmax", moe_capacity_factor=0.0, moe_shared_experts=0)
    problems = unmet(cfg, need)
    _fail(problems, f"meshlm model as Hugging Face {arch}")


def qwen3_config_dict(cfg: ModelConfig, arch: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Qwen3 or Qwen3-MoE model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_qwen3_representable(cfg, arch)
    d = {**common, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
         "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
         "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.seq_len,
         "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope_parameters_for_hf(cfg), "rope_theta": cfg.rope_theta,
         "attention_bias": False, "attention_dropout": cfg.dropout, "use_sliding_window": False,
         "sliding_window": None}
    if cfg.rope_scaling != "none":  # transformers 4.x reads rope_scaling
        d["rope_scaling"] = rope_parameters_for_hf(cfg)
    if arch == "qwen3":
        return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **d, "max_window_layers": cfg.n_layers}
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **d,
            "moe_intermediate_size": cfg.expert_size, "num_experts": cfg.moe_experts,
            "num_experts_per_tok": cfg.moe_top_k, "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": list(range(cfg.moe_first_dense)),
            "router_aux_loss_coef": cfg.moe_aux_loss, "output_router_logits": False}
