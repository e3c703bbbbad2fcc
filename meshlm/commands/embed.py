"""`meshlm embed`: sentence embeddings of texts from a BERT checkpoint (`meshlm/infer/embed.py`)."""

from __future__ import annotations

import argparse

from meshlm.core.config import ConfigError


def _embed(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"embed takes no config overrides (got {overrides[0]!r}); see meshlm embed -h")
    from meshlm.infer.embed import embed_file

    embed_file(args.checkpoint, args.input, args.output, args.batch_size, args.max_length, args.truncate)
    return 0


def add_embed_command(sub) -> None:
    """Register `meshlm embed` on the CLI's subparsers."""
    p = sub.add_parser("embed", help="sentence embeddings of texts from a BERT checkpoint")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint) or a step directory")
    p.add_argument("--input", required=True, help=".txt (one text per line) or .jsonl (a 'text' field per line)")
    p.add_argument("--output", required=True, help="OUT.npy (float32 rows) or OUT.jsonl ({\"embedding\": [...]} "
                                                   "per line), in input order")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per text with [CLS] and [SEP], longer texts cut (default: sentence-transformers' "
                        "max_seq_length when the checkpoint carries it, else model.seq_len)")
    p.add_argument("--truncate", action="store_true",
                   help="cut texts longer than model.seq_len too, instead of stopping with an error")
    p.set_defaults(func=_embed)
