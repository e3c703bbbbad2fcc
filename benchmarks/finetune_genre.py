"""Genre classification (comedy / history / tragedy) of Shakespeare passages from held-out plays: what a
fine-tuned BERT reaches beside two baselines.

    python benchmarks/finetune_genre.py --base runs/bert-tiny [--base OTHER ...] [--random-base]
    python benchmarks/finetune_genre.py --smoke    # 4 + 2 passages a genre, one epoch from a tiny random BERT

The task is `scripts/make_genre_task.py`'s (First Folio genres, passages of 4 spoken lines, validation
on 9 plays never trained on; by default 200 training and 100 validation passages per genre, so the
classes are balanced and the majority class scores 1/3). Every model reads at most `--max-length` tokens
of a passage (64 by default, [CLS] and [SEP] included: the median passage is 45 WordPiece tokens, 1 in 100
is longer than 71, the longest 86). Rows, each scored on the same validation set:

- `majority class`: the most frequent training label for every passage.
- `MiniLM embeddings + logistic regression`: the real all-MiniLM-L6-v2 weights (bundled,
  `meshlm.data.assets.minilm_dir()`) through transformers' BertModel, frozen; mean pooling over the real
  tokens and unit length, as sentence-transformers does; then a multinomial logistic regression written in
  torch (L-BFGS on the mean cross-entropy plus an L2 penalty of `--l2`, scikit-learn's C = 1 by default),
  fixed seed. A strong baseline: MiniLM was trained on a billion sentence pairs.
- `meshlm finetune (BASE)`: `meshlm finetune --task classify` from each `--base` checkpoint (a run
  directory, e.g. of `meshlm train --config bert-tiny`), with its defaults (3 epochs, lr 1e-4, batches of
  32; `--finetune-args` adds or overrides any); the metrics of the last evaluation (no picking the best
  epoch on the validation set).
- `--random-base`: the same fine-tuning from a randomly initialised model of the first base's shape: what
  the base's pretraining is worth.

Accuracy and macro F1 (the mean over the three classes of 2·TP / (2·TP + FP + FN)) for every row; the
baselines' are computed here, the fine-tuned rows' read from DIR/metrics.jsonl (computed by the losses in
`models/bert.py`). Run times are wall-clock on this machine, including data encoding and model loading.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from smoke import add_smoke_flag, tiny_checkpoint  # benchmarks/smoke.py, beside this script

from meshlm.models.bert import class_counts, macro_f1

ROOT = Path(__file__).resolve().parent.parent


def _genre_module():
    """scripts/make_genre_task.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_genre_task", ROOT / "scripts" / "make_genre_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_genre_task = _genre_module()


def read(path: Path) -> tuple[list[str], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["text"] for r in rows], [make_genre_task.GENRES.index(r["label"]) for r in rows]


def scores(pred: torch.Tensor, gold: torch.Tensor) -> tuple[float, float]:
    n, correct, tp, fp, fn = class_counts(pred, gold, len(make_genre_task.GENRES))
    return float(correct / n), macro_f1(tp.tolist(), fp.tolist(), fn.tolist())


def majority(train_y: list[int], valid_y: list[int]) -> tuple[float, float]:
    top = max(set(train_y), key=train_y.count)
    return scores(torch.full((len(valid_y),), top), torch.tensor(valid_y))


@torch.no_grad()
def minilm_embeddings(texts: list[str], max_length: int, batch: int = 64) -> torch.Tensor:
    from transformers import AutoTokenizer, BertModel

    from meshlm.data.assets import minilm_dir
    from meshlm.models.bert import mean_pool

    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = BertModel.from_pretrained(str(minilm_dir())).eval()
    out = []
    for s in range(0, len(texts), batch):
        enc = tok(texts[s:s + batch], padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        out.append(torch.nn.functional.normalize(mean_pool(hidden, enc["attention_mask"]), dim=-1))
    return torch.cat(out)


def logistic_regression(x: torch.Tensor, y: torch.Tensor, classes: int, l2: float, seed: int = 0) -> torch.nn.Linear:
    """Multinomial logistic regression: min mean CE(x W^T + b, y) + l2/2 · ||W||², by L-BFGS."""
    torch.manual_seed(seed)
    head = torch.nn.Linear(x.shape[1], classes).double()
    x = x.double()
    opt = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=500, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), y) + 0.5 * l2 * head.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head


