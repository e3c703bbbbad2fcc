"""`meshlm tune`: an adapter trained on a frozen checkpoint (prompt tuning, p-tuning or LoRA), or the
whole model fine-tuned on the same data (`--method full`, SFT). The data is input/output or task lines
(`tune/data.py`) or conversations, the loss on the assistant's turns (`tune/chat_data.py`, `--pack`).

    meshlm tune --checkpoint BASE --method prompt|ptuning|lora|full --train T.jsonl --valid V.jsonl --out DIR
                [--template [TASK=]TEXT ...] [--epochs 3] [--max-length N] [--truncate]
                [--chat-template FILE] [--pack]  (conversations: {"messages": [...]} lines)
                [--task classify|span|tokens]   (BERT checkpoints: `meshlm finetune`'s tasks)
                [--section.key=value ...]       (tune.lora_rank, tune.virtual_tokens, optim.lr, parallel.tp, ...)

The run's config is the base checkpoint's with `tune.method`, `tune.base=BASE` and tuning defaults
(`tune_values`), then the user's overrides. The ordinary `Trainer` runs it, the adapter given to it as an
extension (`tune/extension.py`): resuming (the same command again), parallel layouts under torchrun,
metrics.jsonl and the log are those of pretraining. At the end DIR
holds the adapter for `meshlm generate --adapter DIR` and for Hugging Face PEFT (`tune/export.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from meshlm.core.config import ConfigError, apply_overrides, build, check_output_dir
from meshlm.core.console import is_main, say
from meshlm.data.items import DataError
from meshlm.data.jsonl import read_jsonl
from meshlm.train.prepared import Extensions, with_schedule

INFO_FILE = "tune.json"
# Learning rates that work for each method on small models (docs/tune.md): prompt tables move slowly.
DEFAULT_LR = {"prompt": 3e-2, "ptuning": 1e-3, "lora": 1e-3, "full": 3e-4}


@dataclass(frozen=True)
class TuneOptions:
    """`meshlm tune`'s flags (`meshlm.commands.tune.tune_options` builds them from the command line)."""

    checkpoint: str  # the frozen base: a run directory, a step directory or a .gguf file
    method: str  # prompt | ptuning | lora | full
    train: str  # FILE.jsonl
    valid: str  # FILE.jsonl
    out: str  # the run directory (the same again resumes)
    epochs: int  # passes over the training set
    template: tuple[str, ...] = ()  # `[TASK=]TEXT` prompt templates
    task: str | None = None  # BERT checkpoints: meshlm finetune's task (classify | span | tokens)
    max_length: int | None = None  # tokens per row (None: model.seq_len)
    truncate: bool = False
    chat_template: str | None = None  # conversations: a Jinja2 template (file or text) instead of the base's
    pack: bool = False  # conversations: several per row (data.document_mask)


def tune_values(base: dict, method: str, checkpoint: str, out_dir: str, tasks: list[str],
                overrides: list[str]) -> dict:
    """The base's config values with the adapter and tuning defaults, then the user's overrides: AdamW at
    `DEFAULT_LR[method]` (no weight decay: an adapter is small and starts at the base's function), linear
    decay to 0, batches of 16 (micro-batches of 8), no time budget (the base's `train.time_budget_s` is
    pretraining's: a tuning run counts epochs), one process unless parallel.* says otherwise."""
    values = {k: dict(v) for k, v in base.items()}
    full = method == "full"  # the whole model from the base's weights (`train.init_from`), no adapter
    values["tune"] = {"method": "none"} if full else {"method": method, "base": checkpoint, "tasks": tasks}
    values["train"].update(out_dir=out_dir, init_from=checkpoint if full else "", resume="auto", micro_batch_size=8, global_batch_size=16,
                           sample_tokens=0, time_budget_s=0.0, compile=False, recompute="none", recompute_method="uniform",
                           recompute_num_layers=0, device="auto")
    values["optim"].update(name="adamw", lr=DEFAULT_LR[method], min_lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8,
                           grad_clip=1.0, decay="linear", decay_steps=0)
    values["parallel"] = {}
    values["model"]["dropout"] = 0.0
    return apply_overrides(values, overrides)


def _tasks(items: list[tuple[str, str, str]], valid: list[tuple[str, str, str]], wheres: list[str]) -> list[str]:
    """The task names in order of first appearance in the training file ([] when every line has none)."""
    names: list[str] = []
    for task, _, _ in items:
        if task not in names:
            names.append(task)
    for (task, _, _), where in zip(valid, wheres):
        if task not in names:
            raise DataError(f"{where}: task {task!r} does not occur in --train; every validation task needs training "
                            "examples (its own virtual prompt)")
    return [] if names == [""] else names


