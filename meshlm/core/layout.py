"""Is this layout valid, and what are its numbers? One torch-free module answers for everyone.

The config, the parallel transforms, the trainer and the (coming) auto-configurator all ask the same
questions: how does the world factor into pp × dp × tp, how many micro-batches does each rank run per
step, which layers go to which pipeline stage, which layers form each recomputation region, and which
combinations are refused. Each rule lives here once, as a plain function of numbers and configs, raising
`ConfigError` with the key and the fix. Nothing here imports torch, so a planner can call it for
thousands of candidate layouts in a second.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from typing import Any

from meshlm.core.errors import ConfigError

# `core/config.py` imports this module (its `Config.validate` runs `check_config`), so this one names the config
# dataclasses in annotations without importing them: a `Config` and its `ModelConfig` section.
Config = ModelConfig = Any


# ---- the world --------------------------------------------------------------------------------------------
def factor_world(world_size: int, tp: int, pp: int, dp: int = 0, cp: int = 1) -> tuple[int, int, int]:
    """(pp, dp, tp) with pp·dp·cp·tp = world_size; dp = 0 means "fill the world". ConfigError otherwise."""
    keys = "parallel.tp / parallel.pp" + (" / parallel.cp" if cp > 1 else "")
    product = f"parallel.tp={tp} × parallel.pp={pp}" + (f" × parallel.cp={cp}" if cp > 1 else "")
    rest = tp * pp * cp
    if world_size % rest != 0:
        raise ConfigError(f"the world of {world_size} processes is not divisible by {product} = {rest}; launch a "
                          f"multiple of {rest} processes or change {keys}")
    if dp == 0:
        dp = world_size // rest
    if dp * rest != world_size:
        sizes = f"parallel.pp={pp} × parallel.dp={dp}" + (f" × parallel.cp={cp}" if cp > 1 else "")
        raise ConfigError(f"{sizes} × parallel.tp={tp} = {dp * rest} but the world "
                          f"has {world_size} processes; set parallel.dp={world_size // rest} or 0 (auto)")
    return pp, dp, tp


# ---- tensor parallelism -----------------------------------------------------------------------------------
def check_tensor_parallel(cfg: ModelConfig, tp: int, sp: bool) -> None:
    """The shapes Megatron's tensor parallelism needs of a transformer: heads, KV heads, MLP width and (under
    sequence parallelism) the sequence divisible by tp. Each refusal names the tp sizes that pass all three
    (SmolLM2's 9 heads, 3 KV heads and width 1,536: 1 and 3)."""
    kv = cfg.kv_heads
    if cfg.n_heads % tp:
        shape = (f"model.n_kv_heads={kv}, " if kv != cfg.n_heads else "") + f"MLP width {cfg.ffn_size}"
        raise ConfigError(f"parallel.tp={tp} does not divide model.n_heads={cfg.n_heads} ({shape}); use tp in "
                          f"{tensor_parallel_sizes(cfg)}")
    if kv % tp and tp % kv:
        raise ConfigError(f"parallel.tp={tp} and model.n_kv_heads={kv}: one must divide the other (KV heads are "
                          f"split when tp divides them, replicated when tp is a multiple); use tp in "
                          f"{tensor_parallel_sizes(cfg)}")
    if cfg.ffn_size % tp:
        raise ConfigError(f"parallel.tp={tp} does not divide the MLP width {cfg.ffn_size}; "
                          f"set model.ffn_hidden_size to a multiple of tp, or use tp in {tensor_parallel_sizes(cfg)}")
    if sp and cfg.seq_len % tp:
        raise ConfigError(f"parallel.sp=true splits the sequence over parallel.tp={tp} ranks, but model.seq_len="
                          f"{cfg.seq_len} is not divisible by {tp}; set model.seq_len to a multiple of {tp}")


# ---- context parallelism ----------------------------------------------------------------------------------
def check_context_parallel(cfg: Config, cp: int, tp: int, decoder: bool = True) -> None:
    """What the ring attention (parallel/context.py) needs: a causal decoder, the row cut into 2·cp equal
    chunks (and each rank's share split over tp under sequence parallelism), no attention dropout (ZeRO-3 shards
    over dp × cp, `parallel/fsdp.py`)."""
    if cp == 1:
        return
    m, p = cfg.model, cfg.parallel
    if not decoder:
        raise ConfigError(f"parallel.cp={cp} splits causal attention into a ring; model.family={m.family!r} attends "
                          "both ways (an encoder) and is not supported; use parallel.cp=1")
    if m.seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp={cp} cuts each row into 2·cp = {2 * cp} equal chunks, but model.seq_len="
                          f"{m.seq_len} is not divisible by {2 * cp}; set model.seq_len to a multiple of {2 * cp}")
    if p.sp and tp > 1 and (m.seq_len // cp) % tp:
        raise ConfigError(f"parallel.sp=true splits each cp rank's {m.seq_len // cp} tokens over parallel.tp={tp}; "
                          f"set model.seq_len to a multiple of {2 * cp * tp}")
    if m.dropout > 0:
        raise ConfigError(f"parallel.cp={cp}: the ring attention has no attention dropout, but model.dropout="
                          f"{m.dropout}; set model.dropout=0")
    if cfg.train.compile:
        raise ConfigError(f"train.compile=true with parallel.cp={cp} is not supported yet (the ring's sends); "
                          "set train.compile=false")


# ---- micro-batches ----------------------------------------------------------------------------------------
def microbatches_per_step(cfg: Config, dp: int) -> int:
    """Micro-batches each rank (or pipeline) runs per step: global_batch_size / (micro_batch_size · dp);
    the interleaved schedule also needs a multiple of pp."""
    t = cfg.train
    per_pipeline = t.micro_batch_size * dp
    if t.global_batch_size % per_pipeline:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size="
                          f"{t.micro_batch_size} × dp={dp}: every data-parallel rank takes an equal share of each "
                          f"global batch; set it to a multiple of {per_pipeline}")
    m = t.global_batch_size // per_pipeline
    pp, vpp = cfg.parallel.pp, cfg.parallel.vpp
    if pp > 1 and vpp > 1 and m % pp:
        raise ConfigError(f"the interleaved schedule (parallel.vpp={vpp}) needs the micro-batches per step, "
                          f"train.global_batch_size / (micro_batch_size · dp) = {m}, to be a multiple of "
                          f"parallel.pp={pp}; set train.global_batch_size to a multiple of "
                          f"{pp * per_pipeline}")
    return m


