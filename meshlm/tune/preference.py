"""Preference data and losses for `meshlm align` (DPO, IPO, SimPO; docs/align.md).

Data. Each line is `{"prompt": ..., "chosen": ..., "rejected": ...}`: plain text, or lists of messages
rendered by the chat template (`meshlm/data/chat.py`; `pair_texts`). The prompt and each completion are
tokenized the way TRL's `DPOTrainer` does it: `prompt + completion` as one text, the completion being the
tokens after the longest common prefix with the prompt's own tokens, then (plain text only) the
end-of-document token.
An example becomes two rows of the same length, chosen then rejected, each `prompt + completion + eod`
padded with end-of-document tokens; the targets are the completion's tokens (the eod included), every
prompt and padding target ignored (-100). A third piece of each row is the reference model's log-probability
of its completion (a float64 stored bit for bit in an int64 column after the targets): the reference is
frozen, so its numbers are computed once (`align.reference_logps`) and travel with the batch, through the
data-parallel split and the pipeline's micro-batches, to wherever the loss is computed.

Batches. The trainer's `BatchLoader` hands out examples; `PreferenceDataset.collate` turns m examples into
2m rows [c1, r1, c2, r2, ...], so a pair never leaves its micro-batch, under any layout.

Loss (TRL's definitions; `d` = (π_c − ref_c) − (π_r − ref_r) with π, ref the summed completion log-probs):

* dpo: −(1−ε)·logσ(β·d) − ε·logσ(−β·d)  (ε = label smoothing, 0 by default: TRL's `sigmoid`);
* ipo: (d̄ − 1/(2β))², d̄ with each log-ratio divided by its completion's token count (TRL's `ipo`);
* simpo (no reference): −(1−ε)·logσ(β·(π̄_c − π̄_r − γ/β)) − ε·logσ(−β·(…)), π̄ the mean token log-prob
  (TRL's `CPOTrainer` with `loss_type="simpo"`, `cpo_alpha=0`).

The loss of a micro-batch is the mean over its pairs; the trainer averages micro-batches and dp ranks as
for any loss. The metrics are TRL's: rewards/chosen and rewards/rejected (β · the log-ratio; for simpo β ·
the mean log-prob), rewards/accuracies, rewards/margins, logps/chosen, logps/rejected (the policy's; mean
ones for simpo) and, where the whole logits are on one rank (tp = 1), logits/chosen and logits/rejected
(the mean logit over the vocabulary, averaged over the completion tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, short_json
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from meshlm.tune.chat_data import ROLES

METHODS = ("dpo", "ipo", "simpo")
FIELDS = ("prompt", "chosen", "rejected")
PART_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected")
LOGIT_NAMES = ("logits/chosen", "logits/rejected")


@dataclass(frozen=True)
class Objective:
    """The loss `method` with its constants."""

    method: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5  # simpo's target margin γ (TRL's simpo_gamma)

    @property
    def reference(self) -> bool:
        """Whether the loss compares with the frozen reference model (simpo does not)."""
        return self.method != "simpo"


# ---- data -------------------------------------------------------------------------------------------------
def pair_texts(line: Line, template=None) -> tuple[str, str, str, bool]:
    """(prompt, chosen, rejected, end with eod) of one line: plain text (an end-of-document token follows each
    completion, as TRL's EOS), or the conversational form, messages rendered by the chat template
    `template()` (called on the first such line): the prompt with the generation prompt, each completion the
    text that rendering prompt + completion adds to it (its end of turn included; no eod added, as TRL).
    A DataError naming file:line otherwise."""
    for key in FIELDS:
        if key not in line.obj:
            raise DataError(f"{line.where}: no {key!r} field; every line of a preference file needs \"prompt\", "
                            "\"chosen\" and \"rejected\"")
    values = [line.obj[key] for key in FIELDS]
    chat = [isinstance(v, list) for v in values]
    if any(chat):
        if not all(chat):
            key = FIELDS[chat.index(False)]
            raise DataError(f"{line.where}: {key!r} is not a list of messages like the others; give every field as "
                            "text, or every field as messages")
        prompt, chosen, rejected = _render_pair(line, template(), *values)
        eod = False
    else:
        for key, value in zip(FIELDS, values):
            if not isinstance(value, str):
                raise DataError(f"{line.where}: {key!r} is {type(value).__name__} {short_json(value)}, not text")
        prompt, chosen, rejected = values
        eod = True
    if chosen == rejected:
        raise DataError(f"{line.where}: 'chosen' and 'rejected' are the same; a preference pair needs two "
                        "different completions (drop the line or fix one of them)")
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip():
            raise DataError(f"{line.where}: {key!r} is empty; each completion needs text to score")
    return prompt, chosen, rejected, eod


def _check_turns(line: Line, key: str, turns: list) -> None:
    """Each message of field `key` an object with a known role and text content, as `meshlm tune` checks a
    conversation (`chat_data.messages`): a DataError naming file:line otherwise."""
    for n, turn in enumerate(turns):
        role = turn.get("role") if isinstance(turn, dict) else None
        if role not in ROLES:
            raise DataError(f"{line.where}: {key}[{n}] has role {short_json(role)}; a role is one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            raise DataError(f"{line.where}: {key}[{n}] ({role}) has content {short_json(turn.get('content'))}, not text")


def _render_pair(line: Line, template, prompt: list, chosen: list, rejected: list) -> tuple[str, str, str]:
    from meshlm.data.chat import render

    for key, turns in zip(FIELDS, (prompt, chosen, rejected)):
        _check_turns(line, key, turns)
    try:
        head = render(template, prompt, add_generation_prompt=True)
        out = []
        for key, messages in (("chosen", chosen), ("rejected", rejected)):
            full = render(template, prompt + messages)
            if not full.startswith(head):
                raise DataError(f"the chat template renders the prompt with its generation prompt differently from "
                                f"the start of prompt + {key}; use a template whose conversations extend their "
                                "prefixes (--chat-template)")
            out.append(full[len(head):])
    except DataError as err:
        raise DataError(f"{line.where}: {err}") from None
    return head, out[0], out[1]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def split_tokens(tokenizer, prompt: str, chosen: str, rejected: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) as TRL splits them: each completion is what follows the
    common prefix of the prompt's tokens and the tokens of prompt + completion (a token merging across the
    boundary goes to the completion); an empty prompt becomes one end-of-document token."""
    p = tokenizer.encode(prompt)
    pc, pr = tokenizer.encode(prompt + chosen), tokenizer.encode(prompt + rejected)
    n = min(_common(p, pc), _common(p, pr))
    head = p[:n] or [tokenizer.eod_id]
    return head, pc[n:], pr[n:]


class PreferenceDataset:
    """Examples of two rows each: item i is [ids (2·T), targets (2·T), reference log-probs (2, float64 bits)]."""

    shuffled = False

    def __init__(self, ids: np.ndarray, targets: np.ndarray, reference: np.ndarray | None = None):
        self.ids, self.targets = ids, targets  # (N, 2, width) int64
        self.width = ids.shape[2]
        self.T = 2 * self.width  # tokens per example (the trainer's tokens/s and FLOPs)
        self.reference = np.zeros((len(ids), 2), dtype=np.float64) if reference is None else reference
        self.num_tokens = int((targets != IGNORE).sum())

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.concatenate([self.ids[i].reshape(-1), self.targets[i].reshape(-1),
                               self.reference[i].astype(np.float64).view(np.int64)])

    def with_reference(self, reference: np.ndarray) -> PreferenceDataset:
        return PreferenceDataset(self.ids, self.targets, np.asarray(reference, dtype=np.float64))

    def collate(self, rows: np.ndarray):
        """m items → (ids (2m, T), targets (2m, T + 1)): rows chosen, rejected, chosen, …; the last target
        column holds each row's reference log-prob (float64 bits)."""
        import torch

        m, T = len(rows), self.width
        ids = rows[:, :2 * T].reshape(2 * m, T)
        targets = rows[:, 2 * T:4 * T].reshape(2 * m, T)
        ref = rows[:, 4 * T:].reshape(2 * m, 1)
        return (torch.from_numpy(np.ascontiguousarray(ids)),
                torch.from_numpy(np.ascontiguousarray(np.concatenate([targets, ref], axis=1))))

    def padded(self, multiple: int, pad_id: int) -> PreferenceDataset:
        """Pairs whose targets are all ignored added up to a multiple of `multiple` (a whole evaluation set);
        the loss and the metrics leave them out."""
        extra = -len(self) % multiple
        if not extra:
            return self
        T = self.width
        return PreferenceDataset(np.concatenate([self.ids, np.full((extra, 2, T), pad_id, dtype=np.int64)]),
                                 np.concatenate([self.targets, np.full((extra, 2, T), IGNORE, dtype=np.int64)]),
                                 np.concatenate([self.reference, np.zeros((extra, 2))]))


def encode_pairs(texts: list[tuple], wheres: list[str], tokenizer, length: int) -> PreferenceDataset:
    """Rows of `length` tokens for (prompt, chosen, rejected) examples; an example too long is a DataError
    naming its file:line."""
    eod = tokenizer.eod_id
    ids = np.full((len(texts), 2, length), eod, dtype=np.int64)
    targets = np.full((len(texts), 2, length), IGNORE, dtype=np.int64)
    for i, (item, where) in enumerate(zip(texts, wheres)):
        prompt, chosen, rejected, end = (*item, True)[:4]  # (prompt, chosen, rejected[, end with eod])
        head, c, r = split_tokens(tokenizer, prompt, chosen, rejected)
        if c == r:
            raise DataError(f"{where}: 'chosen' and 'rejected' give the same tokens; a preference pair needs two "
                            "different completions")
        for k, (name, out) in enumerate((("chosen", c), ("rejected", r))):
            out = out + [eod] if end else out
            need = len(head) + len(out)
            if need > length:
                raise DataError(f"{where}: prompt + {name} is {need} tokens ({len(head)} prompt + {len(out)} "
                                f"{name} with the end-of-document token), longer than the {length} of a row; shorten "
                                "it or raise --max-length (at most model.seq_len)")
            seq = head + out
            ids[i, k, :need] = seq
            targets[i, k, len(head) - 1:need - 1] = out  # position j predicts token j + 1
    return PreferenceDataset(ids, targets)


# ---- the loss ----------------------------------------------------------------------------------------------
def pair_losses(objective: Objective, logps, counts, reference):
    """(per-pair losses, chosen rewards, rejected rewards, chosen logps, rejected logps) from the rows'
    summed log-probs `logps` (2n,), completion token counts `counts` (2n,) and reference log-probs (2n,),
    rows in pairs (chosen, rejected)."""
    import torch.nn.functional as F

    b, e = objective.beta, objective.label_smoothing
    pol_c, pol_r = logps[0::2], logps[1::2]
    n_c, n_r = counts[0::2].clamp(min=1), counts[1::2].clamp(min=1)
    if objective.method == "simpo":
        mean_c, mean_r = pol_c / n_c, pol_r / n_r
        z = mean_c - mean_r - objective.gamma / b
        loss = -(1 - e) * F.logsigmoid(b * z) - e * F.logsigmoid(-b * z)
        return loss, b * mean_c.detach(), b * mean_r.detach(), mean_c.detach(), mean_r.detach()
    ratio_c, ratio_r = pol_c - reference[0::2], pol_r - reference[1::2]
    if objective.method == "ipo":
        loss = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * b)) ** 2
    else:
        d = ratio_c - ratio_r
        loss = -(1 - e) * F.logsigmoid(b * d) - e * F.logsigmoid(-b * d)
    return loss, b * ratio_c.detach(), b * ratio_r.detach(), pol_c.detach(), pol_r.detach()


