"""The planner's cost model: memory per GPU and time per training step of one layout, term by term
(arithmetic, no tensors).

Memory reuses `core.memory` (model states per parameter with ZeRO, the activation formula that
`meshlm bench memory` validates, the pipeline's in-flight micro-batches); time is a sum of named terms:

    step = m · t_mb(slowest pipeline rank r*) + Σ_{r ≠ r*} t_mb(r) / v    (1F1B; interleaved over v chunks)
           + exposed DP reduction + ZeRO all-gather + optimizer step

with t_mb, one micro-batch's forward and backward on a rank, the sum of its layers' GEMMs (at an efficiency
that grows with the GEMM's width), attention, memory-bound elementwise work, recomputation's extra forward,
the TP collectives (α–β model), the context-parallel ring's exposed traffic, the LM head and loss, the
pipeline sends, and host op overhead. Under context parallelism (cp) every per-token quantity counts the
rank's s/cp tokens and the gradient reduction and ZeRO run over the dp × cp ranks.
docs/plan.md derives each term and says where each constant of `Calibration` comes from.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from meshlm.core.config import Config, ConfigError, ModelConfig
from meshlm.core.flops import layer_flops_per_token, model_flops, rank_attention_flops, recompute_flops
from meshlm.core.layout import Layout, full_recompute_chunks, recomputed_layers
from meshlm.core.memory import (
    KORTHIKANTI_DTYPES,
    ActivationDtypes,
    activation_dtypes,
    activation_terms,
    attention_backend,
    model_state_bytes_per_param,
    moe_mlp_parameters,
    mtp_activation_terms,
    pipeline_activation_factor,
    ring_buffer_bytes,
    ring_send_bytes,
)
from meshlm.families.registry import get_spec, muon_share
from meshlm.plan.catalog import Gpu, shared_rates
from meshlm.plan.overlap import dualpipe_bubble, exposed, fp8_share, mirrored, node_limited_time

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
    `core.memory`), and the model-state scheme: meshlm's fp32 weights under autocast ("fp32": 16 B/param)
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
    # DeepSeek-V3's runtime (`plan/overlap.py`). dualpipe: two stages per rank, communication overlapped with
    # computation, (p/2 − 1) micro-batches of fill and drain. comm_sm_share: the share of the GPU's cores that
    # run the overlapped communication, lost to the GEMMs and attention (DeepSeek: 20 of the H800's 132 SMs).
    # ep_dispatch_bytes: bytes per element of the dispatch-direction all-to-alls (forward dispatch, backward
    # combine-gradient; None: the activations' element; DeepSeek: FP8, 1). ep_node_limited: a token crosses the
    # network once per node it targets, NVLink forwards it inside (`overlap.node_limited_time`).
    dualpipe: bool = False
    comm_sm_share: float = 0.0
    ep_dispatch_bytes: float | None = None
    ep_node_limited: bool = False


# The runtimes `meshlm plan --runtime` describes (commands/plan.py lists the names): meshlm's own, and
# Megatron-LM as the published measurements ran it (benchmarks/plan_validation.py). Megatron-LM 2021
# (Narayanan et al.): 16-bit compute with fp32 master weights, the s×s attention scores stored (no flash
# attention), the DP all-reduce after the whole backward, every TP collective waited for, the weight
# gradients accumulated by the GEMMs themselves. 2022 (Korthikanti et al.): the same, with the backward's
# TP collectives (and SP's re-gathers) overlapped with the weight-gradient GEMMs.
_MEGATRON_2021 = Options(precision="bf16", device_type="cuda", backend="math", dtypes=KORTHIKANTI_DTYPES,
                         states="mixed", grad_bytes=4.0, fused_loss=False, sp_regather=False, dp_overlap=False,
                         tp_backward_overlap=False, fused_grad_accumulation=True)
RUNTIMES: dict[str, Options | None] = {
    "meshlm": None,  # None: the precision, device and loss of the config and GPU (`plan.report`)
    "megatron-2021": _MEGATRON_2021,
    "megatron-2022": dataclasses.replace(_MEGATRON_2021, tp_backward_overlap=True),
    # DeepSeek-V3 as its report describes the run (§3.2-3.3, docs/formulas.md "DeepSeek-V3"): FP8 GEMMs in the
    # linear layers, BF16 elsewhere and in the saved activations (fp32 norm statistics), fp32 master weights and
    # gradients (Megatron's "mixed" states: 2 + 4 + 12 B per parameter, the report's BF16 Adam moments not
    # credited), flash attention, the gradients accumulated in fp32 by the GEMMs, DualPipe with 20 of 132 SMs
    # on communication, the dispatch in FP8 and node-limited.
    "deepseek-v3": Options(precision="fp8", device_type="cuda", backend="flash",
                           dtypes=ActivationDtypes(residual=2, compute=2, math=2, bool_masks=True),
                           states="mixed", fused_loss=True, fused_grad_accumulation=True, dualpipe=True,
                           comm_sm_share=20 / 132, ep_dispatch_bytes=1.0, ep_node_limited=True),
}


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
    cp: int = 1  # context parallelism: the sequence split over cp ranks (ring attention)
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp × cp ranks

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def recompute_label(self) -> str:
        if self.recompute == "full" and self.recompute_num_layers:
            return f"full:{self.recompute_num_layers}"
        return self.recompute

    def label(self) -> str:
        return (f"tp={self.tp},pp={self.pp},vpp={self.vpp},dp={self.dp},cp={self.cp},sp={str(self.sp).lower()},"
                f"mbs={self.micro_batch_size},recompute={self.recompute_label},zero={self.zero}"
                + (f",ep={self.ep}" if self.ep > 1 else ""))

    def overrides(self) -> list[str]:
        """The config overrides that run this layout with `meshlm train`."""
        out = [f"--parallel.tp={self.tp}", f"--parallel.pp={self.pp}", f"--parallel.dp={self.dp}",
               f"--parallel.cp={self.cp}", f"--parallel.vpp={self.vpp}", f"--parallel.sp={str(self.sp).lower()}",
               f"--parallel.zero={self.zero}", f"--train.micro_batch_size={self.micro_batch_size}",
               f"--train.recompute={self.recompute}"]
        if self.recompute == "full" and self.recompute_num_layers:
            out += ["--train.recompute_method=block", f"--train.recompute_num_layers={self.recompute_num_layers}"]
        if self.ep > 1:
            out.append(f"--parallel.ep={self.ep}")
        return out

    def apply(self, cfg: Config, global_batch_size: int | None = None, sections: dict | None = None) -> Config:
        """`cfg` with this layout (not validated: `search.check` validates). `sections` keeps the parallel and
        train sections built for one base config across a search's candidates, which share a few of each."""
        block = self.recompute == "full" and self.recompute_num_layers > 0
        gbs = global_batch_size or cfg.train.global_batch_size
        cache = {} if sections is None else sections
        pkey = ("parallel", self.tp, self.pp, self.dp, self.vpp, self.sp, self.zero, self.cp, self.ep)
        if pkey not in cache:
            cache[pkey] = dataclasses.replace(cfg.parallel, tp=self.tp, pp=self.pp, dp=self.dp, vpp=self.vpp,
                                              sp=self.sp, zero=self.zero, pp_layers=[], cp=self.cp, ep=self.ep)
        tkey = ("train", self.micro_batch_size, gbs, self.recompute, self.recompute_num_layers)
        if tkey not in cache:
            cache[tkey] = dataclasses.replace(cfg.train, micro_batch_size=self.micro_batch_size, global_batch_size=gbs,
                                              recompute=self.recompute, recompute_method="block" if block else "uniform",
                                              recompute_num_layers=self.recompute_num_layers if block else 0)
        par, train = cache[pkey], cache[tkey]
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
        out = {"tp": c.tp, "pp": c.pp, "vpp": c.vpp, "dp": c.dp, "cp": c.cp, "ep": c.ep, "sp": c.sp,
               "micro_batch_size": c.micro_batch_size,
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
    """(per layer: the model's mean layer, outside the layers, word embedding V·h) parameters, from the family's
    exact count. The one- and two-layer models give what lies outside the layers; the mean layer comes from the
    whole model, so first dense layers (`moe_first_dense`) or alternating MoE layers are counted at their share."""
    count, main = get_spec(m.family).parameter_count, dataclasses.replace(m, mtp_depth=0)  # MTP: `_with_mtp`
    one = count(dataclasses.replace(main, n_layers=1))
    two = count(dataclasses.replace(main, n_layers=2))
    outside = 2 * one - two
    return float(count(main) - outside) / m.n_layers, float(outside), float(m.vocab_size * m.hidden_size)


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


def rank_expert_parameters(m: ModelConfig, layers: int, tp: int, ep: int) -> tuple[float, float]:
    """(what the MoE layers among `layers` add to `rank_parameters`'s count, which split them over tp; this
    rank's expert parameters). meshlm does not split an MoE layer over tp (parallel/expert.py): its router
    and shared experts are whole on every tp rank, its E experts split over ep only (E/ep per rank). The MoE
    layers are taken spread evenly over the stages."""
    if m.moe_experts <= 0:
        return 0.0, 0.0
    n_moe = layers * m.moe_layers() / m.n_layers
    experts = n_moe * 3 * m.hidden_size * m.expert_size * m.moe_experts
    whole = n_moe * moe_mlp_parameters(m)  # experts, router, shared experts and gate
    return whole - whole / tp - experts + experts / ep, experts / ep


def _rank_parameters(m: ModelConfig, layers: list[int], tp: int, pp: int) -> list[float]:
    """`rank_parameters` of every pipeline rank, given its layers; the middle ranks' once per layer count
    (pp can be 128)."""
    middle: dict[int, float] = {}
    out = []
    for k, n in enumerate(layers):
        if 0 < k < pp - 1:
            if n not in middle:
                middle[n] = rank_parameters(m, n, False, False, tp, pp)
            out.append(middle[n])
        else:
            out.append(rank_parameters(m, n, k == 0, k == pp - 1, tp, pp))
    return out


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


def all_to_all_time(nbytes: float, n: int, gbps: float, latency_us: float, eff: float) -> float:
    """All-to-all of `nbytes` per rank, spread evenly over the n ranks: (n−1)/n of them leave, one latency
    step per peer."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / (gbps * 1e9 * eff) + (n - 1) * latency_us * 1e-6


def dispatch_bytes(m: ModelConfig, b: int, tokens: int, c_bytes: int) -> float:
    """The token rows one all-to-all of an MoE layer moves per rank: b · tokens · top_k rows of h elements."""
    return b * tokens * m.moe_top_k * m.hidden_size * c_bytes


def moe_layer_share(m: ModelConfig) -> float:
    """The share of the layers that are MoE layers (0 for a dense model)."""
    if m.moe_experts <= 0:
        return 0.0
    return m.moe_layers() / m.n_layers


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
                 seq_len: int, cp: int = 1) -> float:
    """The mean layer's saved bytes on a rank; `seq_len` is the whole sequence, of which the rank holds 1/cp.
    Each kind of layer (MoE or dense MLP, sliding-window or global attention: `layer_kinds`) counts its own
    terms (`activation_terms`), weighted by how many layers have it: a stage's layers are taken as the model's
    mean layer, as its parameters are (`_parameter_split`)."""
    dtypes = opts.dtypes or activation_dtypes(opts.precision, opts.device_type)
    backend = opts.backend or attention_backend(opts.device_type, m.dropout)
    total = sum(n * sum(activation_terms(m, b, tp, sp, recompute, dtypes, backend, seq_len, cp, moe=moe,
                                         local=local).values()) for (moe, local), n in layer_kinds(m).items())
    return total / m.n_layers


def _mtp_bytes_fix(m: ModelConfig, b: int, tp: int, sp: bool, cand: Candidate, opts: Options, seq_len: int, cp: int,
                   stored: float, full_bytes: float) -> float:
    """What the last stage's MTP modules save (`mtp_activation_terms`: their norms, the merge's input, a block of
    the last layer's kind) less what `_with_mtp` counted for them (one mean layer each: `stored`, or a checkpoint
    region's input `full_bytes` when their blocks are recomputed whole)."""
    if not m.mtp_depth:
        return 0.0
    dtypes = opts.dtypes or activation_dtypes(opts.precision, opts.device_type)
    backend = opts.backend or attention_backend(opts.device_type, m.dropout)
    whole = cand.recompute == "full" and not cand.recompute_num_layers  # `_with_mtp`: recomputed as regions
    mode = "full" if whole else ("none" if cand.recompute == "full" else cand.recompute)
    own = sum(sum(mtp_activation_terms(m, b, k, tp, sp, mode, dtypes, backend, seq_len, cp,
                                       head_keeps_h=tp > 1 and dtypes.compute >= dtypes.residual).values())
              for k in range(1, m.mtp_depth + 1))
    return own - m.mtp_depth * (full_bytes if whole else stored)


@lru_cache(maxsize=64)
def layer_kinds(m: ModelConfig) -> dict[tuple[bool, bool], int]:
    """{(MoE layer, sliding-window layer): how many layers} of the model."""
    out: dict[tuple[bool, bool], int] = {}
    for i in range(m.n_layers):
        key = (m.is_moe_layer(i), m.layer_window(i) > 0)
        out[key] = out.get(key, 0) + 1
    return out


def _ring_buffers(r: _Run) -> float:
    """The cp ring's transient buffers on a rank (`core.memory.ring_buffer_bytes`), 0 without cp."""
    return _ring_buffer_total(r.m, r.b, r.tp, r.cp, r.opts, r.seq) if r.cp > 1 else 0.0


@lru_cache(maxsize=4096)
def _ring_buffer_total(m: ModelConfig, b: int, tp: int, cp: int, opts: Options, seq_len: int) -> float:
    dtypes = opts.dtypes or activation_dtypes(opts.precision, opts.device_type)
    backend = opts.backend or attention_backend(opts.device_type, m.dropout)
    return sum(ring_buffer_bytes(m, b, tp, cp, dtypes, backend, seq_len).values())


def estimate(cfg: Config, layout: Layout, cand: Candidate, cluster: Cluster, opts: Options | None = None,
             cal: Calibration | None = None, time_too_big: bool = True) -> Estimate:
    """Memory per GPU and step time of `cand`, whose config `cfg` is (`cand.apply`) and whose `layout` is
    `plan_layout`'s answer (`search.evaluate` checks and calls this).

    On a CPU host whose cores the processes share (`gpu.host_cores`), the rates each process gets depend on
    how many are at work at once: first every process of the layout, then the processes times the
    pipeline's busy share (`stage_load`: a stage that waits for a slower one leaves its core to the others).

    `time_too_big=False` (a search) leaves out the time of a layout that does not fit (its `time` empty, its
    step infinite): the memory is costed first, and most of a large search does not fit."""
    gpu = cluster.gpu
    if not gpu.host_cores:
        return _estimate(cfg, layout, cand, cluster, opts, cal, time_too_big)
    first = _estimate(cfg, layout, cand, dataclasses.replace(cluster, gpu=shared_rates(gpu, cand.world)), opts, cal,
                      time_too_big)
    if not first.fits and not time_too_big:
        return first
    busy = cand.world * first.stage_load
    return _estimate(cfg, layout, cand, dataclasses.replace(cluster, gpu=shared_rates(gpu, busy)), opts, cal,
                     time_too_big)


@dataclass(frozen=True)
class _Run:
    """What every step of `_estimate` reads: the layout's sizes, the GPU's rates and the groups' links."""

    cfg: Config
    cand: Candidate
    cluster: Cluster
    opts: Options
    cal: Calibration
    s: int  # tokens of the sequence on this rank: seq / cp
    seq: int  # the whole sequence
    b: int  # micro-batch size
    tp: int
    pp: int
    dp: int
    cp: int
    v: int  # virtual stages (1 without a pipeline)
    sp: bool  # sequence parallelism (tp > 1)
    mb: int  # micro-batches per step
    peak: float  # FLOP/s
    hbm: float  # B/s
    c_bytes: int  # bytes of a 16-bit or fp32 activation element
    tp_link: tuple[float, float]  # (GB/s, latency µs) of each group
    cp_link: tuple[float, float]
    dp_link: tuple[float, float]  # the gradient reduction's group: dp × cp ranks
    pp_link: tuple[float, float]
    ep: int = 1  # expert parallelism (carved from dp × cp)
    ep_link: tuple[float, float] = (1.0, 0.0)  # an ep group: ep consecutive dp × cp indices, tp · ep ranks
    fp8_peak: float = 0.0  # FLOP/s of the GEMMs that run in FP8 (precision 'fp8')

    @property
    def rate(self) -> float:
        """The 16-bit FLOP/s the compute gets: the peak less the cores the overlapped communication holds."""
        return self.peak * (1.0 - self.opts.comm_sm_share)

    def gemm_time(self, flops: float, eff: float) -> float:
        """Seconds of the layers' matmuls: under FP8 training `overlap.fp8_share` of them at the FP8 peak."""
        if self.opts.precision != "fp8":
            return flops / (self.rate * eff)
        share = fp8_share(self.m)
        fp8_rate = self.fp8_peak * (1.0 - self.opts.comm_sm_share)
        return flops * share / (fp8_rate * eff) + flops * (1.0 - share) / (self.rate * eff)

    @property
    def m(self) -> ModelConfig:
        return self.cfg.model

    @property
    def gpu(self) -> Gpu:
        return self.cluster.gpu

    @property
    def dpc(self) -> int:
        """The ranks that reduce gradients and shard ZeRO states: dp × cp (weights are replicated over cp)."""
        return self.dp * self.cp

    @property
    def act_msg(self) -> float:
        """The bytes of one micro-batch's residual stream (a TP collective's message)."""
        return self.b * self.s * self.m.hidden_size * self.c_bytes

    @property
    def weight_elem(self) -> int:
        """Bytes per weight the ZeRO all-gathers move: meshlm's are fp32; with 16-bit weights and fp32 master
        copies ("mixed", Megatron's distributed optimizer) the updated 16-bit weights are gathered."""
        return 2 if self.opts.states == "mixed" and self.opts.precision in ("bf16", "fp16", "fp8") else 4

    def all_reduce(self, nbytes: float, n: int, link: tuple[float, float]) -> float:
        return all_reduce_time(nbytes, n, link[0], link[1], self.cal.link_efficiency)

    def gather(self, nbytes: float, n: int, link: tuple[float, float]) -> float:
        """An all-gather or reduce-scatter, `gather_cost` of an all-reduce."""
        return gather_time(nbytes, n, link[0], link[1], self.cal.link_efficiency, self.gpu.gather_cost)


def _run(cfg: Config, cand: Candidate, cluster: Cluster, layout: Layout, opts: Options | None,
         cal: Calibration | None) -> _Run:
    """The common quantities of `cand` on `cluster` (defaults: `Options()`, the GPU's `Calibration`)."""
    opts, cal = opts or Options(), for_gpu(cal or Calibration(), cluster.gpu)
    tp, pp, dp, cp = cand.tp, cand.pp, cand.dp, cand.cp
    gpu = cluster.gpu
    if opts.precision == "fp8" and not gpu.fp8_tflops:
        raise ConfigError(f"FP8 GEMMs on --gpu {gpu.name}, which has no FP8 peak in the catalog; use a Hopper or "
                          "later GPU (h100-80gb, h800, h200, b200) or another --runtime")
    if opts.dualpipe and pp > 1 and (cand.vpp > 1 or pp % 2):
        raise ConfigError(f"DualPipe pairs stage k with stage p − 1 − k, one chunk each: it needs an even parallel.pp "
                          f"and parallel.vpp=1 (got pp={pp}, vpp={cand.vpp}); choose such a layout or another --runtime")
    # the mesh is (pp, dp, cp, tp), tp innermost: a cp group spans tp · cp consecutive ranks
    return _Run(cfg, cand, cluster, opts, cal, s=cfg.model.seq_len // cp, seq=cfg.model.seq_len,
                b=cand.micro_batch_size, tp=tp, pp=pp, dp=dp, cp=cp,
                v=cand.vpp if pp > 1 else 1, sp=cand.sp and tp > 1, mb=layout.microbatches, peak=gpu.tflops * 1e12,
                hbm=gpu.hbm_gbps * 1e9, c_bytes=4 if opts.precision == "fp32" else 2,
                tp_link=_link(cluster, tp), cp_link=_link(cluster, tp * cp), dp_link=_link(cluster, tp * cp * dp),
                pp_link=_link(cluster, tp * cp * dp * 2) if pp > 1 else (1.0, 0.0), ep=cand.ep,
                ep_link=_link(cluster, tp * cand.ep), fp8_peak=(gpu.fp8_tflops or 0.0) * 1e12)


@dataclass(frozen=True)
class _LayerTimes:
    """One layer, one micro-batch, forward + backward, on one tp rank: seconds by term, and the bytes it stores."""

    gemm: float
    attn: float
    elem: float
    n_coll: int  # TP collectives waited for
    coll: float  # one of them
    regather: float  # SP's backward re-gathers (or, overlapped, what of the collectives stays exposed)
    ops: float  # host op overhead
    full_extra: float  # full recomputation's replayed forward
    sel_extra: float  # selective recomputation's
    stored: float  # bytes saved for backward (selective: without the attention core)
    ring: float = 0.0  # the cp ring's exposed traffic and latency, forward + backward
    a2a: float = 0.0  # expert parallelism's all-to-alls (dispatch, combine; forward + backward), per layer on average

    @property
    def unit(self) -> float:
        return (self.gemm + self.attn + self.elem + self.n_coll * self.coll + self.regather + self.ops + self.ring
                + self.a2a)


def ring_exposed_time(block_bytes: float, cp: int, attn_time: float, gbps: float, latency_us: float,
                      eff: float, grad_bytes: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds the cp ring adds to one layer's attention, which takes `attn_time` (forward
    + backward, this rank's 1/cp share) without it.

    Each rank runs cp block steps; while it computes one block it sends its current K/V block (`block_bytes`)
    to the next rank and receives the next: cp − 1 transfers, each overlapped with a step's compute, so a step
    costs max(compute, transfer) plus the send's latency α. Forward: a step computes 1/cp of the forward (⅓ of
    the attention) and moves one block; backward: 1/cp of the backward (⅔) and moves the K/V block and the
    accumulated dK/dV (`grad_bytes`, fp32 at least; `ring_send_bytes`), and a last dK/dV hop home has no
    compute to hide behind. Returns what exceeds the compute: (cp − 1) · (max(0, transfer − compute) + α) per
    direction, plus that last hop in backward."""
    if cp <= 1:
        return 0.0, 0.0
    grad_bytes = block_bytes if grad_bytes is None else grad_bytes
    bw, alpha = gbps * 1e9 * eff, latency_us * 1e-6
    fwd_compute, bwd_compute = attn_time / (3 * cp), 2 * attn_time / (3 * cp)
    fwd = (cp - 1) * (max(0.0, block_bytes / bw - fwd_compute) + alpha)
    bwd = (cp - 1) * (max(0.0, (block_bytes + grad_bytes) / bw - bwd_compute) + alpha) + grad_bytes / bw + alpha
    return fwd, bwd


def _layer_times(r: _Run) -> _LayerTimes:
    m, cal, opts, b, s, tp, sp, cp = r.m, r.cal, r.opts, r.b, r.seq, r.tp, r.sp, r.cp
    eff = gemm_efficiency(m.hidden_size / tp, cal)
    dense = layer_flops_per_token(m) * b * r.s / tp  # this rank's s/cp tokens
    attn = rank_attention_flops(m, b, s, tp, cp)  # 1/cp of the causal scores (the load balance)
    t_gemm = r.gemm_time(dense, eff)
    t_attn = attn / (r.rate * eff * cal.attention_efficiency)
    stored = _layer_bytes(m, b, tp, sp, "selective" if r.cand.recompute == "selective" else "none", opts, s, cp)
    none_bytes = _layer_bytes(m, b, tp, sp, "none", opts, s, cp)
    t_elem = cal.elementwise_passes * none_bytes / r.hbm
    # two in forward (after attention, after the MLP), two in backward (their conjugates), unless those
    # hide behind the weight-gradient GEMMs (a third of the layer's GEMM time)
    n_coll = 2 if opts.tp_backward_overlap else 4
    # under SP each all-reduce is an all-gather and a reduce-scatter, each `gather_cost` of an all-reduce
    t_coll = r.all_reduce(r.act_msg, tp, r.tp_link) * (2 * r.gpu.gather_cost if sp else 1.0)
    t_regather = 2 * r.gather(r.act_msg, tp, r.tp_link) if sp and opts.sp_regather else 0.0
    if opts.tp_backward_overlap:
        t_regather = max(0.0, 2 * t_coll + t_regather - t_gemm / 3)
    t_ops = cal.layer_ops * r.gpu.op_overhead_us * 1e-6
    # recomputation: full replays the layer's forward (GEMMs, attention, elementwise, its two collectives);
    # selective the attention core
    # the cp ring: K/V blocks of this rank's s/cp tokens and KV heads, c_bytes each, around cp ranks; a
    # replayed forward (full, or selective's attention core) runs the forward ring again
    sent = ring_send_bytes(m, b, tp, cp, dataclasses.replace(KORTHIKANTI_DTYPES, compute=r.c_bytes), s)
    ring_fwd, ring_bwd = ring_exposed_time(sent["block"], cp, t_attn, r.cp_link[0], r.cp_link[1], cal.link_efficiency,
                                           sent["grad_block"])
    # expert parallelism: each MoE layer's all-to-alls (`_ep_exchanges`); not overlapped but under DualPipe, where
    # the replayed forward's join the overlapped communication too (`_rank_comm`)
    a2a = moe_layer_share(m) * _ep_exchanges(r) if r.ep > 1 else 0.0
    replayed_a2a = 0.0 if opts.dualpipe else a2a / 2
    full_extra = (t_gemm / 3 + t_attn / 3 + t_elem / cal.elementwise_passes + 2 * t_coll + t_ops / 3 + ring_fwd
                  + replayed_a2a)
    # selective: the attention core's GEMMs and the elementwise work on what it no longer stores (one pass)
    sel_extra = t_attn / 3 + (none_bytes - _layer_bytes(m, b, tp, sp, "selective", opts, s, cp)) / r.hbm + ring_fwd
    return _LayerTimes(t_gemm, t_attn, t_elem, n_coll, t_coll, t_regather, t_ops, full_extra, sel_extra, stored,
                       ring_fwd + ring_bwd, a2a)


def _ep_exchanges(r: _Run) -> float:
    """Seconds of one MoE layer's all-to-alls for a micro-batch: two in forward (the dispatch of this rank's tokens,
    its sequence shard under SP, top_k rows each, and the combine of the results) and their two conjugates in
    backward (the combine's gradient travels as a dispatch, the dispatch's as a combine). Dispatch-direction ones
    at `Options.ep_dispatch_bytes` per element (DeepSeek's FP8), combine-direction ones at the activations'; each
    a plain all-to-all over the EP group's link, or node-limited (`overlap.node_limited_time`)."""
    m, opts, cal, gpu = r.m, r.opts, r.cal, r.gpu
    tokens = r.b * (r.s // (r.tp if r.sp else 1))

    def one(elem: float) -> float:
        if opts.ep_node_limited:
            per_node = max(1, r.cluster.gpus_per_node // r.tp)
            return node_limited_time(tokens, m, elem, r.ep, per_node, (gpu.intra_gbps, gpu.intra_latency_us),
                                     (gpu.inter_gbps, gpu.inter_latency_us), cal.link_efficiency)
        msg = dispatch_bytes(m, 1, tokens, 1) * elem
        return all_to_all_time(msg, r.ep, r.ep_link[0], r.ep_link[1], cal.link_efficiency)

    dispatch = opts.ep_dispatch_bytes or r.c_bytes
    return 2 * one(dispatch) + 2 * one(r.c_bytes)


@dataclass(frozen=True)
class _Stages:
    """Per pipeline rank: its layers (over its virtual chunks), those that redo their forward, and (full) its
    checkpoint regions, whose inputs stay stored."""

    layers: list[int]
    recomputed: list[int]
    regions: list[int]


def _with_mtp(st: _Stages, m: ModelConfig, cand: Candidate) -> _Stages:
    """The stages with the `model.mtp_depth` MTP modules (models/mtp.py) on the last pipeline rank, beside the head
    they share: each counted as one more of the model's mean layers (its block: weights, time, recomputed as the
    stage's layers are when every layer is), its merge and norms' weights added by `_estimate`, its activations
    replaced by the modules' own in `_memory` (`_mtp_bytes_fix`)."""
    if not m.mtp_depth:
        return st
    d, every = m.mtp_depth, cand.recompute == "selective" or (cand.recompute == "full" and not cand.recompute_num_layers)
    layers, recomputed, regions = list(st.layers), list(st.recomputed), list(st.regions)
    layers[-1] += d
    recomputed[-1] += d if every else 0
    regions[-1] += d if every and cand.recompute == "full" else 0
    return _Stages(layers, recomputed, regions)


def _stages(layout: Layout, cand: Candidate, pp: int, v: int) -> _Stages:
    counts = list(layout.stage_layers)
    rank_layers = [sum(counts[r + k * pp] for k in range(v)) for r in range(pp)]
    method = "block" if cand.recompute_num_layers else "uniform"
    regions = [0] * pp
    recomputed = [0] * pp
    for r in range(pp):
        if cand.recompute == "selective":
            recomputed[r] = rank_layers[r]
        elif cand.recompute == "full":
            for k in range(v):
                n_regions, n_recomputed = _regions(counts[r + k * pp], method, cand.recompute_num_layers)
                regions[r] += n_regions
                recomputed[r] += n_recomputed
    return _Stages(rank_layers, recomputed, regions)


@lru_cache(maxsize=4096)
def _regions(n_layers: int, method: str, num_layers: int) -> tuple[int, int]:
    """(checkpoint regions, layers in them) of a stage of `n_layers` (`full_recompute_chunks`; cached: a
    search asks for the same few stage sizes for every rank of thousands of layouts)."""
    chunks = full_recompute_chunks(n_layers, method, num_layers)
    return len(chunks), sum(len(ch) for ch in chunks)


@dataclass(frozen=True)
class _Edges:
    """Per micro-batch, outside the layers: the head and loss (last rank), the TP collectives of the
    embedding (first rank) and of the head and loss (last rank), the sends (every rank but alone)."""

    head: float
    coll: list[float]  # per pipeline rank
    p2p: float


def _edges(r: _Run) -> _Edges:
    m, cal, opts, gpu, b, s, tp, pp, sp = r.m, r.cal, r.opts, r.gpu, r.b, r.s, r.tp, r.pp, r.sp
    # the head runs once more for each MTP module, whose 2h → h merge is a GEMM too (`_with_mtp`)
    head_flops = 6.0 * b * s * m.hidden_size * m.vocab_size / tp * (1 + m.mtp_depth)
    merge_flops = 6.0 * b * s * 2 * m.hidden_size ** 2 / tp * m.mtp_depth
    # the fused head + loss (tp = 1) works chunk by chunk in cache; otherwise the fp32 logits go to memory
    # and back like any saved tensor
    logits_bytes = 0.0 if (tp == 1 and opts.fused_loss) else b * s * m.vocab_size / tp * 4 * (1 + m.mtp_depth)
    eff = gemm_efficiency(m.hidden_size, cal)
    t_head = head_flops / (r.rate * eff) + r.gemm_time(merge_flops, eff) + cal.elementwise_passes * logits_bytes / r.hbm
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
        t_embed_coll = r.gather(r.act_msg, tp, r.tp_link) if sp else r.all_reduce(r.act_msg, tp, r.tp_link)
        t_head_coll = t_embed_coll + r.all_reduce(4.0 * b * s, tp, r.tp_link) \
            + r.all_reduce(8.0 * b * s, tp, r.tp_link)
    edge_coll = [(t_embed_coll if k == 0 else 0.0) + (t_head_coll if k == pp - 1 else 0.0) for k in range(pp)]
    send = b * s * m.hidden_size * r.c_bytes / (tp if sp else 1)
    pp_gbps, pp_lat = r.pp_link
    t_p2p = 2 * r.v * (pp_lat * 1e-6 + send / (pp_gbps * 1e9 * cal.link_efficiency)) if pp > 1 else 0.0
    return _Edges(t_head, edge_coll, t_p2p)


def _rank_comm(r: _Run, lt: _LayerTimes, st: _Stages, edges: _Edges, rank: int) -> tuple[float, float]:
    """(EP all-to-all, PP sends) of one micro-batch on pipeline rank `rank`: as they run, waited for; under
    DualPipe (`overlap.py`) only what exceeds the rank's computation of a micro-batch (its layers' GEMMs, attention
    and elementwise work), the all-to-alls of full recomputation's replayed forwards included."""
    n = st.layers[rank]
    a2a = n * lt.a2a
    if not r.opts.dualpipe:
        return a2a, edges.p2p
    compute = n * (lt.gemm + lt.attn + lt.elem)
    if r.cand.recompute == "full":  # the replayed forwards: their all-to-alls, and their compute to hide them
        a2a += st.recomputed[rank] * lt.a2a / 2
        compute += st.recomputed[rank] * lt.full_extra
    ep = exposed(a2a, compute)
    return ep, exposed(a2a + edges.p2p, compute) - ep


def _rank_terms(r: _Run, lt: _LayerTimes, st: _Stages, edges: _Edges, rank: int) -> dict[str, float]:
    """One micro-batch on pipeline rank `rank`, by named term."""
    n = st.layers[rank]
    extra = st.recomputed[rank] * (lt.full_extra if r.cand.recompute == "full" else lt.sel_extra)
    ep, p2p = _rank_comm(r, lt, st, edges, rank)
    return {"GEMMs (layers)": n * lt.gemm, "attention": n * lt.attn, "elementwise (memory-bound)": n * lt.elem,
            "recompute (extra forward)": extra, "TP collectives": n * (lt.n_coll * lt.coll + lt.regather),
            "CP ring (exposed)": n * lt.ring, "EP all-to-all": ep,
            "LM head + loss": edges.head if rank == r.pp - 1 else 0.0, "PP point-to-point": p2p,
            "TP collectives (embedding, head, loss)": edges.coll[rank],
            "op overhead (host)": n * lt.ops}


def _pipeline_time(r: _Run, lt: _LayerTimes, st: _Stages, edges: _Edges
                   ) -> tuple[dict[str, float], dict[str, float], list[float], int]:
    """(the step's time by term so far: the slowest rank's m micro-batches and the bubble; that rank's one
    micro-batch by term; every rank's micro-batch time; the slowest rank)."""
    pp = r.pp
    # the slowest rank from scalar totals (pp can be 64), then its terms by name
    extra_unit = lt.full_extra if r.cand.recompute == "full" else lt.sel_extra
    rank_time = [st.layers[k] * (lt.unit - lt.a2a) + st.recomputed[k] * extra_unit + sum(_rank_comm(r, lt, st, edges, k))
                 + (edges.head if k == pp - 1 else 0.0) + edges.coll[k] for k in range(pp)]
    if r.opts.dualpipe:  # each rank runs stage k and stage p − 1 − k, half the micro-batches each
        rank_time = mirrored(rank_time)
    slowest = max(range(pp), key=lambda k: rank_time[k])
    terms = _rank_terms(r, lt, st, edges, slowest)
    if r.opts.dualpipe:
        mirror = _rank_terms(r, lt, st, edges, pp - 1 - slowest)
        terms = {k: (v + mirror[k]) / 2 for k, v in terms.items()}
    time = {k: r.mb * val for k, val in terms.items()}
    # fill and drain: while the slowest rank is busy with its m micro-batches, every other rank does one
    # micro-batch's forward and backward outside that window, each in v chunks (equal stages: (p − 1)/v · t);
    # DualPipe: (p/2 − 1) of them
    others = sum(rank_time) - rank_time[slowest]
    bubble = dualpipe_bubble(others, pp) if r.opts.dualpipe else others / r.v
    time["pipeline bubble"] = bubble if pp > 1 else 0.0
    return time, terms, rank_time, slowest


def _update_time(r: _Run, terms: dict[str, float], p_max: float, slowest_layers: int,
                 p_expert: float = 0.0) -> dict[str, float]:
    """After the micro-batches: gradient accumulation, the data-parallel reduction, the tied embedding's
    all-reduce, the ZeRO gathers and the optimizer step, for the fullest rank's `p_max` parameters, of which
    `p_expert` are expert slices under ep > 1 (reduced over their dp·cp/ep replicas, not ZeRO-sharded)."""
    cal, opts, cand, dp, mb = r.cal, r.opts, r.cand, r.dpc, r.mb  # gradients reduce over dp × cp
    time = {"gradient accumulation": 0.0 if opts.fused_grad_accumulation else
            (mb - 1) * 3 * opts.grad_bytes * p_max / r.hbm}
    if r.ep > 1:
        time["EP expert gradient reduction"] = r.all_reduce(p_expert * opts.grad_bytes, dp // r.ep, r.dp_link)
    p_max -= p_expert if r.ep > 1 else 0.0
    grads = p_max * opts.grad_bytes
    if dp > 1:  # ZeRO-3 too: FSDP2 accumulates unsharded gradients and reduce-scatters in the last backward
        reduce = r.gather(grads, dp, r.dp_link) if cand.zero >= 2 else r.all_reduce(grads, dp, r.dp_link)
        window = (2 / 3) * (terms["GEMMs (layers)"] + terms["attention"]) \
            if opts.dp_overlap else 0.0
        tail = r.all_reduce(min(grads, r.cfg.parallel.bucket_mb * 2 ** 20), dp, r.dp_link)
        time["DP gradient reduction (exposed)"] = max(reduce - window, tail)
    else:
        time["DP gradient reduction (exposed)"] = 0.0
    # the tied word embedding's two copies (first and last pipeline rank) sum their gradients after the
    # backward, over the pair's link, before the optimizer can step
    if r.pp > 1 and r.m.tie_embeddings:
        time["tied embedding all-reduce (first, last stage)"] = r.all_reduce(
            opts.grad_bytes * r.m.vocab_size * r.m.hidden_size / r.tp, 2, _link(r.cluster, cand.world))
    weight_bytes = p_max * r.weight_elem
    time["ZeRO weight all-gather"] = r.gather(weight_bytes, dp, r.dp_link) if dp > 1 and cand.zero in (1, 2) else 0.0
    if dp > 1 and cand.zero == 3:  # per micro-batch: gather the weights in forward and again in backward
        per_mb = 2 * r.gather(weight_bytes, dp, r.dp_link)
        compute = terms["GEMMs (layers)"] + terms["attention"]
        time["ZeRO-3 gathers (exposed)"] = mb * max(per_mb - compute, 0.0) + per_mb / max(1, slowest_layers)
    shard = dp if cand.zero >= 1 else 1
    whole = p_expert if r.ep > 1 else 0.0
    time["optimizer step"] = cal.optimizer_bytes_per_param * (p_max / shard + whole) / r.hbm
    return time


def _memory(r: _Run, stored: float, st: _Stages, params: list[float], experts: list[float] | None = None
            ) -> dict[str, float]:
    """Memory on the fullest rank, by term: the first, the last and the fullest middle rank can be the fullest
    one (ranks in between hold fewer micro-batches than the first and no embedding or head)."""
    # ZeRO shards over dp × cp (the ranks whose gradients are reduced together, as Megatron's distributed
    # optimizer does); the logits and the ring's buffers are this rank's s/cp tokens
    m, opts, cand, b, s, tp, pp, dp, mb, v = r.m, r.opts, r.cand, r.b, r.s, r.tp, r.pp, r.dpc, r.mb, r.v
    per_param = model_state_bytes_per_param(opts.states, dp, distributed_optimizer=cand.zero >= 1,
                                            muon_share=muon_share(r.cfg))
    if cand.zero >= 3:
        per_param["weights"] /= dp
    # expert slices (ep > 1): their states whole on each of their dp·cp/ep replicas (parallel/expert.py)
    experts = experts if experts is not None and r.ep > 1 else [0.0] * pp
    whole = model_state_bytes_per_param(opts.states, 1, muon_share=muon_share(r.cfg))
    a2a = 4 * dispatch_bytes(m, b, s // (tp if r.sp else 1), r.c_bytes) if r.ep > 1 else 0.0
    full_bytes = _layer_bytes(m, b, tp, r.sp, "full", opts, r.seq, r.cp)
    mtp_fix = _mtp_bytes_fix(m, b, tp, r.sp, cand, opts, r.seq, r.cp, stored, full_bytes)  # the last stage's
    ring = _ring_buffers(r)
    factor = pipeline_activation_factor(pp, mb, v) if pp > 1 else 1.0

    def rank_memory(k: int) -> dict[str, float]:
        dense, ex = params[k] - experts[k], experts[k]
        mem = {"weights": per_param["weights"] * dense + whole["weights"] * ex, "gradients": 0.0,
               "optimizer states": per_param["optimizer"] * dense + whole["optimizer"] * ex}
        if opts.precision != "fp32" and opts.states == "fp32":
            mem["16-bit weight copies (autocast)"] = 2.0 * params[k]
        if cand.recompute == "full":
            layer_acts = (st.layers[k] - st.recomputed[k]) * stored + st.regions[k] * full_bytes
        else:
            layer_acts = st.layers[k] * stored
        if k == pp - 1 or (opts.dualpipe and k == 0):  # the MTP modules' own bytes, not mean layers'
            layer_acts += mtp_fix
        # rank k of 1F1B holds min(p − k, m) micro-batches; the first rank the most
        held = factor if k == 0 else (min(pp - k, mb) * (1 + (pp - 1) / (pp * v)) if v > 1 else min(pp - k, mb))
        if opts.dualpipe:  # p + 1 micro-batches of one stage in flight (the report's Table 2); its two stages' layers
            held = min(pp + 1, mb) / 2
        mem["activations"] = layer_acts * held
        if ring:
            mem["CP ring buffers (transient)"] = ring
        # the head's saved tensors for the main loss and each MTP module's (they share the head): the fused head +
        # loss keeps its finished gradients in fp32, the weight's V·h once (one call for every depth) and the
        # stream's b·s·h per depth (models/loss.py); the unfused one the fp32 logits per depth
        calls = 1 + m.mtp_depth
        if tp == 1 and opts.fused_loss:
            logits = 4.0 * m.hidden_size * (m.vocab_size + calls * b * s)
        else:
            logits = calls * 4.0 * b * s * m.vocab_size / tp
        mem["logits (last stage)"] = logits if k == pp - 1 or (opts.dualpipe and k == 0) else 0.0
        mem["gradients"] = gradient_bytes(per_param["grads"] * dense, cand.zero, dp, mb, opts.states,
                                          mem["activations"] + mem["logits (last stage)"]) + whole["grads"] * ex
        if a2a:  # one MoE layer's rows sent, received, their outputs and the outputs back (transient)
            mem["EP all-to-all buffers (transient)"] = a2a
        if cand.zero == 3 and dp > 1:
            # FSDP2 keeps the root's own weights (embedding, final norm, head) gathered from its forward to
            # its backward, and gathers each layer whole while it runs: those full copies beside the shards
            mem["ZeRO-3 gathered weights"] = r.weight_elem * rank_parameters(m, 1, k == 0, k == pp - 1, tp, pp)
        mem["reserved (context, buffers)"] = r.cal.reserve_gib * GIB
        return mem

    middle = [k for k in range(1, pp - 1) if st.layers[k] > st.layers[0]][:1]
    return max((rank_memory(k) for k in sorted({0, pp - 1, *middle})), key=lambda d: sum(d.values()))


def _estimate(cfg: Config, layout: Layout, cand: Candidate, cluster: Cluster, opts: Options | None,
              cal: Calibration | None, time_too_big: bool = True) -> Estimate:
    r = _run(cfg, cand, cluster, layout, opts, cal)
    m, tp, pp = r.m, r.tp, r.pp
    st = _with_mtp(_stages(layout, cand, pp, r.v), m, cand)
    params = _rank_parameters(m, st.layers, tp, pp)
    params[-1] += m.mtp_depth * (2 * m.hidden_size ** 2 + 3 * m.hidden_size) / tp  # MTP merges and norms
    moe = [rank_expert_parameters(m, n, tp, r.ep) for n in st.layers]
    params = [p + fix for p, (fix, _) in zip(params, moe)]
    experts = [ex for _, ex in moe]
    held = st
    if r.opts.dualpipe and pp > 1:  # each rank holds stage k and stage p − 1 − k: both copies' weights and states
        params, experts = [2 * x for x in mirrored(params)], [2 * x for x in mirrored(experts)]
        held = _Stages(*([2 * x for x in mirrored(getattr(st, f))] for f in ("layers", "recomputed", "regions")))
    stored = _layer_bytes(m, r.b, tp, r.sp, "selective" if cand.recompute == "selective" else "none", r.opts, r.seq,
                          r.cp)
    memory = _memory(r, stored, held, params, experts)
    limit = r.gpu.memory_gib * GIB
    fits = sum(memory.values()) <= limit
    if not fits and not time_too_big:  # a search ranks only what fits: the time of the others is not needed
        return Estimate(cand, memory, {}, math.inf, 0.0, 0.0, 0.0, 0.0, False, limit)
    lt = _layer_times(r)
    time, terms, rank_time, slowest = _pipeline_time(r, lt, st, _edges(r))
    fullest = max(range(pp), key=lambda k: params[k])
    time.update(_update_time(r, terms, params[fullest], st.layers[slowest], experts[fullest]))
    step = sum(time.values())

    gbs = r.mb * r.b * r.dp
    flops = model_flops(m, gbs, r.seq)
    hw = flops + recompute_flops(m, gbs, cand.recompute, r.seq, layers=recomputed_layers(cfg))
    world, peak = cand.world, r.peak
    return Estimate(cand, memory, time, step, gbs * r.seq / step, flops / step / world / 1e12,
                    flops / step / world / peak, hw / step / world / peak, fits, limit,
                    stage_load=sum(rank_time) / (pp * rank_time[slowest]) if rank_time[slowest] else 1.0)
