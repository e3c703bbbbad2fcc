"""llama.cpp runs the GGUF meshlm writes (`meshlm convert --to-gguf`): next-token agreement with meshlm.

    .venv/bin/python benchmarks/gguf_llamacpp.py [--checkpoint runs/demo] [--outtypes f32,f16,q8_0,q4_0]
                                                 [--tokens 2048] [--window N] [--out gguf_llamacpp.json]
    .venv/bin/python benchmarks/gguf_llamacpp.py --smoke    # the meshlm side only, on a tiny random model

For each outtype the checkpoint is written as a GGUF and run in llama.cpp through `llama-cpp-python`
(`Llama(..., logits_all=True)`, CPU): llama.cpp's tokenizer on held-out text (the last work of the bundled
corpus, which neither the tokenizer nor the default split trained on) against meshlm's, then, on windows of
the model's context of meshlm's ids, llama.cpp's logits at every position against meshlm's fp32 ones: the
share of positions whose greedy next token is the same, and the largest logit difference.

llama-cpp-python is not a dependency (it compiles llama.cpp: several minutes on 2 cores): install it with
`.venv/bin/pip install llama-cpp-python`. Without it the script says so, runs the meshlm side (writes the
files, computes meshlm's logits) and exits 2; `--smoke` exits 0 there, as it never runs llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from smoke import add_smoke_flag, skipped, tiny_checkpoint  # benchmarks/smoke.py, beside this script

from meshlm.checkpoint.load import load_model
from meshlm.data.assets import shakespeare_files
from meshlm.data.tokenizers import get_tokenizer
from meshlm.families.registry import get_spec
from meshlm.interop.checkpoints import open_checkpoint  # a run, or a .gguf file imported once (cached)
from meshlm.interop.gguf_write import OUTTYPES, export_gguf

MISSING = ("llama-cpp-python is not installed, so llama.cpp was not run (install it with `.venv/bin/pip install "
           "llama-cpp-python`: it compiles llama.cpp, several minutes on 2 cores)")


def held_out_text(chars: int = 40000) -> str:
    return shakespeare_files()[-1].read_text(encoding="utf-8")[5000:5000 + chars]


def meshlm_logits(checkpoint, ids: list[int], seq: int) -> torch.Tensor:
    """meshlm's fp32 logits, (windows, seq, vocab), over `ids` cut into windows of `seq` tokens."""
    model = load_model(checkpoint, get_spec(checkpoint.config.model.family))
    batch = torch.tensor(ids[:len(ids) // seq * seq]).view(-1, seq)
    with torch.no_grad():
        return torch.cat([model(row[None]) for row in batch])


def llamacpp_run(path: Path, text: str, windows: torch.Tensor, n_ctx: int) -> tuple[list[int], np.ndarray]:
    """(llama.cpp's ids for `text`, its logits for each window of meshlm's ids, fresh context each)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2)
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    out = []
    for row in windows.tolist():
        llm.reset()
        llm.eval(row)
        out.append(np.array(llm.scores[:len(row)], dtype=np.float32))
    return ids, np.stack(out)


def compare(outtype: str, path: Path, text: str, ours_ids: list[int], ours: torch.Tensor,
            windows: torch.Tensor, n_ctx: int) -> dict:
    theirs_ids, theirs = llamacpp_run(path, text, windows, n_ctx)
    same_prefix = next((i for i, (a, b) in enumerate(zip(ours_ids, theirs_ids)) if a != b),
                       min(len(ours_ids), len(theirs_ids)))
    theirs_t = torch.from_numpy(theirs)
    return {"outtype": outtype, "file_mb": round(path.stat().st_size / 2 ** 20, 2),
            "tokenizer_equal": ours_ids == theirs_ids, "tokens_equal_prefix": same_prefix,
            "top1_agreement": float((ours.argmax(-1) == theirs_t.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((ours - theirs_t).abs().max()), "positions": int(ours.shape[0] * ours.shape[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo", help="a Llama-style run (default: make demo's)")
    parser.add_argument("--outtypes", default="f32,f16,q8_0,q4_0", help=f"comma-separated, of {', '.join(OUTTYPES)}")
    parser.add_argument("--tokens", type=int, default=2048, help="held-out tokens compared")
    parser.add_argument("--window", type=int, default=0,
                        help="tokens per window (default: the model's context, model.seq_len)")
    parser.add_argument("--out", help="write the rows as JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            args.checkpoint = str(tiny_checkpoint(Path(tmp) / "run", "demo", n_layers=1, hidden_size=64, n_heads=2,
                                                  seq_len=32))
            args.outtypes, args.tokens = "f32", 64
        return run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> int:
    checkpoint = open_checkpoint(args.checkpoint, log=None)
    tok = get_tokenizer(checkpoint.config.data.tokenizer)
    text = held_out_text()
    ids = tok.encode(text)[:args.tokens]
    seq = min(args.window or checkpoint.config.model.seq_len, checkpoint.config.model.seq_len)
    if len(ids) < seq:
        raise SystemExit(f"--tokens {args.tokens} is fewer than one window of {seq}; raise --tokens or lower --window")
    windows = torch.tensor(ids[:len(ids) // seq * seq]).view(-1, seq)
    ours = meshlm_logits(checkpoint, ids, seq)
    files = {}
    for outtype in args.outtypes.split(","):
        start = time.perf_counter()
        files[outtype] = export_gguf(checkpoint, tmp / f"model-{outtype}.gguf", outtype, log=lambda line: None)
        print(f"wrote {outtype}: {files[outtype].stat().st_size / 2 ** 20:.2f} MiB in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    print(f"meshlm logits: {tuple(ours.shape)} over {windows.numel()} held-out tokens", flush=True)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if args.smoke:
            skipped("llama.cpp (llama-cpp-python is not installed; a smoke run never runs it)")
            return 0
        print(MISSING, file=sys.stderr)
        return 2
    rows = [compare(o, path, text[:4000], tok.encode(text[:4000]), ours, windows, seq) for o, path in files.items()]
    print(f"{'outtype':8} {'MiB':>7} {'tokenizer':>9} {'top-1 agree':>11} {'max |Δlogit|':>12}")
    for r in rows:
        print(f"{r['outtype']:8} {r['file_mb']:7.2f} {r['tokenizer_equal']!s:>9} {r['top1_agreement']:11.4f} "
              f"{r['max_abs_logit_diff']:12.4g}")
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": args.checkpoint, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
