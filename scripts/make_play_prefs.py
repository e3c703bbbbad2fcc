#!/usr/bin/env python3
"""Preference pairs from the play task (`make_play_task.py`): the right answer preferred over a wrong one.

    python scripts/make_play_prefs.py --plays data/plays --out data/plays-prefs   # train.jsonl, valid.jsonl

Each line of the play task, `{"input", "output", "play"}`, becomes `{"prompt": input, "chosen": output,
"rejected": the answer of another play}` (`meshlm align`'s format, docs/align.md), the other play drawn
with `--seed`; `--train-pairs` and `--valid-pairs` keep that many lines of each file (drawn with the same
seed, in file order; default: all). The output is a function of the arguments and the input files only.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def pairs(lines: list[dict], rng: random.Random, keep: int | None) -> list[dict]:
    if keep is not None and keep < len(lines):
        lines = [lines[i] for i in sorted(rng.sample(range(len(lines)), keep))]
    answers = sorted({x["output"] for x in lines})
    out = []
    for x in lines:
        wrong = rng.choice([a for a in answers if a != x["output"]])
        out.append({"prompt": x["input"], "chosen": x["output"], "rejected": wrong})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plays", required=True, help="the play task's directory (train.jsonl, valid.jsonl)")
    ap.add_argument("--out", required=True, help="directory for the pairs' train.jsonl and valid.jsonl")
    ap.add_argument("--train-pairs", type=int, default=None, help="pairs kept of train.jsonl (default: all)")
    ap.add_argument("--valid-pairs", type=int, default=None, help="pairs kept of valid.jsonl (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for name, keep in (("train.jsonl", args.train_pairs), ("valid.jsonl", args.valid_pairs)):
        lines = [json.loads(t) for t in (Path(args.plays) / name).read_text().splitlines() if t.strip()]
        rows = pairs(lines, rng, keep)
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}: {len(rows)} pairs")


if __name__ == "__main__":
    main()
