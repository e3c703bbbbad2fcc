"""The layout search: every tp × cp × pp × dp factorisation of the cluster (cp: context parallelism, tried
for long sequences) with its virtual stages, sequence parallelism, micro-batch size, recomputation and ZeRO
stage; each checked by the validity rules of `core.layout` (the ones `parallelize` applies) and costed by
`plan.cost`; ranked by predicted throughput among those that fit in memory (arithmetic, no tensors)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshlm.core.config import Config, ConfigError
from meshlm.core.layout import Layout, check_config, plan_layout
from meshlm.families.registry import get_spec
from meshlm.plan.cost import Calibration, Candidate, Cluster, Estimate, Options, estimate

MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_STAGES = (1, 2, 3, 4, 6, 8)
# Beyond any cluster or batch the planner is meant for (`meshlm plan` refuses them in one line): 2^20 GPUs
# (the largest clusters built hold a few hundred thousand), 2^24 sequences per step (published runs take a
# few thousand; 16 M tokens at sequence 1)
MAX_GPUS = 2 ** 20
MAX_GLOBAL_BATCH_SIZE = 2 ** 24
# Context parallelism is searched only while each rank keeps at least this many tokens of the sequence, so from
# 8,192-token sequences up (Megatron-Core's advice for cp): shorter ring blocks are kernels the model does not
# price (docs/plan.md, "Context parallelism"), and the bound keeps the search to a few cp sizes. `--layout
# cp=N` is judged at any size.
CP_MIN_TOKENS_PER_RANK = 4096


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, from those up to √n (n can be a cluster of a million GPUs)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_sizes(world: int, gpus_per_node: int) -> list[int]:
    """The tensor-parallel sizes the search tries: divisors of the world within a node, up to 8."""
    return [d for d in divisors(world) if d <= max(1, min(gpus_per_node, 8))]


def cp_sizes(world: int, tp: int, seq_len: int) -> list[int]:
    """The context-parallel sizes the search tries with `tp`: 1, and the divisors of world / tp that cut the
    sequence into 2·cp equal chunks (the causal load balance) of at least CP_MIN_TOKENS_PER_RANK / 2 tokens."""
    if world % tp:
        return []
    return [d for d in divisors(world // tp)
            if d == 1 or (seq_len % (2 * d) == 0 and seq_len // d >= CP_MIN_TOKENS_PER_RANK)]


def pp_sizes(world: int, tp: int, n_layers: int) -> list[int]:
    """The pipeline sizes the search tries with `tp`: divisors of world / tp, at most one layer per stage."""
    return [d for d in divisors(world // tp) if d <= n_layers] if world % tp == 0 else []


def smallest_dp(cfg: Config, world: int, gpus_per_node: int) -> int | None:
    """The smallest data-parallel size of a valid layout of the search for this world (the largest valid
    tp · cp · pp, micro-batch 1, one micro-batch), so the smallest global batch in sequences any layout can
    split; None when no tp · cp · pp is valid for the model."""
    best = None
    for tp in tp_sizes(world, gpus_per_node):
        for cp in cp_sizes(world, tp, cfg.model.seq_len):
            for pp in pp_sizes(world, tp * cp, cfg.model.n_layers):
                dp = world // (tp * cp * pp)
                if best is not None and dp >= best:
                    continue
                try:
                    check(cfg, Candidate(tp, pp, dp, cp=cp), global_batch_size=dp)
                except ConfigError:
                    continue
                best = dp
    return best


def check(cfg: Config, cand: Candidate, global_batch_size: int | None = None,
          memo: dict | None = None) -> tuple[Config, Layout]:
    """The candidate's config and layout, or the ConfigError the config validation or `parallelize`'s
    `plan_layout` would raise for it (the same message). `memo` keeps the two sections' verdicts across
    the candidates of one base config (a search)."""
    # the sections a search's candidates share are built once (`memo["sections"]` keeps them alive, so their
    # identity keys their verdicts below)
    run = cand.apply(cfg, global_batch_size, None if memo is None else memo.setdefault("sections", {}))
    # The sections a layout changes (the others are the base config's, validated once by load_config),
    # in Config.validate's order (train before parallel), then layout.check_config, as Config.validate
    # runs them, then parallelize's plan_layout.
    for section in (run.train, run.parallel):
        _validated(section, memo)
    check_config(run)
    spec = get_spec(run.model.family)
    return run, plan_layout(run, cand.pp, cand.dp, cand.tp, spec.stage_costs(run.model), cp=cand.cp,
                            decoder=spec.decoder)


def _validated(section, memo: dict | None) -> None:
    if memo is None:
        section.validate()
        return
    key = ("verdict", id(section))  # a section of memo["sections"], alive as long as the memo
    if key not in memo:
        try:
            section.validate()
            memo[key] = None
        except ConfigError as err:
            memo[key] = str(err)
    if memo[key] is not None:
        raise ConfigError(memo[key])


def candidates(cfg: Config, world: int, gpus_per_node: int, global_batch_size: int,
               given: dict | None = None) -> list[Candidate]:
    """The search space. tp stays within a node (its collectives are the most frequent), up to 8; cp comes
    next in the mesh (`cp_sizes`: long sequences only).

    `given` (`--layout`: any of tp, cp, pp, dp, vpp, sp, micro_batch_size, recompute as (mode, N), zero, ep) fixes
    those fields, even outside the ranges searched (the validity rules judge them); the others range as in
    the full search: the completions of a partial layout. An MoE model's ep ranges over `ep_sizes`."""
    g = given or {}
    out = []
    for tp in [g["tp"]] if "tp" in g else tp_sizes(world, gpus_per_node):
        for cp in [g["cp"]] if "cp" in g else cp_sizes(world, tp, cfg.model.seq_len):
            for pp in [g["pp"]] if "pp" in g else pp_sizes(world, tp * cp, cfg.model.n_layers):
                if world % (tp * cp * pp) or ("dp" in g and g["dp"] * tp * cp * pp != world):
                    continue
                out += _variants(cfg, g, tp, cp, pp, world // (tp * cp * pp), global_batch_size)
    return out


def _variants(cfg: Config, g: dict, tp: int, cp: int, pp: int, dp: int, global_batch_size: int) -> list[Candidate]:
    """The candidates of one tp × cp × pp × dp: virtual stages, SP, micro-batch, recomputation, ZeRO (over the
    dp × cp ranks that reduce gradients)."""
    n_layers, out = cfg.model.n_layers, []
    for vpp in _given_or(g, "vpp", VIRTUAL_STAGES if pp > 1 else (1,)):
        if "vpp" not in g and (pp * vpp > n_layers or (vpp > 1 and n_layers % (pp * vpp))):
            continue
        stage = max(1, n_layers // (pp * vpp))
        recomputes = [("none", 0), ("selective", 0), ("full", 0)]
        recomputes += [("full", n) for n in sorted({stage // 4, stage // 2, 3 * stage // 4}) if 0 < n < stage]
        for sp in _given_or(g, "sp", (False, True) if tp > 1 else (False,)):
            for mbs in _given_or(g, "micro_batch_size", MICRO_BATCH_SIZES):
                if "micro_batch_size" not in g and mbs * dp > global_batch_size:
                    continue
                for rec, n in _given_or(g, "recompute", recomputes):
                    for zero in _given_or(g, "zero", (0, 1, 2, 3) if dp * cp > 1 else (0,)):
                        for ep in _given_or(g, "ep", ep_sizes(cfg, dp * cp)):
                            out.append(Candidate(tp, pp, dp, vpp, sp, mbs, rec, n, zero, cp, ep))
    return out


def ep_sizes(cfg: Config, replicas: int) -> list[int]:
    """The expert-parallel sizes the search tries: 1, and for an MoE model the divisors of the dp × cp
    `replicas` that divide model.moe_experts (ZeRO-3 with ep > 1 is refused by the validity rules)."""
    if cfg.model.moe_experts <= 0:
        return [1]
    return [d for d in divisors(replicas) if cfg.model.moe_experts % d == 0]


def _given_or(given: dict, key: str, searched):
    return [given[key]] if key in given else searched


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fit in memory, fastest first
    too_big: list[Estimate]  # valid, but over the GPU's memory; smallest first; memory only (no time terms)
    rejected: list[tuple[Candidate, str]] = field(default_factory=list)  # invalid, with the rule's message

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def rejection_summary(self, limit: int = 8) -> list[tuple[int, str, Candidate]]:
        """(count, reason, an example) for the most common reasons, memory included."""
        groups: dict[str, list] = {}  # key → [count, the first message, its layout]
        for cand, reason in self.rejected:
            groups.setdefault(_reason_key(reason), [0, reason, cand])[0] += 1
        for est in self.too_big:
            reason = (f"needs {est.memory_bytes / 2 ** 30:,.2f} GiB per GPU, more than the GPU's "
                      f"{est.memory_limit / 2 ** 30:g} GiB")
            groups.setdefault("memory", [0, reason, est.candidate])[0] += 1
        ordered = sorted(groups.values(), key=lambda g: -g[0])[:limit]
        return [(count, reason, cand) for count, reason, cand in ordered]


def distinct(ranked: list[Estimate]) -> list[Estimate]:
    """The best variant (virtual stages, micro-batch size, recompute depth, ZeRO stage) of each parallel
    layout (tp, cp, pp, dp, sp, recompute mode), in rank order: the table's rows."""
    seen, out = set(), []
    for est in ranked:
        c = est.candidate
        key = (c.tp, c.cp, c.pp, c.dp, c.sp, c.recompute, c.ep)
        if key not in seen:
            seen.add(key)
            out.append(est)
    return out


def _reason_key(reason: str) -> str:
    """Group messages that differ only in the layout's numbers."""
    return "".join("#" if ch.isdigit() else ch for ch in reason)


def evaluate(cfg: Config, cand: Candidate, cluster: Cluster, global_batch_size: int, opts: Options | None = None,
             cal: Calibration | None = None, memo: dict | None = None, time_too_big: bool = True) -> Estimate:
    """One layout: its estimate (`time_too_big=False`: without the time of a layout that does not fit), or the
    ConfigError that refuses it."""
    run, layout = check(cfg, cand, global_batch_size, memo)
    return estimate(run, layout, cand, cluster, opts, cal, time_too_big)


def search(cfg: Config, cluster: Cluster, global_batch_size: int, opts: Options | None = None,
           cal: Calibration | None = None, space: list[Candidate] | None = None) -> SearchResult:
    result = SearchResult([], [])
    memo: dict = {}
    for cand in space if space is not None else candidates(cfg, cluster.gpus, cluster.gpus_per_node,
                                                            global_batch_size):
        try:
            est = evaluate(cfg, cand, cluster, global_batch_size, opts, cal, memo, time_too_big=False)
        except ConfigError as err:
            result.rejected.append((cand, str(err)))
            continue
        (result.ranked if est.fits else result.too_big).append(est)
    result.ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory_bytes))
    result.too_big.sort(key=lambda e: e.memory_bytes)
    return result