def split_targets(targets, T: int):
    """(token targets (B, T), reference log-probs (B,) float64) of a preference batch's targets."""
    import torch

    tokens = targets[:, :T]
    if targets.shape[1] > T:
        ref = targets[:, T].contiguous().view(torch.float64)
    else:  # a batch without the reference column (a shape probe): no reference
        ref = torch.zeros(targets.shape[0], dtype=torch.float64, device=targets.device)
    return tokens, ref


def row_logps(logits, tokens, ce, whole: bool, rows=None, n_rows: int = 0):
    """Σ log p(target) over each row's non-ignored targets, (B,) in fp32 (or float64 for a float64 model),
    and the token counts (B,). `whole`: logits (B, T, V) of the whole vocabulary; else `ce` (the layout's mean
    cross-entropy, vocab-parallel under tp) row by row. `rows`: logits (1, N, V) of N selected tokens whose
    rows these are (summed into `n_rows` rows)."""
    import torch
    import torch.nn.functional as F

    from meshlm.models.loss import accumulation_dtype

    keep = tokens != IGNORE
    if whole:
        nll = F.cross_entropy(logits.to(accumulation_dtype(logits)).reshape(-1, logits.shape[-1]), tokens.reshape(-1),
                              ignore_index=IGNORE, reduction="none").view(tokens.shape)
        if rows is not None:
            sums = nll.new_zeros(n_rows).index_add_(0, rows, -nll[0])
            return sums, torch.bincount(rows, minlength=n_rows)
        return -(nll * keep).sum(1), keep.sum(1)
    counts = keep.sum(1)
    sums = []
    for i, n in enumerate(counts.tolist()):  # every tp rank holds the same targets: the same calls
        sums.append(-ce(logits[i:i + 1], tokens[i:i + 1]) * n if n else logits.new_zeros((), dtype=torch.float32))
    return torch.stack([s.to(torch.float32) if s.dtype != torch.float64 else s for s in sums]), counts


