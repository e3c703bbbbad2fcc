"""Train one layout (tp, pp, dp, ZeRO) with meshlm's parallel transforms, the way the trainer does, on a
fixed synthetic dataset read through `BatchLoader`; and the same global batches in one process.

Used by test_data_parallel.py, test_reshard.py and test_bert_parallel.py inside forked gloo worlds
(parallel_world.py). Models are gpt-tiny/llama-tiny-shaped but small (2 layers of width 32, 16 tokens,
vocabulary 101; BERT 4 layers, which its pp2 × vpp2 layout needs), dropout off, with clipping active (a
wrong gradient norm would show); the equivalence runs in float64 (`float64`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from meshlm.core.config import OptimConfig, build
from meshlm.data.dataset import BatchLoader
from meshlm.families.registry import get_spec, spec_of
from meshlm.families.spec import family_loss
from meshlm.parallel import build_model
from meshlm.parallel.dp import apply_data_parallel
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.tensor import full_state_dict
from meshlm.train.optim import build_optimizer

SEED, LR, CLIP = 1234, 1e-3, 0.5
# The equivalence runs are in float64 (`float64()`): AdamW moves an element whose gradient is a
# cancellation of larger terms by up to lr·|δg|/eps for a rounding difference δg (slope lr/eps = 1e5), and
# training compounds it. In fp32 (unit roundoff 6e-8) that reached 2.4e-5 in the weights and 1.7e-5 in a
# gradient norm between layouts that are equal in exact arithmetic, with values that depend on the CPU's
# kernels; in float64 (1.1e-16) the same mechanism stays below 1e-13, so TOL = 1e-9 holds on any host
# and still sees any real error (a missing or doubled reduction moves these numbers by 1e-3 or more).
TOL = 1e-9


@contextlib.contextmanager
def float64():
    """Parameters, activations and losses in float64 inside the block (the default dtype, restored after)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def one_thread():
    """One intra-op thread inside the block (restored after): the single-process references the test process
    computes are tiny, and a second thread only waits on a busy 2-core machine, as the ranks do."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
MICRO_BATCH_SIZE, GLOBAL_BATCH = 1, 8
MODELS = {
    "gpt": {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 101},
    "llama": {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "vocab_size": 101,
              "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": False},
    "bert": {"family": "bert", "n_layers": 4, "hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 101,
             "activation": "gelu_exact", "norm_eps": 1e-12},
}
N_SAMPLES = 64


def config(model: str = "gpt", tp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0, train: dict | None = None,
           optim: str = "adamw", **parallel):
    return build({"model": MODELS[model], "optim": {"name": optim},
                  "train": {"micro_batch_size": MICRO_BATCH_SIZE, "global_batch_size": GLOBAL_BATCH, **(train or {})},
                  "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero": zero, "timeout_s": 60, "bucket_mb": 0.004,
                               **parallel}})


def samples(cfg) -> list[np.ndarray]:
    """Random token rows: nothing to learn across samples, but 64 of them are memorised within steps."""
    g = np.random.default_rng(7)
    if cfg.model.family == "bert":
        return BertRows(cfg.model, g)
    return [g.integers(0, cfg.model.vocab_size, cfg.model.seq_len + 1) for _ in range(N_SAMPLES)]


class BertRows(list):
    """BERT pretraining rows in the data pipeline's layout (ids, types, mask, MLM labels: T each, then the
    sentence-order label): random ids, two segments, padding of 0-6 tokens, a third of the real tokens
    predicted."""

    def __init__(self, m, g: np.random.Generator):
        T = m.seq_len
        rows = []
        for _ in range(N_SAMPLES):
            n = T - int(g.integers(0, 7))
            ids = np.where(np.arange(T) < n, g.integers(1, m.vocab_size, T), 0)
            types = ((np.arange(T) >= n // 2) & (np.arange(T) < n)).astype(np.int64)
            mask = (np.arange(T) < n).astype(np.int64)
            labels = np.where((g.random(T) < 0.33) & (mask == 1), g.integers(0, m.vocab_size, T), -100)
            rows.append(np.concatenate([ids, types, mask, labels, [int(g.integers(0, 2))]]).astype(np.int64))
        super().__init__(rows)
        self.T = T

    def collate(self, rows: np.ndarray):
        batch = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        T = self.T
        inputs, targets = batch[:, :3 * T].reshape(-1, 3, T).clone(), batch[:, 3 * T:]
        inputs[:, 2] += targets[:, :T] != -100  # predicted tokens flagged, as the data pipeline does
        return inputs, targets


@dataclass
class Run:
    """One rank's training state for a layout."""

    cfg: object
    dims: ParallelDims | None
    model: torch.nn.Module
    loss_fn: object
    pipe: object
    sync: object
    opt: torch.optim.Optimizer
    loader: BatchLoader
    m: int
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


_DIMS: dict[tuple[int, int, int], ParallelDims] = {}


def dims_for(tp: int = 1, pp: int = 1, dp: int = 1) -> ParallelDims:
    """One ParallelDims per layout shape and process (building groups is collective and slow)."""
    if (tp, pp, dp) not in _DIMS:
        _DIMS[(tp, pp, dp)] = ParallelDims.build(tp=tp, pp=pp, dp=dp, timeout_s=60)
    return _DIMS[(tp, pp, dp)]


