#!/usr/bin/env python3
"""Build a post-training task from the bundled Shakespeare plays: answer in a character's voice with the
play's true next line (conversations for `meshlm tune`), and prefer the true line to a decoy (preference
pairs for `meshlm align`).

    python scripts/make_chat_task.py --out data/chat   # chat_{train,valid,test}.jsonl, pref_{train,valid,test}.jsonl

**Conversations** (`chat_SPLIT.jsonl`, one `{"messages": [...]}` a line). The user names the play, the act,
the scene and its place, the character the assistant plays and the one who speaks to it, then quotes the
previous `--context` speeches as the text prints them ("PROTEUS." on a line, then the speech). The assistant
answers with the character's next speech in the play. A conversation has 1 to `--max-turns` turns: a later
user turn is the other speaker's next speech, the assistant's the character's reply, as long as the scene
goes on alternating between them. A share `--system-fraction` of the conversations starts with a system
message. Speeches are cut to their first `--lines` lines; a conversation longer than `--max-chars`
characters loses turns (or is skipped). Each line also holds `play`, `speaker` and `turns`.

**Preference pairs** (`pref_SPLIT.jsonl`, `{"prompt", "chosen", "rejected"}`). The prompt is a first user
turn as above (the text of the user message); `chosen` is the character's true speech; `rejected` is a
speech of the same number of lines and comparable length (within `--length-tolerance` of the chosen's
characters where the pool has one, else the closest) either by another speaker of the same play
(`"rejected_from": "other_speaker"`) or from another play (`"other_play"`), the share of the latter
`--other-play-fraction`. `rejected_speaker` and `rejected_play` name it. Another play is drawn from the
same side of the split: a training pair's decoy from a training play, a held-out pair's from the other
held-out plays, so no held-out set holds a line of a training play.

**The split is by play.** `--valid-plays` and `--test-plays` are held out whole (default: the two works the
default GPT config never trains on, `data.split = "95,5,0"`: The Two Gentlemen of Verona for validation,
The Winter's Tale for test, so even the base has not read them); every other play of the First Folio
(36 plays, `make_genre_task.FOLIO`) is for training. Rows are drawn evenly over each split's plays with
`--seed`; the output is a function of the arguments and the corpus only. Each split draws its
conversations and pairs from one random stream, so a split's files depend on all of its size flags (a
different `--pref-train` reorders chat_train.jsonl too): to use fewer pairs, take the first N lines.
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_genre_task import ACT, INLINE_SPEAKER, OPENING, SCENE, is_speaker, play_files

VALID_PLAYS = ("two_gentlemen_of_verona",)
TEST_PLAYS = ("winters_tale",)
SYSTEM = "Stay in character: answer with your next speech in the play."
SMALL = {"of", "and", "the", "or", "to", "in", "a", "for"}
ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
ORDINAL_WORDS = {"FIRST": 1, "SECOND": 2, "THIRD": 3, "FOURTH": 4, "FIFTH": 5}


class TaskError(ValueError):
    """Arguments the corpus cannot satisfy (a play it lacks, more rows than a play has)."""


@dataclass
class Speech:
    speaker: str  # as the text prints it, without the period: "PROTEUS", "Ham", "First Lord"
    lines: list[str] = field(default_factory=list)


@dataclass
class Scene:
    act: int
    number: int
    place: str
    speeches: list[Speech] = field(default_factory=list)


def number(word: str) -> int:
    """ "IV" / "4" / "FOURTH" → 4 (0 when it is none of these)."""
    word = word.strip(". ").upper()
    if word.isdigit():
        return int(word)
    if word in ORDINAL_WORDS:
        return ORDINAL_WORDS[word]
    if not word or any(c not in ROMAN for c in word):
        return 0
    values = [ROMAN[c] for c in word]
    return sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))


def title_of(text: str) -> str:
    """The play's title from its first line, in title case: "The Two Gentlemen of Verona"."""
    first = next(line.strip() for line in text.splitlines() if line.strip())
    def word(k: int, w: str) -> str:
        if set(w.strip(",;.")) <= set(ROMAN):  # "IV", "III"
            return w
        return w.lower() if k and w.lower() in SMALL else w.capitalize()
    return " ".join(word(k, w) for k, w in enumerate(first.split()))


def display(speaker: str) -> str:
    """A speaker's name for prose: capitals in title case ("FIRST LORD" → "First Lord"), others as printed."""
    return " ".join(w.capitalize() for w in speaker.split()) if speaker.isupper() else speaker


