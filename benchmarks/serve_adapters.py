"""Decode throughput of the engine with adapters (`meshlm serve --adapter`): the base alone, every row on one
LoRA adapter run unmerged (what the server does), the same adapter merged into a copy of the weights (what a
one-adapter server did before it served several), and rows mixing the base, the LoRA and a prompt adapter.

    python benchmarks/serve_adapters.py [--checkpoint runs/demo] [--lora runs/tune-spk-all/lora]
                                        [--prompt runs/tune-spk-all/prompt] [--rows 16] [--max-tokens 64]

The adapters are `benchmarks/tune_task.py --answer speaker`'s (RESULTS.md, "Tuning"). Each case runs
`--rows` requests of `--prompt-tokens` prompt tokens and exactly `--max-tokens` greedy output tokens through
one engine (`--rows` rows at once), one torch thread, best of `--repeats`; output tokens/s and the ratio to
the base alone in the same run.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshlm.checkpoint.load import checkpoint_config, load_model_from_checkpoint
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
    args = ap.parse_args()
    for path in (args.checkpoint, args.lora, args.prompt):
        if not Path(path).exists():
            raise SystemExit(f"error: {path} does not exist; run benchmarks/tune_task.py --answer speaker first "
                             "(it trains runs/demo when missing and tunes both adapters)")
    torch.set_num_threads(args.threads)
    cfg = checkpoint_config(args.checkpoint)
    lora, prompt = (read_adapter(d, cfg, args.checkpoint) for d in (args.lora, args.prompt))
    base, tokenizer, cfg = load_model_from_checkpoint(args.checkpoint, "cpu", cfg)
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
