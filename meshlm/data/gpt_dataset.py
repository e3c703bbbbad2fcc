"""GPT samples from an indexed dataset: Megatron's document, sample and shuffle indices, and blending.

For one split (a contiguous range of documents) and `num_epochs` epochs:

- document index: for each epoch e, the split's documents in an order drawn from (seed, e), concatenated;
  read end to end it is one token stream of E·T tokens (T = tokens per epoch);
- sample index: (N+1, 2) rows (position in the document index, offset in that document) where sample i
  starts; sample i is stream tokens [i·s, i·s + s] (s+1 tokens: inputs and shifted targets), crossing
  document and epoch boundaries; N = (E·T − 1) // s, so no token is dropped except the tail of the last epoch;
- shuffle index: the samples starting in epoch e, permuted with (seed, e). Megatron shuffles documents
  and samples across all epochs at once; shuffling per epoch means every training token is seen exactly
  once per epoch, and epoch e+1 starts only when epoch e is done.

The indices depend only on (data, documents, seq_len, seed, epochs): they are built with numpy once and
cached as .npy files beside the data (`PREFIX.index-cache/`), then memory-mapped.

Blending: a blend index picks, for global sample i, a dataset and that dataset's next sample. Dataset d's
k-th sample is placed at (k + ½)/w_d and all places are merged in order (stride scheduling), so after any
n samples dataset d has supplied n·w_d ± 1 of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from meshlm.data.assets import default_cache_dir
from meshlm.data.indexed import IndexedDataset

INDEX_VERSION = 1


def split_documents(n_docs: int, weights: tuple[float, float, float]) -> list[range]:
    """Contiguous document ranges for train/valid/test (Megatron's split by document); a positive share
    gets at least one document when there are more than two."""
    counts = [round(w * n_docs) for w in weights]
    for i in (1, 2):
        if weights[i] > 0 and counts[i] == 0 and n_docs > 2:
            counts[i] = 1
    counts[0] = n_docs - counts[1] - counts[2]
    if counts[0] < 1:
        raise ValueError(f"the split {weights} leaves no training document out of {n_docs}")
    return [range(counts[0]), range(counts[0], counts[0] + counts[1]), range(counts[0] + counts[1], n_docs)]


def epochs_for(num_samples: int, tokens_per_epoch: int, seq_len: int) -> int:
    """Fewest epochs whose stream yields `num_samples` samples of seq_len+1 tokens (at least one)."""
    if tokens_per_epoch <= 0:
        return 1
    epochs = max(1, math.ceil((num_samples * seq_len + 1) / tokens_per_epoch))
    while (epochs * tokens_per_epoch - 1) // seq_len < num_samples:
        epochs += 1
    return epochs


def build_indices(doc_lengths: np.ndarray, documents: np.ndarray, seq_len: int, seed: int, num_epochs: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) as described in the module docstring.

    doc_lengths[j] is the token count of documents[j] (the split's document ids)."""
    doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
    documents = np.asarray(documents, dtype=np.int64)
    tokens_per_epoch = int(doc_lengths.sum())
    n_docs = len(documents)
    orders = [np.random.default_rng([seed, e, 0]).permutation(n_docs) for e in range(num_epochs)]
    order = np.concatenate(orders) if orders else np.zeros(0, np.int64)  # positions into `documents`
    document_index = documents[order]
    n_samples = max(0, (num_epochs * tokens_per_epoch - 1) // seq_len)
    if n_samples == 0:
        return document_index, np.zeros((0, 2), np.int64), np.zeros(0, np.int64)
    ends = np.cumsum(doc_lengths[order])  # stream offset where each document-index entry ends
    starts = np.arange(n_samples + 1, dtype=np.int64) * seq_len
    position = np.searchsorted(ends, starts, side="right")
    sample_index = np.stack([position, starts - (ends[position] - doc_lengths[order][position])], axis=1)
    shuffle_index = np.arange(n_samples, dtype=np.int64)
    for e in range(num_epochs):  # samples whose first token lies in epoch e: [ceil(eT/s), ceil((e+1)T/s))
        lo = min(n_samples, -(-e * tokens_per_epoch // seq_len))
        hi = min(n_samples, -(-(e + 1) * tokens_per_epoch // seq_len))
        shuffle_index[lo:hi] = lo + np.random.default_rng([seed, e, 1]).permutation(hi - lo)
    return document_index, sample_index, shuffle_index


def index_cache_dir(prefix: str, cache_dir: str | Path | None) -> Path:
    """Where a prefix's indices live: `cache_dir` if given, else beside the data, else the user cache."""
    if cache_dir:
        return Path(cache_dir) / "index-cache"
    beside = Path(prefix + ".index-cache")
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    return default_cache_dir() / "index-cache"


def cached_arrays(prefix: str, cache_dir: str | Path | None, name: str, desc: dict, names: tuple[str, ...],
                  build) -> tuple[np.ndarray, ...]:
    """The arrays `names` described by `desc` (a JSON-able dict that determines them): memory-mapped from
    `index_cache_dir(prefix, cache_dir)` if built before, else `build()` and saved there. Each array is
    written to a temporary file and renamed; the description file, written last, marks them complete."""
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    folder = index_cache_dir(prefix, cache_dir)
    stem = folder / f"{Path(prefix).name}-{name}-{key}"
    done = Path(f"{stem}-description.json")
    if done.exists():
        return tuple(np.load(f"{stem}-{n}.npy", mmap_mode="r") for n in names)
    arrays = build()
    folder.mkdir(parents=True, exist_ok=True)
    for n, array in zip(names, arrays):
        tmp = f"{stem}-{n}.{os.getpid()}.tmp.npy"
        np.save(tmp, array)
        os.replace(tmp, f"{stem}-{n}.npy")
    tmp = f"{done}.{os.getpid()}.tmp"
    Path(tmp).write_text(json.dumps(desc, indent=1))
    os.replace(tmp, done)
    return tuple(arrays)


class GPTDataset:
    """Shuffled samples of seq_len+1 tokens over `documents` of an indexed dataset, `num_epochs` epochs.

    `shuffled = True` tells BatchLoader that index i is already the i-th sample to train on."""

    shuffled = True

    def __init__(self, indexed: IndexedDataset, documents: range, seq_len: int, seed: int,
                 num_samples: int = 0, cache_dir: str | Path | None = None, name: str = "train",
                 bytes_per_token: float = 0.0):
        self.indexed, self.documents, self.seq_len, self.seed = indexed, documents, seq_len, seed
        self.name, self.bytes_per_token = name, bytes_per_token
        self.doc_lengths = indexed.document_lengths[documents.start:documents.stop]
        self.n_tokens = int(self.doc_lengths.sum())
        self.num_epochs = epochs_for(num_samples, self.n_tokens, seq_len)
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(cache_dir)

    def _description(self) -> dict:
        idx = self.indexed.idx_path.stat()
        return {"version": INDEX_VERSION, "prefix": str(Path(self.indexed.prefix).resolve()),
                "idx_bytes": idx.st_size, "idx_mtime_ns": idx.st_mtime_ns, "split": self.name,
                "documents": [self.documents.start, self.documents.stop], "seq_len": self.seq_len,
                "seed": self.seed, "num_epochs": self.num_epochs}

    def _load_or_build(self, cache_dir) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return cached_arrays(
            self.indexed.prefix, cache_dir, self.name, self._description(),
            ("document_index", "sample_index", "shuffle_index"),
            lambda: build_indices(self.doc_lengths, np.arange(self.documents.start, self.documents.stop),
                                  self.seq_len, self.seed, self.num_epochs))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        (p0, o0), (p1, o1) = self.sample_index[j], self.sample_index[j + 1]
        doc = self.indexed.document
        if p0 == p1:
            parts = [doc(int(self.document_index[p0]))[o0:o1 + 1]]
        else:
            parts = [doc(int(self.document_index[p0]))[o0:]]
            parts += [doc(int(self.document_index[p])) for p in range(p0 + 1, p1)]
            parts.append(doc(int(self.document_index[p1]))[:o1 + 1])
        return np.concatenate(parts).astype(np.int64)

    @property
    def tokens(self) -> np.ndarray:
        """The split's tokens in document order (one epoch), memory-mapped."""
        idx = self.indexed
        first, last = int(idx.document_indices[self.documents.start]), int(idx.document_indices[self.documents.stop])
        if first == last:
            return idx.tokens[:0]
        start = int(idx.sequence_pointers[first]) // idx.dtype.itemsize
        end = int(idx.sequence_pointers[last - 1]) // idx.dtype.itemsize + int(idx.sequence_lengths[last - 1])
        if end - start == self.n_tokens:  # documents written back to back, as both tools do
            return idx.tokens[start:end]
        return np.concatenate([idx.document(d) for d in self.documents])


class BlendedDataset:
    """Samples drawn from several datasets with fixed weights (see the module docstring)."""

    shuffled = True

    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        total = float(sum(weights))
        self.datasets, self.weights = datasets, [w / total for w in weights]
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, num_samples)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        d = int(self.dataset_index[i])
        dataset = self.datasets[d]
        return dataset[int(self.dataset_sample_index[i]) % len(dataset)]

    @property
    def n_tokens(self) -> int:
        return sum(d.n_tokens for d in self.datasets)

    @property
    def tokens(self) -> _TokenCount:
        return _TokenCount(self.n_tokens)

    @property
    def bytes_per_token(self) -> float:
        """Of the mixture: each sample has the same token count, so weights average bytes per token."""
        return sum(w * d.bytes_per_token for w, d in zip(self.weights, self.datasets))


class _TokenCount:
    """len() of a blend's tokens, without reading them."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def blend_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of length num_samples by stride scheduling."""
    places, owners, ranks = [], [], []
    for d, w in enumerate(weights):
        if w <= 0:
            continue
        k = np.arange(math.ceil(num_samples * w) + 2, dtype=np.int64)
        places.append((k + 0.5) / w)
        owners.append(np.full(len(k), d, dtype=np.int16))
        ranks.append(k)
    places, owners, ranks = (np.concatenate(a) for a in (places, owners, ranks))
    order = np.lexsort((owners, places))[:num_samples]  # by place, ties to the lower dataset
    return owners[order], ranks[order]
