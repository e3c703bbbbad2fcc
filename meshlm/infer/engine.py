"""The inference engine: continuous batching over a bounded, pre-allocated KV cache.

Design (docs/serving.md):
- The cache holds `max_seqs` rows of `max_len` positions per layer, allocated once (its size is
  `cache_bytes()`); a request occupies one row from its prefill to its last token. Active requests are kept
  in rows 0..n-1 (a finished request's row is refilled by moving the last one into it), so a decode step runs
  on one contiguous slice of the cache.
- Requests wait in a bounded queue (`max_queue`; beyond it `submit` raises `QueueFull`). Between decode
  steps, waiting requests join while rows are free (prefill: the prompt's keys/values written into the
  request's row), and finished ones leave: continuous batching.
- One decode step feeds every active row its last token at its own position (per-row positions: the
  attention mask hides each row's unused cache tail), so rows of different lengths share a step.
- Sampling is per request: temperature, top-k, top-p, a seeded generator per request, repetition /
  presence / frequency penalties, stop strings and token ids, `max_tokens`. Log-probabilities are the
  model's (log-softmax of the logits before any penalty or temperature): of the chosen token and the top N,
  and with `echo` of every prompt token after the first.
- An exception while running a request (its prefill, sampling, text; a decode step for the rows of that
  step) fails those requests alone (finish_reason "error", `error` said) and the engine goes on; only an
  error outside any request (or a failed model call under tensor parallelism) stops the loop (`dead`).
- The model runs behind a `Runner` (prefill / decode / move); under tensor parallelism rank 0's runner
  broadcasts each operation to the other ranks first (`DistributedRunner`), which replay it in `worker_loop`.
- Adapters (`infer/adapters.py`): a request may name one of the engine's adapters (index 1..K; 0 is the
  base). Rows of different adapters share a decode step: LoRA runs unmerged on each row's own matrices,
  and a prompt adapter's virtual tokens are placed before the prompt at prefill (n more positions of the
  row, not counted as prompt tokens). A request's row starts as a tuning row does (`tune/data.py`) and as
  `meshlm generate --adapter` lays it out: a prompt adapter's virtual tokens, then the prompt; a LoRA
  adapter's row, like the base's, is its prompt alone (as PEFT runs an exported adapter).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshlm.infer import sampling
from meshlm.infer.sampling import (  # noqa: F401 -- re-exported: the engine's API
    MAX_TOP_LOGPROBS,
    InvalidRequest,
    SamplingParams,
    TokenInfo,
    apply_penalties,
    sample_token,
)
from meshlm.models.layers import KVCache


class QueueFull(RuntimeError):
    """The engine's waiting queue is full: retry later."""


