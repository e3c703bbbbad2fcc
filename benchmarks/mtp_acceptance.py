"""The acceptance rate of `--speculative mtp` (infer/mtp_draft.py) on a run trained with `model.mtp_depth`.

Greedy continuations of a few Shakespeare prompts through the paged engine, plainly and with the model's own
multi-token prediction modules as the draft, at 1 and 4 draft tokens a step (depth D caps them at D). Prints one
row per setting: whether the outputs equal the plain ones token for token, the drafted and accepted tokens, the
acceptance rate (what `/metrics` reports as meshlm_spec_acceptance_rate) and the target's forward steps.

    meshlm train --config llama-tiny --model.mtp_depth=1 --train.out_dir=runs/mtp
    python benchmarks/mtp_acceptance.py --checkpoint runs/mtp [--tokens 40]

The wall time is not a speed-up measure: the proposer recomputes the target's layers over the row at each step
(docs/serving.md, "Multi-token prediction as the draft").
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from checkpoints import load_run
from smoke import add_smoke_flag, tiny_checkpoint

from meshlm.infer.engine import CacheOptions, Engine
from meshlm.infer.mtp_draft import MTPDraft
from meshlm.infer.sampling import SamplingParams
from meshlm.infer.speculative import Speculator

PROMPTS = ["ROMEO.\n", "First Citizen:\nBefore we proceed", "KING HENRY.\nNow, lords,", "To be, or not to be",
           "HAMLET.\n", "Enter the King", "MACBETH.\nIs this a dagger", "JULIET.\nO Romeo, Romeo"]


def rows(checkpoint: str, tokens: int, drafts: tuple[int, ...]) -> list[str]:
    model, tokenizer, cfg = load_run(checkpoint)
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True) for _ in prompts]
    plain = Engine(model, tokenizer, max_seqs=len(prompts), options=CacheOptions(block_size=16))
    start = time.perf_counter()
    want = [r.output_ids for r in plain.generate(prompts, params)]
    base = time.perf_counter() - start
    out = [f"| plain | - | - | - | - | {plain.stats['steps']} | {base:.1f} |"]
    for k in drafts:
        engine = Engine(model, tokenizer, max_seqs=len(prompts), options=CacheOptions(block_size=16, num_draft_tokens=k),
                        speculator=Speculator("mtp", MTPDraft(model)))
        start = time.perf_counter()
        got = [r.output_ids for r in engine.generate(prompts, params)]
        wall = time.perf_counter() - start
        s = engine.stats
        rate = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
        out.append(f"| mtp (depth {cfg.model.mtp_depth}), k={k} | {got == want} | {s['draft_tokens']} | "
                   f"{s['accepted_tokens']} | {rate:.3f} | {s['steps']} | {wall:.1f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a run trained with model.mtp_depth > 0")
    parser.add_argument("--tokens", type=int, default=40, help="greedy tokens per prompt (default 40)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if args.smoke or checkpoint is None:
            if not args.smoke:
                parser.error("--checkpoint DIR is needed (or --smoke)")
            checkpoint = str(tiny_checkpoint(f"{tmp}/run", "llama-tiny", n_layers=1, hidden_size=32, mtp_depth=2))
        lines = rows(checkpoint, 4 if args.smoke else args.tokens, (1, 4))
    print("| draft | greedy equal | drafted | accepted | acceptance | target steps | wall s |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
