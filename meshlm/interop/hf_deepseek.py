"""Hugging Face DeepSeek-V3 config.json <-> `ModelConfig` (the weights' names: `families/hf_deepseek.py`).

DeepSeek-V3 is a decoder with multi-head latent attention (`model.attention='mla'`, models/mla.py), RMSNorm,
SwiGLU, first dense layers and then mixture-of-experts layers routed by a sigmoid router whose per-expert bias
only selects (meshlm's `moe_router='sigmoid'`, its `score_bias` = HF's `e_score_correction_bias`), with shared
experts. The map:

    DeepSeek-V3                           meshlm model.
    q_lora_rank (None: no compression)    q_lora_rank (0)
    kv_lora_rank, qk_nope_head_dim,       kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
      qk_rope_head_dim, v_head_dim
    rope_interleave                       rope_interleave
    rope_parameters (yarn: factor,        rope_scaling='yarn', rope_factor, ...; rope_attention_factor = the
      mscale, mscale_all_dim)               cos/sin scale mscale(m)/mscale(m_all); rope_mscale_all_dim
    intermediate_size (dense layers)      ffn_hidden_size
    n_routed_experts                      moe_experts (moe_router='sigmoid', moe_aux_loss=0: bias balancing)
    num_experts_per_tok                   moe_top_k
    moe_intermediate_size                 moe_expert_hidden
    n_shared_experts                      moe_shared_experts
    first_k_dense_replace                 moe_first_dense
    norm_topk_prob                        moe_norm_topk
    routed_scaling_factor                 moe_routed_scale
    n_group, topk_group                   moe_groups, moe_topk_groups (group-limited routing)

Refused with the field and the fix: attention biases, an activation other than SiLU, num_key_value_heads other
than num_attention_heads, groups that do not split the experts evenly. The multi-token-prediction layers
(num_nextn_predict_layers → model.mtp_depth, models/mtp.py) are not part of transformers' DeepseekV3ForCausalLM,
which ignores them; meshlm reads and writes them in DeepSeek's own naming (`model.layers.{n + k}.`,
`families/hf_deepseek.py` `mtp_entries`), and a checkpoint whose files lack them (one saved by transformers)
loads without them (`mtp_depth_in_files`). Exported, a model must
have MLA, RMSNorm, RoPE, SwiGLU, no bias, and with experts the sigmoid router without capacity limit or gated
shared expert (and some experts: HF DeepSeek-V3 has no all-dense form).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from meshlm.core.config import ModelConfig
from meshlm.interop.hf_llama_config import _default_ffn, _fail, _rope_scaling_from_hf, rope_parameters_for_hf, unmet

DEEPSEEK_V3_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV3Model")
# transformers' DeepseekV3Config defaults (those read here)
_DEFAULTS = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
             "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4,
             "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
             "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
             "attention_dropout": 0.0, "rope_theta": 10000.0, "num_nextn_predict_layers": 0}


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _rope_from_hf(g: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """ModelConfig's rope fields from rope_parameters, DeepSeek's YaRN (mscale, mscale_all_dim) included."""
    rope = dict(g.get("rope_parameters") or g.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mscale, mscale_all = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    out = _rope_scaling_from_hf(rope, rope_type, g["max_position_embeddings"], problems)
    out["rope_theta"] = float(rope.get("rope_theta", g["rope_theta"]))
    if rope_type == "yarn":
        if mscale and mscale_all and not rope.get("attention_factor"):
            out["rope_attention_factor"] = _mscale(out["rope_factor"], mscale) / _mscale(out["rope_factor"], mscale_all)
        out["rope_mscale_all_dim"] = float(mscale_all or 0.0)
    return out


def _refusals(g: dict[str, Any]) -> list[str]:
    problems = []
    if g["hidden_act"] != "silu":
        problems.append(f"hidden_act={g['hidden_act']!r}: meshlm's SwiGLU gates with SiLU; use 'silu'")
    if g["attention_bias"]:
        problems.append("attention_bias=true: meshlm's MLA has no biases (released DeepSeek models have none); set "
                        "attention_bias=false")
    if g["num_key_value_heads"] != g["num_attention_heads"]:
        problems.append(f"num_key_value_heads={g['num_key_value_heads']}: MLA has one key and value per head; set "
                        f"it to num_attention_heads={g['num_attention_heads']}")
    return problems


def model_config_from_deepseek_v3(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a DeepSeek-V3 config.json dict (the map in the module doc)."""
    g = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if "q_lora_rank" in d and d["q_lora_rank"] is None:  # None: a plain query projection (V2-Lite)
        g["q_lora_rank"] = 0
    problems = _refusals(g)
    rope = _rope_from_hf(g, problems)
    _fail(problems, "Hugging Face DeepSeek-V3 config")
    n, experts = g["num_hidden_layers"], int(g["n_routed_experts"] or 0)
    first = min(int(g["first_k_dense_replace"]), n)
    cfg = ModelConfig(vocab_size=g["vocab_size"], n_layers=n, hidden_size=g["hidden_size"],
                      n_heads=g["num_attention_heads"], seq_len=g["max_position_embeddings"],
                      dropout=float(g["attention_dropout"]), position="rope", norm="rmsnorm", activation="swiglu",
                      bias=False, tie_embeddings=bool(g["tie_word_embeddings"]), norm_eps=g["rms_norm_eps"],
                      init_std=g["initializer_range"], attention="mla", q_lora_rank=int(g["q_lora_rank"]),
                      kv_lora_rank=g["kv_lora_rank"], qk_nope_head_dim=g["qk_nope_head_dim"],
                      qk_rope_head_dim=g["qk_rope_head_dim"], v_head_dim=g["v_head_dim"],
                      rope_interleave=bool(g["rope_interleave"]), mtp_depth=int(g["num_nextn_predict_layers"] or 0),
                      **rope)
    if experts and first < n:
        cfg = replace(cfg, moe_experts=experts, moe_top_k=int(g["num_experts_per_tok"]), moe_first_dense=first,
                      moe_shared_experts=int(g["n_shared_experts"] or 0), moe_router="sigmoid",
                      moe_norm_topk=bool(g["norm_topk_prob"]), moe_aux_loss=0.0,
                      moe_routed_scale=float(g["routed_scaling_factor"]), moe_groups=int(g["n_group"] or 1),
                      moe_topk_groups=int(g["topk_group"] or 1))
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]))
    if cfg.moe_experts:
        expert = int(g["moe_intermediate_size"])
        cfg = replace(cfg, moe_expert_hidden=0 if expert == cfg.ffn_size else expert)
    cfg.validate()
    return cfg


