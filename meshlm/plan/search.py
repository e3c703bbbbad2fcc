"""The layout search: every tp × pp × dp factorisation of the cluster with its virtual stages, sequence
parallelism, micro-batch size, recomputation and ZeRO stage; each checked by the validity rules of
`core.layout` (the ones `parallelize` applies) and costed by `plan.cost`; ranked by predicted throughput
among those that fit in memory (arithmetic, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshlm.core.config import Config, ConfigError
from meshlm.core.layout import Layout, check_config, plan_layout
from meshlm.families.registry import get_spec
from meshlm.plan.cost import Calibration, Candidate, Cluster, Estimate, Options, estimate

MICRO_BATCH_SIZES = (1, 2, 4, 8)
VIRTUAL_STAGES = (1, 2, 3, 4, 6, 8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(cfg: Config, cand: Candidate, global_batch_size: int | None = None,
          memo: dict | None = None) -> tuple[Config, Layout]:
    """The candidate's config and layout, or the ConfigError the config validation or `parallelize`'s
    `plan_layout` would raise for it (the same message). `memo` keeps the two sections' verdicts across
    the candidates of one base config (a search)."""
    run = cand.apply(cfg, global_batch_size)
    # The sections a layout changes (the others are the base config's, validated once by load_config),
    # in Config.validate's order (train before parallel), then layout.check_config, as Config.validate
    # runs them, then parallelize's plan_layout.
    for section in (run.train, run.parallel):
        _validated(section, memo)
    check_config(run)
    return run, plan_layout(run, cand.pp, cand.dp, cand.tp, get_spec(run.model.family).stage_costs(run.model))


def _validated(section, memo: dict | None) -> None:
    if memo is None:
        section.validate()
        return
    key = repr(section)  # the whole section: equal text, equal verdict
    if key not in memo:
        try:
            section.validate()
            memo[key] = None
        except ConfigError as err:
            memo[key] = str(err)
    if memo[key] is not None:
        raise ConfigError(memo[key])


def candidates(cfg: Config, world: int, gpus_per_node: int, global_batch_size: int) -> list[Candidate]:
    """The search space. tp stays within a node (its collectives are the most frequent), up to 8."""
    m = cfg.model
    out = []
    for tp in divisors(world):
        if tp > max(1, min(gpus_per_node, 8)):
            continue
        for pp in divisors(world // tp):
            if pp > m.n_layers:
                continue
            dp = world // (tp * pp)
            for vpp in VIRTUAL_STAGES if pp > 1 else (1,):
                if pp * vpp > m.n_layers or (vpp > 1 and m.n_layers % (pp * vpp)):
                    continue
                stage = m.n_layers // (pp * vpp)
                recomputes = [("none", 0), ("selective", 0), ("full", 0)]
                recomputes += [("full", n) for n in sorted({stage // 4, stage // 2, 3 * stage // 4}) if 0 < n < stage]
                for sp in (False, True) if tp > 1 else (False,):
                    for mbs in MICRO_BATCH_SIZES:
                        if mbs * dp > global_batch_size:
                            continue
                        for rec, n in recomputes:
                            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                                out.append(Candidate(tp, pp, dp, vpp, sp, mbs, rec, n, zero))
    return out


@dataclass
class SearchResult:
    ranked: list[Estimate]  # fit in memory, fastest first
    too_big: list[Estimate]  # valid, but over the GPU's memory; smallest first
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
    layout (tp, pp, dp, sp, recompute mode), in rank order: the table's rows."""
    seen, out = set(), []
    for est in ranked:
        c = est.candidate
        key = (c.tp, c.pp, c.dp, c.sp, c.recompute)
        if key not in seen:
            seen.add(key)
            out.append(est)
    return out


def _reason_key(reason: str) -> str:
    """Group messages that differ only in the layout's numbers."""
    return "".join("#" if ch.isdigit() else ch for ch in reason)


def evaluate(cfg: Config, cand: Candidate, cluster: Cluster, global_batch_size: int, opts: Options | None = None,
             cal: Calibration | None = None, memo: dict | None = None) -> Estimate:
    """One layout: its estimate, or the ConfigError that refuses it."""
    run, layout = check(cfg, cand, global_batch_size, memo)
    return estimate(run, layout, cand, cluster, opts, cal)


def search(cfg: Config, cluster: Cluster, global_batch_size: int, opts: Options | None = None,
           cal: Calibration | None = None, space: list[Candidate] | None = None) -> SearchResult:
    result = SearchResult([], [])
    memo: dict = {}
    for cand in space if space is not None else candidates(cfg, cluster.gpus, cluster.gpus_per_node,
                                                            global_batch_size):
        try:
            est = evaluate(cfg, cand, cluster, global_batch_size, opts, cal, memo)
        except ConfigError as err:
            result.rejected.append((cand, str(err)))
            continue
        (result.ranked if est.fits else result.too_big).append(est)
    result.ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory_bytes))
    result.too_big.sort(key=lambda e: e.memory_bytes)
    return result
