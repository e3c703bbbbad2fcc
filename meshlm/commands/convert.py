"""`meshlm convert`: a checkpoint to one plain file, to a Hugging Face directory or a GGUF file, or from one;
with `--adapter`, a LoRA merged into the checkpoint first (`interop/convert.py`, `tune/merge.py` do the work;
docs/hf.md, docs/gguf.md)."""

from __future__ import annotations

import argparse

from meshlm.core.config import ConfigError, check_output_dir


def _convert(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"convert takes no config overrides (got {overrides[0]!r}); see meshlm convert -h")
    from meshlm.interop.convert import convert_to_single, export_hf, import_hf

    if args.adapter is not None:
        return _merge(args)
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


def _merge(args: argparse.Namespace) -> int:
    """`--checkpoint BASE --adapter DIR` with --out (a merged run), --to-hf or --to-gguf (merged, then exported)."""
    targets = {"--out": args.out, "--to-hf": args.to_hf, "--to-gguf": args.to_gguf}
    given = [flag for flag, value in targets.items() if value is not None]
    others = [flag for flag, value in (("--to-single", args.to_single), ("--from-hf", args.from_hf),
                                       ("--from-gguf", args.from_gguf), ("--tokenizer", args.tokenizer)) if value]
    if args.checkpoint is None or len(given) != 1 or others:
        raise ConfigError("--adapter DIR merges a LoRA into --checkpoint BASE and takes one of --out MERGED_DIR, "
                          f"--to-hf HF_DIR or --to-gguf OUT.gguf (got {', '.join(given + others) or 'none'}"
                          f"{'' if args.checkpoint else ', no --checkpoint'}); see meshlm convert -h")
    if args.outtype is not None and args.to_gguf is None:
        raise ConfigError("--outtype goes with --to-gguf OUT.gguf; see meshlm convert -h")
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.interop.convert import check_new_dir, export_hf
    from meshlm.interop.gguf_write import DEFAULT_OUTTYPE, check_gguf_model, check_gguf_target, export_gguf
    from meshlm.interop.hf_config import hf_config_dict
    from meshlm.tune.merge import merge_and_export, merge_to_run

    if args.out is not None:
        check_new_dir("--out", args.out)  # before the checkpoint is opened
        print(f"wrote {merge_to_run(open_checkpoint(args.checkpoint), args.adapter, args.out)}")
        return 0
    if args.to_gguf is not None:
        outtype = args.outtype or DEFAULT_OUTTYPE
        check_gguf_target(args.to_gguf, outtype)
        base = open_checkpoint(args.checkpoint)
        check_gguf_model(base.config.model)  # before the merge
        path = merge_and_export(base, args.adapter, args.to_gguf, lambda merged: export_gguf(merged, args.to_gguf,
                                                                                             outtype))
    else:
        check_new_dir("--to-hf", args.to_hf)
        base = open_checkpoint(args.checkpoint)
        hf_config_dict(base.config.model)  # refuses what Hugging Face cannot hold, before the merge
        path = merge_and_export(base, args.adapter, args.to_hf, lambda merged: export_hf(merged, args.to_hf))
    print(f"wrote {path}")
    return 0


def add_convert_command(sub) -> None:
    """Register `meshlm convert` on the CLI's subparsers."""
    p = sub.add_parser("convert", help="a checkpoint to one safetensors file or a Hugging Face directory, or "
                                       "a Hugging Face directory to a checkpoint")
    p.add_argument("--checkpoint", help="with --to-single, --to-hf, --to-gguf or --adapter: a run directory (its latest checkpoint), a "
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
    p.add_argument("--out", metavar="RUN_DIR", help="with --from-hf, --from-gguf or --adapter: the new run directory")
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter (meshlm tune's --out, or PEFT's files) to merge "
                                                    "into --checkpoint's weights (W + (alpha/r) B A): written with "
                                                    "--out as a run directory, or exported with --to-hf or --to-gguf")
    p.add_argument("--tokenizer", help="with --from-hf: data.tokenizer to record (default: the directory's "
                                       "tokenizer files, else the bundled gpt2 or bert)")
    p.set_defaults(func=_convert)
