"""Decode-shaped attention on this CPU: PyTorch's `scaled_dot_product_attention` against meshlm's
`models.paged.masked_attention` (the path 16-bit decoding rows take), in fp32 and bf16; in bf16 also the kernel
on fp32 copies of its inputs (the result cast back).

Shapes as the paged engine hands them to attention for decoding rows: R rows of one query each, SmolLM2's 9 query
heads over 3 KV heads of 64, L keys per row (gathered blocks), a per-row mask of each row's length. Each cell is
the best of 3 timings of `--repeats` calls in this thread's CPU time (one torch thread: the calls run in it, and
another job's turns on the core do not count), the fastest of the path columns in bold; "max diff" is between
the kernel's and masked_attention's outputs.

    .venv/bin/python benchmarks/attention_kernels.py
    .venv/bin/python benchmarks/attention_kernels.py --smoke
Run it alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.thread_time() - start) / repeats)
    return best * 1e3


def calls(q, k, v, mask, scale):
    """(PyTorch's kernel, the kernel on fp32 copies (cast back), masked_attention) on these inputs, as calls
    without arguments."""
    import torch.nn.functional as F

    from meshlm.models.paged import masked_attention

    def widened():
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True,
                                           scale=scale)
        return y.to(q.dtype)

    return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale),
            widened, lambda: masked_attention(q, k, v, mask, scale))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x96,16x96,16x512,64x200", help="rows x keys, comma-separated")
    parser.add_argument("--repeats", type=int, default=100)
    add_smoke_flag(parser)
    args = parser.parse_args()
    import torch

    from meshlm.core.precision import cpu_bf16_support

    if args.smoke:
        args.shapes, args.repeats = "2x16", 2
    torch.set_num_threads(1)
    nh, nkv, hd = 9, 3, 64
    print(f"native bf16: {cpu_bf16_support() or 'none'}; 1 thread; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| rows × keys | dtype | SDPA ms | SDPA on fp32 copies ms | masked_attention ms | SDPA / masked | max diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        R, L = map(int, shape.split("x"))
        lengths = torch.randint(L // 2, L + 1, (R,), generator=g)
        mask = (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(R, nh, 1, hd, generator=g).to(dtype)
            k, v = (torch.randn(R, nkv, L, hd, generator=g).to(dtype) for _ in range(2))
            with torch.no_grad():
                kernel, widened, mine = calls(q, k, v, mask, hd ** -0.5)
                sdpa_ms, mine_ms = best_ms(kernel, args.repeats), best_ms(mine, args.repeats)
                wide_ms = best_ms(widened, args.repeats) if dtype != torch.float32 else float("nan")
                diff = (kernel().float() - mine().float()).abs().max().item()
            cells = [f"{x:.3f}" for x in (sdpa_ms, wide_ms, mine_ms)]
            fastest = min(range(3), key=lambda i: (sdpa_ms, wide_ms, mine_ms)[i] if cells[i] != "nan" else 1e9)
            cells[fastest] = f"**{cells[fastest]}**"
            print(f"| {R} × {L} | {str(dtype).removeprefix('torch.')} | {' | '.join(cells)} | {sdpa_ms / mine_ms:.2f}× | "
                  f"{diff:.1e} |")


if __name__ == "__main__":
    main()
