"""The GPT family (GPT-2 and Llama-style decoders, `models/gpt.py`): how it is parallelised, checkpointed,
counted and fed, as one `ModelSpec`."""

from __future__ import annotations

from meshlm.core.config import Config, ModelConfig
from meshlm.core.flops import model_flops
from meshlm.core.memory import parameter_count
from meshlm.data import build_datasets
from meshlm.data.documents import document_positions
from meshlm.families.common import (
    Entry,
    activation_bytes,
    check_tp,
    embedding_and_head_costs,
    qkv_blocks,
    recompute_extra_flops,
)
from meshlm.families.hf_deepseek import deepseek_table
from meshlm.families.hf_gemma3 import gemma3_table, is_gemma3
from meshlm.families.hf_gpt_oss import gpt_oss_table, is_gpt_oss
from meshlm.families.hf_moe import moe_architecture, moe_table
from meshlm.families.spec import ModelSpec, PipelinePlan
from meshlm.families.styles import (
    ColumnParallel,
    HeadParallelAttention,
    HeadParallelLatentAttention,
    RowParallel,
    SequenceDropout,
    SequenceParallel,
    SequenceShardedPositions,
    VocabParallel,
)
from meshlm.models.gpt import GPT, init_rule
from meshlm.models.loss import cross_entropy
from meshlm.models.mla import lora_targets  # layers.lora_targets, with MLA's linears


def tp_plan(cfg: ModelConfig) -> dict:
    """Megatron's split: embedding and head over the vocabulary, attention by heads, the MLP's fc by columns
    (each of [W_gate; W_up] alike) and its proj by rows; norms, dropout and positions per token under SP."""
    ffn = cfg.ffn_size
    plan = {
        "tok_emb": VocabParallel(),
        "pos_emb": SequenceShardedPositions(),
        "drop": SequenceDropout(),
        "layers.*.norm[12]": SequenceParallel(),
        "layers.*.post_*_norm": SequenceParallel(),  # Gemma's sandwich norms (absent slots match nothing)
        "layers.*.attn": HeadParallelLatentAttention() if cfg.attention == "mla" else
        HeadParallelAttention(qkv="qkv", proj="proj", core="core"),
        "layers.*.attn.resid_dropout": SequenceDropout(),
        "layers.*.mlp.fc": ColumnParallel(blocks=(ffn, ffn) if cfg.gated else None),
        "layers.*.mlp.proj": RowParallel(),
        "layers.*.mlp.dropout": SequenceDropout(),
        "norm": SequenceParallel(),
        "lm_head": ColumnParallel(vocab_of="tok_emb"),
    }
    if cfg.mtp_depth:  # multi-token prediction (models/mtp.py): its blocks as the layers, its norms and the
        # replicated 2h → h merge per token (their gradients summed over tp under SP)
        plan.update({f"mtp.*.block.{k[len('layers.*.'):]}": v for k, v in plan.items() if k.startswith("layers.*.")})
        plan.update({"mtp.*.[eh]norm": SequenceParallel(), "mtp.*.merge": SequenceParallel(),
                     "mtp.*.norm": SequenceParallel()})
    return plan


def logical_blocks(name: str, cfg: ModelConfig) -> list[tuple[str, int]]:
    """Layout-free checkpoint tensors stacked along dim 0 of parameter `name`, with their row counts:
    `attn.qkv` → q, k, v; SwiGLU's (GeGLU's) `mlp.fc` → gate, up; others whole (embedding/head: the vocabulary)."""
    qkv = qkv_blocks(name, cfg)
    if qkv is not None:
        return qkv
    prefix, attr = name.rsplit(".", 1)
    if prefix.endswith("mlp.fc") and cfg.gated:
        base = prefix[:-len("fc")]
        return [(f"{base}gate.{attr}", cfg.ffn_size), (f"{base}up.{attr}", cfg.ffn_size)]
    return [(name, -1)]  # whole: the rows of the plain parameter


def hf_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture of this GPT: 'qwen3' with per-head q/k norms, 'llama' with RoPE, else
    'gpt2' (learned positions); `interop.hf_config.check_representable` checks the other switches. A MoE GPT:
    'mixtral', 'qwen2_moe', 'qwen3_moe' or 'gpt_oss' (`families/hf_moe.py`); latent attention: 'deepseek_v3'
    (`families/hf_deepseek.py`); Gemma's layer parts: 'gemma3_text' (`families/hf_gemma3.py`)."""
    if is_gemma3(cfg):  # before the others, whose checks would drop Gemma's parts (interop/hf_gemma3.py refuses)
        return "gemma3_text"
    if cfg.attention == "mla":
        return "deepseek_v3"
    if cfg.moe_experts:
        return moe_architecture(cfg)
    if cfg.qk_norm:
        return "qwen3"
    if cfg.sliding_window:  # Mistral: a window on every layer (`interop/hf_mistral.py` checks the rest)
        return "mistral"
    return "llama" if cfg.position == "rope" else "gpt2"


