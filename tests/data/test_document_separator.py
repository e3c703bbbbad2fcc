"""The document separator apart from the end of sequence (`data.tokenizers.document_separator`): a declared eos
that the chat template writes after every turn (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`) hands the
separator role to the vocabulary's document token, and stays the first stop id as transformers declares it;
an eos the template does not write, or one with no other document token (DeepSeek's), stays the separator."""

from __future__ import annotations

import json

import pytest
import transformers

from meshlm.data.tokenizers import HFTokenizer
from tests.interop.hf_tiny import word_tokenizer

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
LLAMA3 = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>" \
         "{% endfor %}"
DEEPSEEK = "{% for m in messages %}{{ m['content'] }}<｜end▁of▁sentence｜>{% endfor %}"
CASES = {  # specials, declared eos, template (None: none), where the template is, expected separator
    "chatml": (("<|im_start|>", "<|im_end|>", "<|endoftext|>"), "<|im_end|>", CHATML, "config", "<|endoftext|>"),
    "llama3": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               "<|eot_id|>", LLAMA3, "jinja", "<|end_of_text|>"),
    "chatml_untemplated": (("<|im_start|>", "<|im_end|>", "<|endoftext|>"), "<|im_end|>", None, "", "<|im_end|>"),
    "deepseek": (("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"), "<｜end▁of▁sentence｜>", DEEPSEEK, "config",
                 "<｜end▁of▁sentence｜>"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_turn_ending_eos_hands_the_separator_to_the_document_token(tmp_path, case):
    specials, eos, template, where, separator = CASES[case]
    tok = word_tokenizer(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": "<unk>"}
    if where == "config":
        config["chat_template"] = [{"name": "default", "template": template}]
    elif where == "jinja":
        (tmp_path / "chat_template.jinja").write_text(template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json", str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).eos_token_id
    assert ours.eod_id == tok.token_to_id(separator) and ours.eod_token == separator
    assert ours.eos_token == eos and ours.stop_ids[0] == theirs == tok.token_to_id(eos)
    assert ours.stop_ids == tuple(dict.fromkeys((theirs, ours.eod_id)))
