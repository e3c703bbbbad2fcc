"""`meshlm finetune`: a BERT checkpoint fine-tuned on a labelled task, with the task's metrics.

    meshlm finetune --checkpoint BASE --task classify|span|tokens --train T.jsonl --valid V.jsonl --out DIR
                    [--epochs 3] [--max-length N] [--truncate] [--section.key=value ...]

The run's config is the base checkpoint's, with the task's head (`model.bert_head`), `model.num_labels`
found from the labels, `train.init_from=BASE` (the encoder and pooler come from it, a new head keeps its
seeded init) and fine-tuning defaults (`finetune_values`, `with_schedule`), then any `--section.key=value` the user gives.
Then the ordinary `Trainer` runs with the datasets built here: resuming, checkpoints, parallel layouts,
metrics.jsonl and the log are those of pretraining. Running the same command again resumes DIR.

Data, one JSON object per line:

* classify: `{"text": ..., "text_pair": ... (optional), "label": ...}`; labels are class ids 0..C-1, or
  strings (mapped to ids in sorted order; the mapping is written to DIR/finetune.json). With
  `--model.num_labels=1` the labels are numbers and the head a regression (mean squared error).
* span (SQuAD): `{"question": ..., "context": ..., "answers": {"text": [...], "answer_start": [...]}}`
  with character offsets into the context; no answers means "no answer", the [CLS] position.
* tokens: `{"tokens": [word, ...], "labels": [label per word]}`; a word's first sub-token carries its
  label, the others are ignored (−100).

Inputs are `[CLS] a [SEP] (b [SEP])`, a = text / question, b = text_pair / context, with token types and
padding to model.seq_len, or to `--max-length` (shorter: a base with 512 positions need not pay for them
on short texts; the trainer's tokens/s and MFU count the rows' tokens). Everything is read, checked and encoded before DIR is created: a bad line is
one error naming the file and line (a text longer than the model too, unless `--truncate`; with it, span
examples whose answer is cut off are dropped and counted).

Evaluation covers the whole validation set once: it is padded to whole micro-batches with rows whose
labels are ignored, and `train.eval_iters` is set to its micro-batch count. The losses record the counts
their metrics need (`models/bert.py`), so metrics.jsonl's eval rows carry val_accuracy and val_f1
(classify, tokens: macro F1), val_exact_match and val_f1 (span), or val_mse and val_pearson (regression).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from meshlm.core.config import ConfigError, apply_overrides, build, check_output_dir
from meshlm.core.console import say
from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, get_field, read_jsonl, short_json
from meshlm.models.loss import IGNORE_INDEX as IGNORE
from meshlm.train.prepared import Extensions, train_prepared, with_schedule, write_info

MAX_ANSWERS = 3  # gold answers kept per span example (SQuAD's validation set has up to 5; scores take the best)
INFO_FILE = "finetune.json"
INFO_KEYS = ("task", "num_labels", "names", "regression")  # another run in DIR differs in one of these


# ---- labels -------------------------------------------------------------------------------------------------
@dataclass
class Labels:
    """How raw labels become ids: class ids as given, strings by a sorted mapping, or regression values."""

    num_labels: int
    names: list[str] | None = None  # string labels, id = index
    regression: bool = False

    def to_id(self, raw, where: str, flag_train: str):
        if self.regression:
            return float(raw)
        if self.names is not None:
            if raw not in self._index:
                raise DataError(f"{where}: label {short_json(raw)} does not occur in {flag_train}; the head's classes "
                                f"are {', '.join(self.names[:10])}{', ...' if len(self.names) > 10 else ''}")
            return self._index[raw]
        return raw

    def __post_init__(self):
        self._index = {n: i for i, n in enumerate(self.names or [])}

    def to_dict(self) -> dict:
        return {"num_labels": self.num_labels, "names": self.names, "regression": self.regression}


def resolve_labels(train: list[tuple[str, object]], valid: list[tuple[str, object]], given: int | None,
                   train_flag: str) -> Labels:
    """The label scheme from every (file:line, raw label) of both files: integers 0..C-1 (C = the largest + 1,
    or `given` = --model.num_labels), strings (sorted), or numbers for regression (`given` = 1)."""
    everything = train + valid
    for where, raw in everything:
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise DataError(f"{where}: label {short_json(raw)} is neither a class id, a class name nor a number")
    if given == 1:
        for where, raw in everything:
            if isinstance(raw, str) or not math.isfinite(raw):
                raise DataError(f"{where}: label {short_json(raw)} is not a finite number; model.num_labels=1 is "
                                "a regression head")
        return Labels(1, regression=True)
    first = train[0][1]
    if isinstance(first, str):
        for where, raw in train:
            if not isinstance(raw, str):
                raise DataError(f"{where}: label {short_json(raw)} is not a string like the first line's {short_json(first)}"
                                "; use class names or class ids throughout")
        names = sorted({raw for _, raw in train})
        if given is not None and given != len(names):
            raise DataError(f"{train_flag} has {len(names)} class names but model.num_labels={given}; drop "
                            "--model.num_labels or make them agree")
        if len(names) < 2:
            raise DataError(f"{train_flag} has one class only ({short_json(names[0])}); a classifier needs two or more")
        return Labels(len(names), names=names)
    for where, raw in everything:
        if isinstance(raw, str) or raw != int(raw) or raw < 0:
            raise DataError(f"{where}: label {short_json(raw)} is not a class id (an integer >= 0) like the first line's "
                            f"of {train_flag}; for regression pass --model.num_labels=1")
    top = max(int(raw) for _, raw in train)
    num = given if given is not None else top + 1
    for where, raw in everything:
        if raw >= num:
            source = f"model.num_labels={given}" if given is not None else \
                f"the training labels (0..{top}, so model.num_labels={num})"
            raise DataError(f"{where}: label {int(raw)} is outside the head's range 0..{num - 1} set by {source}; "
                            "fix the label or set --model.num_labels")
    if num < 2:
        raise DataError(f"{train_flag}: every label is 0; a classifier needs two or more classes (or "
                        "--model.num_labels=1 for regression)")
    return Labels(num)


# ---- encoding -----------------------------------------------------------------------------------------------
class Encoder:
    """Token ids (and character offsets) from the base checkpoint's tokenizer; `[CLS] a [SEP] (b [SEP])`."""

    def __init__(self, tokenizer, seq_len: int, truncate: bool):
        special = tokenizer.special_ids
        missing = [t for t in ("cls", "sep", "pad") if t not in special]
        if missing:
            raise ConfigError(f"tokenizer {tokenizer.name!r} has no {', '.join(f'[{m.upper()}]' for m in missing)} "
                              "token; fine-tuning a BERT needs a WordPiece tokenizer such as data.tokenizer=bert")
        self.tok, self.T, self.truncate = tokenizer, seq_len, truncate
        self.cls, self.sep, self.pad = special["cls"], special["sep"], special["pad"]
        self.unk = special.get("unk", self.pad)
        self.hf = getattr(tokenizer, "_tok", None)  # a `tokenizers.Tokenizer`: batch encoding with offsets

    def ids(self, texts: list[str]) -> list[list[int]]:
        if self.hf is not None:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        return [self.tok.encode(t) for t in texts]

    def with_offsets(self, texts: list[str]):
        if self.hf is None:
            raise ConfigError(f"--task span needs character offsets from the tokenizer; {self.tok.name!r} gives "
                              "none (use a Hugging Face tokenizer such as data.tokenizer=bert)")
        return [(e.ids, e.offsets) for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def too_long(self, where: str, n: int) -> DataError:
        return DataError(f"{where}: the example is {n} tokens with [CLS] and [SEP], longer than the model's "
                         f"model.seq_len={self.T}; shorten it or pass --truncate to cut it")

    def row(self, a: list[int], b: list[int] | None) -> tuple[np.ndarray, int, int]:
        ids = [self.cls, *a, self.sep] + ([*b, self.sep] if b is not None else [])
        out = np.full(self.T, self.pad, dtype=np.int32)
        out[:len(ids)] = ids
        return out, len(a) + 2, len(ids)


def _fit_pair(a: list[int], b: list[int] | None, room: int) -> tuple[list[int], list[int] | None]:
    """Longest first: drop tokens from the end of the longer segment until both fit in `room`."""
    a, b = list(a), (None if b is None else list(b))
    while len(a) + (len(b) if b is not None else 0) > room:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    return a, b


@dataclass
class Encoded:
    ids: np.ndarray  # (N, T) int32
    lens: np.ndarray  # (N, 2) int32: [CLS] a [SEP] length (types 1 from there), real tokens (mask)
    targets: np.ndarray  # (N, K) int64, or float64 for regression
    dropped: int = 0  # span: examples whose answer the truncation cut off


def encode_classify(lines: list[Line], labels: Labels, enc: Encoder, train_flag: str) -> Encoded:
    texts = [get_field(x, "text", str, "classify") for x in lines]
    pairs = [get_field(x, "text_pair", str, "classify", optional=True) for x in lines]
    raw = [(x.where, x.obj["label"]) for x in lines]
    a_ids = enc.ids(texts)
    has_b = [i for i, p in enumerate(pairs) if p is not None]
    b_ids: list[list[int] | None] = [None] * len(lines)
    for i, ids in zip(has_b, enc.ids([pairs[i] for i in has_b])):
        b_ids[i] = ids
    rows, lens = [], []
    for line, a, b in zip(lines, a_ids, b_ids):
        room = enc.T - (3 if b is not None else 2)
        n = len(a) + (len(b) if b is not None else 0)
        if n > room:
            if not enc.truncate:
                raise enc.too_long(line.where, n + enc.T - room)
            a, b = _fit_pair(a, b, room)
        r, na, nr = enc.row(a, b)
        rows.append(r)
        lens.append((na, nr))
    dtype = np.float64 if labels.regression else np.int64
    targets = np.array([[labels.to_id(v, w, train_flag)] for w, v in raw], dtype=dtype)
    return Encoded(np.stack(rows), np.array(lens, dtype=np.int32), targets)


def _answers(line: Line, context: str) -> list[tuple[int, int]]:
    """The answers' character spans [start, end) in the context, checked against their text."""
    answers = get_field(line, "answers", dict, "span")
    texts, starts = answers.get("text"), answers.get("answer_start")
    if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
        raise DataError(f"{line.where}: 'answers' must hold lists 'text' and 'answer_start' of the same length")
    spans = []
    for text, start in zip(texts, starts):
        if not isinstance(text, str) or not text or isinstance(start, bool) or not isinstance(start, int):
            raise DataError(f"{line.where}: an answer needs a non-empty 'text' and an integer 'answer_start'")
        if context[start:start + len(text)] != text:
            raise DataError(f"{line.where}: answer {short_json(text)} is not at character {start} of the context "
                            f"(found {short_json(context[start:start + len(text)])}); fix answer_start")
        spans.append((start, start + len(text)))
    return spans


def encode_span(lines: list[Line], enc: Encoder) -> Encoded:
    questions = [get_field(x, "question", str, "span") for x in lines]
    contexts = [get_field(x, "context", str, "span") for x in lines]
    spans = [_answers(x, c) for x, c in zip(lines, contexts)]
    q_ids = enc.ids(questions)
    c_enc = enc.with_offsets(contexts)
    rows, lens, targets, dropped = [], [], [], 0
    for line, q, (c, offsets), answers in zip(lines, q_ids, c_enc, spans):
        gold = []
        for s, e in answers:  # the tokens whose characters overlap the answer
            hit = [i for i, (a, b) in enumerate(offsets) if a < e and b > s]
            if not hit:
                raise DataError(f"{line.where}: answer at characters {s}..{e} covers no token of the context")
            gold.append((hit[0], hit[-1]))
        n = len(q) + len(c) + 3
        if n > enc.T:
            if not enc.truncate:
                raise enc.too_long(line.where, n)
            q = q[:max(1, (enc.T - 3) // 2)]  # a question takes at most half, the context the rest
            c = c[:enc.T - 3 - len(q)]
        inside = [(s, e) for s, e in gold if e < len(c)]
        if gold and (not inside or inside[0] != gold[0]):  # the answer the loss trains on was cut off
            dropped += 1
            continue
        base = len(q) + 2  # [CLS] question [SEP]
        pairs = [(s + base, e + base) for s, e in inside][:MAX_ANSWERS] or [(0, 0)]  # no answer: [CLS]
        pairs += [(IGNORE, IGNORE)] * (MAX_ANSWERS - len(pairs))
        r, na, nr = enc.row(q, c)
        rows.append(r)
        lens.append((na, nr))
        targets.append([p for pair in pairs for p in pair])
    if not rows:
        raise DataError(f"{lines[0].where.rsplit(':', 1)[0]}: every example's answer lies beyond the truncated "
                        f"context (model.seq_len={enc.T}); use shorter contexts")
    return Encoded(np.stack(rows), np.array(lens, dtype=np.int32), np.array(targets, dtype=np.int64), dropped)


def encode_tokens(lines: list[Line], labels: Labels, enc: Encoder, train_flag: str) -> Encoded:
    words, tags = [], []
    for x in lines:
        w = get_field(x, "tokens", list, "tokens")
        t = get_field(x, "labels", list, "tokens")
        if len(w) != len(t):
            raise DataError(f"{x.where}: {len(w)} tokens but {len(t)} labels; give one label per token")
        if not all(isinstance(v, str) for v in w):
            raise DataError(f"{x.where}: 'tokens' must be a list of strings (words)")
        words.append(w)
        tags.append([labels.to_id(v, x.where, train_flag) for v in t])
    flat = enc.ids([w for ws in words for w in ws])
    rows, lens, targets, k = [], [], [], 0
    for x, ws, ts in zip(lines, words, tags):
        ids, lab = [], []
        for t in ts:
            pieces = flat[k] or [enc.unk]  # a word the tokenizer drops keeps one position for its label
            k += 1
            ids += pieces
            lab += [t] + [IGNORE] * (len(pieces) - 1)
        if len(ids) + 2 > enc.T:
            if not enc.truncate:
                raise enc.too_long(x.where, len(ids) + 2)
            ids, lab = ids[:enc.T - 2], lab[:enc.T - 2]
        r, na, nr = enc.row(ids, None)
        y = np.full(enc.T, IGNORE, dtype=np.int64)
        y[1:1 + len(lab)] = lab
        rows.append(r)
        lens.append((na, nr))
        targets.append(y)
    return Encoded(np.stack(rows), np.array(lens, dtype=np.int32), np.stack(targets))


def _raw_labels(lines: list[Line], task: str) -> list[tuple[str, object]]:
    if task == "classify":
        return [(x.where, get_field(x, "label", (int, float, str), "classify")) for x in lines]
    out = []
    for x in lines:
        for v in get_field(x, "labels", list, "tokens"):
            out.append((x.where, v))
    return out


# ---- datasets -----------------------------------------------------------------------------------------------
class FinetuneDataset:
    """Encoded examples as the trainer's BatchLoader reads them: row i is one int64 vector (ids, the two
    segment lengths, the targets; float targets travel as their float64 bits), `collate` turns a batch of
    rows into (inputs (B, 3, T), targets)."""

    def __init__(self, data: Encoded):
        self.data = data
        self.T = data.ids.shape[1]
        self.float_targets = data.targets.dtype == np.float64
        self.num_tokens = int(data.lens[:, 1].sum())

    def __len__(self) -> int:
        return len(self.data.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        y = self.data.targets[i]
        y = y.view(np.int64) if self.float_targets else y.astype(np.int64)
        return np.concatenate([self.data.ids[i].astype(np.int64), self.data.lens[i].astype(np.int64), y])

    def collate(self, rows: np.ndarray):
        import torch

        from meshlm.models.bert import pack_inputs

        T = self.T
        x = torch.from_numpy(np.ascontiguousarray(rows[:, :T]))
        pos = torch.arange(T)
        first = torch.from_numpy(rows[:, T:T + 1].copy())
        real = torch.from_numpy(rows[:, T + 1:T + 2].copy())
        inputs = pack_inputs(x, (pos >= first) & (pos < real), pos < real)
        y = np.ascontiguousarray(rows[:, T + 2:])
        targets = torch.from_numpy(y.view(np.float64)).float() if self.float_targets else torch.from_numpy(y)
        return inputs, targets

    def padded(self, multiple: int, enc: Encoder) -> FinetuneDataset:
        """This set with rows of `[CLS] [SEP]` and ignored targets added up to a multiple of `multiple`."""
        extra = -len(self) % multiple
        if not extra:
            return self
        d = self.data
        ids, na, nr = enc.row([], None)
        fill = np.nan if self.float_targets else IGNORE
        return FinetuneDataset(Encoded(np.concatenate([d.ids, np.tile(ids, (extra, 1))]),
                                       np.concatenate([d.lens, np.tile([[na, nr]], (extra, 1)).astype(np.int32)]),
                                       np.concatenate([d.targets, np.full((extra, d.targets.shape[1]), fill,
                                                                          dtype=d.targets.dtype)])))


# ---- config -------------------------------------------------------------------------------------------------
def finetune_values(base: dict, task: str, num_labels: int, out_dir: str, init_from: str,
                    overrides: list[str]) -> dict:
    """The base checkpoint's config values with the task's head and fine-tuning defaults, then the user's
    overrides. Defaults (BERT's recipe, scaled to small runs): AdamW lr 1e-4 (β2 0.999, ε 1e-6, weight decay
    0.01), linear decay to 0, batches of 32 (micro-batches of 16), no layout (one process unless parallel.*
    says otherwise), a fresh run from the base's weights (`train.init_from`) that resumes from DIR."""
    values = {k: dict(v) for k, v in base.items()}
    values["model"].update(bert_head=task, num_labels=num_labels)
    values["train"].update(out_dir=out_dir, init_from=init_from, resume="auto", micro_batch_size=16,
                           global_batch_size=32, sample_tokens=0, compile=False, recompute="none",
                           recompute_method="uniform", recompute_num_layers=0, device="auto")
    values["optim"].update(lr=1e-4, min_lr=0.0, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-6,
                           grad_clip=1.0, decay="linear", decay_steps=0)
    values["parallel"] = {}
    return apply_overrides(values, overrides)


# ---- the command --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FinetuneOptions:
    """`meshlm finetune`'s flags (`meshlm.commands.finetune.finetune_options` builds them from the command line;
    `meshlm tune --task` too)."""

    checkpoint: str  # the base: a run directory or a step directory
    task: str  # classify | span | tokens
    train: str  # FILE.jsonl
    valid: str  # FILE.jsonl
    out: str  # the run directory (the same again resumes)
    epochs: int  # passes over the training set
    max_length: int | None = None  # tokens per example (None: model.seq_len)
    truncate: bool = False  # cut examples longer than the row instead of refusing them


def _given_num_labels(overrides: list[str]) -> int | None:
    value = apply_overrides({}, [o for o in overrides if o.removeprefix("--").startswith("model.num_labels=")])
    given = value.get("model", {}).get("num_labels")
    if given is None:
        return None
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ConfigError(f"model.num_labels={given!r} must be an integer >= 1 (1: regression)")
    return given


def _max_length(opts: FinetuneOptions, cfg) -> int:
    """Tokens per example: --max-length, at most model.seq_len (its default); under sequence parallelism a
    multiple of parallel.tp."""
    seq_len, wanted = cfg.model.seq_len, opts.max_length
    if wanted is None:
        return seq_len
    if not 2 <= wanted <= seq_len:
        raise ConfigError(f"--max-length {wanted} must be in 2..{seq_len} (model.seq_len, the positions the base "
                          "checkpoint has)")
    if cfg.parallel.sp and wanted % cfg.parallel.tp:
        raise ConfigError(f"--max-length {wanted} must be a multiple of parallel.tp={cfg.parallel.tp} under sequence "
                          "parallelism")
    return wanted


def _class_counts(data: Encoded, labels: Labels) -> str:
    if labels.regression:
        y = data.targets[:, 0]
        return f"labels {y.min():.3g}..{y.max():.3g}, mean {y.mean():.3g}"
    y = data.targets[data.targets != IGNORE] if data.targets.shape[1] > 1 else data.targets[:, 0]
    counts = Counter(int(v) for v in y)
    names = labels.names or [str(i) for i in range(labels.num_labels)]
    return "classes " + ", ".join(f"{names[c]} {counts.get(c, 0)}" for c in range(labels.num_labels))


def prepare(opts: FinetuneOptions, overrides: list[str]):
    """Everything before training, without writing anything: (config, tokenizer, train set, padded valid
    set, info for DIR/finetune.json)."""
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec

    if opts.epochs < 1:
        raise ConfigError(f"--epochs {opts.epochs} must be >= 1")
    check_output_dir("--out", opts.out)
    train_lines = read_jsonl(opts.train, "--train")
    valid_lines = read_jsonl(opts.valid, "--valid")
    base = open_checkpoint(opts.checkpoint).config  # the trainer reads its weights (`train.init_from`)
    if not get_spec(base.model.family).task_heads:
        raise ConfigError(f"--checkpoint {opts.checkpoint!r} holds a model.family={base.model.family!r} model; "
                          "meshlm finetune needs a BERT checkpoint (model.family=bert)")
    given = _given_num_labels(overrides)
    if opts.task == "span":
        labels = Labels(2)
    else:
        labels = resolve_labels(_raw_labels(train_lines, opts.task), _raw_labels(valid_lines, opts.task), given,
                                "--train")
        if opts.task == "tokens" and labels.regression:
            raise ConfigError("--task tokens needs model.num_labels >= 2 (regression is for --task classify)")
    values = finetune_values(base.to_dict(), opts.task, labels.num_labels, opts.out, opts.checkpoint, overrides)
    first = build(values)  # the model's length, the tokenizer and the micro-batch size
    tokenizer = get_tokenizer(first.data.tokenizer)
    length = _max_length(opts, first)
    enc = Encoder(tokenizer, length, opts.truncate)
    sets = []
    for lines, flag, path in ((train_lines, "--train", opts.train), (valid_lines, "--valid", opts.valid)):
        if opts.task == "classify":
            data = encode_classify(lines, labels, enc, "--train")
        elif opts.task == "span":
            data = encode_span(lines, enc)
        else:
            data = encode_tokens(lines, labels, enc, "--train")
        sets.append(data)
        note = f"; dropped {data.dropped} whose answer lies beyond the truncated context" if data.dropped else ""
        counts = "" if opts.task == "span" else f" ({_class_counts(data, labels)})"
        say(f"{flag} {path}: {len(data.ids)} examples{counts}{note}")
    train, valid = (FinetuneDataset(d) for d in sets)
    # The whole validation set, once per evaluation: padded to whole micro-batches with ignored rows.
    valid = valid.padded(first.train.micro_batch_size, enc)
    cfg = with_schedule(values, overrides, len(train), len(valid), opts.epochs)
    info = {"task": opts.task, "checkpoint": opts.checkpoint, "train": opts.train, "valid": opts.valid,
            "train_examples": len(train), "valid_examples": len(sets[1].ids), "max_length": length,
            **labels.to_dict()}
    return cfg, tokenizer, train, valid, info


def run_finetune(opts: FinetuneOptions, overrides: list[str], extensions: Extensions) -> int:
    """`meshlm finetune` (parsed by `meshlm.commands.finetune`), with the trainer's `extensions(cfg)`."""
    cfg, tokenizer, train, valid, info = prepare(opts, overrides)
    t = cfg.train
    say(f"fine-tuning {info['task']} (model.num_labels={cfg.model.num_labels}) from {opts.checkpoint}: "
        f"{t.max_steps} steps of {t.global_batch_size} examples, lr {cfg.optim.lr:g}, evaluation every "
        f"{t.eval_every} steps over {info['valid_examples']} examples ({t.eval_iters} micro-batches)")
    trainer, result = train_prepared(cfg, (tokenizer, train, valid), opts.out, lambda out: write_info(out, info, INFO_FILE, INFO_KEYS),
                                     extensions)
    shown = {k: v for k, v in result.items() if k.startswith("val_")}
    if shown:
        say(f"finetune: step {result['step']}: " + " | ".join(f"{k} {v:.4f}" for k, v in shown.items()))
    return trainer.exit_code

