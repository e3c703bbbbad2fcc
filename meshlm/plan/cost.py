"""The planner's cost model: memory per GPU and time per training step of one layout, term by term (torch-free).

Memory reuses `plan.memory` (model states per parameter with ZeRO, the activation formula that
`meshlm bench memory` validates, the pipeline's in-flight micro-batches); time is a sum of named terms:

    step = m · t_mb(slowest pipeline rank r*) + Σ_{r ≠ r*} t_mb(r) / v    (1F1B; interleaved over v chunks)
           + exposed DP reduction + ZeRO all-gather + optimizer step

with t_mb, one micro-batch's forward and backward on a rank, the sum of its layers' GEMMs (at an efficiency
that grows with the GEMM's width), attention, memory-bound elementwise work, recomputation's extra forward,
the TP collectives (α–β model), the LM head and loss, the pipeline sends, and host op overhead.
docs/plan.md derives each term and says where each constant of `Calibration` comes from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from meshlm.config import Config, ModelConfig
from meshlm.plan.catalog import Gpu, shared_rates
from meshlm.plan.flops import layer_flops_per_token, model_flops, recompute_flops
from meshlm.plan.layout import Layout, full_recompute_chunks, recomputed_layers
from meshlm.plan.memory import (
    ActivationDtypes,
    activation_dtypes,
    activation_terms,
    attention_backend,
    model_state_bytes_per_param,
    pipeline_activation_factor,
)

GIB = 2 ** 30


@dataclass(frozen=True)
class Calibration:
    """The model's few constants (docs/plan.md, "Constants"). None is fitted to a single published row."""

    # Large 16-bit GEMMs reach about 80% of the tensor-core datasheet peak (cuBLAS on A100/H100 at
    # 8192³); a GEMM whose narrow side is w = hidden/tp runs at gemm_max · w / (w + gemm_half_width).
    gemm_max_efficiency: float = 0.78
    gemm_half_width: float = 256.0
    # Attention's batched s×s GEMMs run at this fraction of the dense GEMMs' rate (small per-head K = k).
    attention_efficiency: float = 0.5
    # Collectives and sends reach this fraction of the link's datasheet bandwidth (NCCL bus bandwidth).
    link_efficiency: float = 0.75
    # Memory-bound work moves the bytes a layer saves for backward this many times (written in forward,
    # read in backward, its gradient written and read).
    elementwise_passes: float = 4.0
    # AdamW over fp32 states reads weights, gradients, m, v and writes weights, m, v: 28 B, plus 4 B the
    # gradient norm reads.
    optimizer_bytes_per_param: float = 32.0
    # Operations launched per layer, forward and backward (counted on meshlm's GPT layer), for op_overhead.
    layer_ops: float = 60.0
    # Reserved per GPU beyond the modelled bytes: CUDA context, NCCL buffers, allocator slack.
    reserve_gib: float = 2.0
    # Serving (plan/inference.py): a bandwidth-bound decode step streams at this fraction of the datasheet
    # memory bandwidth (what a large device-to-device copy reaches).
    hbm_efficiency: float = 0.8


