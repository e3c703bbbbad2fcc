"""`meshlm convert`: a checkpoint to one plain file, to a Hugging Face directory, or from one.

    meshlm convert --checkpoint RUN --to-single OUT_DIR     any layout → OUT_DIR/model.safetensors + config.json
    meshlm convert --checkpoint RUN --to-hf HF_DIR           any layout → a directory `from_pretrained` loads
    meshlm convert --from-hf HF_DIR --out RUN                GPT-2, Llama or BERT directory → a meshlm run
    meshlm convert --checkpoint BASE --adapter DIR --out RUN  a LoRA merged into its base → a meshlm run
                                                             (`tune/merge.py` merges; `save_model_run` writes)

`--to-single`: a checkpoint of any layout (the single-process `model.pt`, or the per-rank pieces of a
parallel run) is assembled in one process, without torch.distributed, into the plain state dict (fused
`attn.qkv` and `mlp.fc`, the vocabulary unpadded), and written as `OUT_DIR/model.safetensors` with the
run's `OUT_DIR/config.json`. Load it with `safetensors.torch.load_file` and `load_state_dict` (or
`checkpoint.single.load_model_state(OUT_DIR)`); `meshlm generate --checkpoint OUT_DIR` reads it too. A tied LM
head is stored as its own copy of the embedding (safetensors keeps no shared tensors).

`--to-hf`: the same model as config.json + model.safetensors (shards with an index above 5 GB) of
GPT2LMHeadModel, LlamaForCausalLM or the Bert* class of the head, with the tokenizer files (`hf_files.py`).
It is not assembled in memory: each tensor is read from the checkpoint and written to its file in turn
(`hf_stream.py`), so the conversion holds one tensor at a time. `train.save_hf` writes the same directory
during training (`during_training.py`).

`--from-hf`: a run directory holding one checkpoint (step 0) that `meshlm generate --checkpoint`,
`meshlm embed --checkpoint` and `train.resume` take: the weights, a fresh optimizer, the config (the
model's, meshlm's defaults for the rest, `data.tokenizer` on the tokenizer files carried into RUN/hf).

Both directions write into a temporary directory beside the target and rename it into place, so a
failure leaves nothing half-written; the target must be new or empty.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from meshlm.core.config import ConfigError, check_output_dir
from meshlm.families.registry import get_spec

WEIGHTS = "model.safetensors"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def convert_to_single(checkpoint, out_dir: str | Path) -> Path:
    """Write the plain model of the opened `checkpoint` (`checkpoint.load.Checkpoint`) to OUT_DIR."""
    import torch  # here, not at the top: the CLI imports this module to build its parser
    from safetensors.torch import save_file

    from meshlm.checkpoint.files import load_config_dict
    from meshlm.checkpoint.single import read_model_state

    source = checkpoint.path
    config = load_config_dict(source)  # as saved, written out unchanged
    # any format: one process, a parallel run's pieces (assembled here), converted
    state = read_model_state(source, spec=get_spec(checkpoint.config.model.family))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt", "source": str(source)})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out / WEIGHTS


# ---- writing a directory in one piece -----------------------------------------------------------------------
def check_new_dir(flag: str, path: str | Path) -> Path:
    """The absolute path of a new or empty output directory given as `flag`; ConfigError otherwise."""
    check_output_dir(flag, str(path))
    target = Path(path).expanduser().absolute()
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{flag} {str(path)!r} is not empty; choose a new directory (nothing is overwritten)")
    return target




def _publish(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` on a temporary directory beside `target`, then rename it to `target`; on any error
    the temporary directory is removed and `target` left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        write(tmp)
        if target.exists():
            target.rmdir()  # checked empty
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- Hugging Face → meshlm --------------------------------------------------------------------------------
def _pick_tokenizer(cfg, carried: Path, final: Path, tokenizer: str | None) -> tuple[str, str, str | None]:
    """(data.tokenizer for the config, the spec to check it with now, a note for the user): --tokenizer,
    else the carried files, else the family's bundled tokenizer."""
    if tokenizer is not None:
        return tokenizer, tokenizer, None
    if (carried / "tokenizer.json").exists() or (carried / "tokenizer.model").exists():
        return str(final), str(carried), None
    bundled = get_spec(cfg.family).default_tokenizer
    return bundled, bundled, (f"note: no tokenizer files (tokenizer.json, tokenizer.model, vocab.txt, vocab.json + "
                              f"merges.txt) in the directory; data.tokenizer={bundled!r}, meshlm's bundled one "
                              "(--tokenizer chooses another)")


