"""Decoding rows' attention over the paged pool: read in place by meshlm's kernel (`models/native.py`) against
the gathering path it replaces (each row's blocks copied out of the pool, then PyTorch's kernel, or
`masked_attention`, by the rules of `PagedCache.attend_16bit`), both through `PagedCache.attend` as the engine
calls it.

Shapes: SmolLM2-135M's heads (9 query heads over 3 KV heads of 64) and the demo model's (4 over 4 of 64); R rows
of one query each, row lengths drawn from [L/2, L], each row's blocks scattered over a pool of 64 rows × 1,024
positions (as `meshlm serve --max-seqs 64 --max-len 1024` allocates), fp32 and bf16 pools. Each cell: the best
of 5 timings of `--repeats` calls, wall time, `--threads` torch threads (the kernel's OpenMP region takes as
many). "max diff" is between the two paths' outputs (fp32: rounding; bf16: one bf16 rounding of the output).

    .venv/bin/python benchmarks/paged_decode.py
    .venv/bin/python benchmarks/paged_decode.py --smoke
Run it alone.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS = {"smollm2": (576, 9, 3), "demo": (256, 4, 4)}  # hidden, query heads, KV heads (head width 64)


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def setup(heads: str, dtype, rows: int, length: int, block_size: int = 16, pool_rows: int = 64,
          pool_len: int = 1024, seed: int = 0):
    """A one-layer model of `heads`' attention shape, its pool, and a step of `rows` decoding rows: (the layer's
    cache view, the group, the queries, the core)."""
    import torch

    from meshlm.core.config import ModelConfig
    from meshlm.core.precision import cast_parameters
    from meshlm.models.gpt import GPT
    from meshlm.models.paged import Batch, PagedKV

    hidden, nh, nkv = HEADS[heads]
    cfg = ModelConfig(n_layers=1, hidden_size=hidden, n_heads=nh, n_kv_heads=nkv, seq_len=pool_len, vocab_size=64,
                      position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    model = GPT(cfg).eval()
    if dtype == torch.bfloat16:
        model = cast_parameters(model, "bf16")
    blocks = pool_rows * pool_len // block_size
    kv = PagedKV(model, blocks, block_size)
    g = torch.Generator().manual_seed(seed)
    for t in kv.layers[0][:2]:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    rnd = random.Random(seed)
    order = list(range(blocks))
    rnd.shuffle(order)
    plan = []
    for n in sorted(rnd.randint(length // 2, length) for _ in range(rows)):  # shortest first, as the scheduler
        table = tuple(order.pop() for _ in range(-(-n // block_size)))
        plan.append((range(n - 1, n), table))
    batch = Batch(plan, block_size, "cpu", group_max=16)
    cache = kv.caches(batch)[0]
    q = torch.randn(rows, nh, 1, 64, generator=g).to(dtype)
    return cache, batch.groups, q, model.layers[0].attn.core


def attend_all(cache, groups, q, core):
    import torch

    return torch.cat([cache.attend(q[g.start:g.start + g.rows], g, core) for g in groups])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x128,1x600,16x224,16x640,64x224,64x320",
                        help="rows x longest row's positions, comma-separated")
    parser.add_argument("--models", default="smollm2,demo")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.models, args.repeats = "2x40", "demo", 2

    import torch

    from meshlm.core.precision import cpu_bf16_support
    from meshlm.models import native

    torch.set_num_threads(args.threads)
    if native.paged_decode() is None:
        sys.exit(f"the in-place kernel is not available here: {native.unavailable()}")
    print(f"torch {torch.__version__}, {args.threads} threads, bf16 support: {cpu_bf16_support() or 'none'}")
    print("| heads | dtype | rows × positions | gathering path, ms | in place, ms | gathering / in place | max diff |")
    print("|---|---|---|---:|---:|---:|---:|")
    supports = native.supports
    for heads in args.models.split(","):
        for name in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            for shape in args.shapes.split(","):
                rows, length = (int(x) for x in shape.split("x"))
                step = setup(heads, dtype, rows, length)
                with torch.no_grad():
                    placed = attend_all(*step)
                    in_place = best_ms(lambda step=step: attend_all(*step), args.repeats)
                    native.supports = lambda q, pool: False
                    try:
                        gathered = attend_all(*step)
                        gathering = best_ms(lambda step=step: attend_all(*step), args.repeats)
                    finally:
                        native.supports = supports
                diff = (placed.float() - gathered.float()).abs().max().item()
                print(f"| {heads} | {name} | {rows} × {length} | {gathering:.3f} | {in_place:.3f} | "
                      f"{gathering / in_place:.2f}× | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
