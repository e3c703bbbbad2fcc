"""A checkpoint as a `Scorer`: whole in one process, or this rank's part of a parallel layout under torchrun
(`--parallel.tp=2`-style overrides; weights read from a checkpoint of any layout). The checkpoint comes in
opened (`interop.checkpoints.open_checkpoint`, once per command); the loading is `checkpoint.load`'s."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshlm.checkpoint.load import Checkpoint, load_model, load_parallel
from meshlm.core.config import ConfigError, apply_overrides, build
from meshlm.data.tokenizers import get_tokenizer
from meshlm.eval.scorer import Scorer, parallel_forward, plain_forward, world_size
from meshlm.families.registry import get_spec


@dataclass
class Loaded:
    scorer: Scorer | None  # None for an encoder (BERT) checkpoint
    cfg: object  # meshlm.core.config.Config
    tokenizer: object
    model: torch.nn.Module | None  # the whole model (one process), for heads other than a language model
    dims: object | None = None  # ParallelDims under torchrun

    @property
    def is_main(self) -> bool:
        return self.dims is None or self.dims.is_main


def check_overrides(overrides: list[str], flag_hint: str = "meshlm eval") -> list[str]:
    """Only the layout (`--parallel.*`) may be overridden: the model is the checkpoint's."""
    for item in overrides:
        key = item.removeprefix("--").split("=", 1)[0]
        if not key.startswith("parallel."):
            raise ConfigError(f"{flag_hint} takes only --parallel.* overrides (the layout), not {item!r}; the "
                              "model and tokenizer come from the checkpoint")
    return overrides


def pick_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but no CUDA GPU is visible; use cpu")
    return torch.device(name)


def with_virtual_tokens(model: torch.nn.Module, head: list[int]):
    """A forward that puts a prompt adapter's placeholders before every row and drops their outputs: the
    logits of the ids as the tuned model sees them."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        prefix = torch.tensor(head, dtype=x.dtype, device=x.device).expand(x.shape[0], len(head))
        return model(torch.cat([prefix, x], dim=1))[:, len(head):]

    return forward


def load(checkpoint: Checkpoint, overrides: list[str] | None = None, batch_size: int = 8, progress: bool = False,
         device: str | None = None, adapter: str | None = None, adapter_task: str | None = None) -> Loaded:
    """The model of the opened `checkpoint` for evaluation; with `adapter`, a `meshlm tune` (or PEFT) adapter
    on it (one process): LoRA merged into the weights, virtual tokens before every row (`adapter_task` picks
    a task's)."""
    overrides = check_overrides(overrides or [])
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be >= 1")
    cfg = checkpoint.config
    spec = get_spec(cfg.model.family)
    decoder = spec.decoder
    if world_size() == 1:
        layout = build(apply_overrides(_without_layout(cfg), overrides)).parallel
        if layout.tp * layout.pp > 1:
            raise ConfigError(f"{overrides[0]} needs several processes: launch with torchrun --nproc_per_node=N "
                              "-m meshlm eval ...")
        dev = pick_device(device)
        model, tokenizer = load_model(checkpoint, spec, dev), get_tokenizer(cfg.data.tokenizer)
        forward, context = model, cfg.model.seq_len
        if adapter is not None:
            from meshlm.tune.export import apply_adapter, read_adapter

            tuned = read_adapter(adapter, cfg, checkpoint)
            apply_adapter(model, cfg, tuned)
            if tuned.virtual_tokens:
                head = [tuned.task_index(adapter_task)] * tuned.virtual_tokens
                forward, context = with_virtual_tokens(model, head), context - len(head)
        elif adapter_task is not None:
            raise ConfigError("--adapter-task picks the virtual prompt of an --adapter; give --adapter DIR")
        scorer = Scorer(plain_forward(forward, cfg.model.vocab_size), context, tokenizer, batch_size, dev,
                        progress) if decoder else None
        return Loaded(scorer, cfg, tokenizer, model)
    if adapter is not None:
        raise ConfigError("--adapter evaluates in one process (the adapter goes onto the whole model); drop torchrun")
    if not decoder:
        raise ConfigError(f"{checkpoint.given} holds a model.family={cfg.model.family!r} model; its evaluation "
                          "(--task classify) runs in one process: drop torchrun")
    return _load_parallel(checkpoint, spec, overrides, batch_size, progress, device)


def _without_layout(cfg) -> dict:
    """The checkpoint's config with the layout it was trained under dropped: evaluation takes its own."""
    values = cfg.to_dict()
    values["parallel"] = {}
    return values


def _load_parallel(checkpoint: Checkpoint, spec, overrides, batch_size, progress, device) -> Loaded:
    from meshlm.parallel import init_distributed

    cfg = checkpoint.config
    values = apply_overrides(_without_layout(cfg), overrides)
    dp = max(1, world_size() // (values["parallel"].get("tp", 1) * values["parallel"].get("pp", 1)))
    # Forward only: logits from the last stage (no fused head), no recomputation or compile, one
    # micro-batch per data-parallel rank (the layout rules need a batch; evaluation brings its own).
    values["train"].update(fused_loss=False, compile=False, recompute="none", micro_batch_size=1,
                           global_batch_size=dp, precision="fp32", init_from="")
    eval_cfg = build(values)
    dev = pick_device(device)
    dims = init_distributed(eval_cfg.parallel, dev if dev.type == "cpu" else None)
    parallelized = load_parallel(checkpoint, spec, eval_cfg, dims)
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    scorer = Scorer(parallel_forward(parallelized, cfg.model.vocab_size), cfg.model.seq_len, tokenizer, batch_size,
                    dims.device, progress, dims.is_main)
    return Loaded(scorer, eval_cfg, tokenizer, None, dims)
