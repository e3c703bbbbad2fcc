"""Small GGUF files for the tests, written with llama.cpp's own `gguf.GGUFWriter`: a byte-level BPE vocabulary
and the tensors of a Hugging Face model under llama.cpp's names."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Hugging Face name (after `model.layers.N.`) → llama.cpp name (after `blk.N.`).
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "o r"]


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): the 256 byte symbols, the merges' results and <|endoftext|> (control)."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    return tokens, [1] * (len(tokens) - 1) + [3], list(MERGES)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.<module...>.<weight|bias>
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(path: Path, arch: str, kv: dict, tensors: dict[str, np.ndarray], tokenizer: bool = True,
               quantize: str | None = None) -> Path:
    """A GGUF file of architecture `arch` with metadata `kv` (`{arch}.` keys without the prefix; ints as
    uint32, floats as float32), `tensors` (llama.cpp names, numpy shapes), the tiny vocabulary, and 2-D
    tensors quantized to `quantize` (e.g. "Q8_0") when given."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    if tokenizer:
        tokens, types, merges = tiny_vocabulary()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(len(tokens) - 1)
        writer.add_bos_token_id(len(tokens) - 1)
    for name, array in tensors.items():
        if quantize and array.ndim == 2:
            kind = gguf.GGMLQuantizationType[quantize]
            writer.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def qwen2_gguf(path: Path, quantize: str | None = "Q8_0"):
    """A random 2-layer Qwen2 (q/k/v biases, untied head) saved as GGUF; returns (path, its HF config)."""
    import torch
    import transformers

    torch.manual_seed(0)
    tokens, _, _ = tiny_vocabulary()
    config = transformers.Qwen2Config(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # every tensor random (HF starts biases at zero and norms at one)
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param))
    state = {gguf_name(k): v.detach().numpy() for k, v in model.state_dict().items()}
    kv = {"block_count": 2, "context_length": 128, "embedding_length": 64, "feed_forward_length": 96,
          "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 10000.0,
          "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": len(tokens)}
    return write_gguf(path, "qwen2", kv, state, quantize=quantize), config
