"""Tokenizers behind one small interface: encode, decode, vocab_size, eod_id, name.

The name is recorded with datasets and checkpoints so that a mismatch is caught.
"""

from __future__ import annotations

import base64
import functools
from typing import Protocol

from meshlm.data.assets import gpt2_ranks_file

# GPT-2's pre-tokenizer split pattern (the r50k_base pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class GPT2Tokenizer:
    """GPT-2 byte-level BPE through tiktoken, built from the ranks file shipped by openai-whisper."""

    name = "gpt2"

    def __init__(self) -> None:
        import tiktoken

        ranks = {}
        with open(gpt2_ranks_file(), "rb") as fh:
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

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))


@functools.cache
def get_tokenizer(name: str) -> Tokenizer:
    if name == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {name!r}; set data.tokenizer to 'gpt2'")
