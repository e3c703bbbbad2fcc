"""Hugging Face interop: GPT-2, Llama, Mixtral and Qwen2-MoE checkpoints to and from meshlm's `GPT` (BERT:
`hf_bert.py`; the MoE layers' names: `families/hf_moe.py`, their configs: `hf_moe.py`; gpt-oss's names and
layouts: `families/hf_gpt_oss.py`, its config: `hf_gpt_oss.py`).

Both directions go through one table per architecture of (meshlm key, HF keys, Conv1D-transposed). A meshlm
tensor is the HF tensors concatenated along dim 0 (the output dim), transposed for GPT-2's Conv1D, which
stores weights as (in, out) where `nn.Linear` stores (out, in). Per layer i:

    meshlm                  HF GPT-2 (`transformer.`)         HF Llama (`model.`)
    tok_emb.weight          wte.weight                        embed_tokens.weight
    pos_emb.weight          wpe.weight                        - (RoPE)
    layers.i.norm1          h.i.ln_1                          layers.i.input_layernorm
    layers.i.attn.qkv       h.i.attn.c_attn ᵀ  ([q; k; v])    layers.i.self_attn.[q_proj; k_proj; v_proj]
    layers.i.attn.proj      h.i.attn.c_proj ᵀ                 layers.i.self_attn.o_proj
    layers.i.norm2          h.i.ln_2                          layers.i.post_attention_layernorm
    layers.i.mlp.fc         h.i.mlp.c_fc ᵀ                    layers.i.mlp.[gate_proj; up_proj]
    layers.i.mlp.proj       h.i.mlp.c_proj ᵀ                  layers.i.mlp.down_proj
    norm                    ln_f                              norm
    lm_head.weight          lm_head.weight (no prefix; equal to the embedding when tied)

HF's Llama q/k rows are already in the rotate-half RoPE layout (pairs i, i + hd/2) that meshlm uses, so they
are copied without the permutation Meta's original checkpoints need. `transformers` is imported only inside
the functions that return its config objects; converting dicts, `save_hf` and `load_hf` run without it.
`load_hf` and `save_hf` handle every family: GPT-2, Llama and BERT directories.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.families.common import entry_rows
from meshlm.families.registry import get_spec
from meshlm.interop.hf_config import (
    check_representable,
    hf_architecture,
    hf_config_from_model_config,
    model_config_from_hf,
)
from meshlm.interop.hf_deepseek import mtp_depth_in_files
from meshlm.interop.hf_moe import check_zero, split_fused_experts
from meshlm.models.gpt import GPT

# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED = re.compile(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)"
                      r"|model\.layers\.\d+\.self_attn\.rotary_emb\..*")


def _to_hf_state(model: GPT, arch: str) -> dict[str, torch.Tensor]:
    """HF state dict (fresh tensors); when tied, lm_head.weight is the embedding tensor, as in HF's own."""
    cfg = model.cfg
    check_representable(cfg, arch)
    ours = model.state_dict()
    table, out = get_spec(cfg.family).hf_table(cfg), {}
    for entry in table:
        if entry.ours == "lm_head.weight" and cfg.tie_embeddings:
            out["lm_head.weight"] = out[table[0].theirs[0]]
            continue
        tensor = ours[entry.ours].detach()
        if not entry.theirs:
            check_zero(entry.ours, tensor, arch)
            continue
        if entry.layout is not None:  # one HF tensor in its own layout (gpt-oss's experts)
            out[entry.theirs[0]] = entry.layout[0](tensor).contiguous().clone()
            continue
        rows = entry_rows(cfg, entry)
        flat = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 2 else tensor  # (E, r, c) → (E·r, c)
        parts = flat.split(rows) if rows is not None else [tensor]
        for key, part in zip(entry.theirs, parts):
            out[key] = (part.t() if entry.transposed else part).contiguous().clone()
    return out


def _normalise_keys(state: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """Drop recomputed buffers; add the `transformer.` prefix that GPT2Model-level checkpoints lack."""
    if arch == "gpt2" and "transformer.wte.weight" not in state and "wte.weight" in state:
        state = {(k if k == "lm_head.weight" else f"transformer.{k}"): v for k, v in state.items()}
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
        state = split_fused_experts(state, arch)
    return {k: v for k, v in state.items() if not _IGNORED.fullmatch(k)}


def _from_hf_state(cfg: ModelConfig, state: dict[str, torch.Tensor], arch: str) -> GPT:
    state = _normalise_keys(state, arch)
    if arch == "deepseek_v3":  # the multi-token prediction modules the files hold (transformers saves none)
        cfg = mtp_depth_in_files(cfg, state)
    table = get_spec(cfg.family).hf_table(cfg)
    ours, used, missing, zero = {}, set(), [], []
    for entry in table:
        if not entry.theirs:  # a meshlm tensor HF lacks (a bias outside q/k/v): zero
            zero.append(entry.ours)
            continue
        if entry.ours == "lm_head.weight" and cfg.tie_embeddings:
            head, embedding = state.get("lm_head.weight"), state.get(table[0].theirs[0])
            if head is not None and embedding is not None and not torch.equal(head, embedding):
                raise ConfigError("tie_word_embeddings=true but lm_head.weight differs from the token embedding; "
                                  "set tie_word_embeddings=false in the config")
            used.add("lm_head.weight")
            if "tok_emb.weight" in ours:
                ours["lm_head.weight"] = ours["tok_emb.weight"]
            continue
        absent = [k for k in entry.theirs if k not in state]
        if absent:
            missing += absent
            continue
        used.update(entry.theirs)
        tensor = torch.cat([state[k] for k in entry.theirs], dim=0)
        if entry.layout is not None:
            tensor = entry.layout[1](tensor)
        ours[entry.ours] = tensor.t() if entry.transposed else tensor
    unexpected = sorted(set(state) - used)
    if missing or unexpected:
        raise ConfigError(f"Hugging Face {arch} state dict does not match its config: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}; check n_layers, bias and tie_word_embeddings")
    model = GPT(cfg)
    for name, tensor in model.state_dict().items():  # experts stacked (E, r, c) from their (r, c) tensors
        if name in ours and tensor.dim() > 2 and ours[name].numel() == tensor.numel():
            ours[name] = ours[name].reshape(tensor.shape)
        if name in zero:
            ours[name] = torch.zeros_like(tensor)
    model.load_state_dict(ours, strict=True)  # copies into the fp32 model, checking every shape
    return model


def to_hf_gpt2(model: GPT) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers.GPT2Config, GPT2LMHeadModel state dict) equal to `model`."""
    return hf_config_from_model_config(model.cfg, "gpt2"), _to_hf_state(model, "gpt2")


def from_hf_gpt2(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> GPT:
    """A meshlm GPT from a GPT2Config (or its dict) and a GPT2LMHeadModel/GPT2Model state dict."""
    return _from_hf_state(model_config_from_hf(hf_config, "gpt2"), state_dict, "gpt2")


def to_hf_llama(model: GPT) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers.LlamaConfig, LlamaForCausalLM state dict) equal to `model`."""
    return hf_config_from_model_config(model.cfg, "llama"), _to_hf_state(model, "llama")