def _check_tokenizer(cfg, spec: str, shown: str):
    from meshlm.data.tokenizers import get_tokenizer

    tok = get_tokenizer(spec)
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"tokenizer {shown!r} has {tok.vocab_size} tokens, more than the model's vocab_size="
                          f"{cfg.vocab_size}; pass --tokenizer with the model's own tokenizer")
    special_tokens = get_spec(cfg.family).special_tokens
    if special_tokens is not None:
        need = special_tokens(cfg)
        absent = [n for n in need if n not in tok.special_ids]
        if absent:
            raise ConfigError(f"tokenizer {shown!r} has no {', '.join(f'[{n.upper()}]' for n in absent)} token, "
                              "which a BERT needs; pass --tokenizer with the model's own tokenizer")
    return tok


def import_hf(hf_dir: str | Path, out_dir: str | Path, tokenizer: str | None = None,
              log: Callable[[str], None] = _note) -> Path:
    """Convert the Hugging Face directory `hf_dir` into the meshlm run directory `out_dir` (new or empty):
    checkpoints/step_0000000 with the model, a fresh optimizer and the config; the tokenizer and
    sentence-transformers files in out_dir/hf. Returns the checkpoint directory."""
    from meshlm.interop.hf import load_hf
    from meshlm.interop.hf_files import carry_files, read_sentence_modules

    source = Path(hf_dir).expanduser()
    target = check_new_dir("--out", out_dir)
    notes: list[str] = []  # told once the run is written (an error is the one line the user sees)
    model = load_hf(source, notes.append)  # every check of the config and the weights, before anything is written
    cfg = model.cfg
    modules = read_sentence_modules(source) if get_spec(cfg.family).sentence_embeddings else None
    if modules is not None:
        cfg = replace(cfg, pooling=modules.pooling, normalize_embeddings=modules.normalize)
        if modules.max_seq_length and modules.max_seq_length > cfg.seq_len:
            raise ConfigError(f"sentence_bert_config.json: max_seq_length={modules.max_seq_length} exceeds the "
                              f"model's max_position_embeddings={cfg.seq_len}")
    path = write_run(target, model, cfg, lambda folder: carry_files(source, folder, modules), tokenizer, notes)
    for note in notes:
        log(note)
    return path


def write_run(target: Path, model, cfg, carry: Callable[[Path], object], tokenizer: str | None,
              notes: list[str]) -> Path:
    """Publish the run directory `target` (checked new or empty) of an imported `model` with ModelConfig `cfg`:
    `carry(folder)` writes the tokenizer and other carried files into its hf/ folder, data.tokenizer is
    `tokenizer` or those files (`_pick_tokenizer`), and checkpoints/step_0000000 holds the model, a fresh
    optimizer and the config. Written in a temporary directory and renamed into place (`_publish`); notes
    for the user are appended to `notes`. Returns the checkpoint directory. Shared by `import_hf` and
    `gguf.import_gguf`."""
    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.core.config import Config, DataConfig, TrainConfig
    from meshlm.core.rng import rng_state, seed_everything
    from meshlm.interop.hf_files import CARRIED
    from meshlm.train.optim import build_optimizer

    written: list[Path] = []

    def write(tmp: Path) -> None:
        carry(tmp / CARRIED)
        spec, check, note = _pick_tokenizer(cfg, tmp / CARRIED, target / CARRIED, tokenizer)
        tok = _check_tokenizer(cfg, check, spec)
        if note:
            notes.append(note)
        config = Config(model=cfg, data=DataConfig(tokenizer=spec), train=TrainConfig(out_dir=str(target)))
        config.validate()
        seed_everything(config.train.seed)
        parts = {"model": model.state_dict(), "optim": build_optimizer(model, config.optim).state_dict(),
                 "state": {"step": 0, "tokens_seen": 0, "rng": rng_state(), "loader": {"consumed": 0},
                           "scaler": {}, "tokenizer": tok.name, "skipped_steps": 0}}
        path = save_checkpoint(tmp, 0, parts, config.to_dict())
        written.append(target / path.relative_to(tmp))

    _publish(target, write)
    return written[0]