def row_length(wanted: int | None, seq_len: int) -> int:
    """Tokens per row: `--max-length` (`wanted`), checked against the base's model.seq_len (its default)."""
    if wanted is None:
        return seq_len
    if not 2 <= wanted <= seq_len:
        raise ConfigError(f"--max-length {wanted} must be in 2..{seq_len} (model.seq_len of the base checkpoint)")
    return wanted


def _chat_flags(opts: TuneOptions, chat: bool) -> None:
    """The flags that go with conversation data, or without it."""
    if chat:
        if opts.template:
            raise ConfigError("--template is for input/output and task lines; conversations ('messages' lines) are "
                              "rendered with the chat template: give --chat-template FILE to replace the checkpoint's")
        if opts.pack and opts.method in ("prompt", "ptuning"):
            raise ConfigError(f"--pack with --method {opts.method}: the virtual tokens start each row, not each "
                              "conversation; use --method full or lora with --pack, or drop --pack")
    elif opts.pack or opts.chat_template:
        flag = "--pack" if opts.pack else "--chat-template"
        raise ConfigError(f"{flag} is for conversations ({{\"messages\": [...]}} lines); --train holds "
                          "input/output lines")


def _chat_sets(opts: TuneOptions, base, lines: tuple, length: int, n_virtual: int, tokenizer) -> tuple[list, dict]:
    """Conversation files encoded (chat_data.py): ([train, valid], what tune.json records of them)."""
    from meshlm.data.chat import template_for
    from meshlm.tune.chat_data import encode_chats

    template = template_for(base.data.tokenizer, override=opts.chat_template)
    sets = []
    for part, flag, path in zip(lines, ("--train", "--valid"), (opts.train, opts.valid)):
        data, cut, n = encode_chats(part, tokenizer, template, length, n_virtual, opts.truncate, opts.pack)
        sets.append(data)
        say(f"{flag} {path}: {n} conversations, {data.num_tokens:,} assistant tokens"
            + (f" packed into {len(data)} rows of {length}" if opts.pack else "")
            + (f"; {cut} cut to fit (--truncate keeps their start)" if cut else ""))
    return sets, {"chat_template": getattr(template, "text", template), "pack": bool(opts.pack)}


def _io_sets(opts: TuneOptions, items: tuple, lines: tuple, length: int, n_virtual: int, tasks: list[str],
             tokenizer) -> list:
    """Input/output or task lines encoded (data.py): [train, valid]."""
    from meshlm.tune.data import encode

    sets = []
    for part, part_lines, flag, path in zip(items, lines, ("--train", "--valid"), (opts.train, opts.valid)):
        data, cut = encode(part, [x.where for x in part_lines], tokenizer, length, n_virtual, tasks, opts.truncate)
        sets.append(data)
        say(f"{flag} {path}: {len(data)} examples, {data.num_tokens:,} output tokens"
            + (f"; {cut} inputs cut to fit" if cut else ""))
    return sets


