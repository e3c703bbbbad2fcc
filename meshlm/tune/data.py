"""Tuning data for decoder models: `{"input", "output"}` lines, or task lines filled into a prompt template.

* `{"input": "...", "output": "..."}`: the model reads the input and learns to continue with the output;
  the loss is on the output's tokens (and the end-of-document token after it) only: every other target is
  ignored (-100).
* `{"taskname": "...", field: ..., "answer": "..."}` with a template per task, as NeMo's p-tuning data:
  `--template 'play=Line: {line}\\nPlay:{answer}'`. `{answer}` must end the template; the text before it,
  with the line's fields filled in, is the input, the answer the output. Several tasks in one run each
  get their own virtual prompt (`tune.tasks`, in order of first appearance in the training file).

Each example becomes one row of `seq_len` tokens: [task index × virtual tokens] (placeholders that
`tune/prompt.py` replaces) + input + output + end-of-document, padded with end-of-document tokens whose
targets are ignored. Nothing else goes before the input: it is the tokenizer's encoding of the text as it
is, which is what `meshlm generate` / `meshlm serve` feed the tuned model and what the exported tokenizer
gives a Hugging Face / PEFT user (`tokenizer(prompt)`), so the adapter sees the same ids everywhere (an
empty input alone becomes one end-of-document token, as `meshlm generate` reads an empty prompt). An
example longer than that is an error naming its file and line, unless `--truncate`, which drops the
start of the input.
"""

from __future__ import annotations

import math
import re
import string

import numpy as np

from meshlm.data.items import DataError
from meshlm.data.jsonl import Line, get_field
from meshlm.models.loss import IGNORE_INDEX as IGNORE

ANSWER = "answer"


class Template:
    """A prompt template: text with `{field}` slots, ending in `{answer}`."""

    def __init__(self, task: str, text: str):
        self.task, self.text = task, text
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        except ValueError as err:  # an unmatched brace: "{q {answer}", "answer}"
            raise DataError(f"--template {task}={text!r} cannot be read ({err}); write fields as {{name}} and a "
                            "literal brace as {{ or }}") from None
        if not text.rstrip().endswith("{" + ANSWER + "}"):
            raise DataError(f"--template {task}={text!r} must end with {{{ANSWER}}} (the output the model learns)")
        if names.count(ANSWER) != 1:
            raise DataError(f"--template {task}={text!r} must hold {{{ANSWER}}} exactly once, at its end")
        bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
        if bad:
            raise DataError(f"--template {task}={text!r}: {{{bad[0]}}} is not a field name; use {{name}} slots only")
        self.fields = [n for n in names if n != ANSWER]
        self.prefix = text[:text.rindex("{" + ANSWER + "}")]

    def split(self, line: Line) -> tuple[str, str]:
        values = {}
        for name in self.fields + [ANSWER]:
            if name not in line.obj:
                raise DataError(f"{line.where}: no {name!r} field, which task {self.task!r}'s template needs "
                                f"({self.text!r})")
            value = line.obj[name]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise DataError(f"{line.where}: {name!r} is {type(value).__name__}, not text")
            values[name] = str(value)
        return self.prefix.format(**values), values[ANSWER]


def parse_templates(specs: list[str]) -> dict[str, Template]:
    """`--template [TASK=]TEXT` flags → task name → Template (one unnamed template serves every line)."""
    out = {}
    for spec in specs:
        task, sep, text = spec.partition("=")
        if not sep or "{" in task:
            task, text = "", spec
        task = task.strip()
        if task in out:
            raise DataError(f"--template for task {task or '(default)'!r} given twice")
        out[task] = Template(task, text)
    return out


def examples(lines: list[Line], templates: dict[str, Template], flag: str) -> list[tuple[str, str, str]]:
    """(task, input, output) per line."""
    out = []
    for line in lines:
        if templates:
            task = line.obj.get("taskname", "")
            if not isinstance(task, str):
                raise DataError(f"{line.where}: 'taskname' is {type(task).__name__}, not text")
            template = templates.get(task) or templates.get("")
            if template is None:
                raise DataError(f"{line.where}: task {task!r} has no --template (given for: "
                                f"{', '.join(repr(k) for k in templates)}); add --template '{task}=...{{answer}}'")
            text, answer = template.split(line)
            out.append((task, text, answer))
        else:
            text = get_field(line, "input", str, "tune")
            answer = get_field(line, "output", str, "tune")
            task = line.obj.get("taskname", "")
            if not isinstance(task, str):
                raise DataError(f"{line.where}: 'taskname' is {type(task).__name__}, not text")
            out.append((task, text, answer))
        if not out[-1][2].strip():
            raise DataError(f"{line.where}: the output is empty; every example needs something to learn")
    return out


