"""int8 weights at several rows: which product a serving step of 2-64 decoding rows could use (issue 47,
"int8 at 16 clients").

A stack of `--layers` SmolLM2-135M-shaped linear layers (576 → 960 → 576 → 3,072 → 1,536 → 576: the fused
query/key/value, the output projection, the fused gate and up projection, the down projection, one block's
products and nothing else) runs `--rows` bf16 rows through each of these forms, each in one graph compiled as
`meshlm serve --compile` compiles its step (`infer.runner.COMPILE_CONFIG`: frozen weights, autotuned products),
with the rows dynamic and tuned at the size measured:

- `bf16`: the bf16 weights (oneDNN's product on a prepacked weight): the reference row;
- `dequant`: what an int8 layer of a compiled step does from two rows on (`infer.quantize.Int8Linear`): the
  weight dequantized per call, `linear(x, q·s)`;
- `woq`: `linear(x, q) · s`, the form Inductor's weight-only-int8 pattern rewrites to `_weight_int8pack_mm` and
  then autotunes against its own C++ GEMM template;
- `kernel`: `aten._weight_int8pack_mm` called directly (the one-row path);
- `act8`: the activations quantized too, per row (symmetric int8, one scale a row) and multiplied by
  `torch._int_mm` (int8 × int8 → int32 on VNNI), the result scaled by both scales.

Printed: ms for the stack's products, the weights' GB/s (their bytes over the time) and the time against
`bf16`'s. `--perplexity` adds the quality `act8` would cost SmolLM2-135M-Instruct (`bf16 --quantize int8`,
the head in int8 too) scored as benchmarks/quantize_quality.py scores its forms: every int8 layer of several
rows with int8 activations, then with the down projection and the head left weight-only.

    .venv/bin/python benchmarks/int8_products.py                   # rows 1, 16, 64; about 5 minutes
    .venv/bin/python benchmarks/int8_products.py --rows 16 --perplexity
    .venv/bin/python benchmarks/int8_products.py --smoke
Run it alone: another CPU-heavy job on the same cores changes every number.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag, skipped  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN, QKV, MLP = 576, 960, 1536  # SmolLM2-135M: 9 query heads and 3 key/value heads of 64
FORMS = ("bf16", "dequant", "woq", "kernel", "act8")


def int8_rows(x, q, s):
    """x qᵀ with x quantized per row (symmetric int8): (x_q q_qᵀ) · s_x · s_q, through `torch._int_mm`."""
    import torch

    xf = x.float()
    xs = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    xq = (xf / xs).round().clamp(-127, 127).to(torch.int8)
    return (torch._int_mm(xq, q.t()).float() * xs * s.float()).to(x.dtype)


def int8_layers(model, weight_only: tuple[str, ...], ffn: int, vocab: int) -> list:
    """`model`'s int8 layers that take int8 activations: all but those `weight_only` names ("all"; "down": the
    down projections, input width `ffn`; "head": the output head, `vocab` outputs)."""
    from meshlm.infer.quantize import Int8Linear

    return [m for m in model.modules() if isinstance(m, Int8Linear) and "all" not in weight_only
            and not ("down" in weight_only and m.in_features == ffn)
            and not ("head" in weight_only and m.out_features == vocab)]


def stack(form: str, layers: int, hidden: int, qkv: int, mlp: int):
    import torch
    import torch.nn.functional as F

    from meshlm.infer.quantize import int8_codes

    shapes = [(qkv, hidden), (hidden, hidden), (2 * mlp, hidden), (hidden, mlp)]

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            for i in range(layers):
                for j, shape in enumerate(shapes):
                    w = torch.randn(shape, generator=g) / shape[1] ** 0.5
                    if form == "bf16":
                        self.register_buffer(f"w{i}_{j}", w.to(torch.bfloat16))
                    else:
                        q, s = int8_codes(w)
                        self.register_buffer(f"q{i}_{j}", q)
                        self.register_buffer(f"s{i}_{j}", s.to(torch.bfloat16))

        def lin(self, x, i, j):
            if form == "bf16":
                return F.linear(x, getattr(self, f"w{i}_{j}"))
            q, s = getattr(self, f"q{i}_{j}"), getattr(self, f"s{i}_{j}")
            if form == "dequant":
                return F.linear(x, q.to(x.dtype) * s[:, None])
            if form == "woq":
                return F.linear(x, q.to(x.dtype)) * s
            if form == "kernel":
                return torch.ops.aten._weight_int8pack_mm(x, q, s)
            return int8_rows(x, q, s)

        def forward(self, x):
            for i in range(layers):
                a = self.lin(x, i, 0)[:, :hidden]
                b = self.lin(a, i, 1)
                c = self.lin(b, i, 2)[:, :mlp]
                x = self.lin(c, i, 3) + x
            return x

    model = Stack().eval()
    weight_bytes = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n[0] in "wq")
    return model, weight_bytes


def timed(fn, x, runs: int) -> float:
    for _ in range(3):
        fn(x)
    start = time.perf_counter()
    for _ in range(runs):
        fn(x)
    return (time.perf_counter() - start) / runs * 1e3


def speed(args) -> list[tuple[str, int, float, float, float]]:
    """(form, rows, compile s, ms per stack, weight bytes) for each form and row count."""
    import torch
    from torch._dynamo import config as dynamo_config
    from torch._inductor import config as inductor_config

    from meshlm.infer.runner import COMPILE_CONFIG

    out = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden).to(torch.bfloat16)
        for form in args.forms:
            model, nbytes = stack(form, args.layers, args.hidden, args.qkv, args.mlp)
            fn, compile_s = model, 0.0
            if args.compile:
                torch._dynamo.reset()
                with inductor_config.patch(COMPILE_CONFIG), dynamo_config.patch(recompile_limit=64):
                    fn = torch.compile(model, dynamic=True)
                    start = time.perf_counter()
                    fn(x)
                    compile_s = time.perf_counter() - start
            ms = min(timed(fn, x, args.runs) for _ in range(args.repeats))
            print(f"{form} at {rows} rows: {ms:.2f} ms (compile {compile_s:.0f} s)", file=sys.stderr, flush=True)
            out.append((form, rows, compile_s, ms, nbytes))
    return out


def perplexities(args) -> list[tuple[str, float]]:
    """SmolLM2-135M-Instruct's held-out perplexity: fp32, bf16 int8 (weight-only) and `act8` variants."""
    import copy

    import torch
    from quantize_quality import held_out_text, perplexity  # beside this script

    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters
    from meshlm.data.assets import smollm2_gguf
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.infer.quantize import Int8Linear, QuantizeOptions
    from meshlm.interop.checkpoints import open_checkpoint

    class RowInt8Linear(Int8Linear):
        """Int8Linear whose several-row products take int8 activations (`int8_rows`)."""

        def forward(self, x):
            flat = x.reshape(-1, self.in_features).to(self.compute_dtype).contiguous()
            if flat.shape[0] < 2:
                return super().forward(x)
            y = int8_rows(flat, self.qweight, self.scales).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias

    checkpoint = open_checkpoint(str(smollm2_gguf()), log=None)
    cfg = checkpoint.config
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    base = load_model(checkpoint, get_spec(cfg.model.family), "cpu").eval()
    text = held_out_text(tokenizer, args.tokens)
    # each variant's layers left weight-only (one row or many), the rest taking int8 activations from two rows on
    variants = {"fp32": None, "bf16 int8, weight-only": ("all",), "bf16 int8, act8 everywhere": (),
                "bf16 int8, act8 but the down projection": ("down",),
                "bf16 int8, act8 but the down projection and the head": ("down", "head")}
    out = []
    with torch.no_grad():
        for name, weight_only in variants.items():
            model = base if weight_only is None else cast_parameters(copy.deepcopy(base), "bf16")
            if weight_only is not None:
                QuantizeOptions("int8", 32, True).apply(model)
                for mod in int8_layers(model, weight_only, cfg.model.ffn_size, cfg.model.vocab_size):
                    mod.__class__ = RowInt8Linear
            out.append((name, perplexity(model, cfg, tokenizer, text, args.window)))
            print(f"{name}: perplexity {out[-1][1]:.3f}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64", help="comma-separated row counts (default 1,16,64)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--layers", type=int, default=30, help="blocks of products (default 30, SmolLM2's)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per repeat (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, the fastest kept (default 3)")
    parser.add_argument("--eager", dest="compile", action="store_false", help="eager stacks, not compiled")
    parser.add_argument("--perplexity", action="store_true", help="also the held-out perplexity act8 would cost")
    parser.add_argument("--tokens", type=int, default=20000, help="held-out tokens scored (default 20000)")
    parser.add_argument("--window", type=int, default=1024, help="perplexity window, tokens (default 1024)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
    args.forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    bad = [f for f in args.forms if f not in FORMS]
    if bad:
        parser.error(f"--forms: unknown {', '.join(bad)}; choose from {', '.join(FORMS)}")
    args.hidden, args.qkv, args.mlp = HIDDEN, QKV, MLP
    if args.smoke:
        args.hidden, args.qkv, args.mlp, args.layers, args.rows = 64, 96, 128, 1, [2]
        args.runs, args.repeats, args.compile, args.perplexity = 2, 1, False, False
        skipped("compiling, SmolLM2's shapes and the perplexities")
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    rows = speed(args)
    print(f"{args.layers} blocks of products ({args.hidden} -> {args.qkv} -> {args.hidden} -> {2 * args.mlp} -> "
          f"{args.mlp} -> {args.hidden}), bf16 rows, {'compiled' if args.compile else 'eager'}, {args.threads} "
          f"thread(s); load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print("| form | rows | ms | weight GB/s | vs bf16 | compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    ref = {r: ms for f, r, _, ms, _ in rows if f == "bf16"}
    for form, r, compile_s, ms, nbytes in rows:
        ratio = f"{ms / ref[r]:.2f}x" if r in ref else "-"
        print(f"| {form} | {r} | {ms:.2f} | {nbytes / ms / 1e6:.1f} | {ratio} | {compile_s:.0f} |")
    if args.perplexity:
        results = perplexities(args)
        print("| SmolLM2-135M-Instruct | perplexity | vs fp32 |")
        print("|---|---:|---:|")
        for name, ppl in results:
            print(f"| {name} | {ppl:.3f} | {100 * (ppl / results[0][1] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
