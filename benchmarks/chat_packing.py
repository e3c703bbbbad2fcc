#!/usr/bin/env python3
"""What packing conversations buys in chat fine-tuning (`meshlm tune --pack`): useful tokens a second, one
conversation per row (padded) against several per row (packed, data.document_mask), the same model and data.

    .venv/bin/python benchmarks/chat_packing.py [--conversations 512] [--seq-len 256] [--steps 20] [--device auto]
    .venv/bin/python benchmarks/chat_packing.py --smoke    # 24 conversations, a 1-layer model, 1 timed step

The conversations are real and of mixed length: `scripts/make_chat_task.py`'s builder (a character's next
speeches in the bundled Shakespeare plays, 1 to 3 assistant turns, half with a system message), drawn from
the training plays with a fixed seed. Both runs are `meshlm tune --method full`'s, prepared and built as the
command does (`tune.command.prepare`, `build_trainer`) from the same freshly initialised GPT (4 layers of
width 128, 4 heads, RoPE, the GPT-2 tokenizer and vocabulary, rows of --seq-len tokens), steps of 16 rows
(micro-batches of 8), fp32. Their optimizer steps (`Trainer.train_step`: data, forward, backward, clipping,
AdamW) are timed alternately, one of each in turn after two warm-up steps each, so both see the same machine
load. A useful token is one of a conversation (its closing end-of-document token included), not padding;
useful tokens/s = the set's conversation tokens / its rows × rows a step / the median step time. Prints the
table, the packed/padded ratio and the machine's load average.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from smoke import add_smoke_flag  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
MODEL = {"family": "gpt", "n_layers": 4, "hidden_size": 128, "n_heads": 4, "vocab_size": 50257, "position": "rope",
         "dropout": 0.0}
ROWS_PER_STEP = 16


def conversations(n: int, seed: int) -> list[dict]:
    """`n` conversations of the training plays, by make_chat_task's builder and its default arguments."""
    import make_chat_task as task

    args = task.parser().parse_args(["--out", "unused"])
    names = task.split_plays(args.valid_plays, args.test_plays)["train"]
    return task.chat_rows(task.load_plays(names), names, n, random.Random(f"chat_packing:{seed}"), args)


def save_base(out: Path, seq_len: int, **shape) -> None:
    import torch

    from meshlm.checkpoint.single import save_checkpoint
    from meshlm.core.config import build
    from meshlm.models.gpt import GPT

    cfg = build({"model": {**MODEL, "seq_len": seq_len, **shape}, "data": {"tokenizer": "gpt2"},
                 "train": {"out_dir": str(out), "progress": False}})
    torch.manual_seed(0)
    gpt = GPT(cfg.model)
    save_checkpoint(out, 0, {"model": gpt.state_dict(), "optim": torch.optim.AdamW(gpt.parameters()).state_dict(),
                             "state": {"step": 0, "tokens_seen": 0}}, cfg.to_dict())


def conversation_tokens(padded, eod: int) -> int:
    """The tokens of every conversation, closing end-of-document tokens included, from the padded set (one
    conversation a row: up to its row's first end-of-document token; the text holds none)."""
    return sum(int(np.argmax(ids == eod)) + 1 for ids in padded.ids)


def trainer_for(work: Path, pack: bool, device: str, steps: int):
    """`meshlm tune --method full`'s prepared run and its Trainer (built as the command builds it)."""
    from meshlm.commands.train import build_trainer
    from meshlm.commands.tune import add_tune_command, tune_options
    from meshlm.tune.command import prepare

    argv = ["tune", "--checkpoint", str(work / "base"), "--method", "full", "--train", str(work / "chat.jsonl"),
            "--valid", str(work / "valid.jsonl"), "--out", str(work / ("packed" if pack else "padded")),
            "--train.progress=false", "--train.save_every=0", "--train.eval_every=0", "--train.precision=fp32",
            "--train.adapt_threads=false", f"--train.device={device}", f"--train.global_batch_size={ROWS_PER_STEP}",
            "--train.micro_batch_size=8", "--train.peak_tflops=1", f"--train.max_steps={steps}",
            *(["--pack"] if pack else [])]
    parser = argparse.ArgumentParser()
    add_tune_command(parser.add_subparsers())
    args, overrides = parser.parse_known_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):
        cfg, tokenizer, train, valid, _ = prepare(tune_options(args), overrides)
        return build_trainer(cfg, datasets=(tokenizer, train, valid)), train, tokenizer.eod_id


def timed_step(trainer) -> tuple[float, float]:
    import torch

    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    loss, _ = trainer.train_step()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    trainer.step += 1
    return time.perf_counter() - began, loss


def measure(work: Path, steps: int, device: str, seq_len: int) -> list[dict]:
    """Both trainers, their steps timed alternately (so both see the same machine load) after two warm-up
    steps each; steps beyond a run's epoch wrap into its next one."""
    runs = {pack: trainer_for(work, pack, device, steps + 2) for pack in (False, True)}
    useful_total = conversation_tokens(runs[False][1], runs[False][2])
    times: dict[bool, list[float]] = {False: [], True: []}
    losses: dict[bool, float] = {}
    for k in range(steps + 2):
        for pack, (trainer, _, _) in runs.items():
            dt, losses[pack] = timed_step(trainer)
            if k >= 2:
                times[pack].append(dt)
    out = []
    for pack, (_, train, _) in runs.items():
        step_s = statistics.median(times[pack])
        useful = useful_total / len(train)
        out.append({"mode": "packed" if pack else "padded", "rows": len(train), "steps": steps,
                    "useful_per_row": useful, "padding": 1 - useful / seq_len, "step_s": step_s,
                    "useful_tok_s": useful * ROWS_PER_STEP / step_s, "last_loss": losses[pack]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each run (after 2 warm-up steps)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    add_smoke_flag(ap)
    a = ap.parse_args()
    shape = {}
    if a.smoke:
        a.conversations, a.seq_len, a.steps = 24, 256, 1
        shape = {"n_layers": 1, "hidden_size": 32, "n_heads": 2}
    began, load = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = conversations(a.conversations + 32, a.seed)
        for name, part in (("chat.jsonl", rows[:a.conversations]), ("valid.jsonl", rows[a.conversations:])):
            (work / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        save_base(work / "base", a.seq_len, **shape)
        results = measure(work, a.steps, a.device, a.seq_len)
    print(f"{a.conversations} conversations (make_chat_task), rows of {a.seq_len} tokens, {ROWS_PER_STEP} rows a "
          f"step, device {a.device}; load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after "
          f"({time.time() - began:.0f} s)\n")
    print("| mode | rows | steps | useful tokens/row | padding | median step (s) | useful tokens/s | last loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['rows']} | {r['steps']} | {r['useful_per_row']:.1f} | {r['padding']:.1%} | "
              f"{r['step_s']:.3f} | {r['useful_tok_s']:,.0f} | {r['last_loss']:.3f} |")
    padded, packed = results
    print(f"\npacked / padded useful tokens/s: {packed['useful_tok_s'] / padded['useful_tok_s']:.2f}x "
          f"(rows: {padded['rows'] / packed['rows']:.2f}x fewer; step time {packed['step_s'] / padded['step_s']:.2f}x)")


if __name__ == "__main__":
    main()
