"""transformers' own reading of the SmolLM2 asset GGUF (the reference of tests/interop/test_gguf_read.py and
tests/test_released_model.py), done once per test run instead of once per module and worker.

`from_pretrained(dir, gguf_file=...)` spends ~30 s of CPU on this 135M-parameter file (it parses the file's
49,152-token vocabulary twice through numpy memmaps and rebuilds gguf's tensor-name map once per tensor), and
builds the tokenizer with a third parse. The first caller of a run does exactly that, then keeps what
transformers built in the run's $MESHLM_CACHE (tests/conftest.py's `session_cache_dir`, shared by the xdist
workers): the fp32 state dict, the model and generation configs and the tokenizer's own `save_pretrained`
files. Every later caller rebuilds the same transformers model class from that config and loads those
tensors: the same weights bit for bit, still dequantized by transformers, not by meshlm. The folder is
written under a temporary name and renamed, so concurrent workers never read a half-written copy."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers' GGUF loading, with two of gguf-py's pure functions it calls memoized while this lasts: it
    builds `gguf.get_tensor_name_map(arch, n_blocks)` (a table of every tensor name of the architecture) afresh
    for each of a model's ~400 modules, and parses the same file with `gguf.GGUFReader` once for the config, once
    for the weights and once for the tokenizer (each parse ~4 s of CPU for SmolLM2's 49,152-token vocabulary).
    The same tables and the same parse are handed back: what transformers builds from them does not change, only
    the time (about 19 -> 8 s of CPU for one SmolLM2 model). Both are imported from `gguf` at call time
    (transformers' modeling_gguf_pytorch_utils), so patching the module's attributes reaches them."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict = {}

    def read(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.get_tensor_name_map, gguf.GGUFReader = functools.cache(name_map), read
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def _key(path: Path) -> str:
    import transformers

    st = path.stat()
    return f"{path.name}-{st.st_size}-{st.st_mtime_ns}-transformers{transformers.__version__}"


def _from_gguf(path: Path):
    import torch
    import transformers

    with warnings.catch_warnings(), gguf_parsed_once():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def _save(folder: Path, model, tokenizer) -> None:
    from safetensors.torch import save_file

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        tied = model.config.get_text_config().tie_word_embeddings
        if tied:  # one storage for two names: safetensors stores it once, under the embedding's name
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(model.config.to_json_string())
        (tmp / "generation_config.json").write_text(model.generation_config.to_json_string())
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        (tmp / "meta.json").write_text(json.dumps({"class": type(model).__name__, "tied": tied}))
        try:
            tmp.rename(folder)
        except OSError:  # another worker's copy landed first: the same bytes
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load(folder: Path):
    import torch
    import transformers
    from safetensors.torch import load_file

    meta = json.loads((folder / "meta.json").read_text())
    config = transformers.AutoConfig.for_model(**json.loads((folder / "config.json").read_text()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    assert type(model).__name__ == meta["class"], (type(model).__name__, meta)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if meta["tied"] else []), (missing, unexpected)
    if meta["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.generation_config = transformers.GenerationConfig.from_dict(
        json.loads((folder / "generation_config.json").read_text()))
    return model.eval(), tokenizer


def transformers_smollm2(cache_dir: Path):
    """(model, tokenizer) as transformers builds them from the SmolLM2 asset GGUF (fp32, eval mode), read from
    `cache_dir` when an earlier caller of this test run kept them there."""
    from meshlm.data.assets import smollm2_gguf

    path = smollm2_gguf()
    folder = Path(cache_dir) / "transformers-gguf" / _key(path)
    if not folder.exists():
        model, tokenizer = _from_gguf(path)
        folder.parent.mkdir(parents=True, exist_ok=True)
        _save(folder, model, tokenizer)
        return model, tokenizer
    return _load(folder)
