#!/usr/bin/env python3
"""Zero-shot vs prompt tuning vs p-tuning vs LoRA vs full fine-tuning of the default GPT checkpoint on a task
from the bundled corpus: which of eight plays is a passage from? (`scripts/make_play_task.py`.)

    .venv/bin/python benchmarks/tune_task.py [--checkpoint runs/demo] [--work runs/tune-task] [--epochs 3]
                                             [--max-length 96] [--methods prompt,ptuning,lora,full]
                                             [--extra "METHOD=--key=value ..."]
    .venv/bin/python benchmarks/tune_task.py --smoke   # a tiny random base, 4 + 2 passages a play, one epoch of
                                                       # prompt tuning

The base is `make demo`'s run (`meshlm train --config demo`; trained here first if it is missing).
Each method is one `meshlm tune` command (printed), with its defaults but the epochs and what `--extra`
adds to that method's command (repeatable). Accuracy: the
validation passage's answer is the title with the highest log-likelihood (summed over the title's tokens
and the end-of-document token after it, as the tuning loss counts them) among the eight, scored with the
base plus the adapter (or the fine-tuned model); zero-shot scores the base on the same rows, laid out as
LoRA's and full fine-tuning's are (the passage, "Play:", nothing before them). Also: greedy exact match (the
title generated token by token), trainable parameters, optimizer state (from the run's log), median
step time. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script
from make_play_task import ANSWERS, make_task, outputs
from smoke import add_smoke_flag, tiny_checkpoint

from meshlm.checkpoint.load import open_checkpoint
from meshlm.data.tokenizers import get_tokenizer
from meshlm.tune.export import apply_adapter, read_adapter

METHODS = ("prompt", "ptuning", "lora", "full")


def run(cmd: list[str], log: Path) -> str:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, check=False)
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    return text


@torch.no_grad()
def score(model, tok, rows: list[dict], head: list[int], batch: int = 64,
          answers: dict[str, str] | None = None, calibrated: list | None = None) -> tuple[float, float]:
    """(accuracy by the highest-likelihood answer, greedy exact match of the answer); `answers`: play → the
    output string (`make_play_task.outputs`, titles by default). `calibrated`, a list, gets the accuracy
    with each answer's mean score over the rows subtracted first (a diagnostic, not a method)."""
    answers = answers or outputs("title")
    titles = [tok.encode(t) + [tok.eod_id] for t in answers.values()]
    names = list(answers)
    seqs = [(head + tok.encode(row["input"]), title) for row in rows for title in titles]
    scores = torch.empty(len(seqs))
    greedy = torch.zeros(len(seqs), dtype=torch.bool)  # every title token (and the end) is the argmax
    for s in range(0, len(seqs), batch):
        chunk = seqs[s:s + batch]
        T = max(len(p) + len(t) for p, t in chunk)
        ids = torch.full((len(chunk), T), tok.eod_id)
        for k, (p, t) in enumerate(chunk):
            ids[k, :len(p) + len(t)] = torch.tensor(p + t)
        hidden = model.run_layers(model.embed(ids))  # the output layer only where a title token is predicted
        for k, (p, t) in enumerate(chunk):
            pos, want = torch.arange(len(p) - 1, len(p) + len(t) - 1), torch.tensor(t)
            logits = model.head(hidden[k, pos]).float()
            scores[s + k] = torch.log_softmax(logits, -1)[torch.arange(len(t)), want].sum()
            greedy[s + k] = bool((logits.argmax(-1) == want).all())
    table = scores.view(len(rows), len(titles))
    picked = table.argmax(1)
    accuracy = sum(names[int(picked[i])] == row["play"] for i, row in enumerate(rows)) / len(rows)
    exact = sum(bool(greedy[i * len(titles) + names.index(row["play"])]) for i, row in enumerate(rows))
    if calibrated is not None:  # each answer's mean score over the rows taken off: what the scores know
        fair = (table - table.mean(0)).argmax(1)  # beyond the answers' priors
        calibrated.append(sum(names[int(fair[i])] == row["play"] for i, row in enumerate(rows)) / len(rows))
    return accuracy, exact / len(rows)


