"""`meshlm align`: preference optimisation (DPO, IPO, SimPO) of a checkpoint on (prompt, chosen, rejected)
pairs, the whole model or a LoRA adapter (docs/align.md).

    meshlm align --checkpoint BASE --method dpo|ipo|simpo --train P.jsonl --valid V.jsonl --out DIR
                 [--beta 0.1] [--label-smoothing 0] [--simpo-gamma 0.5] [--adapter none|lora]
                 [--epochs 1] [--max-length N] [--chat-template FILE] [--section.key=value ...]

The ordinary `Trainer` runs it, as `meshlm tune` does: the preference loss reaches it through the
`Preference` extension, which gives the trainer the family spec with `preference.loss_for` as its loss
(`Extension.adapt_spec`), so the one-process loop, tensor parallelism (vocab-split logits) and the last
pipeline stage all compute it; resuming, checkpoints, metrics.jsonl, the log and every layout are
pretraining's. `--adapter lora` adds the `Tuning` extension of `meshlm tune` (tune.method=lora on the
frozen base); `--adapter none` trains every weight from the base (`train.init_from`).

The reference model is the base checkpoint, frozen. Its log-probabilities of every chosen and rejected
completion are computed once, before training, with the base loaded whole in one process (on every rank:
the same deterministic fp32 forward, so no rank waits for another), and saved with the run as
DIR/align_reference.pt; a resumed run reads them back (checked against the data and the base). With
`--adapter lora` the base *is* the model with the adapter off (LoRA starts at zero), so there is never a
second model in memory during training.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.core.config import ConfigError, apply_overrides, build, check_output_dir
from meshlm.core.console import is_main, say
from meshlm.data.jsonl import read_jsonl
from meshlm.train.extension import Extension
from meshlm.train.prepared import Extensions, with_schedule
from meshlm.tune import preference
from meshlm.tune.command import row_length
from meshlm.tune.preference import Objective

INFO_FILE = "align.json"
REFERENCE_FILE = "align_reference.pt"
# Learning rates: TRL's DPOConfig default for the whole model; ten times that for a LoRA adapter.
DEFAULT_LR = {"none": 1e-6, "lora": 1e-5}
DEFAULT_EPOCHS = 1


@dataclass(frozen=True)
class AlignOptions:
    """`meshlm align --method dpo|ipo|simpo`'s flags (`meshlm.commands.align.align_options` builds them from the
    command line)."""

    checkpoint: str  # the base and frozen reference: a run directory, a step directory or a .gguf file
    method: str  # dpo | ipo | simpo
    train: str  # FILE.jsonl of preference pairs
    valid: str  # FILE.jsonl of held-out pairs
    out: str  # the run directory (the same again resumes)
    beta: float  # the preference strength
    label_smoothing: float  # conservative DPO / SimPO: the share of pairs assumed flipped
    simpo_gamma: float  # SimPO's target reward margin
    adapter: str  # none (every weight trains) | lora
    epochs: int  # passes over the training pairs
    max_length: int | None = None  # tokens per row, prompt + completion (None: model.seq_len)
    chat_template: str | None = None  # conversational lines: a Jinja2 template instead of the base tokenizer's


class Preference(Extension):
    """The preference loss of `objective` as the run's loss (`Extension.adapt_spec`)."""

    def __init__(self, objective: Objective, micro_batch: int, seq_len: int):
        self.objective, self.micro_batch, self.seq_len = objective, micro_batch, seq_len

    def adapt_spec(self, spec):
        return preference.adapt_spec(spec, self.objective, self.micro_batch, self.seq_len)


def align_values(base: dict, adapter: str, checkpoint: str, out_dir: str, overrides: list[str]) -> dict:
    """The base's config with the alignment defaults, then the user's overrides: AdamW at `DEFAULT_LR`, no
    weight decay, linear decay, micro-batches of 4 pairs, batches of 16 pairs, dropout off, one process unless
    parallel.* says otherwise, no time budget (the base's is pretraining's), and the unfused head (the loss
    needs the logits)."""
    values = {k: dict(v) for k, v in base.items()}
    full = adapter == "none"
    values["tune"] = {"method": "none"} if full else {"method": adapter, "base": checkpoint, "tasks": []}
    values["train"].update(out_dir=out_dir, init_from=checkpoint if full else "", resume="auto", micro_batch_size=4,
                           global_batch_size=16, sample_tokens=0, time_budget_s=0.0, compile=False, recompute="none",
                           recompute_method="uniform", recompute_num_layers=0, device="auto", fused_loss=False,
                           eval_tasks=[])
    values["optim"].update(name="adamw", lr=DEFAULT_LR[adapter], min_lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.999,
                           eps=1e-8, grad_clip=1.0, decay="linear", decay_steps=0)
    values["parallel"] = {}
    values["model"]["dropout"] = 0.0
    return apply_overrides(values, overrides)


