"""`meshlm align` end to end on one process: DPO learns the preference (train and valid metrics as TRL names
them), the frozen reference's log-probs are computed once and saved with the run, resuming is exact, a LoRA
adapter run keeps the base and exports the adapter, conversational lines go through the chat template, and
bad input is one clear line naming file:line, with exit code 2 and no run directory left."""

from __future__ import annotations

import random

import pytest
import torch

from meshlm.checkpoint.files import checkpoints_dir, load_torch, step_name
from meshlm.checkpoint.single import resolve_checkpoint
from meshlm.data.chat import BUILTIN_TEMPLATE, render
from meshlm.data.jsonl import Line
from meshlm.data.tokenizers import get_tokenizer
from meshlm.tune import preference
from meshlm.tune.align import REFERENCE_FILE
from tests.tune.tune_helpers import QUIET, WORDS, metrics, run, save_base, train_losses, write_jsonl

STEPS = ["--train.max_steps=6", "--train.log_every=1", "--train.eval_every=3", "--optim.warmup_steps=1",
         "--optim.lr=1e-2"]
TRL_NAMES = {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected"}


def pair_rows(n: int, seed: int) -> list[dict]:
    """Prefer repeating the colour the prompt names over another colour."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.sample(WORDS, 2)
        rows.append({"prompt": f"say {a}:", "chosen": f" {a}", "rejected": f" {b}"})
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    return {"root": root, "base": save_base(root / "base"),
            "train": write_jsonl(root / "train.jsonl", pair_rows(32, 1)),
            "valid": write_jsonl(root / "valid.jsonl", pair_rows(6, 2))}


def align_args(data, method: str, out, *extra: str, train=None, valid=None) -> list[str]:
    return ["align", "--checkpoint", str(data["base"]), "--method", method, "--train", str(train or data["train"]),
            "--valid", str(valid or data["valid"]), "--out", str(out), "--max-length", "16", *QUIET, *STEPS, *extra]


def test_dpo_learns_with_trl_metrics_and_a_cached_reference(data, tmp_path):
    out = tmp_path / "dpo"
    code, stdout, err = run(*align_args(data, "dpo", out))
    assert code == 0, err
    train, evals = metrics(out), metrics(out, "eval")
    assert len(train) == 6 and len(evals) == 2
    assert TRL_NAMES <= set(train[0]) and {f"val_{k}" for k in TRL_NAMES} <= set(evals[-1])
    # Step 1: the policy is the reference: log-ratios 0, the loss log 2.
    assert train[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)
    assert train[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert train[-1]["loss"] < train[0]["loss"] and evals[-1]["val_rewards/margins"] > 0
    assert evals[-1]["val_rewards/accuracies"] > 0.5
    assert "| rewards/accuracies " in stdout and "val_rewards/margins " in stdout  # the log lines
    saved = torch.load(out / REFERENCE_FILE, weights_only=True)
    # The validation pairs padded to whole micro-batches (4 pairs): the padding pairs score nothing.
    assert saved["train"].shape == (32, 2) and saved["valid"].shape == (8, 2)
    assert bool((saved["train"] < 0).all()) and bool((saved["valid"][:6] < 0).all())
    assert bool((saved["valid"][6:] == 0).all())
    # Training steps further in the same DIR read the reference back instead of recomputing it.
    code, stdout, err = run(*align_args(data, "dpo", out, "--train.max_steps=7"))
    assert code == 0, err
    assert "reference log-probs read from" in stdout and "computing the reference" not in stdout
    # ... and refuse a reference of other data.
    code, _, err = run(*align_args(data, "dpo", out, "--train.max_steps=8", valid=data["train"]))
    assert_one_error(code, err, REFERENCE_FILE, "other data")


def test_resume_is_exact(data, tmp_path):
    """Steps 3-4 resumed from the step-2 checkpoint in another directory equal the straight run's."""
    short = ["--train.max_steps=4", "--train.eval_every=2"]
    code, _, err = run(*align_args(data, "ipo", tmp_path / "whole", *short, "--train.save_every=2"))
    assert code == 0, err
    step2 = checkpoints_dir(tmp_path / "whole") / step_name(2)
    code, _stdout, err = run(*align_args(data, "ipo", tmp_path / "resumed", *short, f"--train.resume={step2}"))
    assert code == 0, err
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    assert len(resumed) == 2 and resumed == whole[2:]
    assert metrics(tmp_path / "resumed", "eval")[-1] == metrics(tmp_path / "whole", "eval")[-1]


def test_lora_adapter_and_simpo(data, tmp_path):
    out = tmp_path / "lora"
    code, _stdout, err = run(*align_args(data, "simpo", out, "--adapter", "lora", "--beta", "2"))
    assert code == 0, err
    assert not (out / REFERENCE_FILE).exists()  # SimPO has no reference
    assert (out / "adapter_model.safetensors").exists()
    tensors = load_torch(resolve_checkpoint(out, log=None) / "model.pt")
    assert tensors and all(".lora." in k for k in tensors)
    train = metrics(out)
    assert train[-1]["loss"] < train[0]["loss"]
    # SimPO's rewards are β · the mean token log-prob.
    assert train[0]["rewards/chosen"] == pytest.approx(2 * train[0]["logps/chosen"], rel=1e-5)


def test_conversational_lines_use_the_chat_template(data, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": r["rejected"].strip()}]} for r in pair_rows(8, 3)]
    path = write_jsonl(data["root"] / "chat.jsonl", rows)
    code, _stdout, err = run(*align_args(data, "dpo", tmp_path / "chat", "--max-length", "32", "--train.max_steps=2",
                                        train=path, valid=path))
    assert code == 0, err
    # The rows are the rendered conversation: the prompt with the generation prompt, the reply's turn after it.
    texts = preference.pair_texts(Line("chat.jsonl:1", rows[0]), lambda: BUILTIN_TEMPLATE)
    full = render(BUILTIN_TEMPLATE, rows[0]["prompt"] + rows[0]["chosen"])
    assert texts[0] + texts[1] == full and texts[0].endswith("<|assistant|>\n") and texts[3] is False
    data_set = preference.encode_pairs([texts], ["x"], get_tokenizer("gpt2"), 32)
    tokenizer = get_tokenizer("gpt2")
    chosen = [int(t) for t in data_set.targets[0, 0] if t != -100]
    assert tokenizer.decode(chosen) == texts[1]


def assert_one_error(code: int, err: str, *words: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("row,words", [
    ({"prompt": "say red:", "chosen": " red"}, ["bad.jsonl:2", "'rejected'"]),
    ({"prompt": "say red:", "chosen": " red", "rejected": " red"}, ["bad.jsonl:2", "the same"]),
    ({"prompt": "say " + "red " * 30 + ":", "chosen": " red", "rejected": " blue"}, ["bad.jsonl:2", "--max-length"]),
    ({"prompt": "say red:", "chosen": " red", "rejected": 3}, ["bad.jsonl:2", "'rejected'", "not text"]),
    ({"prompt": [{"role": "user", "content": "x"}], "chosen": " red", "rejected": " blue"},
     ["bad.jsonl:2", "'chosen'", "messages"]),
])
def test_bad_lines(data, tmp_path, row, words):
    bad = write_jsonl(tmp_path / "bad.jsonl", [pair_rows(1, 0)[0], row])
    code, _, err = run(*align_args(data, "dpo", tmp_path / "out", train=bad))
    assert_one_error(code, err, *words)
    assert not (tmp_path / "out").exists()


def test_bad_flags(data, tmp_path):
    for flags, words in ((["--beta", "0"], ["--beta"]), (["--label-smoothing", "0.2"], ["IPO"]),
                         (["--parallel.cp=2"], ["parallel.cp"]), (["--train.fused_loss=true"], ["fused_loss"])):
        method = "ipo" if "--label-smoothing" in flags else "dpo"
        code, _, err = run(*align_args(data, method, tmp_path / "out", *flags))
        assert_one_error(code, err, *words)
        assert not (tmp_path / "out").exists()


# The README's "Preference optimisation (DPO)" section's commands (the lead adds the section with exactly these).
README_ALIGN = [
    ".venv/bin/python scripts/make_play_task.py --out data/plays",
    (".venv/bin/python scripts/make_play_prefs.py --plays data/plays --out data/plays-prefs --train-pairs 400 "
     "--valid-pairs 100"),
    (".venv/bin/meshlm align --checkpoint runs/gpt-tiny --method dpo --train data/plays-prefs/train.jsonl "
     "--valid data/plays-prefs/valid.jsonl --max-length 80 --out runs/plays-dpo"),
    (".venv/bin/meshlm align --checkpoint runs/gpt-tiny --method simpo --beta 2 --adapter lora --train "
     "data/plays-prefs/train.jsonl --valid data/plays-prefs/valid.jsonl --max-length 80 --out runs/plays-simpo-lora"),
]


def test_readme_align_commands(tmp_path):
    """The README's alignment commands, as typed, on a narrowed gpt-tiny base (outputs under tmp_path; each
    alignment run two steps)."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.cli_batch import run_meshlm_batch, shell_words
    from tests.conftest import ROOT
    from tests.test_readme_commands import _section_commands

    assert _section_commands("Preference optimisation (DPO)") == README_ALIGN
    base = ["--model.n_layers=2", "--model.hidden_size=32", "--train.micro_batch_size=2", "--train.global_batch_size=2",
            "--train.eval_iters=1", "--train.peak_tflops=1", "--train.max_steps=1", "--train.progress=false",
            "--train.sample_tokens=0", f"--train.out_dir={tmp_path}/runs/gpt-tiny"]
    bin_dir = str(Path(sys.executable).parent)
    typed = []
    for line in README_ALIGN:
        line = line.replace(".venv/bin/", bin_dir + "/").replace("runs/", f"{tmp_path}/runs/")
        line = line.replace("data/plays", f"{tmp_path}/data/plays")
        if " align " in line:
            line += " --train.max_steps=2 --train.progress=false --train.eval_iters=1 --train.peak_tflops=1"
        typed.append(line)
    # The two data scripts, then the base's training and the two `meshlm align` lines in one process
    # (tests/cli_batch.py).
    for line in typed[:2]:
        proc = subprocess.run(["bash", "-c", line], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    aligns = typed[2:]
    batch = run_meshlm_batch([["train", "--config", "gpt-tiny", *base], *(shell_words(ln, ROOT)[1:] for ln in aligns)],
                             cwd=ROOT)
    for line, proc in zip(["(the base) train", *aligns], batch):
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    for name, key in (("plays-dpo", "val_rewards/margins"), ("plays-simpo-lora", "val_rewards/accuracies")):
        assert key in metrics(tmp_path / "runs" / name, "eval")[-1]
    assert (tmp_path / "runs" / "plays-simpo-lora" / "adapter_model.safetensors").exists()
