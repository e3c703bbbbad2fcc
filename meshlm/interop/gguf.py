"""GGUF (llama.cpp, Ollama, LM Studio) → a meshlm run directory, through the Hugging Face import path.

A GGUF file holds the model's hyperparameters and its tokenizer as metadata (`{arch}.block_count`,
`tokenizer.ggml.tokens`, ...) and its tensors under llama.cpp's names (`blk.3.attn_q.weight`), most of them
quantized in blocks. It is read with llama.cpp's own `gguf` package (`GGUFReader`, `gguf.quants.dequantize`),
never parsed here:

- the metadata becomes a transformers-style config dict, read by `hf_config.model_config_from_hf` (so a GGUF
  model is refused or accepted exactly as the same Hugging Face config.json would be);
- each tensor is renamed to its Hugging Face name, dequantized to fp32 and placed by the family's HF name
  table, one tensor at a time, straight into its rows of the fp32 model (docs/gguf.md, "Memory");
- llama.cpp's converter permutes the rows of a Llama q_proj / k_proj per head so that RoPE rotates adjacent
  pairs (GGML's "normal" RoPE) instead of the halves (i, i + hd/2) Hugging Face and meshlm rotate. Per head,
  HF row r = j·(hd/2) + i (half j ∈ {0, 1}, pair i) was written to GGUF row 2·i + j; `unpermuted_rows` reads
  it back. Qwen2 files use GGML's "neox" RoPE (the halves) and are not permuted;
- the tokenizer files (`gguf_tokenizer.py`) go into the run's carried hf/ folder.

`import_gguf` writes the run like `convert.import_hf` (`convert.write_run`); `cached_import` imports a
file once into `$MESHLM_CACHE/gguf/` for `--checkpoint FILE.gguf`.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshlm.core.config import ConfigError

# GGUF architectures read, and whether llama.cpp permuted their q/k rows for its interleaved RoPE.
ARCHITECTURES = {"llama": True, "qwen2": False}
# Quantization types `gguf.quants.dequantize` reads (llama.cpp's block formats, F16/BF16/F32).
QUANT_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
               "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
               "TQ1_0", "TQ2_0", "MXFP4")
# llama.cpp tensor name (after `blk.N.`) → Hugging Face Llama/Qwen2 name (after `model.layers.N.`).
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# Weights dequantized at once: numpy's temporaries (~15 bytes a weight for Q4_1) stay below glibc's 128 KiB
# mmap threshold, so freeing them never raises it and the model's tensors do not fragment the heap (measured).
_WEIGHTS_PER_CHUNK = 1 << 14


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- opening ----------------------------------------------------------------------------------------------
def open_gguf(path: str | Path):
    """`gguf.GGUFReader` of `path` (memory-mapped); a missing, truncated or foreign file is a ConfigError."""
    from gguf import GGUFReader

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{str(path)!r} is not a file; give a .gguf model file")
    try:
        return GGUFReader(file)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, OSError, EOFError) as err:
        # GGUFReader raises ValueError on a bad magic or version, and numpy's ValueError/TypeError/IndexError
        # when a header, a field or the tensor data runs past the end of a truncated file.
        raise ConfigError(f"{file} cannot be read as GGUF ({type(err).__name__}: {err}); the file is not a GGUF "
                          "model or is truncated (download it again)") from None


def metadata(reader) -> dict[str, Any]:
    """The file's key-value metadata as Python values (strings, numbers, lists), the big token lists included."""
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except (ValueError, IndexError, TypeError, UnicodeDecodeError) as err:
            raise ConfigError(f"GGUF metadata {name!r} cannot be read ({type(err).__name__}: {err}); the file is "
                              "corrupt") from None
    return out


# ---- metadata → config ----------------------------------------------------------------------------------------
def _arch(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF general.architecture={arch!r} is not read; meshlm imports "
                          f"{', '.join(ARCHITECTURES)} GGUF files")
    return arch


