"""Hugging Face weights written one tensor at a time: from a live model, or from a checkpoint on disk.

`write_hf_model(read, cfg, shapes, directory)` writes config.json and the safetensors files of the Hugging
Face class of `cfg` (the family's name table, `families/*.py` `hf_table`): `read(name)` gives one meshlm
tensor at a time, which is split ([q; k; v], [gate; up]), transposed (GPT-2's Conv1D) and written straight
into its file, so no more than one meshlm tensor is held at once. Each file's safetensors header (names,
dtypes, shapes, byte offsets) is known before any tensor is read, from the shapes alone; the file is then
written front to back. Above `max_shard_bytes` the weights go into `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`, as `save_pretrained` shards them; one file is `model.safetensors`. A tied
embedding is written once (`from_pretrained` ties it again).

`CheckpointTensors(path, cfg)` reads the plain model's tensors of a checkpoint of any layout one at a time:
a parallel run's pieces (`index.json`: each tensor assembled from the safetensors slices that overlap
it), a one-process `model.pt` (memory-mapped), or `meshlm convert --to-single`'s `model.safetensors`.
So `meshlm convert --to-hf` and `train.save_hf` hold one tensor of the model (the largest: the
embedding) at a time, not the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Self

import torch

from meshlm.checkpoint import sharded
from meshlm.core.config import ModelConfig
from meshlm.core.errors import CheckpointError
from meshlm.families.common import Entry, entry_rows
from meshlm.families.registry import get_spec
from meshlm.interop.hf_bert import _TOP_LEVEL
from meshlm.interop.hf_config import hf_architecture, hf_config_dict
from meshlm.interop.hf_moe import check_zero
from meshlm.models.bert import MLM_HEADS

MAX_SHARD_BYTES = 5 * 10 ** 9  # save_pretrained's default max_shard_size ("5GB")
INDEX = "model.safetensors.index.json"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}

Planned = tuple[Entry, list[tuple[str, tuple[int, ...]]]]  # a meshlm tensor and its (HF key, shape) parts


def hf_plan(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[Planned]:
    """Every meshlm tensor the Hugging Face class of `cfg` stores, with its HF keys and their shapes
    (`shapes`: the meshlm tensors' shapes), in the name table's order. The tied LM head is left out; an
    untied BERT MLM head writes its bias twice (`cls.predictions.bias` and `decoder.bias`, as transformers 5
    has them)."""
    spec, arch = get_spec(cfg.family), hf_architecture(cfg)
    prefix = spec.hf_prefix(cfg)
    plan = []
    for entry in spec.hf_table(cfg):
        if entry.ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        shape = tuple(shapes[entry.ours])
        if entry.layout is not None:  # one HF tensor in its own layout (gpt-oss's experts): its shape from ours
            shape = tuple(entry.layout[0](torch.empty(shape, device="meta")).shape)
        rows = entry_rows(cfg, entry)
        parts = []
        for key, n in zip(entry.theirs, rows or [shape[0]]):
            part = (n, *shape[1:]) if rows is None or len(shape) <= 2 else (n, shape[-1])  # (E, r, c): per expert
            parts.append((key if key.startswith(_TOP_LEVEL) else prefix + key, part[::-1] if entry.transposed else part))
        if arch == "bert" and entry.ours == "lm_head.bias" and cfg.bert_head in MLM_HEADS and not cfg.tie_embeddings:
            parts.append(("cls.predictions.decoder.bias", shape))
        plan.append((entry, parts))
    return plan


def _hf_parts(entry: Entry, tensor: torch.Tensor, cfg: ModelConfig, count: int) -> list[torch.Tensor]:
    if entry.layout is not None:
        return [entry.layout[0](tensor)]
    rows = entry_rows(cfg, entry)
    flat = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 2 else tensor  # (E, r, c) → (E·r, c)
    parts = list(flat.split(rows)) if rows is not None else [tensor]
    parts = [p.t() if entry.transposed else p for p in parts]
    return parts + [tensor] * (count - len(parts))  # BERT's second MLM bias


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shards(plan: list[Planned], dtype: torch.dtype, max_bytes: int) -> list[list[Planned]]:
    """The plan cut into files of at most `max_bytes` (a meshlm tensor's parts stay in one file; a tensor
    larger than `max_bytes` gets a file of its own)."""
    files: list[list[Planned]] = [[]]
    size = 0
    for item in plan:
        n = sum(_nbytes(shape, dtype) for _, shape in item[1])
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += n
    return files


def _write_file(path: Path, items: list[Planned], read: Callable[[str], torch.Tensor], cfg: ModelConfig,
                dtype: torch.dtype) -> None:
    """One safetensors file: the header from the shapes, then each tensor's bytes in the header's order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, parts in items:
        for key, shape in parts:
            end = offset + _nbytes(shape, dtype)
            header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for entry, parts in items:
            tensor = read(entry.ours).detach().to("cpu", dtype)
            if not parts:
                check_zero(entry.ours, tensor, hf_architecture(cfg))
            for (key, shape), part in zip(parts, _hf_parts(entry, tensor, cfg, len(parts))):
                if tuple(part.shape) != shape:
                    raise CheckpointError(f"{entry.ours} has shape {tuple(tensor.shape)}, not the config's; the "
                                          "checkpoint does not match its config.json")
                f.write(part.contiguous().view(torch.uint8).numpy().data)
            del tensor
        f.flush()
        os.fsync(f.fileno())


def write_hf_model(read: Callable[[str], torch.Tensor], cfg: ModelConfig, shapes: dict[str, tuple[int, ...]],
                   directory: str | Path, dtype: torch.dtype = torch.float32,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """config.json and the weights of the Hugging Face class of `cfg` in `directory` (see the module doc);
    `read(name)` gives meshlm tensor `name`, written as `dtype`. Returns the weight files' names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**hf_config_dict(cfg), "dtype": str(dtype).removeprefix("torch.")}
    plan = hf_plan(cfg, shapes)
    files = _shards(plan, dtype, max_shard_bytes)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    for name, items in zip(names, files):
        _write_file(directory / name, items, read, cfg, dtype)
    if len(files) > 1:
        total = sum(_nbytes(shape, dtype) for _, parts in plan for _, shape in parts)
        weight_map = {key: name for name, items in zip(names, files) for _, parts in items for key, _ in parts}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return names


class CheckpointTensors:
    """`read(name)` of the plain model's tensors of resolved checkpoint `path`, one at a time (module doc);
    float32, each checked finite. A context manager: closes the files it opened."""

    def __init__(self, path: str | Path, cfg: ModelConfig):
        self.path, self.cfg, self.spec = Path(path), cfg, get_spec(cfg.family)
        self.shapes = {**sharded.plain_shapes(cfg, spec=self.spec), **sharded.plain_buffer_shapes(cfg, spec=self.spec)}
        self.source = self.state = None
        if sharded.is_sharded(self.path):
            self.source = sharded.open_source(self.path, cfg, spec=self.spec)
        elif (self.path / "model.pt").exists():
            try:
                self.state = torch.load(self.path / "model.pt", map_location="cpu", mmap=True, weights_only=True)
            except Exception as err:  # noqa: BLE001 (torch.load raises many kinds)
                raise CheckpointError(f"{self.path / 'model.pt'} cannot be read ({type(err).__name__}: {err}); the "
                                      "checkpoint is corrupt") from None
        elif (self.path / "model.safetensors").exists():
            from safetensors import safe_open

            self.state = safe_open(str(self.path / "model.safetensors"), framework="pt")
        else:
            raise CheckpointError(f"checkpoint {self.path} holds no model weights (model.pt, model.safetensors or "
                                  "index.json); it is incomplete")

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self._sharded(name) if self.source is not None else self._plain(name)
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"checkpoint {self.path} holds non-finite weights (tensor {name!r} holds NaN or "
                                  "inf); use an earlier checkpoint")
        return tensor

    def _plain(self, name: str) -> torch.Tensor:
        tensor = self.state[name] if isinstance(self.state, dict) else self.state.get_tensor(name)
        return tensor.to(torch.float32)

    def _sharded(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        cols = max(1, math.prod(shape[1:]))
        blocks = []
        for logical, rows in sharded.fused_blocks(name, self.cfg, spec=self.spec):
            block = torch.empty(rows, cols)
            if self.source.read("weight", logical, 0, 0, block) != block.numel():
                raise CheckpointError(f"checkpoint {self.path} is missing parts of {logical}")
            blocks.append(block)
        return torch.cat(blocks).reshape(shape)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.source is not None:
            self.source.close()
        self.state = None
