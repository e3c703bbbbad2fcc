"""BERT-tiny pretraining quality: held-out MLM accuracy and perplexity against the unigram baseline.

    .venv/bin/meshlm train --config bert-tiny --train.out_dir=runs/bert-tiny
    .venv/bin/python benchmarks/bert_pretrain.py --run runs/bert-tiny
    .venv/bin/python benchmarks/bert_pretrain.py --smoke    # a 2-step run of a tiny bert-tiny, made here

The unigram baseline predicts every masked token from the training split's masked-token frequencies
alone (no context): its accuracy is the share of held-out masked tokens equal to the most frequent
training label, its perplexity exp of the cross-entropy of the held-out labels under those frequencies
(add-one smoothing). Both are computed on exactly the samples the trainer evaluates (the validation
split's first `eval_iters` micro-batches, same seed), and printed beside the run's last evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import numpy as np
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

from meshlm.checkpoint.files import load_config_dict
from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.core.config import config_from_dict
from meshlm.data.bert_build import build_bert_datasets


def masked_labels(dataset, n_samples: int) -> np.ndarray:
    T = dataset.collate(np.stack([np.asarray(dataset[0])]))[0].shape[-1]
    labels = [np.asarray(dataset[i])[3 * T:4 * T] for i in range(min(n_samples, len(dataset)))]
    flat = np.concatenate(labels)
    return flat[flat >= 0]


def tiny_run(out: Path) -> Path:
    """A 2-step `meshlm train --config bert-tiny` run of a tiny width, evaluated at its end (for --smoke)."""
    from meshlm.core.config import load_config
    from meshlm.train.trainer import Trainer

    cfg = load_config("bert-tiny", [
        "--model.n_layers=1", "--model.hidden_size=32", "--model.n_heads=2", "--model.seq_len=32",
        "--train.max_steps=2", "--train.micro_batch_size=2", "--train.global_batch_size=2", "--train.eval_every=2",
        "--train.eval_iters=1", "--train.progress=false", f"--train.out_dir={out}"])
    Trainer(cfg, progress=False).run()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a `meshlm train --config bert-tiny` run directory")
    parser.add_argument("--train-samples", type=int, default=20000, help="training samples counted for frequencies")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.run, args.train_samples = str(tiny_run(Path(tmp) / "bert-tiny")), 64
            report(args)
        return
    if not args.run:
        parser.error("--run is required (a `meshlm train --config bert-tiny` run directory)")
    report(args)


def report(args: argparse.Namespace) -> None:
    """The table for the run directory `args.run`."""
    run = Path(args.run)
    cfg = config_from_dict(load_config_dict(resolve_checkpoint(run)))
    _, train, valid = build_bert_datasets(cfg)
    t = cfg.train
    n_eval = min(t.eval_iters, max(1, len(valid) // t.micro_batch_size)) * min(t.micro_batch_size, len(valid))
    train_labels = masked_labels(train, args.train_samples)
    valid_labels = masked_labels(valid, n_eval)
    counts = np.bincount(train_labels, minlength=cfg.model.vocab_size).astype(np.float64)
    top = int(counts.argmax())
    probs = (counts + 1) / (counts.sum() + len(counts))
    uni_acc = float((valid_labels == top).mean())
    uni_ppl = math.exp(-float(np.log(probs[valid_labels]).mean()))
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    last = evals[-1]
    print(f"held-out masked tokens: {len(valid_labels):,} (from {n_eval} samples); training counts from "
          f"{len(train_labels):,}")
    print("| model | MLM accuracy | MLM perplexity | SOP accuracy |")
    print("|---|---|---|---|")
    print(f"| unigram (most frequent: id {top}) | {uni_acc:.3f} | {uni_ppl:,.1f} | 0.500 |")
    print(f"| {run.name}, step {last['step']} | {last['val_mlm_acc']:.3f} | {last['val_mlm_ppl']:,.1f} | "
          f"{last['val_sop_acc']:.3f} |")
    print(f"ratio of MLM accuracy to the unigram baseline: {last['val_mlm_acc'] / uni_acc:.2f}x")


if __name__ == "__main__":
    main()
