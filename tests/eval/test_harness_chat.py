"""`meshlm harness --apply_chat_template`: the meshlm model renders each prompt with the checkpoint's chat
template (meshlm's builtin one for a gpt2-tokenizer checkpoint) and gives the numbers and strings of the
harness's Hugging Face backend on the same weights exported by `meshlm convert --to-hf` (whose export now
carries that template as chat_template.jinja), both run in this process on tasks defined here."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from meshlm.cli import main
from meshlm.data.chat import BUILTIN_TEMPLATE, render
from tests.eval.eval_helpers import PROMPTS, write_jsonl

pytest.importorskip("lm_eval")


def evaluate(lm, manager, tasks):
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, apply_chat_template=True, log_samples=True,
                          batch_size=3)
    return out["results"], out["samples"]


def test_apply_chat_template_equals_the_hf_backend(tiny_gpt, task_files, tmp_path):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from meshlm.eval.harness import MeshlmLM

    gen = write_jsonl(tmp_path / "gen.jsonl", [{"context": p, "answer": " x"} for p in PROMPTS[:4]])
    tasks = {"chat_choice": {"output_type": "multiple_choice", "data": task_files["choice"],
                             "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                             "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
             "chat_gen": {"output_type": "generate_until", "data": gen, "doc_to_text": "{{context}}",
                          "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
                          "generation_kwargs": {"until": ["<|"], "max_gen_toks": 5, "do_sample": False}}}
    folder = tmp_path / "tasks"
    folder.mkdir()
    for name, t in tasks.items():
        body = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(t.pop("data"))}},
                "test_split": "test", **t}
        (folder / f"{name}.yaml").write_text(json.dumps(body))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", "--checkpoint", str(tiny_gpt), "--to-hf", str(tmp_path / "hf")]) == 0

    ours = MeshlmLM(checkpoint=str(tiny_gpt), batch_size=3, device="cpu")
    assert ours.chat_template(True) == BUILTIN_TEMPLATE
    assert ours.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|user|>\nHi\n<|end|>\n<|assistant|>\n"
    manager = TaskManager(include_path=str(folder), include_defaults=False)  # not the 14k built-in tasks
    got, got_samples = evaluate(ours, manager, list(tasks))
    theirs = HFLM(pretrained=str(tmp_path / "hf"), dtype="float32", device="cpu", batch_size=3)
    ref, ref_samples = evaluate(theirs, manager, list(tasks))

    contexts = [s["arguments"][0][0] for s in got_samples["chat_gen"]]
    assert contexts == [render(BUILTIN_TEMPLATE, [{"role": "user", "content": p}], add_generation_prompt=True)
                        for p in PROMPTS[:4]]  # the prompts are chats
    assert contexts == [s["arguments"][0][0] for s in ref_samples["chat_gen"]]
    assert [s["resps"] for s in got_samples["chat_gen"]] == [s["resps"] for s in ref_samples["chat_gen"]]
    assert got["chat_choice"]["acc,none"] == pytest.approx(ref["chat_choice"]["acc,none"], abs=1e-6)
    lls = [float(r[0][0]) for s in got_samples["chat_choice"] for r in s["resps"]]
    ref_lls = [float(r[0][0]) for s in ref_samples["chat_choice"] for r in s["resps"]]
    assert lls == pytest.approx(ref_lls, rel=1e-4, abs=1e-4)
