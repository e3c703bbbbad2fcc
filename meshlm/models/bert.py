"""BERT: the post-LN bidirectional encoder of Devlin et al. 2019, with Megatron's pretraining heads.

Reads like `models/gpt.py`. Input is one int64 tensor `inputs` (B, 3, T): token ids, token types (segment
A = 0, B = 1) and the attention mask (1 = a real token, 0 = padding), stacked on dim 1 (`pack_inputs`
makes it from separate tensors; plain (B, T) ids mean one segment, no padding). Keeping the batch one
tensor lets the trainer, data parallelism and the pipeline schedule split it along dim 0 as they split
GPT's ids.

    x = Dropout(LayerNorm(tok_emb[ids] + pos_emb[0..T) + type_emb[types]))
    each layer:  x = LN1(x + Attention(x, padding mask));  x = LN2(x + MLP(x))      (post-LN, exact GeLU)

Heads (`model.bert_head`), on the last stage:

* `pretrain`: the MLM head, transform (dense + GeLU + LayerNorm) then a decoder tied to the word embeddings
  plus its own bias, over every position, and the sentence-order head (Megatron's `bert_binary_head`: a
  2-way linear on the pooler, tanh(W·x[CLS] + b)). Output (mlm logits (B, T, V), sop logits (B, 2)).
  Targets (B, T + 1): the MLM labels (−100 where nothing is predicted) then the SOP label. Loss = the mean
  MLM cross-entropy over predicted tokens + the SOP cross-entropy, as in Megatron.
* `mlm`: the MLM head alone (Hugging Face's `BertForMaskedLM`); targets (B, T) or (B, T + 1).
* `classify`: a linear on the pooler (`num_labels` classes; 1: regression with MSE); targets (B, 1).
* `span`: start/end logits per token (SQuAD), output (B, T, 2); targets (B, 2) = start, end positions
  (or (B, 2K) with K gold answers: the first pair trains, the best one scores).
* `tokens`: a linear per token (`num_labels`); targets (B, T), −100 ignored.
* `encoder`: the last hidden states (B, T, h) (sentence embeddings; no loss).

Under tensor parallelism the MLM decoder is vocab-parallel (its logits split, the loss and accuracy
vocab-parallel); the pooler and task heads are small and replicated on every tp rank, fed by the whole
sequence (`pool_gather` gathers it under sequence parallelism). Under pipeline parallelism every stage
gets the batch's `inputs` (their padding mask) beside the stream (`ModelSpec.stage_inputs`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.core.errors import ConfigError
from meshlm.models.init import InitRule, draw_base_seed, init_parameters
from meshlm.models.layers import MLP, Attention, make_norm
from meshlm.models.loss import IGNORE_INDEX, PartsLoss, TokenOps, accumulation_dtype

PREDICTED = 2  # attention-mask value of a real token the MLM head predicts (1: real, 0: padding)
MASKED_FRACTION = 0.15  # tokens predicted by MLM pretraining (Megatron's default; the FLOPs count)
POOLED_HEADS = ("pretrain", "classify", "encoder")  # heads with the pooler (encoder: kept for conversion)
MLM_HEADS = ("pretrain", "mlm")


def pack_inputs(ids: torch.Tensor, token_types: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) ids [, types, mask] → the (B, 3, T) int64 input of `BERT`."""
    types = torch.zeros_like(ids) if token_types is None else token_types.to(ids.dtype)
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.dtype)
    return torch.stack([ids, types, mask], dim=1).long()


def as_inputs(inputs: torch.Tensor) -> torch.Tensor:
    return pack_inputs(inputs) if inputs.dim() == 2 else inputs


