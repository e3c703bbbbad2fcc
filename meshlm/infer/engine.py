"""The inference engine: continuous batching over a paged KV cache, in three pieces (docs/serving.md).

- The KV cache is one pool of fixed-size blocks per layer (`--block-size` positions each, `--num-blocks` of
  them, allocated once: `Runner.cache_bytes()`); a request holds a block table, the blocks of the positions it
  has computed, taken as it grows, so memory follows the tokens a request really has (`infer/blocks.py`). An MLA
  layer caches its latent and RoPE key, not keys and values; sliding-window layers give back the blocks that
  fall out of their window, in a pool of their own when global layers are mixed in (docs/serving.md, "Cache
  memory"; `core/kv_cache.py` is the formula).
- The scheduler (`infer/scheduler.py`) decides each step, with no model: running requests first (decoding
  rows, then prefill chunks), then waiting ones in arrival order while rows (`max_seqs`), blocks and the token
  budget (`max_batched_tokens`: chunked prefill) last; a prompt whose first full blocks another request
  computed takes them (prefix caching); when blocks run out the newest running requests are preempted
  (their blocks freed, recomputed from their tokens later). It returns a frozen `StepPlan`.
- The runner (`infer/runner.py`) executes the plan's forward: one model call over every token of the step
  (decoding rows, prefill chunks, speculative drafts) as rows of one token with their own positions; each
  layer writes keys and values into the plan's block slots and attends through the block tables
  (`models/paged.py`). Under tensor parallelism rank 0's runner broadcasts each plan (`DistributedRunner`),
  the other ranks replay it (`worker_loop`).
- The engine (here) keeps the queue, the thread and acceptance. Requests wait in a bounded queue
  (`max_queue`; beyond it `submit` raises `QueueFull`; one client holds at most half of it, and one request's
  prompts are queued all or none: `submit_group`). After each forward it samples every request whose tokens
  are all computed, checks stop rules, and tells the request's owner (`on_update`).
- Sampling is per request: temperature, top-k, top-p, a seeded generator per request, repetition /
  presence / frequency penalties, stop strings and token ids, `max_tokens`. Log-probabilities are the
  model's (log-softmax of the logits before any penalty or temperature): of the chosen token and the top N,
  and with `echo` of every prompt token after the first.
- Speculative decoding (`infer/speculative.py`, `--speculative ngram|draft`): decoding rows take up to k
  draft tokens (in blocks the scheduler reserves, within the budget left), the step verifies them in the same
  forward, rejection sampling keeps a prefix plus one token of the target's own.
- An exception while running a request (its prefill, sampling, text; a step for the rows of that step) fails
  those requests alone (finish_reason "error", `error` said) and the engine goes on; only an error outside
  any request (or a failed model call under tensor parallelism) stops the loop (`dead`).
- Adapters (`infer/adapters.py`): a request may name one of the engine's adapters (index 1..K; 0 is the
  base). Rows of different adapters share a step: LoRA runs unmerged on each row's own matrices, and a
  prompt adapter's virtual tokens are placed before the prompt (n more positions of the row, not counted as
  prompt tokens). A request's row starts as a tuning row does (`tune/data.py`) and as `meshlm generate
  --adapter` lays it out: a prompt adapter's virtual tokens, then the prompt; a LoRA adapter's row, like the
  base's, is its prompt alone (as PEFT runs an exported adapter).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshlm.core.kv_cache import blocks_needed, kv_groups
from meshlm.infer import openmp, sampling
from meshlm.infer.blocks import BlockPool
from meshlm.infer.request import Request
from meshlm.infer.runner import DistributedRunner, Runner, worker_loop  # noqa: F401 -- worker_loop: the engine's API
from meshlm.infer.sampling import (  # noqa: F401 -- re-exported: the engine's API
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    SamplingParams,
    TokenInfo,
    apply_penalties,
    sample_token,
)
from meshlm.infer.scheduler import KVGroup, Scheduler, StepPlan
from meshlm.infer.speculative import target_probs, verify


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: retry later."""


