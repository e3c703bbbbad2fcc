"""The BERT family (the encoder of `models/bert.py` and its heads): how it is parallelised, checkpointed,
counted and fed, as one `ModelSpec`."""

from __future__ import annotations

from meshlm.core.config import ModelConfig
from meshlm.core.flops import model_flops
from meshlm.data.bert_build import build_bert_datasets
from meshlm.families.common import (
    Entry,
    activation_bytes,
    check_tp,
    embedding_and_head_costs,
    qkv_blocks,
    recompute_extra_flops,
)
from meshlm.families.spec import ModelSpec, PipelinePlan
from meshlm.families.styles import (
    ColumnParallel,
    HeadParallelAttention,
    RowParallel,
    SequenceDropout,
    SequenceGathered,
    SequenceParallel,
    SequenceShardedPositions,
    VocabParallel,
)
from meshlm.models.bert import (
    BERT,
    MASKED_FRACTION,
    MLM_HEADS,
    POOLED_HEADS,
    eval_metrics,
    example_batch,
    init_rule,
    loss_for,
)
from meshlm.models.layers import lora_targets


def tp_plan(cfg: ModelConfig) -> dict:
    """GPT's split for the layers and the word embedding; positions and token types per token under SP;
    the heads on the gathered sequence (`pool_gather`): the MLM transform, pooler and task heads
    replicated, the MLM decoder over the vocabulary (its input already whole: no sequence gather)."""
    return {
        "tok_emb": VocabParallel(),
        "pos_emb": SequenceShardedPositions(),
        "type_emb": SequenceShardedPositions(),
        "emb_norm": SequenceParallel(),
        "drop": SequenceDropout(),
        "layers.*.norm[12]": SequenceParallel(),
        "layers.*.attn": HeadParallelAttention(qkv="qkv", proj="proj", core="core"),
        "layers.*.attn.resid_dropout": SequenceDropout(),
        "layers.*.mlp.fc": ColumnParallel(),
        "layers.*.mlp.proj": RowParallel(),
        "layers.*.mlp.dropout": SequenceDropout(),
        "pool_gather": SequenceGathered(),
        "lm_head": ColumnParallel(vocab_of="tok_emb", gather_sequence=False),
    }


def logical_blocks(name: str, cfg: ModelConfig) -> list[tuple[str, int]]:
    """Checkpoint tensors: `attn.qkv` → q, k, v (as GPT); the rest whole."""
    return qkv_blocks(name, cfg) or [(name, -1)]


def parameter_count(cfg: ModelConfig) -> int:
    """Exact, from the config (each tied tensor once)."""
    h, V, L, f, head = cfg.hidden_size, cfg.vocab_size, cfg.n_layers, cfg.ffn_size, cfg.bert_head
    norm = 2 * h  # LayerNorm weight and bias
    layer = (3 * h * h + 3 * h) + (h * h + h) + norm + (h * f + f) + (f * h + h) + norm
    n = V * h + cfg.seq_len * h + cfg.type_vocab_size * h + norm + L * layer
    if head in POOLED_HEADS:
        n += h * h + h
    if head in MLM_HEADS:
        n += h * h + h + norm + V + (0 if cfg.tie_embeddings else V * h)
    if head == "pretrain":
        n += 2 * h + 2
    if head in ("classify", "tokens"):
        n += cfg.num_labels * (h + 1)
    if head == "span":
        n += 2 * (h + 1)
    return n


def _flops(cfg: ModelConfig, batch: int, seq_len: int | None = None) -> float:
    """Model FLOPs of a training step (forward + backward = 3× forward): GPT's count of the layers, plus
    the half of the s × s scores a causal count leaves out (an encoder attends both ways: QKᵀ and ·V are
    2·2·b·s²·h forward), plus the MLM head (transform h × h and decoder h × V) on the predicted tokens
    (`MASKED_FRACTION` of them: the head runs on those alone), where GPT counts its output layer on every
    token."""
    s = seq_len or cfg.seq_len
    h, d, V = cfg.head_dim * cfg.n_heads, cfg.hidden_size, cfg.vocab_size
    gpt_output_layer = 6.0 * batch * s * d * V
    bidirectional = 6.0 * batch * s * s * cfg.n_layers * h
    mlm = 6.0 * batch * s * MASKED_FRACTION * (d * d + d * V) if cfg.bert_head in MLM_HEADS else 0.0
    return model_flops(cfg, batch, seq_len) - gpt_output_layer + bidirectional + mlm


