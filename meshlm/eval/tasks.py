"""The evaluation tasks: reading their files (one clear error per bad line) and their metrics.

* perplexity: token perplexity, word perplexity and bits per byte of a text, with a sliding window of
  stride `--stride` and without overlap (docs/eval.md has the formulas);
* cloze (LAMBADA, `{"text": ...}`): the last word's accuracy in its two definitions, and its perplexity;
* choice (`{"context": ..., "choices": [...], "label": i}`): accuracy and length-normalised accuracy;
* classify (a `meshlm finetune --task classify` run, its fine-tuning jsonl): accuracy and macro F1.

Each `run_*` returns the metrics as a dict of plain numbers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from meshlm.core.config import ConfigError
from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, read_jsonl
from meshlm.data.jsonl import short_json as _short
from meshlm.eval.scorer import Scorer, windows

LN2 = math.log(2)


# ---- reading ------------------------------------------------------------------------------------------------
def read_text(path: str, flag: str = "--data") -> list[str]:
    """The documents of a perplexity file: each line's "text" of a .jsonl file, else the whole file."""
    if path.endswith(".jsonl"):
        docs = [_string(line, "text", "perplexity") for line in read_jsonl(path, flag)]
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"{flag} {path!r} does not exist or is not a file; give a text or .jsonl file")
        try:
            docs = [p.read_text(encoding="utf-8-sig")]
        except UnicodeDecodeError as err:
            raise DataError(f"{flag} {path!r} is not UTF-8 text (byte {err.start})") from None
    if not any(d.strip() for d in docs):
        raise DataError(f"{flag} {path!r} holds no text; give a file with text to score")
    return [d for d in docs if d.strip()]


def _string(line: Line, key: str, task: str) -> str:
    if key not in line.obj:
        raise DataError(f"{line.where}: no {key!r} field; every line of a {task} file needs one")
    value = line.obj[key]
    if not isinstance(value, str):
        raise DataError(f"{line.where}: {key!r} is {type(value).__name__} {_short(value)}, not a string")
    return value


def read_cloze(path: str, flag: str = "--data") -> list[tuple[str, str, str]]:
    """(file:line, context, last word with the whitespace before it) of each `{"text": ...}` line."""
    out = []
    for line in read_jsonl(path, flag):
        text = _string(line, "text", "cloze").rstrip()
        m = re.match(r"(.*\S)(\s+\S+)$", text, re.DOTALL)
        if m is None:
            raise DataError(f"{line.where}: 'text' {_short(text)} has fewer than two words; a cloze passage is a "
                            "context and a last word to predict")
        out.append((line.where, m.group(1), m.group(2)))
    return out


def read_choice(path: str, flag: str = "--data") -> list[tuple[str, str, list[str], int]]:
    """(file:line, context, choices, label) of each `{"context", "choices", "label"}` line."""
    out = []
    for line in read_jsonl(path, flag):
        context = _string(line, "context", "choice")
        if "choices" not in line.obj:
            raise DataError(f"{line.where}: no 'choices' field; every line of a choice file needs one")
        choices = line.obj["choices"]
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise DataError(f"{line.where}: 'choices' is {_short(choices)}; give a list of two or more non-empty "
                            "strings")
        if "label" not in line.obj:
            raise DataError(f"{line.where}: no 'label' field; every line of a choice file needs one")
        label = line.obj["label"]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise DataError(f"{line.where}: 'label' {_short(label)} is not an index into its {len(choices)} "
                            f"choices; give an integer 0..{len(choices) - 1}")
        out.append((line.where, context, choices, label))
    return out


# ---- encoding -----------------------------------------------------------------------------------------------
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and its continuation, the continuation's as they come out of encoding the
    whole text (so a word is split as in running text); whitespace ending the context moves to the
    continuation first. An empty context is the end-of-document token."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    ctx = tokenizer.encode(stripped) if stripped else []
    whole = tokenizer.encode(stripped + continuation)
    cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else tokenizer.encode(continuation)
    return (ctx or [tokenizer.eod_id]), cont


