"""Hugging Face Gemma 3 text config.json (model_type `gemma3_text`, `Gemma3ForCausalLM`) <-> `ModelConfig` (the
weights' names: `families/hf_gemma3.py`).

Gemma 3's decoder is Llama's grouped-query attention and RoPE with per-head q/k norms (Qwen3's), and parts of its
own that meshlm has as switches: RMSNorms that scale by (1 + w), a norm on the attention's and on the MLP's output
before each residual add, embeddings times √hidden_size, a softmax scale from query_pre_attn_scalar, a GeGLU MLP,
and local (sliding-window) layers between global ones with their own RoPE base. The map:

    Gemma 3                                   meshlm model.
    (always)                                  norm = rmsnorm, norm_unit_offset, sandwich_norm, embed_scale,
                                              qk_norm = true, position = rope, bias = false
    hidden_activation gelu_pytorch_tanh       activation = geglu
    head_dim                                  head_size (0 when it is hidden_size / num_attention_heads)
    query_pre_attn_scalar                     attn_scale_dim (0 when it equals head_dim)
    sliding_window, layer_types               sliding_window, window_pattern (layer i global when (i + 1) % N == 0;
      (or 4.x's sliding_window_pattern)         no 'sliding_attention' entry: sliding_window 0)
    rope_parameters.full_attention            rope_theta, rope_scaling (linear, llama3, yarn: the global layers')
      (4.x: rope_theta, rope_scaling)
    rope_parameters.sliding_attention         rope_local_theta (default RoPE only)
      (4.x: rope_local_base_freq)

Refused with the field and the fix: final_logit_softcapping or attn_logit_softcapping set (Gemma 2's tanh caps;
Gemma 3 sets neither), use_bidirectional_attention, attention_bias, another hidden_activation, a layer_types list
window_pattern cannot say, RoPE scaling on the local layers. Exported, a model must have every switch above (and
MHA, no experts, no sinks, no multi-token prediction).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.families.hf_gemma3 import gemma_parts
from meshlm.interop.hf_gpt_oss import window_pattern
from meshlm.interop.hf_llama_config import _default_ffn, _fail, _rope_scaling_from_hf, rope_parameters_for_hf, unmet

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3TextModel")
# transformers' Gemma3TextConfig defaults (those read here)
_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "initializer_range": 0.02,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
             "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
             "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new")  # transformers' tanh approximations of GeLU


def _rope(g: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """rope_theta, rope_local_theta and the global layers' scaling, from transformers 5's per-layer-type
    rope_parameters or 4.x's rope_theta / rope_local_base_freq / rope_scaling."""
    params = g.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or g.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {})
    full_type = full.get("rope_type", full.get("type", "default"))
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type != "default":
        problems.append(f"rope_parameters.sliding_attention.rope_type={local_type!r}: meshlm's local layers rotate "
                        "with plain RoPE at their own base; use 'default'")
    out = _rope_scaling_from_hf(full, full_type, g["max_position_embeddings"], problems)
    return {**out, "rope_theta": float(full.get("rope_theta", g["rope_theta"])),
            "rope_local_theta": float(local.get("rope_theta", g["rope_local_base_freq"]))}