@dataclass(frozen=True)
class Options:
    """What runs: the precision, the device kind (element sizes and attention backend of
    `plan.memory`), and the model-state scheme: meshlm's fp32 weights under autocast ("fp32": 16 B/param)
    or Megatron's 16-bit weights with fp32 master copies ("mixed": 18 B/param)."""

    precision: str = "bf16"
    device_type: str = "cuda"
    backend: str | None = None  # None: what `attention_backend` picks; "math": the s×s scores are stored
    dtypes: ActivationDtypes | None = None  # None: `activation_dtypes(precision, device_type)`
    states: str = "fp32"
    grad_bytes: float = 4.0  # bytes per gradient element the data-parallel reduction moves
    fused_loss: bool = True  # tp=1: the chunked head + loss keeps no logits
    # Sequence parallelism's backward re-gathers the shard each column-parallel linear kept (two all-gathers
    # per layer). meshlm waits for them; Megatron overlaps them with the weight-gradient GEMM (False).
    sp_regather: bool = True
    # The DP gradient reduction starts during the last micro-batch's backward (meshlm's buckets, True) or
    # after the whole backward (Megatron-LM 2021's local DDP, False).
    dp_overlap: bool = True
    # The backward's two TP collectives (the column-parallel linears' input gradients) run while the
    # weight-gradient GEMMs compute (Megatron-LM's asynchronous TP communication, True) or wait (meshlm, False).
    tp_backward_overlap: bool = False
    # Each micro-batch after the first adds its weight gradients to the accumulated ones: autograd's
    # separate add reads both and writes one (meshlm, 3 × grad_bytes per parameter), or the weight-gradient
    # GEMM accumulates in place (Megatron-LM's fused accumulation, True: free).
    fused_grad_accumulation: bool = False


@dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    gpus: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Candidate:
    """One layout: the parallel sizes and the per-rank choices."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    sp: bool = False
    micro_batch_size: int = 1
    recompute: str = "none"  # none | selective | full
    recompute_num_layers: int = 0  # full: 0 = every layer its own region; N > 0 = the first N of each stage
    zero: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def recompute_label(self) -> str:
        if self.recompute == "full" and self.recompute_num_layers:
            return f"full:{self.recompute_num_layers}"
        return self.recompute

    def label(self) -> str:
        return (f"tp={self.tp},pp={self.pp},vpp={self.vpp},dp={self.dp},sp={str(self.sp).lower()},"
                f"mbs={self.micro_batch_size},recompute={self.recompute_label},zero={self.zero}")

    def overrides(self) -> list[str]:
        """The config overrides that run this layout with `meshlm train`."""
        out = [f"--parallel.tp={self.tp}", f"--parallel.pp={self.pp}", f"--parallel.dp={self.dp}",
               f"--parallel.vpp={self.vpp}", f"--parallel.sp={str(self.sp).lower()}",
               f"--parallel.zero={self.zero}", f"--train.micro_batch_size={self.micro_batch_size}",
               f"--train.recompute={self.recompute}"]
        if self.recompute == "full" and self.recompute_num_layers:
            out += ["--train.recompute_method=block", f"--train.recompute_num_layers={self.recompute_num_layers}"]
        return out

    def apply(self, cfg: Config, global_batch_size: int | None = None) -> Config:
        """`cfg` with this layout (not validated: `search.check` validates)."""
        block = self.recompute == "full" and self.recompute_num_layers > 0
        par = dataclasses.replace(cfg.parallel, tp=self.tp, pp=self.pp, dp=self.dp, vpp=self.vpp, sp=self.sp,
                                  zero=self.zero, pp_layers=[])
        train = dataclasses.replace(cfg.train, micro_batch_size=self.micro_batch_size,
                                    global_batch_size=global_batch_size or cfg.train.global_batch_size,
                                    recompute=self.recompute, recompute_method="block" if block else "uniform",
                                    recompute_num_layers=self.recompute_num_layers if block else 0)
        return dataclasses.replace(cfg, parallel=par, train=train)


@dataclass
class Estimate:
    """A layout's predicted numbers. `memory` in bytes per GPU (the fullest rank), `time` in seconds per step,
    both by named term (`--explain`)."""

    candidate: Candidate
    memory: dict[str, float]
    time: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    fits: bool
    memory_limit: float
    measured_step_time_s: float | None = None
    # the pipeline ranks' mean busy share of a step, Σ_r t_r / (p · t_max): 1 when the stages are equal
    stage_load: float = 1.0

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    def to_dict(self) -> dict:
        c = self.candidate
        out = {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "dp": c.dp, "sp": c.sp, "micro_batch_size": c.micro_batch_size,
               "recompute": c.recompute_label, "zero": c.zero, "memory_gb": round(self.memory_bytes / GIB, 3),
               "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
               "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu, "fits": self.fits,
               "overrides": " ".join(c.overrides())}
        if self.measured_step_time_s is not None:
            out["measured_step_time_s"] = self.measured_step_time_s
        return out


# ---- parameters per rank -----------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _parameter_split(m: ModelConfig) -> tuple[float, float, float]:
    """(per layer, outside the layers, word embedding V·h) parameters, from the family's exact count."""
    count = _family_count(m.family)
    one = count(dataclasses.replace(m, n_layers=1))
    two = count(dataclasses.replace(m, n_layers=2))
    return float(two - one), float(2 * one - two), float(m.vocab_size * m.hidden_size)


