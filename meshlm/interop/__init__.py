"""Conversions between meshlm models and other frameworks' checkpoints (Hugging Face GPT-2 and Llama)."""

from meshlm.interop.hf import from_hf_gpt2, from_hf_llama, load_hf, save_hf, to_hf_gpt2, to_hf_llama
from meshlm.interop.hf_config import (
    check_representable,
    hf_architecture,
    hf_config_dict,
    hf_config_from_model_config,
    model_config_from_hf,
)

__all__ = ["check_representable", "from_hf_gpt2", "from_hf_llama", "hf_architecture", "hf_config_dict",
           "hf_config_from_model_config", "load_hf", "model_config_from_hf", "save_hf", "to_hf_gpt2",
           "to_hf_llama"]