class EngineDead(RuntimeError):
    """The engine loop stopped (an error in the model, or a shutdown)."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request], None] | None = None  # called from the engine thread after each change
    id: int = 0
    adapter: int = 0  # the engine's adapter index (0: the base)
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def length(self) -> int:
        """Positions of its cache row in use: the head (a prompt adapter's virtual tokens), prompt, output."""
        return len(self.head) + len(self.prompt_ids) + len(self.output_ids)


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


# ---- running the model --------------------------------------------------------------------------------------
class _Rows:
    """A KVCache-like view of cache rows (`KVCache.update` on views of the engine's buffers)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    update = KVCache.update


class Runner:
    """The model and its cache: `prefill(row, ids)`, `decode(tokens, positions)`, `move(src, dst)`; with
    `adapters` (an `AdapterSet`), each row's adapter index too."""

    def __init__(self, model, max_seqs: int, max_len: int, vocab_size: int, tp_group=None, adapters=None):
        self.model, self.adapters = model, adapters
        self.max_seqs, self.max_len, self.vocab_size, self.tp_group = max_seqs, max_len, vocab_size, tp_group
        p = next(model.parameters())
        self.device = p.device
        self.buffers = []
        for layer in model.layers:
            shape = (max_seqs, layer.attn.n_kv_heads, max_len, layer.attn.head_dim)
            self.buffers.append((torch.zeros(shape, dtype=p.dtype, device=p.device),
                                 torch.zeros(shape, dtype=p.dtype, device=p.device)))

    def cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.buffers)

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary fp32 logits (gathered over tp when the head is vocab-parallel)."""
        if self.tp_group is not None:
            import torch.distributed as dist

            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size].float()

    def _with(self, indices: list[int] | None, prefill: bool = False):
        if self.adapters is None or indices is None:
            return contextlib.nullcontext()
        return self.adapters.batch(indices, prefill)

    @torch.no_grad()
    def prefill(self, row: int, ids: list[int], adapter: int = 0) -> torch.Tensor:
        """Fill cache row `row` with the prompt (with adapter `adapter`: its virtual tokens at the first
        positions, whose ids are placeholders); (T, V) logits."""
        caches = [_Rows(k[row:row + 1], v[row:row + 1]) for k, v in self.buffers]
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        with self._with([adapter], prefill=True):
            return self._logits(self.model(x, caches=caches, start=0))[0]

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], adapters: list[int] | None = None) -> torch.Tensor:
        """Rows 0..n-1 take one token each at their own position (row i with adapter `adapters[i]`);
        (n, V) logits."""
        n = len(tokens)
        caches = [_Rows(k[:n], v[:n]) for k, v in self.buffers]
        x = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
        if min(positions) == max(positions):  # one position for all (one row, or prompts of one length):
            start = positions[0]  # the plain cache path, without a mask
        else:
            start = torch.tensor(positions, dtype=torch.long, device=self.device)
        with self._with(adapters):
            return self._logits(self.model(x, caches=caches, start=start))[:, -1]

    def idle(self) -> None:
        """Called about once a second while there is nothing to do."""

    def move(self, src: int, dst: int, length: int) -> None:
        for k, v in self.buffers:
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]


class DistributedRunner(Runner):
    """Rank 0's runner under tensor parallelism: each operation is broadcast to the other ranks first (and
    a ping every few idle seconds, so that their wait for the next operation never reaches the timeout)."""

    PING_S = 5.0
    last_sent = 0.0

    def _send(self, op: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([op], src=0)
        self.last_sent = time.monotonic()

    def idle(self):
        if time.monotonic() - self.last_sent > self.PING_S:
            self._send(("idle",))

    def prefill(self, row, ids, adapter=0):  # no adapters under tensor parallelism (the server refuses them)
        self._send(("prefill", row, ids))
        return super().prefill(row, ids)

    def decode(self, tokens, positions, adapters=None):
        self._send(("decode", tokens, positions))
        return super().decode(tokens, positions)

    def move(self, src, dst, length):
        self._send(("move", src, dst, length))
        super().move(src, dst, length)

    def shutdown(self) -> None:
        self._send(("stop",))


def worker_loop(runner: Runner) -> None:
    """Ranks other than 0: replay rank 0's operations until it says stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op = box[0]
        if op[0] == "stop":
            return
        getattr(Runner, op[0])(runner, *op[1:])