def check_objective(opts: AlignOptions) -> Objective:
    if not (opts.beta > 0 and math.isfinite(opts.beta)):
        raise ConfigError(f"--beta {opts.beta} must be > 0 (the strength of the preference; 0.1 is usual)")
    if not 0 <= opts.label_smoothing < 0.5:
        raise ConfigError(f"--label-smoothing {opts.label_smoothing} must be in [0, 0.5) (0: plain DPO)")
    if opts.label_smoothing and opts.method == "ipo":
        raise ConfigError("--label-smoothing is for --method dpo|simpo; IPO's squared loss has none: drop it")
    if not math.isfinite(opts.simpo_gamma):
        raise ConfigError(f"--simpo-gamma {opts.simpo_gamma} must be a finite number (SimPO's target margin; 0.5 "
                          "is usual)")
    return Objective(opts.method, opts.beta, opts.label_smoothing, opts.simpo_gamma)


def check_config(cfg, length: int) -> None:
    """Refuse what the preference loss cannot run under, each with the fix."""
    if cfg.train.fused_loss is True:
        raise ConfigError("train.fused_loss=true: the preference loss needs the logits; drop --train.fused_loss")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"parallel.cp={cfg.parallel.cp}: meshlm align splits no sequence over ranks; use "
                          "parallel.tp, pp or dp")
    if cfg.parallel.sp and length % max(1, cfg.parallel.tp):
        raise ConfigError(f"--max-length {length} must be a multiple of parallel.tp={cfg.parallel.tp} under "
                          "sequence parallelism")
    if cfg.train.eval_tasks:
        raise ConfigError("train.eval_tasks is not supported by meshlm align; drop it")


def chat_template(tokenizer: str, override: str | None):
    """The conversational lines' chat template, found on first use: --chat-template, else the base's tokenizer's
    (`meshlm.data.chat.template_for`)."""
    found = []

    def get():
        if not found:
            from meshlm.data.chat import template_for

            found.append(template_for(tokenizer, override))
        return found[0]

    return get


def prepare(opts: AlignOptions, overrides: list[str], checkpoint):
    """Everything before training, writing nothing: (config, objective, tokenizer, train set, valid set, info);
    the sets without their reference log-probs yet. `checkpoint`: the opened base (`--checkpoint`)."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.tune.export import base_fingerprint

    if opts.epochs < 1:
        raise ConfigError(f"--epochs {opts.epochs} must be >= 1")
    objective = check_objective(opts)
    check_output_dir("--out", opts.out)
    base = checkpoint.config
    if not get_spec(base.model.family).decoder:
        raise ConfigError(f"--checkpoint {opts.checkpoint!r} holds a model.family={base.model.family!r} model; "
                          "meshlm align needs a decoder (GPT) checkpoint")
    # The run names the verified step directory: a resumed run reads the very weights this one starts from.
    values = align_values(base.to_dict(), opts.adapter, str(checkpoint.path), opts.out, overrides)
    first = build(values)
    template = chat_template(first.data.tokenizer, opts.chat_template)
    texts = {}
    for flag, path in (("--train", opts.train), ("--valid", opts.valid)):
        lines = read_jsonl(path, flag)
        texts[flag] = ([preference.pair_texts(line, template) for line in lines], [line.where for line in lines])
    length = row_length(opts.max_length, first.model.seq_len)
    check_config(first, length)
    tokenizer = get_tokenizer(first.data.tokenizer)
    sets = {}
    for flag, path in (("--train", opts.train), ("--valid", opts.valid)):
        data = preference.encode_pairs(*texts[flag], tokenizer, length)
        sets[flag] = data
        say(f"{flag} {path}: {len(data)} pairs, {data.num_tokens:,} completion tokens")
    train, valid = sets["--train"], sets["--valid"]
    n_valid = len(valid)
    if first.train.micro_batch_size < 1:
        raise ConfigError("train.micro_batch_size must be >= 1 (pairs per micro-batch)")
    valid = valid.padded(first.train.micro_batch_size, tokenizer.eod_id)
    cfg = with_schedule(values, overrides, len(train), len(valid), opts.epochs)
    info = {"method": opts.method, "adapter": opts.adapter, "beta": objective.beta,
            "label_smoothing": objective.label_smoothing, "simpo_gamma": objective.gamma,
            "checkpoint": opts.checkpoint, "base_fingerprint": base_fingerprint(checkpoint.path),
            "train": opts.train, "valid": opts.valid, "train_pairs": len(train), "valid_pairs": n_valid,
            "max_length": length}
    return cfg, objective, tokenizer, train, valid, info


# ---- the reference -----------------------------------------------------------------------------------------
def data_fingerprint(sets, info: dict) -> str:
    """A hash of the encoded pairs and the base's weights: the cached reference log-probs belong to them."""
    h = hashlib.sha256(info["base_fingerprint"].encode())
    for data in sets:
        h.update(np.ascontiguousarray(data.ids).tobytes())
        h.update(np.ascontiguousarray(data.targets).tobytes())
    return h.hexdigest()[:24]


