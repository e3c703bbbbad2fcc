"""Fixed-length GPT samples and a resumable, deterministic batch order.

A split's documents are concatenated with an end-of-document token after each; sample i is the window
`tokens[i·s : i·s + s + 1]` (inputs and shifted targets), crossing document boundaries as Megatron does.
Each epoch visits every sample once in an order drawn from (seed, epoch). The loader's position is the
number of samples consumed, so a checkpoint resumes with the very next sample.
"""

from __future__ import annotations

import numpy as np
import torch

from meshlm.data.corpus import TokenizedCorpus


class GPTSamples:
    def __init__(self, corpus: TokenizedCorpus, docs: range, seq_len: int, eod_id: int):
        parts = []
        for d in docs:
            parts.append(np.asarray(corpus.doc(d), dtype=np.int64))
            parts.append(np.asarray([eod_id], dtype=np.int64))
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self.seq_len = seq_len
        self.n_bytes = int(sum(corpus.n_bytes[d] for d in docs))
        self.n_samples = max(0, (len(self.tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    @property
    def bytes_per_token(self) -> float:
        return self.n_bytes / max(1, len(self.tokens))


class SampleOrder:
    """Global sample index → dataset index: a fresh permutation per epoch, seeded by (seed, epoch)."""

    def __init__(self, n_samples: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n_samples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __getitem__(self, g: int) -> int:
        epoch, i = divmod(g, self.n)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._epoch = epoch
        return int(self._perm[i])


class BatchLoader:
    """Hands out micro-batches of (inputs, targets); `consumed` samples is the resumable position."""

    def __init__(self, samples: GPTSamples, micro_batch_size: int, seed: int, consumed: int = 0,
                 shuffle: bool = True):
        if len(samples) == 0:
            raise ValueError("dataset has no complete sample; use more text or a shorter model.seq_len")
        self.samples, self.mbs = samples, micro_batch_size
        self.order = SampleOrder(len(samples), seed, shuffle)
        self.consumed = consumed

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.samples[self.order[self.consumed + j]] for j in range(self.mbs)]
        self.consumed += self.mbs
        batch = torch.from_numpy(np.stack(rows))  # (B, s + 1)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