def joined(context: str, choice: str) -> str:
    """A choice as the continuation of its context: after a space unless either side brings whitespace."""
    if not context or context[-1].isspace() or choice[0].isspace():
        return choice
    return " " + choice


# ---- metrics ------------------------------------------------------------------------------------------------
def run_perplexity(scorer: Scorer, docs: list[str], stride: int | None = None) -> dict:
    """Token and word perplexity and bits per byte, with the sliding window and without overlap."""
    L = scorer.seq_len
    stride = stride or max(1, L // 2)
    if not 1 <= stride <= L:
        raise ConfigError(f"--stride {stride} must be in 1..{L} (the model's context, model.seq_len)")
    tok = scorer.tokenizer
    ids = [tok.encode(d) for d in docs]
    n_tokens = sum(len(t) for t in ids)
    n_words = sum(len(d.split()) for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    out = {"documents": len(docs), "tokens": n_tokens, "words": n_words, "bytes": n_bytes, "seq_len": L,
           "stride": stride}
    layouts = {"": stride, "_nonoverlapping": L}
    done: dict[int, float] = {}
    for suffix, s in layouts.items():
        if s not in done:
            scored = scorer.score_windows([windows(t, tok.eod_id, L, s) for t in ids], desc=f"perplexity (stride {s})")
            done[s] = -float(sum(x.sum() for x in scored))
        nll = done[s]
        out[f"perplexity{suffix}"] = _exp(nll / max(n_tokens, 1))
        out[f"word_perplexity{suffix}"] = _exp(nll / max(n_words, 1))
        out[f"bits_per_byte{suffix}"] = nll / LN2 / max(n_bytes, 1)
    out["nll"] = done[stride]
    return out


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def run_cloze(scorer: Scorer, examples: list[tuple[str, str, str]]) -> dict:
    """Last-word accuracy (whole word: every token of it greedy-correct; last token: its final token
    greedy-correct given everything before it) and the last word's perplexity exp(−mean log p(word))."""
    pairs = [encode_pair(scorer.tokenizer, ctx, word) for _, ctx, word in examples]
    results = scorer.continuation(pairs, desc="cloze")
    whole = [r[1] for r in results]
    last = [bool(r[3][-1]) for r in results]
    lls = [r[0] for r in results]
    return {"examples": len(examples), "accuracy": _mean(whole), "accuracy_whole_word": _mean(whole),
            "accuracy_last_token": _mean(last), "perplexity": _exp(-_mean(lls))}


def run_choice(scorer: Scorer, examples: list[tuple[str, str, list[str], int]]) -> dict:
    """Accuracy: the choice of highest log-likelihood is the label; length-normalised accuracy: the choice
    of highest log-likelihood per character of the choice."""
    pairs, owners = [], []
    for k, (_, context, choices, _) in enumerate(examples):
        for c in choices:
            pairs.append(encode_pair(scorer.tokenizer, context, joined(context, c)))
            owners.append(k)
    lls = [r[0] for r in scorer.continuation(pairs, desc="choice")]
    hits, hits_norm, at = [], [], 0
    for _, _, choices, label in examples:
        ll = np.array(lls[at:at + len(choices)])
        at += len(choices)
        lengths = np.array([len(c) for c in choices], dtype=np.float64)
        hits.append(int(np.argmax(ll)) == label)
        hits_norm.append(int(np.argmax(ll / lengths)) == label)
    return {"examples": len(examples), "accuracy": _mean(hits), "accuracy_norm": _mean(hits_norm)}


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def classify_metrics(preds: np.ndarray, gold: np.ndarray, num_labels: int) -> dict:
    """Accuracy and macro F1 (the mean over classes present in the gold labels or the predictions of
    2·TP / (2·TP + FP + FN))."""
    from meshlm.models.bert import macro_f1

    tp = [int(((preds == c) & (gold == c)).sum()) for c in range(num_labels)]
    fp = [int(((preds == c) & (gold != c)).sum()) for c in range(num_labels)]
    fn = [int(((preds != c) & (gold == c)).sum()) for c in range(num_labels)]
    return {"examples": len(gold), "accuracy": float((preds == gold).mean()), "f1": macro_f1(tp, fp, fn)}