def make_loss(objective: Objective, ce, whole: bool):
    """The preference loss on (logits, targets) of one micro-batch, recording TRL's metrics (`PreferenceLoss`)."""
    from meshlm.models.loss import PartsLoss

    class PreferenceLoss(PartsLoss):
        part_names = PART_NAMES + (LOGIT_NAMES if whole else ())

        def __call__(self, logits, targets):
            return preference_loss(self, objective, ce, whole, logits, targets)

        def record_pairs(self, sums, n: int) -> None:
            """Metric sums over `n` real pairs (weighted by pairs, padding pairs left out)."""
            import torch

            self._records.append((torch.stack([s.detach().to(torch.float32).reshape(()) for s in sums]), n))

    return PreferenceLoss()


def preference_loss(parts, objective: Objective, ce, whole: bool, logits, targets):
    """The mean loss over the micro-batch's real pairs (a pair whose chosen row has no target is padding)."""
    import torch

    tokens, ref = split_targets(targets, logits.shape[1])
    logps, counts = row_logps(logits, tokens, ce, whole)
    ref = ref.to(logps.dtype)
    counts_f = counts.to(logps.dtype)
    loss, reward_c, reward_r, lp_c, lp_r = pair_losses(objective, logps, counts_f, ref)
    real = (counts[0::2] > 0).to(loss.dtype)
    n = int(real.sum())
    total = (loss * real).sum() / max(n, 1)
    sums = [(reward_c * real).sum(), (reward_r * real).sum(), ((reward_c > reward_r).to(loss.dtype) * real).sum(),
            ((reward_c - reward_r) * real).sum(), (lp_c * real).sum(), (lp_r * real).sum()]
    if whole:
        with torch.no_grad():
            mean_logit = logits.detach().to(logps.dtype).mean(-1)  # (B, T): the mean over the vocabulary
            keep = (tokens != -100).to(logps.dtype)
            for rows in (slice(0, None, 2), slice(1, None, 2)):
                k = keep[rows] * real.unsqueeze(1)
                sums.append((mean_logit[rows] * k).sum() / k.sum().clamp(min=1) * n)
    parts.record_pairs(sums, n)
    return total


