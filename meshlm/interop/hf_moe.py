"""Hugging Face Mixtral and Qwen2-MoE <-> a mixture-of-experts GPT: the map, and the experts' weights.

Both are Llama decoders whose MLP is a router over SwiGLU experts: softmax over all experts, the top k taken,
their weights renormalised to sum to 1 (Mixtral; Qwen2-MoE when norm_topk_prob) or not. meshlm's MoE layer
(`models/moe.py`) computes the same, so a converted model gives the same logits. The map:

    Mixtral                      Qwen2-MoE                          meshlm model.
    num_local_experts            num_experts                        moe_experts
    num_experts_per_tok          num_experts_per_tok                moe_top_k
    intermediate_size            moe_intermediate_size              moe_expert_hidden
    -                            intermediate_size (dense layers)   ffn_hidden_size
    (always renormalised)        norm_topk_prob                     moe_norm_topk
    -                            shared_expert_intermediate_size    moe_shared_experts × moe_expert_hidden
    -                            shared_expert_gate (always)        moe_shared_gate = true
    -                            decoder_sparse_step                moe_every
    -                            mlp_only_layers = [0, k)           moe_first_dense = k
    router_aux_loss_coef         router_aux_loss_coef               moe_aux_loss

Qwen2-MoE's bias on q/k/v only (qkv_bias, as Qwen1.5-MoE-A2.7B has) becomes `model.bias=true` with the
biases HF lacks (o_proj's, the dense MLPs') zero; such a model exports back while those are still zero
(`families/hf_moe.py`). Refused, each with the field and the fix: a sliding window (meshlm attends over the
whole context), mlp_only_layers that are not the first layers, a shared expert whose width is not a multiple
of an expert's. Exported, a model must have softmax routing (the sigmoid router's selection bias has no HF
counterpart), no capacity limit (HF routes dropless), and Mixtral's uniform layout without biases or Qwen2-MoE's
gated shared expert. Qwen3-MoE (per-head q/k norms, no shared expert) is `hf_qwen3.py`'s; its experts are split
here as Qwen2-MoE's.

The configs are read and written by `hf_config.py` (`model_config_from_mixtral`, `model_config_from_qwen2_moe`,
`moe_config_dict`); the weights' names are `families/hf_moe.py`'s table. Here: `split_fused_experts` turns the
fused expert tensors of transformers 5's in-memory state dict (`experts.gate_up_proj` (E, 2F, H),
`experts.down_proj` (E, H, F); Mixtral's under `mlp.`) into the per-expert names that `save_pretrained`
writes and the table uses; `check_zero` refuses to leave out a tensor HF lacks that is not zero.
"""

from __future__ import annotations

import re

import torch

from meshlm.core.config import ConfigError

_FUSED = re.compile(r"(model\.layers\.\d+\.)(mlp|block_sparse_moe)\.(experts\.(gate_up_proj|down_proj)|gate\.weight)")


def split_fused_experts(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """`state` with transformers 5's fused expert tensors split into the per-expert names (module doc)."""
    out = {}
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for key, tensor in state.items():
        m = _FUSED.fullmatch(key)
        if m is None:
            out[key] = tensor
            continue
        prefix = f"{m.group(1)}{block}."
        if m.group(3) == "gate.weight":
            out[prefix + "gate.weight"] = tensor
        elif m.group(4) == "down_proj":
            out.update({f"{prefix}experts.{j}.{down}.weight": t for j, t in enumerate(tensor.unbind(0))})
        else:
            for j, t in enumerate(tensor.unbind(0)):
                g, u = t.chunk(2, dim=0)
                out.update({f"{prefix}experts.{j}.{gate}.weight": g, f"{prefix}experts.{j}.{up}.weight": u})
    return out


def check_zero(name: str, tensor: torch.Tensor, arch: str) -> None:
    """A meshlm tensor the HF model lacks (its table gives it no names) must be zero to be left out."""
    if bool(tensor.any()):
        raise ConfigError(f"{name} is not zero, and Hugging Face {arch} has no such tensor (its biases are on q/k/v "
                          "only); train with model.bias=false to export, or keep the model in meshlm")