def check_deepseek_v3_representable(cfg: ModelConfig) -> None:
    """ConfigError naming every switch of `cfg` that Hugging Face DeepSeek-V3 cannot hold."""
    need = {"attention": "mla", "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
            "moe_router": "sigmoid", "moe_capacity_factor": 0.0, "moe_shared_gate": False, "moe_every": 1}
    problems = unmet(cfg, need)
    if not cfg.moe_experts:
        problems.append("model.moe_experts=0 (HF DeepSeek-V3 always has expert layers after first_k_dense_replace; "
                        "give the model experts, or keep it in meshlm)")
    if cfg.rope_scaling == "llama3":
        problems.append("model.rope_scaling='llama3' (DeepSeek-V3 scales with YaRN; use 'yarn' or 'none')")
    _fail(problems, "meshlm model as Hugging Face deepseek_v3")


def deepseek_v3_config_dict(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the DeepSeek-V3 model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_deepseek_v3_representable(cfg)
    rope = rope_parameters_for_hf(cfg)
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        rope["mscale_all_dim"] = cfg.rope_mscale_all_dim
    d = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **common,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.n_layers,
         "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
         "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
         "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
         "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave, "hidden_act": "silu",
         "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope,
         "rope_theta": cfg.rope_theta, "attention_bias": False, "attention_dropout": cfg.dropout,
         "n_routed_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
         "moe_intermediate_size": cfg.expert_size, "n_shared_experts": cfg.moe_shared_experts,
         "first_k_dense_replace": cfg.moe_first_dense, "norm_topk_prob": cfg.moe_norm_topk,
         "routed_scaling_factor": cfg.moe_routed_scale, "n_group": cfg.moe_groups,
         "topk_group": cfg.moe_topk_groups,
         "num_nextn_predict_layers": cfg.mtp_depth}
    if cfg.rope_scaling != "none":  # transformers 4.x reads rope_scaling
        d["rope_scaling"] = rope
    return d


def mtp_depth_in_files(cfg: ModelConfig, keys) -> ModelConfig:
    """`cfg` with mtp_depth lowered to the MTP modules the checkpoint's tensor names (`keys`) hold: transformers
    saves DeepSeek-V3 without them, though its config.json keeps num_nextn_predict_layers."""
    depth = 0
    while depth < cfg.mtp_depth and f"model.layers.{cfg.n_layers + depth}.eh_proj.weight" in keys:
        depth += 1
    return cfg if depth == cfg.mtp_depth else replace(cfg, mtp_depth=depth)
