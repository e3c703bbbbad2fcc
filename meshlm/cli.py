"""meshlm command line: `meshlm train | generate | embed | finetune | tune | serve | eval | harness | plot | prepare |
tokenizer train | bench memory | convert`.

User errors (bad config or argument, missing or corrupt checkpoint or asset, bad data, a full disk, a
run too large for this machine, a run whose losses stay non-finite) print one line starting with
`error:` that names the key or path and the fix, and exit with code 2, without a traceback; argparse's
usage errors too (docs/reliability.md). A training run stopped by SIGINT or SIGTERM saves its checkpoint
and exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from meshlm.config import DEFAULT_CONFIG, ConfigError, bundled_configs
from meshlm.data.commands import add_data_commands
from meshlm.eval.commands import add_eval_command
from meshlm.infer.embed import add_embed_command
from meshlm.infer.server import add_serve_command
from meshlm.interop.convert import add_convert_command
from meshlm.plan.command import add_plan_command
from meshlm.plan.commands import add_bench_commands
from meshlm.train.finetune import add_finetune_command
from meshlm.tune.command import add_tune_command


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.config import load_config
    from meshlm.parallel import destroy
    from meshlm.plan.fit import check_training_fits
    from meshlm.train.trainer import Trainer

    cfg = load_config(args.config, overrides).check_paths()
    check_training_fits(cfg)
    try:
        trainer = Trainer(cfg)
        trainer.run()
    except BaseException:
        destroy()  # under torchrun: leave the process groups (a no-op for one process)
        raise
    destroy(wait_for_all=True)
    return trainer.exit_code  # 0, or 130 / 143 after SIGINT / SIGTERM (the checkpoint is saved)


def load_model_from_checkpoint(path: str, device: str = "cpu", cfg=None):
    """(model, tokenizer, config) from a run directory or checkpoint directory (`meshlm.infer.load`)."""
    from meshlm.infer.load import load_model_from_checkpoint as load

    return load(path, device, cfg)


def checkpoint_config(path: str):
    from meshlm.infer.load import checkpoint_config as load_config

    return load_config(path)


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling arguments of `meshlm generate` (the lengths are checked against the model later)."""
    from meshlm.config import SEED_MAX

    checks = [
        (args.max_new_tokens >= 0, f"--max-new-tokens {args.max_new_tokens} must be >= 0"),
        (math.isfinite(args.temperature) and args.temperature >= 0,
         f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy decoding)"),
        (args.top_k >= 0, f"--top-k {args.top_k} must be >= 0 (0: keep every token)"),
        (math.isfinite(args.top_p) and 0 < args.top_p <= 1,
         f"--top-p {args.top_p} must be in (0, 1] (1: off; e.g. 0.9 keeps the tokens holding 90% of the mass)"),
        (args.seed is None or 0 <= args.seed <= SEED_MAX, f"--seed {args.seed} must be in 0..{SEED_MAX}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _check_lengths(cfg, n_prompt: int, max_new_tokens: int) -> int:
    """How many tokens to generate: a prompt longer than the context is an error; with learned positions,
    generation stops at model.seq_len (said on stderr); RoPE may go further while the KV cache fits."""
    from meshlm.plan.fit import check_fits, kv_cache_bytes, weights_bytes

    m = cfg.model
    if n_prompt > m.seq_len:
        raise ConfigError(f"--prompt is {n_prompt} tokens, longer than the model's context of model.seq_len="
                          f"{m.seq_len} tokens; shorten the prompt")
    if m.position == "learned" and n_prompt + max_new_tokens > m.seq_len:
        print(f"note: generating {m.seq_len - n_prompt} tokens, not {max_new_tokens}: the prompt "
              f"({n_prompt} tokens) and the new tokens fill the model's context of model.seq_len={m.seq_len} "
              "(learned positions)", file=sys.stderr)
        max_new_tokens = m.seq_len - n_prompt
    needed = {"weights": weights_bytes(m), "KV cache": kv_cache_bytes(m, 1, n_prompt + max_new_tokens)}
    check_fits(needed, f"generating {max_new_tokens:,} tokens", "lower --max-new-tokens (at most model.seq_len="
               f"{m.seq_len} is what the model was trained for)")
    return max_new_tokens


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"generate takes no config overrides (got {overrides[0]!r}); see meshlm generate -h")
    _check_sampling(args)
    import torch

    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.infer.generate import generate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = checkpoint_config(args.checkpoint)
    from meshlm.models.registry import get_spec

    if not get_spec(cfg.model.family).decoder:
        raise ConfigError(f"{args.checkpoint} holds a model.family={cfg.model.family!r} model, which does not "
                          "generate text; use meshlm embed or meshlm finetune with it, or a GPT checkpoint here")
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    ids = tokenizer.encode(args.prompt) or [tokenizer.eod_id]
    adapter, head = None, []
    if args.adapter is not None:  # checked against this base before anything is loaded
        from meshlm.tune.export import apply_adapter, read_adapter

        adapter = read_adapter(args.adapter, cfg, args.checkpoint)
        # As the tuning data lays an example out (tune/data.py): the task's virtual-token placeholders, or
        # a document start.
        head = [adapter.task_index(args.task)] * adapter.virtual_tokens or [tokenizer.eod_id]
    elif args.task is not None:
        raise ConfigError("--task chooses the virtual prompt of an --adapter; give --adapter DIR")
    max_new_tokens = _check_lengths(cfg, len(head) + len(ids), args.max_new_tokens)
    model, _, _ = load_model_from_checkpoint(args.checkpoint, device, cfg)
    if adapter is not None:
        apply_adapter(model, cfg, adapter)  # LoRA merged into the weights: no extra work per token
    prompt = torch.tensor([head + ids], device=device)
    out = generate(model, prompt, max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
    print(tokenizer.decode(out[0, len(head):].tolist()))
    return 0


def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.train.plot import plot_losses

    print(f"wrote {plot_losses(args.out_dir)}")
    return 0


def one_line(message: str) -> str:
    """`message` as one printable line: newlines and other control characters (from user input) escaped."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line `error: ...` (exit code 2) instead of the usage and the
    error; the subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {one_line(message)}; see {self.prog} -h\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="meshlm", description="GPT training with Megatron-style parallelism")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model; extra --section.key=value override the config")
    train.add_argument("--config", default=DEFAULT_CONFIG,
                       help=f"bundled name ({', '.join(bundled_configs())}) or path to a .toml file")
    train.set_defaults(func=_train)
    gen = sub.add_parser("generate", help="sample text from a checkpoint")
    gen.add_argument("--checkpoint", required=True, help="run directory (uses its latest checkpoint) or a step dir")
    gen.add_argument("--prompt", default="\n")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step")
    gen.add_argument("--adapter", default=None, metavar="DIR", help="an adapter of meshlm tune (or a PEFT "
                     "directory) tuned on --checkpoint")
    gen.add_argument("--task", default=None, help="with a several-task prompt adapter: the task's prompt")
    gen.set_defaults(func=_generate)
    plot = sub.add_parser("plot", help="write OUT_DIR/loss.png from OUT_DIR/metrics.jsonl")
    plot.add_argument("out_dir")
    plot.set_defaults(func=_plot)
    add_data_commands(sub)  # meshlm prepare, meshlm tokenizer train
    add_bench_commands(sub)  # meshlm bench memory
    add_plan_command(sub)  # meshlm plan (the auto-configurator)
    add_convert_command(sub)  # meshlm convert --to-single | --to-hf | --from-hf
    add_embed_command(sub)  # meshlm embed
    add_finetune_command(sub)  # meshlm finetune
    add_tune_command(sub)  # meshlm tune
    add_serve_command(sub)  # meshlm serve (OpenAI-compatible HTTP server; needs meshlm[serve])
    add_eval_command(sub)  # meshlm eval, meshlm harness
    return parser


def main(argv: list[str] | None = None) -> int:
    from meshlm.data.assets import AssetError
    from meshlm.errors import CheckpointError, CheckpointWriteError, TrainingError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if not (e.startswith("--") and "." in e.split("=", 1)[0] and "=" in e)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} (config overrides look like --train.lr=3e-4)")
    try:
        return args.func(args, extra)
    except (ConfigError, CheckpointError, CheckpointWriteError, TrainingError, AssetError) as err:
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
