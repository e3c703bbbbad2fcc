"""Hugging Face names of gpt-oss (`GptOssForCausalLM`): a GPT with attention sinks and gpt-oss's experts.

A MoE GPT with the router and expert biases (`model.moe_bias`), the clamped SwiGLU (`model.moe_activation=
'swiglu_clamped'`) or sinks (`model.attention_sinks`) converts to gpt-oss (`interop/hf_gpt_oss.py` checks the
other switches). Every layer is a MoE layer; per layer i (`model.layers.i.`; embeddings, norms and head as Llama's):

    meshlm (layers.i.)        gpt-oss (model.layers.i.)
    attn.qkv.{weight,bias}    self_attn.[q_proj; k_proj; v_proj].{weight,bias}   (biases with attention_bias)
    attn.proj.{weight,bias}   self_attn.o_proj.{weight,bias}
    attn.sinks                self_attn.sinks
    mlp.router.{weight,bias}  mlp.router.{weight,bias}
    mlp.experts.fc            mlp.experts.gate_up_proj         (E, 2F, H) ↔ (E, H, 2F), gate/up interleaved
    mlp.experts.fc_bias       mlp.experts.gate_up_proj_bias    (E, 2F), gate/up interleaved
    mlp.experts.proj          mlp.experts.down_proj            (E, H, F) ↔ (E, F, H)
    mlp.experts.proj_bias     mlp.experts.down_proj_bias       (E, H)

gpt-oss stores its experts as `x @ W` (in, out) matrices, and its fused gate/up columns alternate: column 2j is
the gate of unit j, 2j + 1 its up. meshlm's `fc` is (out, in) with all gates first ([W_gate; W_up]), so the
conversion transposes and (de)interleaves (`Entry.layout`); both are exact copies. That is the layout
`save_pretrained` writes and the bf16 checkpoints hold; MXFP4-quantized ones (`*_blocks`, `*_scales`) are refused
when their config is read.
"""

from __future__ import annotations

import torch

from meshlm.core.config import ModelConfig
from meshlm.families.common import Entry


def is_gpt_oss(cfg: ModelConfig) -> bool:
    """A MoE GPT with any of gpt-oss's own parts: expert biases, the clamped SwiGLU, sinks."""
    return bool(cfg.moe_experts) and (cfg.moe_bias or cfg.moe_activation == "swiglu_clamped" or cfg.attention_sinks)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """(E, 2F, ...) [gates; ups] → rows gate_0, up_0, gate_1, up_1, ... (the same shape)."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack((gate, up), dim=2).reshape(t.shape)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows gate_0, up_0, gate_1, ... of (E, 2F, ...) → [gates; ups]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


GATE_UP = (lambda t: _interleave(t).transpose(1, 2), lambda t: _deinterleave(t.transpose(1, 2)))
GATE_UP_BIAS = (_interleave, _deinterleave)
DOWN = (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2))


def _layer(cfg: ModelConfig, i: int) -> list[Entry]:
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
    table = [Entry(f"{ours}norm1.weight", (f"{theirs}input_layernorm.weight",)),
             Entry(f"{ours}norm2.weight", (f"{theirs}post_attention_layernorm.weight",))]
    for p in ("weight", "bias") if cfg.bias else ("weight",):
        table += [Entry(f"{ours}attn.qkv.{p}", tuple(f"{attn}{x}_proj.{p}" for x in "qkv")),
                  Entry(f"{ours}attn.proj.{p}", (f"{attn}o_proj.{p}",))]
    return table + [
        Entry(f"{ours}attn.sinks", (f"{attn}sinks",)),
        Entry(f"{ours}mlp.router.weight", (f"{mlp}router.weight",)),
        Entry(f"{ours}mlp.router.bias", (f"{mlp}router.bias",)),
        Entry(f"{ours}mlp.experts.fc", (f"{mlp}experts.gate_up_proj",), layout=GATE_UP),
        Entry(f"{ours}mlp.experts.fc_bias", (f"{mlp}experts.gate_up_proj_bias",), layout=GATE_UP_BIAS),
        Entry(f"{ours}mlp.experts.proj", (f"{mlp}experts.down_proj",), layout=DOWN),
        Entry(f"{ours}mlp.experts.proj_bias", (f"{mlp}experts.down_proj_bias",))]


def gpt_oss_table(cfg: ModelConfig) -> list[Entry]:
    """gpt-oss's name table (module doc)."""
    table = [Entry("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        table += _layer(cfg, i)
    return table + [Entry("norm.weight", ("model.norm.weight",)), Entry("lm_head.weight", ("lm_head.weight",))]
