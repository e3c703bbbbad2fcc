"""`train.eval_tasks`: evaluation tasks run at each of the trainer's evaluations, on the model being trained
(this rank's part under any layout, as `meshlm eval` runs it), their metrics logged as
`val_<name>_<metric>` (metrics.jsonl and TensorBoard's valid/ scalars), e.g. `val_shakespeare_cloze_accuracy`
or, for `cloze:FILE`, `val_cloze_accuracy`.

The files are read (and shipped sets built) at the first evaluation; a bad file stops the run there with one
error line. The trainer runs them as an extension (`train/extension.py`) given to it: `eval_extensions(cfg)`,
whose `evaluate(trainer)` it calls from each evaluation (every rank).
"""

from __future__ import annotations

import re

import torch

from meshlm.core.config import Config, ConfigError
from meshlm.eval import tasks
from meshlm.eval.scorer import Scorer, parallel_forward
from meshlm.train.extension import Extension

LOGGED = {"perplexity": ("perplexity", "word_perplexity", "bits_per_byte"),
          "cloze": ("accuracy", "accuracy_last_token", "perplexity"),
          "choice": ("accuracy", "accuracy_norm")}
BATCH = 8


def _name(task: str, kind: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9]+", "_", task.lower()).strip("_") if ":" not in task else kind
    name, k = base, 2
    while name in taken:
        name, k = f"{base}{k}", k + 1
    taken.add(name)
    return name


class TrainingTasks:
    def __init__(self, trainer):
        from meshlm.eval.sets import SETS, ensure_set

        if not trainer.spec.decoder:
            raise ConfigError(f"train.eval_tasks needs a language model; model.family={trainer.cfg.model.family!r} "
                              "does not predict next tokens: set train.eval_tasks=[]")
        self.items, taken = [], set()
        for task in trainer.cfg.train.eval_tasks:
            if task in SETS:
                kind, path = SETS[task], str(ensure_set(task))
            else:
                kind, _, path = task.partition(":")
            flag = f"train.eval_tasks entry {task!r}:"
            if kind == "perplexity":
                data = tasks.read_text(path, flag)
            elif kind == "cloze":
                data = tasks.read_cloze(path, flag)
            else:
                data = tasks.read_choice(path, flag)
            self.items.append((_name(task, kind, taken), kind, data))
        cfg = trainer.cfg.model
        self.scorer = Scorer(self._forward(trainer), cfg.seq_len, trainer.tokenizer, BATCH, trainer.device,
                             progress=False, is_main=trainer.dims.is_main)

    @staticmethod
    def _forward(trainer):
        return parallel_forward(trainer.parallel, trainer.cfg.model.vocab_size)

    def __call__(self) -> dict:
        out = {}
        for name, kind, data in self.items:
            if kind == "perplexity":
                metrics = tasks.run_perplexity(self.scorer, data)
            elif kind == "cloze":
                metrics = tasks.run_cloze(self.scorer, data)
            else:
                metrics = tasks.run_choice(self.scorer, data)
            out.update({f"val_{name}_{m}": float(metrics[m]) for m in LOGGED[kind]})
        return out


class EvalTasks(Extension):
    """`train.eval_tasks` at each of the trainer's evaluations: the tasks read at the first one."""

    implements = ("train.eval_tasks",)

    def __init__(self):
        self.tasks: TrainingTasks | None = None

    @torch.no_grad()
    def evaluate(self, trainer) -> dict:
        """The metrics of `train.eval_tasks` on the trainer's model now (every rank calls it)."""
        if self.tasks is None:
            self.tasks = TrainingTasks(trainer)
        was_training = trainer.model.training
        trainer.model.eval()
        try:
            return self.tasks()
        finally:
            trainer.model.train(was_training)


def eval_extensions(cfg: Config) -> list[Extension]:
    """[EvalTasks()] when `cfg` sets train.eval_tasks, else []."""
    return [EvalTasks()] if cfg.train.eval_tasks else []