class EngineDead(RuntimeError):
    """The engine loop stopped (an error in the model, or a shutdown)."""


class Histogram:
    """Cumulative bucket counts (Prometheus' histogram), bounded memory whatever the number of requests."""

    BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, math.inf)

    def __init__(self):
        self.counts = [0] * len(self.BOUNDS)
        self.count, self.total = 0, 0.0
        self.lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            for i, bound in enumerate(self.BOUNDS):
                if value <= bound:
                    self.counts[i] += 1
            self.count += 1
            self.total += value

    def snapshot(self) -> tuple[list[tuple[float, int]], int, float]:
        with self.lock:
            return list(zip(self.BOUNDS, self.counts)), self.count, self.total


@dataclass(frozen=True)
class Limits:
    """What a request is checked against before it is queued: the context, the vocabulary, the pool and the
    queue. Plain data, so that a server whose engine runs in another process checks its requests without
    asking it (`infer/engine_process.py`)."""

    max_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    window: int  # the main group's sliding window (0: none)
    max_batched_tokens: int | None
    max_queue: int

    def check(self, prompt_ids: list[int], params: SamplingParams, head: int = 0) -> None:
        """InvalidRequest for a request the engine cannot run (`head`: positions its adapter puts before it)."""
        params.validate()
        vocab = self.vocab_size
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in 0..{vocab - 1}", "prompt")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidRequest(f"stop_token_ids must be token ids in 0..{vocab - 1} (got {bad_stop[0]})",
                                 "stop_token_ids")
        room = self.max_len - head  # positions left after the adapter's virtual tokens
        context = f"{self.max_len} tokens" + (f" ({head} of them the adapter's virtual tokens)" if head else "")
        if len(prompt_ids) > room:
            raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens, more than the model's context of "
                                 f"{context}", "prompt")
        if len(prompt_ids) + params.max_tokens > room:
            raise InvalidRequest(f"max_tokens {params.max_tokens} with the prompt's {len(prompt_ids)} tokens is "
                                 f"more than the model's context of {context}; at most "
                                 f"{room - len(prompt_ids)}", "max_tokens")
        # within the context: only a pool smaller than one sequence (under a window: its longest step) refuses it;
        # a local layers' pool of their own holds as much as the main one needs (`CacheOptions.local_blocks_for`)
        blocks = blocks_needed(head + len(prompt_ids) + params.max_tokens, self.block_size, self.window,
                               self.max_batched_tokens)
        if blocks > self.num_blocks:
            raise InvalidRequest(f"the prompt's {len(prompt_ids)} tokens and max_tokens {params.max_tokens} need "
                                 f"{blocks} KV cache blocks of {self.block_size} positions; the cache holds "
                                 f"{self.num_blocks} (raise --num-blocks)", "max_tokens")

    def client_share(self, client: str | None) -> int:
        """The most waiting requests one client may hold: half the queue (at least 1), so that one client
        sending as fast as it can leaves the other half to the others (docs/serving.md, "Fair queueing");
        requests without a client (the engine used in-process) may fill the whole queue."""
        return self.max_queue if client is None else max(1, self.max_queue // 2)

    def check_group(self, n: int, client: str | None) -> None:
        """InvalidRequest (param "prompt") when one request's `n` prompts and choices are more than `client` may
        ever queue: no wait would change it."""
        share = self.client_share(client)
        if n > share:
            whose = "in all" if client is None else "of one client (half of it)"
            raise InvalidRequest(f"the request has {n} prompts and choices; the queue holds at most {share} {whose} "
                                 f"(meshlm serve --max-queue {self.max_queue}): send at most {share} at a time or "
                                 "raise --max-queue", "prompt")

    def check_room(self, waiting: list[str | None], n: int, client: str | None) -> None:
        """QueueFull (retry later) when the queue, whose waiting requests came from the clients `waiting`, or
        `client`'s share of it, has no room for `n` more now."""
        if len(waiting) + n > self.max_queue:
            raise QueueFull(f"{len(waiting)} requests are waiting, room for {self.max_queue - len(waiting)} of "
                            f"this request's {n}")
        share = self.client_share(client)
        mine = 0 if client is None else sum(c == client for c in waiting)
        if mine + n > share:
            raise QueueFull(f"this client has {mine} requests waiting, room for {share - mine} of this request's "
                            f"{n} (one client may hold {share} of the {self.max_queue} places)")


@dataclass
class CacheOptions:
    """The engine's cache and scheduling options (`meshlm serve` flags; docs/serving.md).

    block_size: positions per KV block; num_blocks: the pool (None: every row's `max_len` in blocks, as much
    as before paging); prefix_caching: share the blocks of identical prompt prefixes; max_batched_tokens: the
    tokens one step runs at most (decoding rows first, then prefill chunks; None: whole prompts, no chunking);
    speculative: None, "ngram" (prompt lookup) or "draft" (the model at `draft_checkpoint`), proposing up to
    `num_draft_tokens` tokens a step; compile: the runner's step through torch.compile (`Runner`, compiled at
    start)."""

    block_size: int = 16
    num_blocks: int | None = None
    prefix_caching: bool = True
    max_batched_tokens: int | None = 512
    speculative: str | None = None
    draft_checkpoint: str | None = None
    num_draft_tokens: int = 4
    compile: bool = False

    def blocks_for(self, max_seqs: int, max_len: int) -> int:
        return self.num_blocks or max_seqs * -(-max_len // self.block_size)

    def local_blocks_for(self, max_seqs: int, max_len: int, window: int) -> int:
        """The local layers' pool, when they have their own (`core/kv_cache.kv_groups`): `max_seqs` sequences each
        holding at most the blocks of its longest step (a prefill chunk, or a token and its drafts) and the
        window before it; never more than the main pool."""
        chunk = max(self.max_batched_tokens or max_len, 1 + self.num_draft_tokens if self.speculative else 1)
        per_seq = min(-(-max_len // self.block_size), -(-(min(chunk, max_len) + window - 1) // self.block_size) + 1)
        return min(self.blocks_for(max_seqs, max_len), max_seqs * per_seq)


# ---- the engine ---------------------------------------------------------------------------------------------
class Engine:
    """Continuous batching of generation requests over one model (see the module docstring).

    Use it synchronously (`generate`, or `submit` + `step`) or start its thread (`start`), as the server does.
    """

    def __init__(self, model, tokenizer, max_seqs: int = 32, max_len: int | None = None, max_queue: int = 256,
                 runner: Runner | None = None, adapters=None, options: CacheOptions | None = None, speculator=None):
        self.model, self.tokenizer, self.adapters = model, tokenizer, adapters
        cfg = model.cfg
        self.max_len = max_len or cfg.seq_len
        if cfg.position == "learned" and self.max_len > cfg.seq_len:
            raise InvalidRequest(f"max_len {self.max_len} is more than the model's learned positions "
                                 f"(model.seq_len={cfg.seq_len})", "max_len")
        o = self.options = options or CacheOptions()
        if o.max_batched_tokens is not None and o.max_batched_tokens < 1:
            raise InvalidRequest(f"max_batched_tokens must be >= 1 or None (got {o.max_batched_tokens})",
                                 "max_batched_tokens")
        self.max_seqs, self.max_queue, self.max_batched_tokens = max_seqs, max_queue, o.max_batched_tokens
        window, local_window = kv_groups(cfg)  # one group for every layer, or a second one for the local layers
        if runner is None:
            local = o.local_blocks_for(max_seqs, self.max_len, local_window) if local_window else 0
            runner = Runner(model, o.blocks_for(max_seqs, self.max_len), o.block_size, cfg.vocab_size,
                            adapters=adapters, compile=o.compile, local_blocks=local)
        self.runner, self.block_size = runner, runner.block_size
        self.pool = BlockPool(runner.num_blocks, runner.block_size, o.prefix_caching)
        local_blocks = getattr(runner, "local_blocks", 0)  # a given runner says (tp's and pp's hold it too)
        self.local_pool = BlockPool(local_blocks, runner.block_size, o.prefix_caching) if local_blocks else None
        self.speculator = speculator
        self.eod_id = getattr(tokenizer, "eod_id", None)
        # every end-of-sequence id the model declares ends a request (`data.tokenizers`: stop_ids), unless ignore_eos
        self.stop_ids = frozenset(getattr(tokenizer, "stop_ids", None) or
                                  (() if self.eod_id is None else (self.eod_id,)))
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.waiting: deque[Request] = deque()  # the queue: `submit_group` appends under `lock`, admission reads
        self.next_id = 0
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.dead: str | None = None  # the error that stopped the loop
        self.print_errors = True  # a failed request's traceback on stderr (the server's log; not in-process use)
        # called on the loop's thread after each step and after the loop failed its requests: the requests'
        # `on_update`s of a step were all called before it (`infer/engine_process.py` sends them together)
        self.on_step: Callable[[], None] | None = None
        # mixed_steps: steps whose rows used more than one model (the base, adapters); split_steps: steps of
        # several requests whose forward failed and ran again request by request (`_run`)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0, "steps": 0,
                      "mixed_steps": 0, "requests_failed": 0, "preemptions": 0, "prefix_queried_tokens": 0,
                      "prefix_hit_tokens": 0, "window_freed_blocks": 0,
                      "batched_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0, "split_steps": 0}
        self.ttft = Histogram()  # seconds from arrival to the first token, of finished requests
        self.tpot = Histogram()  # seconds per output token after the first
        # blocks out of a window go back to their pool as a sequence grows (infer/scheduler.py)
        local = KVGroup(self.local_pool, local_window, "local_blocks", "local_freed") if local_blocks else None
        self.scheduler = Scheduler(self.pool, max_seqs, o.max_batched_tokens, self.lock, self.stats,
                                   self._released, self.waiting, window=window, local=local)

    @property
    def active(self) -> list[Request]:
        """The running requests, in the order they were admitted (the scheduler's batch)."""
        return self.scheduler.active

    def _released(self, req: Request) -> None:
        """`req` gave its blocks back (finished or preempted): its draft model row goes too."""
        if self.speculator is not None:
            self.speculator.release(req)

    # ---- requests ----
    def virtual_tokens(self, adapter: int) -> int:
        """Positions adapter `adapter` puts before every prompt (a prompt adapter's virtual tokens)."""
        n = len(self.adapters.served) if self.adapters is not None else 0
        if not 0 <= adapter <= n:
            raise InvalidRequest(f"adapter index {adapter} is not one of this engine's (0..{n})", "model")
        return self.adapters.virtual_tokens(adapter) if adapter else 0

    def head(self, adapter: int) -> list[int]:
        """The ids adapter `adapter`'s row holds before the prompt, as a tuning row starts (`tune/data.py`) and
        as `meshlm generate --adapter` lays it out: a prompt adapter's virtual-token placeholders (their
        embeddings are replaced); nothing for a LoRA adapter or the base. Not prompt tokens: they count
        against the context only."""
        return [0] * self.virtual_tokens(adapter)

    @property
    def limits(self) -> Limits:
        """What a request is checked against before it is queued (`Limits`)."""
        return Limits(self.max_len, self.model.cfg.vocab_size, self.pool.num_blocks, self.block_size,
                      self.scheduler.groups[0].window, self.max_batched_tokens, self.max_queue)

    def check(self, prompt_ids: list[int], params: SamplingParams, adapter: int = 0) -> None:
        """InvalidRequest for a request the engine cannot run."""
        self.limits.check(prompt_ids, params, len(self.head(adapter)))

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_update: Callable[[Request], None] | None = None, adapter: int = 0) -> Request:
        return self.submit_group([(prompt_ids, params)], on_update, adapter)[0]

    def submit_group(self, items: list[tuple[list[int], SamplingParams]],
                     on_update: Callable[[Request], None] | None = None, adapter: int = 0,
                     client: str | None = None, tags: list | None = None) -> list[Request]:
        """Queue the requests `items` ([(prompt ids, params)], one HTTP request's prompts and choices) together
        or none of them: InvalidRequest (param "prompt") when there are more than `Limits.client_share`, which
        no wait would change; QueueFull (retry later) when the queue, or the client's share of it, has too
        little room now; InvalidRequest from `check` for a bad one. `tags`: each request's `tag` (its caller's
        own name for it, set before any other thread can see it)."""
        limits, head = self.limits, len(self.head(adapter))
        limits.check_group(len(items), client)
        for ids, sp in items:
            limits.check(ids, sp, head)
        reqs = [self._request(ids, sp, on_update, adapter, client) for ids, sp in items]
        for req, tag in zip(reqs, tags or ()):
            req.tag = tag
        with self.lock:
            if self.dead is not None:
                raise EngineDead(self.dead)
            if self.stopping:
                raise QueueFull("the server is shutting down")
            limits.check_room([r.client for r in self.waiting], len(reqs), client)
            for req in reqs:
                req.id = self.next_id
                self.next_id += 1
                self.waiting.append(req)
            self.wake.notify()
        return reqs

    def _request(self, prompt_ids: list[int], params: SamplingParams, on_update, adapter: int,
                 client: str | None) -> Request:
        """A new request (not queued): its generator seeded, its stop-string state begun."""
        req = Request(list(prompt_ids), params, on_update, adapter=adapter, head=self.head(adapter), client=client)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        elif not params.greedy:
            req.generator = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 62, ()).item()))
        req.seen = set(prompt_ids)
        sampling.begin(req, self.tokenizer)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (a client that went away); its row is freed before the next step."""
        req.cancelled = True
        with self.lock:
            self.wake.notify()

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def running(self) -> int:
        return len(self.active)

    # ---- acceptance: sampled tokens, stop rules, finishing, failing ----
    def _finish(self, req: Request, reason: str) -> None:
        req.emitted = len(req.text)  # before the reason: a reader that sees it finished sees all its text
        req.finished_at = time.monotonic()
        req.finish_reason = reason
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.arrival)
            if len(req.output_ids) > 1:
                self.tpot.observe((req.finished_at - req.first_token_at) / (len(req.output_ids) - 1))
        self.stats["requests_finished"] += 1

    def _notify(self, req: Request) -> None:
        if req.finished:
            req.done_event.set()
        if req.on_update is not None:
            req.on_update(req)

    def _token_info(self, logprobs: torch.Tensor | None, token: int, n: int | None) -> TokenInfo:
        info = TokenInfo(token, self.tokenizer.decode([token]) if n is not None else "")  # text: for logprobs
        if logprobs is not None and n is not None:
            info.logprob = float(logprobs[token])
            if n > 0:
                values, ids = torch.topk(logprobs, n)
                info.top = list(zip(ids.tolist(), values.tolist()))
        return info

    def _accept(self, req: Request, logits: torch.Tensor, argmax: int | None = None, token: int | None = None) -> None:
        """Sample the next token of `req` from its (V,) logits (`argmax`: the greedy choice, when known), or take
        `token` (verified by speculative decoding); update its text and finish reason."""
        p = req.params
        if p.max_tokens == 0:
            self._finish(req, "length")
            return
        if token is None:
            plain = p.greedy and not p.shapes_logits  # the step's argmax is the greedy choice
            token = argmax if plain and argmax is not None else sample_token(logits, req)
        logprobs = F.log_softmax(logits, -1) if p.logprobs is not None else None
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        req.output.append(self._token_info(logprobs, token, p.logprobs))
        req.counts[token] = req.counts.get(token, 0) + 1
        req.seen.add(token)
        sampling.observe(req, token)
        self.stats["generation_tokens"] += 1
        if (token in self.stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
            req.text = self.tokenizer.decode(req.output_ids[:-1])
            self._finish(req, "stop")
            return
        req.text = self.tokenizer.decode(req.output_ids)
        for s in p.stop:
            at = req.text.find(s)
            if at >= 0:
                req.text = req.text[:at]
                self._finish(req, "stop")
                return
        if len(req.output_ids) >= p.max_tokens or req.length >= self.max_len:
            self._finish(req, "length")
            return
        hold = max((len(s) - 1 for s in p.stop), default=0)  # a stop string may still complete
        safe = len(req.text) - hold
        while safe > 0 and req.text[safe - 1] == "\ufffd":  # an incomplete UTF-8 character: wait for its bytes
            safe -= 1
        req.emitted = max(req.emitted, safe)

    def _fail(self, reqs: list[Request], err: BaseException) -> None:
        """Fail `reqs` (not the engine): each answers with `err`; their rows are freed before the next step."""
        if self.print_errors:
            traceback.print_exception(err)  # the server's log
        for req in reqs:
            if not req.finished:
                req.error = f"{type(err).__name__}: {err}"
                req.emitted = len(req.text)
                req.finished_at = time.monotonic()
                req.finish_reason = "error"
                self.stats["requests_failed"] += 1
                with contextlib.suppress(Exception):  # a callback that fails too: the request is finished anyway
                    self._notify(req)

    def _isolated(self, reqs: list[Request], call, *args):
        """`call(*args)` (work on requests after a forward, no model call); an exception fails `reqs` (the
        requests it was for) and returns None, so that one request never stops the engine for the others."""
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 -- answered to the requests concerned
            self._fail(reqs, err)
            return None

    # ---- one step: schedule, (speculate,) run, accept ----
    def _release_finished(self) -> None:
        """Finish cancelled requests and give finished ones' blocks back."""
        for req in self.active:
            if req.cancelled and not req.finished:
                self._finish(req, "abort")
                self._notify(req)
        self.scheduler.retire()

    def step(self) -> bool:
        """Schedule (running requests first, then waiting ones, within the token budget and the pool's
        blocks), run one forward over all their tokens, then take the next token of every request whose tokens
        are all computed. Returns whether anything was done."""
        self._release_finished()
        scheduled = self.scheduler.schedule()
        for req in scheduled.aborted:  # cancelled while waiting
            self._finish(req, "abort")
            self._notify(req)
        if not scheduled.work:
            return False
        self._speculate(scheduled.work, scheduled.budget)
        self._run(self.scheduler.plan(scheduled.work))
        self._release_finished()
        return True

    def _run(self, plan: StepPlan) -> None:
        """The runner's forward of `plan`. When it fails and holds several requests, each is run again alone, so
        that an error caused by one request fails that request only (a step's writes to the cache are
        idempotent); under tensor parallelism a failure is fatal (the other ranks would be out of step)."""
        try:
            logits = self.runner.forward(plan.forward)
        except Exception as err:
            if isinstance(self.runner, DistributedRunner):
                raise
            if len(plan.seqs) == 1:
                self._fail([plan.seqs[0].request], err)
                return
            self.stats["split_steps"] += 1
            if self.stats["split_steps"] == 1 and self.print_errors:  # a step that works only request by request
                print("meshlm engine: a step of several requests failed and runs again one request at a time "
                      "(slow; counted in meshlm_split_steps_total); the first such error:", file=sys.stderr)
                traceback.print_exception(err)
            for seq in plan.seqs:
                self._run(self.scheduler.plan([(seq.request, seq.tokens)]))
            return
        self.stats["steps"] += 1
        self.stats["batched_tokens"] += plan.n_tokens
        self.stats["mixed_steps"] += len({s.request.adapter for s in plan.seqs}) > 1
        self._after(plan, logits)

    def _after(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """Advance each request of the step by its computed tokens and take its next token(s) from `logits`."""
        # every selected row's greedy choice at once: `max`'s indices are argmax's (the first of equal maxima,
        # NaN the largest) and 2.5-4.8x faster on a CPU (64 rows of SmolLM2's 49,152 logits: 5.6 against 1.2 ms
        # in bf16, 2.2 against 0.9 in fp32)
        argmax = logits.max(-1).indices.tolist()
        row = 0
        for seq in plan.seqs:
            req, k = seq.request, seq.logits
            mine, greedy = logits[row:row + k], argmax[row:row + k]
            row += k
            if not req.finished:
                self._isolated([req], self._advance, req, seq.tokens, mine, greedy)
                self._notify(req)
            req.drafts, req.draft_probs = [], None

    def _advance(self, req: Request, n: int, logits: torch.Tensor, argmax: list[int]) -> None:
        start = req.computed
        req.computed += n
        if req.params.echo and not req.prompt_done:
            self._prompt_logprobs(req, start, logits if req.params.logprobs is not None else None)
            req.prompt_done = req.computed == req.length
        if req.drafts:
            self._verify(req, logits, argmax)
        elif req.computed == req.length:
            if req.first_token_at is None:
                self.stats["prompt_tokens"] += len(req.prompt_ids)
            self._accept(req, logits[-1], argmax[-1])
        self.scheduler.register(req)

    def _prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor | None) -> None:
        """Echo: the prompt's tokens (with logprobs, their log-probabilities) from the logits of positions
        start.. of this step (position p's predict the token at p + 1; the prompt's first token has none)."""
        h, ids = len(req.head), req.prompt_ids
        if not req.prompt_tokens:
            req.prompt_tokens = [TokenInfo(ids[0], self.tokenizer.decode(ids[:1]))]
        end = start + (logits.shape[0] if logits is not None else req.length - start)
        lp = F.log_softmax(logits, -1) if logits is not None else None
        for p in range(max(start, h + len(req.prompt_tokens) - 1), min(end, h + len(ids) - 1)):
            i = p - h + 1  # the prompt token predicted at position p
            req.prompt_tokens.append(self._token_info(lp[p - start] if lp is not None else None, ids[i],
                                                      req.params.logprobs))

    # ---- speculative decoding ----
    def _speculable(self, req: Request) -> bool:
        """Whether `req` may take drafts: a base-model request decoding, nothing reshaping its logits (its
        target distribution at each draft position is then the model's own)."""
        return (not req.adapter and req.computed == req.length - 1 and not req.params.shapes_logits
                and req.first_token_at is not None)

    def _speculate(self, work: list[tuple[Request, int]], budget: float) -> None:
        """Drafts for this step's decoding rows (`req.drafts`), within the budget left and the free blocks: a
        row that finds no block decodes plainly (no request is preempted for a guess)."""
        if self.speculator is None or budget < 1:
            return
        rows = [req for req, n in work if n == 1 and self._speculable(req)]
        if not rows:
            return
        k = int(min(self.options.num_draft_tokens, budget // len(rows)))
        if k < 1:
            return
        for req, (tokens, probs) in zip(rows, self.speculator.propose(rows, k)):
            room = min(self.max_len - req.length, req.params.max_tokens - len(req.output_ids) - 1)
            tokens = tokens[:max(room, 0)]
            if tokens and self.scheduler.reserve(req, req.length + len(tokens)):
                req.drafts = tokens
                req.draft_probs = probs[:len(tokens)] if probs is not None else None
                self.stats["draft_tokens"] += len(tokens)

    def _verify(self, req: Request, logits: torch.Tensor, argmax: list[int]) -> None:
        """Accept `req`'s drafts by the target's (k + 1, V) logits: greedy by the argmax, sampled by rejection
        sampling (`infer/speculative.py`); then each kept token as if sampled alone."""
        drafts, p = req.drafts, req.params
        if p.greedy:
            m = next((i for i, t in enumerate(drafts) if argmax[i] != t), len(drafts))
            tokens = drafts[:m] + [argmax[m]]
        else:
            tokens = verify(target_probs(logits, p), drafts, req.draft_probs, req.generator)
        self.stats["accepted_tokens"] += len(tokens) - 1
        req.computed = req.length + len(tokens) - 1  # the fed token and the accepted drafts are cached
        for i, token in enumerate(tokens):
            self._accept(req, logits[i], argmax[i], token=token)
            if req.finished:
                break
        self.speculator.rollback(req, req.length - 1)


    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 adapters: list[int] | None = None) -> list[Request]:
        """Run `prompts` to completion synchronously (the engine's thread must not be running); prompt i
        with adapter index `adapters[i]` (default: the base)."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        adapters = adapters or [0] * len(prompts)
        reqs = [self.submit(p, sp, adapter=a) for p, sp, a in zip(prompts, params, adapters)]
        while not all(r.finished for r in reqs):
            self.step()
        return reqs

    # ---- the loop thread ----
    def start(self) -> None:
        """Run the loop on a thread of its own. The calling thread (which loaded and compiled the model) first
        hands back its OpenMP workers, so that the loop's are the process's only pool (`infer/openmp.py`)."""
        openmp.release_pool()
        self.thread = threading.Thread(target=self._loop, name="meshlm-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.thread is not None and self.thread.is_alive()

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    if not self.waiting and not self.active and not self.stopping:
                        self.wake.wait(timeout=1.0)
                    idle = not self.waiting and not self.active
                    if self.stopping and idle:
                        break
                if idle:
                    self.runner.idle()
                    continue
                self.step()
                if self.on_step is not None:
                    self.on_step()
        except BaseException as err:  # noqa: BLE001 -- the loop is dead: fail every request so no client waits forever
            with self.lock:  # no request joins the queue unseen from here on
                self.dead = f"{type(err).__name__}: {err}"
                stranded = list(self.active) + list(self.waiting)
            for req in stranded:
                if not req.finished:
                    req.error = self.dead
                    req.finish_reason = "error"
                    self._notify(req)
            traceback.print_exc()  # the server's log; /health now fails
            if self.on_step is not None:
                with contextlib.suppress(Exception):  # what it sends may fail too: the loop has ended anyway
                    self.on_step()
        finally:
            if isinstance(self.runner, DistributedRunner):
                try:
                    self.runner.shutdown()  # release the other ranks' loops
                except Exception:  # noqa: BLE001 -- they may be gone already (the error above)
                    traceback.print_exc()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new requests; finish the waiting and active ones; end the loop (drain)."""
        with self.lock:
            self.stopping = True
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout)