def _rope_scaling(meta: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any] | None:
    """Hugging Face's rope_scaling from `{arch}.rope.scaling.*` (None: plain RoPE)."""
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError("GGUF tensor rope_freqs.weight (Llama 3.1-style scaled RoPE frequencies) is not read; "
                          "import the model's Hugging Face directory with meshlm convert --from-hf instead")
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ConfigError(f"GGUF {arch}.rope.scaling.type={kind!r} is not read; meshlm implements plain RoPE and "
                          "YaRN ('yarn') scaling")
    out = {"rope_type": "yarn", "factor": meta.get(f"{arch}.rope.scaling.factor"),
           "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
           "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast"),
           "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow"),
           "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
    return {k: v for k, v in out.items() if v is not None}


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The transformers config.json dict (LlamaConfig keys) of a GGUF file's metadata and tensor names.
    A Qwen2 file becomes a Llama config with biases (its o_proj and MLP biases are zeros)."""
    arch = _arch(meta)

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ConfigError(f"GGUF metadata {arch}.{key} is missing; the file is not a complete {arch} model")
        return meta[f"{arch}.{key}"]

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConfigError(f"GGUF {arch}.rope.dimension_count={rotary} rotates part of each head of {head_dim}; "
                          "meshlm's RoPE rotates whole heads")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens)))
    bias = any(name.endswith(".bias") for name in tensor_names)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
              "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "max_position_embeddings": int(need("context_length")),
              "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
              "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
              "tie_word_embeddings": "output.weight" not in tensor_names,
              "attention_bias": bias, "mlp_bias": bias, "hidden_act": "silu"}
    scaling = _rope_scaling(meta, arch, tensor_names)
    if scaling:
        config["rope_scaling"] = scaling
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{name}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{name}"])
    return config


# ---- tensors ----------------------------------------------------------------------------------------------------
def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp tensor name (None when it has none)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def check_tensors(reader) -> dict[str, Any]:
    """{HF name: the GGUF tensor} for every tensor of the file; a tensor without a Llama name or of a
    quantization type `gguf.quants` cannot read is a ConfigError naming it."""
    out = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in QUANT_TYPES:
            raise ConfigError(f"GGUF tensor {tensor.name!r} has quantization type {kind}, which is not read; "
                              f"meshlm dequantizes {', '.join(QUANT_TYPES)}")
        name = hf_name(tensor.name)
        if name is None and tensor.name != "rope_freqs.weight":
            raise ConfigError(f"GGUF tensor {tensor.name!r} has no place in a Llama model; the file's architecture "
                              "holds tensors meshlm does not read")
        if name is not None:
            out[name] = tensor
    return out


def gguf_shape(tensor) -> tuple[int, ...]:
    """numpy's row-major shape of a GGUF tensor: GGUF's dimensions reversed."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def dequantized(tensor, out=None, row_order=None):
    """The fp32 torch tensor of a GGUF tensor (`gguf_shape`), dequantized a few thousand weights at a time
    into `out` (a preallocated tensor of that shape, or a fresh one); with `row_order`, the file's row r goes
    to row row_order[r] (no second copy of the tensor for the q/k permutation)."""
    import torch
    from gguf.quants import dequantize

    shape = gguf_shape(tensor)
    out = torch.empty(shape, dtype=torch.float32) if out is None else out
    data, kind = tensor.data, tensor.tensor_type
    rows = out.numpy().reshape(-1, shape[-1])  # a view: numpy writes into `out` (the mapped file is read-only)
    flat = data.reshape(rows.shape[0], -1)
    step = max(1, _WEIGHTS_PER_CHUNK // shape[-1])
    try:
        for start in range(0, rows.shape[0], step):
            part = dequantize(flat[start:start + step], kind).reshape(-1, shape[-1])
            where = slice(start, start + part.shape[0]) if row_order is None else \
                row_order[start:start + part.shape[0]]
            rows[where] = part
    except (NotImplementedError, ValueError) as err:
        raise ConfigError(f"GGUF tensor {tensor.name!r} ({kind.name}) cannot be dequantized ({err})") from None
    return out


def release_pages(reader) -> None:
    """Unmap the pages of the file read so far from this process (`madvise(MADV_DONTNEED)`): they stay in the
    page cache and are read back if touched again, but no longer count in its memory. A no-op where numpy's
    memmap or the platform offers no madvise."""
    import mmap

    mapped = getattr(reader.data, "_mmap", None)  # np.memmap's mmap.mmap object
    if mapped is not None and hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


def unpermuted_rows(rows: int, n_heads: int):
    """Undo llama.cpp's q/k row permutation: for each GGUF row 2·i + j of a head, its Hugging Face row
    j·(hd/2) + i (numpy int64 indices, in file order)."""
    import numpy as np

    half = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, 2, half).transpose(0, 2, 1).reshape(-1)  # (nh, hd/2, 2) order


def _hf_shape(tensors: dict[str, Any], name: str, cfg) -> tuple[int, ...]:
    if name in tensors:
        return gguf_shape(tensors[name])
    if name.endswith(".bias") and (".self_attn.o_proj." in name or ".mlp." in name):
        return (cfg.hidden_size if "o_proj" in name or "down_proj" in name else cfg.ffn_size,)
    raise ConfigError(f"GGUF file has no tensor for {name!r}; the file is not a complete model "
                      f"(block_count={cfg.n_layers})")


def _fill_hf_tensor(tensors: dict[str, Any], name: str, cfg, permuted: bool, out) -> None:
    """Write the HF tensor `name` into `out`: dequantized, q/k rows unpermuted; a bias the file lacks (Qwen2's
    o_proj and MLP) zero."""
    if name not in tensors:
        out.zero_()
    elif permuted and (".q_proj." in name or ".k_proj." in name):
        order = unpermuted_rows(out.shape[0], cfg.n_heads if ".q_proj." in name else cfg.kv_heads)
        dequantized(tensors[name], out, order)
    else:
        dequantized(tensors[name], out)


