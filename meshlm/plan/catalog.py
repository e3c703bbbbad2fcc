"""The accelerators the planner knows: datasheet peak rate, memory, memory bandwidth and links (torch-free).

Every number is a vendor datasheet figure (dense, no sparsity; 16-bit tensor-core rate: bf16 where the chip
has it, fp16 on V100), stated per GPU:

* `tflops`: dense bf16/fp16 tensor-core peak, TFLOP/s; `fp8_tflops`: the dense FP8 peak where the chip has one;
* `memory_gib`: memory as the driver reports it, GiB;
* `hbm_gbps`: memory bandwidth, GB/s;
* `intra_gbps`: NVLink (or PCIe) bandwidth per GPU and per direction inside a node, GB/s (the datasheet's
  bidirectional aggregate halved);
* `inter_gbps`: network bandwidth per GPU between nodes, GB/s (one InfiniBand adapter per GPU, as in a DGX);
* `intra_latency_us`, `inter_latency_us`: the α of the α–β model, the fixed cost of one step of a collective
  on that link (a few µs: the usual order of magnitude for NVLink and InfiniBand, not a datasheet figure);
* `op_overhead_us`: host time per launched operation that is *not* hidden behind the device's work. GPUs
  launch asynchronously (0); on a CPU every eager op costs its dispatch (measured by `--gpu this`);
* `gather_cost`: what an all-gather or a reduce-scatter of a tensor costs, as a fraction of an all-reduce
  of it. A ring runs half an all-reduce's steps (0.5, NCCL); gloo's are slower than that (measured by
  `--gpu this`).

Any field can be overridden (`with_overrides`, the `--gpu-*` options of `meshlm plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from meshlm.core.config import ConfigError


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: float
    memory_gib: float
    hbm_gbps: float
    intra_gbps: float
    inter_gbps: float
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    op_overhead_us: float = 0.0
    # A measured GEMM-efficiency curve (`--gpu this`) replacing `cost.Calibration`'s: efficiency(w) =
    # gemm_max_efficiency · w / (w + gemm_half_width), relative to `tflops`. None: the calibrated one.
    gemm_max_efficiency: float | None = None
    gemm_half_width: float | None = None
    # Measured (`--gpu this` on a CPU): seconds·1e9 per logit of the softmax cross-entropy's forward and
    # backward (max, subtract, exp, sum, log, gather; then softmax minus one-hot). A CPU runs these at a few
    # ns per element, far below its copy bandwidth (exp is compute-bound there). None: the bandwidth model.
    softmax_ns_per_element: float | None = None
    # Measured the same way for the fused chunked head + loss of tp = 1 (`models/loss.linear_cross_entropy`,
    # its three matmuls excluded). None: `softmax_ns_per_element` prices both paths.
    fused_softmax_ns_per_element: float | None = None
    # A CPU host whose `host_cores` cores every process of a layout shares (`share_cores`): a process that
    # is busy gets min(1, cores / busy processes) of a core (`cost.estimate` counts a pipeline's waiting
    # stages as idle), and memory-bound work (copies, the softmax) runs `busy_slowdown` times slower when
    # every core is busy (measured: the softmax on all cores at once against one), interpolated in between.
    # None: a device per process (GPUs).
    host_cores: int | None = None
    busy_slowdown: float = 1.0
    # An all-gather's or reduce-scatter's cost as a fraction of an all-reduce's of the same tensor (module
    # docstring): a ring's 0.5; measured on gloo by `measure_links`.
    gather_cost: float = 0.5
    # Dense FP8 tensor-core peak, TFLOP/s (Hopper and later; None: the chip has none): the rate of the GEMMs a
    # runtime runs in FP8 (`cost.Options.precision='fp8'`).
    fp8_tflops: float | None = None

    def describe(self) -> str:
        return (f"{self.name}: {self.tflops:g} TFLOP/s, {self.memory_gib:g} GiB, HBM {self.hbm_gbps:g} GB/s, "
                f"intra-node {self.intra_gbps:g} GB/s, inter-node {self.inter_gbps:g} GB/s")


CATALOG: dict[str, Gpu] = {g.name: g for g in [
    # A100 SXM: 312 TFLOP/s bf16; NVLink 3 600 GB/s both ways; HDR InfiniBand 200 Gb/s per GPU.
    Gpu("a100-80gb", 312.0, 80.0, 2039.0, 300.0, 25.0),
    Gpu("a100-40gb", 312.0, 40.0, 1555.0, 300.0, 25.0),
    # H100 SXM: 989 TFLOP/s bf16 dense, 1979 FP8 dense; NVLink 4 900 GB/s both ways; NDR 400 Gb/s per GPU.
    Gpu("h100-80gb", 989.0, 80.0, 3350.0, 450.0, 50.0, fp8_tflops=1979.0),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s.
    Gpu("h200", 989.0, 140.0, 4800.0, 450.0, 50.0, fp8_tflops=1979.0),
    # H800 SXM (the H100 for export, DeepSeek-V3's GPU): the H100's compute and 80 GB of HBM3, its NVLink cut
    # to 400 GB/s both ways; 8 × 400 Gb/s InfiniBand per node, 50 GB/s per GPU.
    Gpu("h800", 989.0, 80.0, 3350.0, 200.0, 50.0, fp8_tflops=1979.0),
    # V100 SXM2 32 GB: 125 TFLOP/s fp16 (no bf16); NVLink 2 300 GB/s both ways; EDR 100 Gb/s.
    Gpu("v100-32gb", 125.0, 32.0, 900.0, 150.0, 12.5),
    # B200: 2.25 PFLOP/s bf16 dense, 4.5 FP8 dense; NVLink 5 1.8 TB/s both ways; 400 Gb/s per GPU.
    Gpu("b200", 2250.0, 180.0, 8000.0, 900.0, 50.0, fp8_tflops=4500.0),
    # L40S (PCIe, no NVLink): 362 TFLOP/s bf16 dense, 733 FP8 dense; PCIe 4.0 x16 between GPUs.
    Gpu("l40s", 362.0, 48.0, 864.0, 32.0, 25.0, fp8_tflops=733.0),
]}

OVERRIDABLE = ("tflops", "memory_gib", "hbm_gbps", "intra_gbps", "inter_gbps", "intra_latency_us",
               "inter_latency_us", "op_overhead_us", "gather_cost")


def get_gpu(name: str) -> Gpu:
    """The catalog entry, or a ConfigError that lists the catalog (`this` is measured: `measure_this`)."""
    key = name.strip().lower()
    if key in CATALOG:
        return CATALOG[key]
    raise ConfigError(f"--gpu {name!r} is not in the catalog; use one of {', '.join(CATALOG)}, or 'this' to "
                      "measure this machine (override any field with --gpu-tflops, --gpu-memory-gb, ...)")


def with_overrides(gpu: Gpu, **values: float | None) -> Gpu:
    """`gpu` with the given fields replaced (None: keep); each must be a positive number (latencies,
    overhead: >= 0)."""
    names = {f.name for f in fields(Gpu)}
    changes = {}
    for key, value in values.items():
        if value is None:
            continue
        if key not in names or key == "name":
            raise ConfigError(f"unknown GPU field {key!r}; use one of {', '.join(OVERRIDABLE)}")
        floor_ok = value >= 0 if key.endswith(("_us",)) else value > 0
        if not floor_ok or not math.isfinite(value):  # inf or nan: a rate or size no machine has
            flag = "--gpu-" + key.replace("_", "-").replace("memory-gib", "memory-gb")
            raise ConfigError(f"{flag}={value} must be {'>= 0' if key.endswith('_us') else 'positive'} and finite")
        changes[key] = float(value)
    return replace(gpu, **changes) if changes else gpu


def measure_this(threads: int | None = None, cores: int | None = None) -> Gpu:
    """This machine as a 'GPU': the matmul rate measured here (`measure_peak_tflops`, fp32 on CPU, bf16 on
    CUDA), its memory (`fit.machine_memory`), and on CPU a GEMM-efficiency curve, the memory bandwidth of a
    large copy, the per-op dispatch overhead of eager code, a softmax cross-entropy's time per logit (the
    unfused one and the fused head's) and, with `cores` > 1, how much slower the softmax runs on all cores
    at once (`busy_slowdown`). The links are gloo over loopback on one host: a rough 2 GB/s and 50 µs here;
    `measure_links` measures them (`meshlm plan --gpu this` with more than one process)."""
    import time

    import torch

    from meshlm.core.fit import machine_memory
    from meshlm.train.metrics import measure_peak_tflops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        peak = measure_peak_tflops(device, torch.bfloat16 if cuda else torch.float32, seconds=0.3)
        overhead, bandwidth, curve = 0.0, 0.0, (None, None)
        if not cuda:
            curve = _gemm_curve(peak)
            # eager dispatch of a tiny op, the floor of every op a small model runs
            x = torch.ones(8, requires_grad=True)
            start, n = time.perf_counter(), 2000
            for _ in range(n):
                (x * 2.0).sum()
            overhead = (time.perf_counter() - start) / (2 * n) * 1e6
            # memory bandwidth: a 64 MiB copy reads and writes its bytes (the best of a few)
            src = torch.ones(16 * 2 ** 20)
            dst = torch.empty_like(src)
            best = math.inf
            for _ in range(5):
                start = time.perf_counter()
                dst.copy_(src)
                best = min(best, time.perf_counter() - start)
            bandwidth = 2 * src.numel() * 4 / best / 1e9
            softmax_ns, fused_ns = _softmax_ns_per_element(), _fused_ns_per_element()
            slowdown = _busy_slowdown(cores, softmax_ns) if cores and cores > 1 else 1.0
    finally:
        torch.set_num_threads(old)
    memory, _ = machine_memory(device.type)
    if cuda:
        props = torch.cuda.get_device_properties(0)
        return Gpu(f"this ({props.name})", peak, memory / 2 ** 30, 1000.0, 100.0, 12.5)
    return Gpu("this (cpu)", peak, memory / 2 ** 30, bandwidth, 2.0, 2.0, 50.0, 50.0, overhead, *curve,
               softmax_ns_per_element=softmax_ns, fused_softmax_ns_per_element=fused_ns,
               busy_slowdown=slowdown)


def _softmax_ns_per_element(rows: int = 512, vocab: int = 32768) -> float:
    """Nanoseconds per logit of a softmax cross-entropy, forward and backward, written out as the
    vocab-parallel loss computes it on each rank (the best of three)."""
    import time

    import torch

    z = torch.randn(rows, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (rows, 1))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        shifted = z - z.max(-1, keepdim=True).values.detach()
        loss = (shifted.exp().sum(-1, keepdim=True).log() - shifted.gather(1, target)).mean()
        loss.backward()
        best = min(best, time.perf_counter() - start)
        z.grad = None
    return best / (rows * vocab) * 1e9


def _fused_ns_per_element(rows: int = 1024, width: int = 32, vocab: int = 32768) -> float:
    """Nanoseconds per logit of the fused head + loss (`linear_cross_entropy`, forward and backward) beyond
    its three matmuls, which are timed alone at the same shapes and taken off (the best of three each)."""
    import time

    import torch

    from meshlm.models.loss import linear_cross_entropy

    h = torch.randn(rows, width, requires_grad=True)
    w = (torch.randn(vocab, width) * width ** -0.5).requires_grad_()
    target = torch.randint(0, vocab, (rows,))
    z = torch.empty(rows, vocab)

    def best_of(fn) -> float:
        fn()
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    def matmuls():
        with torch.no_grad():
            torch.matmul(h, w.t(), out=z)
            z @ w
            z.t() @ h

    def fused():
        linear_cross_entropy(h, w, target, chunk=rows).backward()
        h.grad = w.grad = None

    return max(best_of(fused) - best_of(matmuls), 0.0) / (rows * vocab) * 1e9


def _busy_worker(barrier, queue) -> None:
    import torch

    torch.set_num_threads(1)
    barrier.wait()
    queue.put(_softmax_ns_per_element())


def _busy_slowdown(cores: int, alone_ns: float) -> float:
    """The softmax's time per logit with one process per core running it at once, over `alone_ns` (one
    process alone): how much memory-bound work slows when every core is busy (at least 1)."""
    import multiprocessing
    import statistics

    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(cores), ctx.Queue()
    procs = [ctx.Process(target=_busy_worker, args=(barrier, queue), daemon=True) for _ in range(cores)]
    for proc in procs:
        proc.start()
    try:
        busy = [queue.get(timeout=300) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
    return max(1.0, statistics.median(busy) / alone_ns)


# fp32 values of the link probe's all-reduces: 4 B, 256 KiB, 2 MiB, 8 MiB
LINK_PROBE_NUMELS = (1, 64 * 2 ** 10, 512 * 2 ** 10, 2 * 2 ** 20)
GATHER_PROBE_NUMELS = LINK_PROBE_NUMELS[2:]  # where bandwidth, not latency, sets the cost


def _link_worker(rank: int, init: str, queue) -> None:
    """One of two gloo processes of `measure_links`: the cost of an all-reduce of each probe size after ~3 ms
    of matmuls on both ranks (median of matmuls + all-reduce, less the median of the matmuls alone), and of
    an all-gather and a reduce-scatter of the larger tensors (the calls tensor parallelism makes)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from meshlm.parallel.tensor_layers import ALL_GATHER, REDUCE_SCATTER

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        a = torch.randn(256, 256)

        def work():  # about 3 ms of matmuls on one thread, a layer's share of a small model's step
            for _ in range(8):
                a @ a

        def cost(collective) -> float:
            for _ in range(3):
                collective()
            solo, busy = [], []
            for _ in range(30):
                start = time.perf_counter()
                work()
                solo.append(time.perf_counter() - start)
                start = time.perf_counter()
                work()
                collective()
                busy.append(time.perf_counter() - start)
            return max(0.0, statistics.median(busy) - statistics.median(solo))

        result = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}}
        for numel in LINK_PROBE_NUMELS:
            x = torch.ones(numel)
            result["all_reduce"][numel * 4.0] = cost(lambda x=x: dist.all_reduce(x))
            if numel in GATHER_PROBE_NUMELS:  # the same full tensor, gathered from halves or scattered into them
                half = torch.ones(numel // 2)
                result["all_gather"][numel * 4.0] = cost(lambda x=x, h=half: getattr(dist, ALL_GATHER)(x, h))
                result["reduce_scatter"][numel * 4.0] = cost(lambda x=x, h=half: getattr(dist, REDUCE_SCATTER)(h, x))
        if rank == 0:
            queue.put(result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def fit_links(costs: dict[float, float]) -> tuple[float, float]:
    """(GB/s, latency µs) of the α–β model from all-reduce costs {bytes: seconds} between 2 ranks, whose ring
    all-reduce costs 2α + n/β (2·(n−1)/n = 1): the least-squares line through the points."""
    xs, ys = [float(k) for k in costs], list(costs.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise RuntimeError(f"the all-reduce probe found no bandwidth term: {costs}")
    return 1 / slope / 1e9, max(my - slope * mx, 0.0) / 2 * 1e6


def gather_cost_of(costs: dict[str, dict[float, float]]) -> float:
    """An all-gather's and a reduce-scatter's mean cost over an all-reduce's of the same tensors (the sizes
    measured for all three), kept within [0.25, 2]: tensor parallelism with SP runs about as many of each."""
    sizes = [n for n in costs["all_gather"] if n in costs["reduce_scatter"] and n in costs["all_reduce"]]
    reduce = sum(costs["all_reduce"][n] for n in sizes)
    if not sizes or reduce <= 0:
        return 0.5
    gathers = sum(costs["all_gather"][n] + costs["reduce_scatter"][n] for n in sizes) / 2
    return min(2.0, max(0.25, gathers / reduce))


def measure_links(timeout_s: float = 120.0) -> tuple[float, float, float]:
    """(GB/s, latency µs, `gather_cost`) of gloo between two busy processes on this host, as a training step
    sees it: all-reduces of 4 B to 8 MiB run between matmuls (`measure_link_costs`), fitted by `fit_links`,
    and all-gathers and reduce-scatters of 2 and 8 MiB against the all-reduces of those sizes
    (`gather_cost_of`). Between idle processes, back-to-back all-reduces cost a half to a third of this
    (benchmarks/RESULTS.md)."""
    costs = measure_link_costs(timeout_s)
    return (*fit_links(costs["all_reduce"]), gather_cost_of(costs))


def measure_link_costs(timeout_s: float = 120.0) -> dict[str, dict[float, float]]:
    """{collective: {full tensor bytes: seconds}} from two spawned gloo processes (`_link_worker`)."""
    import multiprocessing
    import queue as queues
    import tempfile
    from pathlib import Path

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="meshlm-links-") as tmp:
        init = Path(tmp, "rendezvous").as_uri()
        procs = [ctx.Process(target=_link_worker, args=(r, init, out), daemon=True) for r in range(2)]
        for proc in procs:
            proc.start()
        try:
            costs = out.get(timeout=timeout_s)
        except queues.Empty:
            codes = [proc.exitcode for proc in procs]
            raise RuntimeError(f"the gloo link probe gave no result in {timeout_s:g} s (exit codes {codes})") from None
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return costs


def _gemm_curve(peak_tflops: float, width: int = 64, rows: int = 1024) -> tuple[float, float]:
    """(gemm_max_efficiency, gemm_half_width) through two points: the peak (a 1024-wide matmul: efficiency 1)
    and a `rows` × `width` × `width` matmul measured here: with q = its rate / peak, the curve
    E·w/(w + W) through (1024, 1) and (width, q) has W = 1024·width·(1 − q) / (1024·q − width)."""
    import time

    import torch

    a, b = torch.randn(rows, width), torch.randn(width, width)
    torch.matmul(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.1:
        torch.matmul(a, b)
        count += 1
    rate = 2.0 * rows * width * width * count / (time.perf_counter() - start) / 1e12
    q = min(rate / peak_tflops, 0.999)
    half = 1024 * width * (1 - q) / max(1024 * q - width, 1e-9) if 1024 * q > width else 1e6
    return (1024 + half) / 1024, half


def share_cores(gpu: Gpu, cores: int | None = None) -> Gpu:
    """A one-thread CPU 'GPU' whose host's cores (this machine's by default) the processes of a layout share:
    `cost.estimate` gives each busy process min(1, cores/busy) of a core and slows its memory-bound work by
    the host's `busy_slowdown` (`shared_rates`), layout by layout."""
    import os

    return replace(gpu, host_cores=cores or os.cpu_count() or 1)


def shared_rates(gpu: Gpu, busy: float) -> Gpu:
    """`gpu` (a one-thread CPU with `host_cores`) as each of `busy` processes at work at once sees it: the
    compute and memory rates scaled by min(1, cores/busy), the per-op host time by the inverse, memory-bound
    work (copy bandwidth, the softmax) slowed by 1 + (busy_slowdown − 1)·(k − 1)/(cores − 1) with
    k = min(busy, cores) cores at work."""
    cores = gpu.host_cores or 1
    busy = max(1.0, busy)
    share = min(1.0, cores / busy)
    k = min(busy, float(cores))
    slow = 1.0 + (gpu.busy_slowdown - 1.0) * (k - 1.0) / (cores - 1.0) if cores > 1 else 1.0

    def ns(value: float | None) -> float | None:
        return value * slow / share if value else value

    return replace(gpu, tflops=gpu.tflops * share, hbm_gbps=gpu.hbm_gbps * share / slow,
                   op_overhead_us=gpu.op_overhead_us / share, softmax_ns_per_element=ns(gpu.softmax_ns_per_element),
                   fused_softmax_ns_per_element=ns(gpu.fused_softmax_ns_per_element), host_cores=None)
