"""`meshlm plan`: the layout for a model on a cluster, for training (ranked, explained, tried) or serving.

    meshlm plan --config gpt2-1.3b --gpus 16 --gpus-per-node 8 --gpu a100-80gb --global-batch-size 512
    meshlm plan --config gpt2-1.3b --gpus 16 --gpu a100-80gb --explain tp=2,pp=1,dp=8,mbs=4
    meshlm plan --config gpt-tiny --gpus 2 --gpu this --trial 3 --steps 6
    meshlm plan --config gpt2-1.3b --gpu h100-80gb --inference --tpot-ms 20

docs/plan.md describes the cost model; `benchmarks/plan_validation.py` holds it to published measurements.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from meshlm.config import DEFAULT_CONFIG, Config, ConfigError, bundled_configs

GIB = 2 ** 30
GPU_FIELDS = [("tflops", "dense 16-bit peak TFLOP/s"), ("memory-gb", "memory per GPU, GiB"),
              ("hbm-gbps", "memory bandwidth, GB/s"), ("intra-gbps", "intra-node link per GPU, GB/s"),
              ("inter-gbps", "inter-node link per GPU, GB/s"), ("intra-latency-us", "intra-node latency, µs"),
              ("inter-latency-us", "inter-node latency, µs"), ("op-overhead-us", "host time per op, µs"),
              ("gather-cost", "all-gather / reduce-scatter cost as a fraction of an all-reduce's")]
LAYOUT_KEYS = {"tp", "pp", "dp", "vpp", "sp", "mbs", "micro_batch_size", "recompute", "zero"}


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="choose the parallel layout for a model on a cluster (training or "
                                       "serving); extra --section.key=value override the config")
    plan.add_argument("--config", default=DEFAULT_CONFIG,
                      help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs in the cluster (training)")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu", default="a100-80gb", help="catalog name, or 'this' to measure this machine")
    for name, text in GPU_FIELDS:
        plan.add_argument(f"--gpu-{name}", type=float, default=None, help=f"override the GPU's {text}")
    plan.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: the config's)")
    plan.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the config's)")
    plan.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                      help="default: bf16 on a catalog GPU, the config's on --gpu this")
    plan.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    plan.add_argument("--all", action="store_true", help="every fitting variant, not the best of each layout")
    plan.add_argument("--json", action="store_true", help="print the ranked layouts as a JSON list")
    plan.add_argument("--layout", default=None, help="evaluate one layout: tp=8,pp=8,dp=16,vpp=1,sp=true,mbs=1,"
                                                      "recompute=selective|full|full:N|none,zero=1")
    plan.add_argument("--explain", default=None, metavar="LAYOUT", help="print every memory and time term of a layout")
    plan.add_argument("--write-config", default=None, metavar="PATH", help="write the winning layout's config (.toml)")
    plan.add_argument("--trial", type=int, default=0, metavar="K", help="run the top K layouts with torchrun here")
    plan.add_argument("--steps", type=int, default=6, help="steps per trial (the first is not timed)")
    plan.add_argument("--inference", action="store_true", help="plan serving: tp and batch size")
    plan.add_argument("--prompt-tokens", type=int, default=512)
    plan.add_argument("--output-tokens", type=int, default=128)
    plan.add_argument("--ttft-ms", type=float, default=None, help="target time to first token")
    plan.add_argument("--tpot-ms", type=float, default=None, help="target time per output token")
    plan.set_defaults(func=_plan)


# ---- inputs ------------------------------------------------------------------------------------------------
def _gpu(args: argparse.Namespace):
    from meshlm.plan.catalog import get_gpu, measure_links, measure_this, share_cores, with_overrides

    if args.gpu.strip().lower() == "this":
        threads = None
        if args.gpus > 1:  # torchrun gives each process one thread (OMP_NUM_THREADS=1)
            threads = 1
        gpu = measure_this(threads, cores=os.cpu_count() if threads == 1 else None)
        if threads == 1:
            if args.gpu_intra_gbps is None or args.gpu_intra_latency_us is None:  # not both given: measure
                gbps, latency, gather = measure_links()  # gloo between two busy processes on this host
                gpu = with_overrides(gpu, intra_gbps=gbps, inter_gbps=gbps, intra_latency_us=latency,
                                     inter_latency_us=latency, gather_cost=gather)
            gpu = share_cores(gpu)
    else:
        gpu = get_gpu(args.gpu)
    values = {name.replace("-", "_").replace("memory_gb", "memory_gib"): getattr(args, "gpu_" + name.replace("-", "_"))
              for name, _ in GPU_FIELDS}
    return with_overrides(gpu, **values)


def _config(args: argparse.Namespace, overrides: list[str]) -> Config:
    from meshlm.config import load_config

    extra = []
    if args.seq_len is not None:
        extra.append(f"--model.seq_len={args.seq_len}")
    if args.global_batch_size is not None:
        extra.append(f"--train.global_batch_size={args.global_batch_size}")
    return load_config(args.config, [*overrides, *extra])


def _check_cluster(args: argparse.Namespace) -> None:
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be >= 1")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node} must be >= 1")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        below = args.gpus // args.gpus_per_node * args.gpus_per_node
        raise ConfigError(f"--gpus {args.gpus} is not a multiple of --gpus-per-node {args.gpus_per_node}: whole nodes "
                          f"only; use --gpus {below} or {below + args.gpus_per_node}")
    for name, value in (("--top", args.top), ("--steps", args.steps), ("--prompt-tokens", args.prompt_tokens),
                        ("--output-tokens", args.output_tokens)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be >= 1")
    if args.trial < 0:
        raise ConfigError(f"--trial {args.trial} must be >= 0")


def parse_layout(text: str, gpus: int, cfg: Config):
    """'tp=8,pp=8,dp=16,sp=true,mbs=1,recompute=selective,zero=1' → Candidate (dp defaults to fill --gpus)."""
    from meshlm.plan.cost import Candidate
    from meshlm.plan.layout import factor_world

    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout {text!r}: {part!r} is not key=value with key one of "
                              f"{', '.join(sorted(LAYOUT_KEYS))}; e.g. tp=8,pp=8,dp=16,sp=true,recompute=selective")
        values[key] = value.strip()

    def integer(key: str, default: int) -> int:
        raw = values.get(key)
        if raw is None:
            return default
        if not raw.isdigit() or int(raw) < (0 if key == "zero" else 1):
            raise ConfigError(f"--layout {key}={raw!r} must be a whole number >= {0 if key == 'zero' else 1}")
        return int(raw)

    tp, pp = integer("tp", 1), integer("pp", 1)
    try:  # the world's rule (plan.layout.factor_world), for the --gpus of the cluster; dp defaults to fill it
        pp, dp, tp = factor_world(gpus, tp, pp, integer("dp", 0) if "dp" in values else 0)
    except ConfigError as err:
        raise ConfigError(f"--layout {text!r} on --gpus {gpus}: {err}") from None
    sp_raw = values.get("sp", "false").lower()
    if sp_raw not in ("true", "false", "1", "0"):
        raise ConfigError(f"--layout sp={sp_raw!r} must be true or false")
    rec, _, n = values.get("recompute", cfg.train.recompute).partition(":")
    if rec not in ("none", "selective", "full") or (n and (rec != "full" or not n.isdigit())):
        raise ConfigError(f"--layout recompute={values.get('recompute')!r} must be none, selective, full or full:N "
                          "(the first N layers of each stage)")
    mbs = integer("mbs", integer("micro_batch_size", cfg.train.micro_batch_size))
    return Candidate(tp, pp, dp, integer("vpp", 1), sp_raw in ("true", "1"), mbs, rec, int(n or 0),
                     integer("zero", 0))


def _options(args: argparse.Namespace, cfg: Config, gpu):
    from meshlm.plan.cost import Options

    this = gpu.name.startswith("this")
    device = "cpu" if gpu.name == "this (cpu)" else "cuda"
    precision = args.precision or (cfg.train.precision if this else "bf16")
    return Options(precision=precision, device_type=device, fused_loss=cfg.train.fused_loss)


# ---- output ------------------------------------------------------------------------------------------------
def _row(i: int | str, e) -> str:
    c = e.candidate
    return (f"| {i} | {c.tp} | {c.pp} | {c.vpp} | {c.dp} | {'yes' if c.sp else 'no'} | {c.micro_batch_size} | "
            f"{c.recompute_label} | {c.zero} | {e.memory_bytes / GIB:,.1f} | {_secs(e.step_time_s)} | "
            f"{e.tokens_per_s:,.0f} | {_tflops(e.tflops_per_gpu)} | {100 * e.mfu:.1f}% |")


def _secs(x: float) -> str:
    return f"{x:.3g}"


def _tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


TABLE_HEAD = [("| rank | tp | pp | vpp | dp | sp | mbs | recompute | zero | memory GiB | step s | tokens/s | "
              "TFLOP/s/GPU | MFU |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def explain(e, cfg: Config) -> str:
    from meshlm.plan.memory import parameter_count

    c = e.candidate
    lines = [f"layout {c.label()}: {cfg.model.n_layers} layers of hidden {cfg.model.hidden_size}, "
             f"global batch {cfg.train.global_batch_size} × {cfg.model.seq_len} tokens"
             + (f", {parameter_count(cfg.model) / 1e9:.2f}B parameters" if cfg.model.family == "gpt" else ""),
             "", "memory per GPU (the fullest pipeline rank):"]
    w = max(36, *(len(k) for k in [*e.memory, *e.time]))
    for k, v in e.memory.items():
        lines.append(f"  {k:<{w}} {v / GIB:>10.3f} GiB")
    lines.append(f"  {'total':<{w}} {e.memory_bytes / GIB:>10.3f} GiB of {e.memory_limit / GIB:g} GiB: "
                 f"{'fits' if e.fits else 'DOES NOT FIT'}")
    lines += ["", "time per step (the slowest pipeline rank):"]
    for k, v in e.time.items():
        lines.append(f"  {k:<{w}} {v:>12.6f} s  {100 * v / e.step_time_s:5.1f}%")
    lines.append(f"  {'step':<{w}} {e.step_time_s:>12.6f} s")
    lines.append(f"\n{e.tokens_per_s:,.0f} tokens/s, {_tflops(e.tflops_per_gpu)} TFLOP/s per GPU, MFU "
                 f"{100 * e.mfu:.1f}%, HFU {100 * e.hfu:.1f}%")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ValueError(f"cannot write {value!r} to TOML")


def write_config(cfg: Config, path: str) -> Path:
    """The whole config (every section, every key) as TOML that `--config PATH` reads back."""
    out = Path(path)
    lines = [f"# written by meshlm plan: {' '.join(sys.argv[1:])}".rstrip()]
    for section, values in cfg.to_dict().items():
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    except OSError as err:
        raise ConfigError(f"--write-config {path!r}: cannot write it ({err.strerror}); give a writable path") from None
    return out


# ---- the command -------------------------------------------------------------------------------------------
def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    _check_cluster(args)
    cfg = _config(args, overrides)
    gpu = _gpu(args)
    if args.inference:
        return _inference(args, cfg, gpu)
    from meshlm.plan.cost import Cluster
    from meshlm.plan.search import distinct, evaluate, search

    cluster = Cluster(gpu, args.gpus, args.gpus_per_node)
    opts = _options(args, cfg, gpu)
    gbs = cfg.train.global_batch_size
    one = args.layout or args.explain
    if one:
        cand = parse_layout(one, args.gpus, cfg)
        est = evaluate(cfg, cand, cluster, gbs, opts)
        if args.json:
            print(json.dumps([est.to_dict()], indent=1))
        elif args.explain:
            print(explain(est, cand.apply(cfg, gbs)))
        else:
            print("\n".join(TABLE_HEAD + [_row(1, est)]))
            print(f"{'fits' if est.fits else 'does NOT fit'} in {gpu.memory_gib:g} GiB; "
                  f"overrides: {' '.join(cand.overrides())}")
        if args.write_config:
            print(f"wrote {write_config(cand.apply(cfg, gbs), args.write_config)}", file=sys.stderr)
        return 0
    result = search(cfg, cluster, gbs, opts)
    if not result.ranked:
        raise ConfigError(_nothing_fits(cfg, cluster, opts, result))
    ranked = result.ranked if args.all else distinct(result.ranked)
    best = ranked[0]
    if args.trial:
        ranked = _trials(args, cfg, ranked[:args.trial], overrides)
        best = ranked[0]
    if args.json:
        print(json.dumps([e.to_dict() for e in ranked[:max(args.top, args.trial)]], indent=1))
    else:
        n_checked = len(result.ranked) + len(result.too_big) + len(result.rejected)
        print(f"{_describe(cfg)} on {args.gpus} × {gpu.name} ({args.gpus_per_node} per node), global batch {gbs}, "
              f"{opts.precision}: {n_checked:,} layouts: {len(result.ranked):,} fit, "
              f"{len(result.too_big):,} too big, {len(result.rejected):,} invalid")
        print()
        print("\n".join(TABLE_HEAD + [_row(i, e) for i, e in enumerate(ranked[:args.top], 1)]))
        summary = result.rejection_summary()
        if summary:
            print("\nrejected:")
            for count, reason, cand in summary:
                print(f"  {count:>6} × {reason} (e.g. {cand.label()})")
        print(f"\nbest: {best.candidate.label()}\n  overrides: {' '.join(best.candidate.overrides())}")
    if args.write_config:
        print(f"wrote {write_config(best.candidate.apply(cfg, gbs), args.write_config)}", file=sys.stderr)
    return 0


def _describe(cfg: Config) -> str:
    from meshlm.plan.cost import _family_count

    m = cfg.model
    n = _family_count(m.family)(m)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return f"{m.family} {size} ({m.n_layers} layers, hidden {m.hidden_size}, {m.n_heads} heads, seq {m.seq_len})"


def _nothing_fits(cfg: Config, cluster, opts, result) -> str:
    """One line: why no layout works, and what would (more GPUs of this type, or another type)."""
    from meshlm.plan.catalog import CATALOG
    from meshlm.plan.cost import Cluster

    if not result.too_big:
        _count, reason, cand = result.rejection_summary(1)[0]
        near = _valid_counts(cfg, cluster.gpus, cluster.gpus_per_node)
        return (f"no layout of {cluster.gpus} GPUs is valid for this model (e.g. {cand.label()}: {reason}); "
                + (f"--gpus {' or '.join(map(str, near))} would factor" if near else "try another --gpus"))
    smallest = result.too_big[0]
    need = smallest.memory_bytes / GIB
    more = _smallest_cluster(cfg, cluster, opts)
    others = [g.name for g in CATALOG.values() if g.name != cluster.gpu.name and _fits_on(cfg, Cluster(
        g, cluster.gpus, cluster.gpus_per_node), opts, result)]
    hint = f"{more} GPUs of this type would fit it" if more else "no cluster up to 64× larger fits it"
    return (f"the model does not fit on {cluster.gpus} × {cluster.gpu.name}: the leanest layout "
            f"({smallest.candidate.label()}) needs {need:,.1f} GiB per GPU, the GPU has {cluster.gpu.memory_gib:g} GiB; "
            f"{hint}" + (f"; at {cluster.gpus} GPUs, {', '.join(others)} would" if others else "")
            + "; or lower --global-batch-size / --seq-len")


def _valid_counts(cfg: Config, gpus: int, gpus_per_node: int) -> list[int]:
    """The nearest GPU counts below and above `gpus` with a valid layout (validity only, not memory)."""
    from meshlm.plan.search import candidates, check

    def valid(n: int) -> bool:
        for cand in candidates(cfg, n, gpus_per_node, cfg.train.global_batch_size):
            try:
                check(cfg, cand)
            except ConfigError:
                continue
            return True
        return False

    below = next((n for n in range(gpus - 1, 0, -1) if valid(n)), None)
    above = next((n for n in range(gpus + 1, 2 * gpus + 1) if valid(n)), None)
    return [n for n in (below, above) if n]


def _lean_space(cfg: Config, gpus: int, gpus_per_node: int) -> list:
    """The memory-leanest variant of every tp × pp: micro-batch 1, full recomputation, SP, the deepest ZeRO."""
    from meshlm.plan.cost import Candidate
    from meshlm.plan.search import divisors

    out = []
    for tp in [d for d in divisors(gpus) if d <= max(1, min(gpus_per_node, 8))]:
        for pp in [d for d in divisors(gpus // tp) if d <= cfg.model.n_layers]:
            dp = gpus // (tp * pp)
            out.append(Candidate(tp, pp, dp, 1, tp > 1, 1, "full", 0, (3 if tp == 1 else 2) if dp > 1 else 0))
    return out


def _fits_on(cfg: Config, cluster, opts, result=None) -> bool:
    from meshlm.plan.search import search

    return bool(search(cfg, cluster, cfg.train.global_batch_size, opts,
                       space=_lean_space(cfg, cluster.gpus, cluster.gpus_per_node)).ranked)


def _smallest_cluster(cfg: Config, cluster, opts) -> int | None:
    from meshlm.plan.cost import Cluster

    gpus = cluster.gpus
    for _ in range(6):
        gpus *= 2
        if _fits_on(cfg, Cluster(cluster.gpu, gpus, cluster.gpus_per_node), opts):
            return gpus
    return None


# ---- trials ------------------------------------------------------------------------------------------------
def trial_command(config: str, cand, world: int, steps: int, out_dir: str, overrides: list[str]) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] \
        if world > 1 else [sys.executable]
    return [*launcher, "-m", "meshlm", "train", "--config", config, *overrides, *cand.overrides(),
            f"--train.max_steps={steps}", "--train.log_every=1", "--train.eval_every=0", "--train.eval_iters=1",
            "--train.save_every=0", "--train.sample_tokens=0", "--train.progress=false", "--train.device=cpu",
            "--train.peak_tflops=1.0", "--train.resume=never", f"--train.out_dir={out_dir}"]


def measured_step_time(out_dir: str, statistic: str = "median") -> float:
    """The median (or the minimum: the least disturbed by other work on a shared machine) step time of a
    run's metrics.jsonl, without its first step (warm-up)."""
    times = [json.loads(line)["step_time_s"] for line in Path(out_dir, "metrics.jsonl").read_text().splitlines()
             if '"kind": "train"' in line]
    times = sorted(times[1:] or times)
    return times[0] if statistic == "min" else times[len(times) // 2]


def _trials(args: argparse.Namespace, cfg: Config, top: list, overrides: list[str]) -> list:
    """Run each layout with torchrun for --steps steps, measure, re-rank by measurement."""
    if args.gpu.strip().lower() != "this":
        print(f"note: --trial runs on this machine, not on {args.gpu}; the measured times are this machine's",
              file=sys.stderr)
    extra = [*overrides]
    if args.seq_len is not None:
        extra.append(f"--model.seq_len={args.seq_len}")
    if args.global_batch_size is not None:
        extra.append(f"--train.global_batch_size={args.global_batch_size}")
    for est in top:
        with tempfile.TemporaryDirectory(prefix="meshlm-plan-trial-") as tmp:
            cmd = trial_command(args.config, est.candidate, est.candidate.world, args.steps, tmp, extra)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"trial {est.candidate.label()} failed: {tail}", file=sys.stderr)
                est.measured_step_time_s = math.inf
                continue
            est.measured_step_time_s = measured_step_time(tmp)
    if not args.json:
        print("trials (this machine): predicted vs measured step time\n")
        print("| layout | predicted s | measured s | measured / predicted |\n|---|---|---|---|")
        for est in top:
            m = est.measured_step_time_s
            print(f"| {est.candidate.label()} | {est.step_time_s:.4f} | {m:.4f} | {m / est.step_time_s:.2f} |")
        print()
    return sorted(top, key=lambda e: e.measured_step_time_s)