def _meshlm_tensor(tensors: dict[str, Any], names: tuple[str, ...], cfg, permuted: bool):
    """meshlm's tensor of the HF tensors `names` stacked along rows (q; k; v or gate; up), dequantized straight
    into their rows of one preallocated fp32 tensor."""
    import torch

    shapes = [_hf_shape(tensors, name, cfg) for name in names]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ConfigError(f"GGUF tensors {list(names)} have shapes {shapes} that do not stack; the file is corrupt")
    out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=torch.float32)
    start = 0
    for name, shape in zip(names, shapes):
        _fill_hf_tensor(tensors, name, cfg, permuted, out[start:start + shape[0]])
        start += shape[0]
    return out


def model_from_gguf(reader, cfg, arch: str):
    """The meshlm model (eval mode, fp32) of the GGUF file: each tensor dequantized and placed by the
    family's Hugging Face name table, then assigned into a model built on the meta device. The file's pages
    are released after each tensor, so the peak holds the fp32 model and about one quantized tensor."""
    import torch

    from meshlm.families.registry import get_spec
    from meshlm.models.init import meta_device

    tensors = check_tensors(reader)
    table = get_spec(cfg.family).hf_table(cfg)
    wanted = {k for entry in table for k in entry.theirs}
    extra = sorted(set(tensors) - wanted)
    if extra:
        raise ConfigError(f"GGUF tensors {extra[:4]} do not fit a {cfg.n_layers}-layer model; the metadata "
                          "and the tensors disagree")
    ours = {}
    for entry in table:
        if entry.ours == "lm_head.weight" and cfg.tie_embeddings:
            ours[entry.ours] = ours["tok_emb.weight"]
            continue
        ours[entry.ours] = _meshlm_tensor(tensors, tuple(entry.theirs), cfg, ARCHITECTURES[arch])
        release_pages(reader)
    with meta_device():
        model = get_spec(cfg.family).model_class(cfg)
    try:
        model.load_state_dict(ours, strict=True, assign=True)
    except RuntimeError as err:
        raise ConfigError(f"GGUF tensor shapes do not match the metadata's model ({str(err).splitlines()[-1]})") \
            from None
    model.init_buffers(torch.device("cpu"))
    return model.eval()


# ---- import -----------------------------------------------------------------------------------------------------
def read_gguf(file: str | Path):
    """(model, ModelConfig, metadata, hf config dict) of a GGUF file; every check before a byte is written."""
    from meshlm.interop.hf_config import model_config_from_hf

    reader = open_gguf(file)
    meta = metadata(reader)
    # GGUFReader keeps a few numpy views per token and merge (~160 MiB for a 49k vocabulary): read once, dropped
    # before the model is dequantized
    reader.fields.clear()
    release_pages(reader)
    names = {t.name for t in reader.tensors}
    hf_config = hf_config_from_gguf(meta, names)
    if "tokenizer.ggml.tokens" not in meta:
        raise ConfigError(f"{file} has no tokenizer (no tokenizer.ggml.tokens); meshlm imports GGUF files that "
                          "carry their vocabulary")
    from meshlm.interop.gguf_tokenizer import check_tokenizer

    check_tokenizer(meta)
    cfg = model_config_from_hf(hf_config, "llama")
    model = model_from_gguf(reader, cfg, meta["general.architecture"])
    return model, cfg, meta, hf_config


def import_gguf(file: str | Path, out_dir: str | Path, log: Callable[[str], None] = _note) -> Path:
    """Convert the GGUF `file` into the meshlm run directory `out_dir` (new or empty), as `import_hf` does
    for a Hugging Face directory: checkpoints/step_0000000 (the fp32 model, a fresh optimizer, the config)
    and out_dir/hf with tokenizer.json, tokenizer_config.json (its chat template), generation_config.json
    and config.json. Returns the checkpoint directory; nothing is written on any error."""
    from meshlm.interop.convert import check_new_dir, write_run
    from meshlm.interop.gguf_tokenizer import write_tokenizer_files

    target = check_new_dir("--out", out_dir)
    model, cfg, meta, hf_config = read_gguf(file)

    def carry(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer_files(meta, folder, cfg.seq_len)
        (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    notes: list[str] = []
    path = write_run(target, model, cfg, carry, None, notes)
    for note in notes:
        log(note)
    return path


def cache_dir_for(file: str | Path) -> Path:
    """`$MESHLM_CACHE/gguf/<stem>-<key>`: the key hashes the file's resolved path, size and mtime, so an
    edited or replaced file is imported again."""
    from meshlm.data.assets import default_cache_dir

    path = Path(file).expanduser().resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return default_cache_dir() / "gguf" / f"{path.stem}-{key}"


def cached_import(file: str | Path, log: Callable[[str], None] = _note) -> Path:
    """The run directory of GGUF `file` in the cache (`cache_dir_for`), imported on first use (said once on
    stderr), reused after. A run another process published meanwhile is taken as it is."""
    if not Path(file).expanduser().is_file():
        raise ConfigError(f"{str(file)!r} is not a file; give a .gguf model file")
    run = cache_dir_for(file)
    if (run / "checkpoints").is_dir():
        return run
    log(f"importing {file} once into {run}")
    try:
        import_gguf(file, run, log)
    except (ConfigError, OSError):
        if (run / "checkpoints").is_dir():  # a concurrent import won the rename
            return run
        raise
    return run