def wait_for(req: Request, timeout: float | None = None) -> Request:
    req.done_event.wait(timeout)
    return req


# ---- encoders: batched embeddings ----------------------------------------------------------------------------
class EmbeddingEngine:
    """Embeddings from a BERT checkpoint: [CLS] text [SEP], the checkpoint's pooling (`infer/embed.py`)."""

    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.lock = threading.Lock()

    def embed(self, texts: list[str] | list[list[int]]) -> tuple[list[list[float]], int]:
        """(one vector per input, the number of tokens read); InvalidRequest for a text over model.seq_len."""
        from meshlm.infer.embed import embed_ids

        cfg = self.model.cfg
        special = self.tokenizer.special_ids
        ids = []
        for i, text in enumerate(texts):
            body = text if isinstance(text, list) else self.tokenizer.encode(text)
            if any(not 0 <= t < cfg.vocab_size for t in body):
                raise InvalidRequest(f"input {i}: token ids must be in 0..{cfg.vocab_size - 1}", "input")
            if len(body) + 2 > cfg.seq_len:
                raise InvalidRequest(f"input {i} is {len(body) + 2} tokens with [CLS] and [SEP], more than the "
                                     f"model's context of {cfg.seq_len} tokens", "input")
            ids.append([special["cls"], *body, special["sep"]])
        with self.lock:
            vectors = embed_ids(self.model, ids, special["pad"], self.batch_size, cfg.pooling,
                                cfg.normalize_embeddings)
        return vectors.tolist(), sum(len(i) for i in ids)
