"""int8, int4 and bf16 weights at a few decoding rows: PyTorch's kernels against meshlm's own
(`models/kernels/quant_rows.cpp`, `models/kernels/bf16_rows.cpp`; issue 47, the one-client rows).

Every matrix product of one SmolLM2-135M decoding step and nothing else: 30 blocks of four linears (576 → 960
query/key/value, 576 → 576 output, 576 → 3,072 gate and up, 1,536 → 576 down) and the 576 → 49,152 output head,
random weights (the time does not depend on their values), 134 MB of codes in int8 and 95 MB in int4 with its scales
(its head in int8, as `--quantize int4` keeps it): more than this host's caches, so each pass reads its codes from
memory, as a served step does. Each form runs `--rows` fp32 rows through the quantized layers themselves (`infer.quantize.Int8Linear`,
`Int4Linear`), eagerly:

- `fp32`: the float weights (`F.linear`), 4 bytes a weight: the reference row;
- `int8 aten`, `int4 aten`: PyTorch's kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), x rounded to
  bf16 (`own=False`);
- `int8 own`, `int4 own`: meshlm's kernel, x rounded to 8-bit blocks of 32 (`own=True`; the default on a CPU
  without native bf16);
- `bf16 aten`: bf16 weights and rows through `F.linear` (oneDNN's bf16 product), 2 bytes a weight;
- `bf16 own`: the same through meshlm's `meshlm::bf16_rows` (`vdpbf16ps`; CPUs with AVX512-BF16), at every row
  count (`infer.rows.ROWS` decides where a served model stops calling it).

Printed: ms per pass (median of `--repeats` timings of `--passes` passes each), the codes' GB/s (their bytes,
scales included, over the time), and each meshlm row against PyTorch's at the same precision; first, what
`torch.sum` reads a second over 512 MB in the same run (the memory's speed, the ceiling of a one-row pass).

    .venv/bin/python benchmarks/quant_rows.py                 # rows 1, 4, 16; about 3 minutes
    .venv/bin/python benchmarks/quant_rows.py --forms "bf16 aten,bf16 own" --rows 1,2,4,8,16
    .venv/bin/python benchmarks/quant_rows.py --rows 1 --threads 1
    .venv/bin/python benchmarks/quant_rows.py --smoke
Run it alone: another CPU-heavy job on the same cores changes every number.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMOLLM2 = {"layers": 30, "hidden": 576, "qkv": 960, "mlp": 1536, "vocab": 49152}
SMOKE = {"layers": 2, "hidden": 64, "qkv": 96, "mlp": 128, "vocab": 256}


FORMS = ("fp32", "int8 aten", "int8 own", "int4 aten", "int4 own", "bf16 aten", "bf16 own")


def build(shape: dict, form: str) -> list:
    """The step's linears in `form` (one of FORMS)."""
    import torch
    from torch import nn

    class KernelRows(nn.Linear):  # every row count through meshlm::bf16_rows
        def forward(self, x):
            return torch.ops.meshlm.bf16_rows.default(x, self.weight)

    from meshlm.infer.quantize import Int4Linear, Int8Linear

    h = shape["hidden"]
    sizes = [(h, shape["qkv"]), (h, h), (h, 2 * shape["mlp"]), (shape["mlp"], h)] * shape["layers"]
    sizes.append((h, shape["vocab"]))
    torch.manual_seed(0)
    layers = []
    for i, (k, n) in enumerate(sizes):
        linear = nn.Linear(k, n, bias=False)
        if form == "fp32":
            layers.append(linear)
            continue
        if form.startswith("bf16"):
            linear = linear.bfloat16()
            if form == "bf16 own":
                linear.__class__ = KernelRows
            layers.append(linear)
            continue
        mode, kernel = form.split()
        own = kernel == "own"
        head = i == len(sizes) - 1
        if mode == "int8" or head:
            layers.append(Int8Linear(linear, torch.bfloat16, own=own))
        else:
            layers.append(Int4Linear(linear, 32, torch.bfloat16, own=own))
    return layers


def code_bytes(layers: list) -> int:
    return sum(b.numel() * b.element_size() for m in layers for b in list(m.buffers()) + list(m.parameters()))


def time_pass(layers: list, rows: int, passes: int, repeats: int) -> float:
    """Median ms of one pass: each layer multiplies `rows` rows of its own input width."""
    import torch

    dtype = layers[0].weight.dtype if isinstance(getattr(layers[0], "weight", None), torch.Tensor) else torch.float32
    inputs = {m.in_features: torch.randn(rows, m.in_features).to(dtype) for m in layers}
    times = []
    with torch.no_grad():
        for m in layers:  # one untimed pass
            m(inputs[m.in_features])
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(passes):
                for m in layers:
                    m(inputs[m.in_features])
            times.append((time.perf_counter() - start) / passes * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16", help="decoding rows per pass (each below the crossing, 32)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma-separated forms (default: all of {FORMS})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--passes", type=int, default=10, help="passes per timing (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per row (default 5; the median is printed)")
    add_smoke_flag(parser)
    args = parser.parse_args()

    import torch

    from meshlm.core.precision import cpu_bf16_support
    from meshlm.models import native

    forms = [f.strip() for f in args.forms.split(",")]
    if bad := [f for f in forms if f not in FORMS]:
        parser.error(f"--forms: {bad[0]!r} is not one of {', '.join(FORMS)}")
    if native.quant_rows() is None:
        print(f"meshlm's int8/int4 kernel is unavailable here ({native.unavailable('quant_rows')}): PyTorch's "
              "int8/int4 rows only", flush=True)
        forms = [f for f in forms if f not in ("int8 own", "int4 own")]
    if native.bf16_rows() is None:
        print(f"meshlm's bf16 kernel is unavailable here ({native.unavailable('bf16_rows')}): no bf16 own row",
              flush=True)
        forms = [f for f in forms if f != "bf16 own"]
    shape = SMOKE if args.smoke else SMOLLM2
    passes, repeats = (1, 1) if args.smoke else (args.passes, args.repeats)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    big = torch.ones((2 if args.smoke else 128) * 2**20)  # 8 MB (smoke) or 512 MB of fp32
    big.sum()
    start = time.perf_counter()
    for _ in range(passes * repeats):
        big.sum()
    read = big.numel() * 4 * passes * repeats / (time.perf_counter() - start) / 1e9
    del big
    print(f"{shape['layers']} blocks and the head; {args.threads} thread(s); native bf16: "
          f"{cpu_bf16_support() or 'no'}; median of {repeats} x {passes} passes; torch.sum reads {read:.1f} GB/s",
          flush=True)
    print("| form | rows | ms / pass | GB/s of weights | PyTorch's kernel's time / this |")
    print("|---|---:|---:|---:|---:|")
    aten = {}  # (precision, rows): PyTorch's ms
    for form in forms:
        layers = build(shape, form)
        size = code_bytes(layers)
        for r in rows:
            ms = time_pass(layers, r, passes, repeats)
            mode, _, kernel = form.partition(" ")
            if kernel == "aten":
                aten[mode, r] = ms
            ratio = f"{aten[mode, r] / ms:.2f}x" if kernel == "own" and (mode, r) in aten else ""
            print(f"| {form} | {r} | {ms:.2f} | {size / ms / 1e6:.1f} | {ratio} |", flush=True)
        del layers


if __name__ == "__main__":
    main()