def parse_play(text: str) -> list[Scene]:
    """The play's scenes, each with its act, number, place and speeches (stage directions removed)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if ACT.match(line.strip()) or OPENING.match(line.strip())), 0)
    out: list[Scene] = []
    act, in_direction, block_start = 0, False, True
    for raw in lines[start:]:
        line = raw.strip()
        first, block_start = block_start, not line
        if in_direction:  # a stage direction over several lines
            if "]" not in line:
                continue
            in_direction, line = False, line.split("]", 1)[1].strip()
        if "[" in line:
            if "]" not in line.split("[", 1)[1]:
                in_direction, line = True, line.split("[", 1)[0].strip()
            line = re.sub(r"\[[^\]]*\]", " ", line).strip()
        if not line:
            continue
        if ACT.match(line):
            act = number(line.split()[1])
            continue
        if SCENE.match(line):
            head, _, place = line.partition(" ")[2].partition(" ")
            out.append(Scene(act, number(head), place.strip()))
            continue
        if OPENING.match(line) or not out:
            continue
        speeches = out[-1].speeches
        if (first or line.isupper()) and is_speaker(line):
            speeches.append(Speech(re.sub(r"\s+", " ", line.rstrip("."))))
            continue
        inline = INLINE_SPEAKER.match(line) if first else None
        if inline:
            speeches.append(Speech(inline.group(0).strip().rstrip(".")))
            line = line[inline.end():]
        if speeches:
            speeches[-1].lines.append(re.sub(r"\s+", " ", line))
    for scene in out:
        scene.speeches = [s for s in scene.speeches if s.lines]
    return [s for s in out if s.speeches]


def quote(speech: Speech, n_lines: int) -> str:
    """A speech as the text prints it: the name with its period on a line, then its first lines."""
    return speech.speaker + ".\n" + text_of(speech, n_lines)


def text_of(speech: Speech, n_lines: int) -> str:
    return "\n".join(speech.lines[:n_lines])


@dataclass
class Play:
    name: str
    title: str
    scenes: list[Scene]


@functools.cache
def load_play(name: str) -> Play:
    """A play of the corpus, parsed (once per process: it is only read)."""
    text = play_files()[name].read_text(encoding="utf-8")
    return Play(name, title_of(text), parse_play(text))


def load_plays(names: list[str]) -> dict[str, Play]:
    return {name: load_play(name) for name in names}


def situation(play: Play, scene: Scene, speech: Speech, other: Speech, context: list[Speech], n_lines: int) -> str:
    """The first user message: where, who is who, and the previous speeches."""
    where = f"{play.title}. Act {scene.act}, scene {scene.number}." + (f" {scene.place}" if scene.place else "")
    who = f"You are {display(speech.speaker)}; {display(other.speaker)} speaks to you."
    return where + "\n" + who + "\n\n" + "\n\n".join(quote(s, n_lines) for s in context)


def answerable(speech: Speech, min_words: int) -> bool:
    return len(" ".join(speech.lines).split()) >= min_words


def starts(play: Play, min_words: int) -> list[tuple[int, int]]:
    """(scene, speech) positions where a character answers the speech before it (another speaker's)."""
    return [(k, i) for k, scene in enumerate(play.scenes) for i in range(1, len(scene.speeches))
            if scene.speeches[i].speaker != scene.speeches[i - 1].speaker
            and answerable(scene.speeches[i], min_words)]


def conversation(play: Play, k: int, i: int, turns: int, args: argparse.Namespace, system: bool) -> dict | None:
    """Up to `turns` turns of the character at speech i of scene k, cut to args.max_chars (None if the first
    turn alone is longer)."""
    scene = play.scenes[k]
    sp = scene.speeches
    me = sp[i].speaker
    context = sp[max(0, i - args.context):i]
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages += [{"role": "user", "content": situation(play, scene, sp[i], sp[i - 1], context, args.lines)},
                 {"role": "assistant", "content": text_of(sp[i], args.lines)}]
    for t in range(1, turns):
        j = i + 2 * t
        if j >= len(sp) or sp[j].speaker != me or sp[j - 1].speaker == me or not answerable(sp[j], args.min_words):
            break
        more = [{"role": "user", "content": quote(sp[j - 1], args.lines)},
                {"role": "assistant", "content": text_of(sp[j], args.lines)}]
        if sum(len(m["content"]) for m in messages + more) > args.max_chars:
            break
        messages += more
    if sum(len(m["content"]) for m in messages) > args.max_chars:
        return None
    n_turns = sum(m["role"] == "assistant" for m in messages)
    return {"messages": messages, "play": play.name, "speaker": display(me), "turns": n_turns}


def quotas(plays: list[str], total: int) -> list[tuple[str, int]]:
    """`total` rows spread evenly over `plays` (the remainder to the first ones)."""
    return [(p, total // len(plays) + (1 if k < total % len(plays) else 0)) for k, p in enumerate(plays)]


def draw(play: Play, quota: int, rng: random.Random, make, what: str) -> list[dict]:
    """`quota` rows of `play` built by `make(k, i)` from its start positions in a random order, skipping
    those `make` refuses (None)."""
    positions = starts(play, 1)
    rng.shuffle(positions)
    rows = []
    for k, i in positions:
        if len(rows) == quota:
            break
        row = make(k, i)
        if row is not None:
            rows.append(row)
    if len(rows) < quota:
        raise TaskError(f"{play.name} gives {len(rows)} {what}, fewer than the {quota} asked for; "
                         "ask for fewer rows (--train/--valid/--test, --pref-*) or more plays")
    return rows


def chat_rows(plays: dict[str, Play], names: list[str], total: int, rng: random.Random,
              args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, quota in quotas(names, total):
        play = plays[name]

        def make(k: int, i: int, play: Play = play) -> dict | None:
            if not answerable(play.scenes[k].speeches[i], args.min_words):
                return None
            return conversation(play, k, i, rng.randint(1, args.max_turns), args,
                                rng.random() < args.system_fraction)
        rows += draw(play, quota, rng, make, "conversations")
    return rows


class Decoys:
    """Speeches of a set of plays by line count, sorted by length: a decoy of comparable length."""

    def __init__(self, plays: dict[str, Play], names: list[str], n_lines: int, min_words: int):
        self.pools: dict[int, list[tuple[int, str, str, str]]] = {}
        for name in names:
            for scene in plays[name].scenes:
                for s in scene.speeches:
                    if answerable(s, min_words):
                        text = text_of(s, n_lines)
                        n = min(len(s.lines), n_lines)
                        self.pools.setdefault(n, []).append((len(text), text, name, display(s.speaker)))
        for pool in self.pools.values():
            pool.sort()

    def pick(self, chosen: str, n_lines: int, tolerance: float, rng: random.Random, accept) -> tuple | None:
        """A (length, text, play, speaker) of `n_lines` lines within `tolerance` of `chosen`'s length that
        `accept` takes, at random; else the closest one it takes (None if it takes none)."""
        pool = self.pools.get(n_lines, [])
        lo = bisect.bisect_left(pool, (int(len(chosen) * (1 - tolerance)),))
        hi = bisect.bisect_right(pool, (int(len(chosen) * (1 + tolerance)) + 1,))
        near = [c for c in pool[lo:hi] if accept(c) and c[1] != chosen]
        if near:
            return rng.choice(near)
        fits = [c for c in pool if accept(c) and c[1] != chosen]
        return min(fits, key=lambda c: abs(c[0] - len(chosen)), default=None)


def pref_rows(plays: dict[str, Play], names: list[str], decoy_plays: list[str], total: int, rng: random.Random,
              args: argparse.Namespace) -> list[dict]:
    decoys = Decoys(plays, sorted(set(names) | set(decoy_plays)), args.lines, args.min_words)
    rows = []
    for name, quota in quotas(names, total):
        play = plays[name]
        others = [p for p in decoy_plays if p != name]

        def make(k: int, i: int, play: Play = play, others: list[str] = others) -> dict | None:
            sp = play.scenes[k].speeches
            if not answerable(sp[i], args.min_words):
                return None
            chosen, me = text_of(sp[i], args.lines), display(sp[i].speaker)
            from_other_play = bool(others) and rng.random() < args.other_play_fraction
            if from_other_play:
                def accept(c, others=others):
                    return c[2] in others
            else:
                def accept(c, play=play, me=me):
                    return c[2] == play.name and c[3] != me
            decoy = decoys.pick(chosen, min(len(sp[i].lines), args.lines), args.length_tolerance, rng, accept)
            if decoy is None:
                return None
            context = sp[max(0, i - args.context):i]
            return {"prompt": situation(play, play.scenes[k], sp[i], sp[i - 1], context, args.lines),
                    "chosen": chosen, "rejected": decoy[1], "play": play.name, "speaker": me,
                    "rejected_from": "other_play" if from_other_play else "other_speaker",
                    "rejected_play": decoy[2], "rejected_speaker": decoy[3]}
        rows += draw(play, quota, rng, make, "preference pairs")
    return rows


def split_plays(valid: list[str], test: list[str]) -> dict[str, list[str]]:
    names = list(play_files())
    for flag, chosen in (("--valid-plays", valid), ("--test-plays", test)):
        unknown = [p for p in chosen if p not in names]
        if unknown or not chosen:
            raise TaskError(f"{flag}: {', '.join(unknown) or 'no play'} is not a play of the corpus; "
                             f"name one or more of: {', '.join(sorted(names))}")
    if set(valid) & set(test):
        raise TaskError(f"--valid-plays and --test-plays share {', '.join(sorted(set(valid) & set(test)))}; "
                         "hold out different plays for each")
    return {"train": sorted(p for p in names if p not in valid and p not in test), "valid": sorted(valid),
            "test": sorted(test)}


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def make_task(args: argparse.Namespace) -> dict:
    """Write the six files under args.out; returns a summary (plays and rows per split)."""
    splits = split_plays(args.valid_plays, args.test_plays)
    plays = load_plays([p for names in splits.values() for p in names])
    held_out = splits["valid"] + splits["test"]
    summary: dict = {"plays": splits}
    files = {}
    for split, names in splits.items():  # every row drawn before a file is written
        rng = random.Random(f"{args.seed}:{split}")
        chats = chat_rows(plays, names, getattr(args, split), rng, args)
        prefs = pref_rows(plays, names, names if split == "train" else held_out, getattr(args, f"pref_{split}"),
                          rng, args)
        rng.shuffle(chats)
        rng.shuffle(prefs)
        files[f"chat_{split}.jsonl"], files[f"pref_{split}.jsonl"] = chats, prefs
        summary[split] = {"conversations": len(chats), "pairs": len(prefs)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        write(out / name, rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for chat_*.jsonl, pref_*.jsonl and summary.json")
    for split, n, pn in (("train", 2000, 1000), ("valid", 100, 200), ("test", 100, 200)):
        ap.add_argument(f"--{split}", type=int, default=n, help=f"conversations of the {split} plays ({n})")
        ap.add_argument(f"--pref-{split}", type=int, default=pn, help=f"preference pairs of the {split} plays ({pn})")
    comma = lambda s: [p for p in s.split(",") if p]
    ap.add_argument("--valid-plays", type=comma, default=list(VALID_PLAYS), help="held out for validation, "
                    "comma-separated corpus names (default two_gentlemen_of_verona)")
    ap.add_argument("--test-plays", type=comma, default=list(TEST_PLAYS),
                    help="held out for test (default winters_tale)")
    ap.add_argument("--lines", type=int, default=2, help="lines kept of each speech (2)")
    ap.add_argument("--context", type=int, default=2, help="previous speeches quoted in the first user turn (2)")
    ap.add_argument("--max-turns", type=int, default=3, help="assistant turns per conversation, at most (3)")
    ap.add_argument("--max-chars", type=int, default=420,
                    help="characters of a conversation's messages, at most (420: at most 240 tokens of the demo model's tokenizer and chat template)")
    ap.add_argument("--min-words", type=int, default=4, help="words of an assistant answer, at least (4)")
    ap.add_argument("--system-fraction", type=float, default=0.5, help="conversations with a system message")
    ap.add_argument("--other-play-fraction", type=float, default=0.5,
                    help="preference pairs whose rejected line is from another play (else another speaker's)")
    ap.add_argument("--length-tolerance", type=float, default=0.15,
                    help="a rejected line's length is within this fraction of the chosen's where one exists")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    for flag in ("lines", "max_turns", "min_words", "max_chars"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1")
    for flag in ("system_fraction", "other_play_fraction", "length_tolerance"):
        if not 0 <= getattr(args, flag) <= 1:
            ap.error(f"--{flag.replace('_', '-')} must be between 0 and 1")
    try:
        summary = make_task(args)
    except TaskError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split in ("train", "valid", "test"):
        plays = summary["plays"][split]
        print(f"{split}: {summary[split]['conversations']} conversations, {summary[split]['pairs']} preference "
              f"pairs from {len(plays)} plays" + ("" if split == "train" else f" ({', '.join(plays)})"))
    print(f"wrote {args.out}/chat_{{train,valid,test}}.jsonl, pref_{{train,valid,test}}.jsonl, summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
