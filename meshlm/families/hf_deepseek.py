"""Hugging Face names of a GPT with multi-head latent attention: DeepSeek-V3 (`DeepseekV3ForCausalLM`).

Per layer i (`model.layers.i.`; norms, embeddings and the dense layers' MLP as Llama's):

    meshlm (layers.i.)          DeepSeek-V3 (model.layers.i.)
    attn.q.weight               self_attn.q_proj.weight             (q_lora_rank 0)
    attn.q_down.weight          self_attn.q_a_proj.weight
    attn.q_norm.weight          self_attn.q_a_layernorm.weight
    attn.q_up.weight            self_attn.q_b_proj.weight
    attn.kv_down.weight         self_attn.kv_a_proj_with_mqa.weight
    attn.kv_norm.weight         self_attn.kv_a_layernorm.weight
    attn.kv_up.weight           self_attn.kv_b_proj.weight
    attn.proj.weight            self_attn.o_proj.weight
    mlp.router.weight           mlp.gate.weight
    mlp.router.score_bias       mlp.gate.e_score_correction_bias
    mlp.experts.fc / .proj      mlp.experts.j.[gate_proj; up_proj] / down_proj (as Qwen2-MoE, `hf_moe.py`)
    mlp.shared.fc.weight        mlp.shared_experts.[gate_proj; up_proj].weight
    mlp.shared.proj.weight      mlp.shared_experts.down_proj.weight

Row layouts are the same on both sides (the rope dims stay interleaved; models/mla.py de-interleaves them at
run time as transformers does), so every tensor copies unchanged.
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.families.common import Entry
from meshlm.families.hf_moe import _expert_entries

_ATTENTION = (("q_down", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("q_up", "q_b_proj"),
              ("kv_down", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("kv_up", "kv_b_proj"),
              ("proj", "o_proj"))


def _mla_entries(cfg: ModelConfig, ours: str, theirs: str) -> list[Entry]:
    pairs = _ATTENTION if cfg.q_lora_rank else (("q", "q_proj"),) + _ATTENTION[3:]
    return [Entry(f"{ours}attn.{a}.weight", (f"{theirs}self_attn.{b}.weight",)) for a, b in pairs]


def _deepseek_moe(cfg: ModelConfig, ours: str, theirs: str) -> list[Entry]:
    mlp, S = f"{theirs}mlp.", cfg.moe_shared_experts * cfg.expert_size
    table = _expert_entries(cfg, ours, mlp, ("gate_proj", "up_proj", "down_proj"))
    table.append(Entry(f"{ours}mlp.router.score_bias", (f"{mlp}gate.e_score_correction_bias",)))
    if S:
        table += [Entry(f"{ours}mlp.shared.fc.weight", (f"{mlp}shared_experts.gate_proj.weight",
                                                        f"{mlp}shared_experts.up_proj.weight"), rows=(S, S)),
                  Entry(f"{ours}mlp.shared.proj.weight", (f"{mlp}shared_experts.down_proj.weight",))]
    return table


def _layer_entries(cfg: ModelConfig, ours: str, theirs: str, moe: bool) -> list[Entry]:
    table = [Entry(f"{ours}norm1.weight", (f"{theirs}input_layernorm.weight",)),
             Entry(f"{ours}norm2.weight", (f"{theirs}post_attention_layernorm.weight",))]
    table += _mla_entries(cfg, ours, theirs)
    if moe:
        return table + _deepseek_moe(cfg, ours, theirs)
    mlp = f"{theirs}mlp."
    return table + [Entry(f"{ours}mlp.fc.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")),
                    Entry(f"{ours}mlp.proj.weight", (f"{mlp}down_proj.weight",))]


def mtp_entries(cfg: ModelConfig) -> list[Entry]:
    """DeepSeek's multi-token prediction modules (models/mtp.py), as its checkpoints store module k (from 0) after
    the last layer, in `model.layers.{n_layers + k}.`: `enorm`, `hnorm`, `eh_proj` (our `merge`), a whole decoder
    layer (our `block`, of the last layer's kind), `shared_head.norm` (our module `norm`), and copies of the shared
    embedding and output head (`embed_tokens`, `shared_head.head`: written from ours, read back as ours; a tied
    head is not copied). transformers' DeepseekV3ForCausalLM ignores these tensors."""
    table = []
    for k in range(cfg.mtp_depth):
        ours, theirs = f"mtp.{k}.", f"model.layers.{cfg.n_layers + k}."
        table += [Entry(f"{ours}enorm.weight", (f"{theirs}enorm.weight",)),
                  Entry(f"{ours}hnorm.weight", (f"{theirs}hnorm.weight",)),
                  Entry(f"{ours}merge.weight", (f"{theirs}eh_proj.weight",)),
                  Entry(f"{ours}norm.weight", (f"{theirs}shared_head.norm.weight",)),
                  Entry("tok_emb.weight", (f"{theirs}embed_tokens.weight",))]
        if not cfg.tie_embeddings:
            table.append(Entry("lm_head.weight", (f"{theirs}shared_head.head.weight",)))
        table += _layer_entries(cfg, f"{ours}block.", theirs, cfg.is_moe_layer(cfg.n_layers - 1))
    return table


def deepseek_table(cfg: ModelConfig) -> list[Entry]:
    """DeepSeek-V3's name table (module doc; the MTP modules' names: `mtp_entries`)."""
    table = [Entry("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        table += _layer_entries(cfg, f"layers.{i}.", f"model.layers.{i}.", cfg.is_moe_layer(i))
    return table + [Entry("norm.weight", ("model.norm.weight",)), Entry("lm_head.weight", ("lm_head.weight",))] \
        + mtp_entries(cfg)
