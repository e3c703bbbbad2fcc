"""Shared by the evaluation tests: stub models with logits known by construction, a character tokenizer,
a tiny saved GPT checkpoint, and brute-force per-token scoring to compare the batched paths with."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import build
from meshlm.models.gpt import GPT

ALPHABET = "ab c\n"  # ids 0..4; the end-of-document token is 5


class CharTokenizer:
    """One token per character of ALPHABET; eod = len(ALPHABET)."""

    name = "chars"
    vocab_size = len(ALPHABET) + 1
    eod_id = len(ALPHABET)

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i] if i < len(ALPHABET) else "" for i in ids)


class UnigramModel(nn.Module):
    """The same logits at every position: log p(token) = log(probs[token]), whatever the context."""

    def __init__(self, probs: list[float]):
        super().__init__()
        self.register_buffer("logits", torch.log(torch.tensor(probs, dtype=torch.float64)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(*x.shape, -1).clone()


class ContextModel(nn.Module):
    """Logits that depend on the current token, the one before it in the window and the position in the
    window, so that how much context a token gets changes its score."""

    def __init__(self, vocab: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("cur", torch.randn(vocab, vocab, generator=g, dtype=torch.float64))
        self.register_buffer("prev", torch.randn(vocab, vocab, generator=g, dtype=torch.float64))
        self.register_buffer("pos", torch.randn(64, vocab, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        has_prev = (torch.arange(x.shape[1]) > 0).to(torch.float64)[None, :, None]
        return self.cur[x] + has_prev * self.prev[prev] + self.pos[: x.shape[1]][None]


def last_logprob(model: nn.Module, context: list[int], target: int) -> float:
    """log p(target | context), the model run on exactly `context` (brute force, one position)."""
    with torch.no_grad():
        logits = model(torch.tensor([context]))[0, -1].double()
    return float(torch.log_softmax(logits, -1)[target])


def save_tiny_gpt(out: Path, seq_len: int = 32, seed: int = 0, n_layers: int = 2, hidden: int = 64) -> Path:
    """A GPT (gpt2 tokenizer) with spread-out random weights, saved as a one-process checkpoint of run dir `out`.
    A large init_std makes the predictions confident, so greedy choices are not near-ties."""
    cfg = build({"model": {"vocab_size": 50257, "n_layers": n_layers, "hidden_size": hidden, "n_heads": 4,
                           "seq_len": seq_len, "init_std": 0.2, "dropout": 0.0},
                 "train": {"out_dir": str(out), "progress": False, "peak_tflops": 1.0},
                 "data": {"tokenizer": "gpt2"}})
    torch.manual_seed(seed)
    model = GPT(cfg.model)
    optim = torch.optim.AdamW(model.parameters())
    save_checkpoint(out, 0, {"model": model.state_dict(), "optim": optim.state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def close(a: float, b: float, tol: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=tol, abs_tol=tol)


class BigramModel(nn.Module):
    """p(next | current) from a table: after token i the most likely next token is GREEDY[i] (.6), every
    other one has .08; the rest of the context does not matter."""

    GREEDY: ClassVar[dict[int, int]] = {0: 1, 1: 2, 2: 0, 3: 2, 4: 3, 5: 0}  # a→b, b→' ', ' '→a, c→' ', '\n'→c, eod→a

    def __init__(self, vocab: int = len(ALPHABET) + 1):
        super().__init__()
        table = torch.full((vocab, vocab), 0.08, dtype=torch.float64)
        for cur, nxt in self.GREEDY.items():
            table[cur, nxt] = 0.6
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.table[x])

    def prob(self, cur: str, nxt: str) -> float:
        return float(self.table[ALPHABET.index(cur), ALPHABET.index(nxt)])


PROMPTS = ["To be, or not to be", "Now is the winter of our", "Friends, Romans, countrymen", "All the world's a",
           "The quality of mercy is not", "If music be the food of love", "Once more unto the breach, dear",
           "What light through yonder window", "We few, we happy few", "A horse! a horse!"]


def make_task_files(checkpoint: Path, out: Path) -> dict[str, Path]:
    """Task files for the tiny model: cloze passages = prompt + 6 greedily generated tokens (so some last words
    are the model's own predictions), choices among those passages, and a text for perplexity."""
    from tests.checkpoint_helpers import load_run

    model, tok, _ = load_run(str(checkpoint))
    texts = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok.encode(p)
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            texts.append(tok.decode(ids))
    cloze = write_jsonl(out / "cloze.jsonl", [{"text": t} for t in texts])
    rows = []
    for k, p in enumerate(PROMPTS):
        own = texts[k][len(p):]
        others = [texts[(k + j) % len(texts)][len(PROMPTS[(k + j) % len(texts)]):] for j in (1, 2, 3)]
        choices = [c.strip() or "x" for c in (others[:k % 3] + [own] + others[k % 3:])]
        rows.append({"context": p, "choices": choices, "label": k % 3})
    choice = write_jsonl(out / "choice.jsonl", rows)
    text = out / "text.txt"
    text.write_text("\n".join(texts) * 2 + "\n")
    return {"cloze": cloze, "choice": choice, "perplexity": text}
