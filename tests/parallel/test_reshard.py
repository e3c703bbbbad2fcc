"""The resharding checkpoint format itself (meshlm/checkpoint/sharded.py): logical tensors, the pieces a
local range maps to, and atomic publishing when a rank fails or dies while writing.

Resuming across layouts end to end is tested in test_data_parallel.py (spawned worlds) and
test_data_parallel_trainer.py (torchrun).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import dp_harness as H
import pytest
import torch
from parallel_world import run_world

from meshlm.checkpoint import sharded
from meshlm.checkpoint.files import checkpoints_dir
from meshlm.checkpoint.single import load_model_state, resolve_checkpoint
from meshlm.families.registry import get_spec
from meshlm.models.gpt import GPT

GPT_SPEC = get_spec("gpt")  # every run here is of the gpt family (its pieces need the spec)

@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_logical_tensors_split_fused_weights_and_fuse_back(model):
    cfg = H.config(model).model
    torch.manual_seed(0)
    state = GPT(cfg).state_dict()
    spec = get_spec(cfg.family)
    logical = sharded.split_plain(state, cfg, spec=spec)
    shapes = sharded.logical_shapes(cfg, spec=spec)
    assert {k: (v.shape[0], *(() if v.shape[1] == 1 and len(shapes[k]) == 1 else (v.shape[1],)))
            for k, v in logical.items()} == shapes
    assert "layers.0.attn.k.weight" in shapes and "layers.0.attn.qkv.weight" not in shapes
    assert shapes["layers.0.attn.k.weight"][0] == cfg.kv_heads * cfg.head_dim
    assert ("layers.0.mlp.gate.weight" in shapes) == (model == "llama")
    assert ("lm_head.weight" in shapes) == (not cfg.tie_embeddings), "a tied LM head is the embedding, once"
    back = sharded.fuse_logical(logical, cfg, spec=spec)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_pieces_of_any_flat_ranges_cover_a_tensor_once():
    """ZeRO shards start and end anywhere: the boxes of consecutive ranges tile the logical tensors."""
    cfg = H.config("llama").model
    model = GPT(cfg)
    name, p = "layers.1.attn.qkv.weight", model.layers[1].attn.qkv.weight
    segments = sharded.param_segments(model, name, tuple(p.shape), tp_rank=0, spec=get_spec(cfg.family))
    assert [s.name for s in segments] == [f"layers.1.attn.{x}.weight" for x in "qkv"]
    seen = {s.name: torch.zeros(s.rows, p.shape[1], dtype=torch.int64) for s in segments}
    cuts = [0, 5, 33, 34, 32 * 17 + 3, 32 * 40, p.numel()]
    flat = torch.arange(p.numel())
    for lo, hi in itertools.pairwise(cuts):
        for seg, (row, col, n, w), off in sharded.pieces(segments, tuple(p.shape), lo, hi):
            seen[seg.name][row:row + n, col:col + w] += 1
            local = flat[lo + off:lo + off + n * w].view(n, w)
            first = (seg.local_row + row - seg.row) * p.shape[1] + col
            assert int(local[0, 0]) == first, "a box's values come from the rows and columns it names"
    assert all(bool((v == 1).all()) for v in seen.values())


def _failing_worker(rank: int, world: int, out_dir: str) -> dict:
    """Save step 1 on both ranks; then rank 1 fails (an exception), then dies (os._exit) while writing."""
    from safetensors import torch as st

    root = Path(out_dir).parent / "run"
    cfg = H.config(dp=2, zero=1)
    run = H.build_run(cfg, H.dims_for(dp=2))
    H.step(run)
    H.save(run, root, cfg.to_dict())
    out = {"first": resolve_checkpoint(root).name}
    real = st.save  # the shard's bytes (sharded.py writes them through files.py's checksumming writer)

    def broken(tensors, **kw):
        raise OSError("disk full (injected)")

    H.step(run)
    if rank == 1:
        st.save = broken
    try:
        H.save(run, root, cfg.to_dict())
    except Exception as err:  # noqa: BLE001 (what each rank saw)
        out["failed"] = f"{type(err).__name__}: {err}"
    finally:
        st.save = real
    out["after_failure"] = resolve_checkpoint(root).name
    H.step(run)
    if rank == 1:
        def dying(tensors, **kw):
            torch.save({**out, "died": True}, Path(out_dir) / "result_1.pt")
            os._exit(0)  # a SIGKILL-like death, mid-checkpoint, without tearing anything down

        st.save = dying
    try:
        H.save(run, root, cfg.to_dict())
        out["killed"] = "published"
    except Exception as err:  # noqa: BLE001
        out["killed"] = f"{type(err).__name__}"
    out["after_kill"] = resolve_checkpoint(root).name
    out["temporaries"] = sorted(p.name.split("-")[1] for p in checkpoints_dir(root).glob(".tmp-*"))
    # The world is broken by design (rank 1 is gone): tearing down its process group can abort inside gloo
    # ("terminate called without an active exception"), so rank 0 reports and leaves the same way rank 1 did.
    torch.save(out, Path(out_dir) / f"result_{rank}.pt")
    os._exit(0)


def test_a_failed_or_dead_rank_never_moves_latest(tmp_path):
    results = run_world(_failing_worker, 2, tmp_path / "world", deadline_s=150)
    rank0 = results[0]
    assert rank0["first"] == "step_0000001"
    assert "CheckpointWriteError" in rank0["failed"], "rank 0 learns that rank 1 failed"
    assert "disk full" in results[1]["failed"], "the failing rank raises its own error"
    assert rank0["after_failure"] == "step_0000001", "nothing was published"
    assert rank0["killed"] != "published", "rank 1 died while writing: rank 0 must not publish"
    assert rank0["after_kill"] == "step_0000001"
    assert rank0["temporaries"] == ["step_0000003"], "a failed write is cleaned up; a death's leftovers stay aside"
    state = load_model_state(resolve_checkpoint(tmp_path / "run"), spec=GPT_SPEC)
    assert state.keys() == GPT(H.config().model).state_dict().keys(), "latest still loads whole"
