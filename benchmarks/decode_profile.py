"""Where one decode step of the serving engine spends its time (issue 47: "a profile of one decode step: Python,
attention, matrix products"), for each weight form at 1 and at `--rows` sequences.

The engine (`infer.engine.Engine`, in process, no HTTP) prefills `--rows` prompts cut from the held-out play,
decodes a few warm-up steps, times `--steps` decode steps, then runs `--steps` more under `torch.profiler`.
Each ATen operator's self time goes to one of:

- matrix products: `mm`, `addmm`, `bmm`, `linear`'s products, the packed int8/int4 kernels, meshlm's int8, int4
  and bf16 rows, oneDNN's and MKL's products on prepacked weights (the compiled step's);
- attention: the attention kernel (`scaled_dot_product_attention`'s CPU implementations, or the math path's
  softmax and products inside it) and the pool's reads and writes (the block gathers, `index_select`, `index`,
  `index_put_`, `index_copy_`: the copies in-place attention would remove); in the compiled step also the
  Python of the attention operator (`meshlm::paged_attention`'s own time) and the one-token step's C++ attention
  operator (`meshlm::row_decode`);
- other operators: norms, RoPE, activations, residual adds, sampling's argmax, casts;
- compiled kernels (`--compile`): the compiled graph's own time, Inductor's fused loops and its matrix-product
  kernels;
- Python and dispatch: the step's wall time (timed without the profiler) less every operator's self time (the
  interpreter, the scheduler, the layout tensors built per step, module calls).

With one torch thread (`--threads 1`, the default) the self times add up to the wall time's operator part.
Each row of the table is one form and batch: wall ms per step, output tokens/s, and each part's share.

    .venv/bin/python benchmarks/decode_profile.py                      # SmolLM2-135M-Instruct, fp32 and bf16
    .venv/bin/python benchmarks/decode_profile.py --forms fp32,bf16,bf16-int4 --rows 16
    .venv/bin/python benchmarks/decode_profile.py --forms bf16 --compile         # the compiled step
    .venv/bin/python benchmarks/decode_profile.py --smoke
Run it alone: another CPU-heavy job on the same cores changes every number.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

from smoke import add_smoke_flag, tiny_checkpoint  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (dtype, quantize mode)
FORMS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int8": ("fp32", "int8"), "int4": ("fp32", "int4"),
         "bf16-int8": ("bf16", "int8"), "bf16-int4": ("bf16", "int4")}
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm",
          "aten::_weight_int4pack_mm_for_cpu", "aten::matmul", "mkldnn::_linear_pointwise",
          "mkldnn::_linear_pointwise.binary", "mkl::_mkl_linear", "meshlm::int8_rows", "meshlm::int4_rows",
          "meshlm::bf16_rows")
ATTENTION = ("scaled_dot_product", "flash_attention", "aten::index_select", "aten::index", "aten::index_put_",
             "aten::index_copy_", "aten::_softmax", "aten::gather", "meshlm::paged_attention", "meshlm::row_decode")
COMPILED = "## Call CompiledFxGraph"  # the compiled step's own kernels (Inductor's loops and matrix products)


CPU_TIME = False  # --cpu-time: the step's time is this thread's CPU time (one torch thread), not the wall's


def part_of(name: str) -> str:
    if name.startswith(COMPILED):
        return "compiled"
    if name in MATMUL:
        return "matmul"
    if any(key in name for key in ATTENTION):
        return "attention"
    return "other"


def profile_steps(engine, steps: int) -> tuple[float, dict[str, float]]:
    """(wall seconds per decode step, seconds per step of each operator part) of `engine`, whose requests are all
    decoding: the wall time over `steps` steps without the profiler (its bookkeeping between operators would
    count as Python), then the parts over `steps` more under it."""
    from torch.profiler import ProfilerActivity, profile

    clock = time.thread_time if CPU_TIME else time.perf_counter
    start = clock()
    for _ in range(steps):
        engine.step()
    wall = (clock() - start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0, "compiled": 0.0}
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::", "mkl::", "meshlm::", COMPILED)) or "attention" in event.key:
            parts[part_of(event.key)] += event.self_cpu_time_total / 1e6 / steps
    return wall, parts


def measure(model, tokenizer, prompts: list[list[int]], steps: int, warm: int, compile: bool = False):
    """(wall s/step, parts) of decoding `prompts` together through a fresh engine over `model` (its step
    compiled with `compile`, the start's compile time printed)."""
    from meshlm.infer.engine import CacheOptions, Engine, SamplingParams

    params = SamplingParams(max_tokens=warm + 2 * steps + 4, temperature=0, ignore_eos=True)
    engine = Engine(model, tokenizer, len(prompts), max(map(len, prompts)) + warm + 2 * steps + 8,
                    options=CacheOptions(prefix_caching=False, max_batched_tokens=None, compile=compile))
    if compile:
        print(f"  step compiled in {engine.runner.compile_s:.1f} s", file=sys.stderr, flush=True)
    for p in prompts:
        engine.submit(p, params)
    for _ in range(1 + warm):  # the prefill, then warm-up decode steps
        engine.step()
    return profile_steps(engine, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a run directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--forms", default="fp32,bf16,int8,int4,bf16-int8,bf16-int4",
                        help=f"comma-separated, of: {', '.join(FORMS)}")
    parser.add_argument("--rows", type=int, default=16, help="sequences decoding together in the second batch")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--steps", type=int, default=16, help="profiled decode steps (default 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--compile", action="store_true", help="the engine's compiled step (`meshlm serve "
                        "--compile`): the step's graph with Inductor's kernels; its compile time is printed")
    parser.add_argument("--cpu-time", action="store_true", help="time each step in this thread's CPU time (with "
                        "--threads 1 the time the step would take alone, on a machine busy with other work)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures one thread: give --threads 1")
    global CPU_TIME
    CPU_TIME = args.cpu_time
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory(prefix="decode-profile-") as tmp:
        if args.smoke:
            args.checkpoint = str(tiny_checkpoint(Path(tmp) / "tiny", n_layers=1, hidden_size=64, n_heads=4,
                                                  seq_len=128))
            args.forms, args.rows, args.steps, args.prompt_tokens = "fp32,bf16", 2, 2, 8
        rows = run(args)
    print(f"checkpoint {args.checkpoint or 'SmolLM2-135M-Instruct.Q4_1.gguf'}; prompts of {args.prompt_tokens} "
          f"tokens; {args.steps} profiled decode steps; {args.threads} thread(s); "
          f"{'compiled step' if args.compile else 'eager step'}; "
          f"{'thread CPU time' if args.cpu_time else 'wall time'}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| form | rows | ms / step | output tokens/s | matrix products | attention | other operators | "
          "compiled kernels | Python and dispatch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for form, n, wall, parts in rows:
        python = max(0.0, wall - sum(parts.values()))
        shares = [parts["matmul"], parts["attention"], parts["other"], parts["compiled"], python]
        print(f"| {form} | {n} | {wall * 1e3:.1f} | {n / wall:.1f} | "
              + " | ".join(f"{1e3 * x:.1f} ms ({100 * x / wall:.0f}%)" for x in shares) + " |")


def run(args) -> list[tuple[str, int, float, dict]]:
    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters
    from meshlm.data.assets import smollm2_gguf
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.eval.sets import held_out_files
    from meshlm.families.registry import get_spec
    from meshlm.infer.quantize import QuantizeOptions
    from meshlm.interop.checkpoints import open_checkpoint

    checkpoint = open_checkpoint(args.checkpoint or str(smollm2_gguf()), log=None)
    cfg = checkpoint.config
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    base = load_model(checkpoint, get_spec(cfg.model.family), "cpu").eval()
    ids = tokenizer.encode(held_out_files()[-1].read_text(encoding="utf-8-sig")[:40000])
    n = args.prompt_tokens
    prompts = [ids[i * n:(i + 1) * n] for i in range(args.rows)]
    out = []
    for form in args.forms.split(","):
        dtype, mode = FORMS[form]
        model = cast_parameters(copy.deepcopy(base), dtype)
        if mode is not None:
            QuantizeOptions(mode).apply(model)
        for batch in sorted({1, args.rows}):
            wall, parts = measure(model, tokenizer, prompts[:batch], args.steps, warm=2, compile=args.compile)
            print(f"{form} x{batch}: {wall * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
            out.append((form, batch, wall, parts))
        del model
    return out


if __name__ == "__main__":
    main()