# ---- pipeline stages --------------------------------------------------------------------------------------
def partition_layers(n_layers: int, pp: int, vpp: int = 1, explicit: list[int] | None = None,
                     first_cost: float = 0.0, last_cost: float = 0.0) -> list[int]:
    """Layers per virtual stage, in model order (length pp·vpp; stage s runs on pipeline rank s mod pp).

    `explicit` (`parallel.pp_layers`) is validated and returned. Otherwise every stage gets one layer and
    each further layer goes to the currently cheapest stage, the cost of a stage being its layers plus
    `first_cost` (stage 0) or `last_cost` (stage S−1) in layer-equivalents. Adding unit weights one at a
    time to the minimum minimises the maximum stage cost; ties go to the later stage, because the early
    stages of 1F1B hold the most micro-batches' activations. 30 layers on 4 stages with a head of 0.25
    layers: [7, 8, 8, 7]. The result always sums to `n_layers` with ≥ 1 layer per stage, so no layout can
    drop or duplicate a layer (`stage_layer_ranges` turns counts into ranges).
    """
    stages = pp * vpp
    if explicit:
        counts = [int(c) for c in explicit]
        if len(counts) != stages:
            raise ConfigError(f"parallel.pp_layers={counts} has {len(counts)} entries but parallel.pp={pp} × "
                              f"parallel.vpp={vpp} = {stages} stages; give one layer count per stage")
        if min(counts) < 1:
            raise ConfigError(f"parallel.pp_layers={counts}: every stage needs at least 1 layer")
        if sum(counts) != n_layers:
            raise ConfigError(f"parallel.pp_layers={counts} sums to {sum(counts)} but model.n_layers={n_layers}; "
                              "the counts must add up to the number of layers")
        return counts
    if n_layers < stages:
        raise ConfigError(f"model.n_layers={n_layers} is fewer than parallel.pp={pp} × parallel.vpp={vpp} = "
                          f"{stages} stages; every stage needs a layer: lower parallel.pp or parallel.vpp")
    return list(_balanced(n_layers, stages, first_cost, last_cost))