def _check_gemma(g: dict[str, Any], problems: list[str]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if g.get(key) is not None:
            problems.append(f"{key}={g[key]}: meshlm has no tanh soft-capping (Gemma 3 sets none); set {key}=null")
    if g.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true: meshlm's GPT is a causal decoder; set it false")
    if g["attention_bias"]:
        problems.append("attention_bias=true: meshlm's Gemma has no q/k/v/o biases (released Gemma 3 models have "
                        "none); set attention_bias=false")
    act = g.get("hidden_activation") or g.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _TANH_GELU:
        problems.append(f"hidden_activation={act!r}: meshlm's GeGLU gates with the tanh GeLU; use 'gelu_pytorch_tanh'")


def model_config_from_gemma3(d: dict[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Gemma 3 text config.json dict (the map in the module doc)."""
    g = {**_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    problems = []
    _check_gemma(g, problems)
    n, heads, hidden = g["num_hidden_layers"], g["num_attention_heads"], g["hidden_size"]
    types = d.get("layer_types")
    if types is None:  # transformers 4.x's config: every sliding_window_pattern-th layer global
        pattern = int(g["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    local, pattern = window_pattern(types, n, problems)
    window = int(d["sliding_window"] or 0) if "sliding_window" in d else int(g["sliding_window"])
    if local and not window:
        problems.append("layer_types names 'sliding_attention' layers but sliding_window is null; give the window")
    rope = _rope(g, problems)
    _fail(problems, "Hugging Face Gemma 3 config")
    kv, head_dim = g["num_key_value_heads"], g["head_dim"]
    if not local:
        rope["rope_local_theta"] = 0.0
    cfg = ModelConfig(vocab_size=g["vocab_size"], n_layers=n, hidden_size=hidden, n_heads=heads,
                      n_kv_heads=None if kv in (None, heads) else kv, seq_len=g["max_position_embeddings"],
                      dropout=float(g["attention_dropout"]), position="rope", norm="rmsnorm", activation="geglu",
                      bias=False, qk_norm=True, tie_embeddings=bool(g["tie_word_embeddings"]),
                      norm_eps=g["rms_norm_eps"], init_std=g["initializer_range"],
                      head_size=0 if head_dim in (None, hidden / heads) else head_dim,
                      sliding_window=window if local else 0, window_pattern=pattern if local else 0,
                      norm_unit_offset=True, sandwich_norm=True, embed_scale=True, **rope)
    scalar = float(g["query_pre_attn_scalar"])
    cfg = replace(cfg, attn_scale_dim=0.0 if scalar == cfg.head_dim else scalar,
                  ffn_hidden_size=_default_ffn(cfg, int(g["intermediate_size"])))
    cfg.validate()
    return cfg


def check_gemma3_representable(cfg: ModelConfig) -> None:
    """ConfigError naming every switch of `cfg` that Hugging Face Gemma 3 cannot hold."""
    need = {"position": "rope", "norm": "rmsnorm", "activation": "geglu", "bias": False, "qk_norm": True,
            "attention": "mha", "norm_unit_offset": True, "sandwich_norm": True, "embed_scale": True,
            "moe_experts": 0, "attention_sinks": False, "mtp_depth": 0}
    problems = unmet(cfg, need)
    if cfg.sliding_window and not cfg.rope_local_theta and cfg.rope_scaling != "none":
        problems.append(f"model.rope_local_theta=0 with model.rope_scaling={cfg.rope_scaling!r} (Gemma's local layers "
                        "rotate unscaled at their own base; set model.rope_local_theta, e.g. 10000)")
    _fail(problems, "meshlm model as Hugging Face gemma3_text")


def refuse_gemma_parts(cfg: ModelConfig, arch: str) -> None:
    """ConfigError when `cfg` has Gemma's layer parts and `arch` (not 'gemma3_text') cannot hold them."""
    parts = gemma_parts(cfg)
    if parts and arch != "gemma3_text":
        raise ConfigError(f"{', '.join(parts)}: Gemma's layer parts cannot be written as Hugging Face {arch}; export "
                          "the model as 'gemma3_text' (Gemma3ForCausalLM)")


def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def gemma3_config_dict(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Gemma 3 model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_gemma3_representable(cfg)
    full = rope_parameters_for_hf(cfg)
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    layer_types = ["sliding_attention" if cfg.layer_window(i) else "full_attention" for i in range(cfg.n_layers)]
    d = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **common,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.n_layers,
         "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
         "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": cfg.seq_len,
         "rms_norm_eps": cfg.norm_eps, "attention_bias": False, "attention_dropout": cfg.dropout,
         "query_pre_attn_scalar": _whole(cfg.attn_scale_dim or cfg.head_dim),  # transformers 5 takes an int
         # every layer global: transformers still builds a window mask, so a window it never applies
         "sliding_window": cfg.sliding_window or cfg.seq_len, "layer_types": layer_types,
         "rope_parameters": {"sliding_attention": local, "full_attention": full},
         "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
         # transformers 4.x reads these
         "rope_theta": cfg.rope_theta, "rope_local_base_freq": local["rope_theta"]}
    if cfg.rope_scaling != "none":
        d["rope_scaling"] = full
    return d
