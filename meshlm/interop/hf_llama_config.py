"""Hugging Face Llama config.json -> `ModelConfig`, and what the decoders built on Llama share (Mixtral, Qwen2-MoE
in `hf_config.py`; Qwen3, Qwen3-MoE in `hf_qwen3.py`): the attention/norm/RoPE part, RoPE scaling both ways, the
dense layers of a mixture of experts, the one-line refusal. Below both readers, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig

_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
                   "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                   "attention_dropout": 0.0, "rope_theta": 10000.0}


def unmet(cfg, need: dict[str, Any]) -> list[str]:
    """"model.KEY=VALUE (set model.KEY=WANTED)" for each key of `need` whose value in `cfg` is not the one wanted:
    what a Hugging Face architecture cannot hold, said as the fix (`_fail` joins them into one error)."""
    return [f"model.{k}={getattr(cfg, k)!r} (set model.{k}={v!r})" for k, v in need.items() if getattr(cfg, k) != v]


def _fail(problems: list[str], what: str) -> None:
    if problems:
        raise ConfigError(f"{what} cannot be converted: " + "; ".join(problems))


def _with_defaults(defaults: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    return {**defaults, **{k: v for k, v in d.items() if v is not None}}


def _default_ffn(cfg: ModelConfig, ffn: int) -> int | None:
    """None when `ffn` is what ModelConfig would pick anyway, so configs round-trip unchanged."""
    return None if replace(cfg, ffn_hidden_size=None).ffn_size == ffn else ffn


def _model_config_from_llama(d: dict[str, Any]) -> ModelConfig:
    g = _with_defaults(_LLAMA_DEFAULTS, d)
    rope = g.get("rope_parameters") or g.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    heads, hidden = g["num_attention_heads"], g["hidden_size"]
    problems = []
    if g["hidden_act"] != "silu":
        problems.append(f"hidden_act={g['hidden_act']!r}: meshlm's SwiGLU gates with SiLU; use 'silu'")
    scaling = _rope_scaling_from_hf(rope, rope_type, g["max_position_embeddings"], problems)
    if bool(g["attention_bias"]) != bool(g["mlp_bias"]):
        problems.append(f"attention_bias={g['attention_bias']}, mlp_bias={g['mlp_bias']}: meshlm's model.bias "
                        "covers both; set them equal")
    _fail(problems, "Hugging Face Llama config")
    kv = g["num_key_value_heads"]
    cfg = ModelConfig(vocab_size=g["vocab_size"], n_layers=g["num_hidden_layers"], hidden_size=hidden,
                      n_heads=heads, n_kv_heads=None if kv in (None, heads) else kv,
                      seq_len=g["max_position_embeddings"], dropout=float(g["attention_dropout"]),
                      position="rope", norm="rmsnorm", activation="swiglu", bias=bool(g["attention_bias"]),
                      tie_embeddings=bool(g["tie_word_embeddings"]), norm_eps=g["rms_norm_eps"],
                      rope_theta=float(rope.get("rope_theta", g["rope_theta"])), init_std=g["initializer_range"],
                      head_size=0 if g["head_dim"] in (None, hidden / heads) else g["head_dim"])
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]), **scaling)
    cfg.validate()
    return cfg


def _rope_scaling_from_hf(rope: dict[str, Any], rope_type: str, max_positions: int,
                          problems: list[str]) -> dict[str, Any]:
    """ModelConfig's rope_* fields from Hugging Face's rope_parameters (or 4.x rope_scaling)."""
    if rope_type == "default":
        return {}
    if rope_type == "linear":  # positions / factor (Gemma 3's global layers)
        return {"rope_scaling": "linear", "rope_factor": float(rope.get("factor") or 1.0)}
    if rope_type not in ("llama3", "yarn"):
        problems.append(f"rope_parameters.rope_type={rope_type!r}: meshlm implements 'default', 'linear', 'llama3' "
                        "and 'yarn' RoPE")
        return {}
    original = rope.get("original_max_position_embeddings") or max_positions
    factor = rope.get("factor") or max_positions / original
    out = {"rope_scaling": rope_type, "rope_factor": float(factor), "rope_original_len": int(original)}
    if rope_type == "llama3":
        return {**out, "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0))}
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        problems.append("rope_parameters.mscale/mscale_all_dim (DeepSeek's YaRN variant): meshlm's YaRN takes "
                        "attention_factor only; give attention_factor instead")
    if rope.get("truncate", True) is False:
        problems.append("rope_parameters.truncate=false: meshlm's YaRN rounds the ramp's ends as the paper does")
    return {**out, "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
            "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
            "rope_attention_factor": float(rope.get("attention_factor") or 0.0)}


def rope_parameters_for_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Hugging Face's rope_parameters for `cfg` (rope_type default, linear, llama3 or yarn)."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor}
    out = {"rope_type": cfg.rope_scaling, "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
           "original_max_position_embeddings": cfg.rope_original_len}
    if cfg.rope_scaling == "llama3":
        return {**out, "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor}
    yarn = {**out, "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow}
    return {**yarn, "attention_factor": cfg.rope_attention_factor} if cfg.rope_attention_factor else yarn


def _llama_part(g: dict[str, Any]) -> ModelConfig:
    """The attention/norm/RoPE part, read as Llama's (no biases: checked by the callers)."""
    keep = {k: v for k, v in g.items() if k not in ("architectures", "model_type")}
    return _model_config_from_llama({**keep, "attention_bias": False, "mlp_bias": False})


def _first_dense(g: dict[str, Any], problems: list[str]) -> int:
    """meshlm's moe_first_dense giving Qwen2-MoE's layer set (mlp_only_layers and decoder_sparse_step)."""
    n, step, dense = g["num_hidden_layers"], g["decoder_sparse_step"], set(g["mlp_only_layers"] or [])
    theirs = [i not in dense and (i + 1) % step == 0 for i in range(n)]
    for k in range(n + 1):
        if theirs == [i >= k and (i + 1) % step == 0 for i in range(n)]:
            return k
    problems.append(f"mlp_only_layers={sorted(dense)}: meshlm's dense layers are the first moe_first_dense ones "
                    "(and those decoder_sparse_step skips); list the first layers only, e.g. [0, 1]")
    return 0