@functools.lru_cache(maxsize=4096)
def _balanced(n_layers: int, stages: int, first_cost: float, last_cost: float) -> tuple[int, ...]:
    """`partition_layers`' greedy balance (cached: the planner asks for the same partitions many times)."""
    if stages == 1:
        return (n_layers,)
    counts = [1] * stages
    extra = [0.0] * stages
    extra[0] += first_cost
    extra[-1] += last_cost
    # The cheapest stage (ties: the later one) from a heap of (cost, −stage): the planner partitions
    # thousands of candidate layouts, so O(n log S) rather than a scan of every stage per layer.
    heap = [(counts[s] + extra[s], -s) for s in range(stages)]
    heapq.heapify(heap)
    for _ in range(n_layers - stages):
        _, neg = heapq.heappop(heap)
        counts[-neg] += 1
        heapq.heappush(heap, (counts[-neg] + extra[-neg], neg))
    return tuple(counts)


def tensor_parallel_sizes(cfg: ModelConfig, most: int = 12) -> str:
    """The tp sizes the model's shape takes: dividing the heads and the MLP width, and dividing the KV heads or
    a multiple of them (replicated), listed as `divisors` lists."""
    found = [d for d in range(1, min(cfg.n_heads, 4096) + 1) if cfg.n_heads % d == 0 and cfg.ffn_size % d == 0
             and (cfg.kv_heads % d == 0 or d % cfg.kv_heads == 0)]
    return ", ".join(map(str, found[:most])) + (", ..." if len(found) > most else "")