def build_run(cfg, dims: ParallelDims | None, consumed: int = 0) -> Run:
    """The reference (dims None): the whole model built from the seed in one process. A layout: the model
    built on the meta device and only this rank's shards materialised, then tp → pp → dp, exactly as the
    trainer does (`parallel.build_model`)."""
    torch.manual_seed(SEED)
    dp = dims.dp if dims is not None else 1
    if dims is None:
        spec = get_spec(cfg.model.family)
        dims, pipe, loss_fn = ParallelDims(), None, family_loss(spec, cfg.model)
        model = spec.model_class(cfg.model)
        sync = apply_data_parallel(model, dims, cfg, cfg.train.global_batch_size // cfg.train.micro_batch_size, spec=spec_of(model))
    else:
        par = build_model(cfg, dims, rng=TPRNGTracker(SEED, dims.tp_rank) if dims.tp > 1 else None, spec=get_spec(cfg.model.family))
        model, loss_fn, pipe, sync = par.model, par.loss_fn, par.pipeline, par.grad_sync
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    opt = build_optimizer(sync, OptimConfig(lr=LR, name=cfg.optim.name))
    loader = BatchLoader(samples(cfg), cfg.train.micro_batch_size, SEED, consumed=consumed, dp_rank=dims.dp_rank,
                         dp_size=dp)
    return Run(cfg, dims, model, loss_fn, pipe, sync, opt, loader, m)


def step(run: Run, zero_grad: bool = True) -> float:
    """One optimizer step of the global batch, as the trainer runs it; returns the global mean loss."""
    if run.pipe is not None:
        batches = [run.loader.next() for _ in range(run.m)]
        total = run.pipe.train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    else:
        total = torch.zeros(())
        for i in range(run.m):
            x, y = run.loader.next()
            run.sync.set_last_microbatch(i == run.m - 1)
            loss = run.loss_fn(run.model(x), y) / run.m
            loss.backward()
            total += loss.detach()
    loss = float(run.sync.average_loss(total))
    run.sync.finish()
    run.norms.append(float(run.sync.clip_grad_norm_(CLIP)))
    run.opt.step()
    run.sync.after_step()
    if zero_grad:
        run.sync.zero_grad(run.opt)
    run.losses.append(loss)
    return loss


def step_without_zero_grad(run: Run) -> float:
    """A step that leaves the gradients in place (to measure model-state memory)."""
    return step(run, zero_grad=False)


def full_state(run: Run) -> dict[str, torch.Tensor]:
    """The plain GPT tensors this rank's pipeline stage holds, gathered over tp (and dp under ZeRO-3), each
    expert slice gathered over its ep group into the whole (E, ...) stack."""
    if run.dims.tp > 1:
        state = full_state_dict(run.model)
    else:
        state = run.model.state_dict()
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    if getattr(run.dims, "ep", 1) > 1:
        import torch.distributed as dist

        for name, p in run.model.named_parameters():
            if getattr(p, "expert_rows", None) is not None:
                parts = [torch.empty_like(p) for _ in range(run.dims.ep)]
                dist.all_gather(parts, p.detach().contiguous(), group=run.dims.ep_group)
                state[name] = torch.cat(parts)
    return state


def train(cfg, dims: ParallelDims | None, steps: int) -> Run:
    run = build_run(cfg, dims)
    for _ in range(steps):
        step(run)
    return run


def reference(model: str, steps: int, optim: str = "adamw") -> dict:
    """The single-process run: losses and gradient norms of `steps` steps, the weights after each step."""
    run = build_run(config(model, optim=optim), None)
    states = {}
    for n in range(1, steps + 1):
        step(run)
        states[n] = full_state(run)
    return {"losses": run.losses, "norms": run.norms, "states": states}


def compare(ref: dict, got: Run) -> dict:
    """Worst differences of `got` from the reference over the steps it took (losses, norms relative)."""
    rel = lambda a, b: abs(a - b) / abs(b)
    n = len(got.losses)
    want, have = ref["states"][n], full_state(got)
    return {"loss": max(rel(a, b) for a, b in zip(got.losses, ref["losses"][:n])),
            "grad_norm": max(rel(a, b) for a, b in zip(got.norms, ref["norms"][:n])),
            "weights": max(float((v - want[k]).abs().max()) for k, v in have.items()),
            "keys": sorted(have), "losses": got.losses}


def save(run: Run, out_dir, config: dict | None = None):
    """A checkpoint of this layout after `len(run.losses)` steps (data position included)."""
    from meshlm.checkpoint import sharded

    state = {"step": len(run.losses), "loader": run.loader.state_dict(), "losses": list(run.losses),
             "norms": list(run.norms)}
    return sharded.save(out_dir, len(run.losses), run.sync, run.opt, state, config or {}, {},
                        spec=spec_of(run.sync.model))


def resume(cfg, dims: ParallelDims | None, path) -> Run:
    """A fresh layout (possibly another one) that continues from checkpoint `path`."""
    from meshlm.checkpoint import sharded
    from meshlm.checkpoint.single import load_part

    state = load_part(path, "state")
    run = build_run(cfg, dims, consumed=state["loader"]["consumed"])
    sharded.load(path, run.sync, run.opt, spec=get_spec(cfg.model.family))
    run.losses, run.norms = list(state["losses"]), list(state["norms"])
    return run
