"""The KV cache's block pool: fixed-size blocks handed out to sequences, shared by prefix, evicted when unused.

The cache is `num_blocks` blocks of `block_size` positions (`models/paged.py` holds the tensors); a sequence holds
a list of blocks (its block table) and nothing else, so memory follows the tokens a sequence really has, never a
reservation of the longest one.

Prefix caching: a block whose positions are all computed is registered under the hash of its content chained
to its predecessors' (`block_hashes`: the tokens of blocks 0..j and a salt, the adapter, since an adapter changes
the keys and values), so a later request whose first blocks hold the same tokens takes those blocks instead of
recomputing them (`match`). A block is reference-counted: when the last sequence holding it lets it go it stays
registered, in least-recently-used order, until an allocation needs a block and no unregistered one is free
(then the oldest such block is evicted: its registration dropped and its positions reused). Each registered
block keeps its tokens: a hash collision can never hand out another prefix's keys.
"""

from __future__ import annotations

from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int, salt: int = 0, known: list[int] | None = None) -> list[int]:
    """The chained hash of each full block of `tokens` (block j's depends on blocks 0..j and `salt`); `known`:
    the hashes already computed for the first blocks (extended, not recomputed)."""
    out = list(known or [])
    parent = out[-1] if out else hash(("meshlm-prefix", salt))
    for j in range(len(out), len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[j * block_size:(j + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """Blocks 0..num_blocks-1: allocation, reference counts, prefix registration and LRU eviction."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs num_blocks >= 1 and block_size >= 1 (got {num_blocks}, "
                             f"{block_size})")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # unregistered and unused (pop from the end)
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered, unused: oldest first (evicted first)
        self.refs = [0] * num_blocks
        self.key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks  # (hash, tokens) if registered
        self.by_hash: dict[int, int] = {}
        self.stats = {"evictions": 0}

    @property
    def available(self) -> int:
        """Blocks an allocation may take now (free, or registered and unused)."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.available

    def match(self, tokens: list[int], hashes: list[int], limit: int) -> list[int]:
        """The registered blocks that hold the first full blocks of `tokens` (by their `hashes`), at most
        `limit` positions' worth; each is taken (its reference count raised)."""
        blocks: list[int] = []
        if self.prefix_caching:
            bs = self.block_size
            for j, h in enumerate(hashes[:limit // bs]):
                b = self.by_hash.get(h)
                if b is None or self.key[b][1] != tuple(tokens[j * bs:(j + 1) * bs]):
                    break
                blocks.append(b)
            for b in blocks:
                self.take(b)
        return blocks

    def take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.cached.pop(block, None)
        self.refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks (reference count 1), or None (and nothing taken) when fewer are available."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:  # the least recently used registered block loses its registration
                b, _ = self.cached.popitem(last=False)
                self.by_hash.pop(self.key[b][0], None)
                self.key[b] = None
                self.stats["evictions"] += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Let `blocks` go (a sequence finished or was preempted): unused registered blocks stay reusable,
        newest last (the last block of a sequence is evicted before its first, reversed order)."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.key[b] is not None:
                    self.cached[b] = None
                else:
                    self.free.append(b)

    def register(self, block: int, h: int, tokens: list[int]) -> None:
        """`block` now holds the computed keys/values of `tokens` (a full block) under chained hash `h`."""
        if not self.prefix_caching or self.key[block] is not None or h in self.by_hash:
            return
        self.key[block] = (h, tuple(tokens))
        self.by_hash[h] = block
