"""A generation request as the engine carries it: what the client asked (prompt, sampling parameters, adapter),
what it has produced (tokens, text, finish reason, timings) and its place in the paged KV cache (blocks held,
positions computed, prefix hashes, this step's speculative drafts).

The scheduler (`infer/scheduler.py`) reads and updates its cache fields; the engine (`infer/engine.py`) its
output and sampling state. Plain data, no model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshlm.infer.sampling import SamplingParams, TokenInfo


@dataclass(eq=False)  # a request is itself: compared by identity (the scheduler's lists)
class Request:
    """One prompt's generation (one choice of an HTTP request): see the module docstring."""

    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request], None] | None = None  # called from the engine thread after each change
    id: int = 0
    adapter: int = 0  # the engine's adapter index (0: the base)
    client: str | None = None  # who sent it (the server's peer address): its share of the queue is bounded
    tag: object = None  # its submitter's own name for it (`Engine.submit_group`'s tags)
    head: list[int] = field(default_factory=list)  # ids before the prompt in the row (`Engine.head`)
    output_ids: list[int] = field(default_factory=list)
    output: list[TokenInfo] = field(default_factory=list)
    prompt_tokens: list[TokenInfo] = field(default_factory=list)  # with echo: the prompt's tokens
    text: str = ""  # the output text, cut at a stop string
    emitted: int = 0  # characters of `text` safe to stream (not a possible stop-string prefix)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    cancelled: bool = False
    generator: torch.Generator | None = None
    counts: dict[int, int] = field(default_factory=dict)  # output token counts (penalties)
    seen: set[int] = field(default_factory=set)  # prompt + output ids (repetition penalty)
    done_event: threading.Event = field(default_factory=threading.Event)
    # the paged cache (the scheduler's): blocks held, positions computed, chained hashes of full blocks,
    # blocks registered for prefix reuse, this step's speculative drafts, the prompt's log-probabilities done;
    # freed: the first blocks of `blocks` already given back (out of every layer's sliding window): their entries
    # stay, so that a position's block is still blocks[position // block_size], but are never read unmasked
    blocks: list[int] = field(default_factory=list)
    freed: int = 0
    local_blocks: list[int] = field(default_factory=list)  # the local layers' table, when they have their own pool
    local_freed: int = 0
    computed: int = 0
    hashes: list[int] = field(default_factory=list)
    registered: int = 0
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    prompt_done: bool = False

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """The ids of its row's positions start..end-1: the head, the prompt, the output (a decoding step asks
        for the last one only: no copy of the whole row)."""
        fixed = len(self.head) + len(self.prompt_ids)
        if start >= fixed:
            return self.output_ids[start - fixed:None if end is None else end - fixed]
        return (self.head + self.prompt_ids + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        """Positions of its cache row in use: the head (a prompt adapter's virtual tokens), prompt, output."""
        return len(self.head) + len(self.prompt_ids) + len(self.output_ids)

    @property
    def wants_prompt_logits(self) -> bool:
        """Echo with logprobs, prompt not done yet: every prompt position's logits are wanted (and its prompt
        is computed, never taken from the prefix cache)."""
        return self.params.echo and self.params.logprobs is not None and not self.prompt_done
