"""Hugging Face interop for the BERT family: `transformers`' Bert* classes to and from meshlm's `BERT`.

One table of (meshlm key, HF keys) per config, as for GPT-2 and Llama (`hf.py`); fused `attn.qkv` is
[query; key; value] stacked along the output dim. The encoder's keys carry the `bert.` prefix in every class
but `BertModel`; the head's keys never do. Per layer i:

    meshlm                   Hugging Face
    tok_emb                  embeddings.word_embeddings
    pos_emb                  embeddings.position_embeddings
    type_emb                 embeddings.token_type_embeddings
    emb_norm                 embeddings.LayerNorm
    layers.i.attn.qkv        encoder.layer.i.attention.self.[query; key; value]
    layers.i.attn.proj       encoder.layer.i.attention.output.dense
    layers.i.norm1           encoder.layer.i.attention.output.LayerNorm
    layers.i.mlp.fc          encoder.layer.i.intermediate.dense
    layers.i.mlp.proj        encoder.layer.i.output.dense
    layers.i.norm2           encoder.layer.i.output.LayerNorm
    pooler                   pooler.dense                         (BertModel, pretraining, classification)
    mlm_dense, mlm_norm      cls.predictions.transform.dense, .LayerNorm        (masked LM, pretraining)
    lm_head.weight, .bias    cls.predictions.decoder.weight (the word embedding when tied), cls.predictions.bias
    sop_head                 cls.seq_relationship                 (pretraining: NSP there, sentence order here)
    task_head                classifier (sequence / token classification), qa_outputs (question answering)

Reading, older names are accepted (`LayerNorm.gamma`/`beta`), recomputed buffers (`position_ids`,
`token_type_ids`) are dropped, and so are the tensors of heads the declared class does not have (as
`from_pretrained` does; `log` says which). Anything else that does not fit the config is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.families.bert import bert_table, hf_prefix
from meshlm.families.common import split_sizes
from meshlm.interop.hf_config import hf_config_from_model_config, model_config_from_hf
from meshlm.models.bert import BERT, MLM_HEADS

_BUFFERS = re.compile(r"embeddings\.(position_ids|token_type_ids)")
_TOP_LEVEL = ("cls.", "classifier.", "qa_outputs.")  # head keys: never under the `bert.` prefix
_HEAD_PREFIXES = ("pooler.", *_TOP_LEVEL)  # the parts a class may leave out


def _canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF keys without the `bert.` prefix, buffers dropped, `gamma`/`beta` named `weight`/`bias`."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("bert.")
        if _BUFFERS.fullmatch(key):
            continue
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key))
        out[key] = value
    return out


def _decoder_bias(state: dict[str, torch.Tensor], tied: bool) -> None:
    """Leave one MLM decoder bias, as `cls.predictions.bias`: the one Hugging Face computes with. Tied
    (tie_word_embeddings), HF ties `decoder.bias` to `cls.predictions.bias` on load; untied (transformers
    >= 5), `decoder.bias` is its own parameter and the one the decoder adds."""
    decoder, head = state.pop("cls.predictions.decoder.bias", None), state.get("cls.predictions.bias")
    if decoder is not None and (head is None or not tied):
        state["cls.predictions.bias"] = decoder


def to_hf_bert(model: BERT) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers.BertConfig, state dict of the Bert* class of `model.cfg.bert_head`) equal to `model`.
    When tied, the decoder weight is the embedding tensor and the decoder bias the head's bias, as in HF's
    own state dicts (`save_hf` drops both: safetensors keeps no shared tensors, HF ties them on load);
    untied, both biases are written, equal."""
    return hf_config_from_model_config(model.cfg, "bert"), to_hf_bert_state(model)


def to_hf_bert_state(model: BERT) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    from meshlm.interop.hf_config import check_representable

    check_representable(cfg, "bert")
    ours, prefix, out = model.state_dict(), hf_prefix(cfg), {}
    for entry in bert_table(cfg):
        tensor = ours[entry.ours].detach()
        parts = tensor.split(split_sizes(cfg, 3)) if len(entry.theirs) == 3 else [tensor]
        for key, part in zip(entry.theirs, parts):
            full = key if key.startswith(_TOP_LEVEL) else prefix + key
            out[full] = part.contiguous().clone()
    if cfg.bert_head in MLM_HEADS:
        bias = out["cls.predictions.bias"]
        if cfg.tie_embeddings:
            out["cls.predictions.decoder.weight"] = out[f"{prefix}embeddings.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = bias if cfg.tie_embeddings else bias.clone()
    return out


def from_hf_bert(hf_config: Any, state_dict: dict[str, torch.Tensor],
                 log: Callable[[str], None] | None = None) -> BERT:
    """A meshlm `BERT` from a BertConfig (or its config.json dict; `architectures` picks the head) and the
    state dict of that class. The weights are copied into a freshly built fp32 model."""
    cfg = model_config_from_hf(hf_config, "bert")
    return bert_from_state(cfg, state_dict, log)


def bert_from_state(cfg: ModelConfig, state_dict: dict[str, torch.Tensor],
                    log: Callable[[str], None] | None = None) -> BERT:
    state = _canonical(state_dict)
    _decoder_bias(state, cfg.tie_embeddings)
    table = bert_table(cfg)
    embedding = state.get("embeddings.word_embeddings.weight")
    if cfg.bert_head in MLM_HEADS and cfg.tie_embeddings:
        decoder = state.pop("cls.predictions.decoder.weight", None)
        if decoder is not None and embedding is not None and not torch.equal(decoder, embedding):
            raise ConfigError("tie_word_embeddings=true but cls.predictions.decoder.weight differs from the word "
                              "embedding; set tie_word_embeddings=false in the config")
        if embedding is not None:
            state["cls.predictions.decoder.weight"] = embedding
    model = BERT(cfg)
    ours, used, missing = {}, set(), []
    for entry in table:
        absent = [k for k in entry.theirs if k not in state]
        if absent:
            missing += absent
            continue
        used.update(entry.theirs)
        ours[entry.ours] = torch.cat([state[k] for k in entry.theirs], dim=0)
    if cfg.bert_head == "encoder" and missing == ["pooler.dense.weight", "pooler.dense.bias"]:
        # a BertModel saved without its pooling layer: the encoder head keeps the pooler only for conversion
        missing = []
        ours.update({k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("pooler.")})
        if log is not None:
            log("note: the checkpoint has no pooler (pooler.dense); it is freshly initialised (unused by embed)")
    extra = sorted(set(state) - used)
    dropped = [k for k in extra if k.startswith(_HEAD_PREFIXES)]
    unexpected = [k for k in extra if k not in dropped]
    if missing or unexpected:
        raise ConfigError(f"Hugging Face BERT state dict does not match its config (bert_head={cfg.bert_head!r}): "
                          f"missing {missing[:6]}, unexpected {unexpected[:6]}; check num_hidden_layers, "
                          "architectures and tie_word_embeddings")
    if dropped and log is not None:
        log(f"note: dropped {len(dropped)} tensors that model.bert_head={cfg.bert_head!r} has no place for: "
            f"{', '.join(dropped[:4])}{', ...' if len(dropped) > 4 else ''}")
    if cfg.bert_head in MLM_HEADS and cfg.tie_embeddings:
        ours["lm_head.weight"] = ours["tok_emb.weight"]
    try:
        model.load_state_dict(ours, strict=True)  # copies into the fp32 model, checking every shape
    except RuntimeError as err:
        shapes = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        raise ConfigError(f"Hugging Face BERT weights do not fit their config: {'; '.join(shapes[:2]) or err}"
                          ) from None
    return model
