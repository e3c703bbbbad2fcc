"""`meshlm plan` (its parser: `commands/plan.py`): the layout for a model on a cluster, for training (ranked,
explained, tried) or serving: `run_plan` reads the inputs, runs the search (`plan/search.py`), prints the
table, one layout's terms (`--explain`) or the serving plan, runs the trials (`plan/trials.py`) and writes the
winner's config.

docs/plan.md describes the cost model; `benchmarks/plan_validation.py` holds it to published measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from meshlm.core.config import Config, ConfigError, load_config
from meshlm.core.layout import factor_world
from meshlm.families.registry import get_spec
from meshlm.plan.catalog import (
    CATALOG,
    OVERRIDABLE,
    get_gpu,
    measure_links,
    measure_this,
    share_cores,
    with_overrides,
)
from meshlm.plan.cost import Candidate, Cluster, Options
from meshlm.plan.inference import plan_serving
from meshlm.plan.search import candidates, check, distinct, divisors, evaluate, search
from meshlm.plan.trials import run_trials

GIB = 2 ** 30
LAYOUT_KEYS = {"tp", "pp", "dp", "vpp", "sp", "mbs", "micro_batch_size", "recompute", "zero"}


# ---- inputs ------------------------------------------------------------------------------------------------
def _gpu(args: argparse.Namespace):
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
    # the --gpu-NAME options of commands/plan.py, one per overridable field (--gpu-memory-gb: memory_gib)
    values = {key: getattr(args, "gpu_" + key.replace("memory_gib", "memory_gb")) for key in OVERRIDABLE}
    return with_overrides(gpu, **values)


def _config(args: argparse.Namespace, overrides: list[str]) -> Config:
    extra = []
    if args.seq_len is not None:
        extra.append(f"--model.seq_len={args.seq_len}")
    if args.global_batch_size is not None:
        extra.append(f"--train.global_batch_size={args.global_batch_size}")
    return load_config(args.config, [*overrides, *extra])


def parse_layout(text: str, gpus: int, cfg: Config):
    """'tp=8,pp=8,dp=16,sp=true,mbs=1,recompute=selective,zero=1' → Candidate (dp defaults to fill --gpus)."""
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
    try:  # the world's rule (core.layout.factor_world), for the --gpus of the cluster; dp defaults to fill it
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
    c = e.candidate
    lines = [f"layout {c.label()}: {cfg.model.n_layers} layers of hidden {cfg.model.hidden_size}, "
             f"global batch {cfg.train.global_batch_size} × {cfg.model.seq_len} tokens"
             + f", {get_spec(cfg.model.family).parameter_count(cfg.model) / 1e9:.2f}B parameters",
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
def run_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    """`meshlm plan` with the parsed `args` (commands/plan.py has checked the cluster's numbers) and the config
    `overrides`: the exit status."""
    cfg = _config(args, overrides)
    gpu = _gpu(args)
    if args.inference:
        return _inference(args, cfg, gpu)
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
        ranked = run_trials(args, ranked[:args.trial], overrides)
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
    m = cfg.model
    n = get_spec(m.family).parameter_count(m)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return f"{m.family} {size} ({m.n_layers} layers, hidden {m.hidden_size}, {m.n_heads} heads, seq {m.seq_len})"


def _nothing_fits(cfg: Config, cluster, opts, result) -> str:
    """One line: why no layout works, and what would (more GPUs of this type, or another type)."""
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
    out = []
    for tp in [d for d in divisors(gpus) if d <= max(1, min(gpus_per_node, 8))]:
        for pp in [d for d in divisors(gpus // tp) if d <= cfg.model.n_layers]:
            dp = gpus // (tp * pp)
            out.append(Candidate(tp, pp, dp, 1, tp > 1, 1, "full", 0, (3 if tp == 1 else 2) if dp > 1 else 0))
    return out


def _fits_on(cfg: Config, cluster, opts, result=None) -> bool:
    return bool(search(cfg, cluster, cfg.train.global_batch_size, opts,
                       space=_lean_space(cfg, cluster.gpus, cluster.gpus_per_node)).ranked)


def _smallest_cluster(cfg: Config, cluster, opts) -> int | None:
    gpus = cluster.gpus
    for _ in range(6):
        gpus *= 2
        if _fits_on(cfg, Cluster(cluster.gpu, gpus, cluster.gpus_per_node), opts):
            return gpus
    return None


# ---- serving -----------------------------------------------------------------------------------------------
def _inference(args: argparse.Namespace, cfg: Config, gpu) -> int:
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
