"""lm-evaluation-harness: tasks defined here (YAML + local jsonl, no downloads) of all four request kinds
(multiple choice, loglikelihood, loglikelihood_rolling, generate_until) run through `meshlm harness --model
meshlm` give the numbers of the harness's own Hugging Face backend (`lm_eval --model hf`) on the same
weights exported by `meshlm convert --to-hf`, within 1e-4, and the same generated strings."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm.cli import main
from tests.conftest import meshlm_command
from tests.eval.eval_helpers import PROMPTS, write_jsonl

TASKS = {
    "mt_choice": ("multiple_choice", "choice", {"doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                                                "doc_to_target": "{{label}}"}, ["acc", "acc_norm"]),
    "mt_ll": ("loglikelihood", "gen", {"doc_to_text": "{{context}}", "doc_to_target": "{{answer}}"},
              ["perplexity", "acc"]),
    "mt_rolling": ("loglikelihood_rolling", "cloze", {"doc_to_text": "", "doc_to_target": "{{text}}"},
                   ["word_perplexity", "byte_perplexity", "bits_per_byte"]),
    "mt_gen": ("generate_until", "gen", {"doc_to_text": "{{context}}", "doc_to_target": "{{answer}}",
                                         "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 5,
                                                               "do_sample": False}}, ["exact_match"]),
}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def write_tasks(root: Path, files: dict[str, Path]) -> Path:
    folder = root / "harness_tasks"
    folder.mkdir()
    for name, (output_type, data, fields, metrics) in TASKS.items():
        body = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(files[data])}},
                "test_split": "test", "output_type": output_type, **fields,
                "metric_list": [{"metric": m} for m in metrics]}
        (folder / f"{name}.yaml").write_text(json.dumps(body, indent=1))  # JSON is YAML
    return folder


def results(out: Path) -> tuple[dict, dict]:
    """(results by task, generated strings of mt_gen) from an --output_path folder."""
    (path,) = list(out.rglob("results_*.json"))
    samples = [json.loads(line) for p in out.rglob("samples_mt_gen_*.jsonl") for line in p.read_text().splitlines()]
    gens = {s["doc_id"]: s["resps"][0][0] for s in samples}
    return json.loads(path.read_text())["results"], gens


@pytest.fixture(scope="module")
def runs(tiny_gpt, task_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    texts = [json.loads(line)["text"] for line in task_files["cloze"].read_text().splitlines()]
    gen = write_jsonl(root / "gen.jsonl", [{"context": p, "answer": t[len(p):]} for p, t in zip(PROMPTS, texts)])
    folder = write_tasks(root, {**task_files, "gen": gen})
    hf = root / "hf"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", "--checkpoint", str(tiny_gpt), "--to-hf", str(hf)]) == 0
    env = {**os.environ, **OFFLINE}
    common = ["--tasks", ",".join(TASKS), "--include_path", str(folder), "--log_samples", "--batch_size", "3"]
    ours = subprocess.run([*meshlm_command(), "harness", "--model", "meshlm", "--model_args",
                           f"checkpoint={tiny_gpt}", *common, "--output_path", str(root / "ours")],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    theirs = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                             f"pretrained={hf},dtype=float32", "--device", "cpu", *common, "--output_path",
                             str(root / "hf_out")], capture_output=True, text=True, timeout=300, env=env, check=False)
    return ours, theirs, root


def test_meshlm_harness_equals_the_hf_backend(runs):
    ours, theirs, root = runs
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    got, got_gen = results(root / "ours")
    ref, ref_gen = results(root / "hf_out")
    compared = 0
    for task, (_, _, _, metrics) in TASKS.items():
        for m in metrics:
            key = f"{m},none"
            a, b = got[task][key], ref[task][key]
            assert a == pytest.approx(b, rel=1e-4, abs=1e-4), (task, m, a, b)
            compared += 1
    assert compared == 8
    assert 0 < got["mt_choice"]["acc,none"] < 1 and 0 < got["mt_ll"]["acc,none"]  # not constants
    assert len(got_gen) == len(PROMPTS) and got_gen == ref_gen
    assert any(got_gen.values())  # something was generated


def test_import_meshlm_does_not_import_lm_eval():
    code = ("import sys, meshlm, meshlm.cli, meshlm.commands.eval, meshlm.eval.tasks; "
            "sys.exit(1 if 'lm_eval' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


def test_harness_without_lm_eval_is_one_error_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    monkeypatch.delitem(sys.modules, "meshlm.eval.harness", raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["harness", "--model", "meshlm", "--tasks", "x"])
    assert code == 2
    text = err.getvalue()
    assert text.startswith("error: ") and text.count("\n") == 1 and "pip install 'meshlm[eval]'" in text
