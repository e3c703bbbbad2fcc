"""`meshlm chat`: talk with a checkpoint in the terminal, with its own chat template (`meshlm/infer/chat.py`)."""

from __future__ import annotations

import argparse

from meshlm.core.config import ConfigError


def _chat(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"chat takes no config overrides (got {overrides[0]!r}); see meshlm chat -h")
    from meshlm.commands.generate import check_sampling

    check_sampling(args)
    if args.context is not None and args.context < 2:
        raise ConfigError(f"--context {args.context} must be >= 2 tokens")
    from meshlm.infer.chat import ChatSettings, start

    settings = ChatSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, system=args.system)
    try:
        return start(args.checkpoint, settings, args.chat_template, context=args.context)
    except KeyboardInterrupt:  # Ctrl-C while the checkpoint loads
        return 130


def add_chat_command(sub) -> None:
    """Register `meshlm chat` on the CLI's subparsers."""
    p = sub.add_parser("chat", help="chat with a checkpoint in the terminal (its chat template, streamed replies)",
                       description="Type a message and press Enter; the reply streams back. /reset forgets the "
                       "conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply, or quits at the prompt.")
    p.add_argument("--checkpoint", required=True, help="run directory (uses its latest checkpoint), a step dir, or "
                   "a .gguf file (converted once into $MESHLM_CACHE/gguf/)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja2 chat template (file or text) instead of the checkpoint's own")
    p.add_argument("--temperature", type=float, default=0.7, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--seed", type=int, default=None, help="seed the replies (turn i samples with seed + i)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the longest reply, in tokens")
    p.add_argument("--context", type=int, default=None, metavar="TOKENS",
                   help="tokens the conversation may use (default: the model's model.seq_len); older turns "
                   "are dropped beyond it")
    p.set_defaults(func=_chat)