def prepare(opts: TuneOptions, overrides: list[str]):
    """Everything before training, writing nothing: (config, tokenizer, train set, valid set, info)."""
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.tune.chat_data import is_chat
    from meshlm.tune.data import examples, parse_templates, trim_multiple
    from meshlm.tune.export import base_fingerprint

    if opts.epochs < 1:
        raise ConfigError(f"--epochs {opts.epochs} must be >= 1")
    check_output_dir("--out", opts.out)
    checkpoint = open_checkpoint(opts.checkpoint)  # resolved and verified once, for the whole command
    base = checkpoint.config
    if not get_spec(base.model.family).decoder:
        raise ConfigError(f"--checkpoint {opts.checkpoint!r} holds a model.family={base.model.family!r} model; for it "
                          "give --task classify|span|tokens (meshlm finetune's data) with --method lora")
    if opts.task is not None:
        raise ConfigError(f"--task {opts.task} is for BERT checkpoints; a GPT checkpoint learns --train's outputs")
    lines = (read_jsonl(opts.train, "--train"), read_jsonl(opts.valid, "--valid"))
    chat = is_chat(*lines)
    _chat_flags(opts, chat)
    templates = {} if chat else parse_templates(list(opts.template))
    items = () if chat else tuple(examples(part, templates, flag) for part, flag in zip(lines, ("--train", "--valid")))
    tasks = [] if chat else _tasks(items[0], items[1], [x.where for x in lines[1]])
    if tasks and opts.method in ("lora", "full"):
        raise ConfigError(f"--method {opts.method} with several tasks ({', '.join(tasks[:3])}): only prompt tuning has a "
                          "prompt per task; train one run per task, or use --method prompt|ptuning")
    # The run names the verified step directory: a resumed run reads the very weights this one starts from.
    values = tune_values(base.to_dict(), opts.method, str(checkpoint.path), opts.out, tasks,
                         (["--data.document_mask=true"] if opts.pack else []) + overrides)
    first = build(values)
    if opts.pack and not first.data.document_mask:
        raise ConfigError("--pack needs data.document_mask=true (conversations sharing a row must not attend to "
                          "each other); drop --data.document_mask=false")
    tokenizer = get_tokenizer(first.data.tokenizer)
    length = row_length(opts.max_length, first.model.seq_len)
    n_virtual = first.tune.virtual_tokens if opts.method in ("prompt", "ptuning") else 0
    extra = {}
    if chat:
        (train, valid), extra = _chat_sets(opts, base, lines, length, n_virtual, tokenizer)
    else:
        train, valid = _io_sets(opts, items, lines, length, n_virtual, tasks, tokenizer)
    n_valid = len(valid)
    valid = valid.padded(first.train.micro_batch_size, tokenizer.eod_id)
    cfg = with_schedule(values, overrides, len(train), len(valid), opts.epochs)
    train.trim = valid.trim = trim_multiple(cfg.parallel)  # each batch as long as its longest row needs
    info = {"method": opts.method, "checkpoint": opts.checkpoint, "base_fingerprint": base_fingerprint(checkpoint.path),
            "train": opts.train, "valid": opts.valid, "train_examples": len(train), "valid_examples": n_valid,
            "max_length": length, "tasks": tasks, "templates": {k: t.text for k, t in templates.items()}, **extra}
    return cfg, tokenizer, train, valid, info


def run_tune(opts: TuneOptions, overrides: list[str], extensions: Extensions) -> int:
    """`meshlm tune` (parsed by `meshlm.commands.tune`), with the trainer's `extensions(cfg)` (the adapter's
    and any evaluation tasks': `meshlm.commands.train.trainer_extensions`)."""
    if opts.task is not None:  # BERT: meshlm finetune's data and heads, with the adapter on the frozen encoder
        from meshlm.train.finetune import FinetuneOptions, run_finetune

        if opts.pack or opts.chat_template:
            raise ConfigError(f"{'--pack' if opts.pack else '--chat-template'} is for conversations on a GPT "
                              f"checkpoint; --task {opts.task} reads meshlm finetune's data")

        finetune = FinetuneOptions(opts.checkpoint, opts.task, opts.train, opts.valid, opts.out, opts.epochs,
                                   opts.max_length, opts.truncate)
        if opts.method == "full":  # that is meshlm finetune itself
            return run_finetune(finetune, overrides, extensions)
        extra = [f"--tune.method={opts.method}", f"--tune.base={opts.checkpoint}", "--train.init_from=",
                 f"--optim.lr={DEFAULT_LR[opts.method]}"]
        code = run_finetune(finetune, extra + overrides, extensions)
        if code == 0 and is_main():
            from meshlm.tune.export import export_run

            export_run(Path(opts.out))
        return code
    from meshlm.train.prepared import train_prepared, write_info
    from meshlm.tune.export import export_run

    cfg, tokenizer, train, valid, info = prepare(opts, overrides)
    t = cfg.train
    say(f"tuning ({opts.method}) {opts.checkpoint}: {t.max_steps} steps of {t.global_batch_size} examples, lr "
        f"{cfg.optim.lr:g}, evaluation every {t.eval_every} steps over {info['valid_examples']} examples")
    out = Path(opts.out)
    # A DIR of conversations resumes only with the same packing and template (its rows would differ).
    keep = ("method", "tasks", "base_fingerprint") + (("pack", "chat_template") if "pack" in info else ())
    trainer, result = train_prepared(cfg, (tokenizer, train, valid), opts.out,
                                     lambda d: write_info(d, info, INFO_FILE, keep), extensions)
    if is_main() and trainer.stop_signal is None:
        done = f"tune: step {result['step']}: val loss {result.get('val_loss', float('nan')):.4f}"
        if opts.method == "full":
            say(f"{done}; the fine-tuned model is {out}'s checkpoint")
        else:
            written = export_run(out)
            say(f"{done}; adapter in {', '.join(str(p.name) for p in written)} of {out}")
    return trainer.exit_code