def run_stats(out: Path, log: str) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_time_s"] for r in rows if r["kind"] == "train"][1:]  # the first window holds the warm-up
    mem = re.search(r"optimizer ([\d.]+) = ", log)
    trainable = re.search(r"tune: .*?: ([\d,]+) adapter parameters", log)
    return {"step_s": statistics.median(steps) if steps else float("nan"),
            "optim_mib": float(mem.group(1)) if mem else float("nan"),
            "trainable": int(trainable.group(1).replace(",", "")) if trainable else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/demo")
    ap.add_argument("--work", default="runs/tune-task")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-length", type=int, default=96, help="tokens per row (the longest example + 10 virtual)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--answer", choices=sorted(ANSWERS), default="title",
                    help="the play's title (default) or its most frequent speaker (scripts/make_play_task.py)")
    ap.add_argument("--extra", action="append", default=[], metavar="METHOD=ARGS",
                    help='more arguments for one method\'s command, e.g. "prompt=--optim.lr=0.1"')
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.work, args.epochs, args.methods, args.extra = tmp, 1, "prompt", ["prompt=--train.peak_tflops=1"]
            args.checkpoint = str(tiny_checkpoint(Path(tmp) / "base", n_layers=1, hidden_size=32, n_heads=2))
            return run_all(args, sizes={"train_per_play": 4, "valid_per_play": 2})
    return run_all(args)


def run_all(args: argparse.Namespace, sizes: dict | None = None) -> int:
    """Every method of `args` and the table; `sizes`: make_task's passages per play, when not its defaults."""
    py = sys.executable
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    base = ROOT / args.checkpoint
    if not (base / "checkpoints").exists():
        run([py, "-m", "meshlm", "train", "--config", "demo", f"--train.out_dir={base}", "--train.progress=false",
             "--train.sample_tokens=0"], work / "base.log")
    data = work / "data"
    make_task(data, answer=args.answer, **(sizes or {}))
    answers = outputs(args.answer)
    rows = [json.loads(x) for x in (data / "valid.jsonl").read_text().splitlines()]
    model, _, cfg = load_run(str(base))
    tok = get_tokenizer(cfg.data.tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    results = {"zero-shot": {"trainable": 0, "optim_mib": 0.0, "step_s": float("nan")}}
    calibrated: list[float] = []
    results["zero-shot"]["accuracy"], results["zero-shot"]["exact"] = score(model.eval(), tok, rows, [],
                                                                            answers=answers, calibrated=calibrated)
    print(f"zero-shot: accuracy {results['zero-shot']['accuracy']:.3f} (calibrated: {calibrated[0]:.3f}, each "
          "answer's mean score over the rows taken off)", flush=True)
    extra = {}
    for item in args.extra:
        method, _, more = item.partition("=")
        extra.setdefault(method, []).extend(more.split())
    for method in [m for m in args.methods.split(",") if m]:  # --methods "": zero-shot alone
        out = work / method
        cmd = [py, "-m", "meshlm", "tune", "--checkpoint", str(base), "--method", method, "--train",
               str(data / "train.jsonl"), "--valid", str(data / "valid.jsonl"), "--out", str(out), "--epochs",
               str(args.epochs), "--max-length", str(args.max_length), "--train.progress=false", "--train.resume=never",
               *extra.get(method, [])]
        log = run(cmd, work / f"{method}.log")
        stats = run_stats(out, log)
        if method == "full":
            tuned, _, _ = load_run(str(out))
            stats["trainable"] = n_params
            head = []
        else:
            adapter = read_adapter(out, cfg, open_checkpoint(str(base)))
            tuned = apply_adapter(load_run(str(base))[0], cfg, adapter)
            head = [0] * adapter.virtual_tokens
        stats["accuracy"], stats["exact"] = score(tuned.eval(), tok, rows, head, answers=answers)
        results[method] = stats
        print(f"{method}: accuracy {stats['accuracy']:.3f}", flush=True)
    print(f"\nbase {args.checkpoint}: {n_params:,} parameters; task: {len(rows)} validation passages of 8 plays "
          "(chance 0.125)")
    print("| method | accuracy (best of 8 answers) | greedy exact match | trainable parameters | optimizer state "
          "| step time (median) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        share = f"{r['trainable']:,} ({100 * r['trainable'] / n_params:.2f}%)" if r["trainable"] is not None else "?"
        step = f"{r['step_s'] * 1000:.0f} ms" if r["step_s"] == r["step_s"] else "-"
        print(f"| {name} | {r['accuracy']:.3f} | {r['exact']:.3f} | {share} | {r['optim_mib']:.2f} MiB | {step} |")
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
