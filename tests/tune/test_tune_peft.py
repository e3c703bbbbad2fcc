"""Adapters and Hugging Face PEFT, both ways: an adapter `meshlm tune` wrote loads with `peft` onto the base
`meshlm convert --to-hf` wrote and gives meshlm's logits within 1e-5 (LoRA on GPT-2, whose q and v rows share
the fused `c_attn`, and on Llama; prompt tuning and p-tuning as a prompt table); and a LoRA adapter `peft`
made (random B, so the update is not zero) loads into meshlm with PEFT's logits within 1e-5."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch

from meshlm.checkpoint.load import load_model_from_checkpoint
from meshlm.cli import main
from meshlm.tune.export import apply_adapter, read_adapter
from tests.tune.tune_helpers import LLAMA, QUIET, repeat_rows, save_base, write_jsonl

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = 1e-5
CASES = {"gpt2_lora_qv_o_down": ("base", "lora", ["--tune.lora_targets=['q','v','o','down']"]),
         "gpt2_prompt": ("base", "prompt", []),
         "gpt2_ptuning_lstm": ("base", "ptuning", ["--tune.encoder=lstm"]),
         "llama_lora_all": ("llama", "lora", ["--tune.lora_targets=['q','k','v','o','gate','up','down']"])}


def run(*argv: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(list(argv))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    out = {"root": root, "train": write_jsonl(root / "train.jsonl", repeat_rows(32, 1)),
           "valid": write_jsonl(root / "valid.jsonl", repeat_rows(8, 2))}
    for name, model in (("base", None), ("llama", LLAMA)):
        out[name] = save_base(root / name, model)
        assert run("convert", "--checkpoint", str(out[name]), "--to-hf", str(root / f"{name}_hf")) == 0
    return out


def hf_logits(hf_dir, adapter_dir, ids: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
        tuned = peft.PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        return tuned(input_ids=ids).logits[0, -ids.shape[1]:]  # (prompt tuning: the virtual positions first)


def meshlm_logits(base, adapter_dir, ids: torch.Tensor, merge: bool) -> torch.Tensor:
    model, _, cfg = load_model_from_checkpoint(str(base))
    adapter = read_adapter(adapter_dir, cfg, str(base))
    apply_adapter(model, cfg, adapter, merge=merge)
    n = adapter.virtual_tokens
    x = torch.cat([torch.zeros(1, n, dtype=torch.long), ids], 1)
    with torch.no_grad():
        return model(x)[0, n:]


@pytest.mark.parametrize("case", list(CASES))
def test_meshlm_adapter_loads_in_peft(bases, case, tmp_path):
    base, method, extra = CASES[case]
    out = tmp_path / case
    assert run("tune", "--checkpoint", str(bases[base]), "--method", method, "--train", str(bases["train"]),
               "--valid", str(bases["valid"]), "--out", str(out), "--max-length", "20", *QUIET,
               "--train.max_steps=4", "--optim.lr=3e-2", "--optim.warmup_steps=1", *extra) == 0
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    ids = torch.tensor([[50256, 1110, 2266, 25, 4171, 4171]])
    ours = meshlm_logits(bases[base], out, ids, merge=False)
    merged = meshlm_logits(bases[base], out, ids, merge=True)
    with torch.no_grad():
        plain = load_model_from_checkpoint(str(bases[base]))[0](ids)[0]
    assert (ours - plain).abs().max() > 1e-3  # the adapter changes the model: the comparison means something
    theirs = hf_logits(bases["root"] / f"{base}_hf", out, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=TOL)
    torch.testing.assert_close(merged, ours, rtol=0, atol=1e-6)


@pytest.mark.parametrize("base,targets,rslora", [("base", ["c_attn", "c_proj"], False),
                                                 ("llama", ["q_proj", "v_proj", "down_proj"], True)])
def test_peft_adapter_loads_into_meshlm(bases, base, targets, rslora, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(bases["root"] / f"{base}_hf"))
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                 use_rslora=rslora, fan_in_fan_out=base == "base", task_type="CAUSAL_LM")
        tuned = peft.get_peft_model(model, config).eval()
        tuned.save_pretrained(str(tmp_path / "peft"))
    ids = torch.tensor([[50256, 1110, 2266, 25, 4171]])
    with torch.no_grad():
        theirs = tuned(input_ids=ids).logits[0]
    ours = meshlm_logits(bases[base], tmp_path / "peft", ids, merge=False)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=TOL)
    torch.testing.assert_close(meshlm_logits(bases[base], tmp_path / "peft", ids, merge=True), theirs, rtol=0,
                               atol=TOL)
    # and through the command line
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(["generate", "--checkpoint", str(bases[base]), "--adapter", str(tmp_path / "peft"), "--prompt",
                     "say red:", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert out.getvalue().startswith("say red:")
