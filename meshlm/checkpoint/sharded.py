"""Checkpoints that reshard: saved under one layout (tp, pp, dp, ZeRO), loaded under any other.

What is stored is layout-free: *logical tensors* named after the plain model's parameters, with the fused
ones split as the family's `logical_blocks` says (GPT: `attn.qkv` → `attn.q`, `attn.k`, `attn.v`; SwiGLU's
`mlp.fc` → `mlp.gate`, `mlp.up`), the
vocabulary padding dropped, replicated KV heads and the tied embedding stored once. For each one: the
weights and Adam's `exp_avg` / `exp_avg_sq` (Adam's step count is one number for the whole model), or, for
the matrices Muon steps (`optim.name=muon`), its `momentum_buffer`. Every
rank writes the rectangular pieces it owns, each with its offset in the logical tensor, to its own
safetensors file; rank 0 writes `index.json` (the logical shapes, where every piece is, the number of
ranks), then the shared state (`state.pt`: step, data position, layout). The model's persistent buffers (a
sigmoid router's `score_bias`: model state that no optimizer steps) are stored as whole "weight" tensors
under their plain names, written once per pipeline stage (by dp × cp rank 0, tp rank 0: every layout
replicates them over tp, dp, cp and ep); a checkpoint written before buffers were saved still loads, the
buffers keeping their initial values. Loading under any layout, each rank works out
which logical rows and columns each of its local tensors (or ZeRO shards of them) holds and reads exactly
those from the pieces that overlap them (safetensors slices: no whole-file reads).

Why not `torch.distributed.checkpoint` (DCP)? DCP plans the same way (chunks with global offsets, read
by overlap), but describes a rank's part of a tensor by DTensor placements over a mesh. Our parts are
not all placements: a ZeRO shard is a flat range that starts and ends mid-row and crosses parameter
boundaries; a tp rank's qkv rows are three blocks (its q heads, its k heads, its v heads); GQA KV heads
are held by a subset of the tp group; the vocabulary rows are padded. DCP would need a gather over dp
(the memory ZeRO saves) and extra meshes per tensor. Our pieces are plain boxes, a few per tensor and rank.

Publishing is atomic as in `files.py` (which both this module and `single.py` use): everything goes into a temporary directory; every rank
reports success (one all-reduce), and only if all did does rank 0 rename it into place and move
`latest`. A rank that fails or dies leaves `latest` on the previous checkpoint.

Single-process runs keep their one-file format (`model.pt`, `optim.pt`); it loads under any layout too
(converted to logical tensors in memory). `full_model_state` assembles a sharded one into the plain GPT
state dict without torch.distributed; `checkpoint.load_model_state` reads any format through it (for
`meshlm generate` and `meshlm convert --to-single`).
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from meshlm.checkpoint.files import (
    Entry,
    begin_checkpoint,
    checkpoints_dir,
    load_torch,
    non_finite,
    publish_checkpoint,
    save_bytes,
    save_torch,
    state_nbytes,
    step_name,
    write_failure,
)
from meshlm.core.config import ModelConfig
from meshlm.core.errors import CheckpointError, CheckpointWriteError, TrainingError
from meshlm.families.spec import ModelSpec
from meshlm.models.init import meta_device
from meshlm.models.params import param_groups
from meshlm.parallel.tensor_layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

FORMAT = "meshlm-logical-v1"
INDEX = "index.json"
SHARDS = "shards"
ADAM_KINDS = ("exp_avg", "exp_avg_sq")
MUON_KINDS = ("momentum_buffer",)
KINDS = ("weight", *ADAM_KINDS, *MUON_KINDS)


# ---- logical tensors ----------------------------------------------------------------------------------------
def fused_blocks(name: str, cfg: ModelConfig, *, spec: ModelSpec) -> list[tuple[str, int]]:
    """The logical tensors stacked along dim 0 of plain parameter `name`, with their row counts (the
    family's `logical_blocks`; a whole parameter keeps its name and rows). A persistent buffer is one
    whole logical tensor of its own name."""
    buffers = plain_buffer_shapes(cfg, spec=spec)
    if name in buffers:
        return [(name, _rows(buffers[name]))]
    blocks = spec.logical_blocks(name, cfg)
    return [(n, plain_shapes(cfg, spec=spec)[name][0] if rows < 0 else rows) for n, rows in blocks]


@functools.lru_cache(maxsize=8)
def plain_shapes(cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of the plain model's parameters (each tensor once: a tied LM head is `tok_emb.weight`)."""
    from meshlm.parallel.materialize import plain_shapes as shapes

    with torch.random.fork_rng(devices=[]):  # a meta build still draws from the CPU generator: keep it untouched
        return shapes(spec, cfg)


@functools.lru_cache(maxsize=8)
def plain_buffers(cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The plain model's persistent buffers (in its state dict, not parameters: a sigmoid router's
    `score_bias`), by plain name, as meta tensors (shape and dtype); computed ones (RoPE tables) are not
    persistent and not here."""
    with meta_device():
        model = _plain_model(cfg, spec)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in model.state_dict().items() if name not in params}


@functools.lru_cache(maxsize=8)
def plain_buffer_shapes(cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in plain_buffers(cfg, spec=spec).items()}


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def local_buffers(model: nn.Module, cfg: ModelConfig, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The persistent buffers this rank's (possibly pruned, parallelized) model holds, by plain name."""
    plain = plain_buffer_shapes(cfg, spec=spec)
    return {name: b for name, b in model.named_buffers() if name in plain}


def _plain_model(cfg: ModelConfig, spec: ModelSpec) -> nn.Module:
    """The plain model (callers build it on the meta device), the CPU random stream left as it was: a save
    or load must not move the run's dropout masks."""
    with torch.random.fork_rng(devices=[]):
        return spec.model_class(cfg)


def logical_shapes(cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shape in plain_shapes(cfg, spec=spec).items():
        for lname, rows in fused_blocks(name, cfg, spec=spec):
            out[lname] = (rows, *shape[1:])
    return out


def split_plain(state: dict[str, torch.Tensor], cfg: ModelConfig, partial: bool = False, *,
                spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A plain GPT state dict → logical tensors (2-D: rows × the rest); `partial`: of the parameters it has."""
    out = {}
    for name in plain_shapes(cfg, spec=spec):
        if partial and name not in state:
            continue
        t = state[name]
        start = 0
        for lname, n in fused_blocks(name, cfg, spec=spec):
            out[lname] = t[start:start + n].reshape(n, -1)
            start += n
    return out


def fuse_logical(tensors: dict[str, torch.Tensor], cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Logical tensors → a plain GPT state dict (the tied LM head included, as `GPT.state_dict` has it)."""
    out = {}
    for name, shape in plain_shapes(cfg, spec=spec).items():
        parts = [tensors[lname] for lname, _ in fused_blocks(name, cfg, spec=spec)]
        out[name] = torch.cat(parts).reshape(shape)
    with meta_device():  # tied parameters appear under every name in a state dict
        model = _plain_model(cfg, spec)
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name] = out[first[id(p)]]
    return out


# ---- which logical boxes a local tensor holds ----------------------------------------------------------------
@dataclass
class Segment:
    """Local rows [local_row, local_row + rows) ↦ logical `name` rows [row, …), columns [col, col + local cols)."""

    local_row: int
    rows: int
    name: str
    row: int
    col: int
    write: bool  # this rank is the one that writes these rows (replicas are written once)


def param_segments(model: nn.Module, name: str, shape: tuple[int, ...], tp_rank: int,
                   tied_copy: bool = False, *, spec: ModelSpec) -> list[Segment]:
    """How this rank's local parameter `name` (of local `shape`) maps onto logical tensors.

    Tensor-parallel modules say which full rows (column-parallel, vocab-parallel) or columns
    (row-parallel) a rank holds, an expert-parallel slice its experts' rows of the (E, …) stack; the full
    rows are then cut by the fused blocks (q/k/v, gate/up) and padding rows past the vocabulary dropped. Replicated tensors are written by tp rank 0; KV rows
    replicated over several tp ranks by their owner; `tied_copy` (the last pipeline stage's copy of the
    tied embedding) never."""
    cfg = model.cfg
    prefix, attr = name.rsplit(".", 1)
    module = model.get_submodule(prefix)
    rows, col, sharded, skip = shape[0], 0, False, None
    full_rows = list(range(rows))
    if isinstance(module, ColumnParallelLinear):
        full_rows, sharded = module.rows[tp_rank].tolist(), True
        if module.shared_rows is not None and not module._owner:
            skip = set(module.shared_rows[0].tolist())
    elif isinstance(module, VocabParallelEmbedding):
        full_rows, sharded = module.vocab_rows[tp_rank].tolist(), True
    elif isinstance(module, RowParallelLinear) and attr == "weight":
        col, sharded = int(module.cols[tp_rank][0]), True
    elif getattr(getattr(module, attr, None), "expert_rows", None) is not None:  # this rank's experts (ep)
        full_rows = list(range(*getattr(module, attr).expert_rows))
    blocks, start = [], 0
    for lname, n in fused_blocks(name, cfg, spec=spec):
        blocks.append((start, start + n, lname))
        start += n
    base_write = (sharded or tp_rank == 0) and not tied_copy
    segments: list[Segment] = []
    for i, full in enumerate(full_rows):
        block = next((b for b in blocks if b[0] <= full < b[1]), None)
        if block is None:  # vocabulary padding
            continue
        write = base_write and not (skip and i in skip)
        last = segments[-1] if segments else None
        if (last is not None and last.name == block[2] and last.write == write and last.local_row + last.rows == i
                and last.row + last.rows == full - block[0]):
            last.rows += 1
        else:
            segments.append(Segment(i, 1, block[2], full - block[0], col, write))
    return segments


def pieces(segments: list[Segment], shape: tuple[int, ...], lo: int, hi: int):
    """The flat range [lo, hi) of a local tensor, cut into boxes that are contiguous in it.

    Yields (segment, (logical row, logical col, rows, cols), offset of the box in the range)."""
    cols = 1
    for s in shape[1:]:
        cols *= s
    for seg in segments:
        a, b = max(lo, seg.local_row * cols), min(hi, (seg.local_row + seg.rows) * cols)
        if a >= b:
            continue
        (ra, ca), (rb, cb) = divmod(a, cols), divmod(b, cols)
        boxes = []
        if ra == rb:
            boxes.append((ra, 1, ca, cb))
        else:
            if ca:
                boxes.append((ra, 1, ca, cols))
                ra += 1
            if rb > ra:
                boxes.append((ra, rb - ra, 0, cols))
            if cb:
                boxes.append((rb, 1, 0, cb))
        for r, n, c0, c1 in boxes:
            yield seg, (seg.row + r - seg.local_row, seg.col + c0, n, c1 - c0), r * cols + c0 - lo


def _segments_for(sync, owned, spec: ModelSpec) -> list[Segment]:
    pipe = sync.pipe
    tied_copy = (pipe is not None and pipe.tied_weight is not None and owned.name == pipe.tied_names[0]
                 and not pipe.has_first)  # the last stage's copy: the first stage writes the embedding
    return param_segments(sync.model, owned.name, owned.shape, sync.dims.tp_rank, tied_copy, spec=spec)


# ---- saving -----------------------------------------------------------------------------------------------
def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().clone()


def _rank_pieces(sync, optimizer, spec: ModelSpec, copy=None) -> tuple[dict[str, torch.Tensor], list[list]]:
    """This rank's pieces: tensors for its safetensors file (copies in host memory, by `copy`) and their
    index entries."""
    copy = copy or _host_copy
    tensors, entries = {}, []
    for owned in sync.save_ranges():
        state = optimizer.state.get(owned.opt_key, {})
        flats = {"weight": owned.weight}
        flats.update({k: owned.opt_flat(state[k]) for k in (*ADAM_KINDS, *MUON_KINDS) if k in state})
        for seg, (row, col, n, w), off in pieces(_segments_for(sync, owned, spec), owned.shape, owned.lo, owned.hi):
            if not seg.write:
                continue
            for kind, flat in flats.items():
                key = f"{kind}/{seg.name}/{row}/{col}"
                piece = flat[off:off + n * w].detach().reshape(n, w)
                tensors[key] = copy(piece.to(torch.promote_types(piece.dtype, torch.float32)))  # fp32/f64
                entries.append([key, kind, seg.name, row, col, n, w])
    _buffer_pieces(sync, spec, copy, tensors, entries)
    return tensors, entries


def _buffer_pieces(sync, spec: ModelSpec, copy, tensors: dict, entries: list) -> None:
    """This stage's persistent buffers, whole, written by dp × cp rank 0 and tp rank 0 only: no layout splits
    them (the family's tp plan names no buffer; a MoE layer's router is whole on every ep rank, its bias
    updated alike on all of them from the global load: `MoE.update_bias`)."""
    d = sync.dims
    if d.dpcp_rank != 0 or d.tp_rank != 0:
        return
    for name, buf in local_buffers(sync.model, sync.model.cfg, spec).items():
        key = f"weight/{name}/0/0"
        flat = buf.detach().reshape(_rows(tuple(buf.shape)), -1)
        tensors[key] = copy(flat.to(torch.promote_types(flat.dtype, torch.float32)))
        entries.append([key, "weight", name, 0, 0, *flat.shape])


def _adam_step(optimizer) -> float | None:
    steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's parameters have different step counts {sorted(steps)}")
    return steps.pop() if steps else None


def _write_rank(tmp: Path, rank: int, tensors: dict[str, torch.Tensor], rank_state: dict,
                layout: dict | None) -> dict[str, Entry]:
    """This rank's two files (its pieces, its random streams); their manifest entries."""
    from safetensors.torch import save as to_bytes

    bad = non_finite({k: v for k, v in tensors.items() if k.startswith("weight/")})
    if bad:
        raise TrainingError(f"refusing to save: the model's weights hold NaN or inf ({bad[0].split('/')[1]}); the "
                            "previous checkpoint is kept. Lower optim.lr or raise optim.warmup_steps")
    (tmp / SHARDS).mkdir(exist_ok=True)
    name = f"rank{rank:05d}"
    return {f"{SHARDS}/{name}.safetensors": save_bytes(to_bytes(tensors), tmp / SHARDS / f"{name}.safetensors"),
            f"{SHARDS}/{name}.pt": save_torch({"rank_state": rank_state, "layout": layout},
                                                         tmp / SHARDS / f"{name}.pt")}


def save(out_dir: str | Path, step: int, sync, optimizer, state: dict, config: dict, rank_state: dict, *,
         spec: ModelSpec) -> Path:
    """Write this layout's checkpoint of step `step` and publish it as `latest` (a collective).

    `state` (rank 0's): step, data position, layout, …; `rank_state`: this rank's random streams; `spec`: the
    model's family (how its fused tensors split). No rank publishes unless every rank wrote its files; a
    failed write removes the temporary directory."""
    pending = begin(out_dir, step, sync, optimizer, state, config, rank_state, spec=spec)
    pending.write()
    return pending.finish()


@dataclass
class PendingSave:
    """One rank's part of a checkpoint between `begin` and `finish`: its pieces copied to host memory, the
    temporary directory every rank writes into, and, once `write` ran, its files' entries or its error.
    `write` uses no collective (a background thread may run it: `checkpoint/background.py`); `begin` and
    `finish` are collectives, called by every rank's main thread at the same point of the run."""

    out_dir: Path
    step: int
    sync: Any
    tmp: Path
    state: dict
    config: dict
    rank_state: dict
    tensors: dict
    entries: list
    adam_step: float | None
    shapes: dict  # the logical tensors' shapes, for the index
    error: BaseException | None = None
    files: dict | None = None

    def write(self) -> None:
        """This rank's two files into the temporary directory (no collective); an error is kept for `finish`."""
        if self.error is not None:
            return
        try:
            self.files = _write_rank(self.tmp, self.sync.dims.rank, self.tensors, self.rank_state,
                                     self.state.get("layout"))
        except Exception as err:  # noqa: BLE001 (any failure: every rank must hear of it before anyone publishes)
            self.error = err

    def finish(self) -> Path:
        """Every rank says whether it wrote its part (one all-reduce); if all did, rank 0 writes the index,
        the shared state and the manifest and publishes; then a barrier. Else each rank raises the error."""
        d = self.sync.dims
        world = d.world_size > 1
        ok = torch.tensor([0 if self.error else 1], dtype=torch.int32, device=d.device)
        if world:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            _fail(self.error, self.tmp, self.step, d.is_main, state_nbytes(self.tensors))
        mine = (d.rank, self.entries, self.adam_step, self.files)
        gathered = [None] * d.world_size if d.is_main else None
        if world:
            dist.gather_object(mine, gathered, dst=0)
        else:
            gathered = [mine]
        self.tensors = {}  # written: the host copy is no longer needed
        path = checkpoints_dir(self.out_dir) / step_name(self.step)
        if d.is_main:
            path = _publish(self.out_dir, self.step, self.tmp, self.shapes, self.state, self.config, gathered)
        if world:
            dist.barrier()
        return path


def begin(out_dir: str | Path, step: int, sync, optimizer, state: dict, config: dict, rank_state: dict,
          copy=None, *, spec: ModelSpec) -> PendingSave:
    """Start step `step`'s checkpoint (a collective): rank 0 makes the temporary directory and tells every
    rank; this rank's pieces are copied off the training tensors (`copy(tensor)`: to host memory; default a
    plain CPU copy). A failure here is kept for `finish`, which every rank reaches."""
    d = sync.dims
    box = [str(begin_checkpoint(out_dir, step)) if d.is_main else None]
    if d.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    pending = PendingSave(Path(out_dir), step, sync, Path(box[0]), state, config, rank_state, {}, [], None,
                          logical_shapes(sync.model.cfg, spec=spec))
    try:
        pending.tensors, pending.entries = _rank_pieces(sync, optimizer, spec, copy)
    except Exception as err:  # noqa: BLE001 (reported by every rank in `finish`)
        pending.error = err
    pending.adam_step = _adam_step(optimizer)
    return pending


def _fail(error: BaseException | None, tmp: Path, step: int, main: bool, need_bytes: int) -> NoReturn:
    """Every rank got here (no one publishes): rank 0 removes the temporary directory; each raises."""
    if isinstance(error, (TrainingError, CheckpointError)):
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error
    if error is not None:
        raise write_failure(error, tmp, step, need_bytes) from error
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointWriteError(f"another rank failed to write its part of step {step}'s checkpoint; nothing was "
                               "published, the previous checkpoints are intact")


def _publish(out_dir, step: int, tmp: Path, shapes: dict, state: dict, config: dict, gathered: list) -> Path:
    """Rank 0: the index of every rank's pieces, the shared state, the manifest; then the rename."""
    steps = {s for _, _, s, _ in gathered if s is not None}
    index = {"format": FORMAT, "shapes": shapes, "ranks": len(gathered),
             "adam_step": steps.pop() if steps else None,
             "chunks": [[f"rank{r:05d}.safetensors", *e] for r, es, _, _ in gathered for e in es]}
    files = {k: v for _, _, _, fs in gathered for k, v in fs.items()}
    try:
        files[INDEX] = save_bytes(json.dumps(index).encode(), tmp / INDEX)
        files["state.pt"] = save_torch(state, tmp / "state.pt")
        return publish_checkpoint(out_dir, step, tmp, config, files)
    except (OSError, RuntimeError) as err:
        if not tmp.exists():
            raise
        raise write_failure(err, tmp, step, state_nbytes(state)) from err


# ---- sources of logical tensors ---------------------------------------------------------------------------
class _ShardedSource:
    """The pieces of a sharded checkpoint, read by overlap (lazily, through safetensors slices)."""

    def __init__(self, path: Path):
        self.dir = path / SHARDS
        index = json.loads((path / INDEX).read_text())
        if index.get("format") != FORMAT:
            raise CheckpointError(f"{path} has checkpoint format {index.get('format')!r}, not {FORMAT!r}")
        self.shapes = {k: tuple(v) for k, v in index["shapes"].items()}
        self.adam_step = index["adam_step"]
        self.chunks: dict[tuple[str, str], list] = {}
        for file, key, kind, name, row, col, n, w in index["chunks"]:
            self.chunks.setdefault((kind, name), []).append((file, key, row, col, n, w))
        self._files: dict[str, Any] = {}

    def read(self, kind: str, name: str, row: int, col: int, out: torch.Tensor) -> int:
        """Copy logical[row:row+n, col:col+w] into `out` (n, w) from every overlapping piece; returns the
        number of elements found."""
        from safetensors import safe_open

        n, w = out.shape
        found = 0
        for file, key, r, c, pn, pw in self.chunks.get((kind, name), ()):
            r0, r1, c0, c1 = max(row, r), min(row + n, r + pn), max(col, c), min(col + w, c + pw)
            if r0 >= r1 or c0 >= c1:
                continue
            if file not in self._files:
                self._files[file] = safe_open(str(self.dir / file), framework="pt")
            part = self._files[file].get_slice(key)[r0 - r:r1 - r, c0 - c:c1 - c]
            out[r0 - row:r1 - row, c0 - col:c1 - col] = part.to(out.dtype)
            found += (r1 - r0) * (c1 - c0)
        return found

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.chunks

    def has_kind(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.chunks)

    def close(self) -> None:
        self._files.clear()


class _TensorSource:
    """Logical tensors in memory (a single-process checkpoint, converted)."""

    def __init__(self, tensors: dict[tuple[str, str], torch.Tensor], adam_step: float | None, shapes):
        self.tensors, self.adam_step, self.shapes = tensors, adam_step, shapes

    def read(self, kind: str, name: str, row: int, col: int, out: torch.Tensor) -> int:
        t = self.tensors.get((kind, name))
        if t is None:
            return 0
        n, w = out.shape
        out.copy_(t[row:row + n, col:col + w])
        return out.numel()

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.tensors

    def has_kind(self, kind: str) -> bool:
        return any(k == kind for k, _ in self.tensors)

    def close(self) -> None:
        pass


# ---- which optimizer a checkpoint's state is for ------------------------------------------------------------
def saved_muon(optim_state: dict) -> bool:
    """Whether an `optimizer.state_dict()` (a one-process `optim.pt`, or a live optimizer's) is
    `optim.name=muon`'s: param groups marked `"muon"`, where Muon keeps its one buffer."""
    return any(g.get("muon") for g in optim_state.get("param_groups", ()))


def steps_muon(optimizer) -> bool:
    return saved_muon({"param_groups": optimizer.param_groups})


def check_same_optimizer(path: Path, trained_muon: bool, optimizer) -> None:
    """CheckpointError (before anything is loaded) when checkpoint `path`'s optimizer state, Muon's momentum
    buffers or Adam's moments on the hidden matrices (`trained_muon`, from what the checkpoint holds), is
    not what `optimizer` keeps: switching `optim.name` between muon and another optimizer cannot resume."""
    if trained_muon == steps_muon(optimizer):
        return
    from meshlm.checkpoint.files import load_config_dict

    try:
        named = load_config_dict(path).get("optim", {}).get("name", "adamw")
    except CheckpointError:
        named = None
    trained = named if named and (named == "muon") == trained_muon else ("muon" if trained_muon else "adamw")
    asked = "muon" if steps_muon(optimizer) else getattr(optimizer, "config_name", "adamw")
    held = "Muon's momentum buffers" if trained_muon else "Adam's two moments"
    raise CheckpointError(
        f"checkpoint {path} was trained with optim.name={trained} but this run asks for optim.name={asked}: its "
        f"optimizer state ({held} for the hidden layers' matrices) cannot continue under another optimizer. "
        f"Resume with --optim.name={trained}, or start a new run from its weights alone (the optimizer starts "
        f"fresh) with --optim.name={asked} --train.init_from={path} and another train.out_dir")


def _single_process_source(path: Path, cfg: ModelConfig, spec: ModelSpec) -> _TensorSource:
    """`model.pt` + `optim.pt` of a one-process run → logical tensors (its AdamW's state, by parameter; with
    `optim.name=muon`, Muon's buffer for the matrices it steps: param groups marked `"muon"` in `optim.pt`)."""
    plain = load_torch(path / "model.pt")
    tensors = {("weight", k): v for k, v in split_plain(plain, cfg, spec=spec).items()}
    tensors.update({("weight", k): plain[k].reshape(_rows(shape), -1)
                    for k, shape in plain_buffer_shapes(cfg, spec=spec).items() if k in plain})
    adam_step = None
    if (path / "optim.pt").exists():
        optim = load_torch(path / "optim.pt")
        with meta_device():
            model = _plain_model(cfg, spec)
        names = {id(p): n for n, p in model.named_parameters()}
        muon = saved_muon(optim)  # what the state itself is, not what config.json says
        order = [names[id(p)] for g in param_groups(model, 0.0, muon) for p in g["params"]]
        per_kind: dict[str, dict[str, torch.Tensor]] = {k: {} for k in (*ADAM_KINDS, *MUON_KINDS)}
        for i, st in optim["state"].items():
            if "step" in st:
                adam_step = float(st["step"])
            for kind, plain in per_kind.items():
                if kind in st:
                    plain[order[i]] = st[kind]
        for kind, plain in per_kind.items():
            if len(plain) == len(order) or (muon and plain):
                tensors.update({(kind, k): v for k, v in split_plain(plain, cfg, partial=muon, spec=spec).items()})
    return _TensorSource(tensors, adam_step, logical_shapes(cfg, spec=spec))


def open_source(path: Path, cfg: ModelConfig, *, spec: ModelSpec):
    """The logical tensors of checkpoint `path` (of a model `cfg` of family `spec`), whichever format it has."""
    if (path / INDEX).exists():
        return _ShardedSource(path)
    if not (path / "model.pt").exists() or any(path.glob("rank*.pt")):
        raise CheckpointError(f"{path} was written by an earlier parallel meshlm whose checkpoints cannot be "
                                   "resumed (`meshlm generate` still reads its weights); train.resume=never starts over")
    return _single_process_source(path, cfg, spec)


def is_sharded(path: Path) -> bool:
    return (Path(path) / INDEX).exists()


# ---- loading ------------------------------------------------------------------------------------------------
def _fill(source, kind: str, sync, owned, flat: torch.Tensor, spec: ModelSpec) -> None:
    want = 0
    got = 0
    for seg, (row, col, n, w), off in pieces(_segments_for(sync, owned, spec), owned.shape, owned.lo, owned.hi):
        out = flat[off:off + n * w].view(n, w)
        want += n * w
        got += source.read(kind, seg.name, row, col, out)
    if got != want:
        raise CheckpointError(f"the checkpoint holds {got} of the {want} {kind} values this rank needs for "
                                   f"{owned.name}; it is incomplete or from another model shape")


def _load_buffers(source, path: Path, model: nn.Module, spec: ModelSpec, log=None) -> None:
    """This rank's persistent buffers from `source`, where it holds them. A checkpoint that holds none (saved
    before sharded checkpoints kept buffers) leaves them at their initial values, said once to `log`; one
    holding only some of them is incomplete."""
    cfg = model.cfg
    plain = plain_buffer_shapes(cfg, spec=spec)
    if not any(source.has("weight", name) for name in plain):
        if plain and log is not None:
            log(f"checkpoint {path} holds no buffers (it predates their saving): {', '.join(sorted(plain))} "
                "keep their initial values")
        return
    for name, buf in local_buffers(model, cfg, spec).items():
        rows = _rows(tuple(buf.shape))
        out = torch.empty(rows, max(1, buf.numel() // rows), dtype=torch.float64)
        if source.read("weight", name, 0, 0, out) != out.numel():
            raise CheckpointError(f"checkpoint {path} is missing the buffer {name}; it is incomplete")
        buf.copy_(out.reshape(buf.shape))


@torch.no_grad()
def load(path: str | Path, sync, optimizer, *, spec: ModelSpec, log=None) -> None:
    """Load weights, persistent buffers and Adam's state from a checkpoint of any layout into this rank's
    part of the model (of family `spec`); `log` hears, once, that an old checkpoint holds no buffers.

    Call after every parallel transform and after building the optimizer (`sync.build_optimizer`)."""
    path = Path(path)
    cfg = sync.model.cfg
    source = open_source(path, cfg, spec=spec)
    if source.shapes != logical_shapes(cfg, spec=spec):
        raise CheckpointError(f"checkpoint {path} was saved for a model of another shape; set the model.* "
                                   "keys as in its config.json")
    has_state = source.adam_step is not None or source.has_kind(MUON_KINDS[0])
    if has_state:
        check_same_optimizer(path, source.has_kind(MUON_KINDS[0]), optimizer)
    try:
        for owned in sync.load_weight_ranges():
            _fill(source, "weight", sync, owned, owned.weight, spec)
        _load_buffers(source, path, sync.model, spec, log)
        if not has_state:
            return
        for owned in sync.load_state_ranges():
            st = optimizer.state[owned.opt_key]
            names = {seg.name for seg in _segments_for(sync, owned, spec)}
            muon = all(source.has(MUON_KINDS[0], n) for n in names)  # Muon's buffer, else Adam's moments
            if not muon:
                st["step"] = torch.tensor(source.adam_step, dtype=torch.float32)
            for kind in MUON_KINDS if muon else ADAM_KINDS:
                st[kind] = torch.zeros_like(owned.opt_key, memory_format=torch.preserve_format)
                _fill(source, kind, sync, owned, owned.opt_flat(st[kind]), spec)
    finally:
        source.close()


@torch.no_grad()
def load_matching_weights(path: str | Path, sync, source_cfg: ModelConfig, *, spec: ModelSpec) -> list[str]:
    """Initialise this rank's part of the model from the weights of checkpoint `path` (any layout) of a
    model `source_cfg` that may differ in its heads (a pretrained BERT → a classifier): every parameter
    whose logical tensors the checkpoint holds with the same shapes is read, the others keep their seeded
    initialisation (`spec`: the family of both). No optimizer state is read. Returns the logical tensors this model has that the
    checkpoint lacks (on every rank alike: from the shapes, not from what this rank holds)."""
    path = Path(path)
    source = open_source(path, source_cfg, spec=spec)
    mine = logical_shapes(sync.model.cfg, spec=spec)
    usable = {n for n, shape in mine.items() if source.shapes.get(n) == shape}
    try:
        for owned in sync.load_weight_ranges():
            if all(seg.name in usable for seg in _segments_for(sync, owned, spec)):
                _fill(source, "weight", sync, owned, owned.weight, spec)
        if plain_buffer_shapes(source_cfg, spec=spec) == plain_buffer_shapes(sync.model.cfg, spec=spec):
            _load_buffers(source, path, sync.model, spec)  # the same buffers (a classifier head adds none)
    finally:
        source.close()
    return sorted(set(mine) - usable)


def load_rank_state(path: str | Path, rank: int, layout: dict) -> dict | None:
    """This rank's random-stream state, if `path` was saved under exactly `layout` (else None)."""
    part = Path(path) / SHARDS / f"rank{rank:05d}.pt"
    if not part.exists():
        return None
    saved = load_torch(part)
    return saved["rank_state"] if saved.get("layout") == layout else None


def full_model_state(path: str | Path, cfg: ModelConfig, *, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The plain GPT state dict of a sharded checkpoint (`index.json`), in one process, without
    torch.distributed: its parameters and the persistent buffers it holds (none, if it predates them)."""
    source = _ShardedSource(path)
    try:
        tensors = {}
        for name, shape in source.shapes.items():
            rows = shape[0]
            t = torch.zeros(rows, max(1, torch.Size(shape[1:]).numel()))
            if source.read("weight", name, 0, 0, t) != t.numel():
                raise CheckpointError(f"checkpoint {path} is missing parts of {name}")
            tensors[name] = t
        buffers = {}
        for name, meta in plain_buffers(cfg, spec=spec).items():
            t = torch.zeros(_rows(tuple(meta.shape)), max(1, torch.Size(meta.shape[1:]).numel()), dtype=meta.dtype)
            if source.read("weight", name, 0, 0, t) == t.numel():  # absent: an old checkpoint (`load_model`)
                buffers[name] = t.reshape(meta.shape)
    finally:
        source.close()
    return {**fuse_logical(tensors, cfg, spec=spec), **buffers}
