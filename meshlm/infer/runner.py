"""The engine's runner: the model and its paged KV cache, executing one step's `ForwardPlan` at a time.

`Runner.forward(plan)` embeds the step's N tokens as N rows of one token (per-token positions), runs every layer
over them with one paged cache view per layer (`models/paged.py`: keys and values written into the plan's block
slots, attention read through the block tables) and returns the fp32 logits of the tokens the plan selects.
Under tensor parallelism rank 0's runner broadcasts each plan to the other ranks first (`DistributedRunner`),
which replay it in `worker_loop`. With `compile=True` the step's dense part (embedding, every layer's projections,
norms and MLP, the head) runs through `torch.compile` with dynamic token counts, so one graph serves every step
of two or more tokens (and one the single-token steps); attention (`PagedCache.update_and_attend`, whose
per-step layout differs every step) stays eager between the compiled pieces. Both are compiled at start
(`compile_s`). Which tokens run, and in which blocks, is the scheduler's business
(`infer/scheduler.py`); what becomes of the logits the engine's (`infer/engine.py`).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from meshlm.core.kv_cache import kv_groups
from meshlm.infer.scheduler import ForwardPlan
from meshlm.models.paged import Batch, PagedKV

log = logging.getLogger(__name__)


class Runner:
    """The model and its paged KV cache (`models/paged.py`): `forward(plan)` runs one step's tokens and returns the
    fp32 logits of the tokens it selects; with `adapters` (an `AdapterSet`) each token's adapter too. 
    `compile`: the step's dense part through torch.compile (module docstring; one process, no adapters: they swap
    weights per step); `compile_s`: the seconds its warm-up took (0.0: eager)."""

    def __init__(self, model, num_blocks: int, block_size: int, vocab_size: int, tp_group=None, adapters=None,
                 compile: bool = False, local_blocks: int = 0):
        self.model, self.adapters = model, adapters
        self.num_blocks, self.block_size, self.vocab_size, self.tp_group = num_blocks, block_size, vocab_size, tp_group
        self.local_blocks = local_blocks  # > 0: the local (sliding-window) layers' own pool (models/paged.py)
        # the windows of the layouts' readers: every layer local (W, 0), or the local layers' own tables (0, W)
        self.windows = kv_groups(model.cfg) if hasattr(model, "cfg") else (0, 0)
        self.device = next(model.parameters()).device
        self.kv = PagedKV(model, num_blocks, block_size, local_blocks)
        self.step_fn = self._dense
        self.compile_s = 0.0
        if compile and adapters is None and tp_group is None:
            self.step_fn = torch.compile(self._dense, dynamic=True)
            self.compile_s = self.warm()
            log.info("compiled the serving step in %.1f s", self.compile_s)

    def cache_bytes(self) -> int:
        return self.kv.nbytes()

    def cache_bytes_per_token(self) -> int:
        """Bytes one position of every layer of this process takes in the pool (`core/kv_cache.py`'s formula: MLA
        layers hold their latent and RoPE key, the others a key and a value per KV head)."""
        return self.kv.bytes_per_token()

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Whole-vocabulary fp32 logits (gathered over tp when the head is vocab-parallel)."""
        if self.tp_group is not None:
            import torch.distributed as dist

            parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
            logits = torch.cat(parts, dim=-1)
        return logits[..., :self.vocab_size].float()

    def _with(self, plan: ForwardPlan):
        if self.adapters is None or plan.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.batch(plan.adapters, plan.virtual)

    def _dense(self, ids: torch.Tensor, start: torch.Tensor, caches: list, rope, select: torch.Tensor) -> torch.Tensor:
        """The model over the step's tokens ids (N, 1) at positions `start` (N,) → the head's output for the
        `select`ed tokens (S, V'): what `compile` hands to torch.compile."""
        m = self.model
        x = m.run_layers(m.embed(ids, start), None, caches, start, rope)
        return m.head(x.index_select(0, select))[:, 0]

    def layouts(self, plan: ForwardPlan) -> tuple[Batch, Batch | None]:
        """The step's layout (`Batch`) and, when the local layers hold a pool of their own, theirs: the same
        positions through their own block tables (`plan.local_tables`), read within their window."""
        batch = Batch(plan.rows, self.block_size, self.device, window=self.windows[0])
        if not plan.local_tables:
            return batch, None
        rows = [(pos, table) for (pos, _), table in zip(plan.rows, plan.local_tables)]
        return batch, Batch(rows, self.block_size, self.device, window=self.windows[1])

    @torch.no_grad()
    def forward(self, plan: ForwardPlan) -> torch.Tensor:
        """(len(plan.select), V) fp32 logits of the selected tokens, after writing every token's keys and values."""
        batch, local = self.layouts(plan)
        ids = torch.tensor(plan.ids, dtype=torch.long, device=self.device)[:, None]  # (N, 1): a row per token
        start = batch.positions
        select = torch.tensor(plan.select, dtype=torch.long, device=self.device)
        with self._with(plan):
            rope = self.model.rope(int(start.max()) + 1)
            return self._logits(self.step_fn(ids, start, self.kv.caches(batch, local), rope, select))

    def warm(self) -> float:
        """Run the compiled step once for each graph it needs and return the seconds it took: torch.compile
        specializes sizes 0 and 1, so a one-token step and a five-token chunk, each selecting no logits (a chunk
        before the prompt's last), one (the last token) and all. Every table is all block 0, so it writes into
        that block only, before any request holds a block (a request's keys are written before they are read)."""
        t0 = time.perf_counter()
        for n, select in ((1, ()), (1, (0,)), (5, ()), (5, (4,)), (5, tuple(range(5)))):
            rows = ((range(n), (0,) * n),)
            local = ((0,) * n,) if self.local_blocks else ()
            self.forward(ForwardPlan(ids=(0,) * n, rows=rows, select=select, local_tables=local))
        return time.perf_counter() - t0

    def replay(self, op: tuple) -> None:
        """On a rank other than 0 (`worker_loop`): rank 0's operation `op` ("forward", "idle") as the plain Runner
        runs it, sending nothing on."""
        getattr(Runner, op[0])(self, *op[1:])

    def idle(self) -> None:
        """Called about once a second while there is nothing to do."""


class DistributedRunner(Runner):
    """Rank 0's runner under tensor parallelism: each step's plan is broadcast to the other ranks first (and a
    ping every few idle seconds, so that their wait for the next step never reaches the timeout)."""

    PING_S = 5.0
    last_sent = 0.0

    def _send(self, op: tuple) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([op], src=0)
        self.last_sent = time.monotonic()

    def idle(self):
        if time.monotonic() - self.last_sent > self.PING_S:
            self._send(("idle",))

    def forward(self, plan):
        self._send(("forward", plan))
        return super().forward(plan)

    def shutdown(self) -> None:
        self._send(("stop",))


def worker_loop(runner: Runner) -> None:
    """Ranks other than 0: replay rank 0's steps (`runner.replay`) until it says stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        op = box[0]
        if op[0] == "stop":
            return
        runner.replay(op)
