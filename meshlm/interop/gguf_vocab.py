"""A checkpoint's tokenizer as GGUF vocabulary metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).

llama.cpp runs a byte-level BPE as `tokenizer.ggml.model = "gpt2"`: the tokens (in the byte-level alphabet,
`Ġ` for a space), their types, the merges ("a b", best first), and `tokenizer.ggml.pre`, the name of the
pre-tokenizer split that llama.cpp (and transformers' GGUF loader) applies before the merges. The name is
chosen by recognising the tokenizer.json's pre-tokenizer, never guessed:

    pre_tokenizer of tokenizer.json                                   tokenizer.ggml.pre
    ByteLevel (use_regex: GPT-2's split)                              gpt-2      (shakespeare-bpe:N, gpt2)
    Sequence[Digits (one digit each), ByteLevel (GPT-2's split)]     smollm     (SmolLM, SmolLM2)
    Sequence[Split (Llama 3's pattern), ByteLevel (no regex)]        llama-bpe  (Llama 3)

Anything else (a WordPiece, a SentencePiece model, a normalizer, another split) is refused with a
ConfigError: a GGUF that tokenizes differently from the model's training would run, and be wrong.

Token types follow llama.cpp's converter: an added special token is CONTROL, another added token
USER_DEFINED, the rest NORMAL, and ids between the tokenizer's size and the model's (padded) vocabulary
`[PAD<id>]`, UNUSED. Special ids: the carried tokenizer_config.json's bos/eos/pad (and unk) tokens where it names
them, else the tokenizer's end-of-document token (meshlm adds no BOS; `add_bos_token` is false).
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from meshlm.core.config import ConfigError
from meshlm.data.chat import special_token_variables, template_for
from meshlm.data.tokenizers import HFTokenizer, get_tokenizer
from meshlm.interop.hf_files import write_gpt2_tokenizer

# llama.cpp's llama_token_type values (gguf.TokenType; kept here so this module imports no gguf)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# Llama 3's pre-tokenizer split, as its tokenizer.json states it
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# transformers' `{% generation %}` marks (training targets only): llama.cpp's Jinja engine does not know them
_GENERATION_MARK = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF stores of a tokenizer."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str | None
    unk_id: int | None = None  # only where tokenizer_config.json names one: a byte-level BPE has no unknowns


def _byte_level(part: dict, regex: bool) -> bool:
    return (part.get("type") == "ByteLevel" and not part.get("add_prefix_space", True)
            and bool(part.get("use_regex", True)) == regex)


def pre_tokenizer_name(pre: dict | None) -> str | None:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json `pre_tokenizer` (module doc), None if unknown."""
    if not isinstance(pre, dict):
        return None
    if _byte_level(pre, regex=True):
        return "gpt-2"
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(parts, list) or len(parts) != 2:
        return None
    first, second = parts
    if first.get("type") == "Digits" and first.get("individual_digits") and _byte_level(second, regex=True):
        return "smollm"
    pattern = (first.get("pattern") or {}).get("Regex")
    if (first.get("type") == "Split" and pattern == LLAMA3_SPLIT and first.get("behavior") == "Isolated"
            and not first.get("invert") and _byte_level(second, regex=False)):
        return "llama-bpe"
    return None


def _merge_text(merge) -> str:
    return merge if isinstance(merge, str) else " ".join(merge)  # tokenizers >= 0.20 writes [a, b]


