"""The cost of packed-document masking (`data.document_mask`): one training step's forward + backward with
positions and segments (SDPA with a boolean (B, 1, T, T) mask) against the plain causal one (`is_causal`).

    python benchmarks/document_mask.py [--steps 10] [--lengths 256,1024] [--device cpu]
    python benchmarks/document_mask.py --smoke     # one timed step of 512 tokens at length 256

A small GPT (4 layers of width 128, 4 heads, RoPE, vocabulary 4,096 so that attention is a visible share of
the step), fp32, 4096 tokens a step (B = 4096 / T rows), rows of random tokens with an end-of-document token
every ~100 tokens. The two variants are timed alternately step by step in one process after two warm-up
steps (so both see the same machine load); the table gives the median milliseconds a step and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

from meshlm.core.config import ModelConfig
from meshlm.data.documents import document_positions
from meshlm.models.gpt import GPT

EOD = 4095


def _step(model: GPT, x: torch.Tensor, y: torch.Tensor, kw: dict) -> float:
    began = time.perf_counter()
    loss = model(x, targets=y, **kw)
    loss.backward()
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - began


def measure(T: int, steps: int, device: str, tokens: int = 4096) -> tuple[float, float]:
    cfg = ModelConfig(vocab_size=4096, n_layers=4, hidden_size=128, n_heads=4, seq_len=T, position="rope",
                      norm="rmsnorm", activation="swiglu", bias=False)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    B = max(1, tokens // T)
    rows = torch.randint(0, EOD, (B, T + 1), generator=g)
    rows[torch.rand(B, T + 1, generator=g) < 0.01] = EOD
    x, y = rows[:, :-1].to(device), rows[:, 1:].to(device)
    positions, segments = document_positions(x, EOD)
    variants = {"causal": {}, "documents": {"positions": positions, "segments": segments}}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(steps + 2):
        for name, kw in variants.items():
            t = _step(model, x, y, kw)
            if i >= 2:
                times[name].append(t)
    return statistics.median(times["causal"]) * 1e3, statistics.median(times["documents"]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lengths", default="256,1024")
    p.add_argument("--device", default="cpu")
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.lengths = 1, "256"
    tokens = 512 if args.smoke else 4096
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print("| seq | rows | causal ms/step | documents ms/step | ratio |\n|---|---|---|---|---|")
    for T in (int(s) for s in args.lengths.split(",")):
        plain, docs = measure(T, args.steps, args.device, tokens)
        print(f"| {T} | {max(1, tokens // T)} | {plain:.1f} | {docs:.1f} | {docs / plain:.2f} |")


if __name__ == "__main__":
    main()