class BertLayer(nn.Module):
    """Post-LN encoder layer: x = LN1(x + attn(x)), then x = LN2(x + mlp(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.norm1 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.norm2 = make_norm(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, mask=mask))
        return self.norm2(x + self.mlp(x))


class BERT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.moe_experts:
            raise ConfigError(f"model.moe_experts={cfg.moe_experts}: mixture of experts is for the GPT family only "
                              "(model.family='gpt'); set model.moe_experts=0 for BERT")
        if cfg.sliding_window or cfg.attention_sinks:  # a decoder's attention; BERT attends both ways
            raise ConfigError(f"model.sliding_window={cfg.sliding_window}, model.attention_sinks={cfg.attention_sinks}"
                              ": for the GPT family only; set model.sliding_window=0, model.attention_sinks=false")
        if cfg.attention != "mha":  # DeepSeek's latent attention is a decoder's; BERT's layers have their own
            raise ConfigError(f"model.attention={cfg.attention!r} is a decoder's (DeepSeek) attention, but "
                              "model.family='bert'; set model.attention='mha'")
        gemma = {k: getattr(cfg, k) for k in ("norm_unit_offset", "sandwich_norm", "embed_scale", "rope_local_theta")
                 if getattr(cfg, k)}
        if gemma or cfg.activation == "geglu":  # Gemma's decoder parts: BERT's layers are post-norm, GeLU
            named = ", ".join(f"model.{k}={v}" for k, v in gemma.items()) or f"model.activation={cfg.activation!r}"
            raise ConfigError(f"{named}: Gemma's layer parts are for the GPT family only; leave them unset for BERT")
        if cfg.mtp_depth:  # multi-token prediction is a decoder's (DeepSeek-V3's) objective
            raise ConfigError(f"model.mtp_depth={cfg.mtp_depth} is for decoders (model.family='gpt'), not "
                              "model.family='bert'; set model.mtp_depth=0")
        self.cfg = cfg
        self.init_seed = draw_base_seed()  # the one draw from the global generator (also on the meta device)
        h, head = cfg.hidden_size, cfg.bert_head
        with torch.random.fork_rng(devices=[]):  # the modules' own default init must not move the generator
            self.tok_emb = nn.Embedding(cfg.vocab_size, h)
            self.pos_emb = nn.Embedding(cfg.seq_len, h)
            self.type_emb = nn.Embedding(cfg.type_vocab_size, h)
            self.emb_norm = make_norm(cfg)
            self.drop = nn.Dropout(cfg.dropout)
            self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layers))
            self.pool_gather = nn.Identity()  # SP: gathers the sequence for the replicated heads
            self.pooler = nn.Linear(h, h) if head in POOLED_HEADS else None
            mlm = head in MLM_HEADS
            self.mlm_dense = nn.Linear(h, h) if mlm else None
            self.mlm_norm = make_norm(cfg) if mlm else None
            self.lm_head = nn.Linear(h, cfg.vocab_size) if mlm else None
            self.sop_head = nn.Linear(h, 2) if head == "pretrain" else None
            self.head_drop = nn.Dropout(cfg.dropout) if head in ("classify", "tokens") else None
            n_out = {"classify": cfg.num_labels, "tokens": cfg.num_labels, "span": 2}.get(head)
            self.task_head = nn.Linear(h, n_out) if n_out else None
        if mlm and cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.init_buffers()
        if not self.tok_emb.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Every parameter from `init_seed` by `init_rule` (the same values any shard of it would get)."""
        init_parameters(self, init_rule)

    def init_buffers(self, device: torch.device | None = None) -> None:
        """BERT has no buffers."""

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs = as_inputs(inputs)
        ids, types = inputs[:, 0], inputs[:, 1]
        T = ids.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds model.seq_len={self.cfg.seq_len}")
        x = self.tok_emb(ids)  # (B, T, h), or (B, T/t, h) under sequence parallelism
        x = x + self.pos_emb(torch.arange(T, device=ids.device)) + self.type_emb(types)
        return self.drop(self.emb_norm(x))

    def run_layers(self, x: torch.Tensor, layer_ids=None, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The stream through layers `layer_ids` (default: all), keys masked by `inputs`' padding mask."""
        mask = None if inputs is None else padding_mask(as_inputs(inputs))
        for i in range(len(self.layers)) if layer_ids is None else layer_ids:
            x = self.layers[i](x, mask)
        return x

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """tanh(W x[CLS] + b) from the (gathered) last hidden states."""
        return torch.tanh(self.pooler(x[:, 0]))

    def head(self, x: torch.Tensor, inputs: torch.Tensor | None = None):
        """The head's output from the last hidden states. With `inputs` whose attention mask flags the
        predicted tokens (value 2, as the pretraining data does), the MLM head runs on those tokens only:
        its logits are (N, V) for the N flagged tokens in order, instead of (B, T, V) (a sixth of the
        output layer's work at the 15% masking rate)."""
        kind = self.cfg.bert_head
        whole = self.pool_gather(x)  # (B, T, h) on every tp rank (gathered under sequence parallelism)
        if kind == "encoder":
            return whole
        mlm = None
        if self.lm_head is not None:
            picked = None if inputs is None else as_inputs(inputs)[:, 2] == PREDICTED
            h = whole[picked] if picked is not None and bool(picked.any()) else whole
            mlm = self.lm_head(self.mlm_norm(F.gelu(self.mlm_dense(h))))
        if kind == "mlm":
            return mlm
        if kind == "pretrain":
            return mlm, self.sop_head(self.pooled(whole))
        if kind == "classify":
            return self.task_head(self.head_drop(self.pooled(whole)))
        if kind == "tokens":
            return self.task_head(self.head_drop(whole))
        return self.task_head(whole)  # span: (B, T, 2)

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        """The last hidden states (B, T, h) (what Hugging Face's `BertModel` returns first)."""
        inputs = as_inputs(inputs)
        return self.run_layers(self.embed(inputs), None, inputs)

    def forward(self, inputs: torch.Tensor):
        """inputs (B, 3, T) (or (B, T) ids) → the head's output (see the module docstring)."""
        inputs = as_inputs(inputs)
        return self.head(self.run_layers(self.embed(inputs), None, inputs), inputs)


def padding_mask(inputs: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, T) bool, True where a key is a real token: broadcast over heads and queries in SDPA."""
    return (inputs[:, 2] != 0)[:, None, None, :]


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The mean of the real tokens' hidden states (sentence-transformers' mean pooling)."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


# ---- losses -------------------------------------------------------------------------------------------------
class PretrainLoss(PartsLoss):
    """MLM cross-entropy (over predicted tokens) + sentence-order cross-entropy; records both and the
    accuracies (trainer metrics `mlm_loss`, `sop_loss`, `mlm_acc`, `sop_acc`)."""

    part_names = ("mlm_loss", "sop_loss", "mlm_acc", "sop_acc")

    def __init__(self, ops: TokenOps, sop: bool):
        super().__init__()
        self.ops, self.sop = ops, sop
        if not sop:
            self.part_names = ("mlm_loss", "mlm_acc")

    def __call__(self, output, targets: torch.Tensor) -> torch.Tensor:
        mlm_logits, sop_logits = output if self.sop else (output, None)
        if mlm_logits.dim() == 2:  # the head ran on the predicted tokens only (`BERT.head`): the data's
            T = targets.shape[1] - 1  # (B, T + 1) targets, whose labels flag exactly those tokens
            labels = targets[:, :T]
            labels = labels[labels != IGNORE_INDEX]
        else:
            T = mlm_logits.shape[1]
            labels = targets[:, :T]
        mlm = self.ops.ce(mlm_logits, labels)
        keep = labels != IGNORE_INDEX
        mlm_acc = (self.ops.correct(mlm_logits, labels) & keep).sum() / keep.sum().clamp_min(1)
        if not self.sop:
            self.record(mlm, mlm_acc)
            return mlm
        order = targets[:, T]
        sop = F.cross_entropy(sop_logits.float() if sop_logits.dtype != torch.float64 else sop_logits, order)
        sop_acc = (sop_logits.detach().argmax(-1) == order).float().mean()
        self.record(mlm, sop, mlm_acc, sop_acc)
        return mlm + sop


# ---- fine-tuning losses and their evaluation metrics ------------------------------------------------------
# Each loss records, per micro-batch and on the device, the counts its metrics are made of (examples,
# correct predictions, per-class true/false positives and false negatives, summed exact-match and F1
# scores). The trainer averages the parts over micro-batches and the layout; a ratio of two such means is
# the ratio of the sums, so `eval_metrics` turns them into the metrics of the whole validation set. Rows
# whose label is IGNORE_INDEX (-100; NaN for regression) add nothing: `meshlm finetune` pads the validation
# set with them to whole micro-batches. An all-ignored micro-batch has loss 0, not NaN.

def class_counts(pred: torch.Tensor, gold: torch.Tensor, num_labels: int) -> tuple[torch.Tensor, ...]:
    """(examples, correct, tp (C,), fp (C,), fn (C,)) over the entries of `gold` that are not ignored."""
    keep = gold != IGNORE_INDEX
    p = F.one_hot(pred.clamp(0, num_labels - 1), num_labels).float() * keep.unsqueeze(-1)  # exact to 2^24
    g = F.one_hot(gold.clamp(0, num_labels - 1), num_labels).float() * keep.unsqueeze(-1)
    p, g = p.reshape(-1, num_labels), g.reshape(-1, num_labels)
    tp = (p * g).sum(0)
    return keep.sum(), ((pred == gold) & keep).sum(), tp, p.sum(0) - tp, g.sum(0) - tp


def class_part_names(count: str, num_labels: int) -> tuple[str, ...]:
    return (count, "correct", *(f"{kind}{c}" for kind in ("tp", "fp", "fn") for c in range(num_labels)))


def macro_f1(tp, fp, fn) -> float:
    """The mean over classes of 2·TP / (2·TP + FP + FN), over the classes that occur among the gold labels
    or the predictions (as scikit-learn's f1_score(average="macro")); 0 when none does."""
    scores = [2 * t / (2 * t + p + n) for t, p, n in zip(tp, fp, fn) if 2 * t + p + n > 0]
    return sum(scores) / len(scores) if scores else 0.0


def _sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.to(accumulation_dtype(logits)), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def classify_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, C) logits against the labels `targets[:, 0]` (−100 ignored); with one
    output, regression: the mean squared error against float labels (NaN ignored)."""
    labels = targets.reshape(targets.shape[0], -1)[:, 0]
    if output.shape[-1] == 1:
        pred = output.reshape(-1).to(accumulation_dtype(output))
        gold = labels.to(pred.dtype)
        keep = ~torch.isnan(gold)
        return torch.where(keep, pred - gold, 0.0).square().sum() / keep.sum().clamp_min(1)
    return _sum_ce(output, labels) / (labels != IGNORE_INDEX).sum().clamp_min(1)


def span_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean of the start and end cross-entropies of (B, T, 2) logits against `targets[:, 0]` (start)
    and `targets[:, 1]` (end); further columns (other gold answers) are for the metrics only."""
    start, end = output.unbind(-1)  # (B, T) each
    n = (targets[:, 0] != IGNORE_INDEX).sum().clamp_min(1)
    return (_sum_ce(start, targets[:, 0]) + _sum_ce(end, targets[:, 1])) / (2 * n)


def tokens_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens whose label (B, T) is not −100."""
    labels = targets.reshape(-1)
    return _sum_ce(output.reshape(-1, output.shape[-1]), labels) / (labels != IGNORE_INDEX).sum().clamp_min(1)


def best_spans(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (start, end) pair with end ≥ start of highest start + end logit, per row of (B, T) logits."""
    T = start.shape[-1]
    scores = start.unsqueeze(-1) + end.unsqueeze(-2)  # (B, T start, T end)
    valid = torch.ones(T, T, dtype=torch.bool, device=start.device).triu()
    best = scores.masked_fill(~valid, float("-inf")).reshape(start.shape[0], -1).argmax(-1)
    return best // T, best % T


def span_scores(pred_start, pred_end, gold_start, gold_end) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match and SQuAD's token-overlap F1 of predicted spans (B,) against gold spans (B, K) (inclusive
    token positions; −100: no such answer), the best over the K gold answers as in SQuAD's evaluation.
    F1 = 2·P·R / (P + R) with P = overlap / predicted length, R = overlap / gold length."""
    ps, pe = pred_start.unsqueeze(-1), pred_end.unsqueeze(-1)
    present = gold_start != IGNORE_INDEX
    exact = ((ps == gold_start) & (pe == gold_end) & present).any(-1)
    overlap = (torch.minimum(pe, gold_end) - torch.maximum(ps, gold_start) + 1).clamp_min(0).float()
    precision = overlap / (pe - ps + 1).float()
    recall = overlap / (gold_end - gold_start + 1).clamp_min(1).float()
    f1 = torch.where(overlap > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-12), 0.0)
    return exact, torch.where(present, f1, 0.0).amax(-1)


class ClassifyLoss(PartsLoss):
    """`classify_loss`, recording the counts for accuracy and macro F1 (examples, correct, and per class
    tp/fp/fn), or for regression the sums for the MSE and Pearson's r."""

    REGRESSION = ("examples", "sq_error", "sum_pred", "sum_gold", "sum_pred2", "sum_gold2", "sum_pred_gold")

    def __init__(self, num_labels: int):
        super().__init__()
        self.num_labels = num_labels
        self.part_names = self.REGRESSION if num_labels == 1 else class_part_names("examples", num_labels)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = classify_loss(output, targets)
        labels = targets.reshape(targets.shape[0], -1)[:, 0]
        if self.num_labels == 1:
            pred = output.detach().reshape(-1).to(accumulation_dtype(output))
            gold = labels.to(pred.dtype)
            keep = ~torch.isnan(gold)
            x, y = torch.where(keep, pred, 0.0), torch.where(keep, gold, 0.0)
            self.record(keep.sum(), (x - y).square().sum(), x.sum(), y.sum(), x.square().sum(), y.square().sum(),
                        (x * y).sum())
        else:
            n, correct, tp, fp, fn = class_counts(output.detach().argmax(-1), labels, self.num_labels)
            self.record(n, correct, *tp, *fp, *fn)
        return loss


