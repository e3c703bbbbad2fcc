"""Hugging Face Mistral config.json <-> `ModelConfig`.

Mistral is a Llama decoder (the same tensor names) whose every layer attends over a sliding window: the query at
position i sees keys i - W + 1 .. i (`model.sliding_window` = W, transformers' `sliding_window_overlay`). The map
(beyond Llama's, `hf_llama_config.py`):

    Mistral                      meshlm model.
    sliding_window (None: off)   sliding_window (0: off)
    head_dim                     head_size (0 when it is hidden_size / num_attention_heads)
    (no biases)                  bias = false

Refused with the field and the fix: a `layer_types` list naming any 'full_attention' layer when a window is set
(transformers' Mistral windows every layer and ignores the list; Ministral's alternation is a different class).
Exported, a model must have RMSNorm, RoPE, SwiGLU, no bias, no per-head q/k norms, no experts, a window on every
layer (model.window_pattern=0) and no attention sinks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.interop.hf_llama_config import _fail, _llama_part, rope_parameters_for_hf, unmet

MISTRAL_ARCHITECTURES = ("MistralForCausalLM", "MistralModel")
# transformers' defaults where they differ from Llama's (`hf_llama_config._LLAMA_DEFAULTS`)
_MISTRAL_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                     "rms_norm_eps": 1e-6, "sliding_window": 4096}


def model_config_from_mistral(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Mistral config.json dict (None values take transformers' defaults, except
    sliding_window, where None means no window)."""
    g = {**_MISTRAL_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    window = int(d["sliding_window"] or 0) if "sliding_window" in d else int(g["sliding_window"])
    problems = []
    if window < 0:
        problems.append(f"sliding_window={window}: give a positive window, or null for none")
    if window and "full_attention" in (g.get("layer_types") or []):
        problems.append("layer_types names 'full_attention' layers, but transformers' Mistral windows every layer; "
                        "drop layer_types (or convert the model as its own class)")
    if g.get("attention_bias") or g.get("mlp_bias"):
        problems.append("attention_bias/mlp_bias=true: Mistral has no biases; set them false")
    _fail(problems, "Hugging Face Mistral config")
    cfg = replace(_llama_part(g), sliding_window=window)
    cfg.validate()
    return cfg


def check_mistral_representable(cfg: ModelConfig) -> None:
    """ConfigError naming every switch of `cfg` that Hugging Face Mistral cannot hold."""
    need = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "qk_norm": False,
            "moe_experts": 0, "window_pattern": 0, "attention_sinks": False, "attention": "mha"}
    problems = unmet(cfg, need)
    _fail(problems, "meshlm model as Hugging Face mistral")


def mistral_config_dict(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Mistral model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_mistral_representable(cfg)
    d = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **common,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.n_layers,
         "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
         "rope_parameters": rope_parameters_for_hf(cfg), "rope_theta": cfg.rope_theta,
         "attention_dropout": cfg.dropout, "sliding_window": cfg.sliding_window or None}
    if cfg.rope_scaling != "none":  # transformers 4.x reads rope_scaling
        d["rope_scaling"] = rope_parameters_for_hf(cfg)
    return d


def refuse_window(cfg: ModelConfig, arch: str) -> None:
    """ConfigError when `cfg` has a sliding window or sinks and `arch` (not 'mistral') cannot hold them."""
    if cfg.sliding_window or cfg.attention_sinks:
        fix = "export it as 'mistral'" if not (cfg.window_pattern or cfg.attention_sinks) else \
            "alternating windows export with Gemma's layer parts as 'gemma3_text', or with sinks and gpt-oss's " \
            "experts as 'gpt_oss' (families/hf_gemma3.py, families/hf_gpt_oss.py)"
        raise ConfigError(f"model.sliding_window={cfg.sliding_window}, model.window_pattern={cfg.window_pattern}, "
                          f"model.attention_sinks={cfg.attention_sinks} cannot be written as Hugging Face {arch} "
                          f"(full attention, no sinks); {fix}")