def reference_logps(checkpoint, sets: list, device: str, batch_pairs: int = 16) -> list[np.ndarray]:
    """Per set, (N, 2) float64: the frozen base's summed log-probs of each pair's chosen and rejected
    completion, forward only, in the base's own dtype (fp32) on `device`, pairs in order. The output layer
    runs on the completion positions only (the family's `embed`, `run_layers`, `head`): a prompt-heavy set
    pays its vocabulary-wide logits for the completion tokens alone. `checkpoint`: the opened base
    (`checkpoint.load.Checkpoint`)."""
    import torch

    from meshlm.checkpoint.load import load_model
    from meshlm.families.registry import get_spec

    model = load_model(checkpoint, get_spec(checkpoint.config.model.family), device)
    outs = []
    with torch.no_grad():
        for data in sets:
            out = np.zeros((len(data), 2), dtype=np.float64)
            for start in range(0, len(data), batch_pairs):
                items = np.stack([data[i] for i in range(start, min(start + batch_pairs, len(data)))])
                x, y = data.collate(items)
                tokens = y[:, :data.width].to(device)
                keep = tokens != preference.IGNORE
                logits = model.head(model.run_layers(model.embed(x.to(device)))[keep])  # (completion tokens, V)
                logps, _ = preference.row_logps(logits.unsqueeze(0), tokens[keep].unsqueeze(0), None, whole=True,
                                                rows=keep.nonzero()[:, 0], n_rows=len(tokens))
                out[start:start + len(items)] = logps.double().cpu().numpy().reshape(-1, 2)
            outs.append(out)
    del model
    return outs


def reference_device(cfg) -> str:
    import os

    import torch

    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def with_reference(cfg, objective: Objective, info: dict, train, valid, checkpoint):
    """The sets with their reference log-probs: DIR/align_reference.pt's when it holds this data's, else
    computed with the opened base `checkpoint` (every rank alike). Returns (train, valid, the tensors to save or None when read back)."""
    import torch

    if not objective.reference:  # simpo: no reference model
        return train, valid, None
    path = Path(cfg.train.out_dir) / REFERENCE_FILE
    key = data_fingerprint((train, valid), info)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved.get("fingerprint") == key:
            say(f"reference log-probs read from {path}")
            return train.with_reference(saved["train"].numpy()), valid.with_reference(saved["valid"].numpy()), None
        raise ConfigError(f"{path} holds the reference log-probs of other data or another base; use another --out "
                          "to start a new run")
    device = reference_device(cfg)
    say(f"computing the reference log-probs of {len(train) + len(valid)} pairs with the frozen base ({device})")
    ref_train, ref_valid = reference_logps(checkpoint, [train, valid], device)
    saved = {"fingerprint": key, "train": torch.from_numpy(ref_train), "valid": torch.from_numpy(ref_valid)}
    return train.with_reference(ref_train), valid.with_reference(ref_valid), saved


def write_run_files(out: Path, info: dict, saved) -> None:
    """DIR/align.json and (a fresh run) DIR/align_reference.pt, atomically, on rank 0."""
    import torch

    from meshlm.train.prepared import write_info

    write_info(out, info, INFO_FILE, ("method", "adapter", "base_fingerprint"))
    if saved is not None:
        tmp = out / (REFERENCE_FILE + ".tmp")
        torch.save(saved, tmp)
        tmp.replace(out / REFERENCE_FILE)


def run_align(opts: AlignOptions, overrides: list[str], extensions: Extensions) -> int:
    """`meshlm align` (parsed by `meshlm.commands.align`), with the trainer's `extensions(cfg)` (the LoRA
    adapter's: `meshlm.commands.train.trainer_extensions`) and the `Preference` loss."""
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.train.prepared import train_prepared
    from meshlm.tune.export import export_run

    checkpoint = open_checkpoint(opts.checkpoint)  # resolved and verified once, for the whole command
    cfg, objective, tokenizer, train, valid, info = prepare(opts, overrides, checkpoint)
    train, valid, saved = with_reference(cfg, objective, info, train, valid, checkpoint)
    t = cfg.train
    say(f"aligning ({opts.method}, beta {objective.beta:g}, adapter {opts.adapter}) {opts.checkpoint}: {t.max_steps} "
        f"steps of {t.global_batch_size} pairs, lr {cfg.optim.lr:g}, evaluation every {t.eval_every} steps over "
        f"{info['valid_pairs']} pairs")
    loss = Preference(objective, t.micro_batch_size, info["max_length"])
    trainer, result = train_prepared(cfg, (tokenizer, train, valid), opts.out,
                                     lambda d: write_run_files(d, info, saved),
                                     lambda c: [*extensions(c), loss])
    if is_main() and trainer.stop_signal is None:
        shown = " | ".join(f"{k} {v:.4f}" for k, v in result.items() if k in ("val_loss", "val_rewards/accuracies",
                                                                           "val_rewards/margins"))
        done = f"align: step {result['step']}: {shown}"
        if opts.adapter == "none":
            say(f"{done}; the aligned model is {opts.out}'s checkpoint")
        else:
            written = export_run(Path(opts.out))
            say(f"{done}; adapter in {', '.join(str(p.name) for p in written)} of {opts.out}")
    return trainer.exit_code