class SpanLoss(PartsLoss):
    """`span_loss`, recording per micro-batch the examples and the sums of exact match and token-overlap F1
    of the best valid span (end ≥ start) against the gold answers."""

    part_names = ("examples", "exact_match", "f1_sum")

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = span_loss(output, targets)
        start, end = output.detach().unbind(-1)
        ps, pe = best_spans(start.float(), end.float())
        exact, f1 = span_scores(ps, pe, targets[:, 0::2], targets[:, 1::2])
        keep = targets[:, 0] != IGNORE_INDEX
        self.record(keep.sum(), (exact & keep).sum(), torch.where(keep, f1, 0.0).sum())
        return loss


class TokensLoss(PartsLoss):
    """`tokens_loss`, recording the counts for token accuracy and macro F1 over labelled tokens."""

    def __init__(self, num_labels: int):
        super().__init__()
        self.num_labels = num_labels
        self.part_names = class_part_names("tokens", num_labels)

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = tokens_loss(output, targets)
        n, correct, tp, fp, fn = class_counts(output.detach().argmax(-1), targets, self.num_labels)
        self.record(n, correct, *tp, *fp, *fn)
        return loss


def loss_for(cfg: ModelConfig, ops: TokenOps):
    head = cfg.bert_head
    if head in MLM_HEADS:
        return PretrainLoss(ops, sop=head == "pretrain")
    if head == "encoder":
        raise ValueError("model.bert_head='encoder' has no loss; pick pretrain, mlm, classify, span or tokens")
    if head == "classify":
        return ClassifyLoss(cfg.num_labels)
    if head == "tokens":
        return TokensLoss(cfg.num_labels)
    return SpanLoss()


