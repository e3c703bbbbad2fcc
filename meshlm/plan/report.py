"""`meshlm plan` (its parser: `commands/plan.py`): the layout for a model on a cluster, for training (ranked,
explained, tried) or serving: `run_plan` reads the inputs, runs the search (`plan/search.py`), prints the
table, one layout's terms (`--explain`) or the serving plan, runs the trials (`plan/trials.py`) and writes the
winner's config.

docs/plan.md describes the cost model; `benchmarks/plan_validation.py` holds it to published measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
from meshlm.plan.cost import RUNTIMES, Candidate, Cluster, Options
from meshlm.plan.inference import plan_serving
from meshlm.plan.options import PlanOptions
from meshlm.plan.search import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_GPUS,
    candidates,
    check,
    cp_sizes,
    distinct,
    evaluate,
    pp_sizes,
    search,
    smallest_dp,
    tp_sizes,
)
from meshlm.plan.trials import run_trials

GIB = 2 ** 30
LAYOUT_KEYS = {"tp", "cp", "pp", "dp", "vpp", "sp", "mbs", "micro_batch_size", "recompute", "zero", "ep"}


# ---- inputs ------------------------------------------------------------------------------------------------
def _gpu(plan: PlanOptions):
    if plan.gpu.strip().lower() == "this":
        threads = None
        if plan.gpus > 1:  # torchrun gives each process one thread (OMP_NUM_THREADS=1)
            threads = 1
        gpu = measure_this(threads, cores=os.cpu_count() if threads == 1 else None)
        if threads == 1:
            if plan.gpu_intra_gbps is None or plan.gpu_intra_latency_us is None:  # not both given: measure
                gbps, latency, gather = measure_links()  # gloo between two busy processes on this host
                gpu = with_overrides(gpu, intra_gbps=gbps, inter_gbps=gbps, intra_latency_us=latency,
                                     inter_latency_us=latency, gather_cost=gather)
            gpu = share_cores(gpu)
    else:
        gpu = get_gpu(plan.gpu)
    # the --gpu-NAME options of commands/plan.py, one per overridable field (--gpu-memory-gb: memory_gib)
    values = {key: getattr(plan, "gpu_" + key.replace("memory_gib", "memory_gb")) for key in OVERRIDABLE}
    return with_overrides(gpu, **values)


def _config(plan: PlanOptions, overrides: list[str]) -> Config:
    extra = []
    if plan.seq_len is not None:
        extra.append(f"--model.seq_len={plan.seq_len}")
    if plan.global_batch_size is not None:
        extra.append(f"--train.global_batch_size={plan.global_batch_size}")
    return load_config(plan.config, [*overrides, *extra])


def parse_layout(text: str, gpus: int) -> dict:
    """'tp=8,pp=8,dp=16,sp=true,mbs=1,recompute=selective,zero=1' → the fields it gives, by `Candidate` field
    name (recompute as (mode, N)); the search completes the others (`search.candidates(given=...)`). The
    given parallel sizes must factor --gpus; with tp and pp given, cp is 1 unless given and dp fills the rest."""
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if not eq or key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout {text!r}: {part!r} is not key=value with key one of "
                              f"{', '.join(sorted(LAYOUT_KEYS))}; e.g. tp=8,pp=8,dp=16,sp=true,recompute=selective")
        values["micro_batch_size" if key == "mbs" else key] = value.strip()
    given: dict = {}
    for key in ("tp", "cp", "pp", "dp", "vpp", "micro_batch_size", "zero", "ep"):
        if key in values:
            raw, least = values[key], 0 if key == "zero" else 1
            if not raw.isdigit() or int(raw) < least:
                name = "mbs" if key == "micro_batch_size" else key
                raise ConfigError(f"--layout {name}={raw!r} must be a whole number >= {least}")
            given[key] = int(raw)
    _check_world(text, gpus, given)
    if "sp" in values:
        sp_raw = values["sp"].lower()
        if sp_raw not in ("true", "false", "1", "0"):
            raise ConfigError(f"--layout sp={sp_raw!r} must be true or false")
        given["sp"] = sp_raw in ("true", "1")
    if "recompute" in values:
        rec, _, n = values["recompute"].partition(":")
        if rec not in ("none", "selective", "full") or (n and (rec != "full" or not n.isdigit())):
            raise ConfigError(f"--layout recompute={values['recompute']!r} must be none, selective, full or full:N "
                              "(the first N layers of each stage)")
        given["recompute"] = (rec, int(n or 0))
    return given


def _check_world(text: str, gpus: int, given: dict) -> None:
    """The given tp, cp, pp, dp against --gpus: the world's rule (`core.layout.factor_world`, on the --gpus / cp
    ranks of one context-parallel position) when tp and pp are both given (cp then 1 unless given, dp filling
    the world), else the given sizes must divide it."""
    try:
        if "tp" in given and "pp" in given:
            cp = given.get("cp", 1)
            pp, dp, tp = factor_world(gpus, given["tp"], given["pp"], given.get("dp", 0), cp)
            given.update(tp=tp, cp=cp, pp=pp, dp=dp)
            return
        sizes = {k: given[k] for k in ("tp", "cp", "pp", "dp") if k in given}
        product = math.prod(sizes.values())
        if gpus % product:
            named = " × ".join(f"{k}={v}" for k, v in sizes.items()) + (f" = {product}" if len(sizes) > 1 else "")
            raise ConfigError(f"{named} does not divide the {gpus} GPUs; give sizes whose product divides --gpus")
    except ConfigError as err:
        raise ConfigError(f"--layout {text!r} on --gpus {gpus}: {err}") from None


def _options(plan: PlanOptions, cfg: Config, gpu):
    """What runs: meshlm (the config's loss, the GPU's device) or a preset runtime (`cost.RUNTIMES`)."""
    this = gpu.name.startswith("this")
    preset = RUNTIMES[plan.runtime]
    if preset is not None:
        return dataclasses.replace(preset, precision=plan.precision or preset.precision)
    device = "cpu" if gpu.name == "this (cpu)" else "cuda"
    precision = plan.precision or (cfg.train.precision if this else "bf16")
    return Options(precision=precision, device_type=device, fused_loss=cfg.train.fused_loss)


# ---- output ------------------------------------------------------------------------------------------------
def _row(i: int | str, e) -> str:
    c = e.candidate
    return (f"| {i} | {c.tp} | {c.pp} | {c.vpp} | {c.dp} | {c.cp} | {c.ep} | {'yes' if c.sp else 'no'} | "
            f"{c.micro_batch_size} | "
            f"{c.recompute_label} | {c.zero} | {e.memory_bytes / GIB:,.1f} | {_secs(e.step_time_s)} | "
            f"{e.tokens_per_s:,.0f} | {_tflops(e.tflops_per_gpu)} | {100 * e.mfu:.1f}% |")


def _secs(x: float) -> str:
    return f"{x:.3g}"


def _tflops(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


TABLE_HEAD = [("| rank | tp | pp | vpp | dp | cp | ep | sp | mbs | recompute | zero | memory GiB | step s | tokens/s | "
              "TFLOP/s/GPU | MFU |"), "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


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
def run_plan(plan: PlanOptions, overrides: list[str]) -> int:
    """`meshlm plan` with its typed flags `plan` (commands/plan.py has checked the cluster's numbers) and the config
    `overrides`: the exit status."""
    _check_bounds(plan)
    cfg = _config(plan, overrides)
    gpu = _gpu(plan)
    if plan.inference:
        return _inference(plan, cfg, gpu)
    _check_batch(cfg.train.global_batch_size, "train.global_batch_size=")
    cluster = Cluster(gpu, plan.gpus, plan.gpus_per_node)
    opts = _options(plan, cfg, gpu)
    gbs = cfg.train.global_batch_size
    if plan.layout or plan.explain:
        return _one_layout(plan, cfg, cluster, opts)
    result = search(cfg, cluster, gbs, opts)
    if not result.ranked:
        raise ConfigError(_nothing_fits(cfg, cluster, opts, result))
    ranked = result.ranked if plan.all else distinct(result.ranked)
    best = ranked[0]
    if plan.trial:
        ranked = run_trials(plan, ranked[:plan.trial], overrides)
        best = ranked[0]
    if plan.json:
        print(json.dumps([e.to_dict() for e in ranked[:max(plan.top, plan.trial)]], indent=1))
    else:
        n_checked = len(result.ranked) + len(result.too_big) + len(result.rejected)
        print(f"{_describe(cfg)} on {plan.gpus} × {gpu.name} ({plan.gpus_per_node} per node), global batch {gbs}, "
              f"{opts.precision}: {n_checked:,} layouts: {len(result.ranked):,} fit, "
              f"{len(result.too_big):,} too big, {len(result.rejected):,} invalid")
        print()
        print("\n".join(TABLE_HEAD + [_row(i, e) for i, e in enumerate(ranked[:plan.top], 1)]))
        summary = result.rejection_summary()
        if summary:
            print("\nrejected:")
            for count, reason, cand in summary:
                print(f"  {count:>6} × {reason} (e.g. {cand.label()})")
        print(f"\nbest: {best.candidate.label()}\n  overrides: {' '.join(best.candidate.overrides())}")
    if plan.write_config:
        print(f"wrote {write_config(best.candidate.apply(cfg, gbs), plan.write_config)}", file=sys.stderr)
    return 0


# ---- bounds ------------------------------------------------------------------------------------------------
def _check_bounds(plan: PlanOptions) -> None:
    """Sizes beyond any real cluster or batch are refused before any work (a billion GPUs used to hang)."""
    for flag, value in (("--gpus", plan.gpus), ("--gpus-per-node", plan.gpus_per_node)):
        if value > MAX_GPUS:
            raise ConfigError(f"{flag} {value} is more GPUs than the planner plans for (at most {MAX_GPUS:,} = "
                              "2^20); give the cluster's real size")
    if plan.global_batch_size is not None:
        _check_batch(plan.global_batch_size, "--global-batch-size ")


def _check_batch(value: int, name: str) -> None:
    if not 1 <= value <= MAX_GLOBAL_BATCH_SIZE:
        raise ConfigError(f"{name}{value} is out of range: give 1 to {MAX_GLOBAL_BATCH_SIZE:,} sequences per step "
                          "(2^24)")


# ---- one layout (--layout, --explain): the given fields, completed by the search ---------------------------
def _one_layout(plan: PlanOptions, cfg: Config, cluster: Cluster, opts) -> int:
    text = plan.layout or plan.explain
    given = parse_layout(text, cluster.gpus)
    gbs = cfg.train.global_batch_size
    result = search(cfg, cluster, gbs, opts, space=candidates(cfg, cluster.gpus, cluster.gpus_per_node, gbs, given))
    if result.ranked:
        est = result.ranked[0]
    elif result.too_big and plan.explain:  # the terms of the leanest completion say why it does not fit
        est = evaluate(cfg, result.too_big[0].candidate, cluster, gbs, opts)  # with its time (the search skips it)
    else:
        raise ConfigError(_layout_does_not_fit(cfg, cluster, opts, text, given, result))
    cand = est.candidate
    chosen = [name for name, key in LAYOUT_FIELDS if key not in given]
    if plan.json:
        print(json.dumps([est.to_dict()], indent=1))
    elif plan.explain:
        print(explain(est, cand.apply(cfg, gbs)))
    else:
        print("\n".join(TABLE_HEAD + [_row(1, est)]))
        print(f"fits in {cluster.gpu.memory_gib:g} GiB; "
              + (f"completed by the search: {', '.join(chosen)}; " if chosen else "")
              + f"overrides: {' '.join(cand.overrides())}")
    if plan.write_config:
        print(f"wrote {write_config(cand.apply(cfg, gbs), plan.write_config)}", file=sys.stderr)
    return 0


# (--layout name, `parse_layout` key), in `Candidate.label`'s order
LAYOUT_FIELDS = [("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("dp", "dp"), ("cp", "cp"), ("sp", "sp"),
                 ("mbs", "micro_batch_size"), ("recompute", "recompute"), ("zero", "zero"), ("ep", "ep")]


def _layout_does_not_fit(cfg: Config, cluster: Cluster, opts, text: str, given: dict, result) -> str:
    """One line: the given fields have no valid completion (the rule that refuses them), or none that fits
    (the leanest one's memory, the excess, its largest term, and which given fields, left open, would fit)."""
    where = f"--layout {text!r} on {cluster.gpus} × {cluster.gpu.name}"
    if not result.too_big:
        if not result.rejected:
            return f"{where}: the search has no completion of it ({_no_candidates(cfg, cluster)})"
        _count, reason, _cand = result.rejection_summary(1)[0]
        return f"{where}: {reason}"
    lean = result.too_big[0]
    need, limit = lean.memory_bytes / GIB, cluster.gpu.memory_gib
    largest = max(lean.memory, key=lean.memory.get)
    what = "it" if len(result.too_big) == 1 and not result.rejected else f"its leanest completion ({lean.candidate.label()})"
    freed = _fits_when_open(cfg, cluster, opts, given)
    return (f"{where} does not fit: {what} needs {need:,.1f} GiB per GPU, {need - limit:,.1f} GiB more than the "
            f"{cluster.gpu.name}'s {limit:g} GiB (the largest term: {largest}, {lean.memory[largest] / GIB:,.1f} GiB); "
            + (f"it fits with {' or '.join(freed)} open (leave it out of --layout)" if freed else
               "no single given field left open would fit it: lower --global-batch-size / --seq-len, or more GPUs")
            + "; --explain shows every term")


def _fits_when_open(cfg: Config, cluster: Cluster, opts, given: dict) -> list[str]:
    """The given fields of which leaving one open (the search completing it) finds a layout that fits."""
    gbs = cfg.train.global_batch_size
    out = []
    for name, key in LAYOUT_FIELDS:
        if key not in given:
            continue
        rest = {k: v for k, v in given.items() if k != key}
        if key in ("tp", "pp", "cp") and "dp" in rest:  # tp, cp, pp and dp fix each other: open dp with it
            rest.pop("dp")
        space = candidates(cfg, cluster.gpus, cluster.gpus_per_node, gbs, rest)
        if search(cfg, cluster, gbs, opts, space=space).ranked:
            out.append(name)
    return out


def _describe(cfg: Config) -> str:
    m = cfg.model
    n = get_spec(m.family).parameter_count(m)
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    return f"{m.family} {size} ({m.n_layers} layers, hidden {m.hidden_size}, {m.n_heads} heads, seq {m.seq_len})"


def _nothing_fits(cfg: Config, cluster, opts, result) -> str:
    """One line: why no layout works, and what would (more GPUs of this type, or another type)."""
    if not result.too_big and not result.rejected:
        return _no_candidates(cfg, cluster)
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


def _no_candidates(cfg: Config, cluster) -> str:
    """Why the search has no layout at all: the global batch cannot give every data-parallel rank a sequence
    (the smallest dp of a valid layout: the world over its largest valid tp · pp)."""
    gbs = cfg.train.global_batch_size
    least = smallest_dp(cfg, cluster.gpus, cluster.gpus_per_node)
    if least is None:
        return (f"no tp × pp of {cluster.gpus:,} GPUs is valid for this model (tp up to "
                f"{min(cluster.gpus_per_node, 8)}, pp up to the {cfg.model.n_layers} layers); try another --gpus")
    return (f"no layout of {cluster.gpus:,} GPUs can split --global-batch-size {gbs} (train.global_batch_size): "
            f"every valid layout has dp >= {least:,} (tp up to {min(cluster.gpus_per_node, 8)}, pp up to the "
            f"{cfg.model.n_layers} layers), one sequence per data-parallel rank at least; give --global-batch-size "
            f"of at least {least} (a multiple of it), or fewer --gpus")


def _valid_counts(cfg: Config, gpus: int, gpus_per_node: int, tries: int = 64) -> list[int]:
    """The nearest GPU counts below and above `gpus` with a valid layout (validity only, not memory), whole
    nodes beyond one node, at most `tries` counts each way."""
    def valid(n: int) -> bool:
        for cand in candidates(cfg, n, gpus_per_node, cfg.train.global_batch_size):
            try:
                check(cfg, cand)
            except ConfigError:
                continue
            return True
        return False

    step = gpus_per_node if gpus > gpus_per_node else 1
    below = next((n for n in range(gpus - step, max(0, gpus - step * tries), -step) if valid(n)), None)
    above = next((n for n in range(gpus + step, gpus + step * tries + 1, step) if valid(n)), None)
    return [n for n in (below, above) if n]


def _lean_space(cfg: Config, gpus: int, gpus_per_node: int) -> list:
    """The memory-leanest variant of every tp × cp × pp: micro-batch 1, full recomputation, SP, the deepest
    ZeRO."""
    out = []
    for tp in tp_sizes(gpus, gpus_per_node):
        for cp in cp_sizes(gpus, tp, cfg.model.seq_len):
            for pp in pp_sizes(gpus, tp * cp, cfg.model.n_layers):
                dp = gpus // (tp * cp * pp)
                zero = (3 if tp == 1 else 2) if dp * cp > 1 else 0
                out.append(Candidate(tp, pp, dp, 1, tp > 1, 1, "full", 0, zero, cp))
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
def _inference(plan: PlanOptions, cfg: Config, gpu) -> int:
    precision = plan.precision or ("bf16" if not gpu.name.startswith("this") else cfg.train.precision)
    elem = 4 if precision == "fp32" else 2
    for flag, value in (("--ttft-ms", plan.ttft_ms), ("--tpot-ms", plan.tpot_ms)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value} must be a finite number of milliseconds > 0 (or leave it out)")
    ttft = plan.ttft_ms / 1e3 if plan.ttft_ms is not None else None
    tpot = plan.tpot_ms / 1e3 if plan.tpot_ms is not None else None
    rows, refused = plan_serving(cfg.model, gpu, plan.gpus_per_node, plan.prompt_tokens, plan.output_tokens, ttft,
                                 tpot, elem)
    if not rows:
        raise ConfigError(f"the model does not fit for serving on up to {plan.gpus_per_node} × {gpu.name} "
                          f"({gpu.memory_gib:g} GiB each) even at batch 1; use a GPU with more memory or more "
                          "--gpus-per-node" + (f" ({refused[0][1]})" if refused else ""))
    meeting = [r for r in rows if r.meets]
    if plan.json:
        print(json.dumps([r.to_dict() for r in rows[:plan.top]], indent=1))
        return 0
    targets = ", ".join(t for t in (f"TTFT <= {plan.ttft_ms:g} ms" if ttft else "",
                                    f"TPOT <= {plan.tpot_ms:g} ms" if tpot else "") if t) or "none (max throughput)"
    print(f"serving {_describe(cfg)} on {gpu.name}, prompts of {plan.prompt_tokens} tokens, "
          f"{plan.output_tokens} generated, {precision}; targets: {targets}\n")
    print("| rank | tp | batch | memory GiB | KV cache/request MiB | TTFT ms | TPOT ms | tokens/s (replica) | "
          "tokens/s per GPU | meets targets |\n|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows[:plan.top], 1):
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
