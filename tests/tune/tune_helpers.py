"""Shared by the tuning tests: tiny GPT bases (GPT-2 and Llama style, the GPT-2 tokenizer) saved as
one-process checkpoints, and a small task in words that a few steps of tuning learn."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import torch

from meshlm.checkpoint.single import save_checkpoint
from meshlm.core.config import build
from meshlm.models.gpt import GPT

VOCAB = 50257
QUIET = ["--train.progress=false", "--train.peak_tflops=1", "--train.save_every=0"]
GPT2 = {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 32, "dropout": 0.0}
LLAMA = {**GPT2, "n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
         "tie_embeddings": False, "ffn_hidden_size": 64}
WORDS = ["red", "blue", "green", "gold"]


def base_config(out: Path, model: dict | None = None):
    return build({"model": {"family": "gpt", "vocab_size": VOCAB, **(model or GPT2)},
                  "train": {"out_dir": str(out), "progress": False, "peak_tflops": 1.0}, "data": {"tokenizer": "gpt2"}})


def save_base(out: Path, model: dict | None = None, seed: int = 0) -> Path:
    """A freshly initialised GPT saved as run directory `out` (what a pretraining run leaves)."""
    cfg = base_config(out, model)
    torch.manual_seed(seed)
    gpt = GPT(cfg.model)
    save_checkpoint(out, 0, {"model": gpt.state_dict(), "optim": torch.optim.AdamW(gpt.parameters()).state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def repeat_rows(n: int, seed: int) -> list[dict]:
    """`{"input", "output"}`: repeat the colour named in the input."""
    rng = random.Random(seed)
    return [{"input": f"say {w}:", "output": f" {w}"} for w in (rng.choice(WORDS) for _ in range(n))]


def task_rows(n: int, seed: int) -> list[dict]:
    """Two tasks for templates: `first` answers the first word, `last` the last one."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        task = ("first", "last")[i % 2]
        rows.append({"taskname": task, "a": a, "b": b, "answer": a if task == "first" else b})
    return rows


def metrics(run: Path, kind: str = "train") -> list[dict]:
    return [r for r in (json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics(run)]


def run(*argv: str) -> tuple[int, str, str]:
    """`meshlm ARGV` in this process: (exit code, stdout, stderr)."""
    from meshlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()
