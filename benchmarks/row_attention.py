"""One decoding token's attention over the paged pool inside a compiled step (issue 47, item 2: "attention over
the pool without copying"): `models.paged.RowCache` as it is (the row's keys and values read through its slot
index into a copy, then the layer's core, `scaled_dot_product_attention`, on fp32 copies for a 16-bit pool)
against an in-place form, the attention written out as two reductions over the positions (scores, then the
weighted values, the softmax between in fp32), which Inductor fuses into one kernel that loads each key and value
through the slot index with no gathered copy.

`--layers` layers of SmolLM2-135M's shape (9 query heads over 3 KV heads of 64), each with its own pool of
`--slots` positions (the served engine's: 64 sequences of 1,024), attend for one query in one graph compiled as
`meshlm serve --compile` compiles its step (`infer.runner.COMPILE_CONFIG`, the position count dynamic), each layer
taking the last one's output as its query (they run one after another, as a model's do). Each row of the table
is one length L: the row's positions are L / 16 blocks of 16 contiguous slots, scattered over the pool as a
served row's are. Both forms write the token's key and value into its slot too, as the step does. Cells: ms for
all the layers, the best of `--repeats` timings of `--runs` calls (the forms take turns); before timing, the two
forms' outputs are checked against each other.

`--step MODEL` times the whole served step instead: one request decoding alone in a compiled engine, as `meshlm
serve --compile` builds it (`infer.server.build_server`: `--step-dtype`, `--step-quantize`, a pool of 64 × 1,024
positions), a `--prompt-tokens` passage of the bundled plays as its prompt, `Engine.step` timed over `--rounds`
rounds of `--round-steps` steps once it decodes. MODEL: `smollm2` (the bundled GGUF) or a checkpoint. Each form
runs in a fresh process, the forms taking turns for `--starts` starts (one process's figures drift less than
the host's between processes), so each start's pair is the comparison.

    .venv/bin/python benchmarks/row_attention.py                        # fp32 and bf16, L = 128 to 1,024
    .venv/bin/python benchmarks/row_attention.py --step smollm2         # bf16 + int8, 3 starts (about 15 minutes)
    .venv/bin/python benchmarks/row_attention.py --smoke
Run it alone: another CPU-heavy job on the same cores changes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from smoke import add_smoke_flag, skipped  # benchmarks/smoke.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def in_place_class(row_cache):
    """`row_cache` (models.paged.RowCache) with the in-place form: two reductions over the positions, the pool
    read through the slot index inside them, the softmax in fp32."""
    from meshlm.models.paged import _scale

    class InPlace(row_cache):
        def update_and_attend(self, q, k, v, start, core, mask=None):
            nh, nkv, hd = q.shape[1], k.shape[1], q.shape[-1]
            self.k[:, self.slot] = k[:, :, 0].transpose(0, 1).to(self.k.dtype)
            self.v[:, self.slot] = v[:, :, 0].transpose(0, 1).to(self.v.dtype)
            qh = q[0, :, 0].float().view(nkv, 1, nh // nkv, hd)  # a KV head's query heads together
            keys = self.k[:, self.index].float()[:, :, None]  # (nkv, L, 1, hd): loaded inside the reduction
            probs = ((keys * qh).sum(-1) * _scale(core, hd)).softmax(1)  # (nkv, L, group)
            values = self.v[:, self.index].float()[:, :, None]
            return (probs[..., None] * values).sum(1).reshape(1, nh, 1, values.shape[-1]).to(q.dtype)

    return InPlace


STEP_FORMS = ("gathered", "in-place")


def step_child(args) -> dict:
    """One process, one form: the served engine's one-row decode step, timed (module docstring, `--step`)."""
    import torch
    from serve_load import corpus_ids  # benchmarks/, beside this script

    from meshlm.infer.engine import CacheOptions
    from meshlm.infer.quantize import QuantizeOptions
    from meshlm.infer.sampling import SamplingParams
    from meshlm.infer.server import build_server
    from meshlm.models import paged

    torch.set_num_threads(args.threads)
    if args.step_child == "in-place":
        paged.RowCache.update_and_attend = in_place_class(paged.RowCache).update_and_attend
    checkpoint = args.step
    if checkpoint == "smollm2":
        from meshlm.data.assets import smollm2_gguf

        checkpoint = str(smollm2_gguf())
    quantize = None if args.step_quantize == "none" else QuantizeOptions(args.step_quantize, 32, True)
    started = time.perf_counter()
    server = build_server(checkpoint, max_seqs=64, max_len=1024, options=CacheOptions(compile=args.compiled),
                          quantize=quantize, dtype=args.step_dtype)
    start_s = time.perf_counter() - started
    engine = server.engine
    ids = corpus_ids(server.tokenizer, 200_000)
    prompt = ids[len(ids) // 2:len(ids) // 2 + args.prompt_tokens]
    warm = 8
    total = warm + args.rounds * args.round_steps
    req = engine.submit(prompt, SamplingParams(max_tokens=total + 1, temperature=0.0, ignore_eos=True))
    while len(req.output_ids) < 1 + warm:
        engine.step()
    rounds = []
    for _ in range(args.rounds):
        before = len(req.output_ids)
        t0 = time.perf_counter()
        for _ in range(args.round_steps):
            engine.step()
        rounds.append((time.perf_counter() - t0) / args.round_steps * 1e3)
        if len(req.output_ids) - before != args.round_steps:
            raise SystemExit(f"a step gave {len(req.output_ids) - before} tokens over {args.round_steps} steps")
    return {"form": args.step_child, "start_s": start_s, "rounds_ms": rounds, "first": len(prompt) + 1 + warm,
            "last": len(prompt) + len(req.output_ids), "tokens": req.output_ids[:16]}


def step_parent(args) -> None:
    """Each form in its own process, taking turns, `--starts` times; a table of ms per step."""
    results = []
    for start in range(args.starts):
        for form in STEP_FORMS:
            cmd = [sys.executable, __file__, "--step", args.step, "--step-child", form, "--step-dtype", args.step_dtype,
                   "--step-quantize", args.step_quantize, "--prompt-tokens", str(args.prompt_tokens), "--rounds",
                   str(args.rounds), "--round-steps", str(args.round_steps), "--threads", str(args.threads)]
            cmd += [] if args.compiled else ["--eager"]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["start"] = start
            results.append(r)
            print(f"start {start} {form}: {r['rounds_ms']} (start-up {r['start_s']:.0f} s)", file=sys.stderr,
                  flush=True)
    tokens = {json.dumps(r["tokens"]) for r in results}
    print(f"{args.step} {args.step_dtype} {args.step_quantize}, one request alone, positions {results[0]['first']}-"
          f"{results[0]['last']}, {args.rounds} rounds of {args.round_steps} steps, "
          f"{'compiled' if args.compiled else 'eager'}, {args.threads} thread(s); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; greedy tokens "
          f"{'the same in every process' if len(tokens) == 1 else 'DIFFER between processes'}")
    print("| start | form | ms a step, median of rounds | fastest round | slowest round | start-up s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in results:
        ms = r["rounds_ms"]
        print(f"| {r['start']} | {r['form']} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} | "
              f"{r['start_s']:.0f} |")
    for form in STEP_FORMS:
        meds = [statistics.median(r["rounds_ms"]) for r in results if r["form"] == form]
        print(f"{form}: median over starts {statistics.median(meds):.2f} ms ({min(meds):.2f}-{max(meds):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="128,320,600,1024", help="positions the row sees, comma-separated")
    parser.add_argument("--dtypes", default="fp32,bf16", help="the pool's dtype: fp32, bf16 (comma-separated)")
    parser.add_argument("--layers", type=int, default=30, help="layers (default 30, SmolLM2's)")
    parser.add_argument("--slots", type=int, default=64 * 1024, help="positions in each layer's pool")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--runs", type=int, default=50, help="calls per timing (default 50)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per form, the best kept (default 3)")
    parser.add_argument("--step", default=None, metavar="MODEL", help="time the whole served one-row step of "
                        "MODEL (smollm2, or a checkpoint) in process, each form in its own process")
    parser.add_argument("--step-dtype", default="bf16", choices=["fp32", "bf16"], help="--step: the weights' and "
                        "pool's dtype (default bf16)")
    parser.add_argument("--step-quantize", default="int8", choices=["none", "int8", "int4"], help="--step: "
                        "--quantize (default int8)")
    parser.add_argument("--starts", type=int, default=3, help="--step: processes per form (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=560, help="--step: the prompt's tokens (default 560)")
    parser.add_argument("--rounds", type=int, default=5, help="--step: timed rounds (default 5)")
    parser.add_argument("--round-steps", type=int, default=40, help="--step: steps a round (default 40)")
    parser.add_argument("--eager", dest="compiled", action="store_false", help="--step: an eager engine")
    parser.add_argument("--step-child", default=None, choices=STEP_FORMS, help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.step_child:
        print(json.dumps(step_child(args)))
        return
    if args.smoke and args.step:
        args.starts, args.prompt_tokens, args.rounds, args.round_steps, args.compiled = 1, 40, 1, 4, False
        skipped("compiling (an eager engine attends through PagedCache: both forms then run the same code)")
    if args.step:
        step_parent(args)
        return
    lengths = [int(v) for v in args.lengths.split(",") if v.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("fp32", "bf16")]
    if bad:
        parser.error(f"--dtypes: unknown {', '.join(bad)}; choose from fp32, bf16")
    compiled = True
    if args.smoke:
        lengths, dtypes, args.layers, args.slots, args.runs, args.repeats = [20], ["fp32"], 2, 256, 2, 1
        compiled = False
        skipped("compiling (the forms run eagerly) and the full-size pool")

    import torch
    from torch._inductor import config as inductor_config

    from meshlm.core.config import ModelConfig
    from meshlm.infer.runner import COMPILE_CONFIG
    from meshlm.models.layers import Attention
    from meshlm.models.paged import RowCache

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    attn = Attention(ModelConfig(hidden_size=576, n_heads=9, n_kv_heads=3, position="rope", norm="rmsnorm",
                                 activation="swiglu", bias=False))
    nh, nkv, hd, block = attn.n_heads, attn.n_kv_heads, attn.head_dim, 16

    forms = {"RowCache (gathered + core)": RowCache, "in place (two reductions)": in_place_class(RowCache)}
    rows = []
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        g = torch.Generator().manual_seed(0)
        pools = [(torch.randn(nkv, args.slots, hd, generator=g).to(dtype),
                  torch.randn(nkv, args.slots, hd, generator=g).to(dtype)) for _ in range(args.layers)]
        for pool in pools:
            for t in pool:
                torch._dynamo.mark_static(t)  # as the runner marks its pool
        def step(kind, q, k, v, slot, index, pools=pools):
            out = q
            for keys, values in pools:  # the layers one after another, each attending for the last one's output
                out = forms[kind](keys, values, slot, index).update_and_attend(out, k, v, 0, attn.core)
            return out

        fns = {kind: step for kind in forms}
        if compiled:
            torch._dynamo.reset()
            with inductor_config.patch(COMPILE_CONFIG):
                fns = {kind: torch.compile(step, dynamic=True) for kind in forms}
        for length in lengths:
            blocks = torch.randperm(args.slots // block, generator=g)[:(length + block - 1) // block]
            index = (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:length]
            slot = index[-1:]
            q, k, v = (torch.randn(1, n, 1, hd, generator=g).to(dtype) for n in (nh, nkv, nkv))
            outs = [fns[kind](kind, q, k, v, slot, index).float() for kind in forms]
            torch.testing.assert_close(outs[0], outs[1], rtol=2e-2 if dtype != torch.float32 else 1e-4,
                                       atol=2e-2 if dtype != torch.float32 else 1e-4)
            times = {kind: float("inf") for kind in forms}
            for _ in range(args.repeats):
                for kind in forms:
                    fn = fns[kind]
                    for _ in range(3):
                        fn(kind, q, k, v, slot, index)
                    start = time.perf_counter()
                    for _ in range(args.runs):
                        fn(kind, q, k, v, slot, index)
                    times[kind] = min(times[kind], (time.perf_counter() - start) / args.runs * 1e3)
            rows.append((name, length, *times.values()))
            print(f"{name} L={length}: {times}", file=sys.stderr, flush=True)
    print(f"{args.layers} layers, 9 query heads over 3 KV heads of 64, one query, pools of {args.slots} positions, "
          f"{'compiled' if compiled else 'eager'}, {args.threads} thread(s); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| pool | positions | RowCache (gathered + core), ms | in place (two reductions), ms | in place / RowCache |")
    print("|---|---:|---:|---:|---:|")
    for name, length, gathered, inplace in rows:
        print(f"| {name} | {length} | {gathered:.3f} | {inplace:.3f} | {inplace / gathered:.2f}x |")


if __name__ == "__main__":
    main()
