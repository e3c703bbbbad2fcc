"""A Llama-style meshlm checkpoint as one GGUF file, which llama.cpp, Ollama and transformers (`gguf_file=`) run.

    meshlm convert --checkpoint RUN --to-gguf OUT.gguf [--outtype f32|f16|bf16|q8_0|q4_0]

The file is written with llama.cpp's own `gguf` package (`GGUFWriter`; `gguf.quants.quantize` for the block
types), architecture `llama`, tensors under llama.cpp's names (`gguf.TENSOR_NAMES`). Per layer i:

    meshlm                  GGUF (blk.i.)                      note
    tok_emb.weight          token_embd.weight
    layers.i.norm1          attn_norm.weight                   F32 always
    layers.i.attn.qkv       attn_q, attn_k, attn_v .weight     rows [q; k; v]; q and k rows permuted (below)
    layers.i.attn.proj      attn_output.weight
    layers.i.norm2          ffn_norm.weight                    F32 always
    layers.i.mlp.fc         ffn_gate, ffn_up .weight           rows [gate; up]
    layers.i.mlp.proj       ffn_down.weight
    norm.weight             output_norm.weight                 F32 always
    lm_head.weight          output.weight                      only when untied (llama.cpp reuses token_embd)
    -                       rope_freqs.weight                  F32, only for model.rope_scaling='llama3'

RoPE layout: meshlm (like Hugging Face's Llama) rotates the pairs (j, j + d/2) of each head ("rotate half");
llama.cpp's `llama` rotates the adjacent pairs (2j, 2j + 1). So within each head of q and k, output row j
of the first half goes to row 2j and row j of the second half to row 2j + 1: the same attention scores,
as llama.cpp's converter does for Hugging Face checkpoints (and transformers undoes when it loads a GGUF).

Types (`--outtype`): f32; f16 (the default, as llama.cpp's converter picks for a float32 source: half the
size, logits within ~1e-3); bf16; q8_0; q4_0. Norm weights and every 1-D tensor stay F32, as llama.cpp keeps
them. A 2-D weight whose rows are not a multiple of the block (32) falls back to F16, as llama.cpp's
converter does. In q4_0 the output layer (the token embedding when tied) is Q8_0: llama-quantize likewise
keeps the output layer at a higher precision (Q6_K), since its error reaches every logit.

Tensors are read one at a time from the checkpoint (`hf_stream.CheckpointTensors`, any layout): the
header and tensor table are written first, from the shapes alone, then each tensor's data in turn.
The file is written beside OUT under a temporary name and renamed into place; OUT must not exist.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshlm.core.config import ConfigError, ModelConfig
from meshlm.families.common import split_sizes
from meshlm.interop.gguf_vocab import GGUFVocab, gguf_vocab
from meshlm.models.layers import rope_frequencies, yarn_attention_factor

DEFAULT_OUTTYPE = "f16"
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name, (rows, cols) or (n,) shape, type, and where it comes from:
    rows [start, start + shape[0]) of meshlm tensor `source`, head-permuted over `rope_heads` heads when set."""

    name: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    source: str
    start: int = 0
    rope_heads: int | None = None

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape[:-1]) * self.shape[-1] // block * size


def check_gguf_model(cfg: ModelConfig) -> None:
    """ConfigError naming each switch of `cfg` that a llama.cpp `llama` GGUF cannot hold."""
    need = {"family": "gpt", "position": "rope", "norm": "rmsnorm", "activation": "swiglu", "bias": False,
            "moe_experts": 0, "qk_norm": False, "head_size": 0, "attention": "mha", "sliding_window": 0,
            "attention_sinks": False, "norm_unit_offset": False, "sandwich_norm": False, "embed_scale": False,
            "attn_scale_dim": 0.0, "rope_local_theta": 0.0}  # not written: Qwen3's q/k norms and wide heads,
    # DeepSeek's latent attention, sliding windows and sinks, Gemma's layer parts
    problems = [f"model.{k}={getattr(cfg, k)!r}" for k, v in need.items() if getattr(cfg, k) != v]
    if cfg.rope_scaling == "linear":  # (written: llama3 as rope_freqs, yarn as its keys)
        problems.append("model.rope_scaling='linear'")
    if problems:
        raise ConfigError(f"--to-gguf writes Llama-style models (position='rope', norm='rmsnorm', "
                          f"activation='swiglu', bias=false, dense); this checkpoint has {', '.join(problems)}; "
                          "use meshlm convert --to-hf for it")
    if cfg.head_dim % 2:
        raise ConfigError(f"head size {cfg.head_dim} is odd; RoPE needs an even head size")


def _types(outtype: str):
    import gguf

    q = gguf.GGMLQuantizationType
    weight = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0, "q4_0": q.Q4_0}[outtype]
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype]
    return weight, file_type