def eval_metrics(parts: dict, loss: float) -> dict:
    """The reported evaluation metrics from the loss parts' means: MLM/SOP values (and perplexity) for
    pretraining; accuracy and macro F1 for classify and tokens; exact match and F1 for span; MSE and
    Pearson's r for regression."""
    count = parts.get("examples", parts.get("tokens"))
    if "correct" in parts:
        C = sum(1 for k in parts if k.startswith("tp"))
        tp, fp, fn = ([parts[f"{kind}{c}"] for c in range(C)] for kind in ("tp", "fp", "fn"))
        return {"val_accuracy": parts["correct"] / max(count, 1e-12), "val_f1": macro_f1(tp, fp, fn)}
    if "exact_match" in parts:
        n = max(count, 1e-12)
        return {"val_exact_match": parts["exact_match"] / n, "val_f1": parts["f1_sum"] / n}
    if "sq_error" in parts:
        n = max(count, 1e-12)
        mx, my = parts["sum_pred"] / n, parts["sum_gold"] / n
        cov = parts["sum_pred_gold"] / n - mx * my
        vx, vy = parts["sum_pred2"] / n - mx * mx, parts["sum_gold2"] / n - my * my
        r = cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else 0.0
        return {"val_mse": parts["sq_error"] / n, "val_pearson": r}
    out = {f"val_{k}": v for k, v in parts.items()}
    if "mlm_loss" in parts:
        out["val_mlm_ppl"] = math.exp(min(parts["mlm_loss"], 50))
    return out


