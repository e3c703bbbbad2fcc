"""Data: tokenizers, corpus, samples and loaders. `build_datasets` is the trainer's one entry point."""

from __future__ import annotations

from meshlm.config import Config
from meshlm.data.corpus import load_corpus, split_documents
from meshlm.data.dataset import GPTSamples
from meshlm.data.tokenizers import Tokenizer, get_tokenizer


def build_datasets(cfg: Config, progress: bool = True) -> tuple[Tokenizer, GPTSamples, GPTSamples]:
    """(tokenizer, train samples, validation samples) for `cfg.data` and `cfg.model.seq_len`."""
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    corpus = load_corpus(cfg.data, tokenizer, progress)
    train_docs, valid_docs, _ = split_documents(corpus.n_docs, cfg.data.split_weights)
    seq = cfg.model.seq_len
    return (tokenizer, GPTSamples(corpus, train_docs, seq, tokenizer.eod_id),
            GPTSamples(corpus, valid_docs, seq, tokenizer.eod_id))
