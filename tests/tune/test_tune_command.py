"""`meshlm tune` end to end on one process: the base stays bit-identical while the adapter learns, the
checkpoints hold only the adapter, resuming is exact, several tasks get their own prompts, the adapter
serves through `meshlm generate --adapter`, and bad input is one clear line with exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import pytest
import torch

from meshlm.checkpoint.files import checkpoints_dir, load_torch, step_name
from meshlm.checkpoint.load import open_checkpoint
from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from tests.tune.tune_helpers import (
    LLAMA,
    QUIET,
    metrics,
    repeat_rows,
    run,
    save_base,
    task_rows,
    train_losses,
    write_jsonl,
)

STEPS = ["--train.max_steps=8", "--train.log_every=1", "--train.eval_every=4", "--optim.warmup_steps=1",
         "--optim.lr=2e-2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    return {"root": root, "base": save_base(root / "base"), "llama": save_base(root / "llama", LLAMA),
            "train": write_jsonl(root / "train.jsonl", repeat_rows(48, 1)),
            "valid": write_jsonl(root / "valid.jsonl", repeat_rows(12, 2))}


def tune_args(data, method: str, out, *extra: str, base: str = "base") -> list[str]:
    return ["tune", "--checkpoint", str(data[base]), "--method", method, "--train", str(data["train"]), "--valid",
            str(data["valid"]), "--out", str(out), "--max-length", "16", *QUIET, *STEPS, *extra]


@pytest.mark.parametrize("method,base", [("lora", "base"), ("prompt", "base"), ("ptuning", "llama")])
def test_base_bit_identical_and_adapter_learns(data, method, base, tmp_path):
    """The Trainer of `meshlm tune`, kept in hand: every base parameter after training equals the base
    checkpoint's exactly, the adapter moved, the loss fell, and the checkpoint holds only the adapter."""
    from meshlm.commands.train import build_trainer
    from meshlm.tune.command import prepare

    parser = argparse.ArgumentParser()
    from meshlm.commands.tune import add_tune_command, tune_options

    add_tune_command(parser.add_subparsers())
    args, overrides = parser.parse_known_args(tune_args(data, method, tmp_path / "run", base=base))
    with contextlib.redirect_stdout(io.StringIO()):
        cfg, tok, train, valid, _ = prepare(tune_options(args), overrides)
        trainer = build_trainer(cfg, datasets=(tok, train, valid))
        assert trainer.model.loss_on_target_rows  # the fused head runs on the answers' rows only
        first = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.run()
    base_state = load_model_state(resolve_checkpoint(data[base], log=None))
    params = dict(trainer.model.named_parameters())
    frozen = [n for n, p in params.items() if not p.requires_grad]
    assert frozen and set(frozen) == {n for n in base_state if n in params}  # (a tied head is the embedding)
    for name in frozen:
        assert torch.equal(params[name].detach(), base_state[name]), name
    assert first and all(not torch.equal(first[n], params[n].detach()) for n in first)
    losses = train_losses(tmp_path / "run")
    assert losses[-1] < losses[0] - 0.01, losses  # (a random base: the logits start near uniform)
    saved = load_torch(resolve_checkpoint(tmp_path / "run", log=None) / "model.pt")
    assert set(saved) == set(first)
    marker = ".lora." if method == "lora" else "prompt."
    assert all(marker in n for n in saved)
    optim = load_torch(resolve_checkpoint(tmp_path / "run", log=None) / "optim.pt")
    assert set(optim) == set(first) and all(set(s) >= {"exp_avg", "exp_avg_sq"} for s in optim.values())


