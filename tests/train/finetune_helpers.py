"""Shared by the fine-tuning tests: a tiny BERT base checkpoint and small synthetic tasks in real words
(BERT's WordPiece tokenizer), each learnable in a few dozen steps."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import build
from meshlm.models.bert import BERT
from meshlm.models.gpt import GPT

GROUPS = {"animal": ["cat", "dog", "horse", "cow", "sheep"], "colour": ["red", "blue", "green", "yellow", "black"],
          "number": ["one", "two", "three", "four", "five"]}
FILLER = ["the", "a", "and", "of", "saw", "with", "near", "then", "was", "by"]
BERT_VOCAB = 30522
# Quiet, short and measured-free runs: the knobs every fine-tuning test passes.
QUIET = ["--train.progress=false", "--train.peak_tflops=1", "--train.save_every=0"]


def tiny_model(family: str = "bert", seq_len: int = 16, dropout: float = 0.1) -> dict:
    model = {"family": family, "vocab_size": BERT_VOCAB, "n_layers": 2, "hidden_size": 32, "n_heads": 4,
             "seq_len": seq_len, "dropout": dropout}
    if family == "bert":
        model.update(bert_head="pretrain", activation="gelu_exact", norm_eps=1e-12)
    return model


def save_base(out: Path, family: str = "bert", seq_len: int = 16, dropout: float = 0.1, seed: int = 0) -> Path:
    """A freshly initialised model saved as a one-process checkpoint of run directory `out` (what a
    pretraining run leaves; fine-tuning reads its weights and config)."""
    cfg = build({"model": tiny_model(family, seq_len, dropout),
                 "train": {"out_dir": str(out), "progress": False, "peak_tflops": 1.0},
                 "data": {"tokenizer": "bert" if family == "bert" else "gpt2"}})
    torch.manual_seed(seed)
    model = (BERT if family == "bert" else GPT)(cfg.model)
    optim = torch.optim.AdamW(model.parameters())
    save_checkpoint(out, 0, {"model": model.state_dict(), "optim": optim.state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def classify_rows(n: int, seed: int) -> list[dict]:
    """Four filler words and three words of one group; the label is the group's name."""
    rng = random.Random(seed)
    names = sorted(GROUPS)
    rows = []
    for _ in range(n):
        name = rng.choice(names)
        words = [rng.choice(FILLER) for _ in range(4)] + [rng.choice(GROUPS[name]) for _ in range(3)]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": name})
    return rows


def tokens_rows(n: int, seed: int) -> list[dict]:
    """Words tagged by their group: 0 filler, 1 animal, 2 colour, 3 number."""
    rng = random.Random(seed)
    pools = [FILLER, GROUPS["animal"], GROUPS["colour"], GROUPS["number"]]
    rows = []
    for _ in range(n):
        tags = [rng.randrange(4) for _ in range(rng.randint(4, 8))]
        rows.append({"tokens": [rng.choice(pools[t]) for t in tags], "labels": tags})
    return rows


def span_rows(n: int, seed: int) -> list[dict]:
    """A context of filler words and animal names with one colour in it; the answer is the colour."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = [rng.choice(FILLER + GROUPS["animal"]) for _ in range(rng.randint(5, 8))]
        at = rng.randrange(len(words) + 1)
        colour = rng.choice(GROUPS["colour"])
        words.insert(at, colour)
        context = " ".join(words)
        start = len(" ".join(words[:at])) + (1 if at else 0)
        rows.append({"question": "which colour?", "context": context,
                     "answers": {"text": [colour], "answer_start": [start]}})
    return rows


def eval_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]
