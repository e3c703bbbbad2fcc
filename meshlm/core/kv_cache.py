"""The serving engine's KV cache, in bytes: what one position of each layer costs and how many positions a
sequence holds (torch-free; the engine's pool, `models/paged.py`, and the serving planner, `plan/inference.py`,
both read it, so the two can never disagree).

Per token and layer, in elements of the cache's dtype:
    attention (MHA, GQA):       2 · n_kv_heads · head_dim            (a key and a value per KV head)
    latent attention (MLA):     kv_lora_rank + qk_rope_head_dim      (the normalised latent c and the RoPE key k_r,
                                                                      shared by every head: models/mla.py)
A sequence of L positions holds every position of a global layer. A local layer (sliding window W) reads only its
last W positions, so the engine frees the blocks wholly before them as the sequence grows (`infer/scheduler.py`):
a sequence then holds at most `window_blocks(W, block_size)` blocks of a local layer, i.e. min(L, W) positions
plus at most a block and a half of rounding. When every layer is local they share one block table and pool;
when local and global layers alternate (`model.window_pattern`) the local layers get a block table and pool of
their own (two KV cache groups, as vLLM's hybrid allocator keeps one per kind of layer), so their blocks are
freed while the global layers keep theirs (`kv_groups`).
"""

from __future__ import annotations

from meshlm.core.config import ModelConfig


def layer_cache_elements(m: ModelConfig) -> int:
    """Elements one layer's paged cache holds per position (module doc)."""
    if m.attention == "mla":
        return m.kv_lora_rank + m.qk_rope_head_dim
    return 2 * m.kv_heads * m.head_dim


def cache_bytes_per_token(m: ModelConfig, elem_bytes: int) -> int:
    """Bytes of one position of every layer in the engine's pool: n_layers · `layer_cache_elements` · elem_bytes."""
    return m.n_layers * layer_cache_elements(m) * elem_bytes


def local_layers(m: ModelConfig) -> list[bool]:
    """Per layer, whether it is local (has a sliding window)."""
    return [bool(m.layer_window(i)) for i in range(m.n_layers)]


def kv_groups(m: ModelConfig) -> tuple[int, int]:
    """(window of the main group, window of a separate local group) of the engine's KV cache: (W, 0) when every
    layer is local (one group, freed by its window), (0, W) when local and global layers are mixed (the global
    layers' group keeps every block, the local layers' group is freed), (0, 0) with no window."""
    local = local_layers(m)
    if not any(local):
        return 0, 0
    return (m.sliding_window, 0) if all(local) else (0, m.sliding_window)


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a decoding sequence holds under a window W: its query at position p reads positions
    p − W + 1 .. p, which touch at most ⌈(W − 1) / block_size⌉ + 1 blocks (≤ ⌈W / block_size⌉ + 1)."""
    return -(-(window - 1) // block_size) + 1


def blocks_needed(positions: int, block_size: int, window: int = 0, chunk: int | None = None) -> int:
    """The most blocks a sequence of `positions` positions holds at once in one pool: all of them, or under a
    window W those of its longest step (`chunk` positions, None: all at once) and the W − 1 positions before it:
    ⌈(chunk + W − 1) / block_size⌉ + 1."""
    whole = -(-positions // block_size)
    if not window:
        return whole
    step = min(positions, chunk or positions)
    return min(whole, -(-(step + window - 1) // block_size) + 1)


def held_positions(m: ModelConfig, layer: int, tokens: int, block_size: int = 1) -> int:
    """Positions of a `tokens`-long sequence that layer `layer`'s cache holds while decoding, in whole blocks of
    `block_size` (1: the analytic count): every one, or for a local layer at most `window_blocks`' worth."""
    whole = -(-tokens // block_size) * block_size
    window = m.layer_window(layer)
    return min(whole, window_blocks(window, block_size) * block_size) if window else whole


def sequence_cache_bytes(m: ModelConfig, tokens: int, elem_bytes: int, block_size: int = 1) -> int:
    """Bytes of the pool one sequence of `tokens` positions holds while decoding: Σ over layers of its held
    positions × `layer_cache_elements` × elem_bytes (module doc)."""
    held = sum(held_positions(m, i, tokens, block_size) for i in range(m.n_layers))
    return held * layer_cache_elements(m) * elem_bytes
