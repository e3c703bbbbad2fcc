"""meshlm command line: `meshlm train | generate | plot | prepare | tokenizer train | bench memory | convert`.

User errors (bad config, missing or corrupt checkpoint or asset, a full disk, a run whose losses stay
non-finite) print one line naming the key or path and the fix, and exit with code 2, without a traceback.
A training run stopped by SIGINT or SIGTERM saves its checkpoint and exits with 130 or 143.
"""

from __future__ import annotations

import argparse
import sys

from meshlm.config import DEFAULT_CONFIG, ConfigError, bundled_configs
from meshlm.data.commands import add_data_commands
from meshlm.interop.convert import add_convert_command
from meshlm.plan.commands import add_bench_commands


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.config import load_config
    from meshlm.parallel import destroy
    from meshlm.train.trainer import Trainer

    cfg = load_config(args.config, overrides)
    try:
        trainer = Trainer(cfg)
        trainer.run()
    except BaseException:
        destroy()  # under torchrun: leave the process groups (a no-op for one process)
        raise
    destroy(wait_for_all=True)
    return trainer.exit_code  # 0, or 130 / 143 after SIGINT / SIGTERM (the checkpoint is saved)


def load_model_from_checkpoint(path: str, device: str = "cpu"):
    """(model, tokenizer, config) from a run directory or checkpoint directory."""
    import torch

    from meshlm.config import config_from_dict
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.models.gpt import GPT
    from meshlm.train import checkpoint as ckpt

    target = ckpt.resolve_checkpoint(path)
    cfg = config_from_dict(ckpt.load_config_dict(target))
    model = GPT(cfg.model)
    model.load_state_dict(ckpt.load_model_state(target))
    return model.to(torch.device(device)).eval(), get_tokenizer(cfg.data.tokenizer), cfg


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from meshlm.infer.generate import generate

    if overrides:
        raise ConfigError(f"generate takes no config overrides (got {overrides[0]!r}); see meshlm generate -h")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer, _ = load_model_from_checkpoint(args.checkpoint, device)
    ids = tokenizer.encode(args.prompt) or [tokenizer.eod_id]
    prompt = torch.tensor([ids], device=device)
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache)
    print(tokenizer.decode(out[0].tolist()))
    return 0


def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.train.plot import plot_losses

    print(f"wrote {plot_losses(args.out_dir)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshlm", description="GPT training with Megatron-style parallelism")
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
    gen.set_defaults(func=_generate)
    plot = sub.add_parser("plot", help="write OUT_DIR/loss.png from OUT_DIR/metrics.jsonl")
    plot.add_argument("out_dir")
    plot.set_defaults(func=_plot)
    add_data_commands(sub)  # meshlm prepare, meshlm tokenizer train
    add_bench_commands(sub)  # meshlm bench memory
    add_convert_command(sub)  # meshlm convert --to-single
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
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
