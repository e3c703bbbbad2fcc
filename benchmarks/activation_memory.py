"""Activation memory per transformer layer, measured against our formula, for tp × sp × recompute; and
the throughput cost of recomputation on CPU, in the same run.

Measured: the bytes autograd saves for backward in each layer during one training forward (loss
included) on rank 0, counted by `meshlm.models.activations` (saved_tensors_hooks, each storage once,
parameters excluded). Formula: `meshlm.core.memory.layer_activation_bytes`, derived term by term in
docs/memory.md for what our code saves. Beside them, Korthikanti et al. 2022's Table 2 for the same shape
(16-bit, 1-byte masks, the shard kept by SP's linears): the GPU accounting ours departs from.
Exits 1 if any measured value is off the formula by more than 5%.

Throughput: tokens/s of full training steps (forward, backward, AdamW) at tp=1 with each recompute mode,
interleaved rounds, median; next to it the FLOP overhead recomputation adds (HFU / MFU − 1).

    .venv/bin/python benchmarks/activation_memory.py                  # GPT, dropout 0.1 (math SDPA on CPU)
    .venv/bin/python benchmarks/activation_memory.py --arch llama --dropout 0   # flash SDPA, no s×s scores
    .venv/bin/python benchmarks/activation_memory.py --smoke          # a tiny shape at t = 1, 2: that it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script
from world import run_world  # benchmarks/world.py, beside this script

from meshlm.core.config import Config, build
from meshlm.core.flops import model_flops, recompute_flops
from meshlm.core.layout import recomputed_layers
from meshlm.core.memory import korthikanti_bytes, layer_activation_bytes
from meshlm.families.registry import spec_of
from meshlm.models.activations import measure_model_activations
from meshlm.models.gpt import GPT
from meshlm.parallel import TPRNGTracker, parallelize
from meshlm.parallel.mesh import ParallelDims

MODES = ("none", "selective", "full")
TOLERANCE = 0.05
LLAMA = {"n_kv_heads": 2, "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False}


def make_config(args: argparse.Namespace, tp: int, sp: bool, recompute: str) -> Config:
    model = {"vocab_size": args.vocab, "n_layers": args.layers, "hidden_size": args.hidden, "n_heads": args.heads,
             "seq_len": args.seq, "dropout": args.dropout, **(LLAMA if args.arch == "llama" else {})}
    if args.arch == "llama":
        model["n_kv_heads"] = max(1, args.heads // 2)
    train = {"micro_batch_size": args.batch, "global_batch_size": args.batch, "recompute": recompute,
             "precision": args.precision}
    return build({"model": model, "train": train, "parallel": {"tp": tp, "sp": sp}})


def measure_layout(args: argparse.Namespace, dims: ParallelDims) -> list[tuple]:
    """(sp, recompute, measured bytes per layer, formula bytes per layer) for this layout, rank 0's view."""
    rows = []
    for sp in ((False, True) if dims.tp > 1 else (False,)):
        for recompute in MODES:
            cfg = make_config(args, dims.tp, sp, recompute)
            torch.manual_seed(0)
            model = GPT(cfg.model)
            rng = TPRNGTracker(0, dims.tp_rank)
            loss_fn = parallelize(model, dims, cfg, rng=rng, spec=spec_of(model)).loss_fn
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
            report = measure_model_activations(model, loss_fn, args.batch, args.seq, args.vocab, autocast, rng)
            formula = sum(layer_activation_bytes(cfg)) / args.layers
            rows.append((sp, recompute, report.layers_total / args.layers, formula))
    return rows


def _measure_tp(args: argparse.Namespace, world: int) -> list[tuple]:
    return measure_layout(args, ParallelDims.build(tp=world, timeout_s=120))


def measure(tp: int, args: argparse.Namespace) -> list[tuple]:
    if tp == 1:
        return measure_layout(args, ParallelDims())
    return run_world(tp, _measure_tp, args)


def throughput(args: argparse.Namespace) -> dict[str, list[float]]:
    """tokens/s per recompute mode at tp=1: `rounds` interleaved rounds of `steps` timed steps each."""
    setups = {}
    for recompute in MODES:
        cfg = make_config(args, 1, False, recompute)
        torch.manual_seed(0)
        model = GPT(cfg.model)
        loss_fn = parallelize(model, ParallelDims(), cfg, spec=spec_of(model)).loss_fn
        setups[recompute] = (model, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-4))
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def step(model, loss_fn, opt):
        with autocast:
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rates = {m: [] for m in MODES}
    for setup in setups.values():  # warm-up
        step(*setup)
    for _ in range(args.rounds):
        for recompute, setup in setups.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(*setup)
            rates[recompute].append(args.steps * args.batch * args.seq / (time.perf_counter() - start))
    shares = [_time_shares(setups["none"], step) for _ in range(args.rounds)]
    rates["core_share"], rates["forward_share"] = [c for c, _ in shares], [f for _, f in shares]
    return rates


