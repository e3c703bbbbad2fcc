"""BERT pretraining samples (Megatron's BERT dataset) from sentence-split indexed data.

The data is an indexed dataset whose sequences are sentences and whose document index groups them into
documents (`meshlm prepare --split-sentences`, or Megatron's `preprocess_data.py --split-sentences`).

**Sample mapping** (`build_sample_mapping`, Megatron's `build_mapping`): every document of at least two
sentences is walked from its first sentence; sentences are added to the current sample until it holds
at least its target length in tokens, at least two sentences, and at least two sentences of the
document remain after it; the document's last sample takes the rest. The target length is T − 3 (room
for [CLS], [SEP], [SEP]), or, with probability `short_seq_prob`, a length drawn uniformly from
[2, T − 3]. A sample is (first sentence, end sentence, target length). Whole epochs are walked, each with
fresh target lengths, until there are `num_samples` samples, and all of them are shuffled together.
Unlike Megatron, documents holding a sentence over 512 tokens are kept (truncation handles them).
The mapping is built with numpy and cached as a `.npy` file beside the data, like the GPT indices.

**A sample** `i` is drawn from a generator seeded with (seed, i) alone, so it does not depend on which
samples were read before, or in what order:

- the sample's n sentences are cut into segment A (the first k, k uniform in [1, n − 1]) and B (the
  rest); with probability ½ they are swapped (sentence-order prediction: label 1 = swapped, 0 = in order);
- the pair is truncated to the target length, one token at a time from the longer segment (B on a tie),
  from its front or its back with probability ½ each (Megatron's `truncate_segments`);
- tokens are `[CLS] A [SEP] B [SEP]`, token types 0 for [CLS] A [SEP] and 1 for B [SEP], padded to T with
  [PAD] (type 0, attention mask 0);
- masking (Megatron's `create_masked_lm_predictions` defaults): candidates are whole words (a token
  and the `##` pieces that follow it); n-grams of 1 to 3 words with P(n) ∝ 1/n are tried from the word
  starts in random order, each shrunk to fit the budget of max(1, round(0.15 × real tokens)) predictions
  (real tokens: those of A and B) and skipped if it overlaps one taken; [CLS], [SEP] and [PAD] are never
  masked. Each chosen token becomes [MASK] (80%), a random id of the whole vocabulary (10%), or stays (10%);
  its label is the original id, −100 elsewhere.

A row is one int64 array of 4T + 1: token ids (T), token types (T), attention mask (T; 1 real, 0 pad),
labels (T), and the sentence-order label. `collate` turns rows into the model's (inputs, targets).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from meshlm.data.gpt_dataset import BlendedDataset, _TokenCount, cached_arrays
from meshlm.data.indexed import IndexedDataset

MAPPING_VERSION = 1
IGNORE_INDEX = -100  # label of a position that is not predicted (torch's cross-entropy default)
SPECIALS = ("cls", "sep", "pad", "mask")  # the special ids BertDataset needs
_MAPPING, _SHUFFLE, _SAMPLE = 0, 1, 2  # random streams, seeded (seed, stream, ...)


def build_sample_mapping(doc_first: np.ndarray, doc_last: np.ndarray, sentence_lengths: np.ndarray,
                         max_len: int, seed: int, num_samples: int, short_seq_prob: float = 0.1,
                         min_sentences: int = 2) -> np.ndarray:
    """(N, 3) int64 rows (first sentence, end sentence, target length), shuffled; see the module docstring.

    Documents are sentences [doc_first[d], doc_last[d]) of `sentence_lengths` (token counts by sentence
    id); `max_len` is the longest target (T − 3). N >= num_samples (whole epochs), or 0 when no document
    has `min_sentences` sentences.

    All documents are walked at once: each step gives every unfinished document its next sample, so
    the work is vectorised over documents and the steps number the most samples in one document."""
    first, last = np.asarray(doc_first, np.int64), np.asarray(doc_last, np.int64)
    keep = last - first >= min_sentences
    first, last = first[keep], last[keep]
    if first.size == 0:
        return np.zeros((0, 3), np.int64)
    counts = last - first
    local_first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # the documents' sentences, back to back
    offset = first - local_first  # local sentence + offset[d] = sentence id
    ids = np.repeat(offset, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(np.asarray(sentence_lengths)[ids], dtype=np.int64)])
    local_last = local_first + counts
    epochs, total, epoch = [], 0, 0
    while epoch == 0 or total < num_samples:
        rng = np.random.default_rng([seed, _MAPPING, epoch])
        start, active, steps = local_first.copy(), np.arange(first.size), []
        while active.size:
            s, end_doc = start[active], local_last[active]
            short = rng.random(active.size) < short_seq_prob
            target = np.where(short, rng.integers(2, max_len + 1, active.size), max_len)
            end = np.maximum(np.searchsorted(cum, cum[s] + target, side="left"), s + 2)  # >= target, >= 2 sentences
            done = end > end_doc - 2  # fewer than two sentences would remain: take them all
            end = np.where(done, end_doc, end)
            steps.append(np.stack([s + offset[active], end + offset[active], target], axis=1))
            start[active] = end
            active = active[~done]
        epochs.append(np.concatenate(steps))
        total += len(epochs[-1])
        epoch += 1
    mapping = np.concatenate(epochs)
    return mapping[np.random.default_rng([seed, _SHUFFLE]).permutation(len(mapping))]


def wordpiece_continuations(tokenizer) -> np.ndarray:
    """(vocab_size,) bool: which ids are WordPiece continuation pieces (`##...`), from `id_to_token`."""
    lookup = getattr(tokenizer, "id_to_token", None)
    if lookup is None:
        return np.zeros(tokenizer.vocab_size, bool)
    return np.fromiter(((lookup(i) or "").startswith("##") for i in range(tokenizer.vocab_size)), bool,
                       count=tokenizer.vocab_size)


def truncated_lengths(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """The lengths Megatron's truncate_segments leaves: while too long, drop a token of the longer
    segment (B on a tie)."""
    excess = len_a + len_b - max_tokens
    if excess <= 0:
        return len_a, len_b
    gap = abs(len_a - len_b)
    if excess <= gap:  # only the longer one shrinks
        return (len_a - excess, len_b) if len_a > len_b else (len_a, len_b - excess)
    rest = excess - gap  # both at min(len_a, len_b); then B, A, B, ... in turn
    low = min(len_a, len_b)
    return low - rest // 2, low - (rest + 1) // 2


class BertDataset:
    """Megatron-style BERT samples over `documents` of a sentence-split indexed dataset (see the module
    docstring). Rows: int64 (4·seq_len + 1,); `collate` gives the model's (inputs, targets).

    `shuffled = True` tells BatchLoader that index i is already the i-th sample to train on."""

    shuffled = True

    def __init__(self, indexed: IndexedDataset, documents, seq_len: int, seed: int, num_samples: int,
                 special_ids: dict[str, int], vocab_size: int, continuation: np.ndarray | None = None,
                 cache_dir: str | Path | None = None, name: str = "train", bytes_per_token: float = 0.0,
                 masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1, max_ngram: int = 3):
        missing = [k for k in SPECIALS if k not in special_ids]
        if missing:
            raise ValueError(f"special_ids lacks {missing}; BERT needs {', '.join(SPECIALS)}")
        if seq_len < 8:
            raise ValueError(f"seq_len={seq_len} is too short for [CLS] A [SEP] B [SEP]; use at least 8")
        self.indexed, self.seq_len, self.seed, self.name = indexed, seq_len, seed, name
        self.documents = documents if isinstance(documents, range) else np.asarray(documents, np.int64)
        self.cls, self.sep, self.pad, self.mask = (int(special_ids[k]) for k in SPECIALS)
        self.vocab_size, self.bytes_per_token = vocab_size, bytes_per_token
        self.masked_lm_prob, self.short_seq_prob, self.max_ngram = masked_lm_prob, short_seq_prob, max_ngram
        self.continuation = np.zeros(0, bool) if continuation is None else np.asarray(continuation, bool)
        docs = np.arange(documents.start, documents.stop) if isinstance(documents, range) else self.documents
        bounds = indexed.document_indices
        self.doc_first, self.doc_last = bounds[docs], bounds[docs + 1]
        self.num_tokens = int(indexed.document_lengths[docs].sum()) if len(docs) else 0
        self.n_tokens = self.num_tokens  # BlendedDataset's name for it
        self.num_samples = num_samples
        (self.samples,) = cached_arrays(
            indexed.prefix, cache_dir, f"bert-{name}", self._description(), ("samples",),
            lambda: (build_sample_mapping(self.doc_first, self.doc_last, indexed.sequence_lengths, seq_len - 3,
                                          seed, num_samples, short_seq_prob),))
        ngrams = np.arange(1, max_ngram + 1)
        self._ngram_cdf = {m: np.cumsum(1 / ngrams[:m]) / np.sum(1 / ngrams[:m]) for m in ngrams.tolist()}

    def _description(self) -> dict:
        idx = self.indexed.idx_path.stat()
        docs = self.documents
        documents = ([docs.start, docs.stop] if isinstance(docs, range)
                     else {"n": len(docs), "sha": _array_digest(docs)})
        return {"version": MAPPING_VERSION, "kind": "bert", "prefix": str(Path(self.indexed.prefix).resolve()),
                "idx_bytes": idx.st_size, "idx_mtime_ns": idx.st_mtime_ns, "split": self.name,
                "documents": documents, "seq_len": self.seq_len, "seed": self.seed,
                "num_samples": self.num_samples, "short_seq_prob": self.short_seq_prob, "min_sentences": 2}

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> _TokenCount:
        """len() is the split's token count (what the trainer reports)."""
        return _TokenCount(self.num_tokens)

    def _sentences(self, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens of sentences [first, end) as int64, their lengths)."""
        idx = self.indexed
        lengths = np.asarray(idx.sequence_lengths[first:end], np.int64)
        start = int(idx.sequence_pointers[first]) // idx.dtype.itemsize
        stop = int(idx.sequence_pointers[end - 1]) // idx.dtype.itemsize + int(lengths[-1])
        if stop - start == int(lengths.sum()):  # back to back in .bin, as both tools write them
            return np.asarray(idx.tokens[start:stop], np.int64), lengths
        return np.concatenate([np.asarray(idx[s], np.int64) for s in range(first, end)]), lengths

    def __getitem__(self, i: int) -> np.ndarray:
        first, end, target = (int(x) for x in self.samples[i])
        rng = np.random.default_rng([self.seed, _SAMPLE, int(i)])
        tokens, lengths = self._sentences(first, end)
        k = int(rng.integers(1, end - first))  # A: the first k sentences
        cut = int(lengths[:k].sum())
        a, b = tokens[:cut], tokens[cut:]
        swapped = bool(rng.random() < 0.5)
        if swapped:
            a, b = b, a
        a, b = self._truncate(a, b, target, rng)
        return self._row(a, b, int(swapped), rng)

    @staticmethod
    def _truncate(a: np.ndarray, b: np.ndarray, target: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Megatron's truncate_segments: each dropped token comes off the front or the back with
        probability ½, so the number from the front is binomial."""
        la, lb = truncated_lengths(len(a), len(b), target)
        drop_a, drop_b = len(a) - la, len(b) - lb
        front_a, front_b = (int(x) for x in rng.binomial([drop_a, drop_b], 0.5))
        return a[front_a:front_a + la], b[front_b:front_b + lb]

    def _row(self, a: np.ndarray, b: np.ndarray, sop: int, rng: np.random.Generator) -> np.ndarray:
        T, la, lb = self.seq_len, len(a), len(b)
        n = la + lb + 3
        row = np.zeros(4 * T + 1, np.int64)
        ids, types, attention, labels = (row[j * T:(j + 1) * T] for j in range(4))
        ids[:] = self.pad
        ids[0], ids[1:1 + la], ids[1 + la], ids[2 + la:n - 1], ids[n - 1] = self.cls, a, self.sep, b, self.sep
        types[2 + la:n] = 1
        attention[:n] = 1
        labels[:] = IGNORE_INDEX
        row[4 * T] = sop
        positions = self._masked_positions(ids, la, lb, rng)
        if positions.size:
            labels[positions] = ids[positions]
            u = rng.random(positions.size)
            random_ids = rng.integers(0, self.vocab_size, positions.size)
            ids[positions] = np.where(u < 0.8, self.mask, np.where(u < 0.9, random_ids, ids[positions]))
        return row

    def _masked_positions(self, ids: np.ndarray, la: int, lb: int, rng: np.random.Generator) -> np.ndarray:
        """Positions to predict: whole-word n-grams up to the budget (see the module docstring)."""
        cand = np.concatenate([np.arange(1, 1 + la), np.arange(2 + la, 2 + la + lb)])
        cont = self.continuation
        is_start = ~(cont[ids[cand]] if cont.size else np.zeros(cand.size, bool))
        is_start[0] = True  # a segment's first token starts a word, whatever it is
        if lb and la:
            is_start[la] = True
        word_of = np.cumsum(is_start) - 1  # the word of each candidate
        starts = np.flatnonzero(is_start)
        n_words = starts.size
        word_len = np.diff(np.append(starts, cand.size)).tolist()
        budget = max(1, round(self.masked_lm_prob * cand.size))
        order = rng.permutation(n_words).tolist()
        u = rng.random(n_words)
        room = np.minimum(self.max_ngram, n_words - np.arange(n_words))  # n-grams may not run past the end
        pick = np.ones(n_words, np.int64)
        for m, cdf in self._ngram_cdf.items():
            sel = room == m
            pick[sel] = 1 + np.searchsorted(cdf[:-1], u[sel], side="right")
        pick = pick.tolist()
        covered = [False] * n_words
        count = 0
        for w in order:
            if count >= budget:
                break
            n = pick[w]
            size = sum(word_len[w:w + n])
            while count + size > budget and n > 1:  # a shorter n-gram, if the longer overflows the budget
                n -= 1
                size -= word_len[w + n]
            if count + size > budget or any(covered[w:w + n]):
                continue
            covered[w:w + n] = [True] * n
            count += size
        return cand[np.asarray(covered, bool)[word_of]] if n_words else cand[:0]

    def collate(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (B, 4T+1) → inputs (B, 3, T) int64 (token ids, token types, attention mask) and targets
        (B, T+1) int64 (masked-LM labels, −100 where not predicted, then the sentence-order label). The
        attention mask is 2 (not 1) at the predicted tokens, so the model's MLM head runs on those alone
        (`models/bert.py`)."""
        batch = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        T = self.seq_len
        inputs, targets = batch[:, :3 * T].reshape(-1, 3, T).clone(), batch[:, 3 * T:]
        inputs[:, 2] += targets[:, :T] != IGNORE_INDEX
        return inputs, targets


def _array_digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, np.int64).tobytes()).hexdigest()[:16]


class BlendedBertDataset(BlendedDataset):
    """BlendedDataset of BertDatasets (of one seq_len), with their `collate`."""

    def collate(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return self.datasets[0].collate(rows)