def gpt2_table(cfg: ModelConfig) -> list[Entry]:
    """GPT-2's names (`transformer.`; Conv1D weights transposed)."""
    table = [Entry("tok_emb.weight", ("transformer.wte.weight",)),
             Entry("pos_emb.weight", ("transformer.wpe.weight",))]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            table += [Entry(f"{ours}{a}.{p}", (f"{theirs}{b}.{p}",)) for p in ("weight", "bias")]
        for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                     ("mlp.proj", "mlp.c_proj")):
            table += [Entry(f"{ours}{a}.weight", (f"{theirs}{b}.weight",), True),
                      Entry(f"{ours}{a}.bias", (f"{theirs}{b}.bias",))]
    return table + [Entry("norm.weight", ("transformer.ln_f.weight",)),
                    Entry("norm.bias", ("transformer.ln_f.bias",)), Entry("lm_head.weight", ("lm_head.weight",))]


def llama_table(cfg: ModelConfig) -> list[Entry]:
    """Llama's names (`model.`; [q; k; v] and [gate; up] from separate tensors); Qwen3's per-head norms
    (`model.qk_norm`) as `self_attn.q_norm` and `self_attn.k_norm`."""
    table = [Entry("tok_emb.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        table += [Entry(f"{ours}norm1.weight", (f"{theirs}input_layernorm.weight",)),
                  Entry(f"{ours}norm2.weight", (f"{theirs}post_attention_layernorm.weight",))]
        if cfg.qk_norm:
            table += [Entry(f"{ours}attn.{x}_norm.weight", (f"{theirs}self_attn.{x}_norm.weight",)) for x in "qk"]
        for p in ("weight", "bias") if cfg.bias else ("weight",):
            attn, mlp = f"{theirs}self_attn.", f"{theirs}mlp."
            table += [Entry(f"{ours}attn.qkv.{p}", tuple(f"{attn}{x}_proj.{p}" for x in "qkv")),
                      Entry(f"{ours}attn.proj.{p}", (f"{attn}o_proj.{p}",)),
                      Entry(f"{ours}mlp.fc.{p}", (f"{mlp}gate_proj.{p}", f"{mlp}up_proj.{p}")),
                      Entry(f"{ours}mlp.proj.{p}", (f"{mlp}down_proj.{p}",))]
    return table + [Entry("norm.weight", ("model.norm.weight",)), Entry("lm_head.weight", ("lm_head.weight",))]


def hf_table(cfg: ModelConfig) -> list[Entry]:
    """The Hugging Face name table of this GPT's architecture (`hf_architecture`)."""
    if hf_architecture(cfg) == "gemma3_text":
        return gemma3_table(cfg)
    if cfg.attention == "mla":
        return deepseek_table(cfg)
    if cfg.moe_experts:
        return gpt_oss_table(cfg) if is_gpt_oss(cfg) else moe_table(cfg, llama_table(cfg))
    return gpt2_table(cfg) if hf_architecture(cfg) == "gpt2" else llama_table(cfg)


def _datasets(cfg: Config, progress: bool = False):
    return build_datasets(cfg, progress=progress)


def document_inputs(ids, eod_id: int) -> dict:
    """Packed documents: each token's position in its document and its document's id in the row, as the
    model's `positions=` and `segments=` (`data/documents.py`: the end-of-document token ends its document)."""
    positions, segments = document_positions(ids, eod_id)
    return {"positions": positions, "segments": segments}


GPT_SPEC = ModelSpec(
    name="gpt", model_class=GPT, tp_plan=tp_plan, check_tensor_parallel=check_tp,
    pipeline=PipelinePlan(first=("tok_emb", "pos_emb", "drop"), layers="layers", last=("norm", "lm_head", "mtp")),
    selective_recompute=("attn.core",), init_rule=init_rule, logical_blocks=logical_blocks, loss=cross_entropy,
    fused_loss=True, flops=model_flops, recompute_flops=recompute_extra_flops, stage_costs=embedding_and_head_costs,
    parameter_count=parameter_count, activation_bytes=activation_bytes, build_datasets=_datasets,
    lora_targets=lora_targets, virtual_tokens=True, peft_task_type=lambda cfg: "CAUSAL_LM",
    hf_architecture=hf_architecture, hf_table=hf_table, document_inputs=document_inputs)