def example_batch(cfg: ModelConfig, micro_batch: int, generator: torch.Generator):
    """Random full-length inputs (two segments, no padding) and pretraining targets (15% of the tokens
    predicted, a random order label), for measuring a step (`models/activations.py`)."""
    T = cfg.seq_len
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, T), generator=generator)
    types = (torch.arange(T) >= T // 2).long().expand(micro_batch, T)
    inputs = pack_inputs(ids, types)
    picked = torch.rand(micro_batch, T, generator=generator) < MASKED_FRACTION
    if cfg.bert_head in MLM_HEADS:
        labels = torch.where(picked, ids, torch.full_like(ids, IGNORE_INDEX))
        inputs[:, 2] += picked  # flagged as the data pipeline does: the MLM head runs on them alone
        return inputs, torch.cat([labels, torch.randint(0, 2, (micro_batch, 1), generator=generator)], dim=1)
    if cfg.bert_head == "span":
        return inputs, torch.randint(0, T, (micro_batch, 2), generator=generator)
    if cfg.bert_head == "tokens":
        return inputs, torch.randint(0, cfg.num_labels, (micro_batch, T), generator=generator)
    return inputs, torch.randint(0, cfg.num_labels, (micro_batch, 1), generator=generator)


def init_rule(name: str, shape: tuple, cfg: ModelConfig) -> InitRule:
    """Megatron's BERT init: N(0, std) everywhere, the layers' output projections N(0, std/√(2L)), biases 0,
    norms 1."""
    if len(shape) == 1:
        return InitRule("ones") if "norm" in name and name.endswith("weight") else InitRule("zeros")
    if name.startswith("layers.") and name.endswith("proj.weight"):
        return InitRule("normal", cfg.init_std / math.sqrt(2 * cfg.n_layers))
    return InitRule("normal", cfg.init_std)
