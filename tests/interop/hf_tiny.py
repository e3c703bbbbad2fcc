"""Tiny Hugging Face model directories whose end of sequence is declared as released models declare it.

`word_tokenizer` builds a WordLevel tokenizer.json from a few words and a family's special tokens (DeepSeek's
`<｜end▁of▁sentence｜>`, ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`); `bigram_llama` a random-init
transformers Llama (2 layers, hidden 32) whose greedy next token is a chosen function of the current one
(one-hot embeddings, the layers' output projections zeroed, lm_head a transition matrix), so a test steers
exactly which ids it generates; `write_hf_dir` saves both with tokenizer_config.json and generation_config.json.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

WORDS = ("hello", "world", "a", "b", "c", "x", "y", "user", "assistant", "system", "hi", "there")
STYLES = {
    # family: (special tokens, the declared eos_token)
    "deepseek": (("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|im_start|>", "<|im_end|>"),
                 "<｜end▁of▁sentence｜>"),
    "chatml": (("<|im_start|>", "<|im_end|>", "<|endoftext|>"), "<|im_end|>"),
    "llama3": (("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>",
                "<|im_end|>"), "<|eot_id|>"),
}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def word_tokenizer(specials: tuple[str, ...]):
    """A `tokenizers.Tokenizer`: <unk>, the special tokens, then WORDS, split on whitespace."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {t: i for i, t in enumerate(("<unk>", *specials, *WORDS))}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    return tok


def bigram_llama(vocab_size: int, next_of: dict[int, int], default: int, seed: int = 0):
    """A transformers LlamaForCausalLM whose greedy next token after id i is `next_of.get(i, default)`:
    embeddings are one-hot (vocab_size <= 32), attention and MLP outputs zero, so the final norm sees the
    current token's one-hot vector and lm_head's column i picks its successor."""
    import transformers

    assert vocab_size <= 32
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, 32))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab_size, 32)
        for i in range(vocab_size):
            head[next_of.get(i, default), i] = 1.0
        model.lm_head.weight.copy_(head)
    return model


def write_hf_dir(path: Path, style: str, chain: list[list[str]], generation_eos: list[str] | str | None,
                 eos_as_dict: bool = False, chat_template: str | None = None):
    """A Hugging Face directory in `path`: the style's tokenizer, tokenizer_config.json declaring its eos_token
    (an AddedToken object when `eos_as_dict`), generation_config.json's eos_token_id (the ids of
    `generation_eos`), and a bigram Llama following each `chain` of tokens (any other token goes to "a").
    Returns (the transformers model, the tokenizers.Tokenizer)."""
    specials, eos = STYLES[style]
    tok = word_tokenizer(specials)
    path.mkdir(parents=True, exist_ok=True)
    ids = tok.get_vocab()
    next_of = {ids[a]: ids[b] for seq in chain for a, b in itertools.pairwise(seq)}
    model = bigram_llama(tok.get_vocab_size(), next_of, ids["a"])
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    declared = {"__type": "AddedToken", "content": eos, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": True} if eos_as_dict else eos
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": declared, "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation_eos is not None:  # written after save_pretrained, which writes its own from config.json
        value = ids[generation_eos] if isinstance(generation_eos, str) else [ids[t] for t in generation_eos]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    elif (path / "generation_config.json").exists():
        (path / "generation_config.json").unlink()
    return model, tok
