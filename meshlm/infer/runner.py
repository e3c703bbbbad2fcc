"""The engine's runner: the model and its paged KV cache, executing one step's `ForwardPlan` at a time.

`Runner.forward(plan)` embeds the step's N tokens as N rows of one token (per-token positions), runs every layer
over them with one paged cache view per layer (`models/paged.py`: keys and values written into the plan's block
slots, attention read through the block tables) and returns the fp32 logits of the tokens the plan selects.
Under tensor parallelism rank 0's runner broadcasts each plan to the other ranks first (`DistributedRunner`),
which replay it in `worker_loop`. With `compile=True` the whole step (embedding, every layer, the head) is one
`torch.compile` graph with dynamic token counts (the model's Python numbers constants: `SPECIALIZE`;
`COMPILE_CONFIG`: the weights frozen in as constants, each linear layer's product the faster of oneDNN's on a
prepacked weight and Inductor's own C++ kernel, or oneDNN's alone for bf16 weights on a CPU whose native bf16 is
AVX512-BF16 without AMX: `compile_config`, where the one-token graph's bf16 products are meshlm's own operator
instead, `infer/rows.py`; the norms, RoPE, casts and residual adds around them fused into a few loops). Each layer's paged attention, whose layout
differs every step, is one opaque operator inside the graph (`models.paged.paged_attention`), run eagerly over
the step's caches, which the runner hands it beside the graph (`models.paged.STEP`); a step of one token past
its first (one client's decoding) attends inside its own graph instead (`models.paged.RowCache`: the pool and
the row's slot index are graph inputs, written in place and read by generated kernels, or by meshlm's in-place
kernel as the operator `row_decode`, whose CPU kernel is registered from C++ where `native.row_ops()` builds: no
Python between the layers). The graphs (one per size class) are compiled at start (`compile_s`). Which tokens
run, and in which blocks, is the scheduler's business
(`infer/scheduler.py`); what becomes of the logits the engine's (`infer/engine.py`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch

from meshlm.core.kv_cache import kv_groups
from meshlm.core.precision import cpu_bf16_support
from meshlm.infer.quantize import compiled_crossing
from meshlm.infer.rows import use_bf16_rows
from meshlm.infer.scheduler import ForwardPlan
from meshlm.models import native
from meshlm.models.paged import STEP, Batch, PagedKV

log = logging.getLogger(__name__)

# Inductor's settings for the compiled step, set while it compiles (at start, `Runner.warm`): `freezing` folds
# the weights in as constants (serving never changes them; adapters, which would, are refused with compile), so
# linear layers get prepacked weights, and `max_autotune` times Inductor's own CPU matrix-product kernels
# against oneDNN's for each shape and keeps the faster (on a CPU Inductor's reach memory bandwidth at a few
# rows, where oneDNN's do not); measured in docs/serving.md ("The compiled step"). Not so for bf16 weights on a
# CPU with AVX512-BF16 and no AMX (`compile_config`)
COMPILE_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# on a CPU whose native bf16 is AVX512-BF16 alone, Inductor's C++ kernels multiply bf16 weights at about fp32's
# speed (one SmolLM2 row: 270 MB of weights read in 16.5 ms, 16 GB/s, where the memory gives 36) and the autotuner,
# timing each product alone on a weight it has just read into the cache, still picks them; oneDNN's bf16 products
# read them at 26 GB/s. There a bf16 model's compiled step takes ATen's products alone (SmolLM2 bf16 in process:
# the step of one row 21.4 -> 13.9 ms, of 16 rows 40.9 -> 32.7 ms; served, one client +23-28% output tokens/s, the
# demo model +5-49% at 1, 16 and 64 clients; benchmarks/RESULTS.md, "Every pair on the AVX512-BF16 EPYC after the
# serving rounds")
BF16_ATEN_ONLY = cpu_bf16_support() == "AVX512-BF16"

# dynamo compiles at most this many graphs per code object: a runner needs three or four (`warm`), and a process
# may build several runners (tests; an engine per run): without room the later ones would run eagerly
RECOMPILE_LIMIT = 64
# the Python numbers a step's graph reads (each norm's eps, a cache's layer, width, block size and scale) are
# constants of the runner: compiled as constants, not as inputs. Without it dynamo (dynamic=True) made each float
# an input, converted to a tensor before every call: SmolLM2's one-token graph spent 0.3 ms a step so on its 61
# norms' eps. A step's own data (tokens, positions, block tables, lengths, slots) are tensors, never such numbers:
# a graph specialized on them would be reused wrongly once guards are skipped (`Runner._compiled`)
SPECIALIZE = {"specialize_float": True, "specialize_int": True}
# the token count the several-token graph is compiled (and its products autotuned) at: Inductor times its
# kernels at the example's sizes and keeps that choice for every count the dynamic graph runs. bf16 and quantized
# weights: 16 (measured on a 2-core EPYC, SmolLM2 bf16, 16 clients' closed loop in process: tuned at 5 rows 155
# output tokens/s, at 16 rows 193, at 512 rows 183; benchmarks/RESULTS.md, "One OpenMP pool"; on an AMX Xeon 16
# beat 64 and a second graph tuned at 128). fp32 weights: 64, where Inductor's fp32 C++ kernel, chosen at 16
# rows, ran the demo model's down projection at 91 GFLOP/s in a 170-token step, against 280-330 for oneDNN's
# product on the step's shapes (RESULTS.md, "Where the several-token graph is tuned")
WARM_ROWS = 16
WARM_ROWS_FP32 = 64
# the warm-up's several-token steps are rows of at most this many positions (a model's length may be short)
WARM_ROW_LENGTH = 16


def compile_config(model: torch.nn.Module) -> dict:
    """Inductor's settings for `model`'s compiled step: `COMPILE_CONFIG`, its products from ATen alone where the
    model multiplies by bf16 weights of its own on the CPU (a `nn.Linear` in bf16 there), `BF16_ATEN_ONLY` holds
    and the products are autotuned at all."""
    config = dict(COMPILE_CONFIG)
    bf16 = any(isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
               for m in model.modules())
    if BF16_ATEN_ONLY and bf16 and "max_autotune_gemm_backends" in config:
        config["max_autotune_gemm_backends"] = "ATEN"
    return config


class Runner:
    """The model and its paged KV cache (`models/paged.py`): `forward(plan)` runs one step's tokens and returns the
    fp32 logits of the tokens it selects; with `adapters` (an `AdapterSet`) each token's adapter too. 
    `compile`: the whole step through torch.compile (module docstring; one process, no adapters: they swap
    weights per step); `compile_s`: the seconds its warm-up took (0.0: eager)."""

    compiled_runners = 0  # compiled runners this process has built: their graphs share one dynamo cache

    def __init__(self, model, num_blocks: int, block_size: int, vocab_size: int, tp_group=None, adapters=None,
                 compile: bool = False, local_blocks: int = 0):
        self.model, self.adapters = model, adapters
        self.num_blocks, self.block_size, self.vocab_size, self.tp_group = num_blocks, block_size, vocab_size, tp_group
        self.local_blocks = local_blocks  # > 0: the local (sliding-window) layers' own pool (models/paged.py)
        # the windows of the layouts' readers: every layer local (W, 0), or the local layers' own tables (0, W)
        self.windows = kv_groups(model.cfg) if hasattr(model, "cfg") else (0, 0)
        self.device = next(model.parameters()).device
        self.kv = PagedKV(model, num_blocks, block_size, local_blocks)
        if self.device.type == "cpu" and native.paged_decode() is None and native.enabled():  # built once, at start
            log.warning("decoding rows copy their keys out of the KV cache (the in-place kernel is unavailable: %s)",
                        native.unavailable())
        if turned := use_bf16_rows(model):  # before compiling: the graphs call the kernel
            log.info("bf16 products of a few rows through meshlm's kernel in %d linears", turned)
        self.step_fn = self._dense
        self.compile_s = 0.0
        if compile and adapters is None and tp_group is None:
            from torch._dynamo import config as dynamo_config
            from torch._inductor import config as inductor_config

            Runner.compiled_runners += 1
            if self.kv.rows_in_place and native.row_ops() is None:  # the one-token graph's attention from C++
                log.info("the one-token graph's attention calls its kernel through Python (%s)",
                         native.unavailable("row_ops"))
            self.step_fn = self._compiled(torch.compile(self._dense, dynamic=True))
            with inductor_config.patch(compile_config(model)), dynamo_config.patch(
                    recompile_limit=RECOMPILE_LIMIT, **SPECIALIZE):
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

    def _compiled(self, graph):
        """The step through `graph` (`_dense` compiled): its layers get the pool's `OpaqueCache`s, the same
        every step, and the step's own caches wait in `STEP` for the attention operator. A step that selects no
        logits (a prompt's chunk before its last) selects its last token and drops its logits: with nothing
        depending on the layers' outputs Inductor would drop their attention calls, and with them the keys and
        values they write (the operator's effect on the pool is invisible to the graph).
        Once warm, in a process with no other compiled runner, dynamo checks only the guards that tell its graphs
        apart (`skip_guard_eval_unsafe`): `warm` has compiled every graph the step needs, so no call can need a
        new one, and the skipped guards (the model's modules and weights, the opaque caches: 0.8 ms of a 14.8 ms
        one-row SmolLM2 bf16 step) cannot fail. A second compiled runner's graphs would share the cache: then every
        guard runs again. Under that stance dynamo refuses any frame it has not seen, and a cyclic garbage
        collection inside the call would run finalizers there (another thread's: an asyncio task's WeakSet
        entry, say), which would fail and leave their work undone: the collector waits until the call returns."""
        opaque = self.kv.opaque_caches()
        owners = [layer.attn for layer in self.model.layers]
        rows = self.kv.rows_in_graph
        for k, v, _, _ in self.kv.layers:  # the pool's shape never changes: constants in the one-token graph, which
            for t in (k, v):               # dynamo would otherwise take for sizes (and tie to a like-sized index)
                if t is not None:
                    torch._dynamo.mark_static(t)

        def step(ids, start, caches, rope, select):
            none = select.numel() == 0
            if none:
                select = torch.full((1,), ids.shape[0] - 1, dtype=select.dtype, device=select.device)
            one = rows and ids.shape[0] == 1 and caches[0].batch.groups[0].keys > 1  # (a first key: the opaque graph)
            layers = self.kv.row_caches(caches[0].batch) if one else opaque
            STEP.caches, STEP.owners = caches, owners
            skip = self.guards_skipped
            collecting = skip and gc.isenabled()
            if collecting:
                gc.disable()
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                    out = graph(ids, start, layers, rope, select)
            finally:
                STEP.caches = STEP.owners = None
                if collecting:
                    gc.enable()
            return out[:0] if none else out
        return step

    @property
    def guards_skipped(self) -> bool:
        """Whether this runner's calls check only the guards that tell its graphs apart (`_compiled`): warm,
        and the process's only compiled runner."""
        return self.compile_s > 0 and Runner.compiled_runners == 1

    def layouts(self, plan: ForwardPlan) -> tuple[Batch, Batch | None]:
        """The step's layout (`Batch`) and, when the local layers hold a pool of their own, theirs: the same
        positions through their own block tables (`plan.local_tables`), read within their window."""
        # where every layer reads decoding rows in place, rows sharing a prefix read it each in place too: meshlm's
        # kernel over the whole table beats the cascade's products over the shared keys, gathered once a layer,
        # at 16 and 64 rows (RESULTS.md, "The kernel's slot arithmetic")
        batch = Batch(plan.rows, self.block_size, self.device, window=self.windows[0],
                      in_place=self.kv.rows_in_place)
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

    @property
    def warm_rows(self) -> int:
        """The token count the several-token graph is compiled and tuned at (`WARM_ROWS`): `WARM_ROWS_FP32` where
        the model computes in fp32."""
        floating = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        return WARM_ROWS_FP32 if floating == torch.float32 else WARM_ROWS

    def warm(self) -> float:
        """Run the compiled step once for each graph it needs and return the seconds it took: torch.compile
        specializes sizes 0 and 1, so a one-token step (at position 0, and at 2 when one-token steps attend in their
        graph: sizes from 2 on) and a `warm_rows`-token step (rows of `WARM_ROW_LENGTH` positions), each selecting
        one token's logits (the last) and, for the several, all (a step that selects none selects one,
        `_compiled`). int8 layers mostly need no more (a compiled step of two tokens or more multiplies by the
        dequantized weight, on a CPU with AMX every step by the kernel: `quantize.COMPILED_DEQUANTIZE_ROWS`); on a
        CPU without native bf16 they change branch at `DEQUANTIZE_ROWS` rows (`quantize.compiled_crossing`), so
        the several-token graph is two, each compiled and tuned on its side: at `WARM_ROWS` tokens below the
        crossing and at `warm_rows` or the crossing above it. An int8 output head multiplies the selected tokens
        only, so the larger one also selects as many as the smaller one holds (head below, blocks above). Every
        table is all block 0, so it writes into that block only, before any request holds a block (a request's
        keys are written before they are read)."""
        sizes, below = [1, self.warm_rows], None
        if (crossing := compiled_crossing(self.model)) is not None:
            below = min(WARM_ROWS, crossing - 1)  # crossing > 2
            sizes = [1, below, max(self.warm_rows, crossing)]
        t0 = time.perf_counter()
        firsts = {1: (0, 2) if self.kv.rows_in_graph else (0,)}  # one token at 0, and past it (`RowCache`)
        for n in sizes:
            for first in firsts.get(n, (0,)):
                lengths = [min(WARM_ROW_LENGTH, n - i) for i in range(0, n, WARM_ROW_LENGTH)]
                table = (0,) * (first + lengths[0])
                rows = tuple((range(first, first + k), table) for k in lengths)
                local = (table,) * len(rows) if self.local_blocks else ()
                selects = [(n - 1,)] + ([tuple(range(n))] if n > 1 else [])
                if below is not None and n > below:
                    selects.append(tuple(range(n - below, n)))
                for select in selects:
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
