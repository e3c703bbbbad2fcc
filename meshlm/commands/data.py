"""The data subcommands of the `meshlm` CLI: `meshlm prepare` and `meshlm tokenizer train`."""

from __future__ import annotations

import argparse

from meshlm.core.config import ConfigError, check_output_dir

VOCAB_MAX = 2 ** 31 - 1  # token ids are int32 in the .bin at most


def _no_overrides(command: str, overrides: list[str]) -> None:
    if overrides:
        raise ConfigError(f"{command} takes no config overrides (got {overrides[0]!r}); see meshlm {command} -h")


def _check_json_key(key: str) -> None:
    """`--json-key` names a field: refused empty (or blank) before any input is read."""
    if not key.strip():
        raise ConfigError(f"--json-key {key!r} is empty; give the field of each .jsonl line that holds the text, "
                          "e.g. --json-key text (the default)")


def _prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    import sys

    from meshlm.data.prepare import prepare

    _no_overrides("prepare", overrides)
    _check_json_key(args.json_key)
    try:
        prepare(args.input, args.tokenizer, args.output, workers=args.workers, append_eod=args.append_eod,
                json_key=args.json_key, on_error=args.on_error, split_paragraphs=args.split_paragraphs,
                progress=not args.no_progress, allow_binary=args.allow_binary, split_sentences=args.split_sentences)
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


def _tokenizer_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.data.items import expand_inputs, refuse_binary
    from meshlm.data.prepare import DataError, iter_texts
    from meshlm.data.tokenizers import get_tokenizer, train_bpe

    _no_overrides("tokenizer train", overrides)
    _check_json_key(args.json_key)
    if not 1 <= args.vocab_size <= VOCAB_MAX:
        raise ConfigError(f"--vocab-size {args.vocab_size} must be in 1..{VOCAB_MAX}; e.g. 32000")
    if not 0 <= args.min_frequency <= VOCAB_MAX:
        raise ConfigError(f"--min-frequency {args.min_frequency} must be in 0..{VOCAB_MAX}; e.g. 2 (the default)")
    check_output_dir("--output", args.output)
    if not args.allow_binary:
        refuse_binary(expand_inputs(args.input), "--input", "--allow-binary")
    bad: list[str] = []
    path = train_bpe(iter_texts(args.input, args.json_key, bad), args.vocab_size, args.output, args.min_frequency)
    if bad:
        print(f"skipped {len(bad)} bad lines, the first: {bad[0]}")
    try:
        tok = get_tokenizer(str(path))
    except ConfigError as err:
        raise DataError(f"training produced an unusable tokenizer ({err})") from None
    print(f"wrote {path} (vocab {tok.vocab_size}, end of document {tok.eod_id}); use --tokenizer {args.output} "
          f"with meshlm prepare and data.tokenizer={args.output!r} for training")
    return 0


def add_data_commands(sub) -> None:
    """Register `prepare` and `tokenizer` on the CLI's subparsers."""
    p = sub.add_parser("prepare", help="tokenize text into a Megatron-compatible PREFIX.bin/.idx",
                       description="Tokenize .txt / .jsonl (optionally .gz) files into PREFIX.bin/.idx "
                                   "(Megatron's format) plus PREFIX.json (tokenizer, byte count).")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories (searched for .txt/.jsonl/.gz) or globs; a .txt file is one document")
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    p.add_argument("--tokenizer", default="gpt2",
                   help="gpt2, bert, a tokenizer.json (or its directory) or a SentencePiece .model (default gpt2)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    p.add_argument("--json-key", default="text", help="field of each .jsonl line that holds the text (default text)")
    p.add_argument("--on-error", choices=("skip", "fatal"), default="skip",
                   help="a .jsonl line that is not JSON (or lacks the key): report and skip it, or stop")
    p.add_argument("--split-paragraphs", action="store_true",
                   help="in .txt files, every blank-line separated paragraph is a document")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence, grouped into documents in the .idx (the data BERT reads)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--allow-binary", action="store_true",
                   help="use inputs that look binary (NUL bytes or invalid UTF-8 in the first KiB, an image, "
                        "an executable, ...); by default they stop the run")
    p.set_defaults(func=_prepare)

    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tokenizer_command", required=True)
    t = tok.add_parser("train", help="train a byte-level BPE tokenizer on your files (writes DIR/tokenizer.json)")
    t.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs")
    t.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, including <|endoftext|>")
    t.add_argument("--output", required=True, metavar="DIR", help="directory for tokenizer.json")
    t.add_argument("--json-key", default="text", help="field of each .jsonl line that holds the text")
    t.add_argument("--min-frequency", type=int, default=2, help="least count of a pair to merge (default 2)")
    t.add_argument("--allow-binary", action="store_true", help="use inputs that look binary (see meshlm prepare)")
    t.set_defaults(func=_tokenizer_train)
