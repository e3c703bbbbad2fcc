"""`meshlm eval` and `meshlm harness` (docs/eval.md).

    meshlm eval --checkpoint DIR --task perplexity|cloze|choice|classify|shakespeare-cloze|shakespeare-choice
                [--data FILE] [--out results.json] [--batch-size N] [--stride N] [--progress] [--parallel.*=...]
    meshlm harness ARGS...   (lm-evaluation-harness's command line, with the `meshlm` model registered;
                              --apply_chat_template [FILE]: prompts as chats, the checkpoint's chat template)

`meshlm eval` prints the results as one JSON object (and writes it atomically to --out); under torchrun
(with `--parallel.tp=2`-style layouts) only rank 0 prints and writes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshlm.commands.serve import add_quantize_flags, quantize_options
from meshlm.core.config import ConfigError


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.eval.evaluate import check_out, evaluate, resolve_task, write_json_atomic
    from meshlm.eval.load import load
    from meshlm.interop.checkpoints import open_checkpoint
    from meshlm.parallel import destroy

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    if args.stride is not None and args.stride < 1:
        raise ConfigError(f"--stride {args.stride} must be >= 1")
    if args.out is not None:
        _check_writable(check_out(args.out), args.out)
    kind, data = resolve_task(args.task, args.data)
    quantize = quantize_options(args)
    progress = args.progress or sys.stderr.isatty()
    start = time.perf_counter()
    try:
        checkpoint = open_checkpoint(args.checkpoint)  # resolved and verified once; a fallback note said once
        loaded = load(checkpoint, overrides, args.batch_size, progress, adapter=args.adapter,
                      adapter_task=args.adapter_task)
        quantized = _quantize(loaded, quantize, args.checkpoint)
        metrics = evaluate(loaded, args.checkpoint, kind, data, args.batch_size, args.stride)
    except BaseException:
        destroy()
        raise
    result = {"task": args.task, "kind": kind, "checkpoint": args.checkpoint, "data": data, **metrics,
              "seconds": round(time.perf_counter() - start, 3)}
    if quantized is not None:
        result["quantized"] = {"mode": quantized.mode, "group_size": quantized.group_size, "head": quantized.head,
                               "layers": quantized.layers, "weight_bytes_before": quantized.bytes_before,
                               "weight_bytes_after": quantized.bytes_after}
    if loaded.dims is not None and loaded.dims.world_size > 1:
        d = loaded.dims
        result["layout"] = {"world_size": d.world_size, "tp": d.tp, "pp": d.pp, "dp": d.dp}
    if loaded.is_main:
        if args.out is not None:
            write_json_atomic(args.out, result)
        print(json.dumps(result))
    destroy(wait_for_all=True)
    return 0


def _quantize(loaded, quantize, given: str):
    """--quantize on the loaded model (one process, a language model; the scorer calls the same modules),
    its `QuantizeReport`; None without --quantize."""
    if quantize is None:
        return None
    quantize.check_serving(given, loaded.scorer is not None, loaded.dims.world_size if loaded.dims else 1)
    return quantize.apply(loaded.model)


def _check_writable(out, given: str) -> None:
    """--out's directory takes a file (a temporary one is created and removed), checked before the evaluation:
    `access()` says yes where creating fails (/proc, read-only mounts), and the results would be lost."""
    import os
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=out.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"--out {given!r} cannot be written ({err.strerror or err} in {str(out.parent)!r}); choose "
                          "another path") from None


def _harness(args: argparse.Namespace, overrides: list[str]) -> int:
    from meshlm.eval.harness import run_harness_cli

    return run_harness_cli(list(args.harness_args) + list(overrides))


def add_eval_command(sub) -> None:
    """Register `meshlm eval` and `meshlm harness` on the CLI's subparsers."""
    p = sub.add_parser("eval", help="score a checkpoint on an evaluation task (perplexity, cloze, choice, classify)",
                       description="Score a checkpoint on a task (docs/eval.md); the results as one JSON object. "
                                   "Under torchrun, --parallel.tp=2 / --parallel.pp=2 pick the layout.")
    p.add_argument("--checkpoint", required=True, help="run directory (its latest checkpoint), a step dir, or a "
                   ".gguf file (converted once into $MESHLM_CACHE/gguf/)")
    p.add_argument("--task", required=True, metavar="TASK",
                   help="perplexity, cloze, choice, classify (with --data), or a shipped set: shakespeare-cloze, "
                        "shakespeare-choice")
    p.add_argument("--data", default=None, metavar="FILE", help="the task's file (.txt/.jsonl; docs/eval.md)")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results here (atomically)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="sequences per forward pass (default 8)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="perplexity: the sliding window's stride in tokens (default model.seq_len // 2)")
    p.add_argument("--progress", action="store_true", help="show a progress bar on stderr even when not a tty")
    p.add_argument("--adapter", default=None, metavar="DIR", help="a meshlm tune (or PEFT) adapter tuned on "
                   "--checkpoint, evaluated on it (one process)")
    p.add_argument("--adapter-task", default=None, metavar="NAME", help="with a several-task prompt adapter: "
                   "the task whose virtual prompt to use")
    add_quantize_flags(p)
    p.set_defaults(func=_eval)
    h = sub.add_parser("harness", prefix_chars="+", add_help=False,
                       help="run lm-evaluation-harness's command line with meshlm checkpoints as --model meshlm",
                       description="lm_eval's own command line (every flag passes through), with the model "
                                   "`meshlm` registered: --model meshlm --model_args checkpoint=DIR; "
                                   "--apply_chat_template [FILE] renders the prompts with the checkpoint's chat "
                                   "template (or FILE's)")
    h.add_argument("harness_args", nargs=argparse.REMAINDER)
    h.set_defaults(func=_harness)