def _tokenizer_json(spec: str, shown: str) -> dict:
    """The tokenizer.json of `data.tokenizer = spec` (GPT-2's rebuilt from meshlm's tiktoken ranks)."""
    if spec == "gpt2":
        with tempfile.TemporaryDirectory() as tmp:
            write_gpt2_tokenizer(Path(tmp), 1024)
            return json.loads((Path(tmp) / "tokenizer.json").read_text())
    tok = get_tokenizer(spec)
    if not isinstance(tok, HFTokenizer):
        raise ConfigError(f"data.tokenizer={shown!r} is a SentencePiece model; --to-gguf writes byte-level BPE "
                          "tokenizers (tokenizer.json, gpt2, shakespeare-bpe:N) only")
    try:
        return json.loads(Path(tok.vocab_file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"data.tokenizer={shown!r}: {tok.vocab_file} cannot be read as JSON ({err})") from None


def _check_byte_bpe(data: dict, shown: str) -> str:
    """The pre-tokenizer name of a byte-level BPE tokenizer.json; ConfigError for any other kind."""
    model = data.get("model") or {}
    what = f"data.tokenizer={shown!r}"
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ConfigError(f"{what} is a {model.get('type', 'unknown')} tokenizer{' with byte fallback' if model.get('byte_fallback') else ''}; "
                          "--to-gguf writes byte-level BPE tokenizers (GPT-2 style) only")
    if data.get("normalizer") is not None:
        raise ConfigError(f"{what} has a normalizer ({data['normalizer'].get('type')}), which a GGUF byte-level BPE "
                          "cannot state; --to-gguf writes tokenizers without one")
    name = pre_tokenizer_name(data.get("pre_tokenizer"))
    if name is None:
        raise ConfigError(f"{what}: its pre-tokenizer {json.dumps(data.get('pre_tokenizer'))[:120]} is not one "
                          "llama.cpp names (GPT-2's ByteLevel split, SmolLM's digits + ByteLevel, Llama 3's split)")
    return name


def _tokens(data: dict, vocab_size: int, shown: str) -> tuple[list[str], list[int]]:
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in data["model"]["vocab"].items()}
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    size = max(by_id) + 1
    if size > vocab_size:
        raise ConfigError(f"data.tokenizer={shown!r} has {size} tokens, more than model.vocab_size={vocab_size}; "
                          "the checkpoint does not match its tokenizer")
    pads = [(f"[PAD{i}]", UNUSED) for i in range(vocab_size)]
    entries = [by_id.get(i, pads[i]) for i in range(vocab_size)]
    return [t for t, _ in entries], [k for _, k in entries]


def _special_ids(tokens: list[str], eod_id: int, folder: Path | None) -> tuple[int, int, int, int | None]:
    """(bos, eos, pad, unk): the carried tokenizer_config.json's where it names tokens of the vocabulary, else
    the end-of-document id (unk: None)."""
    names = special_token_variables(folder) if folder is not None else {}
    index = {t: i for i, t in enumerate(tokens)}

    def pick(key: str, default: int | None) -> int | None:
        return index.get(names.get(key, ""), default)

    eos = pick("eos_token", eod_id)
    return pick("bos_token", eos), eos, pick("pad_token", eos), pick("unk_token", None)


def chat_template_text(spec: str, folder: Path | None) -> str:
    """The chat template `meshlm serve` renders for this tokenizer (`chat.template_for`), without transformers'
    `{% generation %}` marks, which change no output and which llama.cpp's template engine rejects."""
    return _GENERATION_MARK.sub("", template_for(folder if folder is not None else spec).text)


def gguf_vocab(spec: str, vocab_size: int, folder: Path | None = None) -> GGUFVocab:
    """The GGUF vocabulary of `data.tokenizer = spec` for a model of `vocab_size` rows; `folder` holds the
    checkpoint's carried tokenizer files (tokenizer_config.json, chat_template.jinja) when it has some."""
    if spec == "bert":
        raise ConfigError("data.tokenizer='bert' is a WordPiece tokenizer; --to-gguf writes byte-level BPE "
                          "tokenizers (tokenizer.json, gpt2, shakespeare-bpe:N) only")
    data = _tokenizer_json(spec, spec)
    pre = _check_byte_bpe(data, spec)
    tokens, types = _tokens(data, vocab_size, spec)
    merges = [_merge_text(m) for m in data["model"].get("merges") or []]
    eod = get_tokenizer(spec).stop_ids[0]  # the declared eos, not the document separator (data.tokenizers)
    bos, eos, pad, unk = _special_ids(tokens, eod, folder)
    return GGUFVocab(tokens, types, merges, pre, bos, eos, pad, chat_template_text(spec, folder), unk)
