"""A released model's own end of sequence through import, generation, serving and export: tiny Llamas whose
tokenizers declare DeepSeek's, ChatML's or Llama 3's eos import with `meshlm convert --from-hf`, and a
generation_config.json listing two ids makes `meshlm generate`, `models.generate` and the serving engine stop
at each, as transformers' generate does on the same directory."""

from __future__ import annotations

import pytest
import torch
import transformers
from interop_helpers import ok

from meshlm.data.tokenizers import get_tokenizer
from meshlm.infer.chat import load_chat_model
from meshlm.infer.engine import Engine, SamplingParams
from meshlm.models.generate import generate
from tests.interop.hf_tiny import STYLES, write_hf_dir

# a → b → c → <|im_end|> and x → y → <|endoftext|>: each chain ends at one of the two declared ids
CHAINS = [["a", "b", "c", "<|im_end|>", "hello"], ["x", "y", "<|endoftext|>", "there"]]
STOPS = ["<|im_end|>", "<|endoftext|>"]


@pytest.mark.parametrize("style, eos_as_dict", [("deepseek", True), ("chatml", False), ("llama3", True)])
def test_each_declared_eos_imports_and_exports(tmp_path, style, eos_as_dict):
    eos = STYLES[style][1]
    _, tok = write_hf_dir(tmp_path / "hf", style, [["a", "b"]], [eos, "<|im_start|>"], eos_as_dict)
    ok(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    carried = tmp_path / "run" / "hf"
    assert (carried / "generation_config.json").is_file() and (carried / "tokenizer_config.json").is_file()
    _, ours, _ = load_chat_model(str(tmp_path / "run"), "cpu")
    want = [tok.token_to_id(eos), tok.token_to_id("<|im_start|>")]
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token_id == want[0]
    assert (ours.eod_id, list(ours.stop_ids)) == (want[0], want)

    ok(["convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")])
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).eos_token_id == want[0]
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "out")).eos_token_id == want
    assert get_tokenizer(str(tmp_path / "out")).stop_ids == ours.stop_ids


def test_a_bare_tokenizer_exports_its_end_of_document_as_eos_token(tmp_path):
    """A run on a tokenizer.json that declares nothing: --to-hf declares the end of document it used."""
    from meshlm.data.tokenizers import train_bpe
    from meshlm.interop.hf_files import write_tokenizer_files

    path = train_bpe(["to be or not to be"] * 3, 300, tmp_path / "tok")
    (tmp_path / "out").mkdir()
    write_tokenizer_files(str(path), tmp_path / "out", 64)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).eos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """A ChatML-style import whose greedy continuations are CHAINS, with both STOPS declared."""
    tmp = tmp_path_factory.mktemp("steered")
    hf, tok = write_hf_dir(tmp / "hf", "chatml", CHAINS, STOPS)
    ok(["convert", "--from-hf", str(tmp / "hf"), "--out", str(tmp / "run")])
    return tmp, hf, tok


def _hf_greedy(hf, folder, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, with the directory's generation_config.json (its eos ids)."""
    config = transformers.GenerationConfig.from_pretrained(str(folder))
    config.max_new_tokens, config.do_sample, config.pad_token_id = n, False, 0
    out = hf.generate(torch.tensor([ids]), generation_config=config)
    return out[0, len(ids):].tolist()


def test_generate_stops_at_each_declared_id_as_transformers_does(steered):
    tmp, hf, tok = steered
    for start, stop in (("a", "<|im_end|>"), ("x", "<|endoftext|>")):
        theirs = _hf_greedy(hf, tmp / "hf", [tok.token_to_id(start)], 10)
        assert theirs[-1] == tok.token_to_id(stop)  # transformers stops there, and keeps the stop id
        printed = ok(["generate", "--checkpoint", str(tmp / "run"), "--prompt", start, "--max-new-tokens", "10",
                      "--temperature", "0"])
        assert printed == tok.decode([tok.token_to_id(start), *theirs[:-1]]) + "\n"

    model, ours, _ = load_chat_model(str(tmp / "run"), "cpu")
    prompt = torch.tensor([[tok.token_to_id("a")], [tok.token_to_id("x")]])
    out = generate(model, prompt, 10, temperature=0, stop_ids=ours.stop_ids)
    assert out[0].tolist() == [tok.token_to_id(t) for t in CHAINS[0][:4]]  # a b c <|im_end|>: both rows stopped
    assert generate(model, prompt, 10, temperature=0).shape[1] == 11  # no stop ids: all 10 tokens


def test_the_engine_stops_at_each_declared_id_unless_told_to_ignore_eos(steered):
    tmp, hf, tok = steered
    model, ours, _ = load_chat_model(str(tmp / "run"), "cpu")
    engine = Engine(model, ours, max_seqs=2, max_len=32)
    prompts = [[tok.token_to_id("a")], [tok.token_to_id("x")]]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
    for req, prompt in zip(reqs, prompts):
        assert req.finish_reason == "stop"
        assert req.output_ids == _hf_greedy(hf, tmp / "hf", prompt, 10)
        assert req.text == tok.decode(req.output_ids[:-1])
    ignored = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert [r.finish_reason for r in ignored] == ["length", "length"]
    assert ignored[1].output_ids[:3] == [tok.token_to_id(t) for t in ("y", "<|endoftext|>", "there")]
    # a logit_bias that forces <|endoftext|> from the first token stops there too
    forced = engine.generate([prompts[0]], SamplingParams(max_tokens=10, temperature=0,
                                                          logit_bias={tok.token_to_id("<|endoftext|>"): 100.0}))
    assert forced[0].output_ids == [tok.token_to_id("<|endoftext|>")] and forced[0].finish_reason == "stop"