def special_tokens(cfg: ModelConfig) -> list[str]:
    """The special tokens BERT's inputs use: [CLS], [SEP] and [PAD], and [MASK] under an MLM head."""
    return ["cls", "sep", "pad"] + (["mask"] if cfg.bert_head in MLM_HEADS else [])


def peft_task_type(cfg: ModelConfig) -> str:
    """PEFT's task_type of a LoRA adapter on this head."""
    return {"classify": "SEQ_CLS", "tokens": "TOKEN_CLS", "span": "QUESTION_ANS"}.get(cfg.bert_head,
                                                                                       "FEATURE_EXTRACTION")


def _pairs(ours: str, theirs: str) -> list[Entry]:
    return [Entry(f"{ours}.{p}", (f"{theirs}.{p}",)) for p in ("weight", "bias")]


def bert_table(cfg: ModelConfig) -> list[Entry]:
    """(meshlm key, HF keys without the `bert.` prefix) for every tensor of a `BERT` with this config."""
    table = [Entry("tok_emb.weight", ("embeddings.word_embeddings.weight",)),
             Entry("pos_emb.weight", ("embeddings.position_embeddings.weight",)),
             Entry("type_emb.weight", ("embeddings.token_type_embeddings.weight",)),
             *_pairs("emb_norm", "embeddings.LayerNorm")]
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"encoder.layer.{i}."
        table += [Entry(f"{ours}attn.qkv.{p}", tuple(f"{theirs}attention.self.{x}.{p}" for x in ("query", "key", "value")))
                  for p in ("weight", "bias")]
        table += (_pairs(f"{ours}attn.proj", f"{theirs}attention.output.dense")
                  + _pairs(f"{ours}norm1", f"{theirs}attention.output.LayerNorm")
                  + _pairs(f"{ours}mlp.fc", f"{theirs}intermediate.dense")
                  + _pairs(f"{ours}mlp.proj", f"{theirs}output.dense")
                  + _pairs(f"{ours}norm2", f"{theirs}output.LayerNorm"))
    head = cfg.bert_head
    if head in POOLED_HEADS:
        table += _pairs("pooler", "pooler.dense")
    if head in MLM_HEADS:
        table += (_pairs("mlm_dense", "cls.predictions.transform.dense")
                  + _pairs("mlm_norm", "cls.predictions.transform.LayerNorm")
                  + [Entry("lm_head.weight", ("cls.predictions.decoder.weight",)),
                     Entry("lm_head.bias", ("cls.predictions.bias",))])
    if head == "pretrain":
        table += _pairs("sop_head", "cls.seq_relationship")
    if head in ("classify", "tokens"):
        table += _pairs("task_head", "classifier")
    if head == "span":
        table += _pairs("task_head", "qa_outputs")
    return table


def hf_prefix(cfg: ModelConfig) -> str:
    """The prefix of the encoder's keys: none in `BertModel`, `bert.` in the classes with a head."""
    return "" if cfg.bert_head == "encoder" else "bert."


def _datasets(cfg, progress: bool = False):
    return build_bert_datasets(cfg, progress=progress)


BERT_SPEC = ModelSpec(
    name="bert", model_class=BERT, tp_plan=tp_plan, check_tensor_parallel=check_tp,
    pipeline=PipelinePlan(first=("tok_emb", "pos_emb", "type_emb", "emb_norm", "drop"), layers="layers",
                          last=("pool_gather", "pooler", "mlm_dense", "mlm_norm", "lm_head", "sop_head",
                                "head_drop", "task_head")),
    selective_recompute=("attn.core",), init_rule=init_rule, logical_blocks=logical_blocks,
    loss=None, fused_loss=False, flops=_flops, recompute_flops=recompute_extra_flops, stage_costs=embedding_and_head_costs,
    parameter_count=parameter_count, activation_bytes=activation_bytes, build_datasets=_datasets,
    loss_for=loss_for, stage_inputs=True, eval_metrics=eval_metrics, example_batch=example_batch, decoder=False,
    lora_targets=lora_targets, task_heads=True, sentence_embeddings=True, default_tokenizer="bert",
    special_tokens=special_tokens, peft_task_type=peft_task_type, hf_architecture=lambda cfg: "bert",
    hf_table=bert_table, hf_prefix=hf_prefix)
