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


# lm_eval's command line with its Hugging Face backend, then `meshlm harness` (meshlm.cli.main, what the console
# script calls), in one fresh interpreter: torch, transformers and lm_eval are imported once, not twice. Each run
# builds lm_eval's TaskManager, which parses every bundled task YAML (~14,700 tasks: 7 s of CPU) into an index;
# the two runs read the same folders, so the index is built once and each run gets its own dict of its entries
# (lm_eval only reads them: a task's config is re-read from its YAML file, or deep-copied, when it is built).
_BOTH = """
import json, sys, traceback
from lm_eval.tasks import _index

built, build = {}, _index.TaskIndex.build


def index_once(paths, **kwargs):
    paths = list(paths)
    key = (tuple(map(str, paths)), tuple(sorted(kwargs.items())))
    if key not in built:
        built[key] = build(paths, **kwargs)
    return dict(built[key])


_index.TaskIndex.build = staticmethod(index_once)


def run(call):
    try:
        code = call()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    return code or 0


def lm_eval_cli(argv):
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *argv]
    return cli_evaluate()


theirs, ours, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
codes = {"theirs": run(lambda: lm_eval_cli(theirs))}
print("=== meshlm harness", file=sys.stderr, flush=True)
from meshlm.cli import main

codes["ours"] = run(lambda: main(ours))
open(out, "w").write(json.dumps(codes))
"""


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
    ours = ["harness", "--model", "meshlm", "--model_args", f"checkpoint={tiny_gpt}", *common, "--output_path",
            str(root / "ours")]
    theirs = ["--model", "hf", "--model_args", f"pretrained={hf},dtype=float32", "--device", "cpu", *common,
              "--output_path", str(root / "hf_out")]
    codes = root / "codes.json"
    proc = subprocess.run([sys.executable, "-c", _BOTH, json.dumps(theirs), json.dumps(ours), str(codes)],
                          capture_output=True, text=True, timeout=480, env=env, check=False)
    code = json.loads(codes.read_text()) if codes.exists() else {"ours": proc.returncode or 1,
                                                                   "theirs": proc.returncode or 1}
    return (subprocess.CompletedProcess(["meshlm", *ours], code["ours"], proc.stdout, proc.stderr),
            subprocess.CompletedProcess(["lm_eval", *theirs], code["theirs"], proc.stdout, proc.stderr), root)


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
