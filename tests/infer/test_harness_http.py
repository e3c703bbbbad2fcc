"""lm-evaluation-harness's `local-completions` model (the OpenAI completions API: echo + logprobs on token-id
prompts, what its log-likelihood requests send) against `meshlm serve` gives the numbers of `meshlm harness`
run in process on the same checkpoint and documents, within 1e-4."""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from pathlib import Path

import pytest

from meshlm.cli import main
from tests.eval.eval_helpers import PROMPTS, make_task_files, save_tiny_gpt, write_jsonl
from tests.infer.server_helpers import ServeProcess

TASKS = {
    "api_choice": ("multiple_choice", "choice", {"doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                                                 "doc_to_target": "{{label}}"}, ["acc", "acc_norm"]),
    "api_ll": ("loglikelihood", "ll", {"doc_to_text": "{{context}}", "doc_to_target": "{{answer}}"},
               ["perplexity", "acc"]),
}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def harness(model: str, model_args: str, folder: Path, out: Path) -> tuple[dict, dict]:
    """(results by task, {(task, doc_id): per-choice (log-likelihood, is_greedy)}) of `meshlm harness`."""
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["harness", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
                     "--include_path", str(folder), "--log_samples", "--output_path", str(out)])
    assert code == 0
    (path,) = list(out.rglob("results_*.json"))
    samples = {}
    for task in TASKS:
        for p in out.rglob(f"samples_{task}_*.jsonl"):
            for line in p.read_text().splitlines():
                s = json.loads(line)
                # (log-likelihood, is_greedy) per choice; the API model's are logged as strings
                samples[(task, s["doc_id"])] = [(float(r[0][0]), str(r[0][1]) == "True") for r in s["resps"]]
    return json.loads(path.read_text())["results"], samples


@pytest.mark.slow
def test_local_completions_over_http_equals_meshlm_harness(tmp_path, monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    ckpt = save_tiny_gpt(tmp_path / "run")
    started: list[ServeProcess] = []  # the server starts while the documents and the tokenizer are written
    starter = threading.Thread(target=lambda: started.append(ServeProcess("--checkpoint", str(ckpt),
                                                                          "--served-model-name", "tiny")))
    starter.start()
    (tmp_path / "data").mkdir()
    files = make_task_files(ckpt, tmp_path / "data")
    texts = [json.loads(line)["text"] for line in files["cloze"].read_text().splitlines()]
    ll = write_jsonl(tmp_path / "ll.jsonl", [{"context": p, "answer": t[len(p):]} for p, t in zip(PROMPTS, texts)])
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name, (output_type, data, fields, metrics) in TASKS.items():
        path = {"choice": files["choice"], "ll": ll}[data]
        body = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
                "test_split": "test", "output_type": output_type, **fields,
                "metric_list": [{"metric": m} for m in metrics]}
        (folder / f"{name}.yaml").write_text(json.dumps(body))  # JSON is YAML
    hf = tmp_path / "hf"  # the tokenizer local-completions loads (the checkpoint's, as Hugging Face files)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", "--checkpoint", str(ckpt), "--to-hf", str(hf)]) == 0

    import lm_eval.models.openai_completions  # noqa: F401 -- registers local-completions (meshlm harness loads meshlm's only)

    starter.join(120)
    (server,) = started
    try:
        got, got_samples = harness(
            "local-completions", f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={hf},max_length=32,max_retries=1", folder, tmp_path / "http")
    finally:
        assert server.stop() == 0, "".join(server.stderr)[-3000:]
    ref, ref_samples = harness("meshlm", f"checkpoint={ckpt}", folder, tmp_path / "ours")

    assert set(got_samples) == set(ref_samples) and len(ref_samples) == 2 * len(PROMPTS)
    for key, ref_resps in ref_samples.items():
        for (a, greedy_a), (b, greedy_b) in zip(got_samples[key], ref_resps, strict=True):
            assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b, key
    for task, (_, _, _, metrics) in TASKS.items():
        for m in metrics:
            assert got[task][f"{m},none"] == pytest.approx(ref[task][f"{m},none"], rel=1e-4, abs=1e-4), (task, m)
    assert 0 < ref["api_choice"]["acc,none"] < 1 and ref["api_ll"]["acc,none"] > 0  # not constants
    assert os.environ["HF_HUB_OFFLINE"] == "1"
