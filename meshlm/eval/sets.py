"""The shipped evaluation sets, built deterministically from the works of the bundled Shakespeare corpus that
no bundled config trains on.

Held-out works. The bundled configs read the 42 texts in file-name order and split them by document
(`data.split`, `gpt_dataset.split_documents`): the training split is a prefix of that order. The works
past every bundled config's training split are held out by all of them: with today's configs (95,5,0;
98,1,1; 949,50,1) the last two, *The Two Gentlemen of Verona* and *The Winter's Tale*. `held_out_files`
computes this from the configs, so a config change cannot silently leak an evaluation work into training.

Text lines. Each work's lines are stripped of indentation; a line is a *heading* when it is a speaker's name
(upper case, ending with a full stop, e.g. `LEONTES.`), a *direction* when it is in square brackets, else
a *text line*. Front matter (the title and cast list) is skipped: everything before the first heading.

* `shakespeare-cloze` (LAMBADA-style): a passage is 30 to 60 words of consecutive lines (as they stand in
  the text, headings included, blank lines dropped) ending with the last word of a text line, cut before
  that word's trailing punctuation. It is kept only when that last word is *predictable from the passage*
  by this heuristic: it has at least 4 letters, is not a common function word, and occurs earlier in the
  passage (the same word, ignoring case). Passages do not overlap.
* `shakespeare-choice` (next line, four choices): the context is the 6 non-blank lines before a text line
  of at least 4 words (headings included), followed by a newline; the choices are that line and 3 other
  distinct text lines of at least 4 words drawn from the same work with a seeded generator, in a seeded
  order. Every 12th eligible line is used.

The sets are built on first use into `$MESHLM_CACHE/eval/` (default `~/.cache/meshlm/eval/`), named with
their version, and rebuilt by `scripts/make_eval_sets.py`; nothing generated is committed.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from meshlm.core.config import EVAL_SETS

VERSION = 1
SEED = 16
CLOZE_WORDS = (30, 60)
CHOICE_CONTEXT_LINES = 6
CHOICE_EVERY = 12
MIN_LINE_WORDS = 4
SETS = EVAL_SETS  # name → the task that scores it (`core.config` validates train.eval_tasks against it)
FUNCTION_WORDS = frozenset(["about", "above", "after", "again", "against", "also", "among", "another", "because", "been", "before", "being", "below", "between", "both", "could", "does", "doing", "down", "during", "each", "either", "every", "from", "further", "have", "having", "here", "hers", "herself", "himself", "into", "itself", "just", "like", "made", "make", "many", "more", "most", "much", "must", "myself", "neither", "never", "only", "other", "ought", "ours", "ourselves", "over", "same", "shall", "should", "some", "such", "than", "that", "their", "theirs", "them", "themselves", "then", "there", "these", "they", "this", "those", "thou", "thee", "thine", "thus", "thy", "till", "under", "until", "upon", "very", "well", "were", "what", "when", "where", "which", "while", "whom", "whose", "will", "with", "would", "your", "yours", "yourself", "yourselves", "even", "most", "hath", "doth", "art", "shalt", "wilt"])

HEADING = re.compile(r"^[A-Z][A-Z' .,&-]*\.$")


def held_out_files() -> list[Path]:
    """The bundled texts past the training split of every bundled config that reads the bundled corpus."""
    from meshlm.core.config import bundled_configs, load_config
    from meshlm.data.assets import shakespeare_files
    from meshlm.data.gpt_dataset import split_documents

    files = shakespeare_files()
    first_free = 0
    for name in bundled_configs():
        cfg = load_config(name)
        if cfg.data.paths:
            continue
        train = split_documents(len(files), cfg.data.split_weights)[0]
        first_free = max(first_free, train.stop)
    return files[first_free:]


def _lines(path: Path) -> list[tuple[str, str]]:
    """(kind, text) of the work's non-blank lines after its front matter; kind heading|direction|text."""
    out = []
    started = False
    for raw in path.read_text(encoding="utf-8-sig").splitlines():
        line = raw.strip()
        if not line:
            continue
        if HEADING.match(line) and len(line) > 2:
            started = True
            out.append(("heading", line))
        elif started:
            out.append(("direction" if line.startswith("[") else "text", line))
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)?", text)


def cloze_items(path: Path) -> list[dict]:
    lines = _lines(path)
    out, start = [], 0
    lo, hi = CLOZE_WORDS
    for i in range(len(lines)):
        kind, text = lines[i]
        m = re.search(r"([A-Za-z]+)[^A-Za-z]*$", text)
        if kind != "text" or m is None or i <= start:
            continue
        word = m.group(1)
        if len(word) < 4 or word.lower() in FUNCTION_WORDS:
            continue
        last = text[:m.end(1)]
        # Grow the passage backwards by whole lines while it stays within `hi` words.
        j, n = i, len(last.split())
        while j - 1 >= start and n + len(lines[j - 1][1].split()) <= hi:
            j -= 1
            n += len(lines[j][1].split())
        if n < lo:
            continue
        passage = "\n".join([t for _, t in lines[j:i]] + [last])
        before = passage[:len(passage) - len(word)]
        if word.lower() not in {w.lower() for w in _words(before)}:
            continue
        out.append({"text": passage})
        start = i + 1  # the next passage starts after this one
    return out


def choice_items(path: Path, seed: int) -> list[dict]:
    lines = _lines(path)
    eligible = [i for i, (kind, text) in enumerate(lines)
                if kind == "text" and len(text.split()) >= MIN_LINE_WORDS and i >= CHOICE_CONTEXT_LINES]
    pool = sorted({lines[i][1] for i, (kind, text) in enumerate(lines)
                   if kind == "text" and len(text.split()) >= MIN_LINE_WORDS})
    rng = random.Random(seed)
    out = []
    for i in eligible[::CHOICE_EVERY]:
        true = lines[i][1]
        distractors: list[str] = []
        while len(distractors) < 3:
            c = pool[rng.randrange(len(pool))]
            if c != true and c not in distractors:
                distractors.append(c)
        choices = [true, *distractors]
        rng.shuffle(choices)
        context = "\n".join(t for _, t in lines[i - CHOICE_CONTEXT_LINES:i]) + "\n"
        out.append({"context": context, "choices": choices, "label": choices.index(true)})
    return out


def build_set(name: str) -> list[dict]:
    files = held_out_files()
    items = []
    for k, f in enumerate(files):
        items += cloze_items(f) if name == "shakespeare-cloze" else choice_items(f, SEED + k)
    return items


def cache_path(name: str, cache_dir: Path | None = None) -> Path:
    from meshlm.data.assets import default_cache_dir

    return (cache_dir or default_cache_dir() / "eval") / f"{name}-v{VERSION}.jsonl"


def write_set(name: str, path: Path) -> int:
    """Build set `name` and write it to `path` atomically; returns its number of items."""
    items = build_set(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
    tmp.replace(path)
    return len(items)


def ensure_set(name: str) -> Path:
    """The cached file of shipped set `name`, built on first use."""
    path = cache_path(name)
    if not path.exists():
        write_set(name, path)
    return path
