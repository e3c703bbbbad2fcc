"""Per-parameter seeded initialisation: a meta-built model materialised shard by shard holds exactly the
slices of the model built whole from the same seed (tensor-parallel ranks, pipeline stages, padding)."""

from __future__ import annotations

import pytest
import torch

from meshlm.core.config import build
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT
from meshlm.models.init import InitRule, fill_, rows_per_block
from meshlm.parallel import ParallelDims, build_model
from meshlm.parallel.tensor_layers import Sharded

SEED = 11
SHAPES = {
    "gpt": {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "seq_len": 16, "vocab_size": 103},
    "llama": {"n_layers": 2, "hidden_size": 32, "n_heads": 4, "n_kv_heads": 2, "seq_len": 16, "vocab_size": 103,
              "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
              "tie_embeddings": False},
}


def _config(model: str, **parallel):
    return build({"model": SHAPES[model], "parallel": parallel,
                  "train": {"micro_batch_size": 1, "global_batch_size": 4, "recompute": "none"}})


def _whole(model: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return dict(GPT(_config(model).model).named_parameters())


@pytest.mark.parametrize("shape", [(37, 5), (200_000, 3), (7,), (3, 4, 5)])
def test_any_rows_and_columns_equal_the_slice_of_the_whole(shape):
    rule = InitRule("normal", 0.5)
    full = fill_(torch.empty(shape), rule, 123, "w", shape)
    assert full.std() > 0.3
    n = shape[0]
    rows = torch.tensor(sorted({0, n - 1, n // 2, n // 3, min(n - 1, rows_per_block(shape))}) + [n, n + 3])  # + padding
    part = fill_(torch.empty(len(rows), *shape[1:]), rule, 123, "w", shape, rows=rows)
    padded = torch.cat([full, full.new_zeros(4, *shape[1:])])
    assert torch.equal(part, padded[rows])
    if len(shape) == 2:
        cols = fill_(torch.empty(n, 2), rule, 123, "w", shape, cols=slice(1, 3))
        assert torch.equal(cols, full[:, 1:3])


def test_seed_and_name_decide_the_values():
    rule = InitRule("normal", 1.0)
    a = fill_(torch.empty(10, 10), rule, 1, "a", (10, 10))
    assert torch.equal(a, fill_(torch.empty(10, 10), rule, 1, "a", (10, 10)))
    assert not torch.equal(a, fill_(torch.empty(10, 10), rule, 2, "a", (10, 10)))
    assert not torch.equal(a, fill_(torch.empty(10, 10), rule, 1, "b", (10, 10)))


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_meta_build_in_one_process_equals_the_whole_build(model):
    whole = _whole(model)
    torch.manual_seed(SEED)
    built = build_model(_config(model), ParallelDims(), spec=get_spec(_config(model).model.family)).model
    assert all(not p.is_meta for p in built.parameters())
    for name, p in built.named_parameters():
        assert torch.equal(p, whole[name]), name
    if SHAPES[model].get("position") == "rope":
        torch.testing.assert_close(built.rope_cos, GPT(_config(model).model).rope_cos)


def _slice(module, attr: str, full: torch.Tensor) -> torch.Tensor:
    rows, cols = module.shard_index(attr) if isinstance(module, Sharded) else (None, None)
    if rows is not None:
        full = torch.cat([full, full.new_zeros(int(rows.max()) + 1, *full.shape[1:])])[rows]
    return full[:, cols] if cols is not None else full


@pytest.mark.parametrize("model,tp,pp", [("gpt", 2, 1), ("gpt", 4, 1), ("llama", 4, 1), ("gpt", 1, 2),
                                         ("llama", 2, 2)])
def test_every_rank_shards_equal_the_slices_of_the_whole(model, tp, pp):
    """Each rank of a planned tp × pp layout (no process group needed to build) allocates only its shards,
    and they hold the whole model's values: tp=N starts bit-identical to tp=1 without the whole model."""
    whole = _whole(model)
    held = 0
    for rank in range(tp * pp):
        torch.manual_seed(SEED)
        dims = ParallelDims(pp=pp, dp=1, tp=tp, rank=rank)
        cfg = _config(model, tp=tp, pp=pp)
        model_part = build_model(cfg, dims, spec=get_spec(cfg.model.family)).model if pp == 1 else _cut_only(cfg, dims)
        for name, p in model_part.named_parameters():
            prefix, _, attr = name.rpartition(".")
            want = _slice(model_part.get_submodule(prefix), attr, whole[name])
            assert torch.equal(p, want), (rank, name)
            held += p.numel()
    assert held >= sum(p.numel() for p in whole.values())  # every element is somewhere (replicas counted twice)


def _cut_only(cfg, dims):
    """The tp + pp cut and materialisation without the schedule (which needs a process group)."""
    from meshlm.families.registry import get_spec
    from meshlm.parallel.materialize import materialize
    from meshlm.parallel.pipeline import cut_stages
    from meshlm.parallel.tensor import apply_tensor_parallel

    spec = get_spec("gpt")
    with torch.device("meta"):
        model = GPT(cfg.model)
    apply_tensor_parallel(model, dims, sp=False, spec=spec)
    cut_stages(model, spec, cfg, dims.pp_rank, fused=False)
    assert all(p.is_meta for p in model.parameters())
    return materialize(model, spec, torch.device("cpu"))
