"""`build_datasets(cfg)`: `data.*` → (tokenizer, train samples, validation samples).

`data.paths` lists sources, optionally with weights: `["0.7", "a", "0.3", "b"]`. A source is a prepared
prefix (`a.bin` + `a.idx` exist; ours or Megatron's) or text (.txt / .jsonl / .gz files, directories,
globs) that is prepared once into the cache (`data.cache_dir`, else $MESHLM_CACHE, else ~/.cache/meshlm)
and reused. Empty `data.paths` is the bundled Shakespeare corpus, prepared the same way. Without weights,
text sources form one corpus and several prefixes blend in proportion to their training tokens.

Every prefix is split by document (`data.split`, e.g. "98,1,1"); the training split gets enough epochs
for `train.max_steps × train.global_batch_size` samples, the validation split one epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

from meshlm.core.config import Config, ConfigError
from meshlm.data.assets import default_cache_dir, shakespeare_files
from meshlm.data.gpt_dataset import BlendedDataset, GPTDataset, split_documents
from meshlm.data.indexed import IndexedDataset, is_prefix, paths_of, strip_suffix
from meshlm.data.prepare import DataError, expand_inputs, prepare
from meshlm.data.tokenizers import Tokenizer, get_tokenizer

ESTIMATE_TOKENS = 200_000  # tokens decoded to estimate bytes per token of data without a sidecar


def _is_weight(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return not Path(text).exists()


def parse_paths(paths: list[str]) -> list[tuple[float | None, str]]:
    """`data.paths` → [(weight or None, source)]; weights come in `[w1, path1, w2, path2, ...]`."""
    flags = [_is_weight(p) for p in paths]
    if not any(flags):
        return [(None, p) for p in paths]
    if len(paths) % 2 or flags[0::2] != [True] * (len(paths) // 2) or any(flags[1::2]):
        raise ConfigError(f"data.paths={paths!r} mixes weights and paths; use [\"0.7\", \"a\", \"0.3\", \"b\"] "
                          "(a weight before every path) or paths alone")
    pairs = [(float(paths[i]), paths[i + 1]) for i in range(0, len(paths), 2)]
    if any(w < 0 for w, _ in pairs) or sum(w for w, _ in pairs) <= 0:
        raise ConfigError(f"data.paths weights {[w for w, _ in pairs]} must be >= 0 with a positive sum")
    return pairs


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock so that ranks sharing a cache prepare it once (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare_cached(inputs: list[str | Path], tokenizer: Tokenizer, cache_dir: Path, json_key: str = "text",
                   name: str | None = None, progress: bool = True, allow_binary: bool = False,
                   split_sentences: bool = False) -> str:
    """Prepare text `inputs` once into the cache: with an end-of-document token per document, or, with
    `split_sentences` (BERT), one sequence per sentence and no end-of-document token. The key covers the
    files (path, size, mtime), the tokenizer's vocabulary and the options."""
    files = expand_inputs([str(p) for p in inputs], what="data.paths")
    mode = "sentences" if split_sentences else "eod"
    h = hashlib.sha256(json.dumps([tokenizer.identity["sha256"], json_key, mode]).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    name = (name or files[0].name.split(".")[0]) + ("-sentences" if split_sentences else "")
    prefix = cache_dir / "prepared" / f"{name}-{tokenizer.name}-{h.hexdigest()[:16]}"
    if not is_prefix(prefix):
        with _file_lock(Path(f"{prefix}.lock")):
            if not is_prefix(prefix):
                prepare([str(f) for f in files], tokenizer.spec, str(prefix), append_eod=not split_sentences,
                        json_key=json_key, progress=progress, what="data.paths", allow_binary=allow_binary,
                        allow_flag="data.allow_binary=true", split_sentences=split_sentences)
    return str(prefix)


def check_tokenizer(data: IndexedDataset, tokenizer: Tokenizer, spec: str) -> float:
    """Refuse data tokenized by another tokenizer; return bytes per token of the data's text."""
    meta = data.metadata
    if meta is None:  # e.g. prepared by Megatron: no record, so check what can be checked and estimate
        sample = np.asarray(data.tokens[:ESTIMATE_TOKENS])
        if sample.size and int(sample.max()) >= tokenizer.vocab_size:
            raise ConfigError(f"data.paths: {data.prefix} holds token id {int(sample.max())}, beyond "
                              f"data.tokenizer={spec!r} (vocab {tokenizer.vocab_size}); set data.tokenizer to "
                              "the tokenizer the data was prepared with")
        print(f"note: {data.prefix} has no meshlm sidecar ({data.meta_path.name}); assuming it was tokenized "
              f"with data.tokenizer={spec!r}", file=sys.stderr)
        text = tokenizer.decode(sample.tolist()) if sample.size else ""
        return len(text.encode("utf-8")) / max(1, sample.size)
    recorded = meta.get("tokenizer", {})
    if recorded.get("sha256") != tokenizer.identity["sha256"]:
        raise ConfigError(
            f"data.paths: {data.prefix} was prepared with tokenizer {recorded.get('name')!r} "
            f"(--tokenizer {recorded.get('spec')}, vocab sha256 {str(recorded.get('sha256'))[:12]}), but "
            f"data.tokenizer={spec!r} is {tokenizer.name!r} (sha256 {tokenizer.identity['sha256'][:12]}); set "
            f"data.tokenizer={recorded.get('spec')!r} or prepare the data again with --tokenizer {spec}")
    return meta["text_bytes"] / max(1, meta["tokens"])


def _is_prefix(path: str) -> bool:
    """A prepared prefix? A `.bin` without its `.idx` is an interrupted preparation: say so."""
    bin_path, idx_path, _ = paths_of(strip_suffix(path))
    if bin_path.exists() and not idx_path.exists():
        raise DataError(f"data.paths: {bin_path} has no {idx_path.name} (an interrupted meshlm prepare?); "
                        "prepare the data again")
    return is_prefix(path)


def resolve_sources(cfg: Config, tokenizer: Tokenizer, progress: bool, split_sentences: bool = False
                    ) -> list[tuple[float | None, str]]:
    """[(weight or None, prefix)], preparing text sources into the cache (sentence by sentence with
    `split_sentences`)."""
    d = cfg.data
    cache = Path(d.cache_dir) if d.cache_dir else default_cache_dir()
    if not d.paths:
        return [(None, prepare_cached(shakespeare_files(), tokenizer, cache, name="shakespeare",
                                      progress=progress, split_sentences=split_sentences))]
    pairs = parse_paths(d.paths)
    if pairs[0][0] is not None:
        return [(w, strip_suffix(p) if _is_prefix(p) else prepare_cached([p], tokenizer, cache, d.json_key,
                                                                      progress=progress,
                                                                      allow_binary=d.allow_binary,
                                                                      split_sentences=split_sentences))
                for w, p in pairs]
    prefixes = [(None, strip_suffix(p)) for _, p in pairs if _is_prefix(p)]
    texts = [p for _, p in pairs if not _is_prefix(p)]
    if texts:
        prefixes.append((None, prepare_cached(texts, tokenizer, cache, d.json_key, progress=progress,
                                              allow_binary=d.allow_binary, split_sentences=split_sentences)))
    return prefixes


def _open_prefix(prefix: str, tokenizer: Tokenizer, cfg: Config) -> tuple[IndexedDataset, float, range, range]:
    """(data, bytes per token, train documents, validation documents) of one prefix."""
    try:
        data = IndexedDataset(prefix)
    except (OSError, ValueError) as err:
        raise DataError(f"data.paths: {prefix} cannot be read as an indexed dataset ({err})") from None
    bytes_per_token = check_tokenizer(data, tokenizer, cfg.data.tokenizer)
    try:
        train_docs, valid_docs, _ = split_documents(data.n_documents, cfg.data.split_weights)
    except ValueError:
        raise ConfigError(f"data.split={cfg.data.split!r} leaves no training document of the {data.n_documents} "
                          f"in {prefix}; raise the train share") from None
    return data, bytes_per_token, train_docs, valid_docs


def build_datasets(cfg: Config, progress: bool = True) -> tuple[Tokenizer, GPTDataset | BlendedDataset,
                                                                GPTDataset | BlendedDataset]:
    """(tokenizer, train samples, validation samples) for `cfg.data` and `cfg.model.seq_len`."""
    d, seq, seed = cfg.data, cfg.model.seq_len, cfg.train.seed
    tokenizer = get_tokenizer(d.tokenizer)
    num_train = cfg.train.max_steps * cfg.train.global_batch_size
    sources = resolve_sources(cfg, tokenizer, progress)
    opened = [_open_prefix(prefix, tokenizer, cfg) for _, prefix in sources]
    weights = [w if w is not None else float(data.document_lengths[docs.start:docs.stop].sum())
               for (w, _), (data, _, docs, _) in zip(sources, opened)]
    weights = [w / sum(weights) for w in weights]
    trains, valids = [], []
    for w, (data, bpt, train_docs, valid_docs) in zip(weights, opened):
        wanted = num_train if len(opened) == 1 else math.ceil(num_train * w) + 2
        n_tokens = int(data.document_lengths[train_docs.start:train_docs.stop].sum())
        if n_tokens < seq + 1:  # an epoch must hold a sample; more epochs would repeat text inside one
            raise ConfigError(f"data: the training split of {data.prefix} holds {n_tokens} tokens, fewer than "
                              f"model.seq_len+1={seq + 1}; add data, lower model.seq_len or raise the train "
                              "share of data.split")
        trains.append(GPTDataset(data, train_docs, seq, seed, wanted, d.cache_dir or None, "train", bpt))
        valids.append(GPTDataset(data, valid_docs, seq, seed, 0, d.cache_dir or None, "valid", bpt))
    return (tokenizer, *blend_splits(trains, valids, weights, num_train, BlendedDataset))


def blend_splits(trains: list, valids: list, weights: list[float], num_train: int, blend=None) -> tuple:
    """(train, valid) from one dataset per source: the source's own when there is one, else `blend`s
    (BlendedDataset or a subclass) of them by weight; the validation blend is as long as its sources allow
    without repeating a sample."""
    if len(trains) == 1:
        return trains[0], valids[0]
    blend = blend or BlendedDataset
    train = blend(trains, weights, num_train)
    usable = [(v, w) for v, w in zip(valids, weights) if len(v) and w > 0]
    if not usable:
        return train, valids[0]
    total = sum(w for _, w in usable)
    n_valid = int(min(len(v) * total / w for v, w in usable))  # no validation component repeats a sample
    return train, blend([v for v, _ in usable], [w for _, w in usable], n_valid)
