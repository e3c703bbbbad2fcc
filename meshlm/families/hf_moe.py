"""Hugging Face names of a mixture-of-experts GPT (`models/moe.py`): Mixtral, Qwen2-MoE and Qwen3-MoE.

A GPT with `model.moe_experts` converts to `Qwen3MoeForCausalLM` when it has per-head q/k norms
(`model.qk_norm`), else to `MixtralForCausalLM` when it has no shared expert, else to `Qwen2MoeForCausalLM`
(a sigmoid-gated shared expert); `interop/hf_moe.py` and `interop/hf_qwen3.py` check the other switches. All
keep Llama's attention and norm names (Qwen3-MoE adds `self_attn.q_norm`/`k_norm`, as Qwen3 does); a MoE
layer i's MLP is, in the per-expert layout that `save_pretrained` writes and hub checkpoints hold (transformers 5
fuses the experts in memory; `interop/hf_moe.py` reads both), Qwen3-MoE's as Qwen2-MoE's without the shared
expert:

    meshlm (layers.i.)      Mixtral (model.layers.i.block_sparse_moe.)   Qwen2-MoE (model.layers.i.mlp.)
    mlp.router.weight       gate.weight                                  gate.weight
    mlp.experts.fc          experts.j.[w1; w3].weight, j = 0..E-1        experts.j.[gate_proj; up_proj].weight
    mlp.experts.proj        experts.j.w2.weight                          experts.j.down_proj.weight
    mlp.shared.fc.weight    -                                            shared_expert.[gate_proj; up_proj].weight
    mlp.shared.proj.weight  -                                            shared_expert.down_proj.weight
    mlp.shared_gate.weight  -                                            shared_expert_gate.weight

`mlp.experts.fc` (E, 2F, H) is read as (E * 2F, H): expert j's rows are [gate_j; up_j], so the HF tensors
stack in the order gate_0, up_0, gate_1, up_1, ... (`Entry.rows`). A dense layer (Qwen2-MoE's
`mlp_only_layers` / `decoder_sparse_step`, meshlm's moe_first_dense / moe_every) keeps Llama's names. An
entry with no HF names (`theirs == ()`) is a meshlm tensor HF lacks, zero in the HF model: a bias of
`model.bias` outside q/k/v (Qwen2-MoE's qkv_bias).
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.families.common import Entry
from meshlm.families.hf_gpt_oss import is_gpt_oss


def moe_architecture(cfg: ModelConfig) -> str:
    """'gpt_oss' for a MoE GPT with gpt-oss's parts (`families/hf_gpt_oss.py`), 'qwen3_moe' with per-head q/k
    norms, else 'qwen2_moe' with a shared expert, else 'mixtral'."""
    if is_gpt_oss(cfg):
        return "gpt_oss"
    if cfg.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if cfg.moe_shared_experts else "mixtral"


def _expert_entries(cfg: ModelConfig, ours: str, theirs: str, names: tuple[str, str, str]) -> list[Entry]:
    gate, up, down = names
    E, F, H = cfg.moe_experts, cfg.expert_size, cfg.hidden_size
    return [Entry(f"{ours}mlp.router.weight", (f"{theirs}gate.weight",)),
            Entry(f"{ours}mlp.experts.fc", tuple(f"{theirs}experts.{j}.{w}.weight" for j in range(E) for w in (gate, up)),
                  rows=(F,) * (2 * E)),
            Entry(f"{ours}mlp.experts.proj", tuple(f"{theirs}experts.{j}.{down}.weight" for j in range(E)),
                  rows=(H,) * E)]


def _moe_layer(cfg: ModelConfig, i: int) -> list[Entry]:
    ours = f"layers.{i}."
    if moe_architecture(cfg) == "mixtral":
        return _expert_entries(cfg, ours, f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2"))
    theirs = f"model.layers.{i}.mlp."
    S = cfg.moe_shared_experts * cfg.expert_size
    table = _expert_entries(cfg, ours, theirs, ("gate_proj", "up_proj", "down_proj"))
    if not S:  # Qwen3-MoE: no shared expert
        return table
    table += [Entry(f"{ours}mlp.shared.fc.weight", (f"{theirs}shared_expert.gate_proj.weight",
                                                    f"{theirs}shared_expert.up_proj.weight"), rows=(S, S)),
              Entry(f"{ours}mlp.shared.proj.weight", (f"{theirs}shared_expert.down_proj.weight",))]
    if cfg.moe_shared_gate:
        table.append(Entry(f"{ours}mlp.shared_gate.weight", (f"{theirs}shared_expert_gate.weight",)))
    return table


def moe_table(cfg: ModelConfig, llama: list[Entry]) -> list[Entry]:
    """Llama's table `llama` with each MoE layer's MLP entries replaced by the experts' (module doc). With
    `model.bias` (Qwen2-MoE's qkv_bias: biases on q/k/v only), the biases HF lacks (o_proj's, the dense MLPs')
    get no HF names: zero on import, and required zero on export."""
    out: list[Entry] = []
    for entry in llama:
        parts = entry.ours.split(".")
        moe = parts[0] == "layers" and cfg.is_moe_layer(int(parts[1]))
        if moe and parts[2] == "mlp":
            if parts[3:] == ["fc", "weight"]:
                out += _moe_layer(cfg, int(parts[1]))
            continue  # the dense MLP's other tensors: none in a MoE layer
        if entry.ours.endswith(".bias") and ".attn.qkv." not in entry.ours:
            entry = Entry(entry.ours, ())
        out.append(entry)
    return out
