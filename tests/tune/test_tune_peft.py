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

from meshlm.checkpoint.load import open_checkpoint
from meshlm.cli import main
from meshlm.tune.export import apply_adapter, read_adapter
from tests.checkpoint_helpers import load_run
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
    model, _, cfg = load_run(str(base))
    adapter = read_adapter(adapter_dir, cfg, open_checkpoint(base))
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
        plain = load_run(str(bases[base]))[0](ids)[0]
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


PLAIN_PROMPTS = ["say gold:", "say red: say", "blue"]


def peft_greedy(hf_dir, adapter_dir, prompts: list[str], n: int) -> list[list[int]]:
    """New token ids of each prompt as PEFT's docs call a LoRA adapter: the base and the tokenizer from the
    exported directory, `PeftModel.from_pretrained`, `tokenizer(prompt)` as it is, `generate(**inputs)`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
        out = []
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            ids = model.generate(**inputs, max_new_tokens=n, do_sample=False)
            out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


def test_lora_generates_as_peft_users_call_it(bases, tmp_path):
    """Greedy, token for token: meshlm's engine (`meshlm serve`) and `meshlm generate --adapter` give what the
    exported adapter gives through PEFT called as its docs show, with nothing prepended by hand."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.infer.adapters import AdapterSet
    from meshlm.infer.engine import Engine, SamplingParams

    out, n = tmp_path / "lora", 6
    assert run("tune", "--checkpoint", str(bases["base"]), "--method", "lora", "--train", str(bases["train"]),
               "--valid", str(bases["valid"]), "--out", str(out), "--max-length", "20", *QUIET,
               "--train.max_steps=4", "--optim.lr=3e-2", "--optim.warmup_steps=1",
               "--tune.lora_targets=['q','v','o','down']") == 0
    theirs = peft_greedy(bases["root"] / "base_hf", out, PLAIN_PROMPTS, n)
    model, tok, cfg = load_run(str(bases["base"]))
    engine = Engine(model, tok, adapters=AdapterSet(model, cfg, [("lora", read_adapter(out, cfg, open_checkpoint(bases["base"])))]))
    greedy = SamplingParams(max_tokens=n, temperature=0)
    ours = [r.output_ids for r in engine.generate([tok.encode(p) for p in PLAIN_PROMPTS], greedy, [1] * 3)]
    assert ours == theirs
    # an end-of-document token before the prompt changes this adapter's answers: the comparison could fail
    after_eod = [r.output_ids for r in engine.generate([[tok.eod_id] + tok.encode(p) for p in PLAIN_PROMPTS],
                                                       greedy, [1] * 3)]
    assert after_eod != theirs
    gpt2 = get_tokenizer("gpt2")
    for prompt, ids in zip(PLAIN_PROMPTS, theirs):
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["generate", "--checkpoint", str(bases["base"]), "--adapter", str(out), "--prompt", prompt,
                         "--max-new-tokens", str(n), "--temperature", "0", "--ignore-eos"]) == 0
        assert printed.getvalue().startswith(prompt + gpt2.decode(ids)), (printed.getvalue(), ids)


def test_a_tuning_row_starts_with_the_exported_tokenizers_ids(bases):
    """A LoRA row holds exactly `tokenizer(input)` of the exported tokenizer, then the output (no document
    start before it); a prompt row puts only the virtual tokens' placeholders first; an empty input becomes
    one end-of-document token (the first output token needs a position to be predicted from)."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.models.loss import IGNORE_INDEX as IGNORE
    from meshlm.tune.data import encode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(bases["root"] / "base_hf"))
    tok = get_tokenizer("gpt2")
    items = [("", "say red:", " red"), ("", "", " gold")]
    lora, _ = encode(items, ["a:1", "a:2"], tok, 12, 0, [], False)
    prompt = hf_tok("say red:")["input_ids"]
    answer = tok.encode(" red") + [tok.eod_id]
    assert lora.ids[0, :len(prompt) + len(answer)].tolist() == prompt + answer
    assert lora.targets[0, len(prompt) - 1:len(prompt) + 1].tolist() == answer
    assert (lora.targets[0, :len(prompt) - 1] == IGNORE).all()
    assert lora.ids[1, :3].tolist() == [tok.eod_id, *tok.encode(" gold"), tok.eod_id]
    virtual, _ = encode(items[:1], ["a:1"], tok, 12, 3, [], False)
    assert virtual.ids[0, :3 + len(prompt)].tolist() == [0, 0, 0] + prompt
