"""bf16 training throughput on one GPU through meshlm's real Trainer: SDPA flash vs math, fused vs foreach
AdamW, torch.compile on vs off.

    PYTHONPATH=. python benchmarks/gpu_train.py                 # gpt2-1.3b, micro-batch 8 × 2048, on the GPU
    PYTHONPATH=. python benchmarks/gpu_train.py --micro-batch 8 --variants flash,compile
    python benchmarks/gpu_train.py --smoke                      # a tiny shape on any device (CPU test)

One `Trainer` is built (model on the meta device, materialised on the GPU, the trainer's loader, precision
and optimizer) and each variant changes only what it compares, as the trainer itself sets it up:
`trainer.optimizer` rebuilt by `build_optimizer(..., fused=)`, `trainer.forward = torch.compile(model)`
(what `train.compile=true` does), and the SDPA backend pinned by `torch.nn.attention.sdpa_kernel` around
the steps. Every step is the trainer's `train_step` (loader, LR, autocast, backward, clip, AdamW step,
two host reads of loss and norm). As in benchmarks/train_step.py: warm-up steps, then each timed step on
its own (the step ends with a host read, so wall time is GPU time), the median reported: tokens/s, model
TFLOP/s (Megatron's formula, `ModelSpec.flops`), MFU against the datasheet peak, HFU (with the forward that
`train.recompute` redoes; equal to MFU without it) and `torch.cuda.max_memory_allocated` per variant.

Without the asset packages (an offline GPU box) it trains on a synthetic corpus (meshlm/data/synthetic.py):
throughput does not depend on the text.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from meshlm.core.config import Config, load_config
from meshlm.core.layout import recomputed_layers
from meshlm.core.memory import layer_activation_bytes
from meshlm.data.synthetic import assets_present, synthetic_overrides
from meshlm.train.metrics import measure_peak_tflops
from meshlm.train.optim import build_optimizer
from meshlm.train.trainer import Trainer

# NVIDIA H200 (SXM) datasheet: BF16 Tensor Core 1,979 TFLOP/s "with sparsity", i.e. 989 TFLOP/s dense, no
# sparsity. The H200 NVL (1,671 with sparsity, 835 dense) and other GPUs: pass --peak-tflops, else it is measured.
H200_BF16_DENSE_TFLOPS = 989.0


SMOKE = ["--model.n_layers=2", "--model.hidden_size=64", "--model.n_heads=4", "--model.seq_len=64"]


@dataclass(frozen=True)
class Variant:
    name: str
    sdpa: str  # flash | math | auto (PyTorch's own choice, what a plain run gets)
    fused_adamw: bool
    compile: bool
    what: str


VARIANTS = {v.name: v for v in (
    Variant("flash", "flash", True, False, "reference: flash SDPA, fused AdamW, eager"),
    Variant("auto", "auto", True, False, "SDPA backend left to PyTorch"),
    Variant("foreach", "flash", False, False, "foreach AdamW instead of fused"),
    Variant("math", "math", True, False, "math SDPA (scores materialised) instead of flash"),
    Variant("compile", "flash", True, True, "torch.compile(model), as train.compile=true"),
)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gpt2-1.3b")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (no accumulation)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    p.add_argument("--peak-tflops", type=float, default=0.0, help="0: the datasheet peak of a known GPU, "
                   "else measured by a matmul loop")
    p.add_argument("--data", default="auto", choices=("auto", "assets", "synthetic"))
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--smoke", action="store_true", help="a tiny shape, 1 warm-up + 2 steps, no compile: "
                   "checks that the benchmark runs (on CPU in the tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.micro_batch, args.warmup, args.steps = "gpt-tiny", 2, 1, 2
        if args.variants == p.get_default("variants"):
            args.variants = "flash,auto,foreach,math"
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    return args


def make_config(args: argparse.Namespace, work: str) -> Config:
    n_steps = (args.warmup + args.steps) * len(args.variants.split(",")) + 8
    overrides = [f"--train.micro_batch_size={args.micro_batch}", f"--train.global_batch_size={args.micro_batch}",
                 "--train.precision=bf16", f"--train.max_steps={n_steps}", "--train.progress=false",
                 "--train.resume=never", f"--train.out_dir={json.dumps(work + '/run')}", "--train.compile=false",
                 "--train.eval_every=0", "--train.sample_tokens=0", f"--train.recompute={args.recompute}",
                 "--optim.warmup_steps=1"]
    if args.smoke:
        overrides += SMOKE
    use_assets = args.data == "assets" or (args.data == "auto" and assets_present())
    if not use_assets:
        overrides += synthetic_overrides(work + "/data", n_docs=300 if args.smoke else 2000)
    return load_config(args.config, overrides)


def datasheet_peak(device: torch.device, given: float) -> tuple[float, str]:
    """(peak bf16 TFLOP/s, where it comes from) for MFU."""
    if given > 0:
        return given, "--peak-tflops"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    if "H200" in name and "NVL" not in name:
        return H200_BF16_DENSE_TFLOPS, f"{name}: H200 SXM datasheet, dense bf16, no sparsity"
    return measure_peak_tflops(device, torch.bfloat16, seconds=0.2), f"measured bf16 matmul on {device.type}"


def memory_estimate(cfg: Config, n_params: int, device_type: str) -> dict[str, float]:
    """GiB one GPU needs: fp32 weights, gradients and Adam (16 B/param), autocast's bf16 weight copies (2),
    the layers' saved activations (docs/memory.md's formula) with flash or math SDPA."""
    gib = 2.0 ** 30
    states = 18 * n_params / gib
    acts = {b: sum(layer_activation_bytes(cfg, backend=b, device_type=device_type)) / gib for b in ("flash", "math")}
    return {"states": states, **{f"acts_{b}": a for b, a in acts.items()},
            **{f"total_{b}": states + a for b, a in acts.items()}}


def sdpa_context(backend: str):
    """Pin the SDPA backend for the steps (`auto`: PyTorch's choice)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend])


def set_variant(trainer: Trainer, v: Variant) -> None:
    """The trainer's optimizer and forward as this variant wants them (the model and its weights stay)."""
    trainer.optimizer = None  # free the previous Adam states before the new ones are made
    trainer.model.zero_grad(set_to_none=True)  # and what a failed variant's step may have left
    gc.collect()
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()
    trainer.optimizer = build_optimizer(trainer.sync, trainer.cfg.optim, fused=v.fused_adamw)
    trainer.forward = torch.compile(trainer.model) if v.compile else trainer.model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(trainer: Trainer, v: Variant, warmup: int, steps: int, peak: float) -> dict:
    """Warm-up, then `steps` timed `train_step`s; the row of results (median step)."""
    device, cfg = trainer.device, trainer.cfg
    m, t = cfg.model, cfg.train
    set_variant(trainer, v)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    with sdpa_context(v.sdpa):
        start = time.perf_counter()
        for _ in range(warmup):
            losses.append(trainer.train_step()[0])
        warm_s = time.perf_counter() - start
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            losses.append(trainer.train_step()[0])
            times.append(time.perf_counter() - start)
    dt = statistics.median(times)
    flops = trainer.spec.flops(m, t.global_batch_size)
    hw_flops = flops + trainer.spec.recompute_flops(m, t.global_batch_size, t.recompute,
                                                   layers=recomputed_layers(cfg))
    mem = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return {"variant": v.name, "sdpa": v.sdpa, "adamw": "fused" if v.fused_adamw else "foreach",
            "compile": v.compile, "tokens_per_s": t.global_batch_size * m.seq_len / dt, "step_s": dt,
            "tflops": flops / dt / 1e12, "mfu": flops / dt / 1e12 / peak, "hfu": hw_flops / dt / 1e12 / peak,
            "peak_mem_gib": mem, "warmup_s": warm_s, "loss_last": losses[-1],
            "finite": all(math.isfinite(x) for x in losses)}


def print_header(trainer: Trainer, args: argparse.Namespace, peak: float, source: str) -> None:
    cfg, d = trainer.cfg, trainer.device
    m = cfg.model
    name = torch.cuda.get_device_name(d) if d.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {d} ({name})")
    print(f"model {args.config}: {trainer.n_params / 1e9:.3f}B parameters, {m.n_layers} × {m.hidden_size}, "
          f"{m.n_heads} heads, seq {m.seq_len}; micro-batch {args.micro_batch} × {m.seq_len} tokens, bf16 autocast, "
          f"recompute {cfg.train.recompute}; {args.warmup} warm-up + {args.steps} timed steps per variant")
    print(f"peak {peak:,.1f} TFLOP/s ({source})")
    est = memory_estimate(cfg, trainer.n_params, d.type)
    total = f" of {torch.cuda.get_device_properties(d).total_memory / 2 ** 30:.1f} GiB" if d.type == "cuda" else ""
    print(f"memory estimate: states {est['states']:.1f} GiB (18 B/param) + activations {est['acts_flash']:.1f} GiB "
          f"(flash) / {est['acts_math']:.1f} GiB (math) = {est['total_flash']:.1f} / {est['total_math']:.1f} GiB"
          f"{total}, plus the fused head's logits chunk and allocator slack", flush=True)


ROW = "| {variant:<8} | {sdpa:<5} | {adamw:<7} | {compile!s:<7} | {tokens_per_s:>11,.0f} | {step_s:>7.3f} | " \
      "{tflops:>8.1f} | {mfu_pct:>5.1f}% | {hfu_pct:>5.1f}% | {mem:>8} | {warmup_s:>8.1f} | {ratio:>5.2f}x |"
HEAD = ("| variant  | sdpa  | AdamW   | compile | tokens/s    | step s  | TFLOP/s  | MFU    | HFU    | mem GiB  "
        "| warm-up s | vs flash |")


def print_row(row: dict, ref: dict | None) -> None:
    if "error" in row:
        print(f"| {row['variant']:<8} | FAILED: {row['error']}", flush=True)
        return
    ratio = row["tokens_per_s"] / ref["tokens_per_s"] if ref else float("nan")
    mem = "-" if row["peak_mem_gib"] is None else f"{row['peak_mem_gib']:.1f}"
    print(ROW.format(**row, mfu_pct=100 * row["mfu"], hfu_pct=100 * row["hfu"], mem=mem, ratio=ratio), flush=True)


def write_json(path: str, device: torch.device, peak: float, source: str, rows: list[dict]) -> None:
    if path:  # rewritten after every variant: a run cut short by its timeout keeps the rows it finished
        with open(path, "w") as fh:
            json.dump({"device": str(device), "peak_tflops": peak, "peak_source": source, "rows": rows}, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="meshlm-gpu-train-") as work:
        cfg = make_config(args, work)
        trainer = Trainer(cfg, progress=False)
        peak, source = datasheet_peak(trainer.device, args.peak_tflops)
        print_header(trainer, args, peak, source)
        print(HEAD, flush=True)
        for name in args.variants.split(","):
            try:
                rows.append(run_variant(trainer, VARIANTS[name], args.warmup, args.steps, peak))
            except Exception as err:  # noqa: BLE001 (an OOM or a missing kernel fails one variant, not all)
                rows.append({"variant": name, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
            ref = next((r for r in rows if r["variant"] == "flash" and "error" not in r), None)
            print_row(rows[-1], ref)
            write_json(args.json, trainer.device, peak, source, rows)
    failed = [r["variant"] for r in rows if "error" in r or not r.get("finite", False)]
    if failed:
        print(f"failed or non-finite: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