# ---- serving -----------------------------------------------------------------------------------------------
def _inference(args: argparse.Namespace, cfg: Config, gpu) -> int:
    from meshlm.plan.inference import plan_serving

    precision = args.precision or ("bf16" if not gpu.name.startswith("this") else cfg.train.precision)
    elem = 4 if precision == "fp32" else 2
    ttft = args.ttft_ms / 1e3 if args.ttft_ms is not None else None
    tpot = args.tpot_ms / 1e3 if args.tpot_ms is not None else None
    rows, refused = plan_serving(cfg.model, gpu, args.gpus_per_node, args.prompt_tokens, args.output_tokens, ttft,
                                 tpot, elem)
    if not rows:
        raise ConfigError(f"the model does not fit for serving on up to {args.gpus_per_node} × {gpu.name} "
                          f"({gpu.memory_gib:g} GiB each) even at batch 1; use a GPU with more memory or more "
                          "--gpus-per-node" + (f" ({refused[0][1]})" if refused else ""))
    meeting = [r for r in rows if r.meets]
    if args.json:
        print(json.dumps([r.to_dict() for r in rows[:args.top]], indent=1))
        return 0
    targets = ", ".join(t for t in (f"TTFT <= {args.ttft_ms:g} ms" if ttft else "",
                                    f"TPOT <= {args.tpot_ms:g} ms" if tpot else "") if t) or "none (max throughput)"
    print(f"serving {_describe(cfg)} on {gpu.name}, prompts of {args.prompt_tokens} tokens, "
          f"{args.output_tokens} generated, {precision}; targets: {targets}\n")
    print("| rank | tp | batch | memory GiB | KV cache/request MiB | TTFT ms | TPOT ms | tokens/s (replica) | "
          "tokens/s per GPU | meets targets |\n|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows[:args.top], 1):
        print(f"| {i} | {r.tp} | {r.batch} | {r.memory_bytes / GIB:,.1f} | {r.kv_per_request_bytes / 2 ** 20:,.1f} | "
              f"{r.ttft_s * 1e3:,.1f} | {r.tpot_s * 1e3:,.2f} | {r.tokens_per_s:,.0f} | "
              f"{r.tokens_per_s_per_gpu:,.0f} | {'yes' if r.meets else 'no'} |")
    for tp, reason in refused:
        print(f"tp={tp} refused: {reason}")
    if meeting:
        b = meeting[0]
        print(f"\nbest: tp={b.tp}, batch {b.batch}: {b.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, TTFT "
              f"{b.ttft_s * 1e3:,.1f} ms, TPOT {b.tpot_s * 1e3:,.2f} ms")
    else:
        fastest = min(rows, key=lambda r: r.tpot_s)
        print(f"\nno (tp, batch) meets the targets; the lowest TPOT is tp={fastest.tp}, batch {fastest.batch}: "
              f"TTFT {fastest.ttft_s * 1e3:,.1f} ms, TPOT {fastest.tpot_s * 1e3:,.2f} ms")
    return 0