def _weight_type(shape: tuple[int, ...], weight, output: bool, fallbacks: list[str], name: str):
    """The type of one tensor: F32 for 1-D; `weight` (Q8_0 for the q4_0 output layer); F16 where the rows do
    not fill whole blocks."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) == 1:
        return q.F32
    if weight == q.Q4_0 and output:
        weight = q.Q8_0
    if shape[-1] % gguf.GGML_QUANT_SIZES[weight][0]:
        fallbacks.append(name)
        return q.F16
    return weight


def gguf_plan(cfg: ModelConfig, outtype: str, fallbacks: list[str] | None = None) -> list[GGUFTensor]:
    """Every tensor of the GGUF of `cfg` in `outtype`, in file order (module doc's table); `fallbacks` gets
    the names of the 2-D tensors written as F16 because their rows do not fill whole quantization blocks."""
    import gguf

    weight, _ = _types(outtype)
    fallbacks = [] if fallbacks is None else fallbacks
    names, t = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    h, v = cfg.hidden_size, cfg.vocab_size
    plan: list[GGUFTensor] = []

    def add(kind, source: str, shape: tuple[int, ...], bid: int | None = None, start: int = 0,
            rope_heads: int | None = None, output: bool = False) -> None:
        if kind not in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.LLAMA]:
            raise AssertionError(f"{kind} is not a llama tensor")
        name = names[kind].format(bid=bid) + ".weight"
        plan.append(GGUFTensor(name, shape, _weight_type(shape, weight, output, fallbacks, name), source, start,
                               rope_heads))

    add(t.TOKEN_EMBD, "tok_emb.weight", (v, h), output=cfg.tie_embeddings)
    q_rows, kv_rows, _ = split_sizes(cfg, 3)
    ffn = cfg.ffn_size
    for i in range(cfg.n_layers):
        layer = f"layers.{i}."
        add(t.ATTN_NORM, layer + "norm1.weight", (h,), i)
        add(t.ATTN_Q, layer + "attn.qkv.weight", (q_rows, h), i, 0, cfg.n_heads)
        add(t.ATTN_K, layer + "attn.qkv.weight", (kv_rows, h), i, q_rows, cfg.kv_heads)
        add(t.ATTN_V, layer + "attn.qkv.weight", (kv_rows, h), i, q_rows + kv_rows)
        add(t.ATTN_OUT, layer + "attn.proj.weight", (h, q_rows), i)
        add(t.FFN_NORM, layer + "norm2.weight", (h,), i)
        add(t.FFN_GATE, layer + "mlp.fc.weight", (ffn, h), i, 0)
        add(t.FFN_UP, layer + "mlp.fc.weight", (ffn, h), i, ffn)
        add(t.FFN_DOWN, layer + "mlp.proj.weight", (h, ffn), i)
    add(t.OUTPUT_NORM, "norm.weight", (h,))
    if not cfg.tie_embeddings:
        add(t.OUTPUT, "lm_head.weight", (v, h), output=True)
    if cfg.rope_scaling == "llama3":
        add(t.ROPE_FREQS, "", (cfg.head_dim // 2,))
    return plan


def rotate_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q or k rows (n_heads · d, in) from the rotate-half RoPE layout (pairs j, j + d/2 of each head) to the
    interleaved one (pairs 2j, 2j + 1): row j of a head's first half → 2j, row j of its second half → 2j + 1."""
    rows, cols = weight.shape
    d = rows // n_heads
    return weight.reshape(n_heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)  # (nh, d/2, 2, in)


def llama3_rope_factors(cfg: ModelConfig) -> torch.Tensor:
    """llama.cpp's `rope_freqs` for Llama 3 scaling: per frequency, the divisor taking RoPE's base frequency to
    meshlm's scaled one (llama.cpp divides each base frequency by it)."""
    base, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta)
    scaled, _ = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg)
    return base / scaled


def _encode(tensor: torch.Tensor, qtype) -> np.ndarray:
    """A float32 tensor as the bytes (or floats) of GGUF type `qtype`."""
    import gguf

    data = tensor.detach().to(torch.float32).contiguous().numpy()
    return gguf.quants.quantize(data, qtype)


def _add_rope_scaling(writer, cfg: ModelConfig) -> None:
    """llama.cpp's YaRN keys (Llama 3 scaling travels as the `rope_freqs` tensor instead, as llama.cpp's
    converter writes it). llama.cpp multiplies cos/sin by yarn_attn_factor · (0.1 ln s + 1), meshlm by the
    configured attention factor (default 0.1 ln s + 1), hence the ratio."""
    import gguf

    if cfg.rope_scaling != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(cfg.rope_factor)
    writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_len)
    writer.add_rope_scaling_yarn_beta_fast(cfg.rope_beta_fast)
    writer.add_rope_scaling_yarn_beta_slow(cfg.rope_beta_slow)
    if cfg.rope_attention_factor > 0 and cfg.rope_factor > 1:
        writer.add_rope_scaling_yarn_attn_factor(yarn_attention_factor(cfg) / (0.1 * math.log(cfg.rope_factor) + 1))