def divisors(n: int, most: int = 12) -> str:
    """The divisors of `n` (without enumerating up to n: it may be huge), at most `most` of them."""
    small = [d for d in range(1, min(math.isqrt(n), 10 ** 6) + 1) if n % d == 0]
    found = sorted(set(small + [n // d for d in small]))
    return ", ".join(map(str, found[:most])) + (", ..." if len(found) > most else "")



def stage_layer_ranges(counts: list[int]) -> list[range]:
    """[3, 2, 2] → [range(0, 3), range(3, 5), range(5, 7)]: consecutive, disjoint, covering."""
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [range(start, start + c) for start, c in zip(starts, counts)]


def stage_ids(pp_rank: int, pp: int, vpp: int) -> list[int]:
    """The virtual stages pipeline rank `pp_rank` holds: pp_rank, pp_rank + pp, …"""
    return [pp_rank + k * pp for k in range(vpp)]


# ---- activation recomputation -----------------------------------------------------------------------------
RECOMPUTE_MODES = ("none", "selective", "full")


def full_recompute_chunks(n_layers: int, method: str, num_layers: int) -> list[list[int]]:
    """Which layers of a stage of `n_layers` form each checkpoint region (layers in no region: stored).

    uniform: consecutive chunks of `num_layers` (0 → 1), the last one possibly shorter (as Megatron);
    block: each of the first `num_layers` (0 → all) layers alone.
    """
    if num_layers > n_layers:
        raise ConfigError(f"train.recompute_num_layers={num_layers} exceeds the {n_layers} layers of this "
                          f"pipeline stage; use 1..{n_layers}, or 0 for every layer")
    if method == "uniform":
        size = num_layers or 1
        return [list(range(i, min(i + size, n_layers))) for i in range(0, n_layers, size)]
    return [[i] for i in range(num_layers or n_layers)]


def recomputed_layers(cfg: Config) -> int:
    """How many of the model's layers redo (part of) their forward in backward (for hardware FLOPs):
    every layer, except under `full` with `block`, which recomputes the first N of each (virtual) stage; the
    multi-token prediction modules' blocks too when every layer is (selective, or full with
    `recompute_num_layers` 0: `parallel/recompute.py`), each counted as a layer."""
    t, p, n = cfg.train, cfg.parallel, cfg.model.n_layers
    if t.recompute == "none":
        return 0
    if t.recompute == "full" and t.recompute_method == "block" and t.recompute_num_layers:
        return min(n, t.recompute_num_layers * p.pp * p.vpp)
    return n + (cfg.model.mtp_depth if t.recompute == "selective" or not t.recompute_num_layers else 0)


def check_compiled_recompute(cfg: Config, tp_dropout_stream: bool) -> None:
    """Recomputation that replays the tensor-parallel dropout stream (tp > 1 with dropout) cannot be traced
    by torch.compile."""
    t = cfg.train
    if t.recompute != "none" and t.compile and tp_dropout_stream:
        raise ConfigError("train.compile=true cannot trace the replay of the tensor-parallel dropout stream that "
                          f"train.recompute={t.recompute!r} needs with model.dropout={cfg.model.dropout} under tensor "
                          "parallelism; set model.dropout=0, train.recompute=none or train.compile=false")


# ---- data parallelism -------------------------------------------------------------------------------------
def check_data_parallel(cfg: Config, tp: int) -> None:
    """Layouts the data-parallel transforms cannot serve, as errors that say why and what to do. (ZeRO-3 with
    tensor parallelism is served: FSDP2 shards each tp-local tensor by rows, `parallel/fsdp.py`.)"""
    check_optimizer_sharding(cfg.optim.name, cfg.parallel.zero, tp, cfg.model.kv_heads)


def check_optimizer_sharding(optim_name: str, zero: int, tp: int = 1, kv_heads: int | None = None) -> None:
    """LAMB's trust ratio is a norm of each whole parameter; ZeRO steps flat shards that cut across them.
    Under tensor parallelism each shard's squares are summed over tp (`train.optim.tp_square_sums`), which
    counts a KV row held by several tp ranks (tp > n_kv_heads) several times: refused too. Muon
    orthogonalises whole matrices: tensor parallelism and ZeRO, which split them, are refused."""
    if optim_name == "lamb" and zero > 0:
        raise ConfigError(f"optim.name=lamb needs whole parameters; parallel.zero={zero} shards them; "
                          "use parallel.zero=0 or optim.name=adamw")
    if optim_name == "muon" and (zero > 0 or tp > 1):
        split = f"parallel.zero={zero}" if zero > 0 else f"parallel.tp={tp}"
        raise ConfigError(f"optim.name=muon orthogonalises each whole weight matrix; {split} splits them across "
                          "ranks; use parallel.tp=1 and parallel.zero=0 (data and pipeline parallelism keep "
                          "matrices whole) or optim.name=adamw")
    if optim_name == "lamb" and kv_heads is not None and tp > kv_heads:
        raise ConfigError(f"optim.name=lamb with parallel.tp={tp} > model.n_kv_heads={kv_heads} (KV heads held by "
                          "several ranks) is not supported; use parallel.tp <= n_kv_heads or optim.name=adamw")


def check_expert_parallel(cfg: Config, replicas: int | None = None) -> None:
    """`parallel.ep` (parallel/expert.py): an MoE model whose experts split evenly, carved from the
    `replicas` = dp × cp ranks (None: not known yet), ZeRO 0-2."""
    ep, m = cfg.parallel.ep, cfg.model
    if ep == 1:
        return
    if m.moe_experts <= 0 or m.moe_experts % ep:
        raise ConfigError(f"parallel.ep={ep} splits each MoE layer's experts over {ep} ranks, but model.moe_experts="
                          f"{m.moe_experts}; use an ep that divides moe_experts ({divisors(max(m.moe_experts, 1))}) "
                          "or parallel.ep=1")
    if cfg.parallel.zero == 3:
        raise ConfigError(f"parallel.zero=3 with parallel.ep={ep} is not supported (FSDP2 would shard the experts "
                          "again over the expert-data-parallel group); use parallel.zero=1 or 2")
    if replicas is not None and replicas % ep:
        raise ConfigError(f"parallel.ep={ep} is carved from the dp × cp = {replicas} ranks holding the same "
                          f"weights, which it does not divide; use an ep that divides {replicas}")


# ---- the rules that need no world size (Config.validate) ----------------------------------------------------
def check_config(cfg: Config) -> None:
    """Every layout rule that the config alone decides: tensor-parallel shapes, refused combinations, the
    stage partition (an explicit `parallel.pp_layers`, enough layers), recomputation per stage."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.tp > 1:
        check_tensor_parallel(m, p.tp, p.sp)
    check_context_parallel(cfg, p.cp, p.tp)
    check_data_parallel(cfg, p.tp)
    check_expert_parallel(cfg)
    if m.mtp_depth and p.cp > 1:  # multi-token prediction shifts tokens across the ranks' chunks (models/mtp.py)
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with parallel.cp={p.cp} is not supported yet; set "
                          "parallel.cp=1 or model.mtp_depth=0")
    if m.mtp_depth and cfg.data.document_mask:  # its blocks attend over whole rows
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} with data.document_mask=true is not supported yet; set "
                          "data.document_mask=false or model.mtp_depth=0")
    if cfg.tune.method != "none" and p.zero:
        raise ConfigError(f"parallel.zero={p.zero} with tune.method={cfg.tune.method!r}: an adapter's optimizer state is "
                          "tiny and is kept whole on every rank; set parallel.zero=0")
    counts = partition_layers(m.n_layers, p.pp, p.vpp, p.pp_layers or None) if m.n_layers <= 10 ** 5 else \
        [m.n_layers // (p.pp * p.vpp)]  # (a size this large is refused before allocation anyway: core/fit.py)
    if t.recompute_num_layers > min(counts):
        raise ConfigError(f"train.recompute_num_layers={t.recompute_num_layers} exceeds the {min(counts)} layers of a "
                          f"pipeline stage (model.n_layers={m.n_layers} over parallel.pp={p.pp} × vpp={p.vpp}); use "
                          f"1..{min(counts)}, or 0 for every layer")


# ---- the whole layout -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """A valid layout's numbers: sizes, micro-batches per rank and step, layers per virtual stage."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    stage_layers: tuple[int, ...]
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


def plan_layout(cfg: Config, pp: int, dp: int, tp: int, stage_cost: tuple[float, float] = (0.0, 0.0), *,
                cp: int = 1, decoder: bool = True) -> Layout:
    """Check every rule for `cfg` on a pp × dp × cp × tp world; the layout's numbers, or the first ConfigError.
    `stage_cost`: the (first, last) stage's extra work in layers (`ModelSpec.stage_costs`); `decoder`: the
    family's attention is causal (`ModelSpec.decoder`)."""
    check_tensor_parallel(cfg.model, tp, cfg.parallel.sp and tp > 1)
    check_context_parallel(cfg, cp, tp, decoder)
    check_data_parallel(cfg, tp)
    check_expert_parallel(cfg, dp * cp)
    check_compiled_recompute(cfg, tp > 1 and cfg.model.dropout > 0)
    m = microbatches_per_step(cfg, dp)
    p = cfg.parallel
    vpp = p.vpp if pp > 1 else 1
    counts = partition_layers(cfg.model.n_layers, pp, vpp, p.pp_layers or None, *stage_cost) if pp > 1 \
        else [cfg.model.n_layers]
    if cfg.train.recompute == "full":
        for c in counts:
            full_recompute_chunks(c, cfg.train.recompute_method, cfg.train.recompute_num_layers)
    return Layout(pp, dp, tp, m, tuple(counts), cp)
