"""Every command of the README's Evaluation section, as typed, in a folder holding what they name: a tiny GPT
as runs/gpt-tiny, a fine-tuned tiny BERT as runs/genre, task files, a harness task, and the shipped sets
(their first items, cut from the real build, in the cache) so that the tiny runs stay quick."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from meshlm.cli import main
from meshlm.eval import sets
from tests.cli_batch import run_meshlm_batch, shell_words
from tests.eval.eval_helpers import save_tiny_gpt, write_jsonl
from tests.test_readme_commands import _section_commands


def prepare(root: Path, task_files: dict) -> None:
    save_tiny_gpt(root / "runs" / "gpt-tiny")
    from tests.train.finetune_helpers import QUIET, classify_rows, save_base

    base = save_base(root / "runs" / "bert-base")
    (root / "data" / "genre").mkdir(parents=True)
    train = write_jsonl(root / "data" / "genre" / "train.jsonl", classify_rows(16, seed=1))
    valid = write_jsonl(root / "data" / "genre" / "valid.jsonl", classify_rows(9, seed=2))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["finetune", "--checkpoint", str(base), "--task", "classify", "--train", str(train), "--valid",
                     str(valid), "--out", str(root / "runs" / "genre"), "--train.max_steps=2", *QUIET]) == 0
    (root / "lambada.jsonl").write_text(task_files["cloze"].read_text())
    (root / "choices.jsonl").write_text(task_files["choice"].read_text())
    (root / "my_tasks").mkdir()
    task = {"task": "my_task", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(root / "choices.jsonl")}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]}
    (root / "my_tasks" / "my_task.yaml").write_text(json.dumps(task))
    cache = root / "cache"
    for name in sets.SETS:
        items = sets.build_set(name)[:6]
        path = sets.cache_path(name, cache / "eval")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(x) + "\n" for x in items))
    (root / "text.txt").write_text(task_files["perplexity"].read_text())


def test_readme_evaluation_commands(task_files, tmp_path):
    prepare(tmp_path, task_files)
    commands = _section_commands("Evaluation")
    assert len(commands) == 8, commands
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "MESHLM_CACHE": str(tmp_path / "cache"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    typed = []
    for line in commands:
        line = line.replace(".venv/bin/", bin_dir + "/")
        if line.startswith("torchrun"):
            line = line.replace("torchrun", f"{shlex.quote(sys.executable)} -m torch.distributed.run", 1)
        if "--task perplexity" in line:  # a whole play is long for a CPU test: the task files' text instead
            start = line.index('"$(')
            line = line[:start] + "text.txt" + line[line.index(')"', start) + 2:]
            line = line.replace("--stride 64", "--stride 16")  # the tiny model's context is 32 tokens
        typed.append(line)
    # Each line only reads what prepare() wrote: the torchrun launch first, then the seven `meshlm` lines in
    # their order in one process (tests/cli_batch.py).
    procs = {}
    for i, line in enumerate(typed):
        if not line.startswith(f"{bin_dir}/meshlm "):
            procs[i] = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                                      env=env, check=False)
    batch = [i for i in range(len(typed)) if i not in procs]
    assert len(batch) == 7, typed
    procs.update(zip(batch, run_meshlm_batch([shell_words(typed[i], tmp_path)[1:] for i in batch], cwd=tmp_path,
                                             env=env)))
    outputs = []
    for i, line in enumerate(typed):
        assert procs[i].returncode == 0, (line, procs[i].stderr[-2000:])
        outputs.append(procs[i].stdout)
    results = [json.loads(next(x for x in out.splitlines() if x.startswith("{"))) for out in outputs[:7]]
    assert [r["kind"] for r in results] == ["cloze", "choice", "perplexity", "cloze", "choice", "classify", "cloze"]
    assert json.loads((tmp_path / "cloze.json").read_text()) == results[0]
    assert results[0]["examples"] == 6 and {"accuracy_whole_word", "accuracy_last_token"} <= set(results[0])
    assert results[6]["layout"]["tp"] == 2 and results[6]["accuracy"] == results[0]["accuracy"]
    assert {"perplexity", "perplexity_nonoverlapping", "bits_per_byte", "word_perplexity"} <= set(results[2])
    assert {"accuracy", "f1"} <= set(results[5])
    assert list((tmp_path / "results").rglob("results_*.json"))
