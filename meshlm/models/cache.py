"""The one interface between attention and a KV cache: `update_and_attend`.

`Attention.forward` (models/layers.py) computes the step's queries, keys and values and hands all three to its
cache, which stores the new keys and values and returns the attention output over everything it holds. Two
caches implement it, each with its own layout:
- `KVCache` (models/layers.py): (B, n_kv_heads, max_len, hs) rows for `models.generate` (evaluation, the
  sample a training run prints), every row at the same position (an int `start`), or each at its own (a (B,)
  tensor `start`);
- `PagedCache` (models/paged.py): the serving engine's pool of blocks, read through block tables, with its own
  per-token layout (`start` is then the step's positions, already in the cache's `Batch`): `meshlm serve`,
  `meshlm generate` and `meshlm chat` (infer/local.py), and the draft model (infer/speculative.py).
So a new attention path (attention over the pool in place, a compiled kernel) is one more implementation here,
not one more branch in Attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# core(q, k, v, causal, mask) -> y: the layer's attention kernel (scaled dot product, GQA aware)
AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, "torch.Tensor | None"], torch.Tensor]


class AttentionCache:
    """A layer's KV cache as attention sees it (module docstring)."""

    def update_and_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                          core: AttentionCore, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Store the new keys/values `k`, `v` (B, nkv, T, hs) at positions `start`.. and return `core`'s attention
        of the queries `q` (B, nh, T, hs) over every key the cache holds up to each query's position:
        (B, nh, T, hs). `mask` (bool, True = attend): a caller's own mask, where the cache allows one."""
        raise NotImplementedError
