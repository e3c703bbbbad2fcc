"""The engine's runner under pipeline parallelism: each rank runs its stage's layers of every step.

Why: pipeline parallelism in serving is for a model that one device cannot hold (each rank keeps 1/pp of the
layers and of the KV cache), not for speed. A step passes through the stages one after the other, with no
micro-batches in flight together, so pp ranks answer no faster than one process would.

One step (`ForwardPlan`, decided on rank 0 by the scheduler, as in one process):
1. rank 0 (the first stage) broadcasts the plan to every rank (`DistributedRunner._send`, as under tensor
   parallelism; an idle ping every few seconds keeps the others' wait under `parallel.timeout_s`);
2. every rank builds the same `Batch` from it (same positions, same block tables: the plan decides the blocks),
   so each stage's paged KV cache holds its own layers' keys and values in the same slots; sliding-window layers
   mixed with global ones hold a pool of their own on every stage, read through the plan's local tables, so
   their blocks leave the window and go back as in one process;
3. the first stage embeds the step's N tokens, runs its layers and sends the residual stream (N, 1, h) to the
   next stage over the pipeline group (`send`/`recv`: gloo on CPU, NCCL on GPU), which runs its layers, ...;
4. the last stage runs the final norm and head on the selected tokens only and sends their fp32 logits
   (len(select), V) back to rank 0, which hands them to the engine as `Runner.forward` does.
Under pp × tp each stage is tp ranks: every rank of a stage does the same, exchanging the stream with the ranks
of its own tp coordinate; the last stage gathers the vocab-parallel logits over tp and its tp rank 0 sends them.
The ranks other than 0 replay the plans in `runner.worker_loop` (`PipelineRunner.replay`) until rank 0 says stop.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from meshlm.core.kv_cache import kv_groups
from meshlm.infer.runner import DistributedRunner
from meshlm.infer.scheduler import ForwardPlan
from meshlm.models.paged import Batch, PagedKV
from meshlm.parallel.pipeline import PipelinePeerError, rank_at


class PipelineRunner(DistributedRunner):
    """This rank's stage of the model (the pruned plain model of `load_parallel`: other stages' layers are None)
    and the paged KV cache of its own layers. On rank 0 `forward(plan)` broadcasts the plan first and returns
    the selected tokens' logits, received from the last stage; on the other ranks `stage_forward` runs from
    `runner.worker_loop`."""

    def __init__(self, model, pipeline, num_blocks: int, block_size: int, vocab_size: int, tp_group=None,
                 local_blocks: int = 0):
        # Not Runner.__init__: its PagedKV would walk every layer, and this rank holds only its own.
        self.model, self.adapters, self.dims = model, None, pipeline.dims
        self.num_blocks, self.block_size, self.vocab_size, self.tp_group = num_blocks, block_size, vocab_size, tp_group
        # the local (sliding-window) layers' own pool when global layers are mixed in, as in one process: every
        # stage holds one for its own local layers, read through the plan's local tables (`Runner.layouts`)
        self.local_blocks, self.windows = local_blocks, kv_groups(model.cfg)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layer_ids = [i for module in pipeline.modules for i in module.layer_ids]
        self.first, self.last = pipeline.has_first, pipeline.has_last
        self.hidden_size = pipeline.hidden_size
        own = SimpleNamespace(layers=[model.layers[i] for i in self.layer_ids], parameters=model.parameters)
        self.kv = PagedKV(own, num_blocks, block_size, local_blocks)  # a pool per own layer, in `layer_ids` order
        pp = self.dims.pp
        self.prev = rank_at(self.dims, self.dims.pp_rank - 1) if self.dims.pp_rank > 0 else None
        self.next = rank_at(self.dims, self.dims.pp_rank + 1) if self.dims.pp_rank < pp - 1 else None
        self.logits_from = rank_at(self.dims, pp - 1, tp_rank=0)  # the last stage's sender; rank 0 receives

    def _caches(self, batch: Batch, local: Batch | None) -> list:
        """Per model layer its cache view (None for the layers of other stages): `run_layers` indexes by layer id."""
        caches = [None] * self.model.cfg.n_layers
        for i, cache in zip(self.layer_ids, self.kv.caches(batch, local)):
            caches[i] = cache
        return caches

    def _p2p(self, op, tensor: torch.Tensor, peer: int) -> None:
        """`dist.send` or `dist.recv` of `tensor` with `peer` over the pipeline group; a failure (a rank that stopped,
        or did not answer within parallel.timeout_s) is a `PipelinePeerError` saying so."""
        try:
            op(tensor, peer, group=self.dims.pp_group)
        except (RuntimeError, dist.DistError) as err:
            raise PipelinePeerError(f"pipeline serving step failed on rank {self.dims.rank} (stage {self.dims.pp_rank}) "
                                    f"talking to rank {peer}: it stopped or did not answer; see its output [{err}]") from err

    @torch.no_grad()
    def stage_forward(self, plan: ForwardPlan) -> torch.Tensor | None:
        """This stage's part of `plan` (every rank calls it for every step); rank 0 gets the (len(plan.select), V)
        fp32 logits of the selected tokens, the other ranks None."""
        d, m = self.dims, self.model
        batch, local = self.layouts(plan)
        start = batch.positions
        if self.first:
            ids = torch.tensor(plan.ids, dtype=torch.long, device=self.device)[:, None]  # (N, 1): a row per token
            x = m.embed(ids, start)
        else:
            x = torch.empty((len(plan.ids), 1, self.hidden_size), dtype=self.dtype, device=self.device)
            self._p2p(dist.recv, x, self.prev)  # (N, 1, h): the previous stage's residual stream
        x = m.run_layers(x, self.layer_ids, self._caches(batch, local), start, m.rope(int(start.max()) + 1))
        if not self.last:
            self._p2p(dist.send, x.to(self.dtype).contiguous(), self.next)
        else:
            select = torch.tensor(plan.select, dtype=torch.long, device=self.device)
            logits = self._logits(m.head(x.index_select(0, select))[:, 0])  # (S, V) fp32, gathered over tp
            if d.rank == self.logits_from and d.rank != 0:
                self._p2p(dist.send, logits.contiguous(), 0)
            return logits if d.rank == 0 else None
        if d.rank != 0:
            return None
        logits = torch.empty((len(plan.select), self.vocab_size), dtype=torch.float32, device=self.device)
        self._p2p(dist.recv, logits, self.logits_from)
        return logits

    def forward(self, plan: ForwardPlan) -> torch.Tensor:
        self._send(("forward", plan))
        return self.stage_forward(plan)

    def replay(self, op: tuple) -> None:
        """On a rank other than 0 (`runner.worker_loop`): this stage's part of a step; idle pings need nothing."""
        if op[0] == "forward":
            self.stage_forward(op[1])