def _add_metadata(writer, cfg: ModelConfig, vocab: GGUFVocab, name: str, outtype: str) -> None:
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.seq_len)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.ffn_size)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    _add_rope_scaling(writer, cfg)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(_types(outtype)[1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    if vocab.unk_id is not None:
        writer.add_unk_token_id(vocab.unk_id)
    writer.add_add_bos_token(False)  # meshlm trains and generates without a BOS token
    writer.add_add_eos_token(False)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _tensor_data(read: Callable[[str], torch.Tensor], plan: list[GGUFTensor], cfg: ModelConfig):
    """(planned tensor, encoded data) in file order, reading each meshlm tensor once."""
    held: tuple[str, torch.Tensor] | None = None
    for item in plan:
        if item.name == "rope_freqs.weight":
            yield item, _encode(llama3_rope_factors(cfg), item.qtype)
            continue
        if held is None or held[0] != item.source:
            held = None  # drop the previous tensor before reading the next
            held = (item.source, read(item.source))
        tensor = held[1]
        if tuple(tensor.shape[1:]) != item.shape[1:] or tensor.shape[0] < item.start + item.shape[0]:
            raise ConfigError(f"{item.source} has shape {tuple(tensor.shape)}, not the config's; the checkpoint "
                              "does not match its config.json")
        part = tensor[item.start:item.start + item.shape[0]] if len(item.shape) == 2 else tensor
        if item.rope_heads is not None:
            part = rotate_half_to_interleaved(part, item.rope_heads)
        yield item, _encode(part, item.qtype)


def write_gguf(read: Callable[[str], torch.Tensor], cfg: ModelConfig, vocab: GGUFVocab, path: Path, name: str,
               outtype: str = DEFAULT_OUTTYPE, log: Callable[[str], None] = _note) -> None:
    """The GGUF of the model whose tensors `read(meshlm_name)` gives, with tokenizer `vocab`, at `path`:
    metadata and the tensor table first (from the shapes), then one tensor's data at a time."""
    import gguf

    check_gguf_model(cfg)
    fallbacks: list[str] = []
    plan = gguf_plan(cfg, outtype, fallbacks)
    if fallbacks:
        log(f"note: {len(fallbacks)} tensors ({', '.join(fallbacks[:3])}{', ...' if len(fallbacks) > 3 else ''}) "
            f"have rows not a multiple of the {outtype} block; written as F16")
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        _add_metadata(writer, cfg, vocab, name, outtype)
        for item in plan:  # the element shape (rows, cols) and the size in bytes of the stored type
            writer.add_tensor_info(item.name, item.shape, np.dtype(np.float32), item.nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for item, data in _tensor_data(read, plan, cfg):
            writer.write_tensor_data(data)
    finally:
        writer.close()


def check_gguf_target(out: str | Path, outtype: str) -> Path:
    """The absolute path of a new OUT.gguf; ConfigError for an unknown `outtype`, an OUT that exists or a
    folder that does not."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    target = Path(out).expanduser().absolute()
    if target.exists() or target.is_symlink():
        raise ConfigError(f"--to-gguf {str(out)!r} exists; choose a new file name (nothing is overwritten)")
    if not target.parent.is_dir():
        raise ConfigError(f"--to-gguf {str(out)!r}: folder {target.parent} does not exist; create it first")
    return target


def export_gguf(checkpoint, out: str | Path, outtype: str = DEFAULT_OUTTYPE,
                log: Callable[[str], None] = _note) -> Path:
    """`meshlm convert --checkpoint RUN --to-gguf OUT --outtype OUTTYPE` for the opened `checkpoint`
    (`checkpoint.load.Checkpoint`, any layout): every check (outtype, OUT, the model, the tokenizer) before
    anything is written; the file is written beside OUT and renamed into place."""
    from meshlm.interop.hf_files import checkpoint_files
    from meshlm.interop.hf_stream import CheckpointTensors

    target = check_gguf_target(out, outtype)
    source, config = checkpoint.path, checkpoint.config
    cfg = config.model
    check_gguf_model(cfg)
    if config.tune.method != "none":  # its tensors are the base's; the adapter would be left out
        raise ConfigError(f"--checkpoint {checkpoint.given!r} is a meshlm tune run (tune.method="
                          f"{config.tune.method!r}), whose adapter a GGUF model file cannot hold; convert its base "
                          f"({config.tune.base!r}) or a fine-tuned or merged checkpoint")
    vocab = gguf_vocab(config.data.tokenizer, cfg.vocab_size, checkpoint_files(source, config.data.tokenizer))
    run = source.parent.parent if source.parent.name == "checkpoints" else source
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    try:
        with CheckpointTensors(source, cfg) as read:
            write_gguf(read, cfg, vocab, tmp, f"meshlm {run.name}", outtype, log)
        if target.exists():
            raise ConfigError(f"--to-gguf {str(out)!r} appeared while converting; nothing is overwritten")
        os.rename(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
