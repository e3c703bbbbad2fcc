"""Loading a model for inference: the whole model in one process, or this rank's tensor-parallel part.

Checkpoints of any training layout load (a parallel run's pieces are assembled by `load_model_state`).
"""

from __future__ import annotations


def checkpoint_config(path: str):
    """The full `Config` saved with a run directory's newest checkpoint (or one step directory)."""
    from meshlm.checkpoint import single as ckpt
    from meshlm.core.config import config_from_dict

    return config_from_dict(ckpt.load_config_dict(ckpt.resolve_checkpoint(path)))


def load_model_from_checkpoint(path: str, device: str = "cpu", cfg=None):
    """(model in eval mode, tokenizer, config) from a run directory or checkpoint directory."""
    import torch

    from meshlm.checkpoint import single as ckpt
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec

    target = ckpt.resolve_checkpoint(path)
    cfg = cfg or checkpoint_config(path)
    model = get_spec(cfg.model.family).model_class(cfg.model)
    model.load_state_dict(ckpt.load_model_state(target))
    return model.to(torch.device(device)).eval(), get_tokenizer(cfg.data.tokenizer), cfg


def load_tensor_parallel(path: str, tp: int, timeout_s: float = 300):
    """(this rank's part of the model in eval mode, tokenizer, config, ParallelDims) under torchrun with
    `tp` ranks (tensor parallelism only: the world is tp). The checkpoint may come from any layout; its
    tensors are resharded to this one (`sharded.load_matching_weights`). Collective: every rank calls it."""
    import torch

    from meshlm.checkpoint import sharded as dist_checkpoint
    from meshlm.checkpoint import single as ckpt
    from meshlm.core.config import ConfigError, config_from_dict
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.parallel import build_model, init_distributed
    from meshlm.parallel.rng import TPRNGTracker

    source = ckpt.resolve_checkpoint(path)
    saved = checkpoint_config(str(source))
    spec = get_spec(saved.model.family)
    if not spec.decoder:
        raise ConfigError(f"--parallel.tp={tp} serves GPT checkpoints; {path} is model.family={saved.model.family!r}")
    values = saved.to_dict()
    values["parallel"] = {**values["parallel"], "tp": tp, "pp": 1, "dp": 0, "sp": False, "vpp": 1, "pp_layers": [],
                          "zero": 0, "timeout_s": timeout_s}
    values["model"] = {**values["model"], "dropout": 0.0}
    cfg = config_from_dict(values)
    dims = init_distributed(cfg.parallel, torch.device("cpu") if not torch.cuda.is_available() else None)
    if dims.world_size != tp:
        raise ConfigError(f"--parallel.tp={tp} serves on exactly tp ranks; this world has {dims.world_size} "
                          f"(torchrun --nproc-per-node {tp})")
    torch.manual_seed(0)
    par = build_model(cfg, dims, rng=TPRNGTracker(0, dims.tp_rank), spec=spec)
    dist_checkpoint.load_matching_weights(source, par.grad_sync, saved.model)
    par.model.eval()
    return par.model, get_tokenizer(cfg.data.tokenizer), cfg, dims
