"""Data: tokenizers, Megatron-compatible indexed datasets, preparation, GPT samples and blending.

`build_datasets` is the trainer's one entry point; `meshlm prepare` and `meshlm tokenizer train` are the
user's (docs/data.md).

May import: core (not models: data and models are siblings).
"""

from __future__ import annotations

from meshlm.data.build import build_datasets

__all__ = ["build_datasets"]
