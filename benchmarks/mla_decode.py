"""MLA decoding over a latent cache: the absorbed form (what the engine runs, models/mla.py) against up-projecting
the cached latents to per-head keys and values every step (the other way to read the same cache).

One decode step of one layer for `--rows` sequences of `--context` cached positions, fp32 on the CPU, from the
same cache of normalised latents ĉ (r) and RoPE keys k_r (d_r) per position:
- absorbed: q_lat = W_ukᵀ q_n per head, scores [q_lat; q_r]·[ĉ; k_r] (one shared key of r + d_r), output W_uv (Σ p ĉ),
  the heads folded into the queries of one head (as the engine runs it), and through SDPA's `enable_gqa`;
- up-projected: [k_n; v] = W_ukv ĉ for every cached position of every row (n·(d_n + d_v) per position), then
  plain attention over n heads of d_n + d_r.
Both are checked equal (max difference printed) before timing; median of `--repeats` interleaved runs.
Shapes default to DeepSeek-V3's per-head widths (d_n 128, d_r 64, d_v 128, r 512) at 16 heads (a tp=8 rank).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla_decode.py                       # 8 rows × 1,024 positions
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mla_decode.py --context 4096 --rows 2
    .venv/bin/python benchmarks/mla_decode.py --smoke                                    # that it runs
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script


def absorbed(q_n, q_r, latent, k_r, w_uk, w_uv, scale, gqa=False):
    """q_n (B, n, 1, d_n), q_r (B, n, 1, d_r), latent (B, 1, L, r), k_r (B, 1, L, d_r) → (B, n, 1, d_v)."""
    B, n, _, _ = q_n.shape
    q = torch.cat((torch.matmul(q_n, w_uk), q_r), dim=-1)  # (B, n, 1, r + d_r)
    key = torch.cat((latent, k_r), dim=-1)  # (B, 1, L, r + d_r)
    if gqa:  # SDPA's grouped-query path over one KV head
        y = F.scaled_dot_product_attention(q, key, latent, scale=scale, enable_gqa=True)  # (B, n, 1, r)
    else:  # the heads as n queries of one head (MultiHeadLatentAttention.latent_core)
        y = F.scaled_dot_product_attention(q.reshape(B, 1, n, -1), key, latent, scale=scale).view(B, n, 1, -1)
    return torch.matmul(y, w_uv.transpose(1, 2))


def up_projected(q_n, q_r, latent, k_r, w_uk, w_uv, scale):
    """The same step with the latents of every cached position up-projected to per-head keys and values."""
    B, n, _, _ = q_n.shape
    L = latent.shape[2]
    k_n = torch.matmul(latent, w_uk.transpose(1, 2))  # (B, n, L, d_n)
    v = torch.matmul(latent, w_uv.transpose(1, 2))  # (B, n, L, d_v)
    k = torch.cat((k_n, k_r.expand(B, n, L, k_r.shape[-1])), dim=-1)
    return F.scaled_dot_product_attention(torch.cat((q_n, q_r), dim=-1), k, v, scale=scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    add_smoke_flag(p)
    a = p.parse_args()
    if a.smoke:  # a tiny step, once: that it runs
        a.rows, a.context, a.heads, a.repeats = 2, 64, 4, 1
    n, d_n, d_r, d_v, r = a.heads, 128, 64, 128, 512
    g = torch.Generator().manual_seed(0)
    q_n, q_r = torch.randn(a.rows, n, 1, d_n, generator=g), torch.randn(a.rows, n, 1, d_r, generator=g)
    latent, k_r = torch.randn(a.rows, 1, a.context, r, generator=g), torch.randn(a.rows, 1, a.context, d_r, generator=g)
    w_uk, w_uv = torch.randn(n, d_n, r, generator=g) * r ** -0.5, torch.randn(n, d_v, r, generator=g) * r ** -0.5
    args = (q_n, q_r, latent, k_r, w_uk, w_uv, (d_n + d_r) ** -0.5)
    diff = (absorbed(*args) - up_projected(*args)).abs().max().item()
    forms = (("absorbed", absorbed), ("absorbed, SDPA gqa", lambda *x: absorbed(*x, gqa=True)),
             ("up-projected", up_projected))
    times: dict[str, list[float]] = {name: [] for name, _ in forms}
    for _ in range(a.repeats):
        for name, fn in forms:
            t0 = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - t0)
    cache = a.rows * a.context * (r + d_r) * 4
    print(f"MLA decode step, {a.rows} rows × {a.context} positions, {n} heads (d_n {d_n}, d_r {d_r}, d_v {d_v}, "
          f"r {r}), fp32, {torch.get_num_threads()} thread(s); the latent cache {cache / 2 ** 20:.1f} MiB; "
          f"max |difference| {diff:.1e}\n")
    print("| form | ms per step (median) |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
