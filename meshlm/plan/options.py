"""`meshlm plan`'s flags, typed: what `plan/report.py`'s `run_plan` and `plan/trials.py` take
(`meshlm.commands.plan.plan_options` builds them from the command line, whose parser lives there alone)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanOptions:
    """One `meshlm plan` request: the model's config, the cluster, what to print and what to try. The GPU
    overrides (`gpu_*`, None: the catalog's value) are `plan.catalog.OVERRIDABLE`'s fields in its order, named as
    their `--gpu-NAME` flags (memory in GiB as `gpu_memory_gb`)."""

    config: str  # a bundled config's name or a .toml path
    gpus: int  # GPUs in the cluster (training)
    gpus_per_node: int
    gpu: str  # a catalog name, or 'this' to measure this machine
    gpu_tflops: float | None
    gpu_memory_gb: float | None
    gpu_hbm_gbps: float | None
    gpu_intra_gbps: float | None
    gpu_inter_gbps: float | None
    gpu_intra_latency_us: float | None
    gpu_inter_latency_us: float | None
    gpu_op_overhead_us: float | None
    gpu_gather_cost: float | None
    global_batch_size: int | None  # sequences per step (None: the config's)
    seq_len: int | None  # None: the config's
    precision: str | None  # bf16 | fp16 | fp32 (None: bf16 on a catalog GPU, the config's on --gpu this)
    runtime: str  # the software whose costs are modelled (`plan.cost.RUNTIMES`)
    top: int  # rows of the ranked table
    all: bool  # every fitting variant, not the best of each layout
    json: bool  # print JSON instead of the table
    layout: str | None  # one layout, its missing fields completed by the search
    explain: str | None  # one layout, every memory and time term printed
    write_config: str | None  # where to write the winning layout's config (.toml)
    trial: int  # run the top K layouts with torchrun here (0: none)
    steps: int  # steps per trial
    inference: bool  # plan serving instead of training
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None  # target time to first token
    tpot_ms: float | None  # target time per output token
