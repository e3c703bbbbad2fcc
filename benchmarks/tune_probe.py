#!/usr/bin/env python3
"""What the frozen base knows about the play task, and what an input-side prompt would have to change.

    .venv/bin/python benchmarks/tune_probe.py [--checkpoint runs/gpt-tiny] [--data runs/tune-task2/data]
    .venv/bin/python benchmarks/tune_probe.py --smoke   # a tiny random GPT, 4 + 2 passages a play, 20 probe steps

Two measurements on the task of `scripts/make_play_task.py` (the data `benchmarks/tune_task.py` writes):

1. **Where the zero-shot loss sits**: the base's mean loss (nats) on the answer's first token (right after
   "Play:"), on the title's later tokens, and on the end-of-document token after it, with the base's
   top next tokens after "Play:".
2. **Is the play in the base's hidden states?** A linear probe (8-way logistic regression, standardised
   features, L2 1e-3, Adam, 500 full-batch steps) trained on the final-norm hidden state of the training
   rows and scored on the validation rows: the state at the last input position (where the answer is
   predicted), the mean over the input's positions, and both.

A probe well above chance means the base holds the answer; prompt tuning and p-tuning can only reach it by
changing what the frozen layers compute from an extra input, while LoRA and fine-tuning change the layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script
from make_play_task import TITLES, make_task
from smoke import add_smoke_flag, tiny_checkpoint

from meshlm.data.tokenizers import get_tokenizer


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@torch.no_grad()
def loss_parts(model, tok, rows: list[dict]) -> tuple[dict[str, float], list[str]]:
    first, later, end, top = [], [], [], []
    for r in rows:
        # the rows as `meshlm tune` builds them (meshlm/tune/data.py): the prompt's tokens, no leading eod
        prompt, answer = tok.encode(r["input"]), tok.encode(r["output"]) + [tok.eod_id]
        logp = torch.log_softmax(model(torch.tensor([prompt + answer]))[0].float(), -1)
        nats = [-float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(answer)]
        first.append(nats[0])
        later += nats[1:-1]
        end.append(nats[-1])
        if not top:
            top = [tok.decode([i]) for i in logp[len(prompt) - 1].topk(8).indices.tolist()]
    mean = lambda xs: sum(xs) / len(xs)
    return {"first title token": mean(first), "later title tokens": mean(later), "end of document": mean(end)}, top


@torch.no_grad()
def features(model, tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    names = list(TITLES)
    xs, ys = [], []
    for r in rows:
        h = model.norm(model.run_layers(model.embed(torch.tensor([tok.encode(r["input"])]))))[0]
        xs.append(torch.cat([h[-1], h.mean(0)]))
        ys.append(names.index(r["play"]))
    return torch.stack(xs), torch.tensor(ys)


def probe(xt, yt, xv, yv, steps: int = 500) -> float:
    mu, sd = xt.mean(0), xt.std(0) + 1e-6
    w = torch.zeros(xt.shape[1], len(TITLES), requires_grad=True)
    b = torch.zeros(len(TITLES), requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy((xt - mu) / sd @ w + b, yt) + 1e-3 * w.pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((((xv - mu) / sd @ w + b).argmax(1) == yv).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/gpt-tiny")
    ap.add_argument("--data", default="runs/tune-task2/data", help="train.jsonl and valid.jsonl of the task")
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint = str(tiny_checkpoint(Path(tmp) / "tiny", n_layers=1, hidden_size=32, n_heads=2))
            args.data = str(Path(tmp) / "data")
            make_task(args.data, train_per_play=4, valid_per_play=2)
            return report(args, probe_steps=20)
    return report(args)


def report(args: argparse.Namespace, probe_steps: int = 500) -> int:
    """Both measurements for `args.checkpoint` on the task in `args.data`."""
    torch.manual_seed(0)
    model, _, cfg = load_run(str(ROOT / args.checkpoint))
    model.eval()
    tok = get_tokenizer(cfg.data.tokenizer)
    data = ROOT / args.data
    train, valid = rows_of(data / "train.jsonl"), rows_of(data / "valid.jsonl")
    parts, top = loss_parts(model, tok, valid)
    print(f"zero-shot loss on the answer, {len(valid)} validation rows (nats per token):")
    for name, value in parts.items():
        print(f"  {name}: {value:.2f}")
    print(f"  the base's top next tokens after 'Play:': {top}")
    (xt, yt), (xv, yv) = features(model, tok, train), features(model, tok, valid)
    h = xt.shape[1] // 2
    print(f"linear probe for the play ({len(train)} training rows, {len(valid)} validation rows; chance "
          f"{1 / len(TITLES):.3f}):")
    for name, cols in (("last input position", slice(0, h)), ("mean over the input", slice(h, 2 * h)),
                       ("both", slice(0, 2 * h))):
        print(f"  {name}: accuracy {probe(xt[:, cols], yt, xv[:, cols], yv, probe_steps):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