def from_hf_llama(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> GPT:
    """A meshlm GPT from a LlamaConfig (or its dict) and a LlamaForCausalLM state dict."""
    return _from_hf_state(model_config_from_hf(hf_config, "llama"), state_dict, "llama")


def from_hf_moe(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> GPT:
    """A meshlm MoE GPT from a MixtralConfig or Qwen2MoeConfig (or its dict) and the state dict of the model:
    per-expert tensors as saved, or transformers 5's fused ones (`hf_moe.split_fused_experts`)."""
    cfg = model_config_from_hf(hf_config)
    if not cfg.moe_experts:
        raise ConfigError("from_hf_moe converts Mixtral and Qwen2-MoE models; use from_hf_llama or from_hf_gpt2")
    return _from_hf_state(cfg, state_dict, hf_architecture(cfg))


# ---------------------------------------------------------------------------------------------- files

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def save_hf(model: nn.Module, directory: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write config.json + the safetensors weights that `transformers` loads with `from_pretrained`: a GPT as
    GPT2LMHeadModel or LlamaForCausalLM, a BERT as the Bert* class of its head, in the model's dtype
    (`hf_stream.write_hf_model`: one file, or shards above `max_shard_bytes`). Tied tensors are written
    once (safetensors keeps no shared tensors; HF re-ties them on load)."""
    from meshlm.interop.hf_stream import MAX_SHARD_BYTES, write_hf_model

    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    write_hf_model(state.__getitem__, model.cfg, shapes, directory, next(model.parameters()).dtype,
                   max_shard_bytes or MAX_SHARD_BYTES)
    return Path(directory)


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of an HF directory: model.safetensors, shards listed by model.safetensors.index.json,
    or (read with `torch.load(weights_only=True)`, which runs no pickled code) pytorch_model.bin or its
    shards."""
    directory = Path(directory)
    for index, binary in (("model.safetensors.index.json", False), ("pytorch_model.bin.index.json", True)):
        if (directory / index).exists():
            try:
                files = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as err:
                raise ConfigError(f"{directory / index} is not a shard index ({err}); re-save the model") from None
            break
    else:
        found = [name for name in ("model.safetensors", "pytorch_model.bin") if (directory / name).exists()]
        if not found:
            raise ConfigError(f"{directory} holds none of {', '.join(WEIGHT_FILES)}; save the model there with "
                              "save_pretrained")
        files, binary = found[:1], found[0].endswith(".bin")
    state = {}
    for name in files:
        path = directory / name
        try:
            part = torch.load(path, map_location="cpu", weights_only=True) if binary else load_file(str(path))
        except Exception as err:  # noqa: BLE001 (safetensors and torch raise many kinds)
            raise ConfigError(f"{path} cannot be read as {'PyTorch' if binary else 'safetensors'} weights "
                              f"({type(err).__name__}: {err}); the file is missing or corrupt") from None
        state.update(part)
    return state


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise ConfigError(f"{str(directory)!r} is not a directory; give a Hugging Face model directory "
                          "(config.json and model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing; a Hugging Face model directory holds config.json") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} cannot be read as JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def load_hf(directory: str | Path, log: Callable[[str], None] | None = None) -> nn.Module:
    """A meshlm model from an HF GPT-2, Llama or BERT directory (config.json + model.safetensors, its
    shards, or pytorch_model.bin). Like `from_hf_*`, the weights are copied into a freshly built fp32
    model; cast it afterwards for bf16. `log` gets notes on what was left out (BERT: another head's
    tensors)."""
    directory = Path(directory)
    config = read_hf_config(directory)
    cfg = model_config_from_hf(config)
    state = read_hf_weights(directory)
    arch = hf_architecture(cfg)
    if arch == "bert":
        from meshlm.interop.hf_bert import bert_from_state

        return bert_from_state(cfg, state, log)
    return _from_hf_state(cfg, state, arch)
