"""What `meshlm eval` does (docs/eval.md): a task name resolved to its kind and data file, the task run on a
loaded checkpoint, the results written atomically. The command's parser is `commands/eval.py`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from meshlm.core.config import ConfigError

KINDS = ("perplexity", "cloze", "choice", "classify")


def task_names() -> tuple[str, ...]:
    from meshlm.eval.sets import SETS

    return (*KINDS, *SETS)


def resolve_task(task: str, data: str | None) -> tuple[str, str]:
    """(kind, data file) of a task name: a kind with --data FILE, or a shipped set (built on first use)."""
    from meshlm.eval.sets import SETS, ensure_set

    if task in SETS:
        if data is not None:
            raise ConfigError(f"--task {task} is a shipped set; it takes no --data (use --task {SETS[task]} "
                              "--data FILE for your own file)")
        return SETS[task], str(ensure_set(task))
    if task not in KINDS:
        raise ConfigError(f"--task {task!r} is not a task; choose one of {', '.join(task_names())}")
    if data is None:
        raise ConfigError(f"--task {task} needs --data FILE (docs/eval.md gives its format)")
    return task, data


def evaluate(loaded, checkpoint: str, kind: str, data: str, batch_size: int, stride: int | None) -> dict:
    """The metrics of task `kind` on file `data` (every rank calls it under torchrun)."""
    from meshlm.eval import tasks
    from meshlm.families.registry import get_spec

    if kind == "classify":
        if loaded.model is None or not get_spec(loaded.cfg.model.family).task_heads:
            raise ConfigError(f"--task classify needs a fine-tuned BERT checkpoint (meshlm finetune --task classify); "
                              f"{checkpoint} holds a model.family={loaded.cfg.model.family!r} model")
        from meshlm.eval.classify import run_classify

        return run_classify(loaded.model, loaded.tokenizer, checkpoint, data, batch_size)
    if loaded.scorer is None:
        raise ConfigError(f"--task {kind} needs a language model (GPT family); {checkpoint} holds a "
                          f"model.family={loaded.cfg.model.family!r} model (use --task classify)")
    if stride is not None and kind != "perplexity":
        raise ConfigError(f"--stride is for --task perplexity, not {kind}")
    if kind == "perplexity":
        return tasks.run_perplexity(loaded.scorer, tasks.read_text(data), stride)
    if kind == "cloze":
        return tasks.run_cloze(loaded.scorer, tasks.read_cloze(data))
    return tasks.run_choice(loaded.scorer, tasks.read_choice(data))


def check_out(path: str) -> Path:
    """--out names a file in an existing directory (checked before any work is done)."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--out {path!r} is a directory; give a file name such as results.json")
    if not p.parent.exists():
        raise ConfigError(f"--out {path!r}: directory {str(p.parent)!r} does not exist; create it first")
    return p


def write_json_atomic(path: str, obj: dict) -> None:
    """`obj` as JSON at `path`, through a temporary file renamed into place: never half-written."""
    p = check_out(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        tmp.replace(p)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"--out {path!r} cannot be written ({err.strerror or err})") from None
