"""The end of sequence a tokenizer's folder declares (tokenizer_config.json's eos_token, generation_config.json's
eos_token_id) is the tokenizer's eod_id and stop_ids, as transformers reads the same files; the fixed list of
usual names is only the fallback of a bare tokenizer.json."""

from __future__ import annotations

import json

import pytest
import transformers

from meshlm.core.config import ConfigError
from meshlm.data.tokenizers import HFTokenizer, train_bpe
from tests.interop.hf_tiny import STYLES, word_tokenizer


def _folder(tmp_path, style, eos_as_dict=False, generation=None, config_eos=True):
    specials, eos = STYLES[style]
    tok = word_tokenizer(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}
    if config_eos:
        config["eos_token"] = {"__type": "AddedToken", "content": eos, "special": True} if eos_as_dict else eos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation is not None:
        ids = tok.get_vocab()
        value = ids[generation] if isinstance(generation, str) else [ids[t] for t in generation]
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    return tok


def _theirs(folder) -> tuple[int | None, set[int]]:
    """(eos_token_id, the generation stop ids) as transformers reads the folder."""
    eos = transformers.AutoTokenizer.from_pretrained(str(folder)).eos_token_id
    stops: set[int] = set()
    if (folder / "generation_config.json").exists():
        ids = transformers.GenerationConfig.from_pretrained(str(folder)).eos_token_id
        stops = set(ids if isinstance(ids, list) else [ids])
    return eos, stops


@pytest.mark.parametrize("style, eos_as_dict, generation", [
    ("deepseek", True, None),
    ("deepseek", False, "<｜end▁of▁sentence｜>"),
    ("chatml", False, ["<|im_end|>", "<|endoftext|>"]),
    ("llama3", True, ["<|eot_id|>", "<|im_end|>"]),
])
def test_the_declared_eos_is_the_end_of_document_and_every_listed_id_stops(tmp_path, style, eos_as_dict,
                                                                             generation):
    _folder(tmp_path, style, eos_as_dict, generation)
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json", str(tmp_path))
    eos, stops = _theirs(tmp_path)
    assert ours.eod_id == eos and ours.eod_token == STYLES[style][1]
    assert ours.stop_ids[0] == eos and set(ours.stop_ids) == stops | {eos}


def test_generation_config_alone_declares_the_end(tmp_path):
    """No eos_token in tokenizer_config.json: generation_config.json's first id is the end of document."""
    tok = _folder(tmp_path, "deepseek", generation=["<|im_end|>", "<｜end▁of▁sentence｜>"], config_eos=False)
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json", "t")
    assert ours.eod_id == tok.token_to_id("<|im_end|>")
    assert ours.stop_ids == (tok.token_to_id("<|im_end|>"), tok.token_to_id("<｜end▁of▁sentence｜>"))


def test_special_tokens_map_declares_when_tokenizer_config_does_not(tmp_path):
    tok = _folder(tmp_path, "llama3", config_eos=False)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json", "t")
    assert ours.eod_id == tok.token_to_id("<|eot_id|>") == _theirs(tmp_path)[0]


def test_a_bare_tokenizer_json_falls_back_to_the_usual_names(tmp_path):
    """What `meshlm tokenizer train` writes declares nothing: <|endoftext|> (id 0) ends documents, alone."""
    path = train_bpe(["to be or not to be"] * 3, 300, tmp_path)
    ours = HFTokenizer.from_file(path, "t")
    assert (ours.eod_id, ours.eod_token, ours.stop_ids) == (0, "<|endoftext|>", (0,))


def test_a_deepseek_tokenizer_without_a_declaration_is_refused_by_name(tmp_path):
    _folder(tmp_path, "deepseek", config_eos=False)
    with pytest.raises(ConfigError, match="declares no eos_token.*tokenizer_config.json"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json", "t")


@pytest.mark.parametrize("config, generation, words", [
    ({"eos_token": "<|nope|>"}, None, ["tokenizer_config.json", "<|nope|>"]),
    ({"eos_token": "<|eot_id|>"}, {"eos_token_id": [5, 999]}, ["generation_config.json", "999"]),
    ({"eos_token": "<|eot_id|>"}, {"eos_token_id": "5"}, ["generation_config.json", "eos_token_id"]),
])
def test_a_broken_declaration_is_one_error_naming_the_file(tmp_path, config, generation, words):
    word_tokenizer(STYLES["llama3"][0]).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    with pytest.raises(ConfigError) as err:
        HFTokenizer.from_file(tmp_path / "tokenizer.json", "t")
    assert all(w in str(err.value) for w in words), str(err.value)
