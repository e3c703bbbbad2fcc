"""The engine's scheduler: which requests run in the next step, how many tokens each, in which KV cache blocks.

Every step (`Engine.step`) it decides, with no model in sight:
- the token budget (`max_batched_tokens`): running requests first (decoding rows before prefill chunks, so a
  long prompt never stalls the tokens of the others: chunked prefill), then waiting requests join in arrival
  order while rows (`max_seqs`) and budget are left (continuous batching);
- the blocks (`infer/blocks.py`): a request holds blocks for the positions it computes, taken as it grows; a
  joining request first takes the registered blocks that hold its prompt's first full blocks (prefix caching),
  and registers its own once computed (`register`);
- preemption: when a running request's next tokens find no free block, the newest running requests give theirs
  back and wait at the head of the queue, to be recomputed from their tokens when they return (itself last);
- KV cache groups (`KVGroup`, `core/kv_cache.kv_groups`): a request holds one block table per group, each over
  its group's pool: one group for every layer, or, when local (sliding-window) and global layers are mixed, a
  second one for the local layers. In a group with a window W no later query reads a position before
  computed − W + 1, so the blocks wholly before it go back to that group's pool as the request grows
  (`free_out_of_window`, before each reservation: a block another request or the prefix cache still holds
  keeps its reference). A request then holds there at most the blocks of its step and the W − 1 positions
  before it. Admission and reservation take blocks from every group; prefix caching matches the prefix that
  every group still holds.

`schedule()` returns what runs (`Scheduled`); after the engine has attached speculative drafts, `plan(work)`
freezes it into a `StepPlan`: per sequence its request, tokens and share of the logits, and the `ForwardPlan` the
runner executes (`infer/runner.py`): plain tuples, so that a tensor-parallel leader can broadcast it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from meshlm.core.kv_cache import blocks_needed
from meshlm.infer.blocks import BlockPool, block_hashes
from meshlm.infer.request import Request


@dataclass
class KVGroup:
    """Layers sharing one block table per request over one pool: `pool`; `window` (0: every block kept, W: blocks
    out of the window freed); `table` and `freed` name the request's fields holding its table and how many of
    its first blocks went back (`Request.blocks`/`freed`, or `local_blocks`/`local_freed`)."""

    pool: BlockPool
    window: int = 0
    table: str = "blocks"
    freed: str = "freed"


@dataclass(frozen=True)
class ForwardPlan:
    """One forward of the model over the step's N tokens (`Runner.forward`).

    ids: the N token ids; rows: (positions, block table) per sequence, in token order; select: the token indices
    whose logits are returned; adapters: the adapter index per token, or None (all the base); virtual: (token
    index, adapter, position) of a prompt adapter's virtual tokens; local_tables: per sequence its local layers'
    block table, when they have a pool of their own (else empty)."""

    ids: tuple[int, ...]
    rows: tuple[tuple[range, tuple[int, ...]], ...]
    select: tuple[int, ...]
    adapters: tuple[int, ...] | None = None
    virtual: tuple[tuple[int, int, int], ...] = ()
    local_tables: tuple[tuple[int, ...], ...] = ()

    def __getitem__(self, name: str):
        """`plan["ids"]`: the fields by name too (the plan was a dict before it was a dataclass)."""
        return getattr(self, name)


@dataclass(frozen=True)
class SeqPlan:
    """A sequence of the step: `tokens` of `request` computed from position `start`, plus its `drafts`
    (speculative tokens, verified by this step); `logits`: how many rows of the step's logits are its (in plan
    order): every token's (prompt logprobs, or drafts to verify), the last one's (its prompt or output is then
    all computed: the next token is sampled), or none (a prefill chunk before the last)."""

    request: Request
    start: int
    tokens: int
    drafts: tuple[int, ...]
    logits: int


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: its sequences (sorted as the forward lays them out) and the forward itself."""

    seqs: tuple[SeqPlan, ...]
    forward: ForwardPlan

    @property
    def n_tokens(self) -> int:
        return len(self.forward.ids)


@dataclass(frozen=True)
class Scheduled:
    """`schedule()`'s answer: (request, tokens) that run, the token budget left (for speculative drafts), and
    cancelled requests taken out of the queue (the engine finishes them as aborted)."""

    work: tuple[tuple[Request, int], ...]
    budget: float
    aborted: tuple[Request, ...] = ()


