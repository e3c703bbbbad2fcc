"""A GGUF file's tokenizer → Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json,
generation_config.json), which meshlm's `data.tokenizers` and `data.chat.template_for` read.

GGUF stores the vocabulary as metadata: `tokenizer.ggml.model` (the kind), `tokens` (id order), `token_type`
(1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), `merges` ("a b" strings, in rank order),
`pre` (llama.cpp's name for the pre-tokenizer's split regex), the special ids and `tokenizer.chat_template`.

Read: `gpt2`, byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2 vocabularies). Its tokens are already spelled in
GPT-2's byte alphabet, so the vocabulary and merges go into a `tokenizers` BPE unchanged; control tokens
become special added tokens and user-defined ones plain added tokens, both matched whole in text, as
llama.cpp does. The split regex comes from `pre` (`PRE_TOKENIZERS`); an unknown name is refused, since a
wrong split gives different ids silently. SentencePiece (`llama`) and other vocabularies are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshlm.core.config import ConfigError

_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's split regexes (llama-vocab.cpp), by the name `tokenizer.ggml.pre` gives them.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre name → (split regex, digits split one by one first, ignore_merges: a whole word in the vocabulary is
# taken as it is, as llama.cpp does for Llama 3).
PRE_TOKENIZERS = {"default": (_GPT2_SPLIT, False, False), "gpt-2": (_GPT2_SPLIT, False, False),
                  "smollm": (_GPT2_SPLIT, True, False), "llama-bpe": (_LLAMA3_SPLIT, False, True),
                  "llama3": (_LLAMA3_SPLIT, False, True), "qwen2": (_QWEN2_SPLIT, False, False)}


def check_tokenizer(meta: dict[str, Any]) -> None:
    """ConfigError, naming what is there, for a tokenizer `write_tokenizer_files` cannot rebuild."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF tokenizer.ggml.model={kind!r} is not read; meshlm rebuilds byte-level BPE "
                          "('gpt2') vocabularies (SentencePiece 'llama' ones are not supported yet)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"GGUF tokenizer.ggml.pre={pre!r} names a pre-tokenizer meshlm does not know; it reads "
                          f"{', '.join(PRE_TOKENIZERS)}")
    tokens, merges = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ConfigError("GGUF tokenizer has no tokenizer.ggml.merges; a byte-level BPE needs its merges")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) != len(tokens):
        raise ConfigError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; "
                          "the file is corrupt")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and not 0 <= int(value) < len(tokens):
            raise ConfigError(f"GGUF tokenizer.ggml.{key}={value} is outside the {len(tokens)} tokens")


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    split, digits, _ = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split == _GPT2_SPLIT:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def byte_level_tokenizer(meta: dict[str, Any]):
    """The `tokenizers.Tokenizer` of a `gpt2` GGUF vocabulary (`check_tokenizer` first)."""
    from tokenizers import AddedToken, Tokenizer, decoders, processors
    from tokenizers.models import BPE

    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConfigError(f"GGUF tokenizer.ggml.tokens repeats {len(tokens) - len(vocab)} tokens; a BPE vocabulary "
                          "holds each token once")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=PRE_TOKENIZERS[pre][2]))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type") or []
    added = [AddedToken(t, special=kind == _CONTROL, normalized=False)
             for t, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def _special(meta: dict[str, Any], key: str) -> str | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    return None if value is None else meta["tokenizer.ggml.tokens"][int(value)]


def write_tokenizer_files(meta: dict[str, Any], folder: Path, max_length: int) -> list[str]:
    """tokenizer.json, tokenizer_config.json (special tokens, add_bos_token, the chat template) and
    generation_config.json (bos/eos/pad ids) of the GGUF tokenizer `meta` in `folder`; returns the names."""
    check_tokenizer(meta)
    byte_level_tokenizer(meta).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)), "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        config[name] = _special(meta, key)
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    generation = {k: int(meta[f"tokenizer.ggml.{g}"]) for k, g in (
        ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))
        if f"tokenizer.ggml.{g}" in meta}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
