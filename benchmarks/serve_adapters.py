"""Decode throughput of the engine with adapters (`meshlm serve --adapter`): the base alone, every row on one
LoRA adapter run unmerged (what the server does), the same adapter merged into a copy of the weights (what a
one-adapter server did before it served several), and rows mixing the base, the LoRA and a prompt adapter.

    python benchmarks/serve_adapters.py [--checkpoint runs/demo] [--lora runs/tune-spk-all/lora]
                                        [--prompt runs/tune-spk-all/prompt] [--rows 16] [--max-tokens 64]
    python benchmarks/serve_adapters.py --smoke    # a tiny random base, its LoRA and prompt adapters tuned here
                                                   # for one step each; 4 rows of 4 tokens

The adapters are `benchmarks/tune_task.py --answer speaker`'s (RESULTS.md, "Tuning"). Each case runs
`--rows` requests of `--prompt-tokens` prompt tokens and exactly `--max-tokens` greedy output tokens through
one engine (`--rows` rows at once), one torch thread, best of `--repeats`; output tokens/s and the ratio to
the base alone in the same run.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script
from smoke import add_smoke_flag, tiny_checkpoint

from meshlm.checkpoint.load import open_checkpoint
from meshlm.infer.adapters import AdapterSet
from meshlm.infer.engine import Engine, SamplingParams
from meshlm.tune.export import apply_adapter, read_adapter


def tokens_per_s(engine: Engine, prompts: list[list[int]], adapters: list[int], params: SamplingParams,
                 repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reqs = engine.generate(prompts, params, adapters=adapters)
        best = min(best, time.perf_counter() - start)
        assert all(len(r.output_ids) == params.max_tokens for r in reqs)
    return len(prompts) * params.max_tokens / best


def smoke_adapters(work: Path) -> tuple[str, str, str]:
    """(base, LoRA, prompt adapter) for --smoke: a tiny random GPT and one `meshlm tune` step of each method on
    four made-up rows (in this process)."""
    from meshlm.cli import main as meshlm

    base = tiny_checkpoint(work / "base", n_layers=1, hidden_size=32, n_heads=2, seq_len=64)
    rows = "".join(json.dumps({"input": f"Line {i}: to be or not", "output": " to be"}) + "\n" for i in range(4))
    for name in ("train", "valid"):
        (work / f"{name}.jsonl").write_text(rows)
    for method in ("lora", "prompt"):
        code = meshlm(["tune", "--checkpoint", str(base), "--method", method, "--train", str(work / "train.jsonl"),
                       "--valid", str(work / "valid.jsonl"), "--out", str(work / method), "--max-length", "32",
                       "--train.max_steps=1", "--train.global_batch_size=2", "--train.micro_batch_size=2",
                       "--train.progress=false", "--train.peak_tflops=1"])
        if code:
            raise SystemExit(f"meshlm tune --method {method} failed ({code})")
    return str(base), str(work / "lora"), str(work / "prompt")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="runs/demo")
    ap.add_argument("--lora", default="runs/tune-spk-all/lora")
    ap.add_argument("--prompt", default="runs/tune-spk-all/prompt")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    add_smoke_flag(ap)
    args = ap.parse_args()
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            args.checkpoint, args.lora, args.prompt = smoke_adapters(Path(tmp))
            args.rows, args.prompt_tokens, args.max_tokens, args.repeats = 4, 4, 4, 1
            return measure(args)
    return measure(args)


def measure(args: argparse.Namespace) -> int:
    """The table for `args`' checkpoint and adapters."""
    for path in (args.checkpoint, args.lora, args.prompt):
        if not Path(path).exists():
            raise SystemExit(f"error: {path} does not exist; run benchmarks/tune_task.py --answer speaker first "
                             "(it trains runs/demo when missing and tunes both adapters)")
    torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint(args.checkpoint)
    cfg = checkpoint.config
    lora, prompt = (read_adapter(d, cfg, checkpoint) for d in (args.lora, args.prompt))
    base, tokenizer, cfg = load_run(args.checkpoint, "cpu")
    merged = apply_adapter(copy.deepcopy(base), cfg, lora)  # W + (α/r)·B·A
    served = AdapterSet(base, cfg, [("lora", lora), ("prompt", prompt)])
    length = args.prompt_tokens + args.max_tokens + prompt.tune.virtual_tokens + 1
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.model.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.rows)]
    with_adapters = Engine(base, tokenizer, args.rows, length, adapters=served)
    cases = [
        ("base alone", with_adapters, [0] * args.rows),
        ("every row on the LoRA, unmerged", with_adapters, [1] * args.rows),
        ("the LoRA merged into the weights", Engine(merged, tokenizer, args.rows, length), [0] * args.rows),
        ("rows mixed: base, LoRA, prompt", with_adapters, [i % 3 for i in range(args.rows)]),
    ]
    rates = [(name, tokens_per_s(engine, prompts, idx, params, args.repeats)) for name, engine, idx in cases]
    print(f"{args.checkpoint} + {args.lora} + {args.prompt}: {args.rows} rows × {args.max_tokens} greedy tokens "
          f"after {args.prompt_tokens}, {args.threads} thread(s), best of {args.repeats}\n")
    print("| case | output tokens/s | vs the base alone |\n|---|---|---|")
    for name, rate in rates:
        print(f"| {name} | {rate:,.0f} | {rate / rates[0][1]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
