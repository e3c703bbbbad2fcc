"""LoRA on multi-head latent attention (`model.attention='mla'`, DeepSeek-V3; models/mla.py `lora_targets`).

MLA has no fused qkv: its LoRA targets are its own linears, named as Hugging Face DeepSeek-V3's modules, which
PEFT's `target_modules` name too: `q_a_proj`/`q_b_proj` (q_down/q_up; `q_proj` without q compression),
`kv_a_proj_with_mqa` (kv_down), `kv_b_proj` (kv_up), and `o` (proj) as for every attention. A tiny DeepSeek-V3
built by `transformers` (perturbed; a dense first layer, then experts) is imported with `meshlm convert
--from-hf` and tuned by `meshlm tune`; the adapter `peft` loads onto the transformers model gives meshlm's logits
within 1e-5 (V3's q compression, and V2-Lite's plain q_proj), as does the base merged
with it (`meshlm convert --adapter --to-hf`, read by transformers); a LoRA `peft` made (random B) loads into
meshlm with PEFT's logits. Names the model lacks (q/k/v on MLA, MLA's names on multi-head attention, q_proj beside
q compression) are one error line each, and nothing is written."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshlm.checkpoint.load import open_checkpoint
from meshlm.tune.export import apply_adapter, read_adapter
from tests.checkpoint_helpers import load_run
from tests.interop.interop_helpers import perturbed
from tests.tune.tune_helpers import LLAMA, QUIET, repeat_rows, run, save_base, write_jsonl

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TOL = 1e-5
SHAPE = {"vocab_size": 50257, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
         "n_routed_experts": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
         "max_position_embeddings": 32, "tie_word_embeddings": False}
BASES = {"v3": 24, "v2_lite": None}  # q_lora_rank
CASES = {"v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o"],
         "v2_lite": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj"]}
IDS = torch.tensor([[50256, 1110, 2266, 25, 4171, 4171, 318]])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_lora")
    out = {"root": root, "train": write_jsonl(root / "train.jsonl", repeat_rows(16, 1)),
           "valid": write_jsonl(root / "valid.jsonl", repeat_rows(4, 2))}
    for name, q_rank in BASES.items():
        torch.manual_seed(0)
        hf = perturbed(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**SHAPE,
                                                                                            "q_lora_rank": q_rank})))
        hf.save_pretrained(str(root / f"{name}_hf"))
        code, _, err = run("convert", "--from-hf", str(root / f"{name}_hf"), "--out", str(root / name))
        assert code == 0, err
        out[name] = root / name
    return out


def tune(bases, base: str, out, targets: list[str]) -> tuple[int, str]:
    code, _, err = run("tune", "--checkpoint", str(bases[base]), "--method", "lora", "--train", str(bases["train"]),
                       "--valid", str(bases["valid"]), "--out", str(out), "--max-length", "16", *QUIET,
                       "--train.max_steps=3", "--optim.lr=3e-2", "--optim.warmup_steps=0",
                       f"--tune.lora_targets={targets!r}")
    return code, err


def hf_model(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.DeepseekV3ForCausalLM.from_pretrained(str(path)).eval()


def meshlm_logits(base, adapter_dir, merge: bool) -> torch.Tensor:
    model, _, cfg = load_run(str(base))
    if adapter_dir is not None:
        apply_adapter(model, cfg, read_adapter(adapter_dir, cfg, open_checkpoint(base)), merge=merge)
    with torch.no_grad():
        return model(IDS)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_meshlm_lora_on_mla_loads_in_peft_and_merges(bases, case, tmp_path):
    out = tmp_path / "lora"
    code, err = tune(bases, case, out, CASES[case])
    assert code == 0, err
    ours = meshlm_logits(bases[case], out, merge=False)
    assert (ours - meshlm_logits(bases[case], None, merge=False)).abs().max() > 1e-3  # the adapter trained
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuned = peft.PeftModel.from_pretrained(hf_model(bases["root"] / f"{case}_hf"), str(out)).eval()
    with torch.no_grad():
        theirs = tuned(input_ids=IDS).logits[0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=TOL)
    torch.testing.assert_close(meshlm_logits(bases[case], out, merge=True), ours, rtol=0, atol=1e-6)
    code, _, err = run("convert", "--checkpoint", str(bases[case]), "--adapter", str(out), "--to-hf",
                       str(tmp_path / "merged_hf"))
    assert code == 0, err
    with torch.no_grad():
        merged = hf_model(tmp_path / "merged_hf")(input_ids=IDS).logits[0]
    torch.testing.assert_close(merged, ours, rtol=0, atol=TOL)
    if "kv_b_proj" in CASES[case]:  # the engine's latent cache cannot apply kv_b_proj's update per request
        from meshlm.core.config import ConfigError
        from meshlm.infer.adapters import AdapterSet

        model, _, cfg = load_run(str(bases[case]))
        with pytest.raises(ConfigError, match="adapts kv_b_proj"):
            AdapterSet(model, cfg, [("a", read_adapter(out, cfg, open_checkpoint(bases[case])))])


def test_runtime_lora_serving_answers_base_requests_on_mla(bases):
    """--allow-runtime-lora hooks every linear at start; MLA's absorbed decode still serves the base."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.infer.adapters import AdapterSet
    from meshlm.infer.engine import Engine
    from meshlm.infer.sampling import SamplingParams

    model, _, cfg = load_run(str(bases["v3"]))
    tok = get_tokenizer(cfg.data.tokenizer)
    prompt = IDS[0].tolist()
    plain = Engine(model, tok, max_seqs=1, max_len=24).generate([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    hooked = Engine(model, tok, max_seqs=1, max_len=24, adapters=AdapterSet(model, cfg, [], runtime=True))
    again = hooked.generate([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    assert again.error is None and len(again.output_ids) == 8 and again.output_ids == plain.output_ids


def test_peft_lora_on_deepseek_v3_loads_into_meshlm(bases, tmp_path):
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                 task_type="CAUSAL_LM")
        tuned = peft.get_peft_model(hf_model(bases["root"] / "v3_hf"), config).eval()
        tuned.save_pretrained(str(tmp_path / "peft"))
    with torch.no_grad():
        theirs = tuned(input_ids=IDS).logits[0]
    for merge in (False, True):
        torch.testing.assert_close(meshlm_logits(bases["v3"], tmp_path / "peft", merge), theirs, rtol=0, atol=TOL)


@pytest.mark.parametrize("base, targets, words", [
    ("v3", ["q", "v"], ["'q'", "model.attention='mla'", "q_a_proj", "kv_b_proj"]),
    ("v3", ["q_proj"], ["'q_proj'", "model.q_lora_rank=24", "q_a_proj"]),
    ("v2_lite", ["q_a_proj"], ["'q_a_proj'", "model.q_lora_rank=0", "q_proj"]),
    ("llama", ["kv_b_proj"], ["'kv_b_proj'", "model.attention='mha'", "qkv"]),
])
def test_targets_the_model_lacks_are_one_error_line(bases, base, targets, words, tmp_path):
    if base == "llama":
        bases = {**bases, "llama": save_base(tmp_path / "llama", LLAMA)}
    code, err = tune(bases, base, tmp_path / "bad", targets)
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: tune.lora_targets"), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "bad").exists()
