"""Hugging Face names of Gemma 3's text model (`Gemma3ForCausalLM`, model_type `gemma3_text`) on meshlm's GPT.

A GPT with Gemma's layer parts (`model.norm_unit_offset`, `sandwich_norm`, `embed_scale`, `activation='geglu'`,
`attn_scale_dim`, `rope_local_theta`) converts to Gemma 3 (`interop/hf_gemma3.py` checks the other switches).
Per layer i (`model.layers.i.`; the embedding, final norm and head as Llama's):

    meshlm (layers.i.)        Gemma 3 (model.layers.i.)
    norm1                     input_layernorm
    attn.qkv                  self_attn.[q_proj; k_proj; v_proj]
    attn.q_norm, attn.k_norm  self_attn.q_norm, self_attn.k_norm
    attn.proj                 self_attn.o_proj
    post_attn_norm            post_attention_layernorm        (on the attention's output, before the residual add)
    norm2                     pre_feedforward_layernorm
    mlp.fc                    mlp.[gate_proj; up_proj]
    mlp.proj                  mlp.down_proj
    post_mlp_norm             post_feedforward_layernorm

Every norm weight is stored as Gemma stores it, w of the (1 + w) scale: copied as is both ways. Note that
Gemma's `post_attention_layernorm` is Llama's name for the pre-MLP norm, which here is `pre_feedforward_layernorm`.
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.families.common import Entry

GEMMA_KEYS = ("norm_unit_offset", "sandwich_norm", "embed_scale", "attn_scale_dim", "rope_local_theta")


def gemma_parts(cfg: ModelConfig) -> list[str]:
    """`model.KEY=value` for each of Gemma's own switches `cfg` sets (GeGLU included)."""
    parts = [f"model.{k}={getattr(cfg, k)!r}" for k in GEMMA_KEYS if getattr(cfg, k)]
    return parts + (["model.activation='geglu'"] if cfg.activation == "geglu" else [])


def is_gemma3(cfg: ModelConfig) -> bool:
    """A GPT with any of Gemma's own layer parts."""
    return bool(gemma_parts(cfg))


def gemma3_table(cfg: ModelConfig) -> list[Entry]:
    """Gemma 3's name table (module doc)."""
    table = [Entry("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
        for a, b in (("norm1", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                     ("norm2", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"),
                     ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")):
            table.append(Entry(f"{ours}{a}.weight", (f"{theirs}{b}.weight",)))
        table += [Entry(f"{ours}attn.qkv.weight", tuple(f"{attn}{x}_proj.weight" for x in "qkv")),
                  Entry(f"{ours}attn.proj.weight", (f"{attn}o_proj.weight",)),
                  Entry(f"{ours}mlp.fc.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
                  Entry(f"{ours}mlp.proj.weight", (f"{mlp}down_proj.weight",))]
    return table + [Entry("norm.weight", ("model.norm.weight",)), Entry("lm_head.weight", ("lm_head.weight",))]
