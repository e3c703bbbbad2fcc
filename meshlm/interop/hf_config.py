"""Hugging Face config.json <-> `ModelConfig` for GPT-2, Llama, BERT, Mixtral and Qwen2-MoE (the MoE map:
`hf_moe.py`'s doc), Qwen3 and Qwen3-MoE (`hf_qwen3.py`), Mistral (`hf_mistral.py`), DeepSeek-V3
(`hf_deepseek.py`), gpt-oss (`hf_gpt_oss.py`), Gemma 3 (`hf_gemma3.py`); the Llama reader, which the others build on, is
`hf_llama_config.py`.

`model_config_from_hf` reads a `transformers` config object or a plain config.json dict (missing keys take
the HF defaults), so loading needs no `transformers`; only `hf_config_from_model_config` imports it. Every
HF feature meshlm lacks raises `ConfigError` (a ValueError) naming the field and the fix, rather than
converting to a model that silently computes something else.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.interop.hf_deepseek import (
    DEEPSEEK_V3_ARCHITECTURES,
    check_deepseek_v3_representable,
    deepseek_v3_config_dict,
    model_config_from_deepseek_v3,
)
from meshlm.interop.hf_gemma3 import (
    GEMMA3_ARCHITECTURES,
    check_gemma3_representable,
    gemma3_config_dict,
    model_config_from_gemma3,
    refuse_gemma_parts,
)
from meshlm.interop.hf_gpt_oss import (
    GPT_OSS_ARCHITECTURES,
    check_gpt_oss_representable,
    gpt_oss_config_dict,
    model_config_from_gpt_oss,
)
from meshlm.interop.hf_llama_config import (
    _default_ffn,
    _fail,
    _first_dense,
    _llama_part,
    _model_config_from_llama,
    _with_defaults,
    rope_parameters_for_hf,
    unmet,
)
from meshlm.interop.hf_mistral import (
    MISTRAL_ARCHITECTURES,
    check_mistral_representable,
    mistral_config_dict,
    model_config_from_mistral,
    refuse_window,
)
from meshlm.interop.hf_qwen3 import (
    QWEN3_ARCHITECTURES,
    QWEN3_MOE_ARCHITECTURES,
    check_qwen3_representable,
    model_config_from_qwen3,
    model_config_from_qwen3_moe,
    qwen3_config_dict,
)

_GPT2_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
                  "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
                  "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                  "add_cross_attention": False, "tie_word_embeddings": True}
_BERT_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                  "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
                  "initializer_range": 0.02, "layer_norm_eps": 1e-12, "position_embedding_type": "absolute",
                  "is_decoder": False, "add_cross_attention": False, "tie_word_embeddings": True,
                  "problem_type": None}
_ENDOFTEXT = 50256  # GPT-2 BPE's <|endoftext|>, meshlm's default tokenizer

# The Hugging Face classes each family converts to and from; a BERT class fixes `model.bert_head`.
GPT2_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")
BERT_HEADS = {"BertModel": "encoder", "BertForMaskedLM": "mlm", "BertForPreTraining": "pretrain",
              "BertForSequenceClassification": "classify", "BertForTokenClassification": "tokens",
              "BertForQuestionAnswering": "span"}
BERT_ARCHITECTURES = {head: arch for arch, head in BERT_HEADS.items()}
_EXACT_GELU = ("gelu", "gelu_python")  # erf GeLU in transformers' ACT2FN
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def model_config_from_hf(hf_config: Any, expect: str | None = None) -> ModelConfig:
    """A `ModelConfig` from an HF GPT-2, Llama, Mistral, BERT, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V3,
    gpt-oss or Gemma 3 text config (object or
    config.json dict); ValueError if the HF model uses something meshlm lacks (exact GeLU in GPT-2, a sliding
    window, ...). `expect` ('gpt2' or 'llama') is assumed when the dict has no model_type and enforced when it
    has one."""
    d = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
    kind = d.get("model_type") or expect
    if expect is not None and kind != expect:
        raise ConfigError(f"expected a Hugging Face {expect!r} config, got model_type={kind!r}; "
                          "use from_hf_gpt2 for 'gpt2', from_hf_llama for 'llama' and from_hf_bert for 'bert'")
    readers = {"gpt2": (_model_config_from_gpt2, GPT2_ARCHITECTURES),
               "llama": (_model_config_from_llama, LLAMA_ARCHITECTURES),
               "bert": (_model_config_from_bert, tuple(BERT_HEADS)),
               "mixtral": (model_config_from_mixtral, MIXTRAL_ARCHITECTURES),
               "qwen2_moe": (model_config_from_qwen2_moe, QWEN2_MOE_ARCHITECTURES),
               "mistral": (model_config_from_mistral, MISTRAL_ARCHITECTURES),
               "qwen3": (model_config_from_qwen3, QWEN3_ARCHITECTURES),
               "qwen3_moe": (model_config_from_qwen3_moe, QWEN3_MOE_ARCHITECTURES),
               "deepseek_v3": (model_config_from_deepseek_v3, DEEPSEEK_V3_ARCHITECTURES),
               "gpt_oss": (model_config_from_gpt_oss, GPT_OSS_ARCHITECTURES),
               "gemma3_text": (model_config_from_gemma3, GEMMA3_ARCHITECTURES)}
    if kind == "gemma3":  # the multimodal config: its text model is a `text_config` inside
        raise ConfigError("Hugging Face model_type='gemma3' is Gemma 3's image-and-text model; meshlm converts its "
                          "text model, model_type 'gemma3_text' (Gemma3ForCausalLM): save that one")
    if kind not in readers:
        raise ConfigError(f"Hugging Face model_type={kind!r} is not supported; meshlm converts 'gpt2', 'llama', "
                          "'bert', 'mistral', 'mixtral', 'qwen2_moe', 'qwen3', 'qwen3_moe', 'deepseek_v3', "
                          "'gpt_oss' and 'gemma3_text'")
    read, known = readers[kind]
    architecture = hf_architecture_name(d)
    if architecture is not None and known and architecture not in known:
        raise ConfigError(f"architectures={d['architectures']!r}: meshlm converts {kind} models of the classes "
                          f"{', '.join(known)}")
    _check_field_types(d)
    try:
        return read(d)
    except (TypeError, ValueError, KeyError) as err:  # a field of a type the table above does not know
        raise ConfigError(f"the Hugging Face config.json cannot be converted ({type(err).__name__}: {err}); fix the "
                          "field it names") from None


# sizes and counts (positive integers) and real numbers a config.json may hold, checked before any is used
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "n_layer", "n_embd", "n_head", "n_positions",
               "n_inner", "n_ctx", "type_vocab_size", "num_local_experts", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step", "head_dim")
_FLOAT_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range",
                 "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                 "swiglu_limit", "swiglu_alpha", "query_pre_attn_scalar", "rope_local_base_freq")


def _check_field_types(d: dict[str, Any]) -> None:
    """ConfigError naming the first field of the wrong type (e.g. `"num_hidden_layers": "two"`)."""
    for key in _INT_FIELDS:
        value = d.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"the Hugging Face config.json has {key}={value!r}; it must be a whole number >= 1")
    for key in _FLOAT_FIELDS:
        value = d.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value)):
            raise ConfigError(f"the Hugging Face config.json has {key}={value!r}; it must be a finite number")


def hf_architecture_name(d: dict[str, Any]) -> str | None:
    """The one class named by a config.json's `architectures` (None when it names none); several are
    refused, as meshlm converts one model."""
    names = d.get("architectures") or []
    if len(names) > 1:
        raise ConfigError(f"architectures={names!r} names several classes; meshlm converts a directory of one "
                          "model class")
    return names[0] if names else None


def _model_config_from_gpt2(d: dict[str, Any]) -> ModelConfig:
    g = _with_defaults(_GPT2_DEFAULTS, d)
    problems = []
    if g["activation_function"] not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function={g['activation_function']!r}: meshlm's GeLU is the tanh "
                        "approximation; use 'gelu_new'")
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if bool(g[key]) != ok:
            problems.append(f"{key}={g[key]}: meshlm's attention needs {key}={ok}")
    drops = {float(g[k]) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(drops) > 1:
        problems.append(f"resid_pdrop, embd_pdrop, attn_pdrop = {g['resid_pdrop']}, {g['embd_pdrop']}, "
                        f"{g['attn_pdrop']}: meshlm has one model.dropout; set the three equal")
    _fail(problems, "Hugging Face GPT-2 config")
    cfg = ModelConfig(vocab_size=g["vocab_size"], n_layers=g["n_layer"], hidden_size=g["n_embd"],
                      n_heads=g["n_head"], seq_len=g["n_positions"], dropout=drops.pop(), position="learned",
                      norm="layernorm", activation="gelu", bias=True, tie_embeddings=bool(g["tie_word_embeddings"]),
                      norm_eps=g["layer_norm_epsilon"], init_std=g["initializer_range"])
    if g["n_inner"]:
        cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["n_inner"]))
    cfg.validate()
    return cfg


def _model_config_from_bert(d: dict[str, Any]) -> ModelConfig:
    g = _with_defaults(_BERT_DEFAULTS, d)
    head = BERT_HEADS[hf_architecture_name(d) or "BertModel"]  # no architectures: AutoModel's BertModel
    problems = []
    act = g["hidden_act"]
    if act in _TANH_GELU and head in ("pretrain", "mlm"):
        problems.append(f"hidden_act={act!r}: meshlm's BERT MLM transform uses the exact GeLU; only "
                        "hidden_act='gelu' converts with an MLM head")
    elif act not in _EXACT_GELU + _TANH_GELU:
        problems.append(f"hidden_act={act!r}: meshlm's BERT uses GeLU; use 'gelu' (exact) or 'gelu_new' (tanh)")
    for key, ok in (("position_embedding_type", "absolute"), ("is_decoder", False), ("add_cross_attention", False)):
        if g[key] != ok:
            problems.append(f"{key}={g[key]!r}: meshlm's BERT needs {key}={ok!r} (learned absolute positions, "
                            "a bidirectional encoder without cross-attention)")
    if g["problem_type"] == "multi_label_classification":
        problems.append("problem_type='multi_label_classification': meshlm's classify head trains with "
                        "cross-entropy over exclusive classes (or MSE with one label); drop problem_type")
    _fail(problems, "Hugging Face BERT config")
    labels = d.get("id2label")
    num_labels = len(labels) if labels else int(d.get("num_labels") or 2)
    cfg = ModelConfig(family="bert", vocab_size=g["vocab_size"], n_layers=g["num_hidden_layers"],
                      hidden_size=g["hidden_size"], n_heads=g["num_attention_heads"],
                      seq_len=g["max_position_embeddings"], dropout=float(g["hidden_dropout_prob"]),
                      position="learned", norm="layernorm", activation="gelu_exact" if act in _EXACT_GELU else "gelu",
                      bias=True, tie_embeddings=bool(g["tie_word_embeddings"]), norm_eps=g["layer_norm_eps"],
                      init_std=g["initializer_range"], type_vocab_size=g["type_vocab_size"], bert_head=head,
                      num_labels=num_labels if head in ("classify", "tokens") else 2)
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]))
    cfg.validate()
    return cfg


def hf_architecture(cfg: ModelConfig) -> str:
    """The family's Hugging Face architecture: 'bert' for BERT; 'gpt2' for a GPT with learned positions, 'llama'
    with RoPE (`hf_config_dict` checks the other switches)."""
    from meshlm.families.registry import get_spec

    arch = get_spec(cfg.family).hf_architecture
    if arch is None:
        raise ConfigError(f"model.family={cfg.family!r} has no Hugging Face conversion (its ModelSpec sets no "
                          "hf_architecture); use meshlm convert --to-single for a plain safetensors file")
    return arch(cfg)


def check_representable(cfg: ModelConfig, arch: str) -> None:
    if (arch == "bert") != (hf_architecture(cfg) == "bert"):
        raise ConfigError(f"a meshlm model.family={cfg.family!r} model cannot be written as Hugging Face {arch}; "
                          f"use {hf_architecture(cfg)!r}")
    if arch == "bert":
        return _check_bert(cfg)
    refuse_gemma_parts(cfg, arch)
    if arch == "mistral":
        return check_mistral_representable(cfg)
    if arch == "gemma3_text":
        return check_gemma3_representable(cfg)
    if arch == "gpt_oss":
        return check_gpt_oss_representable(cfg)
    refuse_window(cfg, arch)
    if cfg.mtp_depth and arch != "deepseek_v3":  # only DeepSeek's files hold multi-token prediction modules
        raise ConfigError(f"model.mtp_depth={cfg.mtp_depth}: Hugging Face {arch} has no multi-token prediction "
                          "modules (DeepSeek-V3 has); keep the model in meshlm")
    if cfg.attention == "mla" or arch == "deepseek_v3":
        if arch != "deepseek_v3" or hf_architecture(cfg) != arch:
            raise ConfigError(f"a meshlm model with model.attention={cfg.attention!r} cannot be written as Hugging "
                              f"Face {arch}; it converts to {hf_architecture(cfg)!r}")
        return check_deepseek_v3_representable(cfg)
    if cfg.qk_norm or arch in ("qwen3", "qwen3_moe"):
        if arch not in ("qwen3", "qwen3_moe"):
            raise ConfigError(f"model.qk_norm=true (per-head q/k norms) cannot be written as Hugging Face {arch}; it "
                              f"converts to {hf_architecture(cfg)!r}")
        return check_qwen3_representable(cfg, arch)
    if cfg.moe_experts or arch in ("mixtral", "qwen2_moe"):
        return _check_moe(cfg, arch)
    need = {"gpt2": {"position": "learned", "norm": "layernorm", "activation": "gelu", "bias": True},
            "llama": {"position": "rope", "norm": "rmsnorm", "activation": "swiglu"}}[arch]
    problems = unmet(cfg, need)
    if arch == "gpt2" and cfg.kv_heads != cfg.n_heads:
        problems.append(f"model.n_kv_heads={cfg.n_kv_heads} (GPT-2 has no grouped-query attention; unset it)")
    if arch == "gpt2" and cfg.head_size:
        problems.append(f"model.head_size={cfg.head_size} (GPT-2's heads are n_embd / n_head wide; unset it)")
    other = "Llama needs position='rope', norm='rmsnorm', activation='swiglu'" if arch == "gpt2" else \
        "GPT-2 needs position='learned', norm='layernorm', activation='gelu', bias=true"
    _fail(problems and problems + [other], f"meshlm model as Hugging Face {arch}")


def _check_moe(cfg: ModelConfig, arch: str) -> None:
    if arch != hf_architecture(cfg):
        raise ConfigError(f"a meshlm model with model.moe_experts={cfg.moe_experts} cannot be written as Hugging Face "
                          f"{arch}; it converts to {hf_architecture(cfg)!r} (model.moe_experts=0 is a dense model)")
    check_moe_representable(cfg, arch)


def _check_bert(cfg: ModelConfig) -> None:
    problems = [f"model.{k}={getattr(cfg, k)!r} (set model.{k}={v!r})"
                for k, v in (("norm", "layernorm"), ("bias", True)) if getattr(cfg, k) != v]
    if cfg.activation not in ("gelu_exact", "gelu"):
        problems.append(f"model.activation={cfg.activation!r} (Hugging Face BERT needs 'gelu_exact')")
    elif cfg.activation == "gelu" and cfg.bert_head in ("pretrain", "mlm"):
        problems.append("model.activation='gelu' with an MLM head (Hugging Face applies hidden_act in the MLM "
                        "transform too, meshlm the exact GeLU; set model.activation='gelu_exact')")
    if cfg.kv_heads != cfg.n_heads:
        problems.append(f"model.n_kv_heads={cfg.n_kv_heads} (BERT has no grouped-query attention; unset it)")
    if cfg.qk_norm or cfg.head_size:  # Qwen3's switches: BERT's attention has neither
        problems.append(f"model.qk_norm={cfg.qk_norm}, model.head_size={cfg.head_size} (BERT has no per-head q/k "
                        "norms and heads of hidden_size / n_heads; set model.qk_norm=false, model.head_size=0)")
    _fail(problems, "meshlm model as Hugging Face BERT")


def _bert_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    d = {"model_type": "bert", "architectures": [BERT_ARCHITECTURES[cfg.bert_head]], "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
         "intermediate_size": cfg.ffn_size, "hidden_act": "gelu" if cfg.activation == "gelu_exact" else "gelu_new",
         "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout,
         "max_position_embeddings": cfg.seq_len, "type_vocab_size": cfg.type_vocab_size,
         "initializer_range": cfg.init_std, "layer_norm_eps": cfg.norm_eps, "position_embedding_type": "absolute",
         "tie_word_embeddings": cfg.tie_embeddings, "pad_token_id": 0}
    if cfg.bert_head in ("classify", "tokens"):
        d["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
        d["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
        if cfg.bert_head == "classify" and cfg.num_labels == 1:
            d["problem_type"] = "regression"
    return d


def hf_config_dict(cfg: ModelConfig, arch: str | None = None) -> dict[str, Any]:
    """The config.json dict of the HF model equal to `cfg` (arch 'gpt2', 'llama' or 'bert'; default from
    the family and the position switch). A BERT's class follows `model.bert_head`. bos/eos are GPT-2's <|endoftext|> when the vocabulary holds it, else unset.
    HF Llama has attention dropout only, so meshlm's embedding/residual dropout does not carry over to
    HF training (inference is unaffected)."""
    arch = arch or hf_architecture(cfg)
    check_representable(cfg, arch)
    if arch == "bert":
        return _bert_config_dict(cfg)
    special = _ENDOFTEXT if cfg.vocab_size > _ENDOFTEXT else None
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "bos_token_id": special, "eos_token_id": special}
    if arch in ("mixtral", "qwen2_moe"):
        return moe_config_dict(cfg, arch, common)
    if arch in ("qwen3", "qwen3_moe"):
        return qwen3_config_dict(cfg, arch, common)
    if arch == "mistral":
        return mistral_config_dict(cfg, common)
    if arch == "deepseek_v3":
        return deepseek_v3_config_dict(cfg, common)
    if arch == "gpt_oss":
        return gpt_oss_config_dict(cfg, common)
    if arch == "gemma3_text":
        return gemma3_config_dict(cfg, common)
    if arch == "gpt2":
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **common, "n_positions": cfg.seq_len,
                "n_embd": cfg.hidden_size, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
                "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_new", "resid_pdrop": cfg.dropout,
                "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "layer_norm_epsilon": cfg.norm_eps}
    # transformers 4.x reads scaling from rope_scaling; 5.x from rope_parameters (and takes rope_scaling as its alias)
    scaled = {"rope_scaling": rope_parameters_for_hf(cfg)} if cfg.rope_scaling != "none" else {}
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common, **scaled,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            # rope_theta at the top level too, for transformers 4.x readers
            "rope_parameters": rope_parameters_for_hf(cfg), "rope_theta": cfg.rope_theta,
            "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout}


def hf_config_from_model_config(cfg: ModelConfig, arch: str | None = None) -> Any:
    """A `transformers` GPT2Config, LlamaConfig or BertConfig equal to `cfg` (needs transformers)."""
    from transformers import AutoConfig

    d = hf_config_dict(cfg, arch)
    return AutoConfig.for_model(d.pop("model_type"), **d)


# ---- mixtures of experts: Mixtral and Qwen2-MoE (the map and what is refused: hf_moe.py's doc) ----
MIXTRAL_ARCHITECTURES = ("MixtralForCausalLM", "MixtralModel")
QWEN2_MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen2MoeModel")
# transformers' defaults where they differ from Llama's (`hf_llama_config._LLAMA_DEFAULTS`)
_MIXTRAL_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                     "rope_theta": 1e6, "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
                     "router_aux_loss_coef": 0.001}
_QWEN2_MOE_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                       "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                       "use_sliding_window": False, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                       "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
                       "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "qkv_bias": True}


def model_config_from_mixtral(d: dict[str, Any]) -> ModelConfig:
    g = {**_MIXTRAL_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    problems = []
    window = g.get("sliding_window")
    if window is not None and window < g["max_position_embeddings"]:
        problems.append(f"sliding_window={window}: meshlm attends over the whole context; set sliding_window "
                        "null (Mixtral-8x7B's own config has none)")
    _fail(problems, "Hugging Face Mixtral config")
    cfg = _llama_part(g)
    cfg = replace(cfg, moe_experts=int(g["num_local_experts"]), moe_top_k=int(g["num_experts_per_tok"]),
                  moe_norm_topk=True, moe_aux_loss=float(g["router_aux_loss_coef"]))
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]))
    cfg.validate()
    return cfg


def model_config_from_qwen2_moe(d: dict[str, Any]) -> ModelConfig:
    g = {**_QWEN2_MOE_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    problems = []
    if g["use_sliding_window"]:
        problems.append("use_sliding_window=true: meshlm attends over the whole context; set it false")
    experts, expert, shared = int(g["num_experts"]), int(g["moe_intermediate_size"]), \
        int(g["shared_expert_intermediate_size"])
    if experts < 1:
        problems.append(f"num_experts={experts}: a dense Qwen2 model; convert it as Llama")
    if shared <= 0 or shared % expert:
        problems.append(f"shared_expert_intermediate_size={shared}: meshlm's shared expert is moe_shared_experts × "
                        f"moe_intermediate_size wide; use a positive multiple of {expert}")
    first = _first_dense(g, problems)
    _fail(problems, "Hugging Face Qwen2-MoE config")
    cfg = _llama_part(g)
    cfg = replace(cfg, bias=bool(g["qkv_bias"]), moe_experts=experts, moe_top_k=int(g["num_experts_per_tok"]),
                  moe_every=int(g["decoder_sparse_step"]), moe_first_dense=first, moe_shared_experts=shared // expert, moe_shared_gate=True,
                  moe_norm_topk=bool(g["norm_topk_prob"]), moe_aux_loss=float(g["router_aux_loss_coef"]))
    cfg = replace(cfg, ffn_hidden_size=_default_ffn(cfg, g["intermediate_size"]))
    cfg = replace(cfg, moe_expert_hidden=0 if expert == cfg.ffn_size else expert)
    cfg.validate()
    return cfg


def check_moe_representable(cfg: ModelConfig, arch: str) -> None:
    """ConfigError naming every switch of MoE model `cfg` that Hugging Face `arch` cannot hold."""
    need = {"position": "rope", "norm": "rmsnorm", "activation": "swiglu", "moe_router": "softmax",
            "moe_capacity_factor": 0.0}
    if arch == "mixtral":
        need.update(bias=False, moe_norm_topk=True, moe_every=1, moe_first_dense=0, moe_shared_experts=0)
    else:
        need.update(moe_shared_gate=True)
    problems = unmet(cfg, need)
    if problems and arch == "mixtral":
        problems.append("Mixtral routes every layer with renormalised top-k weights and no shared expert; a model "
                        "with a gated shared expert (moe_shared_experts >= 1, moe_shared_gate=true) exports as "
                        "Qwen2-MoE")
    _fail(problems, f"meshlm MoE model as Hugging Face {arch}")


def moe_config_dict(cfg: ModelConfig, arch: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Mixtral or Qwen2-MoE model equal to `cfg` (`common`: vocabulary, ties, special ids)."""
    check_moe_representable(cfg, arch)
    base = {**common, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": rope_parameters_for_hf(cfg), "rope_theta": cfg.rope_theta,
            "attention_dropout": cfg.dropout, "num_experts_per_tok": cfg.moe_top_k,
            "router_aux_loss_coef": cfg.moe_aux_loss, "output_router_logits": False}
    if cfg.rope_scaling != "none":
        base["rope_scaling"] = rope_parameters_for_hf(cfg)
    if arch == "mixtral":
        return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **base,
                "intermediate_size": cfg.expert_size, "num_local_experts": cfg.moe_experts,
                "sliding_window": None, "router_jitter_noise": 0.0}
    return {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **base,
            "intermediate_size": cfg.ffn_size, "moe_intermediate_size": cfg.expert_size,
            "shared_expert_intermediate_size": cfg.moe_shared_experts * cfg.expert_size,
            "num_experts": cfg.moe_experts, "norm_topk_prob": cfg.moe_norm_topk,
            "decoder_sparse_step": cfg.moe_every, "mlp_only_layers": list(range(cfg.moe_first_dense)),
            "qkv_bias": cfg.bias, "use_sliding_window": False}