def _time_shares(setup, step) -> tuple[float, float]:
    """Shares of one `none` training step's time spent in the attention core's forward (what selective
    recomputation adds, at most: early stop skips its last matmul) and in the model's forward (what full
    recomputation adds). CPU runs synchronously, so wall-clock timers around the calls are exact."""
    model = setup[0]
    spent = {"core": 0.0, "forward": 0.0}
    originals = [layer.attn.core for layer in model.layers]

    def timed(fn, key):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[key] += time.perf_counter() - start
            return out
        return run

    for layer, core in zip(model.layers, originals):
        layer.attn.core = timed(core, "core")
    model.forward = timed(model.forward, "forward")
    start = time.perf_counter()
    step(*setup)
    total = time.perf_counter() - start
    del model.forward  # back to the class's forward
    for layer, core in zip(model.layers, originals):
        layer.attn.core = core
    return spent["core"] / total, spent["forward"] / total


def _fmt(n: float) -> str:
    return f"{n / 2 ** 20:,.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:,.1f} KiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (0: skip throughput)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the throughput part (1 is the "
                        "least disturbed by other processes on a shared CPU)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # still held to the formula: a tiny shape measures the same terms
        args.tp, args.batch, args.seq, args.hidden, args.heads, args.layers, args.vocab = [1, 2], 1, 16, 32, 4, 1, 64
        args.steps, args.rounds = 1, 1
    cfg = make_config(args, 1, False, "none")
    m = cfg.model
    print(f"{args.arch}: b={args.batch} s={args.seq} h={args.hidden} a={args.heads} g={m.kv_heads} f={m.ffn_size}, "
          f"{args.layers} layers, dropout {args.dropout}, {args.precision} on CPU "
          f"(SDPA {'math' if args.dropout > 0 else 'flash'} backend), torch {torch.__version__}; "
          "bytes saved for backward per transformer layer on rank 0, one micro-batch\n")
    print("| t | SP | recompute | measured / layer | formula / layer | measured / formula | "
          "Korthikanti Table 2 (16-bit) | reduction vs t=1, none (measured) | (paper) |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst, base, rows = 0.0, None, {}
    for tp in args.tp:
        for sp, recompute, got, want in measure(tp, args):
            paper = korthikanti_bytes(args.seq, args.batch, args.hidden, args.heads, tp, sp, recompute)
            base = base or (got, paper)
            ratio = got / want
            worst = max(worst, abs(ratio - 1))
            rows[(tp, sp, recompute)] = got
            print(f"| {tp} | {'on' if sp else 'off'} | {recompute} | {got:,.0f} ({_fmt(got)}) | {want:,.0f} | "
                  f"{ratio:.3f} | {paper:,.0f} | {base[0] / got:.2f}× | {base[1] / paper:.2f}× |")
    print(f"\nworst |measured / formula − 1| = {worst:.4f} (tolerance {TOLERANCE})")
    shape = (args.seq, args.batch, args.hidden, args.heads)
    for tp in args.tp:
        if tp > 1 and (tp, True, "selective") in rows:
            paper = korthikanti_bytes(*shape) / korthikanti_bytes(*shape, tp, True, "selective")
            print(f"TP+SP+selective at t={tp}: {rows[(1, False, 'none')] / rows[(tp, True, 'selective')]:.2f}× less "
                  f"than no parallelism (measured); the paper's 16-bit accounting predicts {paper:.2f}×")
    if args.steps:
        torch.set_num_threads(args.threads)
        rates = throughput(args)
        flops = model_flops(m, args.batch)
        print(f"\nthroughput at t=1 ({torch.get_num_threads()} threads, {args.rounds} interleaved rounds of "
              f"{args.steps} steps; on a shared CPU the best round is the least disturbed):\n")
        print("| recompute | tokens/s, best round | median | slowdown vs none (best) | slowdown (median of "
              "per-round ratios) | FLOP overhead (HFU/MFU − 1) |")
        print("|---|---|---|---|---|---|")
        best_none = max(rates["none"])
        for recompute in MODES:
            cfg = make_config(args, 1, False, recompute)
            extra = recompute_flops(m, args.batch, recompute, layers=recomputed_layers(cfg)) / flops
            paired = statistics.median(n / r - 1 for n, r in zip(rates["none"], rates[recompute]))
            print(f"| {recompute} | {max(rates[recompute]):,.0f} | {statistics.median(rates[recompute]):,.0f} | "
                  f"{100 * (best_none / max(rates[recompute]) - 1):+.1f}% | {100 * paired:+.1f}% | "
                  f"{100 * extra:+.1f}% |")
        print(f"\nshares of a `none` training step's time (median): the attention core's forward "
              f"{100 * statistics.median(rates['core_share']):.1f}% (what selective recomputation adds, at most), "
              f"the model's forward {100 * statistics.median(rates['forward_share']):.1f}% (what full adds, at most: "
              "it redoes the layers, not the head)")
    if worst > TOLERANCE:
        print(f"FAIL: a measured value is off the formula by {100 * worst:.1f}% (> {100 * TOLERANCE:.0f}%)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
