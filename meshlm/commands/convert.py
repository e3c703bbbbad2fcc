"""`meshlm convert`: a checkpoint to one plain file, to a Hugging Face directory, or from one
(`interop/convert.py` does the work; docs/hf.md)."""

from __future__ import annotations

import argparse

from meshlm.core.config import ConfigError, check_output_dir


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"convert takes no config overrides (got {overrides[0]!r}); see meshlm convert -h")
    from meshlm.interop.convert import convert_to_single, export_hf, import_hf

    modes = {"--to-single": args.to_single, "--to-hf": args.to_hf, "--from-hf": args.from_hf}
    modes["--from-gguf"] = args.from_gguf
    modes["--to-gguf"] = args.to_gguf
    given = [flag for flag, value in modes.items() if value is not None]
    if len(given) != 1:
        raise ConfigError(f"meshlm convert takes one of {', '.join(modes)} (got "
                          f"{', '.join(given) or 'none'}); see meshlm convert -h")
    if args.outtype is not None and args.to_gguf is None:
        raise ConfigError("--outtype goes with --to-gguf OUT.gguf; see meshlm convert -h")
    if args.from_hf is not None:
        if args.out is None or args.checkpoint is not None:
            raise ConfigError("--from-hf HF_DIR takes --out RUN_DIR (the new run directory), not --checkpoint")
        path = import_hf(args.from_hf, args.out, args.tokenizer)
        print(f"wrote {path}")
        return 0
    if args.from_gguf is not None:
        if args.out is None or args.checkpoint is not None or args.tokenizer is not None:
            raise ConfigError("--from-gguf FILE takes --out RUN_DIR (the new run directory), not --checkpoint or "
                              "--tokenizer (the file carries its tokenizer)")
        from meshlm.interop.gguf import import_gguf

        print(f"wrote {import_gguf(args.from_gguf, args.out)}")
        return 0
    if args.checkpoint is None or args.out is not None or args.tokenizer is not None:
        raise ConfigError(f"{given[0]} takes --checkpoint RUN (not --out or --tokenizer); see meshlm convert -h")
    from meshlm.interop.checkpoints import open_checkpoint

    if args.to_gguf is not None:
        from meshlm.interop.gguf_write import DEFAULT_OUTTYPE, check_gguf_target, export_gguf

        outtype = args.outtype or DEFAULT_OUTTYPE
        check_gguf_target(args.to_gguf, outtype)  # before the checkpoint is opened
        print(f"wrote {export_gguf(open_checkpoint(args.checkpoint), args.to_gguf, outtype)}")
        return 0
    if args.to_hf is not None:
        print(f"wrote {export_hf(open_checkpoint(args.checkpoint), args.to_hf)}")
        return 0
    check_output_dir("--to-single", args.to_single)
    path = convert_to_single(open_checkpoint(args.checkpoint), args.to_single)
    print(f"wrote {path} and {path.parent / 'config.json'}")
    return 0


def add_convert_command(sub) -> None:
    """Register `meshlm convert` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="a checkpoint to one safetensors file or a Hugging Face directory, or "
                                       "a Hugging Face directory to a checkpoint")
    p.add_argument("--checkpoint", help="with --to-single or --to-hf: a run directory (its latest checkpoint), a "
                                        "step directory, or a .gguf file (converted once into $MESHLM_CACHE/gguf/)")
    p.add_argument("--to-single", metavar="OUT_DIR",
                   help="directory for model.safetensors (the plain state dict) and config.json")
    p.add_argument("--to-hf", metavar="HF_DIR", help="new directory for config.json, model.safetensors and the "
                                                     "tokenizer files, which transformers' from_pretrained loads")
    p.add_argument("--from-hf", metavar="HF_DIR", help="a local Hugging Face GPT-2, Llama or BERT directory "
                                                       "(config.json, model.safetensors or pytorch_model.bin)")
    p.add_argument("--from-gguf", metavar="FILE", help="a llama.cpp GGUF model file (Llama or Qwen2; any "
                                                       "quantization gguf reads), tokenizer included (docs/gguf.md)")
    p.add_argument("--to-gguf", metavar="OUT.gguf", help="new GGUF file of a Llama-style model with its tokenizer "
                                                        "and chat template, for llama.cpp, Ollama and transformers")
    p.add_argument("--outtype", metavar="TYPE",
                   help="with --to-gguf: f32, f16 (default, as llama.cpp's converter), bf16, q8_0 or q4_0")
    p.add_argument("--out", metavar="RUN_DIR", help="with --from-hf or --from-gguf: the new run directory")
    p.add_argument("--tokenizer", help="with --from-hf: data.tokenizer to record (default: the directory's "
                                       "tokenizer files, else the bundled gpt2 or bert)")
    p.set_defaults(func=_convert)