class Scheduler:
    """Admission, block reservation, preemption, prefix registration and the token budget (module docstring).

    `waiting` is the engine's queue (appended to under `lock` by `Engine.submit_group`; admission takes from
    its head, preemption puts back there); `active` the running
    requests in the order they were admitted; `stats` the engine's counters (preemptions and prefix hits
    counted here); `on_release(req)` is told when a request gives its blocks back (its draft rows go too)."""

    def __init__(self, pool: BlockPool, max_seqs: int, max_batched_tokens: int | None,
                 lock: threading.Lock | None = None, stats: dict | None = None,
                 on_release: Callable[[Request], None] | None = None, waiting: deque[Request] | None = None,
                 window: int = 0, local: KVGroup | None = None):
        self.pool, self.block_size = pool, pool.block_size
        self.groups = [KVGroup(pool, window)] + ([local] if local is not None else [])
        self.max_seqs, self.max_batched_tokens = max_seqs, max_batched_tokens
        self.lock = lock or threading.Lock()
        self.stats = stats if stats is not None else {"preemptions": 0, "prefix_queried_tokens": 0,
                                                      "prefix_hit_tokens": 0}
        self.stats.setdefault("window_freed_blocks", 0)
        self.on_release = on_release
        self.waiting: deque[Request] = waiting if waiting is not None else deque()
        self.active: list[Request] = []

    # ---- one step ----
    def schedule(self) -> Scheduled:
        """Running requests first, then waiting ones, within the token budget and the pool's blocks."""
        budget = self.max_batched_tokens or math.inf
        work, budget = self._schedule_running(budget)
        aborted: list[Request] = []
        admitted, budget = self._admit(budget, aborted)
        return Scheduled(tuple(work + admitted), budget, tuple(aborted))

    def retire(self) -> None:
        """Take finished requests out of the running batch and give their blocks back."""
        keep = []
        for req in self.active:
            if req.finished:
                self.release(req)
            else:
                keep.append(req)
        self.active[:] = keep

    def plan(self, work: list[tuple[Request, int]] | tuple[tuple[Request, int], ...]) -> StepPlan:
        """The frozen plan of `work`, sorted by tokens per sequence (decoding rows first; sequences with as many
        tokens attend together), then by length (similar lengths share an attention call, `models/paged.py`)."""
        work = sorted(work, key=lambda w: (w[1] + len(w[0].drafts), w[0].computed))
        ids, rows, select, adapters, virtual, seqs, local = [], [], [], [], [], [], []
        for req, n in work:
            first, selected = len(ids), len(select)
            drafts = tuple(req.drafts)
            tokens = req.tokens(req.computed, req.computed + n) + list(drafts)
            pos = range(req.computed, req.computed + len(tokens))
            ids.extend(tokens)
            rows.append((pos, tuple(req.blocks)))
            if len(self.groups) > 1:
                local.append(tuple(req.local_blocks))
            adapters.extend([req.adapter] * len(tokens))
            virtual.extend((first + i, req.adapter, p) for i, p in enumerate(pos) if p < len(req.head))
            if req.wants_prompt_logits or drafts:
                select.extend(range(first, len(ids)))
            elif req.computed + n == req.length:
                select.append(len(ids) - 1)
            seqs.append(SeqPlan(req, req.computed, n, drafts, len(select) - selected))
        forward = ForwardPlan(tuple(ids), tuple(rows), tuple(select), tuple(adapters) if any(adapters) else None,
                              tuple(virtual), tuple(local))
        return StepPlan(tuple(seqs), forward)

    # ---- the cache's blocks ----
    def release(self, req: Request) -> None:
        """Give `req`'s blocks back to the pools (its registered ones stay reusable by prefix)."""
        for g in self.groups:
            g.pool.release(getattr(req, g.table)[getattr(req, g.freed):])
            setattr(req, g.table, [])
            setattr(req, g.freed, 0)
        if self.on_release is not None:
            self.on_release(req)

    def free_out_of_window(self, req: Request) -> None:
        """In each group with a window W, give back the blocks of `req` wholly before position computed − W + 1,
        which no later query of its layers reads (module doc); their entries stay in its table (`Request.freed`)."""
        for g in self.groups:
            if not g.window:
                continue
            table, freed = getattr(req, g.table), getattr(req, g.freed)
            dead = min(max(0, req.computed - g.window + 1) // self.block_size, len(table))
            if dead > freed:
                g.pool.release(table[freed:dead])
                self.stats["window_freed_blocks"] += dead - freed
                setattr(req, g.freed, dead)

    def blocks_needed(self, positions: int, window: int = 0) -> int:
        """The most blocks a request of `positions` positions holds at once in a group: all of them, or under a
        window W those of its longest step (a prefill chunk of up to `max_batched_tokens`) and the W − 1 positions
        before it."""
        return blocks_needed(positions, self.block_size, window, self.max_batched_tokens)

    def reserve(self, req: Request, positions: int) -> bool:
        """Blocks for positions 0..positions-1 of `req` in every group (more taken as needed, after its blocks
        out of a window went back); False when a pool is short (what the others gave stays with `req`)."""
        self.free_out_of_window(req)
        for g in self.groups:
            table = getattr(req, g.table)
            need = -(-positions // self.block_size) - len(table)
            if need <= 0:
                continue
            got = g.pool.allocate(need)
            if got is None:
                return False
            table.extend(got)
        return True

    def preempt(self, req: Request) -> None:
        """Take `req` out of the running batch (the pool ran short): its blocks go back, it waits at the head of
        the queue, and is recomputed from its tokens (prompt and output so far) when it comes back."""
        self.active.remove(req)
        self.release(req)
        req.computed = 0
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def register(self, req: Request) -> None:
        """Register `req`'s newly completed blocks for prefix reuse."""
        full = req.computed // self.block_size
        if not self.pool.prefix_caching or full <= len(req.hashes) and full <= req.registered:
            return
        tokens = req.tokens()
        req.hashes = block_hashes(tokens[:full * self.block_size], self.block_size, req.adapter, req.hashes)
        bs = self.block_size
        for g in self.groups:
            table = getattr(req, g.table)
            for j in range(max(req.registered, getattr(req, g.freed)), full):  # a freed block may be another's now
                g.pool.register(table[j], req.hashes[j], tokens[j * bs:(j + 1) * bs])
        req.registered = full

    # ---- scheduling ----
    def _schedule_running(self, budget: float) -> tuple[list[tuple[Request, int]], float]:
        """(request, tokens) for the running requests, oldest first, within `budget` tokens; a request whose next
        tokens find no free block preempts the newest running ones (itself last)."""
        out, scheduled = [], set()
        for req in sorted(self.active, key=lambda r: r.length - r.computed > 1):  # decoding rows first
            if req not in self.active:  # preempted for an older one
                continue
            n = int(min(req.length - req.computed, max(budget, 1)))  # a decoding row always runs
            if req.length - req.computed > 1 and budget <= 0:
                break
            while not self.reserve(req, req.computed + n):
                victims = [r for r in reversed(self.active) if r is not req and id(r) not in scheduled]
                self.preempt(victims[0] if victims else req)
                if not victims:
                    break
            if req not in self.active:
                continue
            scheduled.add(id(req))
            out.append((req, n))
            budget -= n
        return out, budget

    def _admit(self, budget: float, aborted: list[Request]) -> tuple[list[tuple[Request, int]], float]:
        """(request, tokens) for waiting requests that now join (rows and blocks free), within `budget` tokens;
        their first blocks are taken from the prefix cache where another request computed the same tokens.
        Cancelled ones met at the head of the queue leave it (into `aborted`)."""
        out = []
        while budget > 0 and len(self.active) < self.max_seqs:
            with self.lock:
                if not self.waiting:
                    break
                req = self.waiting[0]
            if req.cancelled:
                with self.lock:
                    self.waiting.popleft()
                self.release(req)
                aborted.append(req)
                continue
            if not req.blocks and req.computed == 0 and not req.wants_prompt_logits:
                self._match_prefix(req)
            n = int(min(req.length - req.computed, budget))
            if not self.reserve(req, req.computed + n):  # it waits, holding nothing
                self.release(req)
                req.computed = req.registered = 0
                if not self.active:  # nothing will free blocks: cannot happen (check() bounds a request)
                    raise RuntimeError("the KV cache pool cannot hold one request")
                break
            if self.pool.prefix_caching and not req.wants_prompt_logits:
                self.stats["prefix_queried_tokens"] += req.length - 1
                self.stats["prefix_hit_tokens"] += req.computed
            with self.lock:
                self.waiting.popleft()
            self.active.append(req)
            out.append((req, n))
            budget -= n
        return out, budget

    def _match_prefix(self, req: Request) -> None:
        """Take the registered blocks holding `req`'s first full blocks (all but its last position, whose logits
        are needed): those positions count as computed."""
        tokens = req.tokens()
        req.hashes = block_hashes(tokens, self.block_size, req.adapter, req.hashes)
        tables = [g.pool.match(tokens, req.hashes, req.length - 1) for g in self.groups]
        n = min(len(t) for t in tables)  # the prefix every group still holds
        for g, table in zip(self.groups, tables):
            g.pool.release(table[n:])
            setattr(req, g.table, table[:n])
        req.computed = req.registered = n * self.block_size