def loss_for(objective: Objective):
    """A `ModelSpec.loss_for`: (ModelConfig, TokenOps) → the preference loss of `objective`."""
    from meshlm.models.loss import cross_entropy

    def build(cfg, ops):
        return make_loss(objective, ops.ce, ops.ce is cross_entropy)

    return build


def eval_metrics(parts: dict, loss: float) -> dict:
    """The evaluation's record: val_loss and each metric as val_<name>."""
    return {"val_loss": loss, **{f"val_{k}": v for k, v in parts.items()}}


def example_batch(micro_batch: int, seq_len: int):
    """A random preference batch of `micro_batch` pairs for the activation measurement: (ids, targets)."""
    def make(cfg, _micro, gen):
        import torch

        ids = torch.randint(0, cfg.vocab_size, (2 * micro_batch, seq_len + 1), generator=gen)
        ref = torch.zeros(2 * micro_batch, 1, dtype=torch.float64).view(torch.int64)
        return ids[:, :-1], torch.cat([ids[:, 1:], ref], 1)

    return make


def adapt_spec(spec, objective: Objective, micro_batch: int, seq_len: int):
    """`spec` with the preference loss, its evaluation record and a preference example batch."""
    return dataclasses.replace(spec, loss_for=loss_for(objective), eval_metrics=eval_metrics,
                               example_batch=example_batch(micro_batch, seq_len))
