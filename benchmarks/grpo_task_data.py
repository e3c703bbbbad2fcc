"""The GRPO task's data (a helper module of benchmarks/grpo_task.py): arithmetic word problems from a seeded
generator, each a JSONL row `{"prompt": [messages], "answer": N, "split": ...}` that the built-in rewards
`meshlm.tune.rewards:exact_number` (the number after "####") and `format_regex` score.

The held-out split is unseen by source, not only by numbers: its problems come from other templates (other
verbs and objects) with other names than the training split's, so a model that learns the task must learn
"state the answer after ####, and get the sum right", not memorise sentences. `--ops` sets the difficulty:
"add" (one addition), "addsub" (one addition or subtraction, the default), "two" (two operations).
"""

from __future__ import annotations

import random

INSTRUCTION = ("Answer with one short line of working, then the final number after ####. Example:\n"
               "Tom has 5 pens and buys 3 more. How many pens does Tom have?\n5 + 3 = 8\n#### 8")

# (template, operation): {a} and {b} (and {c}) are numbers, {n} a name; the answer follows the operation
TRAIN_TEMPLATES = [
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", "+"),
    ("{n} had {a} marbles and lost {b} of them. How many marbles does {n} have left?", "-"),
    ("A shelf holds {a} books. {n} puts {b} more books on it. How many books are on the shelf?", "+"),
    ("{n} baked {a} cookies and ate {b}. How many cookies are left?", "-"),
    ("There are {a} birds on a tree and {b} more arrive. How many birds are on the tree?", "+"),
    ("{n} has {a} coins and spends {b}. How many coins does {n} have left?", "-"),
]
TEST_TEMPLATES = [
    ("{n} has {a} roses and is given {b} more. How many roses does {n} have?", "+"),
    ("{n} picks {a} lemons and gives {b} of them away. How many lemons does {n} keep?", "-"),
    ("A ship carries {a} sailors and {b} more come aboard. How many sailors are on the ship?", "+"),
    ("{n} writes {a} letters and burns {b} of them. How many letters are left?", "-"),
]
TRAIN_NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack"]
TEST_NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Portia", "Lear"]


def problem(rng: random.Random, templates, names, ops: str) -> tuple[str, int]:
    """One problem's text and answer."""
    pool = [t for t in templates if ops != "add" or t[1] == "+"]
    text, op = rng.choice(pool)
    a, b = rng.randint(10, 40), rng.randint(2, 9)
    answer = a + b if op == "+" else a - b
    sentence = text.format(n=rng.choice(names), a=a, b=b)
    if ops == "two":
        c = rng.randint(2, 9)
        sentence = sentence.rstrip("?").rsplit(". ", 1)
        sentence = f"{sentence[0]}. Then {c} more are added. {sentence[1]} at the end?"
        answer += c
    return sentence, answer


def rows(split: str, n: int, seed: int, ops: str = "addsub") -> list[dict]:
    """`n` rows of `split` ("train" or "test": disjoint templates and names), seeded."""
    rng = random.Random(f"{split}:{seed}:{ops}")
    templates, names = (TRAIN_TEMPLATES, TRAIN_NAMES) if split == "train" else (TEST_TEMPLATES, TEST_NAMES)
    out = []
    for _ in range(n):
        text, answer = problem(rng, templates, names, ops)
        out.append({"prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}],
                    "answer": answer, "split": split})
    return out