def test_resume_is_exact(data, tmp_path):
    """Steps 5-8 resumed from the step-4 checkpoint in another directory equal the straight run's."""
    code, _, err = run(*tune_args(data, "lora", tmp_path / "whole", "--train.save_every=4"))
    assert code == 0, err
    step4 = checkpoints_dir(tmp_path / "whole") / step_name(4)
    code, stdout, err = run(*tune_args(data, "lora", tmp_path / "resumed", f"--train.resume={step4}"))
    assert code == 0, err
    assert "resumed from" in stdout
    whole, resumed = train_losses(tmp_path / "whole"), train_losses(tmp_path / "resumed")
    assert len(resumed) == 4 and resumed == whole[4:]
    a = load_torch(resolve_checkpoint(tmp_path / "whole", log=None) / "model.pt")
    b = load_torch(resolve_checkpoint(tmp_path / "resumed", log=None) / "model.pt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_several_tasks_with_templates_and_generate(data, tmp_path):
    root = data["root"]
    train = write_jsonl(root / "tasks_train.jsonl", task_rows(64, 3))
    valid = write_jsonl(root / "tasks_valid.jsonl", task_rows(16, 4))
    out = tmp_path / "tasks"
    code, stdout, err = run("tune", "--checkpoint", str(data["base"]), "--method", "prompt", "--train", str(train),
                            "--valid", str(valid), "--out", str(out), "--max-length", "24", "--template",
                            "first=first of {a} {b}:{answer}", "--template", "last=last of {a} {b}:{answer}",
                            *QUIET, *STEPS)
    assert code == 0, err
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["tasks"] == ["first", "last"] and meta["method"] == "prompt"
    assert meta["peft"].startswith("not written")  # PEFT's prompt tuning holds one prompt
    table = load_torch(resolve_checkpoint(out, log=None) / "model.pt")["prompt.table"]
    assert tuple(table.shape) == (2, 10, 32)
    outputs = {}
    for task in ("first", "last"):
        code, stdout, err = run("generate", "--checkpoint", str(data["base"]), "--adapter", str(out), "--task", task,
                                "--prompt", "first of red blue:", "--max-new-tokens", "2", "--temperature", "0")
        assert code == 0, err
        outputs[task] = stdout
    assert all(o.startswith("first of red blue:") for o in outputs.values())
    code, _, err = run("generate", "--checkpoint", str(data["base"]), "--adapter", str(out), "--prompt", "x")
    assert code == 2 and "choose one with --task" in err


def test_generate_with_lora_adapter_equals_merged_model(data, tmp_path):
    """`meshlm generate --adapter` gives the tokens of the base with the update merged by hand."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.models.generate import generate
    from meshlm.tune.export import apply_adapter, read_adapter
    from tests.checkpoint_helpers import load_run

    out = tmp_path / "lora"
    assert run(*tune_args(data, "lora", out, "--tune.lora_targets=['qkv','down']", "--optim.lr=1e-2"))[0] == 0
    code, stdout, err = run("generate", "--checkpoint", str(data["base"]), "--adapter", str(out), "--prompt",
                            "say gold:", "--max-new-tokens", "3", "--temperature", "0", "--ignore-eos")
    assert code == 0, err
    model, _, cfg = load_run(str(data["base"]))
    apply_adapter(model, cfg, read_adapter(out, cfg, open_checkpoint(data["base"])), merge=False)
    tok = get_tokenizer("gpt2")
    ids = torch.tensor([tok.encode("say gold:")])  # nothing before the prompt, as tuning rows begin
    want = tok.decode(generate(model, ids, 3, temperature=0)[0].tolist())
    assert stdout.rstrip("\n") == want


def assert_one_error(code: int, err: str, *words: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bad_inputs(data, tmp_path):
    root = data["root"]
    out = tmp_path / "lora"
    assert run(*tune_args(data, "lora", out))[0] == 0
    # An adapter for another base: other shapes, or the same shapes with other weights.
    code, _, err = run("generate", "--checkpoint", str(data["llama"]), "--adapter", str(out), "--prompt", "x")
    assert_one_error(code, err, "another base model")
    other = save_base(root / "other", seed=5)
    code, _, err = run("generate", "--checkpoint", str(other), "--adapter", str(out), "--prompt", "x")
    assert_one_error(code, err, "other weights", "fingerprint")
    # An unknown LoRA target.
    code, _, err = run(*tune_args(data, "lora", tmp_path / "bad1", "--tune.lora_targets=['q','attn']"))
    assert_one_error(code, err, "tune.lora_targets", "'attn'")
    assert not (tmp_path / "bad1").exists()
    # A template field missing from a line.
    train = write_jsonl(root / "missing.jsonl", [{"taskname": "first", "a": "red", "answer": "red"}])
    code, _, err = run("tune", "--checkpoint", str(data["base"]), "--method", "prompt", "--train", str(train),
                       "--valid", str(train), "--out", str(tmp_path / "bad2"), "--template",
                       "first=first of {a} {b}:{answer}")
    assert_one_error(code, err, "missing.jsonl:1", "'b'")
    assert not (tmp_path / "bad2").exists()
    # A template without {answer} at its end, an example too long, a line without output.
    code, _, err = run("tune", "--checkpoint", str(data["base"]), "--method", "prompt", "--train", str(train),
                       "--valid", str(train), "--out", str(tmp_path / "bad3"), "--template", "first={a} {answer} {b}")
    assert_one_error(code, err, "must end with {answer}")
    long = write_jsonl(root / "long.jsonl", [{"input": "word " * 40, "output": " red"}])
    code, _, err = run(*tune_args(data, "lora", tmp_path / "bad4")[:6], str(long), "--valid", str(long), "--out",
                       str(tmp_path / "bad4"), "--max-length", "16")
    assert_one_error(code, err, "long.jsonl:1", "--truncate")
    # Virtual tokens need a model with an embedding they can replace; ZeRO is refused with an adapter.
    code, _, err = run(*tune_args(data, "lora", tmp_path / "bad5", "--parallel.zero=1"))
    assert_one_error(code, err, "parallel.zero")
    # The same DIR again with another method.
    code, _, err = run(*tune_args(data, "prompt", out))
    assert_one_error(code, err, "method='lora'")


def test_tune_metrics_and_eval(data, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(*tune_args(data, "lora", out))
    assert code == 0, err
    evals = metrics(out, "eval")
    assert [e["step"] for e in evals] == [4, 8]
    assert all("val_loss" in e and "val_bpb" not in e for e in evals)
    assert "adapter parameters" in stdout and "trainable" in stdout
    assert "adapter in adapter.json" in stdout


def test_bert_lora_with_a_new_head(tmp_path):
    """A BERT checkpoint with `--task classify`: LoRA on the frozen encoder, the new head trains too, and the
    checkpoint holds those alone; PEFT's files are not written (they would lack the head), and say so."""
    from tests.train.finetune_helpers import classify_rows
    from tests.train.finetune_helpers import save_base as save_bert

    base = save_bert(tmp_path / "bert", dropout=0.0)
    train = write_jsonl(tmp_path / "train.jsonl", classify_rows(32, 1))
    valid = write_jsonl(tmp_path / "valid.jsonl", classify_rows(8, 2))
    out = tmp_path / "run"
    code, _, err = run("tune", "--checkpoint", str(base), "--method", "lora", "--task", "classify", "--train",
                       str(train), "--valid", str(valid), "--out", str(out), *QUIET, "--train.max_steps=3",
                       "--tune.lora_targets=['qkv','down']")
    assert code == 0, err
    saved = load_torch(resolve_checkpoint(out, log=None) / "model.pt")
    assert {k for k in saved if ".lora." not in k} == {"task_head.weight", "task_head.bias"}
    assert sum(".lora." in k for k in saved) == 2 * 2 * 2  # A and B, two targets, two layers
    meta = json.loads((out / "adapter.json").read_text())
    assert meta["heads"] == ["task_head.bias", "task_head.weight"] and meta["peft"].startswith("not written")
    assert "val_accuracy" in metrics(out, "eval")[-1]


def test_full_fine_tuning_trains_every_weight(data, tmp_path):
    out = tmp_path / "full"
    code, stdout, err = run(*tune_args(data, "full", out))
    assert code == 0, err
    assert "the fine-tuned model is" in stdout and not (out / "adapter.json").exists()
    base = load_model_state(resolve_checkpoint(data["base"], log=None))
    tuned = load_model_state(resolve_checkpoint(out, log=None))
    assert set(base) == set(tuned) and all(not torch.equal(base[k], tuned[k]) for k in base if "norm" not in k)
