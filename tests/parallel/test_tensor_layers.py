"""Each tensor-parallel layer against the single-process layer with the same weights (gloo, CPU).

Worlds of 2 and 4 processes; uneven shapes: 7 input features, a vocabulary of 11 (padded to 12), 3 rows.
Checked per layer: output, input gradient and weight/bias gradients, with and without sequence parallelism,
to 1e-6 relative to the largest reference value (only the summation order differs). Under SP the
column-parallel linear keeps only its input's sequence shard for backward and gathers it again there
(checked: what it saves, the collectives its backward runs, bf16 autocast bit for bit against the
all-gather-then-linear composition).
A GQA attention block with one KV head replicated on every rank checks that the replicated KV
gradients are summed (`finish_grads`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from parallel_world import run_world
from torch import nn

from meshlm.core.config import ModelConfig
from meshlm.families.gpt import tp_plan
from meshlm.models.layers import Block
from meshlm.parallel.mesh import ParallelDims
from meshlm.parallel.rng import TPRNGTracker
from meshlm.parallel.styles import TPContext
from meshlm.parallel.tensor import apply_plan, finish_grads, full_state_dict
from meshlm.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    block_rows,
    gather_from_sequence_region,
    vocab_parallel_cross_entropy,
)

B, T, IN, OUT, VOCAB = 3, 8, 7, 12, 11
TOL = 1e-6


def _seq_chunk(x: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    return x.chunk(dims.tp, dim=1)[dims.tp_rank]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (fp32 sums in another order)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def _column(dims: ParallelDims, sp: bool) -> dict:
    gen = torch.Generator().manual_seed(1)
    dense = nn.Linear(IN, 2 * OUT)  # two stacked blocks, like [W_gate; W_up]
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen))
        dense.bias.copy_(torch.randn(dense.bias.shape, generator=gen))
    x = torch.randn(B, T, IN, generator=gen)
    dy = torch.randn(B, T, 2 * OUT, generator=gen)
    xr = x.clone().requires_grad_()
    (dense(xr) * dy).sum().backward()
    rows = block_rows([OUT, OUT], dims.tp)
    par = ColumnParallelLinear.from_dense(dense, dims.tp_group, rows, sequence_parallel=sp)
    mine = rows[dims.tp_rank]
    xp = (_seq_chunk(x, dims) if sp else x).clone().requires_grad_()
    y = par(xp)
    (y * dy[..., mine]).sum().backward()
    ref_y = dense(x).detach()[..., mine]
    return {"out": _max_diff(y.detach(), ref_y),
            "input_grad": _max_diff(xp.grad, _seq_chunk(xr.grad, dims) if sp else xr.grad),
            "weight_grad": _max_diff(par.weight.grad, dense.weight.grad[mine]),
            "bias_grad": _max_diff(par.bias.grad, dense.bias.grad[mine])}


def _row(dims: ParallelDims, sp: bool) -> dict:
    gen = torch.Generator().manual_seed(2)
    dense = nn.Linear(OUT, IN)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen))
        dense.bias.copy_(torch.randn(dense.bias.shape, generator=gen))
    x = torch.randn(B, T, OUT, generator=gen)
    dy = torch.randn(B, T, IN, generator=gen)
    xr = x.clone().requires_grad_()
    y_ref = dense(xr)
    (y_ref * dy).sum().backward()
    cols = block_rows([OUT], dims.tp)
    mine = cols[dims.tp_rank]
    par = RowParallelLinear.from_dense(dense, dims.tp_group, cols, sequence_parallel=sp)
    xp = x[..., mine].clone().requires_grad_()
    y = par(xp)
    (y * (_seq_chunk(dy, dims) if sp else dy)).sum().backward()
    finish_grads(par, dims)  # SP: the bias saw only this rank's tokens
    return {"out": _max_diff(y.detach(), _seq_chunk(y_ref.detach(), dims) if sp else y_ref.detach()),
            "input_grad": _max_diff(xp.grad, xr.grad[..., mine]),
            "weight_grad": _max_diff(par.weight.grad, dense.weight.grad[:, mine]),
            "bias_grad": _max_diff(par.bias.grad, dense.bias.grad)}


def _embedding(dims: ParallelDims, sp: bool) -> dict:
    gen = torch.Generator().manual_seed(3)
    dense = nn.Embedding(VOCAB, IN)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen))
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    ids[0, :T] = torch.arange(T)  # the first rows of the table
    ids[1, 0] = VOCAB - 1  # and the last one
    dy = torch.randn(B, T, IN, generator=gen)
    y_ref = dense(ids)
    (y_ref * dy).sum().backward()
    par = VocabParallelEmbedding.from_dense(dense, dims.tp_group, sequence_parallel=sp)
    y = par(ids)
    (y * (_seq_chunk(dy, dims) if sp else dy)).sum().backward()
    n = par.weight.shape[0]
    start = dims.tp_rank * n
    ref_grad = torch.cat([dense.weight.grad, torch.zeros(n * dims.tp - VOCAB, IN)])[start:start + n]
    return {"out": _max_diff(y.detach(), _seq_chunk(y_ref.detach(), dims) if sp else y_ref.detach()),
            "weight_grad": _max_diff(par.weight.grad, ref_grad),
            "full_weight": _max_diff(full_state_dict(par)["weight"], dense.weight.detach())}


def _cross_entropy(dims: ParallelDims) -> dict:
    gen = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(B, T, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (B, T), generator=gen)
    targets[0, 0] = VOCAB - 1  # a target on the last, partly padded shard
    targets[1, 2] = targets[2, 5] = -100  # ignored (fine-tuning masks): no loss, no gradient, not counted
    ref = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(ref.view(-1, VOCAB), targets.view(-1))
    loss_ref.backward()
    width = -(-VOCAB // dims.tp)
    start = dims.tp_rank * width
    padded = torch.cat([logits, torch.full((B, T, width * dims.tp - VOCAB), 5.0)], dim=-1)  # padding logits 5
    local = padded[..., start:start + width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, dims.tp_group, VOCAB)
    loss.backward()
    n_valid = max(0, min(width, VOCAB - start))
    return {"loss": abs(loss.item() - loss_ref.item()),
            "logit_grad": _max_diff(local.grad[..., :n_valid], ref.grad[..., start:start + n_valid]),
            "padding_grad": float(local.grad[..., n_valid:].abs().max()) if n_valid < width else 0.0}


def _gqa_block(dims: ParallelDims, sp: bool) -> dict:
    """n_heads=4 with one KV head: at tp=2 and tp=4 every rank holds a copy of it."""
    cfg = ModelConfig(vocab_size=VOCAB, n_layers=1, hidden_size=16, n_heads=4, n_kv_heads=1, seq_len=T,
                      position="learned", norm="rmsnorm", activation="swiglu", bias=True)
    torch.manual_seed(5)
    dense = Block(cfg)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    x = torch.randn(B, T, 16, generator=gen)
    dy = torch.randn(B, T, 16, generator=gen)
    xr = x.clone().requires_grad_()
    y_ref = dense(xr)
    (y_ref * dy).sum().backward()
    ref_grads = {k: p.grad.clone() for k, p in dense.named_parameters()}
    dense.zero_grad(set_to_none=True)  # the norms stay the same modules after the transform

    par = nn.Module()  # a container, so the gathered keys read block.*
    par.block = dense
    block_plan = {k.replace("layers.*.", "block."): v for k, v in tp_plan(cfg).items() if k.startswith("layers.*.")}
    apply_plan(par, block_plan, TPContext(dims.tp_group, dims.tp, dims.tp_rank, sp, TPRNGTracker(0, dims.tp_rank)))
    xp = (_seq_chunk(x, dims) if sp else x).clone().requires_grad_()
    y = par.block(xp)
    (y * (_seq_chunk(dy, dims) if sp else dy)).sum().backward()
    finish_grads(par, dims)
    for p in par.parameters():  # gather the gradients with the weight-gathering code
        p.data = p.grad
    full = full_state_dict(par)
    return {"out": _max_diff(y.detach(), _seq_chunk(y_ref.detach(), dims) if sp else y_ref.detach()),
            "input_grad": _max_diff(xp.grad, _seq_chunk(xr.grad, dims) if sp else xr.grad),
            **{f"grad {k}": _max_diff(full[f"block.{k}"], g) for k, g in ref_grads.items()}}


_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")


def _saved_and_backward_calls(forward, params: set[int], dy: torch.Tensor):
    """(shapes and dtypes saved for backward by `forward()`, parameters and their views aside; the
    all-gathers and reduce-scatters its backward runs)."""
    saved, calls = [], {"all_gather": 0, "reduce_scatter": 0}

    def pack(t):
        if id(t) not in params and (t._base is None or id(t._base) not in params):
            saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward()
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls["all_gather" if "gather" in name else "reduce_scatter"] += 1
            return fn(*args, **kwargs)
        return run

    for n, fn in originals.items():
        setattr(dist, n, counting(n, fn))
    try:
        (y.float() * dy).sum().backward()
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return y.detach(), saved, calls


def _column_sp_saves_the_shard(dims: ParallelDims) -> dict:
    """SP ColumnParallelLinear: saved tensors, backward collectives, and fp32 / bf16 autocast against
    `gather_from_sequence_region` + `F.linear` (which saves the gathered input)."""
    gen = torch.Generator().manual_seed(3)
    dense = nn.Linear(IN, 2 * OUT)
    par = ColumnParallelLinear.from_dense(dense, dims.tp_group, block_rows([OUT, OUT], dims.tp), sequence_parallel=True)
    x = _seq_chunk(torch.randn(B, T, IN, generator=gen), dims)
    dy = torch.randn(B, T, par.weight.shape[0], generator=gen)
    params = {id(p) for p in par.parameters()}
    out = {}
    for precision in ("fp32", "bf16"):
        runs = []
        for fused in (True, False):
            xp = x.clone().requires_grad_()
            par.zero_grad(set_to_none=True)

            def forward(xp=xp, fused=fused, precision=precision):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    if fused:
                        return par(xp)
                    return F.linear(gather_from_sequence_region(xp, dims.tp_group), par.weight, par.bias)

            y, saved, calls = _saved_and_backward_calls(forward, params, dy)
            runs.append((saved, calls, (y, xp.grad, par.weight.grad.clone(), par.bias.grad.clone())))
        (saved, calls, values), (composed_saved, _, composed_values) = runs
        out[precision] = {"saved": saved, "composed_saved": composed_saved, "calls": calls,
                          "diffs": [float((a.float() - b.float()).abs().max()) for a, b in zip(values, composed_values)]}
    return out


def _worker(rank: int, world: int, out_dir: str) -> dict:
    dims = ParallelDims.build(tp=world, timeout_s=60)
    assert dist.get_world_size(dims.tp_group) == world
    results = {"ce": _cross_entropy(dims), "column_sp_saved": _column_sp_saves_the_shard(dims)}
    for sp in (False, True):
        results[f"column_sp{sp}"] = _column(dims, sp)
        results[f"row_sp{sp}"] = _row(dims, sp)
        results[f"embedding_sp{sp}"] = _embedding(dims, sp)
        results[f"gqa_block_sp{sp}"] = _gqa_block(dims, sp)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def layer_results(request, tmp_path_factory):
    world = request.param
    return run_world(_worker, world, tmp_path_factory.mktemp(f"layers{world}"), deadline_s=120)


@pytest.mark.parametrize("layer", ["column", "row", "embedding", "gqa_block"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_parallel_layer_matches_single_process(layer_results, layer, sp):
    for rank, res in enumerate(layer_results):
        for what, diff in res[f"{layer}_sp{sp}"].items():
            assert diff <= TOL, f"rank {rank}: {layer} {what} differs by {diff:.2e}"


def test_vocab_parallel_cross_entropy_matches_ignores_and_padding_gets_no_gradient(layer_results):
    for rank, res in enumerate(layer_results):
        for what, diff in res["ce"].items():
            assert diff <= TOL, f"rank {rank}: cross-entropy {what} differs by {diff:.2e}"



def test_sequence_parallel_column_keeps_the_shard_and_gathers_it_again_in_backward(layer_results):
    t = len(layer_results)
    for rank, res in enumerate(layer_results):
        for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            got = res["column_sp_saved"][precision]
            assert got["saved"] == [((B, T // t, IN), dtype)], (rank, precision, got["saved"])  # the shard only
            gathered = [(torch.Size(shape).numel(), d) for shape, d in got["composed_saved"]]
            assert (B * T * IN, dtype) in gathered  # the composition keeps the gathered input
            assert got["calls"] == {"all_gather": 1, "reduce_scatter": 1}  # the re-gather, dX's reduce-scatter
        # bf16: bit for bit; fp32: dW sums the tokens in another order
        assert res["column_sp_saved"]["bf16"]["diffs"] == [0.0] * 4, res["column_sp_saved"]["bf16"]["diffs"]
        assert max(res["column_sp_saved"]["fp32"]["diffs"]) <= 1e-5
