"""`meshlm eval` end to end in one process: each task kind on a tiny GPT (and a fine-tuned tiny BERT for
classify) against brute force, --out written atomically, and bad input as one `error:` line with exit 2."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from meshlm.cli import main
from tests.checkpoint_helpers import load_run
from tests.eval.eval_helpers import close, last_logprob, write_jsonl


def run(*args: str) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["eval", *args])
    text = out.getvalue().strip()
    return code, (json.loads(text) if code == 0 else None), err.getvalue()


def test_cloze_and_choice_equal_brute_force(tiny_gpt, task_files, tmp_path):
    model, tok, _ = load_run(str(tiny_gpt))
    out_file = tmp_path / "results.json"
    code, res, _ = run("--checkpoint", str(tiny_gpt), "--task", "cloze", "--data", str(task_files["cloze"]),
                       "--out", str(out_file), "--batch-size", "3")
    assert code == 0 and json.loads(out_file.read_text()) == res
    assert not [p for p in tmp_path.iterdir() if p.name != "results.json"]  # no temporary left behind
    whole, last, lls = [], [], []
    for line in task_files["cloze"].read_text().splitlines():
        text = json.loads(line)["text"]
        ctx_text, word = text.rsplit(" ", 1)
        ctx = tok.encode(ctx_text)
        stream = tok.encode(ctx_text + " " + word)
        with torch.no_grad():
            greedy = [int(model(torch.tensor([stream[:i]]))[0, -1].argmax()) for i in range(len(ctx), len(stream))]
        hits = [g == t for g, t in zip(greedy, stream[len(ctx):])]
        whole.append(all(hits))
        last.append(hits[-1])
        lls.append(sum(last_logprob(model, stream[:i], stream[i]) for i in range(len(ctx), len(stream))))
    assert 0 < res["accuracy"] and res["accuracy_whole_word"] == pytest.approx(np.mean(whole))
    assert res["accuracy_last_token"] == pytest.approx(np.mean(last))
    assert res["perplexity"] == pytest.approx(math.exp(-np.mean(lls)), rel=1e-5)

    code, res, _ = run("--checkpoint", str(tiny_gpt), "--task", "choice", "--data", str(task_files["choice"]))
    hits, hits_norm = [], []
    for line in task_files["choice"].read_text().splitlines():
        row = json.loads(line)
        ctx = tok.encode(row["context"])
        ll = []
        for c in row["choices"]:
            stream = tok.encode(row["context"] + " " + c)
            ll.append(sum(last_logprob(model, stream[:i], stream[i]) for i in range(len(ctx), len(stream))))
        hits.append(int(np.argmax(ll)) == row["label"])
        hits_norm.append(int(np.argmax(np.array(ll) / [len(c) for c in row["choices"]])) == row["label"])
    assert code == 0 and res["examples"] == 10
    assert res["accuracy"] == pytest.approx(np.mean(hits)) and res["accuracy_norm"] == pytest.approx(np.mean(hits_norm))


def test_perplexity_stride_one_equals_brute_force(tiny_gpt, tmp_path):
    model, tok, cfg = load_run(str(tiny_gpt))
    text = "Good morrow, kind sir; what news from the court of the king? " * 4
    path = tmp_path / "t.txt"
    path.write_text(text)
    code, res, _ = run("--checkpoint", str(tiny_gpt), "--task", "perplexity", "--data", str(path), "--stride", "1")
    stream = [tok.eod_id, *tok.encode(text)]
    L = cfg.model.seq_len
    nll = -sum(last_logprob(model, stream[max(0, i - L):i], stream[i]) for i in range(1, len(stream)))
    assert code == 0 and res["tokens"] == len(stream) - 1 > L
    assert res["perplexity"] == pytest.approx(math.exp(nll / res["tokens"]), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-5)
    assert res["word_perplexity"] == pytest.approx(math.exp(nll / len(text.split())), rel=1e-5)
    assert res["perplexity_nonoverlapping"] != pytest.approx(res["perplexity"], rel=1e-6)


def test_shipped_set_runs_by_name(tiny_gpt, monkeypatch, tmp_path):
    from meshlm.eval import sets

    small = [{"text": "O, she is fallen into a pit of ink, that the wide sea hath drops too few to wash her "
                      "clean again; and salt too little which may season give to her foul-tainted ink"}]
    monkeypatch.setattr(sets, "build_set", lambda name: small)  # the real build is tested in test_eval_sets.py
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    code, res, _ = run("--checkpoint", str(tiny_gpt), "--task", "shakespeare-cloze")
    assert code == 0 and res["kind"] == "cloze" and res["examples"] == 1
    assert res["data"] == str(tmp_path / "eval" / f"shakespeare-cloze-v{sets.VERSION}.jsonl")


def test_classify_on_a_finetuned_bert(tmp_path):
    from tests.train.finetune_helpers import QUIET, classify_rows, save_base

    base = save_base(tmp_path / "base")
    train = write_jsonl(tmp_path / "train.jsonl", classify_rows(24, seed=1))
    valid = write_jsonl(tmp_path / "valid.jsonl", classify_rows(13, seed=2))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["finetune", "--checkpoint", str(base), "--task", "classify", "--train", str(train), "--valid",
                     str(valid), "--out", str(tmp_path / "ft"), "--train.max_steps=3", *QUIET]) == 0
    code, res, _ = run("--checkpoint", str(tmp_path / "ft"), "--task", "classify", "--data", str(valid),
                       "--batch-size", "4")
    assert code == 0 and res["examples"] == 13
    # by hand: each example alone through the model, string labels mapped by finetune.json's sorted names
    from meshlm.models.bert import pack_inputs

    model, tok, _ = load_run(str(tmp_path / "ft"))
    names = json.loads((tmp_path / "ft" / "finetune.json").read_text())["names"]
    preds, gold = [], []
    for line in valid.read_text().splitlines():
        row = json.loads(line)
        ids = [tok.special_ids["cls"], *tok.encode(row["text"]), tok.special_ids["sep"]]
        with torch.no_grad():
            preds.append(int(model(pack_inputs(torch.tensor([ids])))[0].argmax()))
        gold.append(names.index(row["label"]))
    preds, gold = np.array(preds), np.array(gold)
    assert res["accuracy"] == pytest.approx((preds == gold).mean())
    f1s = []
    for c in range(len(names)):
        tp, fp, fn = ((preds == c) & (gold == c)).sum(), ((preds == c) & (gold != c)).sum(), \
            ((preds != c) & (gold == c)).sum()
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    assert close(res["f1"], float(np.mean(f1s)))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "red cat", "label": "plant"}])
    code, _, err = run("--checkpoint", str(tmp_path / "ft"), "--task", "classify", "--data", str(bad))
    assert code == 2 and err.startswith("error: ") and "bad.jsonl:1: label \"plant\" is not one of" in err


BAD = {
    "missing field": ("choice", [{"context": "a", "label": 0}], "choice.jsonl:1: no 'choices' field"),
    "label out of range": ("choice", [{"context": "a", "choices": ["b", "c"], "label": 0},
                                      {"context": "a", "choices": ["b", "c"], "label": 2}],
                           "choice.jsonl:2: 'label' 2 is not an index into its 2 choices"),
    "cloze missing text": ("cloze", [{"txt": "a b"}], "cloze.jsonl:1: no 'text' field"),
    "empty file": ("cloze", [], "holds no examples"),
    "empty text": ("perplexity", None, "holds no text"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_task_file_is_one_error_line(tiny_gpt, tmp_path, case):
    kind, rows, message = BAD[case]
    path = tmp_path / (f"{kind}.jsonl" if rows is not None else "empty.txt")
    if rows is None:
        path.write_text("  \n\n")
    else:
        write_jsonl(path, rows)
    out = tmp_path / "out.json"
    code, _, err = run("--checkpoint", str(tiny_gpt), "--task", kind, "--data", str(path), "--out", str(out))
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("args,message", [
    (["--task", "hellaswag", "--data", "x.jsonl"], "--task 'hellaswag' is not a task; choose one of"),
    (["--task", "cloze"], "--task cloze needs --data FILE"),
    (["--task", "shakespeare-choice", "--data", "x.jsonl"], "is a shipped set; it takes no --data"),
    (["--task", "cloze", "--data", "nope.jsonl"], "--data 'nope.jsonl' does not exist"),
    (["--task", "cloze", "--data", "x.jsonl", "--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--task", "perplexity", "--data", "README.md", "--stride", "999"], "--stride 999 must be in 1..32"),
    (["--task", "cloze", "--data", "x.jsonl", "--train.lr=1"], "takes only --parallel.* overrides"),
    (["--task", "cloze", "--data", "x.jsonl", "--parallel.tp=2"], "needs several processes: launch with torchrun"),
    (["--task", "cloze", "--data", "x.jsonl", "--out", "/nonexistent/dir/r.json"], "does not exist; create it"),
])
def test_bad_arguments_are_one_error_line(tiny_gpt, task_files, args, message):
    args = [str(task_files["cloze"]) if a == "x.jsonl" else a for a in args]
    code, _, err = run("--checkpoint", str(tiny_gpt), *args)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_classify_needs_a_bert_and_lm_tasks_need_a_gpt(tiny_gpt, task_files):
    code, _, err = run("--checkpoint", str(tiny_gpt), "--task", "classify", "--data", str(task_files["cloze"]))
    assert code == 2 and "needs a fine-tuned BERT checkpoint" in err
