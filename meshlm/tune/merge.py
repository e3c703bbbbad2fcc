"""A LoRA adapter merged into its base's weights, written as an ordinary checkpoint or exported.

    meshlm convert --checkpoint BASE --adapter DIR --out MERGED          a one-process run directory
    meshlm convert --checkpoint BASE --adapter DIR --to-hf HF_DIR        merged, then a Hugging Face directory
    meshlm convert --checkpoint BASE --adapter DIR --to-gguf OUT.gguf    merged, then a GGUF file (llama.cpp)

Each target linear's weight becomes W + (α/r)·B·A (`lora.merge_lora`), what PEFT's `merge_and_unload` does,
so the merged model computes what the base with the unmerged adapter computes, with no adapter left: every
command (and transformers, and llama.cpp after `--to-gguf`) loads it as a plain model. The run directory has
the base's model config without a tune section and the base's tokenizer and chat template
(`interop.convert.save_model_run`).

Only LoRA merges: prompt tuning and p-tuning add virtual tokens to the input, not weights, so such an adapter
is refused (use it with `--adapter` on generate, serve or eval). The adapter is checked against BASE first
(`export.read_adapter`: the same model config and, for meshlm's adapters, the fingerprint of the base's
weights), and every error comes before anything is written. The exports go through a temporary merged run
beside their target, removed afterwards.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch import nn

from meshlm.core.config import ConfigError
from meshlm.tune.export import META, Adapter, apply_adapter, read_adapter


def _method_name(directory: Path, adapter: Adapter) -> str:
    """The adapter's method as it was tuned (p-tuning reads back as prompt tuning: name it as the user did)."""
    meta = directory / META
    if meta.is_file():
        return str(json.loads(meta.read_text()).get("method", adapter.tune.method))
    return adapter.tune.method


def read_mergeable(checkpoint, adapter_dir: str | Path) -> Adapter:
    """The LoRA adapter in `adapter_dir`, checked against the opened base `checkpoint`; ConfigError for a
    checkpoint that is itself a tune run, an adapter of another base, or one that is not LoRA."""
    cfg = checkpoint.config
    if cfg.tune.method != "none":
        raise ConfigError(f"--checkpoint {checkpoint.given!r} is a meshlm tune run (tune.method={cfg.tune.method!r}); "
                          f"give the base it was tuned on ({cfg.tune.base!r}) and the run as --adapter")
    adapter = read_adapter(adapter_dir, cfg, checkpoint)
    if adapter.tune.method != "lora":
        method = _method_name(Path(adapter_dir), adapter)
        raise ConfigError(f"--adapter {str(adapter_dir)!r} is a {method} adapter: its virtual tokens are inputs, not "
                          "weights, so it cannot be merged; use it with --adapter on meshlm generate, serve or eval")
    heads = [n for n in adapter.tensors if ".lora." not in n]
    if heads:
        raise ConfigError(f"--adapter {str(adapter_dir)!r} holds new task heads ({heads[0]}), which a merged base "
                          "model has no place for; use it with --adapter on meshlm eval or serve")
    return adapter


def merged_model(checkpoint, adapter: Adapter) -> nn.Module:
    """The base model of `checkpoint` in one process (fp32, CPU) with `adapter`'s LoRA merged into its weights."""
    from meshlm.checkpoint.load import load_model
    from meshlm.families.registry import get_spec

    cfg = checkpoint.config
    model = load_model(checkpoint, get_spec(cfg.model.family), "cpu").float()
    return apply_adapter(model, cfg, adapter, merge=True)


def merge_to_run(checkpoint, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """`meshlm convert --checkpoint BASE --adapter DIR --out MERGED`: returns the merged run's checkpoint."""
    from meshlm.interop.convert import check_new_dir, save_model_run

    check_new_dir("--out", out_dir)
    adapter = read_mergeable(checkpoint, adapter_dir)
    return save_model_run(checkpoint, merged_model(checkpoint, adapter), out_dir)


def merge_and_export(checkpoint, adapter_dir: str | Path, target: str | Path, export: Callable[[object], Path]) -> Path:
    """Merge `adapter_dir` into `checkpoint` in a temporary run beside `target`, then `export(merged)` with the
    merged run's opened `Checkpoint` (the caller checked `target` first); the temporary run is removed."""
    from meshlm.interop.checkpoints import open_checkpoint

    adapter = read_mergeable(checkpoint, adapter_dir)
    model = merged_model(checkpoint, adapter)
    parent = Path(target).expanduser().absolute().parent
    tmp = Path(tempfile.mkdtemp(dir=parent if parent.is_dir() else None, prefix=f".{Path(target).name}.merge-"))
    try:
        from meshlm.interop.convert import save_model_run

        save_model_run(checkpoint, model, tmp / f"{Path(adapter_dir).name}-merged")
        del model
        return export(open_checkpoint(tmp / f"{Path(adapter_dir).name}-merged", log=None))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