def save_model_run(checkpoint, model, out_dir: str | Path) -> Path:
    """Publish `model` (a plain model of the opened base `checkpoint`'s shapes, e.g. with a LoRA merged into
    its weights) as the one-process run directory `out_dir` (new or empty): the base's model config without
    its training or tuning sections, and the base's tokenizer: a copy of its run's hf/ folder (tokenizer files,
    chat template, declared eos) when it has one, else the same `data.tokenizer` (e.g. the bundled gpt2).
    Returns the checkpoint directory."""
    from meshlm.interop.hf_files import CARRIED

    target = check_new_dir("--out", out_dir)
    source, config = Path(checkpoint.path), checkpoint.config
    run_hf = source.parent.parent / CARRIED if source.parent.name == "checkpoints" else None
    spec: str | None = config.data.tokenizer
    if run_hf is not None and run_hf.is_dir():
        inside = Path(spec).expanduser().absolute()
        if inside == run_hf.absolute() or run_hf.absolute() in inside.parents:
            spec = None  # the copy below is the new run's tokenizer (`_pick_tokenizer`)

    def carry(folder: Path) -> None:
        if run_hf is not None and run_hf.is_dir():
            shutil.copytree(run_hf, folder)

    notes: list[str] = []
    path = write_run(target, model, config.model, carry, spec, notes)
    for note in notes:
        _note(note)
    return path


# ---- meshlm → Hugging Face --------------------------------------------------------------------------------
def export_hf(checkpoint, hf_dir: str | Path, log: Callable[[str], None] = _note) -> Path:
    """Write the model of the opened `checkpoint` (`checkpoint.load.Checkpoint`, any layout) as a Hugging Face
    directory `hf_dir` (new or empty): config.json, the safetensors weights, the tokenizer files and, for a
    BERT encoder, sentence-transformers'."""
    from meshlm.interop.hf_config import hf_config_dict

    target = check_new_dir("--to-hf", hf_dir)
    source, config = checkpoint.path, checkpoint.config
    hf_config_dict(config.model)  # refuses, naming the keys, what Hugging Face cannot hold, before reading weights
    _publish(target, lambda tmp: write_hf_dir(source, config, tmp, log))
    return target


def write_hf_dir(source: Path, config, directory: Path, log: Callable[[str], None] = _note,
                 weights: Path | None = None, tokenizer: Callable[[Path], object] | None = None,
                 max_shard_bytes: int | None = None) -> None:
    """The Hugging Face directory of resolved checkpoint `source` (its `Config`, `config`) in `directory`:
    the weights read one tensor at a time (from `weights`, a copy of `source`'s files, when given) and
    written in float32 (`hf_stream`), the class names a classifier carries, the tokenizer files (written
    by `tokenizer(directory)` when given) and, for a BERT encoder, sentence-transformers' files."""
    from meshlm.interop.hf_files import (
        carried_labels,
        checkpoint_files,
        max_seq_length,
        write_sentence_modules,
        write_tokenizer_files,
    )
    from meshlm.interop.hf_stream import MAX_SHARD_BYTES, CheckpointTensors, write_hf_model

    cfg = config.model
    carried = checkpoint_files(source, config.data.tokenizer)
    with CheckpointTensors(weights or source, cfg) as read:
        write_hf_model(read, cfg, read.shapes, directory, max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES)
    labels = carried_labels(carried, cfg.num_labels) if cfg.bert_head in ("classify", "tokens") else None
    if get_spec(cfg.family).task_heads and labels is not None:
        hf_config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**hf_config, **labels}, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer(directory)
    else:
        write_tokenizer_files(config.data.tokenizer, directory, cfg.seq_len, log)
    if get_spec(cfg.family).sentence_embeddings and cfg.bert_head == "encoder":
        write_sentence_modules(cfg, directory, max_seq_length(carried))