def _family_count(family: str):
    if family == "gpt":  # torch-free
        from meshlm.plan.memory import parameter_count

        return parameter_count
    from meshlm.models.registry import get_spec

    return get_spec(family).parameter_count


def rank_parameters(m: ModelConfig, layers: int, first: bool, last: bool, tp: int, pp: int) -> float:
    """Parameters one tp rank of a pipeline rank holds: its layers, the embedding on the first rank, the head
    (or the tied embedding's copy) on the last."""
    per_layer, outside, word = _parameter_split(m)
    extra = 0.0
    if pp == 1:
        extra = outside
    else:
        if first:
            extra += outside - (0.0 if m.tie_embeddings else word)
        if last:
            extra += word
    return (layers * per_layer + extra) / tp


# ---- collectives (α–β) ---------------------------------------------------------------------------------------
def all_reduce_time(nbytes: float, n: int, gbps: float, latency_us: float, eff: float) -> float:
    """Ring all-reduce: 2(n−1)/n of the bytes over the link, 2(n−1) latency steps."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (gbps * 1e9 * eff) + 2 * (n - 1) * latency_us * 1e-6


def gather_time(nbytes: float, n: int, gbps: float, latency_us: float, eff: float, cost: float = 0.5) -> float:
    """All-gather or reduce-scatter of `nbytes` (the full tensor): `cost` of an all-reduce (`Gpu.gather_cost`;
    a ring's half by default)."""
    return all_reduce_time(nbytes, n, gbps, latency_us, eff) * cost


def _link(cluster: Cluster, span: int) -> tuple[float, float]:
    """(GB/s, latency µs) for a group whose ranks lie within `span` consecutive ranks."""
    g = cluster.gpu
    if span <= cluster.gpus_per_node:
        return g.intra_gbps, g.intra_latency_us
    return g.inter_gbps, g.inter_latency_us


# ---- gradients at the peak --------------------------------------------------------------------------------
def gradient_bytes(full: float, zero: int, dp: int, microbatches: int, states: str, activations: float) -> float:
    """The gradient bytes a rank adds to its peak, whose other part is `activations` (the most it holds in
    flight); `full` is the unsharded gradients' size.

    ZeRO-0/1 keep full-size buffers, and so does Megatron's distributed optimizer (`states="mixed"`) at any
    stage. meshlm's ZeRO-2 (parallel/buckets.py) builds a bucket's full-size buffer at its first gradient
    of the step and keeps it to the reduction, which it can only run after the last micro-batch: every
    forward after the first runs beside them. The reduce-scattered shards (full/dp) come next to them at the
    end of the backward, when the activations are spent, and live until `zero_grad`: the peak is the larger
    of the two moments. FSDP2 (ZeRO-3) accumulates unsharded gradients likewise while gradient sync is off
    (micro-batches before the last); with one micro-batch it reduce-scatters layer by layer during the
    backward and keeps the shards. `tests/parallel/test_data_parallel.py` measures these states in a step."""
    if dp <= 1 or zero < 2 or states == "mixed":
        return full
    during = full if microbatches > 1 else (full / dp if zero == 3 else 0.0)
    if zero == 3:
        return during
    return max(during, full + full / dp - activations)


# ---- the model -------------------------------------------------------------------------------------------
def for_gpu(cal: Calibration, gpu: Gpu) -> Calibration:
    """`cal` with the GPU's measured GEMM curve, if it has one (`--gpu this`)."""
    if gpu.gemm_max_efficiency is None or gpu.gemm_half_width is None:
        return cal
    return dataclasses.replace(cal, gemm_max_efficiency=gpu.gemm_max_efficiency, gemm_half_width=gpu.gemm_half_width)


def gemm_efficiency(width: float, cal: Calibration) -> float:
    return cal.gemm_max_efficiency * width / (width + cal.gemm_half_width)


@lru_cache(maxsize=4096)
def _layer_bytes(m: ModelConfig, b: int, tp: int, sp: bool, recompute: str, opts: Options,
                 seq_len: int) -> float:
    dtypes = opts.dtypes or activation_dtypes(opts.precision, opts.device_type)
    backend = opts.backend or attention_backend(opts.device_type, m.dropout)
    return sum(activation_terms(m, b, tp, sp, recompute, dtypes, backend, seq_len).values())


def estimate(cfg: Config, layout: Layout, cand: Candidate, cluster: Cluster, opts: Options | None = None,
             cal: Calibration | None = None) -> Estimate:
    """Memory per GPU and step time of `cand`, whose config `cfg` is (`cand.apply`) and whose `layout` is
    `plan_layout`'s answer (`search.evaluate` checks and calls this).

    On a CPU host whose cores the processes share (`gpu.host_cores`), the rates each process gets depend on
    how many are at work at once: first every process of the layout, then the processes times the
    pipeline's busy share (`stage_load`: a stage that waits for a slower one leaves its core to the others)."""
    gpu = cluster.gpu
    if not gpu.host_cores:
        return _estimate(cfg, layout, cand, cluster, opts, cal)
    first = _estimate(cfg, layout, cand, dataclasses.replace(cluster, gpu=shared_rates(gpu, cand.world)), opts, cal)
    busy = cand.world * first.stage_load
    return _estimate(cfg, layout, cand, dataclasses.replace(cluster, gpu=shared_rates(gpu, busy)), opts, cal)


def _estimate(cfg: Config, layout: Layout, cand: Candidate, cluster: Cluster, opts: Options | None,
              cal: Calibration | None) -> Estimate:
    opts, cal = opts or Options(), for_gpu(cal or Calibration(), cluster.gpu)
    m, gpu = cfg.model, cluster.gpu
    s, b, tp, pp, dp, v = m.seq_len, cand.micro_batch_size, cand.tp, cand.pp, cand.dp, (cand.vpp if cand.pp > 1 else 1)
    sp = cand.sp and tp > 1
    mb = layout.microbatches
    peak = gpu.tflops * 1e12
    hbm = gpu.hbm_gbps * 1e9
    c_bytes = 2 if opts.precision in ("bf16", "fp16") else 4
    tp_gbps, tp_lat = _link(cluster, tp)
    dp_gbps, dp_lat = _link(cluster, tp * dp)
    pp_gbps, pp_lat = _link(cluster, tp * dp * 2) if pp > 1 else (1.0, 0.0)

    # -- one layer, one micro-batch, forward + backward, on one tp rank
    eff = gemm_efficiency(m.hidden_size / tp, cal)
    dense = layer_flops_per_token(m) * b * s / tp
    attn = 6.0 * b * s * s * m.head_dim * m.n_heads / tp
    t_gemm = dense / (peak * eff)
    t_attn = attn / (peak * eff * cal.attention_efficiency)
    stored = _layer_bytes(m, b, tp, sp, "selective" if cand.recompute == "selective" else "none", opts, s)
    t_elem = cal.elementwise_passes * _layer_bytes(m, b, tp, sp, "none", opts, s) / hbm
    act_msg = b * s * m.hidden_size * c_bytes
    # two in forward (after attention, after the MLP), two in backward (their conjugates), unless those
    # hide behind the weight-gradient GEMMs (a third of the layer's GEMM time)
    n_coll = 2 if opts.tp_backward_overlap else 4
    # under SP each all-reduce is an all-gather and a reduce-scatter, each `gather_cost` of an all-reduce
    gathered = gpu.gather_cost
    t_coll = all_reduce_time(act_msg, tp, tp_gbps, tp_lat, cal.link_efficiency) * (2 * gathered if sp else 1.0)
    t_regather = 2 * gather_time(act_msg, tp, tp_gbps, tp_lat, cal.link_efficiency, gathered) \
        if sp and opts.sp_regather else 0.0
    if opts.tp_backward_overlap:
        t_regather = max(0.0, 2 * t_coll + t_regather - t_gemm / 3)
    t_ops = cal.layer_ops * gpu.op_overhead_us * 1e-6
    # recomputation: full replays the layer's forward (GEMMs, attention, elementwise, its two collectives);
    # selective the attention core
    full_extra = t_gemm / 3 + t_attn / 3 + t_elem / cal.elementwise_passes + 2 * t_coll + t_ops / 3
    # selective: the attention core's GEMMs and the elementwise work on what it no longer stores (one pass)
    sel_extra = t_attn / 3 + (_layer_bytes(m, b, tp, sp, "none", opts, s)
                              - _layer_bytes(m, b, tp, sp, "selective", opts, s)) / hbm

    # -- which layers recompute, per rank
    counts = list(layout.stage_layers)
    rank_layers = [sum(counts[r + k * pp] for k in range(v)) for r in range(pp)]

    method = "block" if cand.recompute_num_layers else "uniform"
    # per rank: layers that redo their forward, and (full) checkpoint regions, whose inputs stay stored
    regions = [0] * pp
    recomputed = [0] * pp
    for r in range(pp):
        if cand.recompute == "selective":
            recomputed[r] = rank_layers[r]
        elif cand.recompute == "full":
            for k in range(v):
                chunks = full_recompute_chunks(counts[r + k * pp], method, cand.recompute_num_layers)
                regions[r] += len(chunks)
                recomputed[r] += sum(len(ch) for ch in chunks)

    # -- the head and loss (last rank), the sends (every rank but alone)
    head_flops = 6.0 * b * s * m.hidden_size * m.vocab_size / tp
    # the fused head + loss (tp = 1) works chunk by chunk in cache; otherwise the fp32 logits go to memory
    # and back like any saved tensor
    logits_bytes = 0.0 if (tp == 1 and opts.fused_loss) else b * s * m.vocab_size / tp * 4
    t_head = head_flops / (peak * gemm_efficiency(m.hidden_size, cal)) + cal.elementwise_passes * logits_bytes / hbm
    # a measured CPU: the softmax's elementwise work on every logit, at the measured rate of the path taken
    fused = tp == 1 and opts.fused_loss
    per_logit = (gpu.fused_softmax_ns_per_element if fused else None) or gpu.softmax_ns_per_element
    if per_logit:
        t_head += per_logit * 1e-9 * b * s * m.vocab_size / tp
    # outside the layers, each micro-batch at tp > 1 runs the vocab-parallel embedding's forward all-reduce
    # (a reduce-scatter under SP), the head input's backward all-reduce (an all-gather's conjugate under
    # SP), and the vocab-parallel cross-entropy's two small all-reduces (the row maximum; Σexp with the
    # target logit), b·s and 2·b·s fp32 values
    t_embed_coll = t_head_coll = 0.0
    if tp > 1:
        t_embed_coll = gather_time(act_msg, tp, tp_gbps, tp_lat, cal.link_efficiency, gathered) if sp else \
            all_reduce_time(act_msg, tp, tp_gbps, tp_lat, cal.link_efficiency)
        t_head_coll = t_embed_coll + all_reduce_time(4.0 * b * s, tp, tp_gbps, tp_lat, cal.link_efficiency) \
            + all_reduce_time(8.0 * b * s, tp, tp_gbps, tp_lat, cal.link_efficiency)
    edge_coll = [(t_embed_coll if r == 0 else 0.0) + (t_head_coll if r == pp - 1 else 0.0) for r in range(pp)]
    send = b * s * m.hidden_size * c_bytes / (tp if sp else 1)
    t_p2p = 2 * v * (pp_lat * 1e-6 + send / (pp_gbps * 1e9 * cal.link_efficiency)) if pp > 1 else 0.0

    def rank_terms(r: int) -> dict[str, float]:
        n = rank_layers[r]
        rec = recomputed[r]
        extra = rec * (full_extra if cand.recompute == "full" else sel_extra)
        return {"GEMMs (layers)": n * t_gemm, "attention": n * t_attn, "elementwise (memory-bound)": n * t_elem,
                "recompute (extra forward)": extra, "TP collectives": n * (n_coll * t_coll + t_regather),
                "LM head + loss": t_head if r == pp - 1 else 0.0, "PP point-to-point": t_p2p,
                "TP collectives (embedding, head, loss)": edge_coll[r],
                "op overhead (host)": n * t_ops}

    # the slowest rank from scalar totals (pp can be 64), then its terms by name
    unit = t_gemm + t_attn + t_elem + n_coll * t_coll + t_regather + t_ops
    extra_unit = full_extra if cand.recompute == "full" else sel_extra
    rank_time = [rank_layers[r] * unit + recomputed[r] * extra_unit + (t_head if r == pp - 1 else 0.0)
                 + t_p2p + edge_coll[r] for r in range(pp)]
    slowest = max(range(pp), key=lambda r: rank_time[r])
    terms = rank_terms(slowest)
    time = {k: mb * val for k, val in terms.items()}
    # fill and drain: while the slowest rank is busy with its m micro-batches, every other rank does one
    # micro-batch's forward and backward outside that window, each in v chunks (equal stages: (p − 1)/v · t)
    others = sum(rank_time) - rank_time[slowest]
    time["pipeline bubble"] = others / v if pp > 1 else 0.0
    params = [rank_parameters(m, rank_layers[r], r == 0, r == pp - 1, tp, pp) for r in range(pp)]
    p_max = max(params)
    time["gradient accumulation"] = 0.0 if opts.fused_grad_accumulation else \
        (mb - 1) * 3 * opts.grad_bytes * p_max / hbm

    # -- data parallelism: the fullest rank's parameters and their traffic
    grads = p_max * opts.grad_bytes
    if dp > 1:  # ZeRO-3 too: FSDP2 accumulates unsharded gradients and reduce-scatters in the last backward
        reduce = gather_time(grads, dp, dp_gbps, dp_lat, cal.link_efficiency, gathered) if cand.zero >= 2 else \
            all_reduce_time(grads, dp, dp_gbps, dp_lat, cal.link_efficiency)
        window = (2 / 3) * (terms["GEMMs (layers)"] + terms["attention"]) \
            if opts.dp_overlap else 0.0
        tail = all_reduce_time(min(grads, cfg.parallel.bucket_mb * 2 ** 20), dp, dp_gbps, dp_lat, cal.link_efficiency)
        time["DP gradient reduction (exposed)"] = max(reduce - window, tail)
    else:
        time["DP gradient reduction (exposed)"] = 0.0
    # the tied word embedding's two copies (first and last pipeline rank) sum their gradients after the
    # backward, over the pair's link, before the optimizer can step
    if pp > 1 and m.tie_embeddings:
        tie_gbps, tie_lat = _link(cluster, cand.world)
        time["tied embedding all-reduce (first, last stage)"] = all_reduce_time(
            opts.grad_bytes * m.vocab_size * m.hidden_size / tp, 2, tie_gbps, tie_lat, cal.link_efficiency)
    # the weights the ZeRO all-gathers move: meshlm's are fp32; with 16-bit weights and fp32 master copies
    # ("mixed", Megatron's distributed optimizer) the updated 16-bit weights are gathered
    weight_elem = 2 if opts.states == "mixed" and opts.precision in ("bf16", "fp16") else 4
    weight_bytes = p_max * weight_elem
    time["ZeRO weight all-gather"] = gather_time(weight_bytes, dp, dp_gbps, dp_lat, cal.link_efficiency, gathered) \
        if dp > 1 and cand.zero in (1, 2) else 0.0
    if dp > 1 and cand.zero == 3:  # per micro-batch: gather the weights in forward and again in backward
        per_mb = 2 * gather_time(weight_bytes, dp, dp_gbps, dp_lat, cal.link_efficiency, gathered)
        compute = terms["GEMMs (layers)"] + terms["attention"]
        time["ZeRO-3 gathers (exposed)"] = mb * max(per_mb - compute, 0.0) + per_mb / max(1, rank_layers[slowest])
    shard = dp if cand.zero >= 1 else 1
    time["optimizer step"] = cal.optimizer_bytes_per_param * p_max / shard / hbm
    step = sum(time.values())

    # -- memory on each rank; the fullest one counts
    per_param = model_state_bytes_per_param(opts.states, dp, distributed_optimizer=cand.zero >= 1, cfg=cfg)
    if cand.zero >= 3:
        per_param["weights"] /= dp
    full_bytes = _layer_bytes(m, b, tp, sp, "full", opts, s)
    factor = pipeline_activation_factor(pp, mb, v) if pp > 1 else 1.0
    def rank_memory(r: int) -> dict[str, float]:
        mem = {"weights": per_param["weights"] * params[r], "gradients": 0.0,
               "optimizer states": per_param["optimizer"] * params[r]}
        if opts.precision != "fp32" and opts.states == "fp32":
            mem["16-bit weight copies (autocast)"] = 2.0 * params[r]
        if cand.recompute == "full":
            layer_acts = (rank_layers[r] - recomputed[r]) * stored + regions[r] * full_bytes
        else:
            layer_acts = rank_layers[r] * stored
        # rank r of 1F1B holds min(p − r, m) micro-batches; the first rank the most
        held = factor if r == 0 else (min(pp - r, mb) * (1 + (pp - 1) / (pp * v)) if v > 1 else min(pp - r, mb))
        mem["activations"] = layer_acts * held
        logits = 0.0 if (tp == 1 and opts.fused_loss) else 4.0 * b * s * m.vocab_size / tp
        mem["logits (last stage)"] = logits if r == pp - 1 else 0.0
        mem["gradients"] = gradient_bytes(per_param["grads"] * params[r], cand.zero, dp, mb, opts.states,
                                          mem["activations"] + mem["logits (last stage)"])
        if cand.zero == 3 and dp > 1:
            # FSDP2 keeps the root's own weights (embedding, final norm, head) gathered from its forward to
            # its backward, and gathers each layer whole while it runs: those full copies beside the shards
            mem["ZeRO-3 gathered weights"] = weight_elem * rank_parameters(
                m, 1, r == 0, r == pp - 1, tp, pp)
        mem["reserved (context, buffers)"] = cal.reserve_gib * GIB
        return mem

    # the first, the last and the fullest middle rank can be the fullest one (ranks in between hold fewer
    # micro-batches than the first and no embedding or head)
    middle = [r for r in range(1, pp - 1) if rank_layers[r] > rank_layers[0]][:1]
    memory = max((rank_memory(r) for r in sorted({0, pp - 1, *middle})), key=lambda d: sum(d.values()))
    limit = gpu.memory_gib * GIB

    gbs = mb * b * dp
    flops = model_flops(m, gbs, s)
    hw = flops + recompute_flops(m, gbs, cand.recompute, s, layers=recomputed_layers(cfg))
    world = cand.world
    return Estimate(cand, memory, time, step, gbs * s / step, flops / step / world / 1e12,
                    flops / step / world / peak, hw / step / world / peak, sum(memory.values()) <= limit, limit,
                    stage_load=sum(rank_time) / (pp * rank_time[slowest]) if rank_time[slowest] else 1.0)