class TuneDataset:
    """Rows of (ids, targets) as the trainer's BatchLoader reads them: row i is 2·T int64 values."""

    def __init__(self, ids: np.ndarray, targets: np.ndarray):
        self.ids, self.targets = ids, targets
        self.T = ids.shape[1]
        # Batches cut after their last target, rounded up to a multiple of `trim` (0: every batch keeps
        # the row's T): positions after the last target change no loss (attention is causal), so padding
        # a batch of short conversations to --max-length was compute thrown away. `trim_multiple` sets it.
        self.trim = 0
        self.num_tokens = int((targets != IGNORE).sum())
        self.loss_fraction = self.num_tokens / max(1, targets.size)  # share of row tokens with a target (FLOPs)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.concatenate([self.ids[i], self.targets[i]])

    def collate(self, rows: np.ndarray):
        import torch

        T = self.T
        ids, targets = rows[:, :T], rows[:, T:]
        if self.trim:
            used = np.flatnonzero((targets != IGNORE).any(axis=0))
            width = int(used[-1]) + 1 if used.size else 1
            width = min(T, -(-width // self.trim) * self.trim)
            ids, targets = ids[:, :width], targets[:, :width]
        return torch.from_numpy(np.ascontiguousarray(ids)), torch.from_numpy(np.ascontiguousarray(targets))

    def padded(self, multiple: int, pad_id: int) -> TuneDataset:
        """Rows with every target ignored added up to a multiple of `multiple` (a whole evaluation set)."""
        extra = -len(self) % multiple
        if not extra:
            return self
        return TuneDataset(np.concatenate([self.ids, np.full((extra, self.T), pad_id, dtype=np.int64)]),
                           np.concatenate([self.targets, np.full((extra, self.T), IGNORE, dtype=np.int64)]))


def trim_multiple(parallel) -> int:
    """The width a batch's length is rounded up to under the layout `parallel` (a ParallelConfig), or 0 to
    keep every batch at the row's length: a pipeline's stages fix their activation shapes at its first step,
    so under pp > 1 every batch keeps T. Otherwise a multiple of 16 that tp (its sequence-parallel split)
    and cp (2·cp chunks per row) divide."""
    if parallel.pp > 1:
        return 0
    return math.lcm(16, parallel.tp * 2 * parallel.cp)


def encode(items: list[tuple[str, str, str]], wheres: list[str], tokenizer, length: int, n_virtual: int,
           tasks: list[str], truncate: bool) -> tuple[TuneDataset, int]:
    """Encode (task, input, output) examples into rows of `length` tokens; returns the set and how many
    inputs were cut (`truncate`)."""
    eod = tokenizer.eod_id
    ids = np.full((len(items), length), eod, dtype=np.int64)
    targets = np.full((len(items), length), IGNORE, dtype=np.int64)
    cut = 0
    index = {t: i for i, t in enumerate(tasks)}
    for row, ((task, text, answer), where) in enumerate(zip(items, wheres)):
        prompt, out = tokenizer.encode(text), tokenizer.encode(answer) + [eod]
        if not prompt and not n_virtual:  # the first output token needs a position to be predicted from
            prompt = [eod]
        room = length - n_virtual - len(out)
        least = 0 if n_virtual else 1  # input tokens a row must keep
        if room < least or (len(prompt) > room and not truncate):
            need = n_virtual + len(prompt) + len(out)
            raise DataError(f"{where}: the example is {need} tokens ({n_virtual} virtual + {len(prompt)} input + "
                            f"{len(out)} output), longer than the {length} of a row; shorten it, raise --max-length "
                            f"(at most model.seq_len){'' if room < least else ', or pass --truncate to cut the input'}")
        if len(prompt) > room:
            prompt, cut = prompt[len(prompt) - room:], cut + 1
        head = [index.get(task, 0)] * n_virtual  # the virtual tokens' placeholders; no other prefix
        seq = head + prompt + out
        ids[row, :len(seq)] = seq
        first = len(head) + len(prompt)  # position of the first output token
        targets[row, first - 1:len(seq) - 1] = out  # position i predicts token i + 1
    return TuneDataset(ids, targets), cut
