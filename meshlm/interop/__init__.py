"""Conversions between meshlm models and other frameworks' checkpoints (Hugging Face GPT-2, Llama, BERT).

`hf.py` (GPT-2, Llama, Mixtral and Qwen2-MoE weights, through the families' name tables), `hf_bert.py`,
`hf_config.py` (configs both ways; `hf_moe.py` for mixtures of experts), `hf_files.py` (tokenizer and
sentence-transformers files), `hf_stream.py` (weights written tensor by tensor, from a model or a checkpoint
on disk), `convert.py` (`meshlm convert`), `during_training.py` (`train.save_hf`: the trainer's extension),
`gguf.py` + `gguf_tokenizer.py` (llama.cpp's GGUF files → a run).
The names below are loaded on first use (PEP 562): importing the package loads no torch.

May import: core, data, models, families, parallel, checkpoint, train.
"""

from __future__ import annotations

import importlib

_HOME = {
    "from_hf_gpt2": "hf", "from_hf_llama": "hf", "from_hf_moe": "hf", "load_hf": "hf", "save_hf": "hf",
    "to_hf_gpt2": "hf", "to_hf_llama": "hf", "read_hf_weights": "hf", "from_hf_bert": "hf_bert",
    "to_hf_bert": "hf_bert",
    "check_representable": "hf_config", "hf_architecture": "hf_config", "hf_config_dict": "hf_config",
    "hf_config_from_model_config": "hf_config", "model_config_from_hf": "hf_config",
    "export_hf": "convert", "import_hf": "convert", "cached_import": "gguf", "import_gguf": "gguf",
}

__all__ = ["cached_import", "check_representable", "export_hf", "from_hf_bert", "from_hf_gpt2", "from_hf_llama",
           "from_hf_moe", "hf_architecture", "hf_config_dict", "hf_config_from_model_config", "import_gguf",
           "import_hf", "load_hf", "model_config_from_hf", "read_hf_weights", "save_hf", "to_hf_bert", "to_hf_gpt2", "to_hf_llama"]


def __dir__() -> list[str]:
    return __all__


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
