"""The ring attention (parallel/context.py) with values of another width than the keys and a given softmax
scale, as multi-head latent attention needs (d_v against d_n + d_r; 1/√(d_n + d_r) · mscale²): output and the
gradients of q, k and v equal a hand-written masked softmax over the whole row, in float64, for a ring of one and
a ring of two (grouped-query heads, packed documents, values narrower and wider than the keys)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_world import run_world

from meshlm.parallel.context import ring_attention, shard_sequence

B, T, D = 2, 16, 8
SCALE = 0.29  # neither 1/√D nor 1/√d_v
CASES = [(4, 2, 6, False), (4, 1, 10, True), (2, 2, 12, True)]  # (query heads, KV heads, value width, documents)


def _inputs(nh: int, nkv: int, dv: int, segmented: bool):
    g = torch.Generator().manual_seed(nh * 100 + nkv * 10 + dv + segmented)
    q = torch.randn(B, nh, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, nkv, T, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, nkv, T, dv, generator=g, dtype=torch.float64)
    w = torch.randn(B, nh, T, dv, generator=g, dtype=torch.float64)  # the loss is sum(out · w)
    seg = torch.cumsum(torch.rand(B, T, generator=g) < 0.25, dim=1) if segmented else None
    return q, k, v, w, seg


def _reference(q, k, v, w, seg):
    """softmax(q kᵀ · SCALE, causal and per document) v, keys and values repeated over each KV head's group."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, :, None] == seg[:, None, :])[:, None]
    scores = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * SCALE
    out = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.repeat_interleave(g, dim=1)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _ring(case, group, cp: int, rank: int):
    q, k, v, w, seg = _inputs(*case)
    want = [shard_sequence(t, cp, rank, dim=2) for t in _reference(q, k, v, w, seg)]
    part = lambda t: shard_sequence(t, cp, rank, dim=2)
    q, k, v = (part(t).clone().requires_grad_() for t in (q, k, v))
    segments = None if seg is None else shard_sequence(seg, cp, rank, dim=1)
    out = ring_attention(q, k, v, group, segments=segments, scale=SCALE)
    (out * part(w)).sum().backward()
    return [float((a - b).abs().max()) for a, b in zip((out.detach(), q.grad, k.grad, v.grad), want)]


def _world(rank: int, world: int, out_dir: str) -> dict:
    return {case: _ring(case, dist.group.WORLD, world, rank) for case in CASES}


def test_ring_of_two_with_other_value_width_and_scale_equals_full_attention(tmp_path):
    for result in run_world(_world, 2, tmp_path):
        assert sorted(result) == sorted(CASES)
        for case, errors in result.items():
            assert max(errors) < 1e-12, (case, errors)  # output, dq, dk, dv


@pytest.mark.parametrize("case", CASES)
def test_ring_of_one_with_other_value_width_is_causal_attention(case):
    assert max(_ring(case, None, 1, 0)) < 1e-12


def test_keys_of_another_width_than_the_queries_are_refused():
    q, k, v = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 6), torch.zeros(1, 2, 4, 6)
    with pytest.raises(ValueError, match="keys' width"):
        ring_attention(q, k, v, None)
