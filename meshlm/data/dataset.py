"""A resumable, deterministic batch order over a split's samples.

The loader's position is the number of samples consumed, so a checkpoint resumes with the very next
sample. Under data parallelism every dp rank reads the same global order and takes its own slice of
each step's global batch (Megatron's order: micro-batch k of rank r is samples `consumed + (k·dp + r)·mbs`
onwards), so the global batch, and the position, are the same whatever dp is. Datasets that carry their
own shuffle (`shuffled = True`: GPTDataset, BlendedDataset, whose index i already is the i-th sample to
train on) are read in order; any other sized dataset gets a fresh permutation per epoch drawn from
(seed, epoch). A batch is (inputs, targets) = rows shifted by one token (GPT), unless the samples have a
`collate(rows)` method, which then makes the pair (BertDataset).
"""

from __future__ import annotations

import numpy as np
import torch


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
    """Hands out micro-batches of (inputs, targets); `consumed` samples (over all dp ranks) is the resumable
    position. With `dp_size` > 1, each call consumes `micro_batch_size · dp_size` samples, of which this rank
    returns its `dp_rank`-th slice."""

    def __init__(self, samples, micro_batch_size: int, seed: int, consumed: int = 0, shuffle: bool = True,
                 dp_rank: int = 0, dp_size: int = 1):
        if len(samples) == 0:
            raise ValueError("dataset has no complete sample; use more text or a shorter model.seq_len")
        self.samples, self.mbs = samples, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        shuffle = shuffle and not getattr(samples, "shuffled", False)
        self.order = SampleOrder(len(samples), seed, shuffle)
        self.consumed = consumed

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.consumed + self.dp_rank * self.mbs
        rows = [np.asarray(self.samples[self.order[first + j]], dtype=np.int64) for j in range(self.mbs)]
        self.consumed += self.mbs * self.dp_size
        collate = getattr(self.samples, "collate", None)
        if collate is not None:  # samples that know their batch layout (BertDataset)
            return collate(np.stack(rows))
        batch = torch.from_numpy(np.stack(rows))  # (B, s + 1)
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
