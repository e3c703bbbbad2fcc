"""`meshlm convert --checkpoint BASE --adapter DIR`: a LoRA merged into its base (W + (α/r)·B·A), written as a
run directory (`--out`), a Hugging Face directory (`--to-hf`) or a GGUF file (`--to-gguf`). References: the base
with the unmerged adapter (meshlm's own forward hook), PEFT's `merge_and_unload` on the exported base, and
meshlm's GGUF reader. Refusals: a prompt adapter, another base's adapter, an --out that is not empty."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from meshlm.checkpoint.load import open_checkpoint
from meshlm.tune.export import apply_adapter, read_adapter
from tests.checkpoint_helpers import load_run
from tests.tune.tune_helpers import LLAMA, QUIET, repeat_rows, run, save_base, write_jsonl

IDS = torch.tensor([[50256, 1110, 2266, 25, 4171, 4171, 318, 257]])
TARGETS = "--tune.lora_targets=['q','k','v','o','gate','up','down']"


def tune(base, data, out, method: str, *extra: str):
    code, _, err = run("tune", "--checkpoint", str(base), "--method", method, "--train", str(data / "train.jsonl"),
                       "--valid", str(data / "valid.jsonl"), "--out", str(out), "--max-length", "16", *QUIET,
                       "--train.max_steps=3", "--optim.lr=3e-2", "--optim.warmup_steps=0", *extra)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny Llama base and a LoRA on every target, tuned three steps (B moved away from its zeros)."""
    root = tmp_path_factory.mktemp("merge")
    write_jsonl(root / "train.jsonl", repeat_rows(16, 1))
    write_jsonl(root / "valid.jsonl", repeat_rows(4, 2))
    base = save_base(root / "base", LLAMA)
    return {"root": root, "base": base, "lora": tune(base, root, root / "lora", "lora", TARGETS)}


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)[0]


def unmerged_logits(base, adapter_dir) -> torch.Tensor:
    """The base with the adapter's update added by its forward hook (`apply_adapter(merge=False)`)."""
    model, _, cfg = load_run(str(base))
    apply_adapter(model, cfg, read_adapter(adapter_dir, cfg, open_checkpoint(base)), merge=False)
    return logits(model)


def test_merged_run_gives_the_base_plus_adapter_logits(tuned, tmp_path):
    out = tmp_path / "merged"
    code, stdout, err = run("convert", "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]),
                            "--out", str(out))
    assert code == 0, err
    assert stdout.startswith("wrote ")
    model, _, cfg = load_run(str(out))
    assert cfg.tune.method == "none" and cfg.data.tokenizer == "gpt2"
    assert not any(".lora." in name for name in model.state_dict())
    plain, expected = logits(load_run(str(tuned["base"]))[0]), unmerged_logits(tuned["base"], tuned["lora"])
    assert (expected - plain).abs().max() > 1e-3  # the adapter changes the model: the comparison means something
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=1e-5)
    code, stdout, err = run("generate", "--checkpoint", str(out), "--prompt", "say red:", "--max-new-tokens", "2",
                            "--temperature", "0")
    assert code == 0 and stdout.startswith("say red:"), err


def test_merged_weights_equal_peft_merge_and_unload(tuned, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    base_hf, merged_hf = tmp_path / "base_hf", tmp_path / "merged_hf"
    assert run("convert", "--checkpoint", str(tuned["base"]), "--to-hf", str(base_hf))[0] == 0
    code, _, err = run("convert", "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]),
                       "--to-hf", str(merged_hf))
    assert code == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base_hf), dtype=torch.float32)
        theirs = peft.PeftModel.from_pretrained(model, str(tuned["lora"])).merge_and_unload().state_dict()
    ours = load_file(str(merged_hf / "model.safetensors"))
    assert set(ours) == set(theirs)
    base = load_file(str(base_hf / "model.safetensors"))
    changed = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert len(changed) == 7 * LLAMA["n_layers"]  # every target linear of every layer, nothing else
    for name, value in ours.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-6, msg=name)
    assert (merged_hf / "tokenizer.json").exists()


def test_to_gguf_with_adapter_reads_back_to_the_merged_logits(tuned, tmp_path):
    pytest.importorskip("gguf")
    file, back = tmp_path / "merged.gguf", tmp_path / "back"
    code, _, err = run("convert", "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]),
                       "--to-gguf", str(file), "--outtype", "f32")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.gguf"]  # the temporary merged run is gone
    assert run("convert", "--from-gguf", str(file), "--out", str(back))[0] == 0
    torch.testing.assert_close(logits(load_run(str(back))[0]), unmerged_logits(tuned["base"], tuned["lora"]),
                               rtol=0, atol=1e-5)


def refused(tmp_path, *argv: str) -> str:
    """Exit 2, one line on stderr, nothing printed and nothing new under `tmp_path`."""
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run("convert", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert sorted(tmp_path.rglob("*")) == before
    return err


def test_prompt_adapter_is_refused(tuned, tmp_path):
    prompt = tune(tuned["base"], tuned["root"], tuned["root"] / "ptuning", "ptuning")
    for target in (["--out", str(tmp_path / "m")], ["--to-gguf", str(tmp_path / "m.gguf")]):
        err = refused(tmp_path, "--checkpoint", str(tuned["base"]), "--adapter", str(prompt), *target)
        assert "is a ptuning adapter" in err and "cannot be merged" in err and "--adapter on meshlm generate" in err


def test_adapter_of_other_weights_is_refused(tuned, tmp_path):
    other = save_base(tmp_path / "other", LLAMA, seed=1)  # the same shapes, other weights
    err = refused(tmp_path, "--checkpoint", str(other), "--adapter", str(tuned["lora"]), "--out", str(tmp_path / "m"))
    assert "was tuned on other weights" in err and str(tuned["base"]) in err
    gpt2 = save_base(tmp_path / "gpt2")
    err = refused(tmp_path, "--checkpoint", str(gpt2), "--adapter", str(tuned["lora"]), "--to-hf", str(tmp_path / "h"))
    assert "was tuned on another base model" in err


def test_existing_out_and_wrong_flags_are_refused(tuned, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = refused(tmp_path, "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]), "--out", str(out))
    assert "is not empty" in err
    assert (out / "keep.txt").read_text() == "mine"
    err = refused(tmp_path, "--checkpoint", str(tuned["base"]), "--adapter", str(tuned["lora"]))
    assert "takes one of --out" in err
    err = refused(tmp_path, "--checkpoint", str(tuned["lora"]), "--adapter", str(tuned["lora"]), "--out",
                  str(tmp_path / "m"))
    assert "is a meshlm tune run" in err
    meta = json.loads((tuned["lora"] / "adapter.json").read_text())
    assert meta["method"] == "lora"