def random_base(like: str, out: Path) -> Path:
    """A fresh model of the base's shape and tokenizer, saved as a run directory."""
    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.models.bert import BERT

    cfg = open_checkpoint(like).config
    torch.manual_seed(cfg.train.seed)
    model = BERT(cfg.model)
    save_checkpoint(out, 0, {"model": model.state_dict(), "optim": torch.optim.AdamW(model.parameters()).state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())
    return out


def finetune(base: str, data: Path, out: Path, max_length: int, extra: list[str]) -> tuple[float, float, float]:
    from meshlm.checkpoint.load import open_checkpoint

    max_length = min(max_length, open_checkpoint(base).config.model.seq_len)
    meshlm = Path(sys.executable).parent / "meshlm"
    cmd = [str(meshlm) if meshlm.exists() else sys.executable, *([] if meshlm.exists() else ["-m", "meshlm"]),
           "finetune", "--checkpoint", base, "--task", "classify", "--train", str(data / "train.jsonl"), "--valid",
           str(data / "valid.jsonl"), "--out", str(out), "--max-length", str(max_length), "--truncate",
           "--train.progress=false", "--train.save_every=0", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"meshlm finetune failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    last = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"][-1]
    return last["val_accuracy"], last["val_f1"], time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", action="append", default=[], help="a BERT run directory to fine-tune (repeatable)")
    ap.add_argument("--random-base", action="store_true", help="also fine-tune a random model of the first base's shape")
    ap.add_argument("--train-per-class", type=int, default=200)
    ap.add_argument("--valid-per-class", type=int, default=100)
    ap.add_argument("--max-length", type=int, default=64,
                    help="tokens per passage, [CLS] and [SEP] included (default 64, at most the base's model.seq_len)")
    ap.add_argument("--l2", type=float, default=None, help="logistic regression's L2 weight (default 1/n_train)")
    ap.add_argument("--finetune-args", default="", help="more arguments for meshlm finetune, e.g. '--epochs 5'")
    ap.add_argument("--keep", metavar="DIR", help="keep the data and the runs in DIR (default: a temporary one)")
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.random_base and not args.base:
        ap.error("--random-base needs a --base (it copies its shape)")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="finetune_genre_"))
    if args.smoke:  # a tiny random BERT of bert-tiny's vocabulary, one epoch
        base = tiny_checkpoint(work / "tiny-bert", "bert-tiny", n_layers=1, hidden_size=32, n_heads=2, seq_len=32)
        args.base, args.train_per_class, args.valid_per_class, args.max_length = [str(base)], 4, 2, 32
        args.finetune_args += " --epochs 1"
    data = work / "genre"
    summary = make_genre_task.make_task(data, args.train_per_class, args.valid_per_class)
    (train_x, train_y), (valid_x, valid_y) = read(data / "train.jsonl"), read(data / "valid.jsonl")
    print(f"task: {len(train_x)} training passages, {len(valid_x)} validation passages from held-out plays "
          f"({', '.join(p for ps in summary['valid_plays'].values() for p in ps)}); torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    rows = []
    t = time.perf_counter()
    rows.append(("majority class", *majority(train_y, valid_y), time.perf_counter() - t))
    t = time.perf_counter()
    emb = minilm_embeddings(train_x + valid_x, args.max_length)
    head = logistic_regression(emb[:len(train_x)], torch.tensor(train_y), 3,
                               args.l2 if args.l2 is not None else 1.0 / len(train_x))
    pred = head(emb[len(train_x):].double()).argmax(-1)
    rows.append(("MiniLM embeddings + logistic regression", *scores(pred, torch.tensor(valid_y)),
                 time.perf_counter() - t))
    print(f"baselines done ({rows[-1][3]:.0f} s for MiniLM)", flush=True)
    extra = args.finetune_args.split()
    bases = [(f"meshlm finetune ({b})", b) for b in args.base]
    if args.random_base:
        bases.append(("meshlm finetune (random init, same shape)", str(random_base(args.base[0], work / "random"))))
    for i, (label, base) in enumerate(bases):
        rows.append((label, *finetune(base, data, work / f"ft{i}", args.max_length, extra)))
        print(f"{label} done ({rows[-1][3]:.0f} s)", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'method':<{width}} | accuracy | macro F1 | time")
    print(f"{'-' * width}-|----------|----------|------")
    for name, acc, f1, secs in rows:
        print(f"{name:<{width}} | {acc:8.3f} | {f1:8.3f} | {secs:4.0f} s")
    if args.keep:
        print(f"\ndata and runs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