# ---- the engine ---------------------------------------------------------------------------------------------
class Engine:
    """Continuous batching of generation requests over one model (see the module docstring).

    Use it synchronously (`generate`, or `submit` + `step`) or start its thread (`start`), as the server does.
    """

    def __init__(self, model, tokenizer, max_seqs: int = 32, max_len: int | None = None, max_queue: int = 256,
                 runner: Runner | None = None, adapters=None):
        self.model, self.tokenizer, self.adapters = model, tokenizer, adapters
        cfg = model.cfg
        self.max_len = max_len or cfg.seq_len
        if cfg.position == "learned" and self.max_len > cfg.seq_len:
            raise InvalidRequest(f"max_len {self.max_len} is more than the model's learned positions "
                                 f"(model.seq_len={cfg.seq_len})", "max_len")
        self.max_seqs, self.max_queue = max_seqs, max_queue
        self.runner = runner or Runner(model, max_seqs, self.max_len, cfg.vocab_size, adapters=adapters)
        self.eod_id = getattr(tokenizer, "eod_id", None)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []  # row i holds active[i]
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.next_id = 0
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.dead: str | None = None  # the error that stopped the loop
        # mixed_steps: decode steps whose rows used more than one model (the base, adapters)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0, "steps": 0,
                      "mixed_steps": 0, "requests_failed": 0}
        self.ttft = Histogram()  # seconds from arrival to the first token, of finished requests
        self.tpot = Histogram()  # seconds per output token after the first

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

    def check(self, prompt_ids: list[int], params: SamplingParams, adapter: int = 0) -> None:
        """InvalidRequest for a request the engine cannot run."""
        params.validate()
        head = len(self.head(adapter))
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < self.model.cfg.vocab_size for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in 0..{self.model.cfg.vocab_size - 1}", "prompt")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad_stop:
            raise InvalidRequest(f"stop_token_ids must be token ids in 0..{self.model.cfg.vocab_size - 1} (got "
                                 f"{bad_stop[0]})", "stop_token_ids")
        room = self.max_len - head  # positions left after the adapter's virtual tokens
        context = f"{self.max_len} tokens" + (f" ({head} of them the adapter's virtual tokens)" if head else "")
        if len(prompt_ids) > room:
            raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens, more than the model's context of "
                                 f"{context}", "prompt")
        if len(prompt_ids) + params.max_tokens > room:
            raise InvalidRequest(f"max_tokens {params.max_tokens} with the prompt's {len(prompt_ids)} tokens is "
                                 f"more than the model's context of {context}; at most "
                                 f"{room - len(prompt_ids)}", "max_tokens")

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_update: Callable[[Request], None] | None = None, adapter: int = 0) -> Request:
        self.check(prompt_ids, params, adapter)
        req = Request(list(prompt_ids), params, on_update, adapter=adapter, head=self.head(adapter))
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        elif not params.greedy:
            req.generator = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 62, ()).item()))
        req.seen = set(prompt_ids)
        sampling.begin(req, self.tokenizer)
        with self.lock:
            if self.dead is not None:
                raise EngineDead(self.dead)
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (the most the queue holds)")
            req.id = self.next_id
            self.next_id += 1
            self.waiting.append(req)
            self.wake.notify()
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

    # ---- one step ----
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

    def _accept(self, req: Request, logits: torch.Tensor, argmax: int | None = None) -> None:
        """Sample the next token of `req` from its (V,) logits (`argmax`: the greedy choice, when known);
        update its text and finish reason."""
        p = req.params
        if p.max_tokens == 0:
            self._finish(req, "length")
            return
        plain = p.greedy and p.repetition_penalty == 1 and not p.presence_penalty and not p.frequency_penalty
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
        if (token == self.eod_id and not p.ignore_eos) or token in p.stop_token_ids:
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
        """`call(*args)`; an exception fails `reqs` (the requests it was for) and returns None, so that one
        request never stops the engine for the others. Under tensor parallelism a failed model call is fatal
        (the other ranks replay each call: they would be out of step)."""
        try:
            return call(*args)
        except Exception as err:  # answered to the requests concerned
            if isinstance(self.runner, DistributedRunner) and call in (self.runner.prefill, self.runner.decode):
                raise
            self._fail(reqs, err)
            return None

    def _admit(self, req: Request) -> None:
        row = len(self.active)
        self.active.append(req)  # a failed request is finished: the next release frees its row
        if req.adapter:  # the head first (virtual tokens' placeholders); no logits of it
            logits = self._isolated([req], self.runner.prefill, row, req.head + req.prompt_ids, req.adapter)
            logits = logits[len(req.head):] if logits is not None else None
        else:
            logits = self._isolated([req], self.runner.prefill, row, req.prompt_ids)
        if logits is None:
            return
        self.stats["prompt_tokens"] += len(req.prompt_ids)
        self._isolated([req], self._first_token, req, logits)

    def _first_token(self, req: Request, logits: torch.Tensor) -> None:
        """The prompt's log-probabilities (echo) and the first token of `req` from its prefill's logits."""
        if req.params.echo:
            lp = F.log_softmax(logits[:-1], -1) if req.params.logprobs is not None else None
            req.prompt_tokens = [TokenInfo(req.prompt_ids[0], self.tokenizer.decode(req.prompt_ids[:1]))]
            for i, t in enumerate(req.prompt_ids[1:]):
                req.prompt_tokens.append(self._token_info(lp[i] if lp is not None else None, t,
                                                          req.params.logprobs))
        self._accept(req, logits[-1])
        self._notify(req)

    def _next_token(self, req: Request, logits: torch.Tensor, argmax: int) -> None:
        self._accept(req, logits, argmax)
        self._notify(req)

    def _release_finished(self) -> None:
        """Free the rows of finished or cancelled requests, keeping the active ones in rows 0..n-1."""
        i = 0
        while i < len(self.active):
            req = self.active[i]
            if req.cancelled and not req.finished:
                self._finish(req, "abort")
                self._notify(req)
            if req.finished:
                last = len(self.active) - 1
                if i != last:
                    moved = self.active[last]
                    self.runner.move(last, i, moved.length)
                    self.active[i] = moved
                self.active.pop()
            else:
                i += 1

    def step(self) -> bool:
        """Admit waiting requests into free rows, then one decode step for every active row. Returns
        whether anything was done."""
        self._release_finished()
        did = False
        while len(self.active) < self.max_seqs:
            with self.lock:
                if not self.waiting:
                    break
                req = self.waiting.popleft()
            if req.cancelled:
                self._finish(req, "abort")
                self._notify(req)
                continue
            self._admit(req)
            did = True
        self._release_finished()
        if self.active:
            tokens = [r.output_ids[-1] for r in self.active]
            positions = [r.length - 1 for r in self.active]
            used = [r.adapter for r in self.active]
            args = (tokens, positions, used) if any(used) else (tokens, positions)
            logits = self._isolated(list(self.active), self.runner.decode, *args)  # fails: every row of the step
            if logits is not None:
                self.stats["mixed_steps"] += len(set(used)) > 1
                argmax = logits.argmax(-1).tolist()  # every row's greedy choice at once
                for i, req in enumerate(self.active):
                    self._isolated([req], self._next_token, req, logits[i], argmax[i])
                self.stats["steps"] += 1
            did = True
        self._release_finished()
        return did

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
